"""Building blocks shared by the families: RMSNorm, SwiGLU MLP, rotary embeddings, attention."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp

from models.configs import ModelConfig, rope_scaling_type

Axes = tuple[str | None, ...]


def dense(features: int, cfg: ModelConfig, axes: Axes, name: str, bias: bool = False) -> nn.Dense:
    """A linear layer named like HF's, kernel ``(fan_in, fan_out)`` with logical axis names."""
    init = nn.initializers.normal(cfg.initializer_range)
    return nn.Dense(
        features,
        use_bias=bias,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        kernel_init=nn.with_logical_partitioning(init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
        name=name,
    )


class RMSNorm(nn.Module):
    """HF's RMSNorm: float32 normalisation, then ``weight * x`` in the input dtype."""

    eps: float
    param_dtype: Any = jnp.float32
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * x32.astype(x.dtype)


def rms_norm(cfg: ModelConfig, name: str, axis_name: str = "norm", eps: float | None = None) -> RMSNorm:
    """RMSNorm with the model's ``rms_norm_eps`` unless ``eps`` is given."""
    eps = cfg.rms_norm_eps if eps is None else eps
    return RMSNorm(eps, jnp.dtype(cfg.param_dtype), axis_name, name=name)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gate = dense(cfg.intermediate_size, cfg, ("embed", "mlp"), "gate_proj")(x)
        up = dense(cfg.intermediate_size, cfg, ("embed", "mlp"), "up_proj")(x)
        return dense(cfg.hidden_size, cfg, ("mlp", "embed"), "down_proj")(nn.silu(gate) * up)


def inv_frequencies(dim: int, theta: float, scaling: dict | None) -> jnp.ndarray:
    """RoPE inverse frequencies, with HF's ``llama3`` scaling when ``scaling`` asks for it."""
    inv = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if rope_scaling_type(scaling) == "default":  # ModelConfig admits only default and llama3
        return inv
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * jnp.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_half(x, positions, inv):
    """Llama-style RoPE (``rotate_half``) on ``x (B, T, N, H)``."""
    freqs = positions[:, None].astype(jnp.float32) * inv[None, :]  # (T, H/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def rope_interleaved(x, positions, inv):
    """DeepSeek-V2's RoPE: adjacent pairs rotated as complex numbers, on ``x (B, T, N, H)``."""
    freqs = positions[:, None].astype(jnp.float32) * inv[None, :]  # (T, H/2)
    cos, sin = jnp.cos(freqs)[None, :, None, :], jnp.sin(freqs)[None, :, None, :]
    x32 = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    re, im = x32[..., 0], x32[..., 1]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


# cuDNN's flash attention (through jax.nn.dot_product_attention): half-precision operands and a
# head width that is a multiple of 8, at most 128 (256 on Hopper; 128 holds on every GPU it runs on).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_WIDTH = 128
CUDNN_MIN_CAPABILITY = 8.0  # cuDNN's flash attention: Ampere (sm80) or newer


def attention_width(cfg: ModelConfig) -> int:
    """The head width attention runs at: the head size, or for MLA the wider of the query/key and
    value widths (the narrower side is zero-padded, see :func:`causal_attention`)."""
    if cfg.model_type == "deepseek_v2":
        return max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
    return cfg.head_size


def default_platform() -> str:
    """``'cuda'``, ``'rocm'``, ``'cpu'`` or ``'tpu'``: the platform of JAX's default backend."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = jax.extend.backend.get_backend().platform_version.lower()
        return "rocm" if "rocm" in version else "cuda"
    return platform


def cuda_compute_capability() -> float | None:
    """The default device's CUDA compute capability (e.g. 9.0 on an H100), None elsewhere."""
    value = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def attention_implementation(
    cfg: ModelConfig, platform: str | None = None, compute_capability: float | None = None
) -> str:
    """``'cudnn'`` or ``'xla'``: ``cfg.attention_impl`` when set, else cuDNN's flash attention where it
    applies (``platform`` ``'cuda'``, by default the default backend's, on a GPU of compute
    capability ``CUDNN_MIN_CAPABILITY`` or newer (by default the default device's; a platform
    given without one is taken as such a GPU); compute dtype bf16 or fp16; a head width that is a
    multiple of 8, at most 128), else XLA's (float32 compute, CPU, TPU, ROCm, older GPUs)."""
    if cfg.attention_impl is not None:
        return cfg.attention_impl
    if platform is None:
        platform = default_platform()
        if platform == "cuda" and compute_capability is None:
            compute_capability = cuda_compute_capability()
    width = attention_width(cfg)
    fits = cfg.dtype in CUDNN_DTYPES and width % 8 == 0 and width <= CUDNN_MAX_HEAD_WIDTH
    capable = compute_capability is None or compute_capability >= CUDNN_MIN_CAPABILITY
    return "cudnn" if platform == "cuda" and capable and fits else "xla"


def causal_attention(q, k, v, cfg: ModelConfig, scale: float | None = None):
    """``jax.nn.dot_product_attention``: cuDNN's flash attention or XLA's, per
    :func:`attention_implementation`.

    ``q (B, T, N, H)``, ``k (B, T, K, H)``, ``v (B, T, K, Hv)``. Where ``Hv != H`` (MLA) the narrower
    side is zero-padded to the wider and the output cropped to ``Hv``: zero columns of q and k add
    nothing to their products, zero columns of v only zero outputs. ``scale`` defaults to
    ``H ** -0.5`` (of the unpadded query).
    """
    h, hv = q.shape[-1], v.shape[-1]
    scale = h**-0.5 if scale is None else scale
    width = max(h, hv)

    def widen(x):
        return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])

    impl = attention_implementation(cfg)
    out = jax.nn.dot_product_attention(
        widen(q), widen(k), widen(v), scale=scale, is_causal=True, implementation=impl
    )
    return out[..., :hv]
