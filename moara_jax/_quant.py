"""Low-bit storage for the Q-GaLore host.

- 8-bit blockwise dynamic quantization of Adam moments, the storage of bitsandbytes' 8-bit
  optimizers (Dettmers et al., https://arxiv.org/abs/2110.02861): each unit (a matrix, or a whole
  plain leaf) is flattened, cut into blocks of 256 entries, each block scaled by its largest
  magnitude and every entry stored as the index (uint8) of the nearest value of a 256-entry
  "dynamic" map (signed for first moments, unsigned for second moments).
- Group-wise min-max integer quantization (``n_bit``-bit unsigned codes with a float scale and
  zero point per group of ``group_size`` consecutive entries), the quantization Q-GaLore
  (https://arxiv.org/abs/2407.08296) applies to projection bases (INT4) and weights (INT8), with
  round-to-nearest or stochastic rounding.
- :func:`adam8bit`: Adam with moments stored that way, the update of bitsandbytes' ``AdamW8bit``
  (``m_hat / (sqrt(v_hat) + eps)``); units under ``min_8bit_size`` entries keep float32 moments,
  as there.

Units of matrices are taken in the paper's (PyTorch) orientation, ``W = kernel^T``, each matrix
of a stacked leaf on its own, so blocks and groups run along the same entries as the reference
packages'.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moara_jax._adam import MAG, PLAIN, node_adam
from moara_jax._labels import path_names
from moara_jax._validate import check_adam, in_made_form_on_update, is_int

BLOCK_SIZE = 256
MIN_8BIT_SIZE = 4096


def flax_serializable(*fields: str):
    """Class decorator: ``flax.serialization`` writes the pytree class as ``{field: array}`` and
    restores it onto a target of the same static structure, so an optimizer state holding it
    goes through ``to_bytes``/``from_bytes`` (and ``to_state_dict``) as the NamedTuple states do.
    Without Flax installed, nothing is registered."""

    def register(cls):
        try:
            from flax import serialization
        except ImportError:  # the optimizer itself does not need Flax
            return cls

        def to_state(x):
            return {f: serialization.to_state_dict(getattr(x, f)) for f in fields}

        def from_state(target, state):
            missing = [f for f in fields if f not in state]
            if missing:
                raise ValueError(f"{cls.__name__} state dict lacks {', '.join(missing)}")
            children = [serialization.from_state_dict(getattr(target, f), state[f], name=f) for f in fields]
            if hasattr(target, "restored"):  # e.g. a state saved in another layout of the same entries
                return target.restored(children)
            return cls.tree_unflatten(target.tree_flatten()[1], children)

        serialization.register_serialization_state(cls, to_state, from_state, override=True)
        return cls

    return register


def _linspace32(start: float, stop: float, num: int) -> np.ndarray:
    """A float32 ``linspace`` whose step is rounded to float32 and whose points are computed in
    float64 from both ends (the first half from ``start``, the rest from ``stop``)."""
    start32, stop32 = np.float32(start), np.float32(stop)
    step = np.float64((stop32 - start32) / np.float32(num - 1))
    i = np.arange(num, dtype=np.float64)
    values = np.where(i < num // 2, np.float64(start32) + step * i, np.float64(stop32) - step * (num - 1 - i))
    return values.astype(np.float32)


@functools.cache
def dynamic_map(signed: bool = True) -> np.ndarray:
    """The 8-bit dynamic quantization map (256 sorted float32 values in [-1, 1] or [0, 1]).

    Seven decades ``10^-6 .. 10^0``; in decade ``i`` the midpoints of ``2^i + 1`` (signed) or
    ``2^(i+1) + 1`` (unsigned) evenly spaced points of ``[0.1, 1]``, scaled by ``10^(i-6)`` (and
    negated, when signed); plus 0 and 1, and zeros to fill 256 entries. Equal to bitsandbytes'
    ``create_dynamic_map`` (tested).

    Args:
      signed: the map of first moments (values in ``[-1, 1]``, symmetric but for the 1) if
        ``True``, of second moments (values in ``[0, 1]``) if ``False``.

    Returns:
      A read-only ``np.ndarray`` of shape ``(256,)``, float32, sorted ascending; cached: each call
      with the same ``signed`` returns the same array.
    """
    values = [np.float32(0.0), np.float32(1.0)]
    for i in range(7):
        points = _linspace32(0.1, 1.0, 2 ** (i + (0 if signed else 1)) + 1)
        means = (points[:-1] + points[1:]) / np.float32(2)
        decade = np.float32(10.0 ** (i - 6)) * means
        values += list(decade) + (list(-decade) if signed else [])
    values += [np.float32(0.0)] * (256 - len(values))
    out = np.sort(np.array(values, np.float32))
    out.setflags(write=False)
    return out


def unit_flat(x: jax.Array, batch_ndim: int, transpose: bool) -> jax.Array:
    """``x`` as ``(*batch, n)`` units: the axes after ``batch_ndim`` flattened (row-major), after
    swapping the last two when ``transpose`` (a Flax kernel read as PyTorch's weight)."""
    if transpose:
        x = jnp.swapaxes(x, -1, -2)
    return x.reshape(x.shape[:batch_ndim] + (-1,))


def _as_rows(a: jax.Array, transpose: bool) -> jax.Array:
    """The last two axes swapped for a ``transpose``d unit (a Flax kernel as PyTorch's rows, and
    back: a transpose is its own inverse), else ``a``."""
    return jnp.swapaxes(a, -1, -2) if transpose else a


def unit_restore(flat: jax.Array, shape: tuple[int, ...], transpose: bool) -> jax.Array:
    """Inverse of :func:`unit_flat` for an array of ``shape``."""
    if transpose:
        t = shape[:-2] + (shape[-1], shape[-2])
        return jnp.swapaxes(flat.reshape(t), -1, -2)
    return flat.reshape(shape)


@flax_serializable("codes", "absmax")
@jax.tree_util.register_pytree_node_class
class Blockwise8bit:
    """An array stored as 8-bit dynamic-map codes with one float32 scale per block of entries.

    Each unit (the trailing axes after ``batch_ndim``, transposed first when ``transpose``) is
    read row-major in blocks of ``block_size`` entries. Where a unit of two axes holds whole
    blocks in each row, ``codes`` has the array's own shape (uint8; the rows swapped back for a
    ``transpose``d unit) and ``absmax`` the block maxima in the same orientation: the blocks of
    the flat layout, but sharded as the array is (a flat array's shards would not line up with the
    gradient's, and each update would gather the whole moment to every device). Otherwise
    ``codes`` is ``(*batch, n)`` and ``absmax`` ``(*batch, ceil(n / block_size))``. ``shape``,
    ``batch_ndim``, ``transpose``, ``signed`` and ``block_size`` are static.
    """

    def __init__(self, codes, absmax, shape, batch_ndim, transpose, signed, block_size=BLOCK_SIZE):
        self.codes = codes
        self.absmax = absmax
        self.shape = tuple(shape)
        self.batch_ndim = batch_ndim
        self.transpose = transpose
        self.signed = signed
        self.block_size = block_size

    def tree_flatten(self):
        aux = (self.shape, self.batch_ndim, self.transpose, self.signed, self.block_size)
        return (self.codes, self.absmax), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @staticmethod
    def in_rows(shape, batch_ndim: int, transpose: bool, block_size: int = BLOCK_SIZE) -> bool:
        """Whether an array of ``shape`` is stored in its own shape: units of two axes whose
        rows (the unit's last axis, after the transpose) hold whole blocks."""
        unit = tuple(shape)[batch_ndim:]
        return len(unit) == 2 and unit[0 if transpose else 1] % block_size == 0

    @classmethod
    def zeros(cls, shape, batch_ndim, transpose, signed, block_size=BLOCK_SIZE) -> Blockwise8bit:
        """All zeros (zero scales), as bitsandbytes initialises its 8-bit states."""
        shape = tuple(shape)
        if cls.in_rows(shape, batch_ndim, transpose, block_size):
            blocks = -2 if transpose else -1
            scales = list(shape)
            scales[blocks] //= block_size
            codes, absmax = jnp.zeros(shape, jnp.uint8), jnp.zeros(tuple(scales), jnp.float32)
        else:
            n = math.prod(shape[batch_ndim:])
            codes = jnp.zeros(shape[:batch_ndim] + (n,), jnp.uint8)
            absmax = jnp.zeros(shape[:batch_ndim] + (-(-n // block_size),), jnp.float32)
        return cls(codes, absmax, shape, batch_ndim, transpose, signed, block_size)

    @classmethod
    def quantize(cls, x, batch_ndim, transpose, signed, block_size=BLOCK_SIZE) -> Blockwise8bit:
        x32 = x.astype(jnp.float32)
        if cls.in_rows(x.shape, batch_ndim, transpose, block_size):
            codes, absmax = blockwise_quantize(_as_rows(x32, transpose), dynamic_map(signed), block_size)
            codes, absmax = _as_rows(codes, transpose), _as_rows(absmax, transpose)
        else:
            codes, absmax = blockwise_quantize(
                unit_flat(x32, batch_ndim, transpose), dynamic_map(signed), block_size
            )
        return cls(codes, absmax, x.shape, batch_ndim, transpose, signed, block_size)

    @property
    def _stored_in_rows(self) -> bool:
        return self.in_rows(self.shape, self.batch_ndim, self.transpose, self.block_size)

    def dequantize(self) -> jax.Array:
        code = dynamic_map(self.signed)
        if self._stored_in_rows:
            rows = functools.partial(_as_rows, transpose=self.transpose)
            return rows(blockwise_dequantize(rows(self.codes), rows(self.absmax), code, self.block_size))
        flat = blockwise_dequantize(self.codes, self.absmax, code, self.block_size)
        return unit_restore(flat, self.shape, self.transpose)

    def restored(self, children) -> Blockwise8bit:
        """This array's structure with restored ``(codes, absmax)``; those of the flat layout
        (a state saved before arrays were stored in their own shape) laid out as this one's."""
        codes, absmax = children
        if self._stored_in_rows and codes.ndim != len(self.shape):
            rows = functools.partial(_as_rows, transpose=self.transpose)
            codes = rows(codes.reshape(rows(self.codes).shape))
            absmax = rows(absmax.reshape(rows(self.absmax).shape))
        return type(self)(
            codes, absmax, self.shape, self.batch_ndim, self.transpose, self.signed, self.block_size
        )

    def torch_codes(self) -> jax.Array:
        """The codes in the order PyTorch's 8-bit state holds them (row-major over the unit,
        after the transpose): ``(*batch, n)``."""
        codes = _as_rows(self.codes, self.transpose) if self._stored_in_rows else self.codes
        return codes.reshape(codes.shape[: self.batch_ndim] + (-1,))

    def __repr__(self) -> str:
        return f"Blockwise8bit(shape={self.shape}, signed={self.signed})"


def _split_blocks(flat: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """``(full blocks (..., k, B), remainder (..., n - k B))`` of the last axis."""
    n = flat.shape[-1]
    k = n // block_size
    full = flat[..., : k * block_size].reshape(flat.shape[:-1] + (k, block_size))
    return full, flat[..., k * block_size :]


def blockwise_quantize(flat: jax.Array, code: np.ndarray, block_size: int = BLOCK_SIZE):
    """8-bit codes and per-block absolute maxima of ``flat`` (``(..., n)``, float32).

    Entries are scaled into ``[-1, 1]`` by their block's absolute maximum (a full block by
    multiplying with its reciprocal, a last partial block by dividing, as bitsandbytes does) and
    mapped to the nearest entry of ``code`` (ties to the lower one).
    """
    full, rest = _split_blocks(flat, block_size)
    amax_full = jnp.max(jnp.abs(full), axis=-1)
    # A zero block scales to zeros (bitsandbytes' 1e-38 floor on the maximum would be flushed to
    # zero, and give NaN, where the backend flushes subnormals).
    inverse = jnp.where(amax_full > 0, 1.0 / jnp.where(amax_full > 0, amax_full, 1.0), 0.0)
    scaled = [jnp.clip(full * inverse[..., None], -1.0, 1.0).reshape(flat.shape[:-1] + (-1,))]
    absmax = [amax_full]
    if rest.shape[-1]:
        amax_rest = jnp.max(jnp.abs(rest), axis=-1, keepdims=True)
        safe = jnp.where(amax_rest > 0, amax_rest, 1.0)
        scaled.append(jnp.where(amax_rest > 0, jnp.clip(rest / safe, -1.0, 1.0), 0.0))
        absmax.append(amax_rest)
    scaled = jnp.concatenate(scaled, axis=-1) if len(scaled) > 1 else scaled[0]
    absmax = jnp.concatenate(absmax, axis=-1) if len(absmax) > 1 else absmax[0]
    code = np.asarray(code, np.float32)
    bounds = jnp.asarray((code[:-1] + code[1:]) / np.float32(2))
    codes = jnp.searchsorted(bounds, scaled, side="left").astype(jnp.uint8)
    return codes, absmax


def blockwise_dequantize(codes: jax.Array, absmax: jax.Array, code: np.ndarray, block_size: int = BLOCK_SIZE):
    """Inverse of :func:`blockwise_quantize`: ``code[codes]`` times the block's maximum."""
    values = jnp.asarray(code, jnp.float32)[codes.astype(jnp.int32)]
    full, rest = _split_blocks(values, block_size)
    k = full.shape[-2]
    out = (full * absmax[..., :k, None]).reshape(values.shape[:-1] + (-1,))
    if rest.shape[-1]:
        out = jnp.concatenate([out, rest * absmax[..., k:]], axis=-1)
    return out


def group_quantize(
    x: jax.Array, group_size: int, n_bit: int, key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Min-max quantization of ``x`` (``(..., n)``, ``n`` a multiple of ``group_size``) in
    groups of ``group_size`` consecutive entries: ``(codes, scales, zeros)`` with ``codes`` in
    ``[0, 2^n_bit - 1]`` (uint8), ``x ~ scales * (codes - zeros)``.

    ``scales = max(max - min, 1e-5) / (2^n_bit - 1)``, ``zeros = clip(round(-min / scales))``;
    codes round to nearest (ties to even), or stochastically when ``key`` is given (up with
    probability equal to the fractional part: unbiased on the grid).
    """
    max_int = 2**n_bit - 1
    groups = x.reshape(x.shape[:-1] + (-1, group_size)).astype(jnp.float32)
    hi = jnp.max(groups, axis=-1, keepdims=True)
    lo = jnp.min(groups, axis=-1, keepdims=True)
    scales = jnp.maximum(hi - lo, 1e-5) / max_int
    zeros = jnp.clip(-jnp.round(lo / scales), 0, max_int)
    if key is None:
        q = jnp.round(groups / scales)
    else:
        ratio = groups / scales
        down = jnp.floor(ratio)
        q = jnp.where(jax.random.uniform(key, ratio.shape) < ratio - down, jnp.ceil(ratio), down)
    codes = jnp.clip(q + zeros, 0, max_int).astype(jnp.uint8)
    return codes, scales, zeros


def group_dequantize(codes: jax.Array, scales: jax.Array, zeros: jax.Array) -> jax.Array:
    """``scales * (codes - zeros)``, groups merged back into the last axis."""
    out = (codes.astype(jnp.float32) - zeros) * scales
    return out.reshape(out.shape[:-2] + (-1,))


def _moment_step(g, mu, nu, count_inc, b1, b2, eps):
    """bitsandbytes' Adam on one value: float32 math on dequantized moments, requantized after."""
    quantized = isinstance(mu, Blockwise8bit)
    g32 = g.astype(jnp.float32)
    m = mu.dequantize() if quantized else mu
    v = nu.dequantize() if quantized else nu
    m = m * b1 + (1.0 - b1) * g32
    v = v * b2 + ((1.0 - b2) * g32) * g32
    t = count_inc.astype(jnp.float32)
    c1 = 1.0 - b1**t
    c2 = jnp.sqrt(1.0 - b2**t)
    if quantized:
        direction = m / (jnp.sqrt(v) / c2 + eps) / c1
        spec = (mu.batch_ndim, mu.transpose)
        m = Blockwise8bit.quantize(m, *spec, signed=True, block_size=mu.block_size)
        v = Blockwise8bit.quantize(v, *spec, signed=False, block_size=nu.block_size)
    else:
        direction = (c2 / c1) * (m / (jnp.sqrt(v) + eps * c2))
    return direction.astype(g.dtype), m, v


def moment_units(x: Any, kind: str, path: Any) -> tuple[int, bool]:
    """``(batch_ndim, transpose)`` of the units an 8-bit moment of ``x`` is quantized in: what
    PyTorch would hold as one tensor. A projected value or block magnitudes: each matrix, in
    PyTorch orientation. A plain leaf, by its Flax name: a ``kernel`` is each matrix, transposed
    (PyTorch's weight); a ``scale`` or ``bias`` each vector (one per layer when layers are
    stacked); anything else (an ``embedding``) the whole leaf."""
    if x.ndim < 2:
        return 0, False
    if kind != PLAIN:
        return x.ndim - 2, True
    name = path_names(path)[-1] if path else ""
    if name == "kernel":
        return x.ndim - 2, True
    if name in ("scale", "bias"):
        return x.ndim - 1, False
    return 0, False


def adam8bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    *,
    min_8bit_size: int = MIN_8BIT_SIZE,
    mag_bits: int = 8,
    block_size: int = BLOCK_SIZE,
) -> optax.GradientTransformation:
    """Adam with 8-bit blockwise moments, on leaves and the chain's nodes (bitsandbytes' 8-bit
    ``AdamW`` update, ``m_hat / (sqrt(v_hat) + eps)``, without weight decay or learning rate).

    A unit (what PyTorch would hold as one tensor: each matrix of a stacked leaf, each norm) with
    fewer than ``min_8bit_size`` entries keeps float32 moments, as bitsandbytes does.
    ``mag_bits=32`` keeps the block magnitudes' moments in float32 (the paper's Q-GaLore
    precision ablation).

    Args:
      b1, b2, eps: Adam's decay rates and stabiliser (``eps`` added to ``sqrt(v_hat)``).
      min_8bit_size: units with fewer entries keep float32 moments (a non-negative integer; 0
        quantizes every unit).
      mag_bits: 8, or 32 for float32 moments of the block magnitudes of ``Decomposed`` nodes.
      block_size: entries per quantization block (one float32 scale each).

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`InnerAdamState`, its moments
      :class:`Blockwise8bit` (first moments on the signed :func:`dynamic_map`, second on the
      unsigned one) or float32 arrays. ``update`` maps a gradient to its Adam direction (float32
      math, in the gradient's dtype), a :class:`LowRank` to a ``LowRank`` of directions with the
      same basis and a :class:`Decomposed` to a ``Decomposed`` of directions; it also takes the
      state as Flax nnx's ``Optimizer`` hands it back.

    Raises:
      ValueError: for ``b1`` or ``b2`` outside ``[0, 1)`` (or an array of a float dtype narrower
        than float32), a negative ``eps``, ``mag_bits`` not 8 or 32, a ``min_8bit_size`` that is
        not a non-negative integer, or a ``block_size`` that is not a positive integer.
    """
    check_adam(b1, b2, eps)
    if mag_bits not in (8, 32):
        raise ValueError(f"mag_bits must be 8 or 32, got {mag_bits!r}")
    if not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(f"min_8bit_size must be a non-negative integer, got {min_8bit_size!r}")
    if not is_int(block_size):
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")

    def init_moments(x, kind, path) -> tuple[Any, Any]:
        batch_ndim, transpose = moment_units(x, kind, path)
        unit = math.prod(x.shape[batch_ndim:])
        if unit < min_8bit_size or (kind == MAG and mag_bits == 32):
            return jnp.zeros(x.shape, jnp.float32), jnp.zeros(x.shape, jnp.float32)
        spec = (x.shape, batch_ndim, transpose)
        return (
            Blockwise8bit.zeros(*spec, signed=True, block_size=block_size),
            Blockwise8bit.zeros(*spec, signed=False, block_size=block_size),
        )

    def step(g, mu, nu, count_inc, kind):
        del kind
        return _moment_step(g, mu, nu, count_inc, b1, b2, eps)

    # Its quantized moments are nodes that Flax nnx's Optimizer hands back as mappings.
    return in_made_form_on_update(node_adam(init_moments, step))
