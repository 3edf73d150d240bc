"""The causal LM shell shared by every family: embeddings, (scanned) decoder layers, final norm,
LM head; and the functional API (``init_params``, ``forward``, ``param_count``, ``logical_axes``)."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.configs import ModelConfig
from models.deepseek_v2 import MLAttention
from models.layers import MLP, rms_norm
from models.llama import LlamaAttention

# Logical names of the residual stream's axes (batch, length, hidden) and of the embedding
# table's for its lookup. A trainer that maps them to mesh axes (``nn.logical_axis_rules``, as
# ``train.sharding.on_mesh`` does) pins the activations' sharding; without rules the
# constraints do nothing.
ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")
LOOKUP_AXES = ("activation_vocab", "activation_embed")

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class DecoderLayer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions):
        cfg = self.cfg
        attn = MLAttention if cfg.model_type == "deepseek_v2" else LlamaAttention
        x = x + attn(cfg, name="self_attn")(rms_norm(cfg, "input_layernorm", "embed")(x), positions)
        x = x + MLP(cfg, name="mlp")(rms_norm(cfg, "post_attention_layernorm", "embed")(x))
        return _residual(x)


def _residual(x: jax.Array) -> jax.Array:
    return nn.with_logical_constraint(x, ACTIVATION_AXES)


def _layer(cfg: ModelConfig, scanned: bool) -> type[nn.Module]:
    """``DecoderLayer``, rematerialised as ``cfg.remat`` says. Inside ``nn.scan`` its
    recomputation needs no barrier against common-subexpression elimination (the scan's loop
    keeps XLA from merging it with the forward pass), so ``prevent_cse`` is off there, as JAX's
    ``checkpoint`` documentation advises; unrolled layers keep it on."""
    if cfg.remat == "none":
        return DecoderLayer
    return nn.remat(DecoderLayer, policy=_REMAT[cfg.remat], prevent_cse=not scanned)


class _ScanBody(nn.Module):
    """``DecoderLayer`` in the ``(carry, x) -> (carry, y)`` form ``nn.scan`` wants."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions):
        return _layer(self.cfg, scanned=True)(self.cfg, name="layer")(x, positions), None


class _LMHead(nn.Module):
    """The untied LM head's ``(hidden, vocab)`` kernel (``lm_head/kernel``, as ``nn.Dense`` names
    and initialises it)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self):
        cfg = self.cfg
        init = nn.with_logical_partitioning(nn.initializers.normal(cfg.initializer_range), ("embed", "vocab"))
        return self.param("kernel", init, (cfg.hidden_size, cfg.vocab_size), jnp.dtype(cfg.param_dtype))


def head_logits(x: jax.Array, kernel: jax.Array, dtype) -> jax.Array:
    """Float32 logits of hidden states ``x (..., hidden)`` through the LM head ``kernel (hidden,
    vocab)``, the product in the compute ``dtype`` (as ``nn.Dense`` and ``nn.Embed.attend`` do)."""
    return jnp.dot(x.astype(dtype), kernel.astype(dtype)).astype(jnp.float32)


class CausalLM(nn.Module):
    """Decoder-only LM with HF parameter names; logits are float32 (with ``head=False``: the
    final norm's output, before the LM head). ``tokens``: ``(batch, seq)`` ids, checked as
    :func:`check_tokens` says; attention is causal, with no mask (pad on the right)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, head: bool = True):
        cfg = self.cfg
        check_tokens(cfg, tokens)
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(cfg.initializer_range), ("vocab", "embed")
            ),
            name="embed_tokens",
        )
        # nn.Embed's lookup (``take`` of the table in the compute dtype), of the table as the
        # rules lay it out for it: under FSDP gathered whole over the hidden axis, so that the
        # rows land sharded by batch (XLA otherwise moves the activations to the table's layout).
        table = nn.with_logical_constraint(embed.embedding, LOOKUP_AXES)
        x = _residual(jnp.take(table.astype(jnp.dtype(cfg.dtype)), tokens, axis=0))
        positions = jnp.arange(tokens.shape[1])
        if cfg.scan_layers:
            body = nn.scan(
                _ScanBody,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=nn.broadcast,
                length=cfg.num_hidden_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = body(cfg, name="layers")(x, positions)
        else:
            layer = _layer(cfg, scanned=False)
            for i in range(cfg.num_hidden_layers):
                x = layer(cfg, name=f"layers_{i}")(x, positions)
        x = rms_norm(cfg, "norm", "embed")(x)
        if not head:
            return x
        kernel = embed.embedding.T if cfg.tie_word_embeddings else _LMHead(cfg, name="lm_head")()
        return head_logits(x, kernel, cfg.dtype)


def build_model(cfg: ModelConfig) -> CausalLM:
    """The Flax module for ``cfg``."""
    return CausalLM(cfg)


def _boxed_init(cfg: ModelConfig, rng):
    return build_model(cfg).init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict[str, Any]:
    """Random parameters (a nested dict of arrays; scanned layers are stacked on axis 0)."""
    return nn.meta.unbox(_boxed_init(cfg, rng))


def abstract_params(cfg: ModelConfig) -> dict[str, Any]:
    """``jax.ShapeDtypeStruct`` of every parameter; nothing is allocated."""
    return nn.meta.unbox(jax.eval_shape(functools.partial(_boxed_init, cfg), jax.random.PRNGKey(0)))


def logical_axes(cfg: ModelConfig) -> dict[str, Any]:
    """Logical axis names of every parameter, as ``PartitionSpec``s over names such as
    ``vocab embed heads kv_heads mlp layers norm`` (map them to mesh axes with
    ``flax.linen.logical_to_mesh_axes`` / ``nn.logical_to_mesh_sharding``)."""
    boxed = jax.eval_shape(functools.partial(_boxed_init, cfg), jax.random.PRNGKey(0))
    return nn.get_partition_spec(boxed)


def check_tokens(cfg: ModelConfig, tokens, what: str = "tokens") -> None:
    """Refuses ``tokens`` that are not ``(batch, seq)`` integers and, when they are concrete (not
    traced; read on the host), ids outside ``[0, vocab_size)``: the embedding's lookup would give
    NaN for an id past the table (every position after it too, through attention) and wrap a
    negative one (``transformers`` raises ``IndexError`` for both). Traced ids are not checked.

    Raises:
      ValueError: naming the shape, dtype or the ids out of range.
    """
    shape, dtype = jnp.shape(tokens), jnp.result_type(tokens)
    if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{what} must be (batch, seq) integers, got shape {shape} of {dtype}")
    if isinstance(tokens, jax.core.Tracer) or not np.prod(shape):
        return
    if isinstance(tokens, jax.Array) and not tokens.is_fully_addressable:
        return  # a multi-host batch: each process holds a part
    ids = np.asarray(tokens)  # on the host: a concrete array captured by a traced function too
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= cfg.vocab_size:
        raise ValueError(
            f"{what} hold ids from {low} to {high}, outside the model's vocabulary [0, {cfg.vocab_size}): "
            "pad with an id of the vocabulary (this model is causal and takes no attention mask: pad "
            "on the right, and leave the padded positions out of the loss)"
        )


def forward(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Logits ``(batch, seq, vocab)`` in float32 for int tokens ``(batch, seq)``.

    Attention is causal over the whole sequence, with no attention mask or position ids: a
    batch of sequences of unequal length is padded on the right (the real positions then see
    only real ones), never on the left. Token ids are checked as :func:`check_tokens` says."""
    return build_model(cfg).apply({"params": params}, tokens)


def hidden_states(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """The final norm's output ``(batch, seq, hidden)`` in the compute dtype: ``forward`` without
    the LM head."""
    return build_model(cfg).apply({"params": params}, tokens, head=False)


def head_kernel(cfg: ModelConfig, params: dict[str, Any]) -> jax.Array:
    """The LM head as a ``(hidden, vocab)`` matrix (the embedding's transpose when tied)."""
    if cfg.tie_word_embeddings:
        return params["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]


def label_nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """``-log softmax(logits)[label]`` at each position: optax's
    ``softmax_cross_entropy_with_integer_labels``, the label's logit picked by a one-hot mask
    instead of ``take_along_axis``. Equal values; the backward of the pick is then an elementwise
    select XLA fuses with the softmax's, so the logits' gradient is written once, in the dtype
    the LM head's backward reads, where the gather's scatter-add kept a float32 copy of
    ``(batch, seq, vocab)`` apart: the train step of Llama 2 60M, batch 128 x 256, took 3.8 GiB
    more scratch with it (17.0 against 13.2 GiB, remat none, scanned layers, XLA's attention;
    ``benchmarks/train_anatomy.py --target h100``, a compile-time figure)."""
    vocab = jnp.arange(logits.shape[-1], dtype=jnp.int32)  # (in labels' dtype, uint8's would wrap)
    picked = jnp.sum(jnp.where(vocab == labels.astype(jnp.int32)[..., None], logits, 0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def _head_nll(x: jax.Array, kernel: jax.Array, labels: jax.Array, dtype) -> jax.Array:
    """Cross entropy at each position of hidden states ``x (..., hidden)`` against ``labels``."""
    return label_nll(head_logits(x, kernel, dtype), labels)


def token_nll(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array, labels: jax.Array) -> jax.Array:
    """Cross entropy ``(batch, seq)`` in float32 of the logits of ``tokens (batch, seq)`` against
    ``labels (batch, seq)`` at each position.

    With ``cfg.loss_chunk`` set, the LM head and the loss run ``loss_chunk`` positions at a time
    (a ``lax.scan`` over the sequence, the batch axis left whole) under ``jax.checkpoint``: the
    backward pass recomputes each chunk's logits instead of keeping ``(batch, seq, vocab)`` of
    them, which at a 32k vocabulary is most of a small model's activation memory. The head enters
    the scan in float32, so its gradient is summed over the chunks in float32 (a scan sums a
    loop-invariant input's gradient in that input's dtype) and rounded to bf16 parameters once.
    The values equal the unchunked ones up to rounding. ``labels`` are checked as the tokens are
    (:func:`check_tokens`)."""
    check_tokens(cfg, labels, "labels")
    seq = tokens.shape[1]
    if not cfg.loss_chunk or cfg.loss_chunk >= seq:
        return label_nll(forward(cfg, params, tokens), labels)
    x = hidden_states(cfg, params, tokens)
    kernel = head_kernel(cfg, params).astype(jnp.float32)
    nll_of = jax.checkpoint(functools.partial(_head_nll, dtype=cfg.dtype), prevent_cse=False)
    c = cfg.loss_chunk
    n = seq // c

    def body(carry, xs):
        x_chunk, label_chunk = xs
        return carry, nll_of(x_chunk, kernel, label_chunk)

    def chunks(a):  # (batch, n * c, ...) -> (n, batch, c, ...)
        return jnp.moveaxis(a[:, : n * c].reshape((a.shape[0], n, c) + a.shape[2:]), 1, 0)

    _, nll = jax.lax.scan(body, None, (chunks(x), chunks(labels)))  # (n, batch, c)
    nll = jnp.moveaxis(nll, 0, 1).reshape(labels.shape[0], n * c)
    if n * c < seq:
        nll = jnp.concatenate([nll, nll_of(x[:, n * c :], kernel, labels[:, n * c :])], axis=1)
    return nll


def cross_entropy(
    cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array, labels: jax.Array
) -> jax.Array:
    """Mean cross entropy of the logits of ``tokens (batch, seq)`` against ``labels (batch, seq)``
    (in chunks of ``cfg.loss_chunk`` positions where set: ``token_nll``)."""
    return token_nll(cfg, params, tokens, labels).mean()


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters, from ``jax.eval_shape`` (nothing allocated)."""
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(abstract_params(cfg))))
