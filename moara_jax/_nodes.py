"""Small pytree nodes that carry intermediate values between the chain's stages.

``decompose`` emits :class:`Decomposed`, ``project`` emits :class:`LowRank` (inside the
``direction`` of a :class:`Decomposed`, or alone for GaLore), ``inner_adam`` keeps the node
structure and ``recompose`` turns nodes back into plain arrays. The basis travels inside
:class:`LowRank` so that ``recompose`` needs no second copy of it in its state.
"""

from __future__ import annotations

from typing import Any

import jax

from moara_jax._decomposition import DEFAULT_EPS


@jax.tree_util.register_pytree_node_class
class Decomposed:
    """Block magnitudes and the direction (an array, or a :class:`LowRank` after ``project``).

    ``mag`` is laid out like the leaf it came from, with the fan_in axis (-2) replaced by the
    number of blocks: ``(..., ceil(fan_in / B), fan_out)``. ``block_size`` and ``eps`` (static
    Python numbers; ``eps`` may be ``None`` when it is not one) are those of the decomposition,
    so that later stages recompose with the same blocks.
    ``gradient`` is the gradient the direction was taken from (or ``None``): ``project``
    recomputes the direction from it inside its refresh branch, so that on plain steps the
    direction feeds only the projection and is not held, in whatever layout the SVD wants, for
    the branch.
    """

    def __init__(
        self,
        mag: Any,
        direction: Any,
        block_size: int,
        *,
        eps: float | None = DEFAULT_EPS,
        gradient: Any = None,
    ):
        self.mag = mag
        self.direction = direction
        self.block_size = block_size
        self.eps = eps
        self.gradient = gradient

    def tree_flatten(self):
        return (self.mag, self.direction, self.gradient), (self.block_size, self.eps)

    @classmethod
    def tree_unflatten(cls, aux, children):
        mag, direction, gradient = children
        return cls(mag, direction, aux[0], eps=aux[1], gradient=gradient)

    def replace(self, **changes: Any) -> Decomposed:
        """A copy with the given fields (``mag``, ``direction``, ``gradient``) replaced.

        A new ``direction`` drops ``gradient`` unless one is given: the gradient describes only
        the direction computed from it.
        """
        fields = {"mag": self.mag, "direction": self.direction, "gradient": self.gradient}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"Decomposed.replace got unknown fields {sorted(unknown)}")
        if "direction" in changes and "gradient" not in changes:
            fields["gradient"] = None
        fields.update(changes)
        return Decomposed(
            fields["mag"], fields["direction"], self.block_size, eps=self.eps, gradient=fields["gradient"]
        )

    def __repr__(self) -> str:
        shape = getattr(self.mag, "shape", None)
        return f"Decomposed(mag_shape={shape}, block_size={self.block_size})"


@jax.tree_util.register_pytree_node_class
class LowRank:
    """A low-rank value with the basis it lives in.

    For a Flax leaf ``G`` of shape ``(..., fan_in, fan_out)`` and ``side='in'`` (project the fan_in
    side), ``basis`` is ``(..., fan_in, r)`` and ``value = basis^T G`` is ``(..., r, fan_out)``;
    for ``side='out'``, ``basis`` is ``(..., fan_out, r)`` and ``value = G basis`` is
    ``(..., fan_in, r)``. ``side`` is static.

    Two optional full-shape fields serve hosts that update outside the subspace (Fira):
    ``projected`` is the matrix that was projected (set by ``project(keep_projected=True)``),
    and ``residual`` is a full-rank term that ``recompose`` adds to the back-projected value.
    ``prev_basis`` (SubTrack++) is the basis whose coordinates the Adam moments are moved from
    when they are transported into ``basis``.
    """

    def __init__(
        self,
        value: Any,
        basis: Any,
        side: str,
        *,
        projected: Any = None,
        residual: Any = None,
        prev_basis: Any = None,
    ):
        self.value = value
        self.basis = basis
        self.side = side
        self.projected = projected
        self.residual = residual
        self.prev_basis = prev_basis

    def tree_flatten(self):
        return (self.value, self.basis, self.projected, self.residual, self.prev_basis), self.side

    @classmethod
    def tree_unflatten(cls, side, children):
        value, basis, projected, residual, prev_basis = children
        return cls(value, basis, side, projected=projected, residual=residual, prev_basis=prev_basis)

    def __repr__(self) -> str:
        shape = getattr(self.value, "shape", None)
        return f"LowRank(value_shape={shape}, side={self.side!r})"


def is_node(x: Any) -> bool:
    """True for the stage nodes (used as ``is_leaf`` in tree maps over updates)."""
    return isinstance(x, (Decomposed, LowRank))
