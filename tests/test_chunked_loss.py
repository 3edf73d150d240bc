"""The LM head and loss in chunks of positions (``ModelConfig.loss_chunk``): the same loss and
gradients as the whole-sequence path, no ``(batch, seq, vocab)`` logits held, and the trainer's
step and config taking it."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from train.config import OptimizerSection, load_config
from train.model import model_config
from train.step import TrainState, make_optimizer, make_train_step

TINY = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def loss_and_grads(cfg, params, tokens, labels):
    return jax.jit(jax.value_and_grad(lambda p: models.cross_entropy(cfg, p, tokens, labels)))(params)


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("llama2-tiny", {}),
        ("llama2-tiny", {"tie_word_embeddings": True}),
        ("llama2-tiny", {"dtype": "bfloat16"}),
        ("qwen3-tiny", {"scan_layers": True, "remat": "dots", "tie_word_embeddings": True}),
    ],
)
@pytest.mark.parametrize("chunk", [8, 12])  # divides the 40 positions; leaves 4 over
def test_chunked_loss_and_gradients_equal_the_whole_sequence_ones(name, overrides, chunk):
    cfg = models.get_config(name, **overrides)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 40), 0, cfg.vocab_size)
    labels = jax.random.randint(jax.random.PRNGKey(2), (3, 40), 0, cfg.vocab_size)
    loss, grads = loss_and_grads(cfg, params, tokens, labels)
    loss_c, grads_c = loss_and_grads(cfg.replace(loss_chunk=chunk), params, tokens, labels)
    # The loss is summed in another order (float32 either way). In bf16 compute each chunk's
    # LM-head gradient is rounded to bf16 on its own before the float32 sum over chunks, where the
    # whole-sequence product rounds once: up to about one bf16 ulp (2^-8) of the largest entry.
    np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
    bf16 = cfg.dtype == "bfloat16"
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g_c = _at(grads_c, path)
        scale = float(jnp.max(jnp.abs(g)))
        atol = 2**-7 * scale if bf16 else 1e-5 * scale
        np.testing.assert_allclose(g_c, g, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_chunked_loss_holds_no_full_logits():
    """Compiled for the CPU, the loss and gradient of a 32k vocabulary over 64 positions hold
    the float32 ``(batch, seq, vocab)`` logits and their gradient without chunks (twice that
    array or more in temporaries), and less than half of that array in chunks of 4 positions."""
    cfg = models.get_config("tiny", vocab_size=32000, dtype="bfloat16", param_dtype="bfloat16")
    params = models.abstract_params(cfg)
    tokens = jax.ShapeDtypeStruct((32, 64), jnp.int32)
    logits_bytes = 32 * 64 * 32000 * 4

    def temp(c):
        fn = jax.value_and_grad(lambda p, t, y: models.cross_entropy(c, p, t, y))
        return jax.jit(fn).lower(params, tokens, tokens).compile().memory_analysis().temp_size_in_bytes

    assert temp(cfg) >= 2 * logits_bytes
    assert temp(cfg.replace(loss_chunk=4)) < logits_bytes / 2


def test_train_step_in_chunks_equals_the_whole_sequence_step():
    """Two MoARa steps of two micro-batches each: the same losses and parameters."""
    cfg = models.get_config("tiny")
    tx = make_optimizer(OptimizerSection(r_base=8, block_size=16, update_proj_gap=1), 1e-2, 0.0)
    batch = jax.random.randint(jax.random.PRNGKey(3), (4, 33), 0, cfg.vocab_size)
    params = models.init_params(cfg, jax.random.PRNGKey(0))

    def run(c):
        state = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))
        step = jax.jit(make_train_step(c, tx, micro_batches=2))
        out = []
        for _ in range(2):
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        return out, state.params

    (losses, p), (losses_c, p_c) = run(cfg), run(cfg.replace(loss_chunk=8))
    np.testing.assert_allclose(losses_c, losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_c, p)


def test_loss_chunk_is_a_model_override_of_a_run(tmp_path):
    assert model_config(load_config(TINY, ["model.overrides.loss_chunk=32"]), 256).loss_chunk == 32
    assert model_config(load_config(TINY), 256).loss_chunk == 0
    # A framework key: free over a Hugging Face directory's model, as remat is.
    cfg = models.get_config("tiny", vocab_size=256)
    models.write_hf_dir(tmp_path / "m", cfg, models.init_params(cfg, jax.random.PRNGKey(0)))
    sets = [f"model.init_from={tmp_path / 'm'}", "model.overrides={loss_chunk: 16, remat: full}"]
    run_model = model_config(load_config(TINY, sets), 256)
    assert (run_model.loss_chunk, run_model.remat, run_model.hidden_size) == (16, "full", cfg.hidden_size)
    with pytest.raises(ValueError, match="loss_chunk must be a non-negative integer"):
        models.get_config("tiny", loss_chunk=-1)
