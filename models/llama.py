"""Llama 2, Llama 3.2, Qwen2.5 and Qwen3: one decoder with family flags (same math as
``transformers``' ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``)."""

from __future__ import annotations

import flax.linen as nn

from models.configs import ModelConfig
from models.layers import causal_attention, dense, inv_frequencies, rms_norm, rope_half


class LlamaAttention(nn.Module):
    """GQA self-attention; q/k/v biases for Qwen2.5, per-head q/k RMSNorm for Qwen3."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions):
        cfg = self.cfg
        b, t, _ = x.shape
        n, kv, h = cfg.num_attention_heads, cfg.kv_heads, cfg.head_size
        bias = cfg.attention_bias or cfg.model_type == "qwen2"
        q = dense(n * h, cfg, ("embed", "heads"), "q_proj", bias)(x).reshape(b, t, n, h)
        k = dense(kv * h, cfg, ("embed", "kv_heads"), "k_proj", bias)(x).reshape(b, t, kv, h)
        v = dense(kv * h, cfg, ("embed", "kv_heads"), "v_proj", bias)(x).reshape(b, t, kv, h)
        if cfg.model_type == "qwen3":
            q = rms_norm(cfg, "q_norm", "head_dim")(q)
            k = rms_norm(cfg, "k_norm", "head_dim")(k)
        inv = inv_frequencies(h, cfg.rope_theta, cfg.rope_scaling)
        q, k = rope_half(q, positions, inv), rope_half(k, positions, inv)
        out = causal_attention(q, k, v, cfg).reshape(b, t, n * h)
        # HF Llama and Qwen3 give o_proj the attention bias too; Qwen2's o_proj never has one.
        o_bias = cfg.attention_bias and cfg.model_type != "qwen2"
        return dense(cfg.hidden_size, cfg, ("heads", "embed"), "o_proj", o_bias)(out)
