"""The ``project`` stage: GaLore's low-rank projection of each target matrix.

Works on Flax kernels ``(..., fan_in, fan_out)``. Shape rules are those of galore-torch's
``proj_type='std'`` in the paper's orientation ``W = kernel^T`` (m = fan_out, n = fan_in): the
smaller of (fan_in, fan_out) is projected to the rank; on a tie (square) the fan_in side, which is
galore-torch's ``'right'``. The basis is refreshed every ``update_proj_gap`` steps (step 0
included) from the SVD of the matrix it receives (the gradient, or the block direction after
``decompose``), under one ``lax.cond`` per call, in float32; same-shaped matrices share one batched
SVD. Between refreshes the basis is kept in the state.
"""

from __future__ import annotations

import contextvars
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moara_jax._bases import canonicalize_signs, top_basis
from moara_jax._decomposition import FAN_IN_AXIS, decompose_along
from moara_jax._labels import unboxed
from moara_jax._nodes import Decomposed, LowRank, is_node
from moara_jax._validate import check_update_proj_gap, is_int, static_hint
from moara_jax._warnings import warn

PROJ_TYPES = ("std",)
SVD_METHODS = ("exact", "eigh", "randomized")


class ProjectState(NamedTuple):
    """State of :func:`project`."""

    count: jax.Array  # shape=(), dtype=jnp.int32: steps taken.
    basis: Any  # per leaf (..., d, r) in the leaf's dtype, d the projected side.


def swap(x: jax.Array) -> jax.Array:
    """The matrix transpose of the last two axes."""
    return jnp.swapaxes(x, -1, -2)


def projection_side(shape: tuple[int, ...]) -> str:
    """``'in'`` to project the fan_in axis (-2), ``'out'`` for the fan_out axis (-1).

    galore-torch ``'std'``: ``m >= n`` (fan_out >= fan_in) projects the fan_in side.

    Args:
      shape: a Flax-layout matrix's shape ``(..., fan_in, fan_out)``; only the last two entries
        are read.

    Returns:
      ``'in'`` when ``fan_out >= fan_in`` (a square matrix included), else ``'out'``: the smaller
      side, whose size is the basis's rows ``d`` in ``(..., d, r)``.
    """
    fan_in, fan_out = shape[-2], shape[-1]
    return "in" if fan_out >= fan_in else "out"


def effective_rank(shape: tuple[int, ...], rank: int) -> int:
    """The rank actually used: ``min(rank, fan_in, fan_out)``."""
    return min(rank, shape[-2], shape[-1])


def stage_settings(
    rank: int | Callable[[Any], int], update_proj_gap: int, proj_type: str, svd: str, name: Any
) -> tuple[Callable[[Any], int], Callable[[Any], str | None]]:
    """A projection stage's shared settings checked (a ``ValueError`` naming the first bad one),
    and its rank and module name as functions of a parameter's key path (each given as one, or
    as one value for every parameter)."""
    if not callable(rank) and not is_int(rank):
        raise ValueError(f"rank must be a positive integer, got {rank!r}{static_hint(rank)}")
    check_update_proj_gap(update_proj_gap)
    if proj_type not in PROJ_TYPES:
        raise ValueError(f"proj_type must be one of {PROJ_TYPES}, got {proj_type!r}")
    if svd not in SVD_METHODS:
        raise ValueError(f"svd must be one of {SVD_METHODS}, got {svd!r}")
    rank_fn = rank if callable(rank) else (lambda path: rank)
    name_fn = name if callable(name) else (lambda path: name)
    return rank_fn, name_fn


def step_key(seed: int, count: jax.Array) -> jax.Array:
    """The random key of a stage's step ``count`` (the randomized refresh's, Q-GaLore's rounding)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), count)


def emit(u: Any, low: Any) -> Any:
    """A stage's output for leaf ``u``: ``low`` as the direction of ``u``'s ``Decomposed`` (its
    gradient, needed only by the refresh, dropped), else ``low`` itself."""
    return u.replace(direction=low, gradient=None) if isinstance(u, Decomposed) else low


def matrix_of(u: Any) -> jax.Array:
    """The matrix a stage node projects: the direction of a ``Decomposed``, else the leaf."""
    return u.direction if isinstance(u, Decomposed) else u


def refresh_matrix(u: Any) -> jax.Array:
    """The matrix whose SVD gives the basis: for a ``Decomposed`` that carries its gradient, the
    direction recomputed from it (the same expression ``decompose`` evaluated, so the same
    values). Called inside the refresh branch, whose operands are then the gradients (alive
    anyway) rather than every direction at once; on plain steps each direction lives only
    until its projection."""
    if isinstance(u, Decomposed) and u.gradient is not None and u.eps is not None:
        return decompose_along(u.gradient, u.block_size, FAN_IN_AXIS, u.eps)[1]
    return matrix_of(u)


def refresh_bases(
    mats: list[jax.Array],
    ranks: list[int],
    svd: str = "exact",
    key: jax.Array | None = None,
    *,
    oversample: int = 8,
    power_iters: int = 2,
    canonical_signs: bool = False,
) -> list[jax.Array]:
    """New bases for a list of matrices; same-shaped ones share one batched SVD.

    Matrices of one shape (stacked layers and, e.g., q/k/v/o of a block) are concatenated into a
    single batch and factored once at the largest rank any of them asks for; each then takes its
    leading ``r`` vectors (the top-``r`` subspace is nested in the top-``r_max`` one).

    Returns float32 bases ``(..., d, r)``, one per matrix, in order.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, m in enumerate(mats):
        groups[tuple(m.shape[-2:])].append(i)
    out: list[jax.Array | None] = [None] * len(mats)
    for gi, (shape2, idx) in enumerate(groups.items()):
        side = projection_side(shape2)
        r_max = max(ranks[i] for i in idx)
        flat = [mats[i].reshape((-1,) + shape2) for i in idx]
        batch = flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=0)
        sub = jax.random.fold_in(key, gi) if svd == "randomized" else None
        bases = top_basis(batch, side, r_max, svd, sub, oversample, power_iters)
        if canonical_signs:
            bases = canonicalize_signs(bases)
        offset = 0
        for i, f in zip(idx, flat, strict=True):
            n = f.shape[0]
            b = bases[offset : offset + n, :, : ranks[i]]
            out[i] = b.reshape(mats[i].shape[:-2] + b.shape[-2:])
            offset += n
    return out  # type: ignore[return-value]


def project_value(g: jax.Array, basis: jax.Array, side: str) -> jax.Array:
    """``basis^T g`` (side 'in') or ``g basis`` (side 'out'), in ``g``'s dtype."""
    basis = basis.astype(g.dtype)
    if side == "in":
        return jnp.swapaxes(basis, -1, -2) @ g
    return g @ basis


def project_back(low: jax.Array, basis: jax.Array, side: str) -> jax.Array:
    """Inverse map of :func:`project_value`: ``basis low`` or ``low basis^T``.

    The operands keep their common dtype (bf16 stays bf16, on the matrix units) and the products
    accumulate and come out in at least float32: for bf16 operands the same values as upcasting
    them first (their products are exact in float32), without a float32 matrix product.
    """
    dtype = jnp.result_type(low, basis)
    low, basis = low.astype(dtype), basis.astype(dtype)
    acc = jnp.promote_types(dtype, jnp.float32)
    if side == "in":
        return jnp.matmul(basis, low, preferred_element_type=acc)
    return jnp.matmul(low, jnp.swapaxes(basis, -1, -2), preferred_element_type=acc)


def transport(c: jax.Array, x: jax.Array, side: str) -> jax.Array:
    """Low-rank coordinates ``x`` (as :func:`project_value` makes them) in an old basis ``P``,
    moved into a new basis ``Q`` by ``c = Q^T P`` (``r x r``): ``c x`` (side 'in') or ``x c^T``."""
    return c @ x if side == "in" else x @ jnp.swapaxes(c, -1, -2)


def refreshed_bases(
    leaves: list[Any],
    old: list[jax.Array],
    ranks: list[int],
    svd: str,
    seed: int,
    count: jax.Array,
    canonical_signs: bool,
    oversample: int = 8,
    power_iters: int = 2,
) -> list[jax.Array]:
    """A stage's refresh: :func:`refresh_bases` of the matrices its nodes ``leaves`` refresh from
    (``refresh_matrix``), with step ``count``'s key, each basis in its ``old`` one's dtype."""
    sources = [refresh_matrix(u) for u in leaves]
    new = refresh_bases(
        sources,
        ranks,
        svd,
        step_key(seed, count),
        oversample=oversample,
        power_iters=power_iters,
        canonical_signs=canonical_signs,
    )
    return [n.astype(o.dtype) for n, o in zip(new, old, strict=True)]


def path_str(path) -> str:
    return jax.tree_util.keystr(path) if path else "<leaf>"


def basis_shape(stage: str, path, u: Any, requested: int, module: str | None) -> tuple[jax.Array, int, int]:
    """``(matrix, d, r)`` of a leaf a projection stage receives: the matrix it projects, its
    projected side's size and the rank used (``requested`` clipped, with a warning naming the
    module). A ``ValueError`` naming ``stage`` and the parameter for a non-matrix or a bad rank."""
    m = matrix_of(u)
    if m.ndim < 2:
        raise ValueError(
            f"{stage}: parameter {path_str(path)} has shape {m.shape}; only matrices "
            "(..., fan_in, fan_out) can be projected (label it as a non-target)"
        )
    if 0 in m.shape:
        raise ValueError(
            f"{stage}: parameter {path_str(path)} has shape {m.shape}: an empty matrix has "
            "nothing to project (moara_adamw leaves it to AdamW; label it as a non-target)"
        )
    if not is_int(requested):
        raise ValueError(f"rank must be a positive integer, got {requested!r}")
    r = effective_rank(m.shape, requested)
    rank_warning(path, m.shape, requested, r, module)
    d = m.shape[-2] if projection_side(m.shape) == "in" else m.shape[-1]
    return m, d, r


def zero_bases(stage: str, params: Any, rank_fn: Callable, name_fn: Callable) -> Any:
    """Zero bases ``(..., d, r)`` in each leaf's dtype for a projection stage's state (ranks
    checked and clipped, with :func:`basis_shape`)."""

    def make(path, u):
        m, d, r = basis_shape(stage, path, u, rank_fn(unboxed(path)), name_fn(unboxed(path)))
        return jnp.zeros(m.shape[:-2] + (d, r), m.dtype)

    with grouped_rank_warnings():
        return jax.tree_util.tree_map_with_path(make, params, is_leaf=is_node)


def state_ranks(stage: str, updates: Any, bases: list, rank_fn: Callable) -> list[int]:
    """The rank of each basis a stage's state holds (``bases``, one ``(..., d, r)`` per leaf of
    ``updates`` in flattening order), checked against the rank these settings give the leaf's
    parameter (``rank_fn``, clipped as at init). The stages take their rank from the basis they
    are handed, so a state made under other ranks (another ``r_base``, ``ranks`` or allocation)
    would otherwise run at its own ranks without a word: a ``ValueError`` naming ``stage``, the
    parameter and both ranks. Shapes only: checked once per trace, nothing on the device."""
    flat = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_node)[0]
    ranks = []
    for (path, u), basis in zip(flat, bases, strict=True):
        have, shape = basis.shape[-1], matrix_of(u).shape
        # An update the basis does not fit (flattened, of another size): the misfit is the
        # update's, for the projection to meet (and the optimizer's diagnosis to name).
        fits = len(shape) >= 2 and basis.shape[-2] == shape[-2 if projection_side(shape) == "in" else -1]
        want = effective_rank(shape, rank_fn(unboxed(path))) if fits else have
        if have != want:
            raise ValueError(
                f"{stage}: the state's basis of {path_str(path)} has rank {have}, and these "
                f"settings give its matrix {tuple(shape)} rank {want}: a state made with other ranks "
                "(r_base, ranks, the allocation) than this optimizer's"
            )
        ranks.append(have)
    return ranks


# The clipped ranks of the matrices sized inside grouped_rank_warnings, else None (warned one by one).
_CLIPS: contextvars.ContextVar[list | None] = contextvars.ContextVar("moara_jax_rank_clips", default=None)


def rank_warning(path, shape: tuple[int, ...], requested: int, rank: int, module: str | None) -> None:
    """Warns, naming the module and both numbers, when the requested rank was clipped (inside
    :func:`grouped_rank_warnings`, once for all the matrices clipped alike)."""
    if rank >= requested:
        return
    clips = _CLIPS.get()
    if clips is not None:
        clips.append((path, tuple(shape), requested, rank, module))
        return
    _warn_clipped([path], tuple(shape), requested, rank, module)


class grouped_rank_warnings:  # noqa: N801 - used as a function, ``with grouped_rank_warnings():``
    """One clipped-rank warning per module type, matrix shape and pair of ranks for the matrices
    sized inside (an unrolled 24-layer model's clipped ``down`` projections: one line, not 24),
    given when the block ends without an error. (A class, not a generator: the warnings name the
    user's line, found by walking out of this package's frames.)"""

    def __enter__(self) -> None:
        self._clips: list = []
        self._token = _CLIPS.set(self._clips)

    def __exit__(self, kind, *_) -> None:
        _CLIPS.reset(self._token)
        if kind is not None:
            return
        groups: dict[tuple, list] = defaultdict(list)
        for path, shape, requested, rank, module in self._clips:
            groups[(module, shape, requested, rank)].append(path)
        for (module, shape, requested, rank), paths in groups.items():
            _warn_clipped(paths, shape, requested, rank, module)


def _numbers_as_numbers(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _warn_clipped(paths: list, shape: tuple[int, ...], requested: int, rank: int, module: str | None) -> None:
    what = f"module {module!r} at " if module else ""
    # First and last by their numbers (layers_2 before layers_10, where a tree sorts its keys as text).
    names = sorted(map(path_str, paths), key=_numbers_as_numbers)
    where = names[0]
    if len(names) == 2:
        where = f"2 matrices ({where} and {names[1]})"
    elif len(names) > 2:
        where = f"{len(names)} matrices ({where}, ..., {names[-1]})"
    # A kernel of more axes is a stack of matrices over all but its last two (scanned layers);
    # one whose matrix spans more of them (a DenseGeneral's) is cut into many small ones.
    stacked = (
        f"; its leading axes {shape[:-2]} are taken as stacked layers, each index a matrix of "
        f"{shape[-2:]}: where the matrix spans more of its axes (an nn.DenseGeneral kernel such "
        "as (embed, heads, head_dim)), pass matrix_axes (moara_jax.MatrixAxes)"
        if len(shape) >= 3
        else ""
    )
    warn(
        f"projection rank {requested} for {what}{where} (Flax shape {shape}) exceeds "
        f"min(fan_in, fan_out) = {rank}; clipped to {rank}{stacked}",
    )


def project(
    rank: int | Callable[[Any], int],
    update_proj_gap: int = 200,
    proj_type: str = "std",
    *,
    svd: str = "exact",
    seed: int = 0,
    oversample: int = 8,
    power_iters: int = 2,
    canonical_signs: bool = False,
    name: str | Callable[[Any], str] | None = None,
    keep_projected: bool = False,
) -> optax.GradientTransformation:
    """Projects every leaf (or the direction of a ``Decomposed`` leaf) onto a rank-``rank`` basis.

    Args:
      rank: projection rank, or a function of the parameter's key path giving its rank (one
        transform, hence one refresh ``cond`` and shared SVD batches, for all modules). Clipped
        to ``min(fan_in, fan_out)`` per matrix, with a warning.
      update_proj_gap: steps between basis refreshes (GaLore's ``T``); step 0 refreshes.
      proj_type: ``'std'`` (galore-torch's default shape rule).
      svd: ``'exact'`` (full SVD, as galore-torch), ``'eigh'`` (eigendecomposition of the
        float32 Gram matrix of the projected side: the same subspace where singular values are
        above ~1e-3 of the largest, and much faster on GPU, where cuSOLVER's SVD is slow) or
        ``'randomized'`` (range finder with ``power_iters`` rounds of subspace iteration and
        ``oversample`` extra columns).
      seed: seed of the randomized range finder (folded with the step).
      oversample, power_iters: the randomized range finder's extra columns and rounds of
        subspace iteration (non-negative integers, ``ValueError`` otherwise); unused by
        ``'exact'`` and ``'eigh'``.
      canonical_signs: flip each basis vector so its largest-magnitude entry is positive.
        Singular vectors are defined up to sign and LAPACK/cuSOLVER builds differ; with this the
        basis (and the run) no longer depends on the backend's convention. galore-torch keeps
        the raw signs (the default here).
      name: module type named in the clipping warning (e.g. ``'down'``), or a function of the
        key path giving it.
      keep_projected: also carry the projected matrix in each :class:`LowRank` (``projected``),
        for a following stage that works outside the subspace (:func:`fira_adam`).

    Returns:
      A transform that emits :class:`LowRank` nodes (inside ``Decomposed`` when given one).
    """
    rank_fn, name_fn = stage_settings(rank, update_proj_gap, proj_type, svd, name)
    if not is_int(oversample, minimum=0):
        raise ValueError(f"oversample must be a non-negative integer, got {oversample!r}")
    if not is_int(power_iters, minimum=0):
        raise ValueError(f"power_iters must be a non-negative integer, got {power_iters!r}")

    def init_fn(params):
        basis = zero_bases("project", params, rank_fn, name_fn)
        return ProjectState(count=jnp.zeros([], jnp.int32), basis=basis)

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_node)
        old = treedef.flatten_up_to(state.basis)
        mats = [matrix_of(u) for u in leaves]
        ranks = state_ranks("project", updates, old, rank_fn)

        def refresh():
            return refreshed_bases(
                leaves, old, ranks, svd, seed, state.count, canonical_signs, oversample, power_iters
            )

        if leaves:
            bases = jax.lax.cond(state.count % update_proj_gap == 0, refresh, lambda: list(old))
        else:
            bases = []
        out = []
        for u, m, b in zip(leaves, mats, bases, strict=True):
            side = projection_side(m.shape)
            low = LowRank(project_value(m, b, side), b, side, projected=m if keep_projected else None)
            out.append(emit(u, low))
        new_state = ProjectState(
            count=optax.safe_increment(state.count),
            basis=jax.tree.unflatten(treedef, bases),
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformation(init_fn, update_fn)
