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

import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moara_jax._decomposition import FAN_IN_AXIS, _is_int, decompose_along
from moara_jax._nodes import Decomposed, LowRank, is_node

PROJ_TYPES = ("std",)
SVD_METHODS = ("exact", "eigh", "randomized")


class ProjectState(NamedTuple):
    """State of :func:`project`."""

    count: jax.Array  # shape=(), dtype=jnp.int32: steps taken.
    basis: Any  # per leaf (..., d, r) in the leaf's dtype, d the projected side.


def _swap(x: jax.Array) -> jax.Array:
    """The matrix transpose of the last two axes."""
    return jnp.swapaxes(x, -1, -2)


def projection_side(shape: tuple[int, ...]) -> str:
    """``'in'`` to project the fan_in axis (-2), ``'out'`` for the fan_out axis (-1).

    galore-torch ``'std'``: ``m >= n`` (fan_out >= fan_in) projects the fan_in side.
    """
    fan_in, fan_out = shape[-2], shape[-1]
    return "in" if fan_out >= fan_in else "out"


def effective_rank(shape: tuple[int, ...], rank: int) -> int:
    """The rank actually used: ``min(rank, fan_in, fan_out)``."""
    return min(rank, shape[-2], shape[-1])


def _check_args(rank: int, update_proj_gap: int, proj_type: str, svd: str) -> None:
    if not _is_int(rank):
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if not _is_int(update_proj_gap):
        raise ValueError(f"update_proj_gap must be a positive integer, got {update_proj_gap!r}")
    if proj_type not in PROJ_TYPES:
        raise ValueError(f"proj_type must be one of {PROJ_TYPES}, got {proj_type!r}")
    if svd not in SVD_METHODS:
        raise ValueError(f"svd must be one of {SVD_METHODS}, got {svd!r}")


def _matrix_of(u: Any) -> jax.Array:
    """The matrix a stage node projects: the direction of a ``Decomposed``, else the leaf."""
    return u.direction if isinstance(u, Decomposed) else u


def _refresh_matrix(u: Any) -> jax.Array:
    """The matrix whose SVD gives the basis: for a ``Decomposed`` that carries its source, the
    direction recomputed from it (the same expression ``decompose`` evaluated, so the same
    values). Called inside the refresh branch, whose operands are then the gradients (alive
    anyway) rather than every direction at once; on plain steps each direction lives only
    until its projection."""
    if isinstance(u, Decomposed) and u.source is not None and u.eps is not None:
        return decompose_along(u.source, u.block_size, FAN_IN_AXIS, u.eps)[1]
    return _matrix_of(u)


def _per_matrix(fn, x: jax.Array):
    """Applies a LAPACK-backed ``fn`` to a batch of matrices ``(B, a, b)``.

    On CPU the batch is looped with ``lax.map``: jaxlib's batched LAPACK kernels fan a batch out
    over the intra-op thread pool and wait for it, and several CPU devices doing that at once
    (a sharded run under ``--xla_force_host_platform_device_count``) can deadlock the pool. On GPU
    the batched cuSOLVER call is kept.
    """
    if x.ndim > 2 and x.shape[0] > 1 and jax.default_backend() == "cpu":
        return jax.lax.map(fn, x)
    return fn(x)


def _svd(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return _per_matrix(lambda x: jnp.linalg.svd(x, full_matrices=False), w)


def _exact_basis(g: jax.Array, side: str, r: int) -> jax.Array:
    """Top-``r`` singular vectors of the projected side, float32, like galore-torch.

    The SVD is taken of the paper-orientation matrix ``W = g^T`` (as galore-torch does), so that
    the sign conventions of LAPACK's factors match the reference's.
    """
    w = jnp.swapaxes(g.astype(jnp.float32), -1, -2)  # (..., fan_out, fan_in)
    u, _, vh = _svd(w)
    if side == "in":
        return jnp.swapaxes(vh[..., :r, :], -1, -2)  # (..., fan_in, r)
    return u[..., :, :r]  # (..., fan_out, r)


def _top_eigvecs(gram: jax.Array, r: int) -> jax.Array:
    """Eigenvectors of the symmetric ``gram`` for its ``r`` largest eigenvalues, descending."""
    vecs, _ = _per_matrix(lambda x: jax.lax.linalg.eigh(x), gram)  # ascending eigenvalues
    return vecs[..., ::-1][..., :r]


def _gram(a: jax.Array) -> jax.Array:
    """``a a^T`` in full float32 precision (no TF32 / bf16 passes on accelerators)."""
    return jnp.einsum("...ij,...kj->...ik", a, a, precision=jax.lax.Precision.HIGHEST)


def _eigh_basis(g: jax.Array, side: str, r: int) -> jax.Array:
    """Top-``r`` left singular vectors of the projected side from the eigendecomposition of the
    float32 Gram matrix ``A A^T`` (``d x d``, d the smaller side).

    The same subspace as :func:`_exact_basis` wherever singular values are above ~1e-3 of the
    largest (the Gram squares them; directions below that carry < 1e-6 of the energy each). On GPU
    cuSOLVER's ``syevd`` on the small Gram matrix is far faster than its ``gesvd`` on ``A``.
    """
    a = g.astype(jnp.float32)
    if side == "out":
        a = jnp.swapaxes(a, -1, -2)  # (..., fan_out, fan_in)
    return _top_eigvecs(_gram(a), r)


def _householder(x: jax.Array) -> jax.Array:
    return _per_matrix(lambda m: jnp.linalg.qr(m)[0], x)


def _cholesky_qr(y: jax.Array) -> jax.Array:
    """One shifted CholeskyQR pass: ``y L^-T`` with ``L L^T = y^T y + shift I``."""
    gram = _gram(jnp.swapaxes(y, -1, -2))  # y^T y
    k = gram.shape[-1]
    shift = 1e-6 * jnp.trace(gram, axis1=-2, axis2=-1)[..., None, None] / k + 1e-30
    chol = jnp.linalg.cholesky(gram + shift * jnp.eye(k, dtype=gram.dtype))
    return jax.lax.linalg.triangular_solve(chol, y, left_side=False, lower=True, transpose_a=True)


def _orthonormal(x: jax.Array) -> jax.Array:
    """Orthonormal basis of the columns of ``x``.

    On CPU: Householder QR. On accelerators, where the QR runs matrix by matrix in cuSOLVER:
    CholeskyQR2 (two shifted CholeskyQR passes: batched matrix products, Cholesky and triangular
    solves), falling back to Householder QR for the whole batch if any result is not orthonormal
    to 1e-3 (rank-deficient input).
    """
    if jax.default_backend() == "cpu":
        return _householder(x)
    q = _cholesky_qr(_cholesky_qr(x))
    eye = jnp.eye(q.shape[-1], dtype=q.dtype)
    err = jnp.abs(jnp.swapaxes(q, -1, -2) @ q - eye)
    ok = jnp.all(jnp.isfinite(q)) & (jnp.max(err) < 1e-3)
    return jax.lax.cond(ok, lambda: q, lambda: _householder(x))


def _randomized_basis(
    g: jax.Array, side: str, r: int, key: jax.Array, oversample: int, power_iters: int
) -> jax.Array:
    """Randomized range finder with subspace (power) iteration, then a small exact SVD.

    Halko, Martinsson & Tropp (2011), Algorithms 4.4 and 5.1: ``Q = orth(A Omega)``, a few rounds of
    ``Q = orth(A orth(A^T Q))``, then the top-``r`` left singular vectors of ``A`` from the SVD of
    the small ``Q^T A`` (from the eigendecomposition of its ``k x k`` Gram matrix). ``A`` is the
    leaf with the projected side first.
    """
    a = g.astype(jnp.float32)
    if side == "out":
        a = jnp.swapaxes(a, -1, -2)  # (..., fan_out, fan_in)
    d, e = a.shape[-2], a.shape[-1]
    k = min(r + oversample, d, e)
    omega = jax.random.normal(key, a.shape[:-2] + (e, k), jnp.float32)
    q = _orthonormal(a @ omega)
    for _ in range(power_iters):
        z = _orthonormal(jnp.swapaxes(a, -1, -2) @ q)
        q = _orthonormal(a @ z)
    small = jnp.swapaxes(q, -1, -2) @ a  # (..., k, e)
    return q @ _top_eigvecs(_gram(small), r)  # left singular vectors of the small k x e


def canonicalize_signs(basis: jax.Array) -> jax.Array:
    """Flips each basis vector (column) so that its largest-magnitude entry is positive."""
    idx = jnp.argmax(jnp.abs(basis), axis=-2, keepdims=True)
    sign = jnp.sign(jnp.take_along_axis(basis, idx, axis=-2))
    return basis * jnp.where(sign == 0, 1.0, sign)


def refresh_bases(
    mats: list[jax.Array],
    ranks: list[int],
    svd: str = "exact",
    key: jax.Array | None = None,
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
        if svd == "exact":
            bases = _exact_basis(batch, side, r_max)
        elif svd == "eigh":
            bases = _eigh_basis(batch, side, r_max)
        else:
            sub = jax.random.fold_in(key, gi)
            bases = _randomized_basis(batch, side, r_max, sub, oversample, power_iters)
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


def _path_str(path) -> str:
    return jax.tree_util.keystr(path) if path else "<leaf>"


def basis_shape(stage: str, path, u: Any, requested: int, module: str | None) -> tuple[jax.Array, int, int]:
    """``(matrix, d, r)`` of a leaf a projection stage receives: the matrix it projects, its
    projected side's size and the rank used (``requested`` clipped, with a warning naming the
    module). A ``ValueError`` naming ``stage`` and the parameter for a non-matrix or a bad rank."""
    m = _matrix_of(u)
    if m.ndim < 2:
        raise ValueError(
            f"{stage}: parameter {_path_str(path)} has shape {m.shape}; only matrices "
            "(..., fan_in, fan_out) can be projected (label it as a non-target)"
        )
    if not _is_int(requested):
        raise ValueError(f"rank must be a positive integer, got {requested!r}")
    r = effective_rank(m.shape, requested)
    rank_warning(path, m.shape, requested, r, module)
    d = m.shape[-2] if projection_side(m.shape) == "in" else m.shape[-1]
    return m, d, r


def zero_bases(stage: str, params: Any, rank_fn: Callable, name_fn: Callable) -> Any:
    """Zero bases ``(..., d, r)`` in each leaf's dtype for a projection stage's state (ranks
    checked and clipped, with :func:`basis_shape`)."""

    def make(path, u):
        m, d, r = basis_shape(stage, path, u, rank_fn(path), name_fn(path))
        return jnp.zeros(m.shape[:-2] + (d, r), m.dtype)

    return jax.tree_util.tree_map_with_path(make, params, is_leaf=is_node)


def rank_warning(path, shape: tuple[int, ...], requested: int, rank: int, module: str | None) -> None:
    """Warns, naming the module and both numbers, when the requested rank was clipped."""
    if rank < requested:
        what = f"module {module!r} at " if module else ""
        warnings.warn(
            f"projection rank {requested} for {what}{_path_str(path)} (Flax shape "
            f"{tuple(shape)}) exceeds min(fan_in, fan_out) = {rank}; clipped to {rank}",
            stacklevel=4,
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
    keep_source: bool = False,
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
      canonical_signs: flip each basis vector so its largest-magnitude entry is positive.
        Singular vectors are defined up to sign and LAPACK/cuSOLVER builds differ; with this the
        basis (and the run) no longer depends on the backend's convention. galore-torch keeps
        the raw signs (the default here).
      name: module type named in the clipping warning (e.g. ``'down'``), or a function of the
        key path giving it.
      keep_source: also carry the projected matrix in each :class:`LowRank` (``source``), for a
        following stage that works outside the subspace (:func:`fira_adam`).

    Returns:
      A transform that emits :class:`LowRank` nodes (inside ``Decomposed`` when given one).
    """
    _check_args(rank if not callable(rank) else 1, update_proj_gap, proj_type, svd)
    if not _is_int(oversample, minimum=0):
        raise ValueError(f"oversample must be a non-negative integer, got {oversample!r}")
    if not _is_int(power_iters, minimum=0):
        raise ValueError(f"power_iters must be a non-negative integer, got {power_iters!r}")
    rank_fn = rank if callable(rank) else (lambda path: rank)
    name_fn = name if callable(name) else (lambda path: name)

    def init_fn(params):
        basis = zero_bases("project", params, rank_fn, name_fn)
        return ProjectState(count=jnp.zeros([], jnp.int32), basis=basis)

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_node)
        old = treedef.flatten_up_to(state.basis)
        mats = [_matrix_of(u) for u in leaves]
        ranks = [o.shape[-1] for o in old]

        def refresh():
            key = jax.random.fold_in(jax.random.PRNGKey(seed), state.count)
            sources = [_refresh_matrix(u) for u in leaves]
            new = refresh_bases(sources, ranks, svd, key, oversample, power_iters, canonical_signs)
            return [n.astype(o.dtype) for n, o in zip(new, old, strict=True)]

        if leaves:
            bases = jax.lax.cond(state.count % update_proj_gap == 0, refresh, lambda: list(old))
        else:
            bases = []
        out = []
        for u, m, b in zip(leaves, mats, bases, strict=True):
            side = projection_side(m.shape)
            low = LowRank(project_value(m, b, side), b, side, source=m if keep_source else None)
            out.append(u.replace(direction=low, source=None) if isinstance(u, Decomposed) else low)
        new_state = ProjectState(
            count=optax.safe_increment(state.count),
            basis=jax.tree.unflatten(treedef, bases),
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformation(init_fn, update_fn)
