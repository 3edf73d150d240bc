"""How a projection basis is computed: the top-``r`` singular vectors of a batch of matrices on
the projected side, exactly (SVD), from the Gram matrix's eigendecomposition (fast on GPU), or
by a randomized range finder with CholeskyQR2 orthonormalisation; and sign canonicalisation.

``top_basis`` is what :func:`moara_jax._projection.refresh_bases` calls per same-shaped batch.
Under a mesh (``jax.set_mesh``) the batch is spread over the mesh's devices, each factoring its
share of the matrices (``spread``), instead of every device factoring all of them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def per_matrix(fn, x: jax.Array):
    """Applies a LAPACK-backed ``fn`` to a batch of matrices ``(B, a, b)``.

    On CPU the batch is looped with ``lax.map``: jaxlib's batched LAPACK kernels fan a batch out
    over the intra-op thread pool and wait for it, and several CPU devices doing that at once
    (a sharded run under ``--xla_force_host_platform_device_count``) can deadlock the pool. On GPU
    the batched cuSOLVER call is kept.
    """
    if x.ndim > 2 and x.shape[0] > 1 and jax.default_backend() == "cpu":
        return jax.lax.map(fn, x)
    return fn(x)


def spread(fn, *batches: jax.Array) -> jax.Array:
    """``fn(*batches)`` for batches of matrices ``(B, ...)`` (one leading size ``B``), with each
    device of the context mesh (``jax.set_mesh``; its axes not already manual) computing
    ``ceil(B / n)`` of the results, ``n = mesh.size``, instead of every device all of them;
    ``fn(*batches)`` as is with no such mesh. ``fn`` must treat the matrices independently.

    The batches are gathered whole on every device first (gradients are sharded across matrix
    dimensions, the shares are along the batch: each device then takes its share locally; a
    factorisation needed them whole on every device before), and the results are gathered back,
    replicated, so that each lands in its state's sharding by a local slice. A batch that ``n``
    does not divide is filled up with copies of its first matrices (real input: no zero matrix
    for a factorisation to degenerate on); their results are dropped. Each matrix is factored
    exactly as without the mesh. Auto and Explicit mesh axes alike; in or outside ``jit``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    kinds = () if mesh.empty else tuple(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = any(kind == AxisType.Explicit for _, kind in kinds)
    # On a mesh of both kinds, over its Explicit axes (reshard names no Auto axis).
    wanted = AxisType.Explicit if explicit else AxisType.Auto
    axes = tuple(a for a, kind in kinds if kind == wanted)
    n = math.prod(mesh.shape[a] for a in axes)
    if n == 1:
        return fn(*batches)
    # On Explicit axes a layout is changed by reshard (there a sharding constraint only asserts).
    place = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint
    b = batches[0].shape[0]
    total = -(-b // n) * n

    @jax.jit
    def shares(*xs):
        whole = [place(x, P()) for x in xs]
        filled = [jnp.concatenate([x] * -(-total // b), axis=0)[:total] if total > b else x for x in whole]
        if explicit:
            filled = [place(x, P(axes)) for x in filled]
        out = jax.shard_map(fn, mesh=mesh, in_specs=P(axes), out_specs=P(axes), axis_names=set(axes))(*filled)
        return place(out, P())[:b]

    return shares(*batches)


def thin_svd(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return per_matrix(lambda x: jnp.linalg.svd(x, full_matrices=False), w)


def _exact_basis(g: jax.Array, side: str, r: int) -> jax.Array:
    """Top-``r`` singular vectors of the projected side, float32, like galore-torch.

    The SVD is taken of the paper-orientation matrix ``W = g^T``, as galore-torch does. Its
    vectors' signs are still the backend's: XLA's and torch's SVDs may flip some of them (seen on
    wide matrices), and the moments carried across a refresh then differ from the reference's;
    ``canonical_signs=True`` (and the same sign rule on the reference's side) removes that.
    """
    w = jnp.swapaxes(g.astype(jnp.float32), -1, -2)  # (..., fan_out, fan_in)
    u, _, vh = thin_svd(w)
    if side == "in":
        return jnp.swapaxes(vh[..., :r, :], -1, -2)  # (..., fan_in, r)
    return u[..., :, :r]  # (..., fan_out, r)


def _top_eigvecs(gram: jax.Array, r: int) -> jax.Array:
    """Eigenvectors of the symmetric ``gram`` for its ``r`` largest eigenvalues, descending."""
    vecs, _ = per_matrix(lambda x: jax.lax.linalg.eigh(x), gram)  # ascending eigenvalues
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
    return _top_eigvecs(_gram(_oriented(g, side)), r)


def _householder(x: jax.Array) -> jax.Array:
    return per_matrix(lambda m: jnp.linalg.qr(m)[0], x)


def _cholesky_qr(y: jax.Array) -> jax.Array:
    """One shifted CholeskyQR pass: ``y L^-T`` with ``L L^T = y^T y + shift I``."""
    gram = _gram(jnp.swapaxes(y, -1, -2))  # y^T y
    k = gram.shape[-1]
    shift = 1e-6 * jnp.trace(gram, axis1=-2, axis2=-1)[..., None, None] / k + 1e-30
    chol = jnp.linalg.cholesky(gram + shift * jnp.eye(k, dtype=gram.dtype))
    return jax.lax.linalg.triangular_solve(chol, y, left_side=False, lower=True, transpose_a=True)


def orthonormal(x: jax.Array) -> jax.Array:
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


def _oriented(g: jax.Array, side: str) -> jax.Array:
    """The leaf as float32 with the projected side first (rows)."""
    a = g.astype(jnp.float32)
    return jnp.swapaxes(a, -1, -2) if side == "out" else a  # "out": (..., fan_out, fan_in)


def _randomized_basis(
    g: jax.Array, side: str, r: int, key: jax.Array, oversample: int, power_iters: int
) -> jax.Array:
    """Randomized range finder with subspace (power) iteration, then a small exact SVD.

    Halko, Martinsson & Tropp (2011), Algorithms 4.4 and 5.1: ``Q = orth(A Omega)``, a few rounds of
    ``Q = orth(A orth(A^T Q))``, then the top-``r`` left singular vectors of ``A`` from the SVD of
    the small ``Q^T A`` (from the eigendecomposition of its ``k x k`` Gram matrix). ``A`` is the
    leaf with the projected side first.
    """
    a = _oriented(g, side)
    d, e = a.shape[-2], a.shape[-1]
    k = min(r + oversample, d, e)
    omega = jax.random.normal(key, a.shape[:-2] + (e, k), jnp.float32)
    q = orthonormal(a @ omega)
    for _ in range(power_iters):
        z = orthonormal(jnp.swapaxes(a, -1, -2) @ q)
        q = orthonormal(a @ z)
    small = jnp.swapaxes(q, -1, -2) @ a  # (..., k, e)
    return q @ _top_eigvecs(_gram(small), r)  # left singular vectors of the small k x e


def canonicalize_signs(basis: jax.Array) -> jax.Array:
    """Flips each basis vector (column) so that its largest-magnitude entry is positive."""
    idx = jnp.argmax(jnp.abs(basis), axis=-2, keepdims=True)
    sign = jnp.sign(jnp.take_along_axis(basis, idx, axis=-2))
    return basis * jnp.where(sign == 0, 1.0, sign)


def top_basis(
    batch: jax.Array,
    side: str,
    r: int,
    svd: str = "exact",
    key: jax.Array | None = None,
    oversample: int = 8,
    power_iters: int = 2,
) -> jax.Array:
    """Float32 bases ``(B, d, r)`` of a batch ``(B, a, b)`` by ``svd``: ``exact``, ``eigh`` or
    ``randomized`` (seeded by ``key``). ``exact`` and ``eigh`` are spread over the context mesh's
    devices (``spread``); ``randomized`` is not: its products with the gradients contract over
    the dimensions FSDP shards, so it runs on the shards as they are, where a spread would gather
    each group whole on every device (more memory, and no time gained in
    ``benchmarks/refresh_methods.py --spread``)."""
    if svd == "randomized":
        return _randomized_basis(batch, side, r, key, oversample, power_iters)
    basis = {"exact": _exact_basis, "eigh": _eigh_basis}[svd]
    return spread(lambda g: basis(g, side, r), batch)
