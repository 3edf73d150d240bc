"""Optimizer-state accounting by component, from the real state pytree.

Works on concrete states and on ``jax.eval_shape(tx.init, params)`` (``ShapeDtypeStruct`` leaves),
so a 7B configuration is accounted without allocating it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from moara_jax._adam import InnerAdamState
from moara_jax._osd import OSDProjectState
from moara_jax._projection import ProjectState
from moara_jax._qgalore import QGaLoreProjectState

COMPONENTS = ("direction_moments", "magnitude_moments", "projection_bases", "adam_moments", "basis_moments")
# Projection states: their ``basis`` counts as projection_bases.
_PROJECT_STATES = (ProjectState, QGaLoreProjectState, OSDProjectState)
_INNER_FIELDS = {
    "mu": "adam_moments",
    "nu": "adam_moments",
    "dir_mu": "direction_moments",
    "dir_nu": "direction_moments",
    "mag_mu": "magnitude_moments",
    "mag_nu": "magnitude_moments",
}


def _nbytes(tree: Any) -> int:
    return sum(
        int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


def _is_state(x: Any) -> bool:
    return isinstance(x, (InnerAdamState, *_PROJECT_STATES))


def state_bytes(opt_state: Any) -> dict[str, int]:
    """Bytes of an optimizer state, split by component.

    Returns a dict with ``direction_moments`` (Adam moments of projected low-rank values),
    ``magnitude_moments`` (Adam moments of block magnitudes), ``projection_bases`` (GaLore's ``P``;
    Q-GaLore's quantized codes, scales and zero points),
    ``adam_moments`` (moments of non-target parameters, or of any unprojected leaf),
    ``basis_moments`` (the AdamW moments of OSD's bases), ``other``
    (counters and the states of other transforms), ``moments`` (the three moment groups: the
    paper's "Opt. state", which does not count bases) and ``total`` (everything).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from moara_jax import moara_adamw
      >>> params = {"q_proj": {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)}}
      >>> tx = moara_adamw(1e-3, r_base=16, block_size=32, rank_allocation=False)
      >>> state_bytes(jax.eval_shape(tx.init, params))["direction_moments"]
      4096
    """
    out = dict.fromkeys(COMPONENTS, 0)
    rest = 0
    for node in jax.tree.leaves(opt_state, is_leaf=_is_state):
        if isinstance(node, InnerAdamState):
            for field, component in _INNER_FIELDS.items():
                out[component] += _nbytes(getattr(node, field))
            rest += _nbytes(node.count)
        elif isinstance(node, _PROJECT_STATES):
            # A quantized basis counts its codes, scales and zero points; OSD's basis has AdamW
            # moments of its own; Q-GaLore's refresh schedule (intervals, cosines, first vectors)
            # goes to ``other``.
            out["projection_bases"] += _nbytes(node.basis)
            moments = (node.basis_mu, node.basis_nu) if isinstance(node, OSDProjectState) else ()
            out["basis_moments"] += _nbytes(moments)
            rest += _nbytes(node) - _nbytes(node.basis) - _nbytes(moments)
        else:
            rest += _nbytes(node)
    out["other"] = rest
    out["moments"] = out["direction_moments"] + out["magnitude_moments"] + out["adam_moments"]
    out["total"] = out["moments"] + out["projection_bases"] + out["basis_moments"] + rest
    return out
