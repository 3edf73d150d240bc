"""What only a GPU can check: cuDNN's flash attention against XLA's, the basis refresh on the
device against a float64 reference, and the trainer's donated, sharded step.

Marked ``gpu``: conftest skips them, with the reason, where JAX's default backend is not a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import moara_jax as mj
import models
from moara_jax._bases import top_basis
from models.layers import causal_attention
from train.config import MeshSection
from train.sharding import batch_sharding, make_mesh, param_shardings, state_shardings
from train.step import TrainState, loss_fn, make_train_step

pytestmark = pytest.mark.gpu


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def attention_inputs(key, b, t, n, kv, h, hv):
    kq, kk, kv_, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, t, n, h), jnp.float32)
    k = jax.random.normal(kk, (b, t, kv, h), jnp.float32)
    v = jax.random.normal(kv_, (b, t, kv, hv), jnp.float32)
    cot = jax.random.normal(kc, (b, t, n, hv), jnp.float32)
    return q, k, v, cot


def attention_and_grads(cfg, q, k, v, cot):
    """Output and ``d<out, cot>/d(q, k, v)`` of the model's attention under ``cfg``."""

    def f(q, k, v):
        return causal_attention(q, k, v, cfg)

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(cot.astype(out.dtype)))


# bf16 keeps 8 significant bits: rounding one value costs up to 2**-9 = 2.0e-3 of it. Both paths
# round q, k, v, the attention probabilities and the output to bf16 (the backward also dP and dS),
# and accumulate in float32, so each lands ~1e-3 to 4e-3 (norm-wise) from the float32 reference;
# 1e-2 (2e-2 for gradients, two more roundings) bounds that with margin, while a wrong mask, scale
# or GQA head mapping is off by O(1).
FORWARD_TOL, GRAD_TOL = 1e-2, 2e-2


@pytest.mark.parametrize(
    "family,kv,h,hv",
    [
        ("llama", 8, 64, 64),  # MHA, Llama 2's head size
        ("llama", 2, 128, 128),  # GQA, the largest width cuDNN takes everywhere
        ("deepseek_v2", 8, 96, 64),  # MLA widths: q/k 64 + 32, v 64 (v zero-padded to 96)
    ],
)
def test_cudnn_attention_equals_xla_within_bf16_rounding(family, kv, h, hv):
    b, t, n = 2, 256, 8
    q, k, v, cot = attention_inputs(jax.random.PRNGKey(h + kv), b, t, n, kv, h, hv)
    base = models.get_config("llama2-tiny") if family == "llama" else models.get_config("deepseek-v2-tiny")
    cudnn = base.replace(dtype="bfloat16", attention_impl="cudnn")
    xla = base.replace(dtype="bfloat16", attention_impl="xla")
    ref_cfg = base.replace(dtype="float32", attention_impl="xla")
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        ref = attention_and_grads(ref_cfg, *(x.astype(jnp.float32) for x in half), cot)
    compiled = jax.jit(lambda *a: attention_and_grads(cudnn, *a)).lower(*half, cot).compile()
    got_cudnn = compiled(*half, cot)
    got_xla = jax.jit(lambda *a: attention_and_grads(xla, *a))(*half, cot)
    assert "__cudnn$fmha" in compiled.as_text()  # cuDNN's kernels, not a silent fallback
    for i, (c, x, r) in enumerate(zip(got_cudnn, got_xla, ref, strict=True)):
        tol = FORWARD_TOL if i == 0 else GRAD_TOL
        assert np.all(np.isfinite(np.asarray(c, np.float32)))
        assert rel_err(c, r) < tol and rel_err(x, r) < tol, (i, rel_err(c, r), rel_err(x, r))
        assert rel_err(c, x) < tol, (i, rel_err(c, x))


def test_default_attention_is_cudnn_in_bf16_and_xla_in_float32():
    cfg = models.get_config("llama2-tiny", param_dtype="bfloat16", dtype="bfloat16")
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, cfg.vocab_size)

    def program(c):
        params = models.abstract_params(c)
        return jax.jit(lambda p, x: models.forward(c, p, x)).lower(params, tokens).compile().as_text()

    assert models.attention_implementation(cfg) == "cudnn" and "__cudnn$fmha" in program(cfg)
    f32 = cfg.replace(param_dtype="float32", dtype="float32")
    assert models.attention_implementation(f32) == "xla" and "__cudnn$fmha" not in program(f32)


def test_model_loss_with_cudnn_equals_xla_within_bf16_rounding():
    cfg = models.get_config("llama2-tiny", param_dtype="bfloat16", dtype="bfloat16")
    params = models.init_params(cfg, jax.random.PRNGKey(1))
    batch = jax.random.randint(jax.random.PRNGKey(2), (4, 129), 0, cfg.vocab_size)

    def loss_and_grads(c):
        return jax.jit(jax.value_and_grad(lambda p: loss_fn(c, p, batch)))(params)

    loss_c, grads_c = loss_and_grads(cfg.replace(attention_impl="cudnn"))
    loss_x, grads_x = loss_and_grads(cfg.replace(attention_impl="xla"))
    # The loss is a mean over 512 tokens of float32 cross entropies of bf16 logits: the attention
    # paths' bf16 differences move it by far less than 1e-2 relative; gradients as above.
    assert abs(float(loss_c) - float(loss_x)) < 1e-2 * abs(float(loss_x))
    flat_c = np.asarray(ravel_pytree(grads_c)[0], np.float32)
    flat_x = np.asarray(ravel_pytree(grads_x)[0], np.float32)
    assert rel_err(flat_c, flat_x) < 5e-2  # bf16 gradients through every layer: a few roundings each


def gapped_batch(seed, batch, m, n, r):
    """Float64 matrices ``U diag(s) V^T`` whose top-``r`` singular values (2 down to 1) stand clear
    of the rest (0.5 and below): a well-defined top-``r`` subspace."""
    rng = np.random.default_rng(seed)
    k = min(m, n)
    s = np.concatenate([np.linspace(2.0, 1.0, r), np.linspace(0.5, 0.01, k - r)])
    out = []
    for _ in range(batch):
        u = np.linalg.qr(rng.standard_normal((m, k)))[0]
        v = np.linalg.qr(rng.standard_normal((n, k)))[0]
        out.append((u * s) @ v.T)
    return np.stack(out)


@pytest.mark.parametrize("svd", ["eigh", "exact"])
def test_refresh_on_the_device_spans_the_float64_subspace(svd):
    """The bases of a stacked ``(layers, fan_in, fan_out)`` leaf computed on the GPU against numpy's
    float64 SVD, by the sine of the largest principal angle between the subspaces. For ``eigh``
    the float32 Gram matrix (1024 x 1024, norm 4) is off by about d * 2**-24 * 4 = 2.4e-4;
    Davis-Kahan bounds the sine by that over the eigengap 1 - 0.25 = 0.75: 3.3e-4. The bound
    1e-3 holds that (the exact SVD does better); a wrong or unsorted basis is off by O(1)."""
    r, fan_in, fan_out = 64, 1024, 2736
    g = gapped_batch(7, 3, fan_in, fan_out, r)
    with jax.default_device(jax.devices()[0]):
        basis = top_basis(jnp.asarray(g, jnp.float32), "in", r, svd=svd)
        basis = np.asarray(jax.device_get(basis), np.float64)
    ref = np.linalg.svd(g, full_matrices=False)[0][:, :, :r]  # (3, fan_in, r)
    for b in range(3):
        off = basis[b] - ref[b] @ (ref[b].T @ basis[b])  # the part outside the reference subspace
        assert np.linalg.norm(off, 2) < 1e-3, (svd, b, np.linalg.norm(off, 2))
        assert np.abs(basis[b].T @ basis[b] - np.eye(r)).max() < 1e-4


def test_donated_sharded_step_keeps_shardings_and_equals_the_undonated_step():
    """The trainer's step as python -m train jits it (NamedShardings in and out, the state
    donated), across a basis refresh (gap 2, three steps) on the device."""
    cfg = models.get_config("llama2-tiny", param_dtype="bfloat16", dtype="bfloat16")
    tx = mj.moara_adamw(1e-3, r_base=16, block_size=16, update_proj_gap=2, svd="eigh")
    mesh = make_mesh(MeshSection())
    abstract_params = models.abstract_params(cfg)
    p_shard = param_shardings(models.logical_axes(cfg), abstract_params, mesh)
    o_shard = state_shardings(jax.eval_shape(tx.init, abstract_params), mesh, abstract_params, p_shard)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    s_shard = TrainState(replicated, p_shard, o_shard)
    b_shard = batch_sharding(mesh, 8 * mesh.shape["data"])

    def init(key):
        params = models.init_params(cfg, key)
        return TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))

    make_state = jax.jit(init, out_shardings=s_shard)
    step = make_train_step(cfg, tx, micro_batches=2)
    kwargs = dict(in_shardings=(s_shard, b_shard), out_shardings=(s_shard, None))
    plain, donated = jax.jit(step, **kwargs), jax.jit(step, donate_argnums=0, **kwargs)
    kept, given = make_state(jax.random.PRNGKey(0)), make_state(jax.random.PRNGKey(0))
    for i in range(3):
        batch = jax.device_put(
            jax.random.randint(jax.random.PRNGKey(10 + i), (b_shard.mesh.size * 8, 65), 0, cfg.vocab_size),
            b_shard,
        )
        before = jax.tree.leaves(given)
        kept, m_kept = plain(kept, batch)
        given, m_given = donated(given, batch)
        assert all(x.is_deleted() for x in before)  # donated: the step reused their buffers
        for x, want in zip(jax.tree.leaves(given), jax.tree.leaves(s_shard), strict=True):
            assert x.sharding.is_equivalent_to(want, x.ndim)
        # The same program but for buffer reuse. The two compilations could at most pick other
        # GEMM algorithms (another float32 summation order, flipping a few bf16 roundings of the
        # activations): 1e-3 allows that; a donated buffer read after reuse gives garbage.
        np.testing.assert_allclose(float(m_given["loss"]), float(m_kept["loss"]), rtol=1e-3)
    assert int(given.step) == 3
    for a, b in zip(jax.tree.leaves(given.params), jax.tree.leaves(kept.params), strict=True):
        assert rel_err(np.asarray(a, np.float32), np.asarray(b, np.float32)) < 1e-2


def test_the_step_loop_moves_values_to_the_host_only_where_it_means_to(monkeypatch, tmp_path):
    """``python -m train``'s steps (the tiny config on the GPU) with JAX's device-to-host guard
    set to refuse implicit transfers: each read of the device's values in the loop is an
    explicit ``jax.device_get`` (one per step's metrics, one per evaluation), so none waits on
    the device unnoticed (a stray ``float(x)`` of a device array would raise here; on a CPU
    nothing is transferred, hence a GPU test). Orbax's save copies the state out in its own way
    and is let through; it runs only at the steps that save."""
    from test_train import FAST, run_cli

    from train import checkpoint, loop

    steps, save = loop.StepLoop._steps, checkpoint.Checkpointer.save

    def guarded_steps(self, *args, **kwargs):
        with jax.transfer_guard_device_to_host("disallow"):
            return steps(self, *args, **kwargs)

    def allowed_save(self, *args, **kwargs):
        with jax.transfer_guard_device_to_host("allow"):
            return save(self, *args, **kwargs)

    monkeypatch.setattr(loop.StepLoop, "_steps", guarded_steps)
    monkeypatch.setattr(checkpoint.Checkpointer, "save", allowed_save)
    proc = run_cli(tmp_path / "run", *FAST, "train.log_every=1", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "completed: 12 steps" in proc.stdout + proc.stderr
