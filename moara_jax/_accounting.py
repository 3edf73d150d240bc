"""Optimizer-state accounting by component, from the real state pytree.

Works on concrete states and on ``jax.eval_shape(tx.init, params)`` (``ShapeDtypeStruct`` leaves),
so a 7B configuration is accounted without allocating it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from moara_jax._adam import InnerAdamState
from moara_jax._projection import ProjectState
from moara_jax.hosts import defined_hosts

COMPONENTS = (
    "direction_moments",
    "magnitude_moments",
    "projection_bases",
    "adam_moments",
    "basis_moments",
    "error_feedback",
)
# The states whose fields are sorted by component (by field name): the core's, and those each
# host defined declares (``Host.state_types``, registered or not); anything else is ``other``.
_CORE_STATES = (InnerAdamState, ProjectState)
_FIELDS = {
    "mu": "adam_moments",
    "nu": "adam_moments",
    "dir_mu": "direction_moments",
    "dir_nu": "direction_moments",
    "mag_mu": "magnitude_moments",
    "mag_nu": "magnitude_moments",
    # A quantized basis counts its codes, scales and zero points.
    "basis": "projection_bases",
    "initial_basis": "projection_bases",
    "basis_mu": "basis_moments",
    "basis_nu": "basis_moments",
    "error": "error_feedback",
}


def _nbytes(tree: Any) -> int:
    return sum(
        int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


def _states() -> tuple[type, ...]:
    return _CORE_STATES + tuple(t for host in defined_hosts() for t in host.state_types)


def _fields(node: Any, states: tuple[type, ...], field_sets: set[frozenset]) -> dict[str, Any] | None:
    """The fields of a known state: the ``NamedTuple`` itself, or a mapping with exactly its field
    names as keys (what a ``NamedTuple`` becomes in Flax nnx's ``nnx.state(optimizer)``)."""
    if isinstance(node, states):
        return node._asdict()
    if isinstance(node, Mapping) and frozenset(node) in field_sets:
        return dict(node)
    return None


def state_bytes(opt_state: Any) -> dict[str, int]:
    """Bytes of an optimizer state, split by component.

    The fields of :class:`InnerAdamState`, :class:`ProjectState` and the hosts' state types
    (``Host.state_types``) are sorted by field name; every other array is ``other``. Each array
    counts its size times its dtype's item size.

    Args:
      opt_state: a concrete state, ``jax.eval_shape(tx.init, params)`` (the route for a model too
        large to allocate), Flax nnx's ``optimizer.opt_state``, or the optimizer's part of
        ``nnx.state(optimizer)`` (where each state ``NamedTuple`` has become a mapping of its
        field names: such a mapping is matched by its keys).

    Returns:
      A dict of byte counts (``int``) with ``direction_moments`` (Adam moments of projected
      low-rank values), ``magnitude_moments`` (Adam moments of block magnitudes),
      ``projection_bases`` (GaLore's ``P``; Q-GaLore's quantized codes, scales and zero points;
      SubTrack++'s initial basis too), ``adam_moments`` (moments of non-target parameters, or of
      any unprojected leaf), ``basis_moments`` (the AdamW moments of OSD's bases),
      ``error_feedback`` (LDAdam's buffers of what the projection dropped), ``other`` (counters,
      Q-GaLore's refresh schedule and the states of other transforms), ``moments`` (the three
      moment groups ``direction_moments + magnitude_moments + adam_moments``: the paper's "Opt.
      state", which does not count bases nor ``basis_moments``) and ``total`` (everything).

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
    states = _states()
    field_sets = {frozenset(t._fields) for t in states}
    known = lambda x: _fields(x, states, field_sets) is not None  # noqa: E731
    for node in jax.tree.leaves(opt_state, is_leaf=known):
        fields = _fields(node, states, field_sets)
        if fields is None:
            rest += _nbytes(node)
            continue
        for field, value in fields.items():
            if field in _FIELDS:
                out[_FIELDS[field]] += _nbytes(value)
            else:
                rest += _nbytes(value)
    out["other"] = rest
    out["moments"] = out["direction_moments"] + out["magnitude_moments"] + out["adam_moments"]
    out["total"] = (
        out["moments"] + out["projection_bases"] + out["basis_moments"] + out["error_feedback"] + rest
    )
    return out
