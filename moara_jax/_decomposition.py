"""Block-wise magnitude--direction decomposition (paper Section 3.1, Appendix B.1).

Pure functions. The public pair works in the paper's orientation: a gradient ``g`` of shape
``(..., m, n)`` (m = fan_out rows, n = fan_in columns; leading axes are batch axes) is split along
each row into contiguous blocks of ``block_size`` entries, right-zero-padded to a multiple of the
block size. The private ``*_along`` helpers do the same math along any axis, which is how the Optax
stages work on Flax kernels ``(..., fan_in, fan_out)`` without transposing them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moara_jax._validate import check_block_size

DEFAULT_EPS = 1e-12
# Flax kernels are (..., fan_in, fan_out): the fan_in axis is where the Optax stages' blocks run.
FAN_IN_AXIS = -2


def num_blocks(n: int, block_size: int) -> int:
    """Number of blocks ``ceil(n / block_size)`` a row of ``n`` entries is split into.

    Args:
      n: the row's length (the paper's ``n``, fan_in).
      block_size: the block size ``B``, a positive integer (``ValueError`` otherwise).

    Returns:
      ``ceil(n / block_size)``, a Python int.
    """
    check_block_size(block_size)
    return math.ceil(n / block_size)


def _blocked(x: jnp.ndarray, block_size: int, axis: int) -> jnp.ndarray:
    """Pads ``axis`` to a multiple of ``block_size`` and splits it into ``(k, block_size)``."""
    axis = axis % x.ndim
    n = x.shape[axis]
    k = num_blocks(n, block_size)
    pad = k * block_size - n
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths)
    return x.reshape(x.shape[:axis] + (k, block_size) + x.shape[axis + 1 :])


def _unblocked(x: jnp.ndarray, n: int, axis: int) -> jnp.ndarray:
    """Inverse of :func:`_blocked`: merges ``(k, block_size)`` at ``axis`` and crops to ``n``."""
    axis = axis % (x.ndim - 1)
    merged = x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])
    return jax.lax.slice_in_dim(merged, 0, n, axis=axis)


@jax.custom_jvp
def _sqrt(x: jnp.ndarray) -> jnp.ndarray:
    """``sqrt``, whose derivative at 0 is taken as 0, not inf (``inf * 0`` made a zero block's
    gradient NaN under ``jax.grad``). Only the derivative is another: the values and the program
    jit compiles without differentiation are sqrt's (a ``where`` about the norm changed XLA's
    fusion of the block sums, and their rounding)."""
    return jnp.sqrt(x)


@_sqrt.defjvp
def _sqrt_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = jnp.sqrt(x)
    positive = x > 0
    return y, jnp.where(positive, t / (2.0 * jnp.where(positive, y, 1.0)), 0.0)


def decompose_along(
    g: jnp.ndarray, block_size: int, axis: int, eps: float = DEFAULT_EPS
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Block decomposition along ``axis``: returns ``(mag, dir)``.

    ``mag`` has ``axis`` replaced by ``ceil(n / block_size)``; ``dir`` has ``g``'s shape. The norm is
    taken in float32 (and returned in float32); ``dir`` keeps ``g``'s dtype.
    """
    check_block_size(block_size)
    axis = axis % g.ndim
    n = g.shape[axis]
    g32 = g.astype(jnp.float32)
    blocks = _blocked(g32, block_size, axis)
    mag = _sqrt(jnp.sum(jnp.square(blocks), axis=axis + 1))
    # The quotients on the unpadded gradient, each magnitude repeated over its block: a padded
    # direction would be cropped by a copy of its own (XLA does not fuse that slice into the
    # projection that reads it).
    rep = jax.lax.slice_in_dim(jnp.repeat(mag, block_size, axis=axis), 0, n, axis=axis)
    direction = g32 / (rep + eps)
    return mag, direction.astype(g.dtype)


def recompose_along(mag: jnp.ndarray, direction: jnp.ndarray, block_size: int, axis: int) -> jnp.ndarray:
    """``Rep_B(mag) * dir`` along ``axis``, in ``dir``'s shape; float32 math, ``dir``'s dtype out."""
    check_block_size(block_size)
    axis = axis % direction.ndim
    n = direction.shape[axis]
    expected = math.ceil(n / block_size)
    if mag.shape[axis] != expected:
        raise ValueError(
            f"mag has {mag.shape[axis]} blocks on axis {axis}, expected ceil({n}/{block_size}) = {expected}"
        )
    # Broadcast each magnitude over its block (no materialised Rep_B), then crop the padding.
    blocks = _blocked(direction.astype(jnp.float32), block_size, axis)
    out = blocks * jnp.expand_dims(mag.astype(jnp.float32), axis + 1)
    return _unblocked(out, n, axis).astype(direction.dtype)


def block_decompose(
    g: jnp.ndarray, block_size: int, eps: float = DEFAULT_EPS
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Splits ``g`` of shape ``(..., m, n)`` into block magnitudes and unit-norm block directions.

    Each row is split into contiguous blocks of ``block_size`` entries (the last one right-zero-
    padded); ``m_ij = ||g_ij||_2`` and ``v_ij = g_ij / (m_ij + eps)``, with ``eps`` in the
    denominator only. Padding is discarded.

    Args:
      g: array of shape ``(..., m, n)`` in the paper's orientation (rows = fan_out units).
      block_size: the block size ``B >= 1``. ``B = 1`` gives signs, ``B >= n`` row-wise norms.
      eps: stabiliser in the denominator.

    Returns:
      ``(mag, dir)``: ``mag`` of shape ``(..., m, ceil(n / B))`` in float32 and ``dir`` of ``g``'s
      shape and dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> mag, d = block_decompose(jnp.array([[3.0, 4.0, 0.0]]), block_size=2)
      >>> mag.tolist()
      [[5.0, 0.0]]
    """
    if g.ndim < 2:
        raise ValueError(f"block_decompose needs a matrix (..., m, n), got shape {g.shape}")
    return decompose_along(g, block_size, axis=-1, eps=eps)


def block_recompose(mag: jnp.ndarray, direction: jnp.ndarray, block_size: int) -> jnp.ndarray:
    """Inverse of :func:`block_decompose` (up to ``eps``): ``Rep_B(mag) * dir``, cropped to ``n``.

    Args:
      mag: block magnitudes ``(..., m, ceil(n / B))``, as :func:`block_decompose` returns them
        (``ValueError`` for another number of blocks on the last axis).
      direction: block directions ``(..., m, n)`` in the paper's orientation (``ValueError`` for
        fewer than 2 axes).
      block_size: the block size ``B`` the magnitudes were taken with, a positive integer.

    Returns:
      ``Rep_B(mag) * dir``, each magnitude multiplied into its block of ``B`` entries of the row,
      of ``direction``'s shape and dtype (computed in float32).
    """
    if direction.ndim < 2:
        raise ValueError(f"block_recompose needs a matrix (..., m, n), got {direction.shape}")
    return recompose_along(mag, direction, block_size, axis=-1)


def alignment(g: jnp.ndarray, g_recon: jnp.ndarray, eps: float = 1e-30) -> jnp.ndarray:
    """Cosine similarity of the flattened matrices ``g`` and ``g_recon``.

    Leading axes are batch axes: for inputs ``(..., a, b)`` the result has shape ``(...)``, one
    cosine per matrix. Computed in float32; a zero matrix gives 0, never NaN.

    Args:
      g, g_recon: arrays of one shape ``(..., a, b)`` (``ValueError`` for two shapes), in either
        orientation (the cosine does not depend on it).
      eps: the denominator's floor: the cosine is ``<g, g_recon> / max(|g| |g_recon|, eps)``,
        each matrix first divided by its largest magnitude.

    Returns:
      A float32 array of shape ``g.shape[:-2]``: the cosine of each pair of matrices.
    """
    if g.shape != g_recon.shape:
        raise ValueError(f"alignment needs equal shapes, got {g.shape} and {g_recon.shape}")
    # Each matrix is first scaled by its largest magnitude (the cosine does not change), so
    # the squared norms can neither underflow nor overflow in float32.
    a = _unit_max(g.astype(jnp.float32))
    b = _unit_max(g_recon.astype(jnp.float32))
    dot = jnp.sum(a * b, axis=(-2, -1))
    norms = jnp.sqrt(jnp.sum(a * a, axis=(-2, -1))) * jnp.sqrt(jnp.sum(b * b, axis=(-2, -1)))
    return dot / jnp.maximum(norms, eps)


def _unit_max(x: jnp.ndarray) -> jnp.ndarray:
    """``x`` divided by its largest magnitude per matrix (a zero matrix stays zero)."""
    peak = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)
    return x / jnp.where(peak > 0, peak, 1.0)
