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


MODELS = [
    ("llama2-tiny", {}),
    ("llama2-tiny", {"tie_word_embeddings": True}),
    ("llama2-tiny", {"dtype": "bfloat16"}),
    ("qwen3-tiny", {"scan_layers": True, "remat": "dots", "tie_word_embeddings": True}),
]
# 8 divides the 40 positions; 12 leaves 4 over. The fast lane keeps the scanned, tied model with
# a remainder and the bf16 one; the other variants are slow.
CASES = [
    pytest.param(name, overrides, chunk, marks=() if chunk == 12 and i in (2, 3) else pytest.mark.slow)
    for i, (name, overrides) in enumerate(MODELS)
    for chunk in (8, 12)
]


@pytest.mark.parametrize("name,overrides,chunk", CASES)
@pytest.mark.slow
def test_chunked_loss_and_gradients_equal_the_whole_sequence_ones(name, overrides, chunk):
    cfg = models.get_config(name, **overrides)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 40), 0, cfg.vocab_size)
    labels = jax.random.randint(jax.random.PRNGKey(2), (3, 40), 0, cfg.vocab_size)
    loss, grads = loss_and_grads(cfg, params, tokens, labels)
    loss_c, grads_c = loss_and_grads(cfg.replace(loss_chunk=chunk), params, tokens, labels)
    np.testing.assert_allclose(loss_c, loss, rtol=1e-6)  # float32 sums in another order
    if cfg.dtype == "float32":
        for path, g in jax.tree_util.tree_leaves_with_path(grads):
            scale = float(jnp.max(jnp.abs(g)))
            np.testing.assert_allclose(
                _at(grads_c, path), g, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
            )
        return
    # In bf16 compute the two paths round differently: the whole-sequence LM-head gradient is one
    # bf16 product over all positions, the chunked one a float32 sum of per-chunk bf16 products.
    # Against the float32-compute gradient (norm of the difference over its norm) the whole one
    # was 2.0% off and the chunked one 0.75% under JAX 0.11.2 on the CPU; 0.52% and 0.51% under
    # 0.10.2. So both are held against the float32-compute gradients of the same parameters, and
    # the chunks must be as close to them (within 25%).
    _, grads_32 = loss_and_grads(cfg.replace(dtype="float32"), params, tokens, labels)
    for path, g32 in jax.tree_util.tree_leaves_with_path(grads_32):
        whole, chunked = (_relative_error(_at(tree, path), g32) for tree in (grads, grads_c))
        assert chunked <= 1.25 * whole + 1e-6, (jax.tree_util.keystr(path), chunked, whole)


def _relative_error(x, reference):
    return float(jnp.linalg.norm(x - reference) / jnp.linalg.norm(reference))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.slow
def test_bf16_head_gradient_is_summed_over_many_chunks_in_float32():
    """bf16 parameters (the trainer's default), 64 chunks: the head's gradient is summed over the
    chunks in float32 and rounded once, so it is no further from the float32-compute gradient
    than the whole-sequence one. Summed in bf16 (the head entering the scan in bf16) it was
    1.04% off against the whole sequence's 0.43%."""
    cfg = models.get_config("tiny", param_dtype="bfloat16", dtype="bfloat16")
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 512), 0, cfg.vocab_size)
    labels = jax.random.randint(jax.random.PRNGKey(2), (4, 512), 0, cfg.vocab_size)
    f32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    _, reference = loss_and_grads(cfg.replace(param_dtype="float32", dtype="float32"), f32, tokens, labels)
    _, whole = loss_and_grads(cfg, params, tokens, labels)
    _, chunked = loss_and_grads(cfg.replace(loss_chunk=8), params, tokens, labels)
    head = reference["lm_head"]["kernel"]
    errors = [_relative_error(g["lm_head"]["kernel"].astype(jnp.float32), head) for g in (whole, chunked)]
    assert chunked["lm_head"]["kernel"].dtype == jnp.bfloat16
    assert errors[1] <= 1.25 * errors[0], errors


@pytest.mark.slow
def test_evaluation_scores_in_chunks_as_without():
    """``train.evaluate``'s per-row log-probabilities (weighted positions) through ``token_nll``:
    the same in chunks as whole, and the per-position values those of ``forward``'s logits."""
    from train.evaluate import sequence_logprobs

    cfg = models.get_config("llama2-tiny")
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 41), 0, cfg.vocab_size)
    weights = (jnp.arange(40) >= 10).astype(jnp.float32)[None].repeat(3, 0)
    nll = models.token_nll(cfg.replace(loss_chunk=16), params, tokens[:, :-1], tokens[:, 1:])
    logp = jax.nn.log_softmax(models.forward(cfg, params, tokens[:, :-1]), -1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(nll, -picked, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        sequence_logprobs(cfg.replace(loss_chunk=16), params, tokens, weights),
        sequence_logprobs(cfg, params, tokens, weights),
        rtol=1e-6,
    )


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


@pytest.mark.slow
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
    # The parameters to 1e-3 of a step (lr 1e-2): Adam's first steps act almost like sign(g) on
    # the low-rank values, so for the few near 0 the two programs' float32 rounding is amplified
    # by 1/eps (1.2e-6 on 1 of 11,264 entries with XLA's legacy CPU emitters).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), p_c, p)


def test_loss_chunk_is_a_model_override_of_a_run():
    assert model_config(load_config(TINY, ["model.overrides.loss_chunk=32"]), 256).loss_chunk == 32
    assert model_config(load_config(TINY), 256).loss_chunk == 0
    with pytest.raises(ValueError, match="loss_chunk must be a non-negative integer"):
        models.get_config("tiny", loss_chunk=-1)


def test_loss_chunk_is_free_over_a_hugging_face_model(tmp_path):
    """A framework key: free over a Hugging Face directory's model, as remat is."""
    pytest.importorskip("transformers")  # write_hf_dir writes the config through it
    cfg = models.get_config("tiny", vocab_size=256)
    models.write_hf_dir(tmp_path / "m", cfg, models.init_params(cfg, jax.random.PRNGKey(0)))
    sets = [f"model.init_from={tmp_path / 'm'}", "model.overrides={loss_chunk: 16, remat: full}"]
    run_model = model_config(load_config(TINY, sets), 256)
    assert (run_model.loss_chunk, run_model.remat, run_model.hidden_size) == (16, "full", cfg.hidden_size)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_loss_is_optaxs_cross_entropy_and_its_backward_scatters_nothing(dtype):
    """``models.model.label_nll``: optax's ``softmax_cross_entropy_with_integer_labels`` in value
    and gradient, the labels' first and last ids included, with the label's logit picked by a
    mask: its backward is elementwise (no scatter-add, which XLA does not fuse and which kept a
    float32 copy of the logits apart), where optax's gather scatters."""
    import optax

    from models.model import label_nll

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((3, 5, 50)) * 4, dtype)
    labels = jnp.asarray(rng.integers(0, 50, (3, 5)), jnp.int32).at[0, 0].set(0).at[0, 1].set(49)
    ours = jax.value_and_grad(lambda x: label_nll(x, labels).sum())
    optax_ = jax.value_and_grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels).sum())
    (value, grad), (want, want_grad) = ours(logits), optax_(logits)
    assert grad.dtype == want_grad.dtype == dtype
    np.testing.assert_array_equal(np.asarray(value, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(want_grad, np.float32))
    assert "scatter" not in str(jax.make_jaxpr(ours)(logits))
    assert "scatter" in str(jax.make_jaxpr(optax_)(logits))  # (what the mask replaces)
    # Labels of a dtype narrower than the vocabulary's ids (300 ids, uint8 labels under 256).
    wide = jnp.asarray(rng.standard_normal((2, 300)), dtype)
    narrow = jnp.asarray([0, 44], jnp.uint8)
    want = optax.softmax_cross_entropy_with_integer_labels(wide, narrow.astype(jnp.int32))
    np.testing.assert_array_equal(
        np.asarray(label_nll(wide, narrow), np.float32), np.asarray(want, np.float32)
    )
