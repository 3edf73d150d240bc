"""Small pytree nodes that carry intermediate values between the chain's stages.

``decompose`` emits :class:`Decomposed`, ``project`` emits :class:`LowRank` (inside the
``direction`` of a :class:`Decomposed`, or alone for GaLore), ``inner_adam`` keeps the node
structure and ``recompose`` turns nodes back into plain arrays. The basis travels inside
:class:`LowRank` so that ``recompose`` needs no second copy of it in its state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class Decomposed(NamedTuple):
    """Block magnitudes and the direction (an array, or a :class:`LowRank` after ``project``).

    ``mag`` is laid out like the leaf it came from, with the fan_in axis (-2) replaced by the
    number of blocks: ``(..., ceil(fan_in / B), fan_out)``.
    """

    mag: Any
    direction: Any


@jax.tree_util.register_pytree_node_class
class LowRank:
    """A low-rank value with the basis it lives in.

    For a Flax leaf ``G`` of shape ``(..., fan_in, fan_out)`` and ``side='in'`` (project the fan_in
    side), ``basis`` is ``(..., fan_in, r)`` and ``value = basis^T G`` is ``(..., r, fan_out)``;
    for ``side='out'``, ``basis`` is ``(..., fan_out, r)`` and ``value = G basis`` is
    ``(..., fan_in, r)``. ``side`` is static.
    """

    def __init__(self, value: Any, basis: Any, side: str):
        self.value = value
        self.basis = basis
        self.side = side

    def tree_flatten(self):
        return (self.value, self.basis), self.side

    @classmethod
    def tree_unflatten(cls, side, children):
        return cls(*children, side=side)

    def __repr__(self) -> str:
        shape = getattr(self.value, "shape", None)
        return f"LowRank(value_shape={shape}, side={self.side!r})"


def is_node(x: Any) -> bool:
    """True for the stage nodes (used as ``is_leaf`` in tree maps over updates)."""
    return isinstance(x, (Decomposed, LowRank))
