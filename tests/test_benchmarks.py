"""The benchmark scripts' own logic: the HLO reading of step_anatomy and train_anatomy, the in-jit
timing guard, vs_torch.py's and refresh_methods.py's CPU smoke runs, the GPU session driver's
readers, data_pipeline.py's and tokenizer_export.py's parts on tiny inputs."""

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import optimizer_step  # noqa: E402
import step_anatomy  # noqa: E402
import vs_torch  # noqa: E402


def test_entry_kernels_counts_one_fusion_and_its_bytes():
    x = jnp.ones(1000, jnp.float32)
    text = jax.jit(lambda a: jnp.sin(a) * 2.0 + 1.0).lower(x).compile().as_text()
    kinds, traffic = step_anatomy.entry_kernels(text)
    assert sum(kinds.values()) == 1
    assert traffic == 2 * 4 * 1000  # one f32[1000] read, one written


@pytest.mark.parametrize("target", sorted(step_anatomy.TARGETS))
@pytest.mark.parametrize("plugin, runtime", [("jax-cuda12-plugin", 12), ("jax-cuda13-plugin", 13)])
def test_deviceless_target_configs_suit_the_installed_cuda_plugin(monkeypatch, plugin, runtime, target):
    """The deviceless H100 and H200 targets: the CUDA runtime of the plugin JAX has, the cuDNN
    version where jaxlib 0.10 reads it and where 0.11 does (it dropped ``dnn_version_info``), and
    the card's own memory and name."""
    import importlib.metadata

    def version(name):
        if name != plugin:
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.11.2"

    monkeypatch.setattr(importlib.metadata, "version", version)
    config = step_anatomy.target_config(target)
    facts = step_anatomy.TARGETS[target]
    assert f"device_memory_size: {facts['memory_bytes']}\n" in config
    assert config.rstrip().endswith(f'device_description_str: "{facts["description"]}"')
    assert f"runtime_version {{ major: {runtime} " in config
    assert 'dnn_version: "9.7.0"' in config and "dnn_version_info { major: 9 minor: 7 }" in config
    assert config.count("{") == config.count("}") and "{cuda}" not in config


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
    tx = optimizer_step.optimizers(r_base, block)["galore_vanilla_exact"]
    with pytest.raises(ValueError, match="refresh gap"):
        optimizer_step.time_device_loop(tx, params, params, steps=optimizer_step.GAP)


@pytest.mark.slow
def test_stacked_llama_params_hold_one_leaf_per_module_type():
    hidden, inter, layers, _, _ = optimizer_step.SIZES["tiny"]
    flat = optimizer_step.llama2_params(hidden, inter, layers)
    stacked = optimizer_step.llama2_params(hidden, inter, layers, stacked=True)
    size = lambda t: sum(x.size for x in jax.tree.leaves(t))  # noqa: E731
    assert size(flat) == size(stacked)
    assert stacked["layers"]["mlp"]["down_proj"]["kernel"].shape == (layers, inter, hidden)
    grads = optimizer_step.decaying_gradients(stacked, r_base=8)
    assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, stacked)


@pytest.mark.slow
def test_kernel_profile_groups_the_traced_loop_events_by_name(tmp_path):
    """A smoke check on CPU (no device plane: the host plane's events are grouped); on a GPU the
    same code reads the device plane's kernels."""
    import kernel_profile

    hidden, inter, layers, r_base, block = optimizer_step.SIZES["tiny"]
    params = optimizer_step.llama2_params(hidden, inter, layers)
    tx = optimizer_step.optimizers(r_base, block)["optax_adamw"]
    result = kernel_profile.kernel_times(tx, params, params, steps=2, trace_dir=str(tmp_path))
    plane = "/host:CPU" if jax.default_backend() == "cpu" else f"/device:{jax.default_backend().upper()}"
    assert result["plane"].startswith(plane) and result["lines"]
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
@pytest.mark.slow
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


@pytest.mark.slow
def test_train_step_benchmark_times_finite_donated_steps():
    """time_steps builds its state inside jit (the donated step refuses shared buffers) and
    raises on a non-finite loss; a tiny bf16 model runs through it."""
    import train_step

    import models

    cfg = models.get_config("llama2-tiny", param_dtype="bfloat16", dtype="bfloat16")
    tx = train_step.optimizers(r_base=8, block=16)["moara_full"]
    ms = train_step.time_steps(cfg, tx, batch=4, micro=2, seq_len=16, steps=2, warmup=1)
    assert ms > 0


@pytest.mark.parametrize(
    "name, peer_class",
    [
        ("llama2-tiny", "LlamaForCausalLM"),
        ("qwen2.5-tiny", "Qwen2ForCausalLM"),
        ("qwen3-tiny", "Qwen3ForCausalLM"),
        ("deepseek-v2-tiny", "DeepseekV2ForCausalLM"),
    ],
)
def test_vs_torch_peer_has_the_papers_groups_and_the_same_model(name, peer_class):
    """The peer is the model of the same family and size (each family's transformers class:
    Qwen's attention biases, DeepSeek-V2's MLA and experts), with the paper's groups."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")  # the peer is a PyTorch model
    import models

    cfg = models.get_config(name)
    peer = vs_torch.peer_model(cfg)
    assert type(peer).__name__ == peer_class
    low_rank, rest = vs_torch.paper_groups(peer)
    assert sum(p.numel() for p in low_rank + rest) == models.param_count(cfg)
    if name == "llama2-tiny":
        assert len(low_rank) == 7 * cfg.num_hidden_layers  # q k v o gate up down in every layer
        assert all(p.ndim == 1 for p in rest if p.shape[0] != cfg.vocab_size)  # norms; embedding, head


@pytest.mark.parametrize(
    "name",
    ["llama2-tiny"] + [pytest.param(n, marks=pytest.mark.slow) for n in ("qwen3-tiny", "deepseek-v2-tiny")],
)
def test_vs_torch_peer_attention_is_causal_sdpa_with_no_mask_under_torch_compile(name):
    """transformers' "sdpa" hands SDPA a (batch, 1, T, T) mask with is_causal=False while
    torch.compile traces (on CUDA no flash kernel takes a mask); the peer's attention is SDPA with
    no mask and is_causal=True in the traced graph, and gives the logits of "sdpa"."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import models

    def traced_sdpa_calls(model, tokens):
        calls = []

        def backend(graph_module, example_inputs):  # records the traced graph, runs it as it is
            for node in graph_module.graph.nodes:
                if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                    calls.append((mask is None, node.kwargs.get("is_causal", False)))
            return graph_module.forward

        torch._dynamo.reset()
        logits = torch.compile(lambda t: model(input_ids=t).logits, backend=backend, fullgraph=True)(tokens)
        return calls, logits

    cfg = models.get_config(name)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    peer = vs_torch.peer_model(cfg)
    calls, logits = traced_sdpa_calls(peer, tokens)
    assert calls == [(True, True)] * cfg.num_hidden_layers
    hf_config = models.to_hf_config(cfg)
    hf_config._attn_implementation, hf_config.use_cache = "sdpa", False
    plain = transformers.AutoModelForCausalLM.from_config(hf_config)
    plain.load_state_dict(peer.state_dict())
    plain_calls, plain_logits = traced_sdpa_calls(plain, tokens)
    assert plain_calls == [(False, False)] * cfg.num_hidden_layers  # what the peer no longer runs
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)


def test_vs_torch_peer_is_built_on_its_device_in_its_dtype():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import models

    peer = vs_torch.peer_model(models.get_config("llama2-tiny"), "cpu", torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in peer.parameters()} == {("cpu", torch.bfloat16)}


def test_vs_torch_derived_figures():
    row = vs_torch.derive({"plain_ms": 100.0, "refresh_ms": 2100.0, "params": 1000}, 5000, peak_tflops=1e-6)
    assert row["tokens_per_s"] == 50_000
    assert row["tokens_per_s_refresh_amortized"] == 5000 / (100 + 2000 / 200) * 1e3
    assert row["mfu"] == 6 * 1000 * 5000 / 0.1 / 1e6


SYNTHETIC_HLO = """HloModule m

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%b (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %f2 = f32[4]{0} fusion(%f1), kind=kLoop, calls=%fused_a
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[4]{0}) tuple(%j, %f2)
}

%c (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%small (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a
}

%big (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %a = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %b = f32[4]{0} fusion(%a), kind=kInput, calls=%fused_a
  %c = f32[4]{0} custom-call(%b), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %d = f32[4]{0} copy(%c)
}

ENTRY %main (p: f32[4], k: s32[]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %k = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %p)
  %w = (s32[], f32[4]) while(%init), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[4]{0} get-tuple-element(%w), index=1
  ROOT %out = f32[4]{0} conditional(%k, %y, %y), branch_computations={%small, %big}
}
"""


def test_program_kernels_weights_loops_by_trip_count_and_takes_the_smaller_branch():
    import train_anatomy

    r = train_anatomy.program_kernels(SYNTHETIC_HLO)
    # Each launching instruction once: body 2 fusions + add, cond's compare, small 1, big 4.
    assert r["kernels"] == 9
    assert r["kernels_by_kind"] == {
        "fusion:kLoop": 4,
        "add": 1,
        "compare": 1,
        "fusion:kInput": 1,
        "custom-call": 1,
        "copy": 1,
    }
    # Body 3 x 3 trips, condition 1 x 4 checks, then the smaller (1) or the larger (4) branch.
    assert r["launches_plain_step"] == 9 + 4 + 1 and r["launches_largest_branches"] == 9 + 4 + 4
    assert r["cudnn_calls"] == ["__cudnn$fmhaSoftmax"] and r["loops_without_trip_count"] == 0


@pytest.mark.slow
def test_train_anatomy_counts_the_micro_batch_loop_and_the_memory():
    """Smaller micro-batches of the same batch: more trips of the accumulation loop (more launches)
    and less activation memory; the peak against the card's memory and JAX's pool of it."""
    import train_anatomy
    import train_step

    import models

    cfg = models.get_config("llama2-tiny", param_dtype="bfloat16", dtype="bfloat16")
    tx = train_step.optimizers(r_base=8, block=16)["adamw"]
    runs = [
        train_anatomy.anatomy(cfg, tx, 8, micro, 16, None, (None, None)) for micro in (4, 2, 1)
    ]  # 2, 4, 8 trips
    launches = [r["launches_plain_step"] for r in runs]
    assert launches[0] < launches[1] < launches[2] and launches[1] > runs[1]["kernels"]
    assert runs[0]["peak_bytes"] > runs[1]["peak_bytes"] > runs[2]["peak_bytes"]
    param_bytes = 2 * models.param_count(cfg)
    for r in runs:
        assert r["peak_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
        assert r["argument_bytes"] >= 3 * param_bytes  # parameters and AdamW's two moments
        assert r["alias_bytes"] > 0 and r["cudnn_calls"] == []  # donated state; no cuDNN on CPU
        assert r["loops_without_trip_count"] == 0
    row = {
        "model": "m",
        "remat": "dots",
        "layers": "scanned",
        "attention": "xla",
        "micro_batch": 4,
        **runs[0],
    }

    def last_line(r):
        return train_anatomy.table([r]).splitlines()[-1]

    assert last_line(row).startswith("| m | dots | scanned | xla | 4 | none |")
    assert last_line(row | {"loss_chunk": 32}).startswith("| m | dots | scanned | xla | 4 | 32 |")
    assert (runs[0]["fits_device"], runs[0]["fits_jax_pool"]) == (None, None)  # memory unknown
    assert " | - | - | " in last_line(row)
    # A deviceless target's pool is JAX's default 75% of its card; the local CPU says neither.
    card = step_anatomy.TARGETS["h200"]["memory_bytes"]
    assert train_anatomy.device_memory("h200") == (card, int(0.75 * card))
    assert train_anatomy.device_memory("local")[0] is None
    # A card just big enough for the middle one's peak: it fits, not in JAX's pool of 75% of it.
    card = runs[1]["peak_bytes"]
    memory = (card, int(0.75 * card))
    sized = [train_anatomy.anatomy(cfg, tx, 8, micro, 16, None, memory) for micro in (4, 2)]
    assert [(r["fits_device"], r["fits_jax_pool"]) for r in sized] == [(False, False), (True, False)]
    assert " | no | no | " in last_line(row | sized[0]) and " | yes | no | " in last_line(row | sized[1])


def test_train_step_benchmark_builds_the_asked_model():
    import argparse

    import train_step

    parser = argparse.ArgumentParser()
    train_step.add_step_arguments(parser)
    args = parser.parse_args(
        ["--model", "llama2-tiny", "--remat", "none", "--layers", "unrolled", "--vocab-size", "300"]
    )
    cfg = train_step.model_config(args)
    assert (cfg.remat, cfg.scan_layers, cfg.vocab_size, cfg.attention_impl, cfg.dtype) == (
        "none",
        False,
        300,
        None,
        "bfloat16",
    )
    args = parser.parse_args(["--model", "llama2-350m", "--attention", "xla"])
    cfg = train_step.model_config(args)
    assert cfg.scan_layers and cfg.attention_impl == "xla" and cfg.remat == "dots" and cfg.loss_chunk == 0
    cfg = train_step.model_config(parser.parse_args(["--loss-chunk", "32"]))
    assert cfg.loss_chunk == 32 and train_step.describe(cfg)["loss_chunk"] == 32


@pytest.fixture
def without_bitsandbytes(monkeypatch):
    """A machine without bitsandbytes, where galore_torch's package __init__ fails (sys.modules
    restored after)."""
    import importlib.util

    if importlib.util.find_spec("galore_torch") is None:
        pytest.skip("galore-torch is not installed")

    def ours(k):
        return k.split(".")[0] in ("galore_torch", "bitsandbytes")

    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.modules["bitsandbytes"] = None  # import bitsandbytes -> ModuleNotFoundError
    yield
    for k in [k for k in sys.modules if ours(k)]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_galore_adamw_loads_without_bitsandbytes(without_bitsandbytes):
    torch = pytest.importorskip("torch")
    with pytest.raises(ModuleNotFoundError):
        import galore_torch  # noqa: F401  (its __init__ imports the 8-bit optimizer)
    for k in [k for k in sys.modules if k.startswith("galore_torch")]:
        del sys.modules[k]
    GaLoreAdamW = vs_torch.galore_adamw()
    assert GaLoreAdamW.__module__ == "galore_torch.adamw"
    w = torch.nn.Parameter(torch.randn(16, 8))
    opt = GaLoreAdamW(
        [{"params": [w], "rank": 2, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}], lr=0.1
    )
    before = w.detach().clone()
    (w**2).sum().backward()
    opt.step()
    assert not torch.equal(before, w.detach())


@pytest.mark.slow
def test_vs_torch_cpu_smoke_run_writes_both_sides(tmp_path):
    """The documented CPU smoke run, the peer's GaLore and MoARa Full only."""
    pytest.importorskip("galore_torch")
    out = tmp_path / "vs.json"
    args = ["--model", "llama2-tiny", "--batch", "8", "--micro-batch", "4", "--seq-len", "32", "--steps", "1"]
    args += ["--warmup", "1", "--refresh-steps", "1", "--no-compile", "--only", "galore_torch", "moara_full"]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "vs_torch.py"), *args, "--out", str(out)],
        cwd=BENCH.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"galore_torch", "moara_full"}
    for run in result["runs"].values():
        assert run["plain_ms"] > 0 and run["refresh_ms"] > 0 and run["tokens_per_s"] > 0
        assert run["micro_batch"] == 4  # each side's row says the micro-batch it ran
    assert result["runs"]["moara_full"]["compiled_peak_bytes"] > 0
    assert result["jax_model"]["attention"] == "xla" and result["jax_preallocate"] == "false"
    assert result["moara_over_peer_tokens_per_s"] > 0


def test_vs_torch_of_the_jax_side_alone_records_the_installed_torch(tmp_path, monkeypatch):
    """A run of this project's side alone (``--only moara_full``, as the GPU session runs each
    optimizer in a process of its own) imports no torch, and still records the version its
    peers' runs have: the session's merged file takes the first run's versions."""
    pytest.importorskip("torch")
    out = tmp_path / "vs.json"
    argv = ["--model", "llama2-tiny", "--batch", "8", "--micro-batch", "4", "--seq-len", "32", "--steps", "1"]
    argv += ["--warmup", "1", "--refresh-steps", "1", "--only", "moara_full", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["vs_torch.py", *argv])
    vs_torch.main()
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"moara_full"} and result["runs"]["moara_full"]["micro_batch"] == 4
    assert result["versions"]["torch"] == importlib.metadata.version("torch")


def test_vs_torch_peer_halves_its_micro_batch_where_the_device_runs_out_of_memory(monkeypatch):
    """The peer has no remat: out of device memory at ``--micro-batch``, it runs at the largest half
    that fits and its row says which; at an odd micro-batch the error stands."""
    torch = pytest.importorskip("torch")
    tried = []

    def at(cfg, optimizer, args, micro_batch):
        tried.append(micro_batch)
        if micro_batch > 32:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"micro_batch": micro_batch}

    monkeypatch.setattr(vs_torch, "_torch_peer_at", at)
    args = SimpleNamespace(micro_batch=128)
    assert vs_torch.torch_peer(None, "galore_torch", args) == {"micro_batch": 32}
    assert tried == [128, 64, 32]
    tried.clear()
    with pytest.raises(torch.OutOfMemoryError):
        vs_torch.torch_peer(None, "galore_torch", SimpleNamespace(micro_batch=96 + 3))
    assert tried == [99]


@pytest.mark.slow
def test_gpu_session_kills_a_childs_whole_process_group_at_the_deadline(tmp_path):
    """A child stopped at the deadline takes the processes it started along (torch.compile's
    workers held the log's pipe open past the call's limit): the call returns at the deadline."""
    import gpu_session

    session = gpu_session.Session(tmp_path, budget_s=3, smoke=True)
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    t0 = time.monotonic()
    rc, text = session.capture([sys.executable, "-c", code])
    assert rc is None and time.monotonic() - t0 < 60
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{grandchild}").exists():
        state = Path(f"/proc/{grandchild}/stat").read_text().split(")")[-1].split()[0]
        if state == "Z":  # killed, not yet reaped by its (killed) parent's reaper
            break
        time.sleep(0.1)
    else:
        assert not Path(f"/proc/{grandchild}").exists(), "the child's own child outlived the deadline"


def test_gpu_session_records_a_phases_fault_and_goes_on(tmp_path, monkeypatch):
    """A phase that raises is recorded with its error; the phases after it still run."""
    import gpu_session

    def broken(s):
        raise KeyError("plain_ms")

    phases = dict(gpu_session.PHASES)
    phases["vs_torch_350m"] = (lambda s: 0.0, broken)
    phases["env"] = (lambda s: 0.0, lambda s: {"ok": True})
    monkeypatch.setattr(gpu_session, "PHASES", phases)
    session = gpu_session.Session(tmp_path, budget_s=60, smoke=True)
    gpu_session.run_phases(session, ["vs_torch_350m", "env"])
    saved = json.loads((tmp_path / "session.json").read_text())
    assert saved["phases"]["vs_torch_350m"]["error"] == "KeyError: 'plain_ms'"
    assert saved["phases"]["env"]["ok"] is True and "finished" in saved


def test_gpu_session_names_the_gpu_tests_that_fail(tmp_path, monkeypatch):
    """The GPU tests' phase lists each failing test (pytest's summary names failures only when
    asked to alongside the skips)."""
    import gpu_session

    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_gpu.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_ok():\n    pass\n"
        "def test_wrong():\n    assert 1 == 2\n"
        "def test_elsewhere():\n    pytest.skip('needs a GPU')\n"
        # a test that starts python -m train runs a second JAX process: no preallocation
        "def test_shares_the_gpu():\n    import os\n"
        "    assert os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'false'\n"
        "@pytest.mark.parametrize('x', ['a b'])\n"  # an id with a space
        "def test_param(x):\n    pass\n"
        "@pytest.fixture\n"
        "def broken():\n    yield\n    raise RuntimeError('in teardown')\n"
        "def test_teardown(broken):\n    pass\n"  # passes, then errors
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    monkeypatch.setattr(gpu_session, "ROOT", tmp_path)
    timeouts = []
    child = gpu_session.Session._child

    def timed(cmd, env, timeout, capture):
        timeouts.append(timeout)
        return child(cmd, env, timeout, capture)

    monkeypatch.setattr(gpu_session.Session, "_child", staticmethod(timed))
    result = gpu_session.phase_gpu_tests(gpu_session.Session(tmp_path, budget_s=600, smoke=True))
    assert result["failures"] == ["tests/test_gpu.py::test_wrong", "tests/test_gpu.py::test_teardown"]
    assert result["counts"] == {"passed": 4, "failed": 1, "skipped": 1, "error": 1}
    assert (
        timeouts == [gpu_session.GPU_TESTS_S] and gpu_session.GPU_TESTS_S < 600
    )  # capped: the rest keep theirs
    assert result["tests"] == {
        f"tests/test_gpu.py::{name}": outcomes
        for name, outcomes in (
            ("test_ok", ["PASSED"]),
            ("test_wrong", ["FAILED"]),
            ("test_elsewhere", ["SKIPPED"]),
            ("test_shares_the_gpu", ["PASSED"]),
            ("test_param[a b]", ["PASSED"]),
            ("test_teardown", ["PASSED", "ERROR"]),
        )
    }
    assert set(result["seconds"]) == set(result["tests"]) and result["stopped_in"] is None
    # Stopped at the cap in the third test: the two it finished, and where it stopped. The cap's
    # SIGINT comes GRACE_S before it (here at 8 s), so pytest still prints its durations; a test
    # that ignores SIGINT is killed at the cap, before pytest's summary.
    monkeypatch.setattr(gpu_session, "GPU_TESTS_S", 10.0)
    monkeypatch.setattr(gpu_session, "GRACE_S", 2.0)
    for ignores in (False, True):
        (tests / "test_gpu.py").write_text(
            "import pytest, signal, time\n"
            "pytestmark = pytest.mark.gpu\n"
            "def test_ok():\n    pass\n"
            "def test_wrong():\n    assert 1 == 2\n"
            f"def test_slow():\n    {'signal.signal(signal.SIGINT, signal.SIG_IGN)' if ignores else 'pass'}\n"
            "    time.sleep(60)\n"
            "def test_never():\n    pass\n"
        )
        result = gpu_session.phase_gpu_tests(gpu_session.Session(tmp_path, budget_s=600, smoke=True))
        assert result["rc"] is None and result["counts"] == {"passed": 1, "failed": 1}, result
        assert result["tests"] == {
            "tests/test_gpu.py::test_ok": ["PASSED"],
            "tests/test_gpu.py::test_wrong": ["FAILED"],
        }
        assert result["stopped_in"] == "tests/test_gpu.py::test_slow"
        finished = {"tests/test_gpu.py::test_ok", "tests/test_gpu.py::test_wrong"}
        assert result["seconds"] == {} if ignores else finished <= set(result["seconds"]), result["seconds"]
        assert "tests/test_gpu.py::test_never" not in result["seconds"]


def test_gpu_session_names_the_test_a_stop_came_in_and_none_after_the_tests_ended():
    import gpu_session

    outcomes = {"tests/test_gpu.py::test_a": ["PASSED"], "tests/test_gpu.py::test_p[a b]": ["PASSED"]}
    head = "tests/test_gpu.py::test_a PASSED      [ 33%]\ntests/test_gpu.py::test_p[a b] PASSED  [ 66%]\n"
    assert gpu_session.stopped_test(head + "tests/test_gpu.py::test_c \n\n=== 2 passed ===", outcomes) == (
        "tests/test_gpu.py::test_c"
    )
    assert gpu_session.stopped_test(head, outcomes) is None  # stopped in a fixture's teardown


def test_a_stopped_child_is_read_to_its_end_in_the_grace_before_the_kill(tmp_path):
    """What a child prints on the SIGINT before its limit comes back whole, more than a pipe holds
    (64 KiB) included: read on in the grace, it is not left blocked on a full pipe until the kill."""
    import gpu_session

    child = tmp_path / "child.py"
    child.write_text(
        "import signal, sys, time\n"
        "def stop(*_):\n    sys.stdout.write('x' * 200_000 + '\\n=== 1 passed in 1.0s ===\\n')\n"
        "    sys.stdout.flush()\n    sys.exit(2)\n"
        "signal.signal(signal.SIGINT, stop)\nprint('started', flush=True)\ntime.sleep(60)\n"
    )
    rc, out = gpu_session.Session._child([sys.executable, str(child)], None, 4.0, capture=True)
    assert rc is None and out.startswith("started") and out.endswith("=== 1 passed in 1.0s ===\n")
    assert out.count("x") == 200_000


def test_gpu_session_times_moara_against_galore_first_with_the_gpu_to_itself(tmp_path, monkeypatch):
    """The vs_torch phases run this project's Full and GaLore first (issue 22's ratio, before the
    slow peer compile), each JAX child with the pool of a GPU to itself (JAX's default 75% is
    under what the 1B step needs without remat), the peers with their own allocator."""
    import gpu_session

    seen = []

    def fake_run(self, cmd, env=None, timeout=None):
        seen.append((cmd[cmd.index("--only") + 1], (env or {}).get("XLA_PYTHON_CLIENT_MEM_FRACTION")))
        # Both sides at the paper config's rank; each child capped by its estimate (smoke: 20 s).
        at = cmd.index("--r-base")
        assert cmd[at : at + 4] == ["--r-base", "8", "--block-size", "4"]
        assert timeout == gpu_session.child_cap(20.0) == 80.0
        return {"rc": 1, "seconds": 0.0, "stopped_at_deadline": False}  # no result: nothing to merge

    monkeypatch.setattr(gpu_session.Session, "run", fake_run)
    monkeypatch.setattr(gpu_session, "paper_args", lambda model: [])
    monkeypatch.setattr(gpu_session, "paper_rank_args", lambda model: ["--r-base", "8", "--block-size", "4"])
    result = gpu_session.phase_vs_torch(
        gpu_session.Session(tmp_path, budget_s=600, smoke=True), "llama2-350m"
    )
    fraction = gpu_session.JAX_ALONE_MEM_FRACTION
    assert seen == [
        ("moara_full", fraction),
        ("galore_vanilla", fraction),
        ("galore_torch", None),
        ("adamw", fraction),
        ("adamw_torch", None),
    ]
    assert set(result["runs"]) == {name for name, _ in seen}


def test_gpu_session_reads_pytest_counts_and_loop_step_times():
    import gpu_session

    assert gpu_session.pytest_counts("3 passed, 2 skipped, 1 error in 4.20s") == {
        "passed": 3,
        "skipped": 2,
        "error": 1,
    }
    rows = [
        {"step": s, "step_time_s": t, "wall_s": w} for s, t, w in [(1, 30.0, 30), (2, 1.0, 31), (3, 1.0, 32)]
    ]
    rows += [{"step": 4, "step_time_s": 1.2, "wall_s": 33.2}, {"step": 4, "eval_loss": 3.0, "wall_s": 35.0}]
    rows += [{"step": 5, "step_time_s": 2.9, "wall_s": 36.1}, {"step": 6, "step_time_s": 1.1, "wall_s": 37.2}]
    times = gpu_session.loop_step_times(rows, skip=1)  # step 1 holds the compilation
    assert times["median_step_s"] == 1.1  # of 1.0, 1.0, 1.2, 2.9, 1.1
    # not 4 (eval), 5 (after it) or 3 (before it: its read may wait for step 4 too)
    assert times["mean_plain_step_s"] == pytest.approx((1.0 + 1.1) / 2)
    assert times["wall_per_step_s"] == pytest.approx((37.2 - 31) / 4) and times["evaluations"] == 1


def test_loop_waits_splits_each_iteration_into_the_loops_parts():
    """From a dispatch to the next: each part's time (the wait for a step's metrics inside their
    read), the rest as ``other``; the summary takes the iterations after the first ``skip`` steps
    that neither evaluate or save nor follow one within two steps."""
    import loop_waits

    t = loop_waits.Timings()
    # (part, the step the loop was at, start, end) in seconds; step k is dispatched at step k - 1
    t.calls = [("dispatch", 0, 0.0, 2.0), ("draw", 1, 2.0, 2.1)]  # step 1: its compilation
    t.calls += [("dispatch", 1, 2.2, 2.201), ("draw", 2, 2.201, 2.203)]
    t.calls += [("read", 2, 2.203, 2.25), ("wait", 2, 2.204, 2.24)]  # the read of step 1
    t.calls += [("dispatch", 2, 2.26, 2.261), ("read", 3, 2.261, 2.262), ("wait", 3, 2.261, 2.2615)]
    t.calls += [("read", 3, 2.262, 2.31), ("wait", 3, 2.262, 2.309), ("evaluate", 3, 2.31, 2.5)]
    for k in range(3, 8):  # steps 4 to 8: 50 ms each, 40 of them waiting
        t.calls += [("dispatch", k, 2.5 + (k - 3) * 0.05, 2.5 + (k - 3) * 0.05 + 0.001)]
        t.calls += [("read", k + 1, 2.51 + (k - 3) * 0.05, 2.55 + (k - 3) * 0.05)]
        t.calls += [("wait", k + 1, 2.51 + (k - 3) * 0.05, 2.54 + (k - 3) * 0.05)]
    rows = t.iterations()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]  # the last dispatch ends no iteration
    assert rows[0]["dispatch"] == pytest.approx(2000) and rows[0]["period"] == pytest.approx(2200)
    assert rows[1]["read"] == pytest.approx(47) and rows[1]["wait"] == pytest.approx(36)
    assert rows[1]["read_rest"] == pytest.approx(11) and rows[1]["other"] == pytest.approx(60 - 1 - 2 - 47)
    assert rows[2]["read"] == pytest.approx(49) and rows[2]["evaluate"] == pytest.approx(190)
    summary = loop_waits.summarize(rows, skip=1)
    assert summary["plain_iterations"] == 3  # steps 2, 6 and 7: not 3 (evaluates), 4 or 5 (after it)
    assert summary["period_ms"]["median"] == pytest.approx(50)
    assert summary["wait_ms"]["median"] == pytest.approx(30)
    assert summary["read_rest_ms"]["median"] == pytest.approx(10)


@pytest.mark.slow
def test_gpu_session_times_the_training_loops_parts_against_the_step_benchmark(tmp_path):
    """The train_loop phase at 60M (here its --smoke sizes): the loop's step times over
    train_step.py's, and where its host time goes (loop_waits.py's file among the results)."""
    import gpu_session

    session = gpu_session.Session(tmp_path, budget_s=240, smoke=True)
    try:
        result = gpu_session.phase_train_loop(session, "llama2-60m")
    finally:
        session.close()
    assert "error" not in result, result
    waits = json.loads((tmp_path / "loop_waits-llama2-60m.json").read_text())
    assert waits["train_exit"] == 0 and len(waits["rows"]) == 7  # 8 steps: 7 dispatch-to-dispatch
    assert {r["step"] for r in waits["rows"] if r["evaluate"]} == {4}
    # each reads a step, but the first (nothing to read yet) and the one after the evaluation (step
    # 4 read its own metrics at once)
    reading = {r["step"] for r in waits["rows"] if r["read"] >= r["wait"] > 0}
    assert reading == {2, 3, 4, 6, 7}, waits["rows"]
    assert result["host_ms"] == {k: v for k, v in waits.items() if k.endswith(("_ms", "iterations"))}
    # the benchmark ran the run's own step: tiny, batch 16 in micro-batches of 8, sequence 32
    assert (
        "--model tiny" in result["benchmark_command"]
        and "--micro-batch 8 --seq-len 32" in result["benchmark_command"]
    )


def test_gpu_session_benchmarks_the_step_the_60m_loop_run_took(tmp_path):
    """train_loop_60m's train_step.py arguments come from its run: the evidence runs' 60M step
    (T5's 32,000 ids though it reads the byte-level corpus, batch 128 unsplit, r_base 128, block 64)."""
    import dataclasses

    import gpu_session

    from train.config import load_config, to_dict
    from train.model import model_config
    from train.rundir import RunDir

    config, extra = gpu_session.LOOP_SETTINGS["llama2-60m"]
    sets = ["data.source=builtin", "data.tokenizer=bytes", *extra]
    cfg = load_config(str(BENCH.parent / config), sets)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_config(to_dict(cfg))
    run.write_model(dataclasses.asdict(model_config(cfg, 259)))
    args = gpu_session.same_step_args(run)
    settings = dict(zip(args[::2], args[1::2], strict=True))
    assert settings == {
        **{"--model": "llama2-60m", "--vocab-size": "32000", "--remat": "none", "--layers": "unrolled"},
        **{"--attention": "auto", "--loss-chunk": "0"},
        **{
            "--batch": "128",
            "--micro-batch": "128",
            "--seq-len": "256",
            "--r-base": "128",
            "--block-size": "64",
        },
    }
    # How the model computes goes along (the loss in chunks, the attention); a float32 run has
    # no bf16 benchmark of the same step.
    changed = dataclasses.replace(model_config(cfg, 259), loss_chunk=32, attention_impl="xla")
    run.write_model(dataclasses.asdict(changed))
    args = gpu_session.same_step_args(run)
    settings = dict(zip(args[::2], args[1::2], strict=True))
    assert settings["--loss-chunk"] == "32" and settings["--attention"] == "xla"
    run.write_model(dataclasses.asdict(dataclasses.replace(changed, param_dtype="float32")))
    with pytest.raises(ValueError, match="parameters and compute are float32 and bfloat16"):
        gpu_session.same_step_args(run)


def test_gpu_session_variants_run_over_the_paper_settings():
    import gpu_session

    import models

    for name, n in gpu_session.PARAMS.items():  # the estimates' parameter counts are the presets'
        assert n == models.param_count(models.get_config(name)), name

    from train.xla_flags import GPU_FLAG_SETS

    session = gpu_session.Session(Path("unused"), budget_s=1, smoke=False, jax_args=["--micro-batch", "64"])
    for group in ("model", "flags"):
        variants = gpu_session.variant_list(session, group)
        labels = [label for label, _ in variants]
        assert variants[0] == ("baseline", []) and variants[-1][1] == [] and len(set(labels)) == len(labels)
    flag_sets = [args[1] for _, args in gpu_session.variant_list(session, "flags")[1:-1]]
    assert flag_sets == list(GPU_FLAG_SETS)
    assert ("loss in chunks of 32", ["--loss-chunk", "32"]) in gpu_session.variant_list(session, "model")
    combined = ["--remat", "none", "--layers", "unrolled", "--micro-batch", "256"]
    assert ("remat none, unrolled layers, micro-batch 256", combined) in gpu_session.variant_list(
        session, "model"
    )
    # The baseline: configs/paper/llama2-350m.yaml's model settings (remat dots; the preset's
    # scanned layers; 60M: none, unrolled), then --jax-args; no paper config, train_step's defaults.
    assert gpu_session.paper_args("llama2-350m") == ["--remat", "dots", "--layers", "scanned"]
    assert gpu_session.paper_args("llama2-60m") == ["--remat", "none", "--layers", "unrolled"]
    assert gpu_session.paper_args("tiny") == []
    # vs_torch.py's rank and block size, both sides': the paper config's (512 and 64 at 1B).
    assert gpu_session.paper_rank_args("llama2-1b") == ["--r-base", "512", "--block-size", "64"]
    assert gpu_session.paper_rank_args("llama2-350m") == ["--r-base", "256", "--block-size", "32"]
    assert gpu_session.paper_rank_args("llama2-tiny") == []
    baseline = gpu_session._baseline(session)
    assert baseline == ["--remat", "dots", "--layers", "scanned", "--micro-batch", "64"]
    # A variant that repeats the baseline's settings is not run twice.
    assert gpu_session._same_as_baseline(session, ["--remat", "dots", "--layers", "scanned"])
    assert gpu_session._same_as_baseline(session, ["--micro-batch", "64"])
    assert not gpu_session._same_as_baseline(session, ["--layers", "unrolled"])
    assert not gpu_session._same_as_baseline(session, ["--attention", "xla"])
    assert session._work is None  # no phase ran: no scratch directory was made
    work = session.work
    assert work.is_dir() and session.work == work
    session.close()
    assert not work.exists()


@pytest.mark.parametrize("mode", ["methods", "spread"])
@pytest.mark.slow
def test_refresh_methods_runs_moara_jax_refresh(mode, tmp_path):
    """refresh_methods.py's moara_jax methods at the tiny size: each gives the float64 SVD's
    subspace (``methods``), and the spread refresh is timed beside the unspread one on two CPU
    devices (``spread``)."""
    from helpers import cpu_devices

    names = ["jax_exact_current", "jax_gram_eigh", "jax_randomized"]
    args = [sys.executable, str(BENCH / "refresh_methods.py"), "--size", "tiny", "--repeats", "1"]
    args += ["--methods", *names, "--out", str(tmp_path / "out.json")]
    args += ["--spread"] if mode == "spread" else ["--no-torch"]
    proc = subprocess.run(args, env=cpu_devices(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    if mode == "methods":
        rows = result["jax_methods"]
        assert rows["jax_exact_current"]["largest_angle_deg"] < 0.1, rows
        assert rows["jax_gram_eigh"]["largest_angle_deg"] < 1.0, rows
        assert rows["jax_randomized"]["energy_ratio_min"] > 0.9, rows
    else:
        rows = dict(result["spread"])
        assert rows.pop("devices") == 2
        assert set(rows) == {f"{n}/{g}" for n in names for g in ("replicated", "sharded")}
        assert all(
            r[m]["ms_median"] > 0 and r[m]["temp_mib"] > 0
            for r in rows.values()
            for m in ("every_device", "spread")
        )


@pytest.mark.slow
def test_sharded_step_counts_fewer_collective_bytes_with_activation_rules(tmp_path):
    """sharded_step.py on the tiny config: under FSDP (and FSDP with tensor parallelism) the
    activation constraints cut the bytes the compiled step moves through collectives at least
    in half; without FSDP (pure data parallelism) they change nothing."""
    from helpers import cpu_devices

    out = tmp_path / "out.json"
    args = [sys.executable, str(BENCH / "sharded_step.py"), "--meshes", "2x4x1", "2x2x2", "8x1x1"]
    proc = subprocess.run(
        [*args, "--out", str(out)],
        cwd=BENCH.parent,
        env=cpu_devices(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["meshes"]
    assert rows["2x4x1"]["ratio"] < 0.5 and rows["2x2x2"]["ratio"] < 0.5, rows
    assert rows["8x1x1"]["with_rules"]["bytes"] == rows["8x1x1"]["without_rules"]["bytes"]


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("optimizer_step", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
        ("optimizer_step", ["--only", "moara_fll"], "--only: unknown moara_fll (known: moara_full_exact, "),
        ("optimizer_step", ["--loop-steps", "200"], "--loop-steps must be under the refresh interval (200)"),
        ("optimizer_step", ["--out", "."], "--out . is a directory: give a file path"),
        ("kernel_profile", ["--only", "x"], "--only: unknown x (known: "),
        ("train_step", ["--batch", "8", "--micro-batch", "3"], "--micro-batch 3 does not divide --batch 8"),
        ("train_step", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        ("train_step", ["--xla-flag-sets", "bogus"], "--xla-flag-sets: unknown bogus (known: latency_hiding"),
        ("vs_torch", ["--only", "galore"], "--only: unknown galore (known: galore_torch, adamw_torch, "),
        ("train_anatomy", ["--batch", "8", "--micro-batch", "4", "3"], "--micro-batch 3 does not divide"),
        ("refresh_methods", ["--methods", "svd"], "--methods: unknown svd (known: jax_randomized, "),
        ("sharded_step", ["--meshes", "1x8"], "--meshes: '1x8' is not data x fsdp x tensor (e.g. 2x4x1)"),
        ("sharded_step", ["--meshes", "2x4x1"], "--meshes: 2x4x1 needs 8 devices, this process has 1"),
        (
            "data_pipeline",
            ["--shards", "*.jsonl", "--validation", "v.jsonl", "--tokenizer", "bytes", "--workers", "1,0"],
            "argument --workers: must be at least 1, got 0",
        ),
        (
            "data_pipeline",
            ["--shards", "/nowhere/train-*.jsonl", "--validation", "v.jsonl", "--tokenizer", "bytes"],
            "--shards: no file matches /nowhere/train-*.jsonl",
        ),
        (
            "data_pipeline",
            ["--shards", __file__, "--validation", "/nowhere/v.jsonl", "--tokenizer", "/nowhere/sp.model"],
            "no file /nowhere/v.jsonl, /nowhere/sp.model",
        ),
        ("tokenizer_export", ["--tokenizer", "/nowhere/sp.model", __file__], "no file /nowhere/sp.model"),
        (
            "tokenizer_export",
            ["--train-bpe", __file__, "--vocab-size", "0", __file__],
            "must be at least 1, got 0",
        ),
        ("fused_kernel", ["--size", "tiny"], "fused_kernel.py times a GPU kernel: JAX's backend is cpu"),
        (
            "step_anatomy",
            ["--target=h100", "--size", "tiny"],
            "--target h100 compiles with JAX's CUDA plugin",
        ),
        (
            "train_anatomy",
            ["--target", "h200", "--models", "tiny"],
            "--target h200 compiles with JAX's CUDA plugin",
        ),
    ],
)
def test_a_benchmarks_bad_arguments_are_one_line_before_any_work(script, argv, message, monkeypatch, capsys):
    """A typo'd name ran nothing and exited 0; a zero count, a missing input file, a micro-batch
    that does not divide the batch (run as another one), a mesh of the wrong size, a GPU-only
    script on a CPU and a deviceless H100 compile without JAX's CUDA plugin each ended in a
    traceback, some after minutes of timing."""
    if script in ("step_anatomy", "train_anatomy") and any("cuda" in p for p in _plugins()):
        pytest.skip("JAX's CUDA plugin is installed: the deviceless targets compile")
    if script == "fused_kernel" and jax.default_backend() == "gpu":
        pytest.skip("a GPU: the kernels would be timed")
    module = __import__(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as e:
        module.main()
    err = capsys.readouterr().err
    # argparse's usage, then its one error line; or sys.exit's one line (printed by Python itself)
    last = str(e.value.code) if isinstance(e.value.code, str) else err.strip().splitlines()[-1]
    assert e.value.code not in (0, None) and "Traceback" not in err, err
    assert last.startswith((f"{script}.py: error: ", "error: ")) and message in last and "\n" not in last, (
        last
    )


def _plugins() -> list[str]:
    import importlib.metadata

    return [d.metadata["Name"] for d in importlib.metadata.distributions() if "jax" in d.metadata["Name"]]


def test_vs_torch_names_a_missing_peer_package_and_runs_the_jax_side_without_torch(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    # galore_torch missing, torch and transformers there (found or not on this machine)
    present = {"torch", "transformers"}
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "galore_torch" else real("json" if name in present else name, *a),
    )
    monkeypatch.setattr(sys, "argv", ["vs_torch.py", "--only", "galore_torch", "moara_full"])
    with pytest.raises(SystemExit) as e:
        vs_torch.main()
    assert str(e.value) == (
        "error: the peer runs (galore_torch) need galore_torch: pip install galore-torch "
        "(or --only moara_full)"
    )


@pytest.mark.parametrize(
    "jax_args", ["--batch 256", "--remat dots --seq-len=512", "--r-base 128", "--seq 512", "--block=8"]
)
def test_gpu_session_refuses_jax_args_that_change_one_sides_workload(jax_args, tmp_path, capsys):
    """``--jax-args`` goes to this project's runs alone: an option that says what both sides run
    (the batch, the sequence, the rank, ...) would compare two workloads, and is refused before
    anything runs."""
    import gpu_session

    with pytest.raises(SystemExit) as e:
        gpu_session.main(["--out", str(tmp_path / "out"), "--smoke", f"--jax-args={jax_args}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--jax-args:" in err and "would change the workload of this project's runs alone" in err
    assert not (tmp_path / "out").exists()


def test_gpu_session_off_smoke_stops_in_one_line_where_jax_has_no_gpu(tmp_path, monkeypatch, capsys):
    """Without ``--smoke`` the phases time a GPU: on a machine whose JAX has none, ``env`` runs
    (first, whatever the order asked) and nothing else does (350M at batch 512 would run on the
    CPU until the deadline). Before it, the session ends the process groups an earlier call cut
    off at its limit left running (recorded where the evidence runner records its runs')."""
    import gpu_session
    from test_evidence import left_by_a_driver_gone

    ran = []
    phases = dict(gpu_session.PHASES)
    phases["env"] = (lambda s: 0.0, lambda s: ran.append("env") or {"backend": "cpu"})
    phases["vs_torch_350m"] = (lambda s: 0.0, lambda s: ran.append("vs_torch_350m") or {})
    monkeypatch.setattr(gpu_session, "PHASES", phases)
    monkeypatch.setattr(gpu_session, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_session, "GROUPS", None)  # main() sets it: put back after the test
    left = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        left_by_a_driver_gone(tmp_path / gpu_session.CHILDREN_FILE, left, "tiny/full-seed0")
        assert gpu_session.main(["--out", str(tmp_path / "out"), "--phases", "vs_torch_350m"]) == 2
        assert left.wait(timeout=10) == -9
    finally:
        left.kill()
        left.wait()
    assert ran == ["env"]
    out, err = capsys.readouterr()
    assert f"ended tiny/full-seed0 (process group {left.pid}), left running by an earlier call" in out
    assert err.strip().splitlines()[-1] == (
        "error: JAX's backend here is cpu, not a GPU: the phases time a GPU "
        "(--smoke checks this script on a CPU)"
    )


def test_gpu_session_sh_leaves_wheels_of_another_python_uninstalled(tmp_path):
    """``.whl/`` holds the GPU machine's CPython 3.12 wheels (``gpu_wheels.sh``): elsewhere pip
    refused them and the script ended before its session; it now says so and goes on."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "gpu_session.sh").write_text((BENCH / "gpu_session.sh").read_text())
    (tmp_path / "benchmarks" / "gpu_session.py").write_text("print('session ran')\n")
    python3 = subprocess.run(
        ["python3", "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True
    )
    major, minor = map(int, python3.stdout.split())  # the script's python3, which may not be this one
    other = f"cp{major}{minor + 1}"
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / f"grain-0.2.18-{other}-{other}-manylinux_2_27_x86_64.whl").write_bytes(b"")
    proc = subprocess.run(
        ["bash", str(tmp_path / "benchmarks" / "gpu_session.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": str(tmp_path / "out")},
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        f"grain-0.2.18-{other}-{other}-manylinux_2_27_x86_64.whl is for another Python than this one: not"
        in proc.stderr
    )
    assert "session ran" in proc.stdout


def test_optimizer_step_writes_a_figure_not_measured_as_null_not_nan(tmp_path):
    """``--in-jit-only`` and ``--refresh-repeats 0`` leave figures unmeasured: strict JSON
    readers (``json.loads(..., parse_constant=...)``, JavaScript) refuse NaN."""
    out = tmp_path / "r.json"
    optimizer_step._write(
        str(out), {"ms": {"adamw": {"plain": float("nan"), "in_jit": 1.5}}, "ratio": [float("nan")]}
    )

    def refuse(name):
        raise ValueError(f"{name} in the JSON")

    assert json.loads(out.read_text(), parse_constant=refuse) == {
        "ms": {"adamw": {"plain": None, "in_jit": 1.5}},
        "ratio": [None],
    }


def test_train_anatomy_compiles_a_profiling_step_that_measures_only_at_its_recordings():
    """``--profile-every N``: the profiling run's step. Measuring every step launches more than a
    training step; measuring every 4th puts the measurement in a branch a plain step skips (its
    kernels are in the program, its launches are not)."""
    import train_anatomy
    import train_step

    import models

    cfg = models.get_config("llama2-tiny", param_dtype="bfloat16", dtype="bfloat16")
    tx = train_step.optimizers(r_base=8, block=16)["galore_vanilla"]
    train, every, some = (train_anatomy.anatomy(cfg, tx, 8, 8, 16, None, (None, None), n) for n in (0, 1, 4))
    assert every["launches_plain_step"] > some["launches_plain_step"] >= train["launches_plain_step"]
    assert some["kernels"] > train["kernels"]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_tokenizer_export_counts_every_document_and_names_where_the_two_first_part(tmp_path, monkeypatch):
    """tokenizer_export.py on a BPE model it trains with Llama 2's settings: every document and
    token counted, none differing (the export is exact for BPE); with an ``AutoTokenizer`` that
    encodes one document otherwise, that document named with both lengths and the pieces of each
    from where they first part."""
    pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")
    import tokenizer_export

    from train.sources import SentencePieceTokenizer

    words = "the quick brown fox jumps over a lazy dog while 42 cats sleep near 1999 red houses".split()
    texts = [" ".join(words[i:] + words[:i]) + f" number {i * 37}" for i in range(12)]
    docs = _jsonl(tmp_path / "docs.jsonl", texts)
    model = tokenizer_export.train_bpe(str(docs), 300, tmp_path / "bpe")
    sp = SentencePieceTokenizer(model)
    lengths = [len(sp.encode(t)) for t in texts]
    assert tokenizer_export.compare(model, [str(docs)]) == {
        "documents": 12,
        "tokens": sum(lengths),
        "documents_differing": 0,
        "differ": [],
    }

    loaded = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(*args, **kwargs):  # the third document's ids from its third on: swapped
        hf = loaded(*args, **kwargs)
        encode = hf.encode

        def changed(text, **kw):
            ids = encode(text, **kw)
            return ids[:2] + ids[2:][::-1] if text == texts[2] else ids

        hf.encode = changed
        return hf

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    result = tokenizer_export.compare(model, [str(docs)])
    want = sp.encode(texts[2])
    got = want[:2] + want[2:][::-1]
    at = next(i for i in range(2, len(want)) if want[i] != got[i])
    piece = sp.processor.id_to_piece
    assert result["documents_differing"] == 1 and result["tokens"] == sum(lengths)
    assert result["differ"] == [
        {
            "document": 2,
            "tokens": [lengths[2], lengths[2]],
            "sentencepiece": [piece(i) for i in want[at : at + 4]],
            "transformers": [piece(i) for i in got[at : at + 4]],
        }
    ]


def _pipeline_shards(folder: Path) -> list[Path]:
    folder.mkdir()
    return [
        _jsonl(
            folder / f"train-{s}.jsonl",
            [f"document {d} of shard {s}: " + "lorem ipsum " * 30 for d in range(20)],
        )
        for s in range(2)
    ]


def test_data_pipeline_prepares_and_loads_every_token(tmp_path):
    """data_pipeline.py's prepare and loader parts on byte-tokenized shards: the store holds each
    document's bytes and an EOS (with 1 worker and with 2), and the loader times batches from it."""
    import data_pipeline

    from train import store as token_store
    from train.config import DataSection

    shards = _pipeline_shards(tmp_path / "shards")
    validation = _jsonl(tmp_path / "validation.jsonl", ["held out " * 40] * 5)
    section = DataSection(
        source="files", paths=[str(s) for s in shards], validation_paths=[str(validation)], tokenizer="bytes"
    )
    texts = [json.loads(line)["text"] for s in shards for line in s.read_text().splitlines()]
    want_train = sum(len(t.encode()) + 1 for t in texts)
    for workers in (1, 2):
        prepared = data_pipeline.prepare(section, tmp_path / "store", workers)
        assert prepared["workers"] == workers and prepared["tokens"] == want_train + 5 * (
            len("held out " * 40) + 1
        )
        assert prepared["tokens_per_s"] == pytest.approx(prepared["tokens"] / prepared["seconds"])
    assert token_store.TokenStore(tmp_path / "store").manifest["splits"]["train"]["tokens"] == want_train
    loaded = data_pipeline.loader(tmp_path / "store", batch=4, seq_len=16, batches=3, repeats=2)
    assert loaded["batch"] == 4 and loaded["seq_len"] == 16 and loaded["tokens_per_s"] > 0


@pytest.mark.slow
def test_data_pipeline_train_run_reports_the_childs_store_rss_and_start_up(tmp_path):
    """data_pipeline.py's ``python -m train`` on a prepared store: the train tokens the run's
    summary counts, the child's own peak RSS, its start-up."""
    import data_pipeline

    from train.config import DataSection

    shards = _pipeline_shards(tmp_path / "shards")
    section = DataSection(
        source="files", paths=[str(shards[0])], validation_paths=[str(shards[1])], tokenizer="bytes"
    )
    data_pipeline.prepare(section, tmp_path / "store", 1)
    run = data_pipeline.train_run(tmp_path / "store", "bytes", tmp_path / "run", steps=2)
    text = [json.loads(line)["text"] for line in shards[0].read_text().splitlines()]
    assert run["train_tokens_in_store"] == sum(len(t.encode()) + 1 for t in text)
    assert 100 < run["peak_rss_mb"] < 1 << 16
    assert run["startup"]["first_step_s"] > 0 and run["process_wall_s"] > run["startup"]["first_step_s"]
