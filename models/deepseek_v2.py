"""DeepSeek-V2 Multi-head Latent Attention (dense variant), as ``transformers``'
``DeepseekV2Attention``: low-rank q (``q_a -> RMSNorm -> q_b``), a shared compressed kv latent
with a decoupled RoPE key (``kv_a_proj_with_mqa``), expanded per head by ``kv_b_proj``."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from models.configs import ModelConfig
from models.layers import causal_attention, dense, inv_frequencies, rms_norm, rope_interleaved

# HF builds the two latent norms with DeepseekV2RMSNorm's default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions):
        cfg = self.cfg
        b, t, _ = x.shape
        n = cfg.num_attention_heads
        nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = nope + rope
        if cfg.q_lora_rank:
            q = dense(cfg.q_lora_rank, cfg, ("embed", "q_lora"), "q_a_proj", cfg.attention_bias)(x)
            q = rms_norm(cfg, "q_a_layernorm", "q_lora", eps=LATENT_NORM_EPS)(q)
            q = dense(n * qk, cfg, ("q_lora", "heads"), "q_b_proj")(q)
        else:
            q = dense(n * qk, cfg, ("embed", "heads"), "q_proj")(x)
        q = q.reshape(b, t, n, qk)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv = dense(
            cfg.kv_lora_rank + rope, cfg, ("embed", "kv_lora"), "kv_a_proj_with_mqa", cfg.attention_bias
        )(x)
        latent, k_pe = kv[..., : cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank :]
        latent = rms_norm(cfg, "kv_a_layernorm", "kv_lora", eps=LATENT_NORM_EPS)(latent)
        kv = dense(n * (nope + vd), cfg, ("kv_lora", "heads"), "kv_b_proj")(latent)
        kv = kv.reshape(b, t, n, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        inv = inv_frequencies(rope, cfg.rope_theta, None)
        q_pe = rope_interleaved(q_pe, positions, inv)
        k_pe = rope_interleaved(k_pe[:, :, None, :], positions, inv)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (b, t, n, rope))], axis=-1)
        out = causal_attention(q, k, v, cfg, scale=qk**-0.5).reshape(b, t, n * vd)
        return dense(cfg.hidden_size, cfg, ("heads", "embed"), "o_proj", cfg.attention_bias)(out)
