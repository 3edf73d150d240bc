"""The benchmark scripts' own logic: the HLO reading of step_anatomy and the in-jit timing guard."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import optimizer_step  # noqa: E402
import step_anatomy  # noqa: E402
import vs_torch  # noqa: E402


def test_entry_kernels_counts_one_fusion_and_its_bytes():
    x = jnp.ones(1000, jnp.float32)
    text = jax.jit(lambda a: jnp.sin(a) * 2.0 + 1.0).lower(x).compile().as_text()
    kinds, traffic = step_anatomy.entry_kernels(text)
    assert sum(kinds.values()) == 1
    assert traffic == 2 * 4 * 1000  # one f32[1000] read, one written


def test_anatomy_of_adamw_reads_and_writes_every_state_buffer():
    hidden, inter, layers, r_base, block = optimizer_step.SIZES["tiny"]
    params = jax.eval_shape(lambda: optimizer_step.llama2_params(hidden, inter, layers))
    tx = optimizer_step.optimizers(r_base, block)["optax_adamw"]
    result = step_anatomy.anatomy(tx, params, None)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    # Reads p, g, mu, nu and writes p, mu, nu: at least seven passes over the parameter bytes.
    assert result["kernels"] >= 1
    assert result["hbm_traffic_gb"] * 1e9 >= 7 * param_bytes
    assert result["scratch_mib"] >= 0


def test_in_jit_loop_refuses_to_cross_a_refresh():
    hidden, inter, layers, r_base, block = optimizer_step.SIZES["tiny"]
    params = optimizer_step.llama2_params(hidden, inter, layers)
    tx = optimizer_step.optimizers(r_base, block)["galore_vanilla"]
    with pytest.raises(ValueError, match="refresh gap"):
        optimizer_step.time_device_loop(tx, params, params, steps=optimizer_step.GAP)


def test_stacked_llama_params_hold_one_leaf_per_module_type():
    hidden, inter, layers, _, _ = optimizer_step.SIZES["tiny"]
    flat = optimizer_step.llama2_params(hidden, inter, layers)
    stacked = optimizer_step.llama2_params(hidden, inter, layers, stacked=True)
    size = lambda t: sum(x.size for x in jax.tree.leaves(t))  # noqa: E731
    assert size(flat) == size(stacked)
    assert stacked["layers"]["mlp"]["down_proj"]["kernel"].shape == (layers, inter, hidden)
    grads = optimizer_step.decaying_gradients(stacked, r_base=8)
    assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, stacked)


def test_kernel_profile_groups_the_traced_loop_events_by_name(tmp_path):
    """A smoke check on CPU (no device plane: the host plane's events are grouped); on a GPU the
    same code reads the device plane's kernels."""
    import kernel_profile

    hidden, inter, layers, r_base, block = optimizer_step.SIZES["tiny"]
    params = optimizer_step.llama2_params(hidden, inter, layers)
    tx = optimizer_step.optimizers(r_base, block)["optax_adamw"]
    result = kernel_profile.kernel_times(tx, params, params, steps=2, trace_dir=str(tmp_path))
    assert result["plane"].startswith("/host:CPU") and result["lines"]
    names = [k["name"] for k in result["kernels"]]
    times = [k["ms_per_step"] for k in result["kernels"]]
    assert len(names) == len(set(names)) and times == sorted(times, reverse=True)
    assert result["busy_ms_per_step"] > 0 and result["launches_per_step"] > 0


@pytest.mark.parametrize("tiles", [None, (64, 32, 2)])
@pytest.mark.parametrize(
    "shape,rank,block,dtype",
    [
        ((96, 200), 128, 32, jnp.bfloat16),  # fan_in side, fan_out off the tile
        ((200, 96), 64, 16, jnp.float32),  # fan_out side, fan_in off the block
        ((3, 100, 72), 64, 16, jnp.float32),  # stacked
    ],
)
def test_fused_kernel_experiment_computes_decompose_then_project(shape, rank, block, dtype, tiles):
    """The experimental Pallas kernel (interpreted) gives XLA's magnitudes and projection."""
    import fused_kernel
    import numpy as np

    from moara_jax._decomposition import decompose_along
    from moara_jax._projection import project_value, projection_side

    k1, k2 = jax.random.split(jax.random.PRNGKey(rank))
    g = jax.random.normal(k1, shape).astype(dtype).at[..., :block, :3].set(0)  # zero blocks too
    side = projection_side(shape)
    d = shape[-2] if side == "in" else shape[-1]
    basis = (jax.random.normal(k2, shape[:-2] + (d, rank)) / np.sqrt(d)).astype(dtype)
    assert fused_kernel.supported(shape, dtype, rank, block)
    mag, low = fused_kernel.decompose_project(
        g, basis, block_size=block, eps=1e-12, side=side, interpret=True, tiles=tiles
    )
    mag_ref, direction = decompose_along(g, block, -2, 1e-12)
    low_ref = np.asarray(project_value(direction, basis, side), np.float64)
    np.testing.assert_allclose(np.asarray(mag), np.asarray(mag_ref), rtol=1e-5, atol=1e-6)
    err = np.linalg.norm(np.asarray(low, np.float64) - low_ref) / np.linalg.norm(low_ref)
    assert low.dtype == dtype and err < (1e-2 if dtype == jnp.bfloat16 else 1e-5)


def test_train_step_benchmark_times_finite_donated_steps():
    """time_steps builds its state inside jit (the donated step refuses shared buffers) and
    raises on a non-finite loss; a tiny bf16 model runs through it."""
    import train_step

    import models

    cfg = models.get_config("llama2-tiny", param_dtype="bfloat16", dtype="bfloat16")
    tx = train_step.optimizers(r_base=8, block=16)["moara_full"]
    ms = train_step.time_steps(cfg, tx, batch=4, micro=2, seq_len=16, steps=2, warmup=1)
    assert ms > 0


def test_vs_torch_peer_has_the_papers_groups_and_the_same_model():
    transformers = pytest.importorskip("transformers")
    import models

    cfg = models.get_config("llama2-tiny")
    peer = transformers.LlamaForCausalLM(models.to_hf_config(cfg))
    low_rank, rest = vs_torch.paper_groups(peer)
    assert len(low_rank) == 7 * cfg.num_hidden_layers  # q k v o gate up down in every layer
    assert sum(p.numel() for p in low_rank + rest) == models.param_count(cfg)
    assert all(p.ndim == 1 for p in rest if p.shape[0] != cfg.vocab_size)  # norms; embedding, head


def test_vs_torch_derived_figures():
    row = vs_torch.derive({"plain_ms": 100.0, "refresh_ms": 2100.0, "params": 1000}, 5000, peak_tflops=1e-6)
    assert row["tokens_per_s"] == 50_000
    assert row["tokens_per_s_refresh_amortized"] == 5000 / (100 + 2000 / 200) * 1e3
    assert row["mfu"] == 6 * 1000 * 5000 / 0.1 / 1e6
