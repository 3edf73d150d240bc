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
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moara_jax._labels import is_box, path_names, unboxed


class MatrixAxes(NamedTuple):
    """The axes of a parameter that form its matrix; every other axis is a batch axis (stacked
    layers), each index along it a matrix of its own.

    ``fan_in`` are the axes a layer contracts with its input, ``fan_out`` those of its output, in
    the order they are flattened (row-major). Negative indices count from the end, so one spec
    serves a kernel with and without a leading layer axis. The default is the chain's own rule.

    Example: Flax's multi-head attention kernels (``nn.DenseGeneral``), with ``nn.scan``'s layer
    axis in front (its default ``variable_axes``) or not: query/key/value
    ``(..., embed, heads, head_dim)`` is ``MatrixAxes(fan_in=-3, fan_out=(-2, -1))``; out
    ``(..., heads, head_dim, embed)`` is ``MatrixAxes(fan_in=(-3, -2), fan_out=-1)``.
    """

    fan_in: int | Sequence[int] = -2
    fan_out: int | Sequence[int] = -1


MatrixAxesTree = Any  # MatrixAxes or None per parameter path (a prefix of it)
MatrixAxesOrFn = MatrixAxesTree | Callable[[Any], MatrixAxesTree]


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, MatrixAxes)


def _axes(value: Any, ndim: int, what: str, where: str) -> tuple[int, ...]:
    many = isinstance(value, Sequence) and not isinstance(value, str)
    axes = tuple(value) if many else (value,)

    def index(a):
        if isinstance(a, bool):
            raise TypeError
        return operator.index(a)

    try:
        axes = tuple(index(a) for a in axes)
    except TypeError:
        axes = ()
    if not axes or not all(-ndim <= a < ndim for a in axes):
        # A spec given for a module applies to every leaf under it: its bias too.
        hint = "; to give it to the kernel alone, put it under the 'kernel' key" if ndim < 3 else ""
        raise ValueError(
            f"matrix_axes of {where}: {what}={value!r} must name one or more of its {ndim} axes "
            f"(integers){hint}"
        )
    return tuple(a % ndim for a in axes)


class _View(NamedTuple):
    """How one leaf becomes its matrix view: the axis order (``None`` when the axes are in order
    already) and its inverse, then the view's shape."""

    order: tuple[int, ...] | None
    inverse: tuple[int, ...] | None
    shape: tuple[int, ...]

    def to_matrix(self, x: jax.Array) -> jax.Array:
        if isinstance(x, jax.ShapeDtypeStruct):  # jax.eval_shape's output: the view's shape alone
            return jax.ShapeDtypeStruct(self.shape, x.dtype)
        return (x if self.order is None else x.transpose(self.order)).reshape(self.shape)

    def from_matrix(self, y: jax.Array, like_shape: tuple[int, ...]) -> jax.Array:
        if self.order is None:
            return y.reshape(like_shape)
        return y.reshape(tuple(like_shape[a] for a in self.order)).transpose(self.inverse)


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
    order = batch + named
    if order == tuple(range(ndim)):
        return _View(None, None, view_shape)
    return _View(order, tuple(sorted(range(ndim), key=order.__getitem__)), view_shape)


def _specs_by_path(specs: Any) -> dict[tuple[str, ...], MatrixAxes | None]:
    """``{path names: spec}`` of a ``matrix_axes`` tree (a spec inside a Flax box, as a
    ``tree_map`` over boxed parameters makes it, counts at the box's path)."""
    found = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]:
        if not _is_spec(spec):
            shown = repr(spec) if len(repr(spec)) <= 40 else type(spec).__name__
            raise ValueError(
                f"matrix_axes{jax.tree_util.keystr(path)} is {shown}: each entry must be a MatrixAxes "
                "or None (a plain tuple or another library's dimension numbers is not one)"
            )
        found[path_names(path)] = spec
    return found


def leaf_views(tree: Any, matrix_axes: MatrixAxesOrFn) -> list[_View | None]:
    """One ``_View`` or ``None`` per leaf of ``tree``, in ``jax.tree.leaves`` order.

    ``matrix_axes`` (or what it returns, called on ``tree``) is matched to the leaves by path,
    so one spec tree serves a dict, a ``FrozenDict``, an nnx ``State`` and their boxed forms. A
    spec at a subtree's path applies to each leaf under it (the nearest one counts); leaves no
    spec covers keep the default rule. A non-``None`` spec whose path is no parameter's is an
    error (a misspelt name would otherwise change nothing); a parameter that ``optax.masked`` or
    ``optax.partition`` hides from this transformation (``optax.MaskedNode``) counts as one."""
    specs = _specs_by_path(matrix_axes(tree) if callable(matrix_axes) else matrix_axes)
    used = set()
    views: list[_View | None] = []
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=masked)[0]:
        names = path_names(path)
        prefix = next((names[:n] for n in range(len(names), -1, -1) if names[:n] in specs), None)
        spec = None if prefix is None else specs[prefix]
        used.add(prefix)
        if masked(x):  # a parameter another transformation steps (optax.masked, optax.partition)
            continue
        where = jax.tree_util.keystr(unboxed(path))
        views.append(None if spec is None else _view(spec, tuple(jnp.shape(x)), where))
    unused = ["/".join(k) or "(the root)" for k, v in specs.items() if v is not None and k not in used]
    if unused:
        raise ValueError(
            f"matrix_axes names {', '.join(unused)}, not the path of a parameter or of a subtree of them"
        )
    return views


def matrix_view(tree: Any, matrix_axes: MatrixAxesOrFn | None) -> Any:
    """``tree`` with every leaf that ``matrix_axes`` gives a :class:`MatrixAxes` as its matrix
    view ``(*batch, prod(fan_in), prod(fan_out))``, a plain array (a Flax box around it is
    dropped: its sharding names do not fit the view); the other leaves as they are. What
    :func:`as_matrices` hands the inner transformation, and what the alignment diagnostic
    (``matrix_alignment(..., matrix_axes=...)``) compares a gradient in.

    Args:
      tree: the parameters, or a tree of their structure (gradients, updates); arrays, or
        ``jax.eval_shape``'s ``ShapeDtypeStruct``s (a view is then a ``ShapeDtypeStruct`` of the
        view's shape and the leaf's dtype, with no sharding).
      matrix_axes: :class:`MatrixAxes` or ``None`` per parameter path, as a tree or a function of
        ``tree`` returning one, as :func:`as_matrices` takes it; ``None``: no views. A spec that
        does not fit its leaf (an axis out of range, ``fan_in`` and ``fan_out`` sharing one, a
        leaf of fewer than 2 axes), an entry that is neither ``MatrixAxes`` nor ``None``, or a
        ``MatrixAxes`` at a path that is no parameter's is a ``ValueError``.

    Returns:
      ``tree`` with each leaf that a :class:`MatrixAxes` covers replaced by its matrix view, of
      the leaf's dtype; ``tree`` itself when ``matrix_axes`` is ``None``.
    """
    if matrix_axes is None:
        return tree
    return _to_matrices(tree, leaf_views(tree, matrix_axes))


def _to_matrices(tree: Any, views: list[_View | None]) -> Any:
    units, treedef = jax.tree.flatten(tree, is_leaf=is_box)  # one array each, boxed or not
    out = []
    for unit, view in zip(units, views, strict=True):
        out.append(unit if view is None else view.to_matrix(jax.tree.leaves(unit)[0]))
    return treedef.unflatten(out)


def as_matrices(
    inner: optax.GradientTransformation, matrix_axes: MatrixAxesOrFn
) -> optax.GradientTransformationExtraArgs:
    """``inner`` run on the matrix view of the leaves ``matrix_axes`` names (:func:`matrix_view`),
    its updates brought back to each leaf's own layout.

    Args:
      inner: an Optax transformation (``moara_adamw``, ``scale_by_moara``, a host's stages, a
        chain); extra arguments of ``update`` (``value=`` for ``optax.contrib.reduce_on_plateau``)
        are passed on to it.
      matrix_axes: :class:`MatrixAxes` or ``None`` per parameter path, as a tree (the
        parameters' own, or a prefix of it; a spec stands for every leaf under its path, and
        leaves it does not reach keep the default rule), or a function of the parameters (also
        called on the updates) returning one. Matched by path, so a plain dict fits an nnx
        ``State`` or a ``FrozenDict`` of the same names.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s on the views. A
      Flax box (``nn.Partitioned``, an nnx ``Variable``) around a viewed leaf is not carried into
      the state: its sharding names are those of the kernel's axes, not the view's. The state of
      a viewed leaf is placed as XLA chooses unless you pin it (``jit``'s ``out_shardings``).

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

    extra_args_inner = optax.with_extra_args_support(inner)

    def update_fn(updates, state, params=None, **extra_args):
        views = leaf_views(updates, matrix_axes)
        params = None if params is None else _to_matrices(params, views)
        new, state = extra_args_inner.update(_to_matrices(updates, views), state, params, **extra_args)
        leaves, treedef = jax.tree.flatten(updates)
        back = [
            y if v is None else v.from_matrix(y, x.shape)
            for y, x, v in zip(jax.tree.leaves(new), leaves, views, strict=True)
        ]
        return treedef.unflatten(back), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
