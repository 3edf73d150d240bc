"""Fira as a host of MoARa: Adam in the subspace plus a norm-scaled full-rank residual.

Fira (Chen et al., https://arxiv.org/abs/2410.01623) keeps GaLore's low-rank Adam state and adds
the part of the gradient the projection drops, scaled per row by how much Adam changed the
low-rank gradient's norm. For one target matrix ``G`` (paper orientation), with ``R = P^T G`` the
low-rank gradient and ``N = m / (sqrt(v) + eps)`` its Adam-normalised value (no bias correction):

- ``phi = ||N||_r / (||R||_r + 1e-8)``, norms over the rank axis (one factor per row of the
  non-projected side),
- ``S = (G - scale * P R) * phi``,
- the norm-growth limiter: from the second step on, ``S`` is divided by
  ``max(||S|| / (||S_prev|| + 1e-8), gamma) / gamma`` (``gamma = 1.01``), and ``||S_prev||`` is
  the norm of the ``S`` actually used,
- the step is ``step_size * (scale * P N + S)``, ``step_size = sqrt(1 - b2**t) / (1 - b1**t)``.

This is the reference package's ``fira.FiraAdamW`` (tested against it). As a MoARa host,
``decompose`` runs first and Fira works on the block direction ``V`` in place of ``G``: the
residual is that of the direction, and ``recompose`` multiplies ``scale * P N + S`` by the
repeated block magnitudes' Adam step. Rank allocation only changes each module's ``r``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moara_jax._adam import InnerAdamState, inner_adam
from moara_jax._nodes import Decomposed, LowRank, is_node
from moara_jax._projection import matrix_of, project, project_back
from moara_jax._validate import number
from moara_jax.hosts._base import Host, StageOptions, real_number

# Fira's constants: the norm-growth limit and the stabiliser of its two norm ratios.
DEFAULT_GROWTH_LIMIT = 1.01
_NORM_EPS = 1e-8


class FiraState(NamedTuple):
    """State of :func:`fira_adam`."""

    inner: InnerAdamState  # the moments (direction, magnitude and plain), as ``inner_adam``.
    residual_norm: Any  # per projected leaf, float32 of its batch shape: ||S|| of the last step.


def _with_core(u: Any, core: Any) -> Any:
    return u.replace(direction=core) if isinstance(u, Decomposed) else core


def _residual_norm_init(path, u) -> jax.Array | None:
    core = matrix_of(u)
    if not isinstance(core, LowRank):
        return None
    if core.projected is None:
        raise ValueError(
            f"fira_adam: the low-rank value at {jax.tree_util.keystr(path)} carries no projected "
            "matrix; place fira_adam after project(..., keep_projected=True)"
        )
    return jnp.zeros(core.value.shape[:-2], jnp.float32)


def _norm(x: jax.Array, axis) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=axis, keepdims=True))


def fira_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    *,
    scale: float = 0.25,
    growth_limit: float = DEFAULT_GROWTH_LIMIT,
    mu_dtype: Any = None,
    mag_dtype: Any = "float32",
) -> optax.GradientTransformation:
    """:func:`inner_adam` plus Fira's norm-scaled, growth-limited full-rank residual.

    Takes the output of ``project(..., keep_projected=True)`` (optionally inside ``Decomposed``
    nodes) and emits what ``inner_adam`` emits, each :class:`LowRank` also carrying
    ``residual = step_size * S`` (see the module docstring), which ``recompose`` adds after the
    back-projection. ``scale`` must be the ``recompose`` scale (Fira's ``alpha``). Leaves that are
    not projected get plain Adam.

    Args:
      b1, b2, eps, mu_dtype, mag_dtype: as :func:`inner_adam`.
      scale: GaLore's scale, used in the residual ``G - scale * P P^T G`` as Fira does.
      growth_limit: Fira's ``gamma``: the most ``||S||`` may grow from one step to the next.

    Returns:
      An ``optax.GradientTransformation`` with :class:`FiraState`.
    """
    if number(growth_limit) and not growth_limit > 0:  # NaN too (inf: no limit)
        raise ValueError(f"growth_limit must be positive, got {growth_limit!r}")
    inner = inner_adam(b1, b2, eps, mu_dtype=mu_dtype, mag_dtype=mag_dtype)

    def init_fn(params):
        norms = jax.tree_util.tree_map_with_path(_residual_norm_init, params, is_leaf=is_node)
        return FiraState(inner=inner.init(params), residual_norm=norms)

    def update_fn(updates, state, params=None):
        out, inner_state = inner.update(updates, state.inner, params)
        t = inner_state.count.astype(jnp.float32)
        step_size = jnp.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        first = state.inner.count == 0
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_node)
        results = treedef.flatten_up_to(out)
        prevs = treedef.flatten_up_to(state.residual_norm)
        new_out, new_norms = [], []
        for u, o, prev in zip(leaves, results, prevs, strict=True):
            low_in, low_out = matrix_of(u), matrix_of(o)
            if not isinstance(low_in, LowRank):
                new_out.append(o)
                new_norms.append(prev)
                continue
            rank_axis = -2 if low_in.side == "in" else -1
            # ||N|| = ||step_size * N|| / step_size: inner_adam's output has the step size folded in.
            phi = _norm(low_out.value, rank_axis) / (step_size * (_norm(low_in.value, rank_axis) + _NORM_EPS))
            dropped = low_in.projected.astype(jnp.float32) - scale * project_back(
                low_in.value, low_in.basis, low_in.side
            )
            residual = dropped * phi
            norm = jnp.sqrt(jnp.sum(jnp.square(residual), axis=(-2, -1)))
            limiter = jnp.maximum(norm / (prev + _NORM_EPS), growth_limit) / growth_limit
            limiter = jnp.where(first, 1.0, limiter)
            residual = residual / limiter[..., None, None]
            core = LowRank(
                low_out.value,
                low_out.basis,
                low_out.side,
                residual=(step_size * residual).astype(low_in.projected.dtype),
            )
            new_out.append(_with_core(o, core))
            new_norms.append(norm / limiter)
        new_state = FiraState(inner=inner_state, residual_norm=treedef.unflatten(new_norms))
        return treedef.unflatten(new_out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class Fira(Host):
    """Fira (Chen et al., https://arxiv.org/abs/2410.01623): GaLore plus the dropped part of the
    gradient, scaled per row by Adam's norm ratio, its norm growth limited to ``growth_limit``
    per step (``fira.FiraAdamW``; :func:`moara_jax.fira_adam`)."""

    name: ClassVar[str] = "fira"
    proj_types: ClassVar[tuple[str, ...] | None] = None

    growth_limit: float = DEFAULT_GROWTH_LIMIT

    def __post_init__(self):
        if not (real_number(self.growth_limit) and self.growth_limit > 0):
            raise ValueError(f"growth_limit must be positive, got {self.growth_limit!r}")

    def stages(self, o: StageOptions):
        projection = project(o.rank, o.update_proj_gap, o.proj_type, keep_projected=True, **o.basis)
        return projection, fira_stage(o, self.growth_limit)


def fira_stage(o: StageOptions, growth_limit: float) -> optax.GradientTransformation:
    """:func:`fira_adam` with the options of a host's stages (Fira's, SubTrack++'s)."""
    return fira_adam(
        o.b1,
        o.b2,
        o.eps,
        scale=o.scale,
        growth_limit=growth_limit,
        mu_dtype=o.mu_dtype,
        mag_dtype=o.mag_dtype,
    )
