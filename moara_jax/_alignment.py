"""The alignment diagnostic: ``S = cos(vec G, vec G_recon)`` per target matrix and module type."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import optax

from moara_jax._decomposition import FAN_IN_AXIS, alignment, decompose_along, recompose_along
from moara_jax._labels import OTHER, label_tree, module_label, unboxed
from moara_jax._matrices import MatrixAxesOrFn, matrix_view
from moara_jax._projection import ProjectState, project_back, project_value, projection_side
from moara_jax.hosts import defined_hosts
from moara_jax.hosts.q_galore import QuantizedBasis, dequantized


def _basis_states() -> dict[type, Any]:
    """The states that hold projection bases, with the rule that picks each basis's side: the
    core's ``project``, and those each host defined declares (``Host.basis_states``)."""
    found = {ProjectState: projection_side}
    for host in defined_hosts():
        found.update(host.basis_states)
    return found


def reconstruct(
    g: jax.Array, basis: jax.Array, block_size: int | None = None, side: str | None = None
) -> jax.Array:
    """``G_recon`` of a Flax-layout gradient: ``Rep_B(M) * (P P^T V)``, or ``P P^T G`` without
    ``block_size``; float32. ``side`` is the projected side (default: GaLore's rule).

    Args:
      g: a gradient ``(..., fan_in, fan_out)`` (leading axes are stacked layers); cast to
        float32.
      basis: its projection basis ``P``, ``(..., d, r)`` with ``d`` the size of the projected
        side (as :func:`projection_bases` gives it); cast to float32.
      block_size: the decomposition block size ``B``: ``g`` is split into block magnitudes ``M``
        and directions ``V`` along fan_in (blocks of ``B`` entries within each fan_out unit, the
        paper's rows; denominator ``eps`` 1e-12, the chain's default ``decompose_eps``) and
        ``V`` is projected. ``None``: ``g`` itself is projected.
      side: ``'in'`` (``P`` spans the fan_in axis: ``P P^T g``) or ``'out'`` (the fan_out axis:
        ``g P P^T``); ``None`` picks it by :func:`projection_side` from ``g``'s shape. Anything else is a
        ``ValueError``.

    Returns:
      ``G_recon``, a float32 array of ``g``'s shape.
    """
    if side not in (None, "in", "out"):
        raise ValueError(f"reconstruct: side must be 'in', 'out' or None, got {side!r}")
    g = g.astype(jnp.float32)
    side = side or projection_side(g.shape)
    basis = basis.astype(jnp.float32)
    if block_size is None:
        return project_back(project_value(g, basis, side), basis, side)
    mag, v = decompose_along(g, block_size, FAN_IN_AXIS)
    v_proj = project_back(project_value(v, basis, side), basis, side)
    return recompose_along(mag, v_proj, block_size, FAN_IN_AXIS)


def _bases_and_sides(opt_state: Any) -> dict[str, tuple[jax.Array, Any]]:
    """``{path: (basis, side rule)}`` of every projection basis in an optimizer state."""
    found: dict[str, tuple[jax.Array, Any]] = {}
    rules = _basis_states()
    states = tuple(rules)
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, states))
    for node in nodes:
        if not isinstance(node, states):
            continue
        leaves = jax.tree_util.tree_flatten_with_path(
            node.basis, is_leaf=lambda x: isinstance(x, (optax.MaskedNode, QuantizedBasis))
        )[0]
        for path, b in leaves:
            if not isinstance(b, optax.MaskedNode):
                found[jax.tree_util.keystr(unboxed(path))] = (dequantized(b), rules[type(node)])
    return found


def projection_bases(opt_state: Any) -> dict[str, jax.Array]:
    """Every projection basis ``P`` in an optimizer state, keyed by its parameter's path string
    (``jax.tree_util.keystr``); stacked leaves keep their leading axes, quantized bases
    (Q-GaLore) are dequantized.

    Args:
      opt_state: an optimizer state (any pytree). The bases are the ``basis`` fields of the
        :class:`ProjectState` nodes in it and of the nodes each defined host declares
        (``Host.basis_states``: Q-GaLore's, OSD's, LDAdam's, SubTrack++'s); the parameters a
        node does not project (``optax.MaskedNode``) have none.

    Returns:
      ``{path: P}``: ``path`` the parameter's ``jax.tree_util.keystr`` (a Flax box's trailing
      ``.value`` dropped), ``P`` of shape ``(..., d, r)``, ``d`` the projected side's size, in
      the dtype the state keeps it in (zeros before the first update). Under ``matrix_axes``
      the bases are those of the matrix views. An abstract state (``jax.eval_shape``'s) gives
      their shapes and dtypes (``jax.ShapeDtypeStruct``); a state without bases, ``{}``.
    """
    return {key: basis for key, (basis, _) in _bases_and_sides(opt_state).items()}


def matrix_alignment(
    grads: Any,
    opt_state: Any,
    *,
    block_size: int | None = None,
    matrix_axes: MatrixAxesOrFn | None = None,
) -> dict[str, jax.Array]:
    """``S(W, t)`` of every projected matrix, keyed by parameter path; stacked leaves
    ``(L, fan_in, fan_out)`` give an array of ``L`` cosines. The bases come from ``opt_state`` (the
    ones used for the last update); ``matrix_axes`` is the optimizer's (:class:`MatrixAxes`).

    Args:
      grads: the gradient pytree (the parameters' structure; Flax boxes allowed).
      opt_state: the state of the low-rank optimizer after the update that used these gradients
        (its bases, :func:`projection_bases`, and the side rule of the state that holds each).
      block_size: as :func:`module_alignment`'s: the optimizer's ``block_size`` when its state
        decomposes the updates (``ValueError`` without it, or with one that gives a matrix
        another number of blocks than the state's magnitudes); ``None``: ``P P^T G``.
      matrix_axes: the optimizer's ``matrix_axes``, if it was given one: the gradients are
        compared in their matrix view (:func:`matrix_view`).

    Returns:
      ``{path: S}``: ``path`` the parameter's ``jax.tree_util.keystr``, for each gradient that
      has a basis in ``opt_state`` (other leaves are left out; none gives ``{}``), and ``S`` a
      float32 array of the leading (stacked) axes' shape, ``()`` for a plain matrix: the cosine
      of ``G`` and :func:`reconstruct`'s ``G_recon``. Arrays, not Python floats: usable inside
      ``jit``.
    """
    bases = _bases_and_sides(opt_state)
    blocks = _magnitude_blocks(opt_state)
    out = {}
    for path, g in jax.tree_util.tree_flatten_with_path(matrix_view(grads, matrix_axes))[0]:
        key = jax.tree_util.keystr(unboxed(path))
        if key in bases:
            if key in blocks:
                _check_blocks(key, g.shape[FAN_IN_AXIS], blocks[key], block_size)
            basis, side_of = bases[key]
            out[key] = alignment(g, reconstruct(g, basis, block_size, side_of(g.shape)))
    return out


def _magnitude_blocks(opt_state: Any) -> dict[str, int | None]:
    """``{path: blocks along fan_in}`` of each matrix whose updates the state decomposes (it
    holds their block magnitudes' moments, ``mag_mu``; None where they are 8-bit codes)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        names = [getattr(k, "name", None) for k in path]
        if "mag_mu" not in names or not getattr(x, "ndim", 0):
            continue
        rest = path[names.index("mag_mu") + 1 :]
        if rest and isinstance(rest[-1], jax.tree_util.FlattenedIndexKey):  # 8-bit (Q-GaLore): codes
            out.setdefault(jax.tree_util.keystr(unboxed(rest[:-1])), None)  # decomposed, count unknown
        elif x.ndim >= 2:
            out[jax.tree_util.keystr(unboxed(rest))] = x.shape[FAN_IN_AXIS]
    return out


def _check_blocks(key: str, fan_in: int, blocks: int | None, block_size: int | None) -> None:
    """Refuses a ``block_size`` that is not the optimizer's, where the state says it decomposed:
    without one the reconstruction would project ``G`` on a basis of the directions ``V``."""
    if block_size is None:
        raise ValueError(
            f"the state decomposes the updates of {key} "
            + (
                f"({blocks} block magnitudes along its fan_in of {fan_in})"
                if blocks
                else "(it holds block magnitudes)"
            )
            + ", so its basis is of the directions V: pass block_size, the optimizer's"
        )
    if blocks is not None and -(-fan_in // block_size) != blocks:
        raise ValueError(
            f"block_size={block_size} splits the fan_in of {key} ({fan_in}) into "
            f"{-(-fan_in // block_size)} blocks, but the state holds {blocks} block magnitudes: "
            "pass the optimizer's block_size"
        )


def module_alignment(
    grads: Any,
    opt_state: Any,
    *,
    block_size: int | None = None,
    label_fn=module_label,
    matrix_axes: MatrixAxesOrFn | None = None,
) -> dict[str, float]:
    """``S_tau`` for this step: the mean over matrices (and stacked layers) of each module type.

    Args:
      grads: the gradient pytree (same structure as the parameters).
      opt_state: the state of a ``moara_adamw``/``scale_by_galore``/``scale_by_moara`` optimizer
        after the update that used these gradients.
      block_size: decompose before projecting (``G_recon = Rep_B(M) * (P P^T V)``), else
        ``P P^T G``. The state of an optimizer that decomposes (``scale_by_moara``,
        ``moara_adamw`` with ``decompose``) holds bases of the directions ``V``: pass its
        ``block_size`` (a ``ValueError`` without it, or with one that gives a matrix another
        number of blocks than the state's magnitudes, where the state says how many; the
        paper's profiling runs vanilla GaLore, whose bases are of ``G``, and takes either).
      label_fn: path -> module type.
      matrix_axes: the optimizer's ``matrix_axes``, if it was given one (:class:`MatrixAxes`).

    Returns:
      ``{module_type: S_tau}`` as Python floats (calls ``jax.device_get``; use
      :func:`matrix_alignment` inside ``jit``).
    """
    per = matrix_alignment(grads, opt_state, block_size=block_size, matrix_axes=matrix_axes)
    if not per and any(lab != OTHER for lab in jax.tree.leaves(label_tree(grads, label_fn))):
        raise ValueError(
            "module_alignment: opt_state holds no projection basis of these gradients' target "
            "matrices: pass the state of the low-rank optimizer they were stepped with"
        )
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    paths = {jax.tree_util.keystr(p): p for p in (unboxed(p) for p, _ in flat)}
    sums: dict[str, list] = defaultdict(list)
    for key, s in jax.device_get(per).items():
        label = label_fn(paths[key])
        if label != OTHER:
            sums[label].extend(jnp.ravel(jnp.asarray(s)).tolist())
    return {k: float(sum(v) / len(v)) for k, v in sums.items()}
