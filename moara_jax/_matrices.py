"""Which axes of a parameter are its matrix: head-split and other multi-axis kernels.

The chain reads a target as Flax's ``(..., fan_in, fan_out)``: the last two axes are the matrix and
any leading axes are stacked layers, each matrix handled on its own. A kernel whose matrix spans
several axes does not fit that rule. Flax's ``nn.MultiHeadDotProductAttention`` and
``nnx.MultiHeadAttention`` store the query/key/value kernels ``(embed, heads, head_dim)`` and the
output kernel ``(heads, head_dim, embed)``: read by the default rule, each would be ``embed`` (or
``heads``) separate small matrices, not the ``(embed, heads * head_dim)`` projection they are.

:class:`MatrixAxes` names the fan-in and fan-out axes of such a kernel, as
``optax.contrib.MuonDimensionNumbers`` does for Muon, and :func:`as_matrices` runs any
transformation on the matrix view of those leaves: each is transposed to
``(*batch, *fan_in, *fan_out)`` and reshaped to ``(*batch, prod(fan_in), prod(fan_out))`` before the
inner transformation, and its update is brought back to the leaf's own layout after. The inner
state holds the views, so ranks, block sizes, projection sides and the alignment diagnostic are
those of the whole matrix. ``moara_adamw(..., matrix_axes=...)`` applies it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import optax

from moara_jax._labels import unboxed


class MatrixAxes(NamedTuple):
    """The axes of a parameter that form its matrix; every other axis is a batch axis (stacked
    layers), each index along it a matrix of its own.

    ``fan_in`` are the axes a layer contracts with its input, ``fan_out`` those of its output, in
    the order they are flattened (row-major). Negative indices count from the end, so one spec
    serves a kernel with and without a leading layer axis. The default is the chain's own rule.

    Example: Flax's multi-head attention kernels (``nn.DenseGeneral``), stacked by ``nn.scan`` or
    not: query/key/value ``(..., embed, heads, head_dim)`` is
    ``MatrixAxes(fan_in=-3, fan_out=(-2, -1))``; out ``(..., heads, head_dim, embed)`` is
    ``MatrixAxes(fan_in=(-3, -2), fan_out=-1)``.
    """

    fan_in: int | Sequence[int] = -2
    fan_out: int | Sequence[int] = -1


MatrixAxesTree = Any  # a tree of MatrixAxes or None with the parameters' structure
MatrixAxesOrFn = MatrixAxesTree | Callable[[Any], MatrixAxesTree]


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, MatrixAxes)


def _axes(value: int | Sequence[int], ndim: int, what: str, where: str) -> tuple[int, ...]:
    axes = (value,) if isinstance(value, int) else tuple(value)
    if not axes or not all(isinstance(a, int) and -ndim <= a < ndim for a in axes):
        raise ValueError(f"matrix_axes of {where}: {what}={value!r} must name one or more of its {ndim} axes")
    return tuple(a % ndim for a in axes)


class _View(NamedTuple):
    """How one leaf becomes its matrix view: the axis order, then the view's shape."""

    order: tuple[int, ...]
    shape: tuple[int, ...]

    def to_matrix(self, x: jax.Array) -> jax.Array:
        if self.order != tuple(range(x.ndim)):
            x = x.transpose(self.order)
        return x.reshape(self.shape)

    def from_matrix(self, y: jax.Array, like_shape: tuple[int, ...]) -> jax.Array:
        y = y.reshape(tuple(like_shape[a] for a in self.order))
        if self.order == tuple(range(len(self.order))):
            return y
        inverse = sorted(range(len(self.order)), key=self.order.__getitem__)
        return y.transpose(inverse)


def _view(spec: MatrixAxes, shape: tuple[int, ...], where: str) -> _View:
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"matrix_axes of {where}: a matrix needs 2 or more axes, the leaf has shape {shape}")
    fan_in = _axes(spec.fan_in, ndim, "fan_in", where)
    fan_out = _axes(spec.fan_out, ndim, "fan_out", where)
    named = fan_in + fan_out
    if len(set(named)) != len(named):
        raise ValueError(
            f"matrix_axes of {where}: fan_in={spec.fan_in!r} and fan_out={spec.fan_out!r} must be "
            f"distinct axes of its shape {shape}"
        )
    batch = tuple(a for a in range(ndim) if a not in named)
    view_shape = tuple(shape[a] for a in batch) + (
        math.prod(shape[a] for a in fan_in),
        math.prod(shape[a] for a in fan_out),
    )
    return _View(batch + named, view_shape)


def leaf_views(tree: Any, matrix_axes: MatrixAxesOrFn) -> list[_View | None]:
    """One ``_View`` or ``None`` per leaf of ``tree``, in ``jax.tree.leaves`` order. A spec may
    stand for a subtree (a prefix of the parameters' structure): it applies to each of its leaves."""
    specs = matrix_axes(tree) if callable(matrix_axes) else matrix_axes
    spec_def = jax.tree.structure(specs, is_leaf=_is_spec)
    try:
        subtrees = spec_def.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "matrix_axes must be a tree of MatrixAxes or None with the parameters' structure "
            f"(or a function of the parameters returning one): {e}"
        ) from None
    paths = iter(jax.tree_util.tree_flatten_with_path(tree)[0])
    views: list[_View | None] = []
    for spec, subtree in zip(jax.tree.leaves(specs, is_leaf=_is_spec), subtrees, strict=True):
        for _ in jax.tree.leaves(subtree):
            path, x = next(paths)
            where = jax.tree_util.keystr(unboxed(path))
            views.append(None if spec is None else _view(spec, tuple(x.shape), where))
    return views


def matrix_view(tree: Any, matrix_axes: MatrixAxesOrFn | None) -> Any:
    """``tree`` with every leaf that ``matrix_axes`` gives a :class:`MatrixAxes` as its matrix
    view ``(*batch, prod(fan_in), prod(fan_out))``; the other leaves as they are. What
    :func:`as_matrices` hands the inner transformation, and what the alignment diagnostic
    (``matrix_alignment(..., matrix_axes=...)``) compares a gradient in."""
    if matrix_axes is None:
        return tree
    return _to_matrices(tree, leaf_views(tree, matrix_axes))


def _to_matrices(tree: Any, views: list[_View | None]) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([x if v is None else v.to_matrix(x) for x, v in zip(leaves, views, strict=True)])


def as_matrices(
    inner: optax.GradientTransformation, matrix_axes: MatrixAxesOrFn
) -> optax.GradientTransformation:
    """``inner`` run on the matrix view of the leaves ``matrix_axes`` names (:func:`matrix_view`),
    its updates brought back to each leaf's own layout.

    Args:
      inner: any transformation (``moara_adamw``, ``scale_by_moara``, a host's stages).
      matrix_axes: a tree with the parameters' structure whose leaves are :class:`MatrixAxes` (a
        leaf to view as a matrix) or ``None`` (a leaf left as it is), or a function of the
        parameters (or updates) returning such a tree.

    Returns:
      An ``optax.GradientTransformation`` whose state is ``inner``'s on the views.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"query": {"kernel": jnp.ones((32, 4, 8))}}  # (embed, heads, head_dim)
      >>> axes = {"query": {"kernel": MatrixAxes(fan_in=-3, fan_out=(-2, -1))}}
      >>> tx = as_matrices(optax.identity(), axes)
      >>> matrix_view(params, axes)["query"]["kernel"].shape
      (32, 32)
    """

    def init_fn(params):
        return inner.init(matrix_view(params, matrix_axes))

    def update_fn(updates, state, params=None):
        views = leaf_views(updates, matrix_axes)
        params = None if params is None else _to_matrices(params, views)
        new, state = inner.update(_to_matrices(updates, views), state, params)
        leaves, treedef = jax.tree.flatten(updates)
        back = [
            y if v is None else v.from_matrix(y, x.shape)
            for y, x, v in zip(jax.tree.leaves(new), leaves, views, strict=True)
        ]
        return treedef.unflatten(back), state

    return optax.GradientTransformation(init_fn, update_fn)
