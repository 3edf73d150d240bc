"""GaLore (Zhao et al., https://arxiv.org/abs/2403.03507), the default host: an SVD basis every
``T`` steps (:func:`moara_jax.project`) and Adam in the subspace (:func:`moara_jax.inner_adam`),
galore-torch's ``GaLoreAdamW``."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from moara_jax._adam import inner_adam
from moara_jax._projection import project
from moara_jax.hosts._base import Host, StageOptions


@dataclasses.dataclass(frozen=True)
class GaLore(Host):
    """GaLore (Zhao et al., https://arxiv.org/abs/2403.03507): SVD basis every ``T`` steps, Adam
    in the subspace (galore-torch's ``GaLoreAdamW``). The default host."""

    name: ClassVar[str] = "galore"
    proj_types: ClassVar[tuple[str, ...] | None] = None

    def stages(self, o: StageOptions):
        projection = project(o.rank, o.update_proj_gap, o.proj_type, **o.basis)
        return projection, inner_adam(o.b1, o.b2, o.eps, mu_dtype=o.mu_dtype, mag_dtype=o.mag_dtype)
