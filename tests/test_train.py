"""The training program end to end on tiny configs (CPU): CLI, metrics, resume after SIGTERM,
an 8-device sharded run, data edge cases, config errors, compare and profiling."""

import contextlib
import dataclasses
import functools
import gzip
import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import yaml
from helpers import cpu_devices

import moara_jax as mj
from train.config import load_config
from train.errors import EXIT_PREEMPTED, UserError
from train.rundir import dedupe_by_step, read_metrics
from train.sources import Counts, file_documents

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
FAST = [
    "train.steps=12",
    "train.eval_every=6",
    "train.batch_size=8",
    "train.seq_len=32",
    "train.eval_batches=2",
    "optimizer.update_proj_gap=5",
    "checkpoint.every=4",
]


def run_cli(run_dir, *sets, extra=(), env=None, check=True, quiet=True, in_process=None, **kw):
    """``python -m train`` on the tiny config: its exit status and output. In this process
    (``train.__main__.main``, the same code with the interpreter's start-up saved) unless a test
    needs a process of its own: an environment of its own (``env``: device counts, platforms) or
    ``in_process=False`` (a real command line, or runs compared with ones in subprocesses)."""
    argv = ["--config", TINY, "--run-dir", str(run_dir)] + ["--quiet"] * quiet
    argv += [x for s in sets for x in ("--set", s)] + list(extra)
    if in_process is None:
        in_process = env is None and not kw
    if in_process:
        from train.__main__ import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        proc = subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "train", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=600,
            **kw,
        )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(run_dir):
    rows = dedupe_by_step(read_metrics(pathlib.Path(run_dir) / "metrics.jsonl"), "loss")
    return {r["step"]: r["loss"] for r in rows}


def sigterm_after(monkeypatch, at: int, before=None) -> None:
    """SIGTERM to this process once the divergence guard has checked step ``at`` (as a scheduler
    stopping the run there); ``before(guard)`` first, if given."""
    from train.metrics import DivergenceGuard

    check = DivergenceGuard.check

    def check_then_signal(self, step, *args):
        stop = check(self, step, *args)
        if step == at:
            if before is not None:
                before(self)
            os.kill(os.getpid(), signal.SIGTERM)
        return stop

    monkeypatch.setattr(DivergenceGuard, "check", check_then_signal)


@pytest.mark.slow
def test_cli_end_to_end_loss_falls_and_outputs_are_complete(tmp_path):
    # The real command line, in a process of its own.
    proc = run_cli(
        tmp_path / "run", *FAST, "train.steps=30", "train.eval_every=10", quiet=False, in_process=False
    )
    banner = proc.stdout.splitlines()
    assert banner[0].startswith("model: tiny, ") and "in the embedding and LM head" in banner[0]
    assert banner[1].startswith("optimizer: moara on galore, r_base 16") and "'down': 32" in banner[1]
    assert banner[2].startswith("data: ") and banner[3].startswith("mesh: data 1 x fsdp 1 x tensor 1 over 1 ")
    assert banner[4].startswith("tokens per step: 256; run dir: ")
    assert "step 30: eval loss" in proc.stderr and (tmp_path / "run" / "curves.png").stat().st_size > 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert len(steps) == 30 and len(evals) == 3
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "wall_s"):
        assert key in steps[0]
    assert {"step", "eval_loss", "eval_ppl"} <= set(evals[0])
    assert np.mean([r["loss"] for r in steps[-5:]]) < np.mean([r["loss"] for r in steps[:5]]) - 0.5
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in (
        "final_eval_ppl",
        "steps",
        "wall_s",
        "tokens_per_s",
        "peak_device_memory_bytes",
        "optimizer_state_bytes",
        "ranks",
    ):
        assert key in summary
    assert summary["ranks"]["per_module"]["down"] == 32 and summary["ranks"]["per_module"]["q"] == 8
    assert summary["optimizer_state_bytes"]["magnitude_moments"] > 0
    saved = load_config(tmp_path / "run" / "config.yaml")
    assert saved.train.steps == 30


@pytest.mark.slow
def test_print_config_prints_what_the_run_saves_and_starts_nothing(tmp_path):
    """``--print-config``: every key with its value, defaults included (``train.grad_clip``, which
    neither tiny.yaml nor the sets give), as the run saves them in ``config.yaml``; no run dir."""
    sets = [*FAST, "train.steps=2", "optimizer.r_base=8"]
    printed = run_cli(tmp_path / "printed", *sets, extra=["--print-config"])
    assert printed.returncode == 0 and not (tmp_path / "printed").exists(), printed.stderr
    shown = yaml.safe_load(printed.stdout)
    assert shown["train"]["grad_clip"] == 0.0 and shown["optimizer"]["r_base"] == 8
    run_cli(tmp_path / "run", *sets)
    assert shown == yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    bad = run_cli(tmp_path / "bad", "train.stepz=2", extra=["--print-config"], check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and not bad.stdout


@pytest.mark.slow
def test_resume_after_sigterm_and_sigkill_equals_uninterrupted(tmp_path):
    """Stopped by SIGTERM (saved, exit 75), resumed and killed by SIGKILL (its lock left behind,
    steps logged past its last checkpoint), resumed again: every step logged once, with the
    uninterrupted run's losses. The data come from a token store (the builtin text's)."""
    sets = [*FAST, "train.steps=24", "checkpoint.every=8", "train.micro_batch_size=4"]
    run_cli(tmp_path / "full", *sets, in_process=False)  # as the interrupted runs: processes
    cut = tmp_path / "cut"

    def start(*extra):
        args = [sys.executable, "-m", "train", "--config", TINY, "--run-dir", str(cut), "--quiet"]
        args += [x for s in sets for x in ("--set", s)] + list(extra)
        return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(proc, n):
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (cut / "metrics.jsonl").exists() and len(losses(cut)) >= n:
                return
            time.sleep(0.05)
        raise AssertionError(proc.communicate()[1][-2000:])

    proc = start()
    wait_for(proc, 7)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] < 24
    stopped = summary["steps"]  # the step SIGTERM's checkpoint was saved at
    proc = start("--resume")
    wait_for(proc, 17)
    proc.kill()
    proc.wait(timeout=60)
    logged = [r["step"] for r in read_metrics(cut / "metrics.jsonl") if "loss" in r]
    assert (cut / ".lock").exists() and 16 < max(logged) < 24
    # What a save killed part-way leaves (orbax's temporary directory, by the name it gives one of
    # step 24 again): removed at the start, not warned about when step 24 is saved.
    (cut / "checkpoints" / "24.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    resumed = run_cli(cut, *sets, extra=["--resume"], in_process=False)
    assert "orbax-checkpoint-tmp" not in resumed.stderr, resumed.stderr
    assert not list((cut / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
    # Checkpoint 16, or the one before it when the kill came while orbax was still writing 16:
    # SIGTERM's (the step the first session stopped at, which need not be 8).
    start = int(resumed.stdout.split("resuming from step ")[1].split()[0])
    assert start in (stopped, 16) and start < max(logged)  # rows past the checkpoint were logged
    rows = [r["step"] for r in read_metrics(cut / "metrics.jsonl") if "loss" in r]
    assert rows == list(range(1, 25))  # every step once, in order
    full, again = losses(tmp_path / "full"), losses(cut)
    np.testing.assert_allclose([again[s] for s in full], [full[s] for s in full], rtol=1e-6)
    # Each session's first step (its time includes the compilation) is marked and left out of
    # the summary's tokens/s.
    rows = dedupe_by_step(read_metrics(cut / "metrics.jsonl"), "tokens_per_s")
    marked = [r["step"] for r in rows if r.get("includes_compile")]
    assert marked[0] == 1 and start + 1 in marked and len(marked) <= 3, marked
    steady = [r["tokens_per_s"] for r in rows if not r.get("includes_compile")]
    assert json.loads((cut / "summary.json").read_text())["tokens_per_s"] == np.median(steady)


@pytest.mark.slow
def test_sharded_2x2x2_mesh_gives_one_device_losses(tmp_path):
    """The default (MoARa on GaLore) through the whole loop, the eight-device run with the loss
    in chunks of positions (the two-process test in tests/test_multiprocess.py shards the
    whole-sequence loss); every host's optimizer on an 8-device mesh against one device is in
    tests/test_sharding_optimizer.py."""
    sets = [*FAST, "train.steps=6", "checkpoint.every=0"]
    # Both on the host's CPU (eight CPU devices; also where a GPU is the default backend).
    run_cli(tmp_path / "one", *sets, env={"JAX_PLATFORMS": "cpu"})
    run_cli(
        tmp_path / "eight",
        *sets,
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "model.overrides.loss_chunk=8",
        env=cpu_devices(8),
    )
    summary = json.loads((tmp_path / "eight" / "summary.json").read_text())
    assert summary["devices"] == 8 and summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert json.loads((tmp_path / "eight" / "model.json").read_text())["loss_chunk"] == 8
    one, eight = losses(tmp_path / "one"), losses(tmp_path / "eight")
    np.testing.assert_allclose([eight[s] for s in one], [one[s] for s in one], rtol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("host", ["ldadam", "subtrack_pp"])
def test_profile_reads_the_bases_of_other_hosts(host, tmp_path):
    run_cli(
        tmp_path / host, *FAST, "mode=profile", "profile.steps=4", "profile.every=2", f"optimizer.host={host}"
    )
    alignment = json.loads((tmp_path / host / "alignment.json").read_text())
    assert set(alignment["s_tau"]) == {"q", "k", "v", "o", "up", "gate", "down"}
    assert all(0 < s <= 1 for s in alignment["s_tau"].values())


@pytest.mark.slow
def test_profile_writes_allocation_that_training_reads(tmp_path):
    pytest.importorskip("tensorboardX")  # S_tau's scalars are read back from its event files
    run_cli(
        tmp_path / "prof",
        *FAST,
        "mode=profile",
        "profile.steps=10",
        "profile.every=2",
        "metrics.writers=[tensorboard]",
    )
    allocation = json.loads((tmp_path / "prof" / "allocation.json").read_text())
    alignment = json.loads((tmp_path / "prof" / "alignment.json").read_text())
    summary = json.loads((tmp_path / "prof" / "summary.json").read_text())  # FAST's moara ran as galore
    assert (summary["mode"], summary["optimizer"], summary["host"]) == ("profile", "galore", "galore")
    from test_metrics_writers import read_events

    events = read_events(tmp_path / "prof")  # S_tau per module and the training scalars
    assert [s for s, _ in events["alignment/S_down"]] == alignment["steps"]
    assert [s for s, _ in events["train/loss"]] == list(range(1, 11)) and "eval/ppl" in events
    assert set(alignment["s_tau"]) == {"q", "k", "v", "o", "up", "gate", "down"}
    assert alignment["steps"] == [2, 4, 6, 8, 10]
    assert all(0 < s <= 1 for s in alignment["s_tau"].values())
    receiver = allocation["receivers"][0]
    assert alignment["s_tau"][receiver] == min(
        v for k, v in alignment["s_tau"].items() if k not in ("q", "k")
    )
    assert allocation["ranks"][receiver] == 2 * 16 and allocation["ranks"]["q"] == 8
    assert sum(allocation["ranks"].values()) == 7 * 16
    assert (tmp_path / "prof" / "alignment.png").stat().st_size > 0
    # The bases (a refresh every 5 steps): steps 2 and 4 under step 1's, 6 to 10 under step 6's;
    # read again without the first's, S_tau is the later recordings' mean.
    by_basis = alignment["s_tau_by_basis"]
    assert {k: v["recordings"] for k, v in by_basis.items()} == {"1": 2, "6": 3}
    from train import profile as profiling

    assert profiling.main([str(tmp_path / "prof"), "--from-step", "5"]) == 0
    again = json.loads((tmp_path / "prof" / "from-step-5" / "alignment.json").read_text())
    for label, values in alignment["trajectories"].items():
        assert again["s_tau"][label] == pytest.approx(np.mean(values[2:]))
        assert by_basis["6"]["s_tau"][label] == pytest.approx(np.mean(values[2:]))
    path = tmp_path / "prof" / "allocation.json"
    run_cli(tmp_path / "use", *FAST, "train.steps=2", f"optimizer.rank_allocation={path}")
    used = json.loads((tmp_path / "use" / "summary.json").read_text())["ranks"]["per_module"]
    assert used == allocation["ranks"]


def test_an_allocation_profiled_at_another_r_base_moves_that_r_base_s_rank(tmp_path):
    """The paper profiles 350M once and keeps which module types donate and receive at 1B and
    7B, whose ranks follow their own r_base: a file profiled at r_base 16 read at 32 gives q/k
    16 and its receiver 64 (its ranks, for r_base 16, were taken as they were: half the budget)."""
    from train.labels import describe
    from train.step import read_allocation

    types = ["q", "k", "v", "o", "up", "gate", "down"]
    profiled = {"r_base": 16, "donors": ["q", "k"], "receivers": ["up"], "ranks": {t: 16 for t in types}}
    profiled["ranks"].update(q=8, k=8, up=32)
    path = tmp_path / "allocation.json"
    path.write_text(json.dumps(profiled))
    assert read_allocation(str(path), 16, tuple(types)) == profiled["ranks"]
    want = {**dict.fromkeys(types, 32), "q": 16, "k": 16, "up": 64}
    assert read_allocation(str(path), 32, tuple(types)) == want
    lines = describe(load_config(TINY, [f"optimizer.rank_allocation={path}", "optimizer.r_base=32"]))
    assert next(line for line in lines.splitlines() if "up_proj" in line).split()[-3:] == ["up", "64", "-"]
    path.write_text(json.dumps({"ranks": profiled["ranks"], "r_base": 16}))
    with pytest.raises(UserError, match="profiled at r_base 16, this run's is 32; it names no donors"):
        read_allocation(str(path), 32, tuple(types))


LLAMA_TYPES, MLA_TYPES = mj.LLAMA_MODULE_TYPES, mj.MLA_MODULE_TYPES


def test_an_allocation_moves_rank_on_another_family_through_the_structural_mapping(tmp_path):
    """The paper applies the Llama 2 profile's rule to DeepSeek-V2, whose q_b and kv_b donate
    where Llama's q and k do: a Llama file on an MLA model (and an MLA file on a Llama model)
    moves the rank between those types and keeps the model's budget; a file that names a type
    the model has no counterpart of, or ranks that do not add up to the budget, are refused in one line.
    The trainer's banner and summary use these ranks."""
    from train.step import read_allocation

    path = tmp_path / "allocation.json"
    ranks = {**dict.fromkeys(LLAMA_TYPES, 16), "q": 8, "k": 8, "down": 32}
    path.write_text(json.dumps({"r_base": 16, "donors": ["q", "k"], "receivers": ["down"], "ranks": ranks}))
    on_mla = read_allocation(str(path), 16, MLA_TYPES)
    assert on_mla == {**dict.fromkeys(MLA_TYPES, 16), "q_b": 8, "kv_b": 8, "down": 32}
    assert sum(on_mla.values()) == 16 * len(MLA_TYPES)
    mla = {"r_base": 16, "donors": ["q_b", "kv_b"], "receivers": ["down"], "ranks": on_mla}
    path.write_text(json.dumps(mla))
    assert read_allocation(str(path), 16, LLAMA_TYPES) == ranks
    path.write_text(json.dumps({**mla, "receivers": ["q_a"]}))  # Llama has no counterpart of q_a
    with pytest.raises(
        UserError, match=r"allocation.json: its receivers: this model has no \['q_a'\] \(this model's module"
    ):
        read_allocation(str(path), 16, LLAMA_TYPES)
    path.write_text(json.dumps({**mla, "donors": ["q_b", "q"]}))  # both are Llama's q
    with pytest.raises(UserError, match=r"are the same module types of this model twice \(\['q', 'q'\]\)"):
        read_allocation(str(path), 16, LLAMA_TYPES)
    path.write_text(json.dumps({"r_base": 16, "ranks": on_mla}))  # no rule to move on another family
    with pytest.raises(UserError, match="its module types are .* this model's .*; it names no donors"):
        read_allocation(str(path), 16, LLAMA_TYPES)
    path.write_text(json.dumps({"r_base": 16, "ranks": {**ranks, "down": 40}}))
    with pytest.raises(
        UserError, match="ranks sum to 120, not the budget of 7 module types x r_base 16 = 112"
    ):
        read_allocation(str(path), 16, LLAMA_TYPES)

    # The trainer on DeepSeek-V2's tiny preset with the Llama file: the MLA ranks, in the summary.
    path.write_text(json.dumps({"r_base": 16, "donors": ["q", "k"], "receivers": ["down"], "ranks": ranks}))
    run_cli(
        tmp_path / "run",
        *FAST,
        "train.steps=2",
        "model.name=deepseek-v2-tiny",
        f"optimizer.rank_allocation={path}",
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ranks"]["per_module"] == on_mla


@pytest.mark.parametrize(
    "content,says",
    [
        ({"ranks": {"q": 2.9}}, "ranks must be positive integers, got {'q': 2.9}"),
        ({"ranks": {"q": True}}, "ranks must be positive integers, got {'q': True}"),
        ({"ranks": {"q": 0}}, "ranks must be positive integers, got {'q': 0}"),
        ({"ranks": {"q": 8}, "r_base": "16"}, "r_base must be a positive integer, got '16'"),
        ({"ranks": {"q": 8}, "donors": "qk"}, "donors must be a list of module types, got 'qk'"),
        ({"ranks": {"q": 8}, "receivers": [1]}, "receivers must be a list of module types, got [1]"),
        ({"ranks": {}}, 'it holds no "ranks" object of module types and ranks'),
        ([1, 2], 'it holds no "ranks" object of module types and ranks'),
    ],
)
def test_an_allocation_file_of_wrong_values_is_refused_naming_it(content, says, tmp_path):
    """Values a file could hold by mistake are refused, not coerced (2.9 was rank 2, true rank 1,
    the string "qk" the donors q and k), in one line naming the file."""
    from train.step import read_allocation

    path = tmp_path / "allocation.json"
    path.write_text(json.dumps(content))
    with pytest.raises(UserError) as e:
        read_allocation(str(path), 16, LLAMA_TYPES)
    assert str(e.value) == f"optimizer.rank_allocation: {path} is not a valid allocation file: {says}"


@pytest.mark.parametrize(
    "donors,types,want",
    [
        (["q", "k"], MLA_TYPES, ["q_b", "kv_b"]),  # the default, on MLA
        (["q"], MLA_TYPES, ["q_b"]),
        (["k", "v"], MLA_TYPES, r"profile.donors: this model has no \['v'\]$"),
        (["q", "q_b"], LLAMA_TYPES, r"profile.donors: \['q', 'q_b'\] are the same module types of this"),
        (["q_b", "kv_b"], LLAMA_TYPES, ["q", "k"]),
    ],
)
def test_profile_donors_map_onto_the_model_or_are_refused(donors, types, want):
    """``profile.donors`` the model lacks are their structural counterparts, or refused (a donor
    was dropped silently before: q and q_b on Llama profiled with q alone); receivers are the
    lowest S_tau, a tie going to the type first in the paper's order, and the outputs list the
    module types in that order."""
    from train.profile import choose_allocation

    cfg = load_config(TINY, [f"profile.donors={json.dumps(donors)}"])
    s_tau = dict.fromkeys(reversed(types), 0.5)  # all tied, listed in the reverse order
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            choose_allocation(s_tau, cfg)
        return
    allocation = choose_allocation(s_tau, cfg)
    assert allocation["donors"] == want and list(allocation["s_tau"]) == list(types)
    assert allocation["receivers"] == [next(t for t in types if t not in want)]
    assert sum(allocation["ranks"].values()) == len(types) * cfg.optimizer.r_base


def test_labels_of_a_profile_config_are_what_profiling_runs():
    """A profiling run measures uniform-rank GaLore without decomposition whatever the condition
    it inherits; labels said the condition's ranks (q 128, down 512) and state."""
    from train.labels import describe

    paper = ROOT / "configs" / "paper"
    lines = describe(load_config(paper / "llama2-350m-profile.yaml", ["data.tokenizer=bytes"])).splitlines()
    assert lines[0].endswith("(profiling: uniform ranks, no decomposition)")
    ranks = {line.split()[-3]: line.split()[-2] for line in lines[2:-1] if "proj" in line}
    assert set(ranks.values()) == {"256"} and len(ranks) == 7
    assert "magnitude_moments 0.00" in lines[-1]


@pytest.mark.parametrize("name", ["adamw", "galore", "moara"])
def test_mu_dtype_sets_the_moments_dtype_of_bf16_parameters(name):
    """``optimizer.mu_dtype``: null keeps Adam's moments in the parameters' bfloat16 (as
    galore-torch's on a bf16 model), float32 stores them in float32, plain and projected alike;
    MoARa's magnitude moments are float32 either way."""
    import jax
    import jax.numpy as jnp

    from train.config import OptimizerSection
    from train.step import make_optimizer

    params = {
        "self_attn": {"q_proj": {"kernel": jnp.zeros((32, 32), jnp.bfloat16)}},
        "norm": {"scale": jnp.ones(32, jnp.bfloat16)},
    }
    for mu_dtype, want in ((None, jnp.bfloat16), ("float32", jnp.float32)):
        opt = OptimizerSection(name, r_base=8, block_size=8, rank_allocation="uniform", mu_dtype=mu_dtype)
        state = jax.eval_shape(make_optimizer(opt, 1e-3, 0.0).init, params)
        paths = [(jax.tree_util.keystr(p), x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(state)]
        moments = {d for p, d in paths if re.search(r"\.(dir_)?(mu|nu)\[", p)}
        magnitudes = {d for p, d in paths if re.search(r"\.mag_(mu|nu)\[", p)}
        assert moments == {jnp.dtype(want)}, (name, mu_dtype, paths)
        assert magnitudes == ({jnp.dtype(jnp.float32)} if name == "moara" else set()), paths


def test_every_run_config_of_the_repository_gives_a_model_its_sequences_fit():
    """Each config file that names a model (the paper's sizes, the evidence base, tiny) loads,
    builds its model's config, and trains sequences within the model's positions with whole
    micro-batches: what the trainer checks only once the data is open."""
    from train.setup import _model_before_data

    named = 0
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        if path.name == "plan.yaml":  # the evidence runner's plan, not a run config
            continue
        cfg = load_config(path)
        if cfg.model.name is None:  # a layer (condition, host, mode): over a model file
            continue
        named += 1
        model, t = _model_before_data(cfg), cfg.train
        assert t.seq_len <= model.max_position_embeddings, path
        assert t.batch_size % (t.micro_batch_size or t.batch_size) == 0, path
    assert named >= 12


@pytest.mark.slow
def test_sweep_then_compare(tmp_path):
    """A two-point sweep over condition layers (layered over tiny.yaml), run again (nothing to
    do), then ``train.compare`` on its runs."""
    sweep_dir = tmp_path / "sweep"
    args = [sys.executable, "-m", "train.sweep", "--base", TINY, "--axis", "paper/conditions/galore,full"]
    args += ["--seeds", "0", "--out", str(sweep_dir)] + [x for s in FAST for x in ("--set", s)]
    first = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "galore-seed0: starting" in first.stdout and "| full | 1 (1 reached, 1 timed) |" in first.stdout
    saved = load_config(sweep_dir / "galore-seed0" / "config.yaml")
    assert saved.optimizer.name == "galore" and saved.model.name == "tiny"
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "galore-seed0: completed, skipped" in again.stdout
    assert "full-seed0: completed, skipped" in again.stdout
    report = json.loads((sweep_dir / "report.json").read_text())
    assert report["points"]["galore"]["steps_to_target"]["mean"] == 12
    assert report["points"]["galore"]["mean_curve"]["steps_to_target"] == 12  # one seed: its own curve
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.compare",
            str(sweep_dir / "galore-seed0"),
            str(sweep_dir / "full-seed0"),
            "--out",
            str(tmp_path / "cmp"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| galore-seed0 | completed |" in text and "| full-seed0 | completed |" in text
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    base = report["runs"][0]
    assert base["steps_to_target"] == 12 and report["target_ppl"] == base["final_ppl"]
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0


@pytest.mark.parametrize(
    "sets,message",
    [
        (["train.stepz=3"], "unknown config key train.stepz (did you mean train.steps? valid: ["),
        (["train.steps=many"], "train.steps: expected int"),
        (["optimizer.r_base=0"], "optimizer.r_base must be >= 1"),
        (["optimizer.block_size=0"], "optimizer.block_size must be >= 1"),
        (["model.name=llama9"], "unknown model 'llama9'"),
        (["data.source=files", "data.paths=['/nonexistent.jsonl']"], "data file not found"),
        (["train.batch_size=6", "mesh.data=4"], "does not match the 1 available devices"),
        (["mesh.tensor=0"], "mesh.fsdp and mesh.tensor must be >= 1, got 1 and 0"),
        (["mesh.data=0"], "mesh.data must be -1 (the devices fsdp x tensor leave) or >= 1, got 0"),
        (["optimizer.rank_allocation=/no/such.json"], "is neither uniform, default nor an allocation file"),
        (["metrics.writers=[jsonl,mlflow]"], "metrics.writers: unknown ['mlflow']"),
        (["train.eval_batches=0"], "train.eval_batches must be >= 1"),
        (["train.seq_len=300"], "train.seq_len (300) exceeds the model's max_position_embeddings (256)"),
        # said before the data is read (a store may take hours to build)
        (
            ["train.seq_len=300", "data.source=files", "data.paths=['/nonexistent.jsonl']"],
            "train.seq_len (300) exceeds the model's max_position_embeddings (256)",
        ),
        (
            ["model.overrides.rms_norm_eps=0", "data.source=files", "data.paths=['/nonexistent.jsonl']"],
            "model: rms_norm_eps must be a positive number, got 0",
        ),
        (["model.overrides={loss_chunk: -8}"], "model: loss_chunk must be a non-negative integer"),
        (["model.overrides.rope_theta=abc"], "model: rope_theta must be a positive finite number, got 'abc'"),
        (["model.overrides.rms_norm_eps=0"], "model: rms_norm_eps must be a positive number, got 0"),
        (
            ["model.overrides.tie_word_embeddings=no thanks"],
            "model: tie_word_embeddings must be true or false",
        ),
        (["model.overrides.scan_layers=maybe"], "model: scan_layers must be true or false, got 'maybe'"),
        (
            ["model.overrides.vocab_size=100"],
            "model.overrides.vocab_size must be an integer >= the tokenizer's 257 ids",
        ),
        (
            ["model.overrides.param_dtype=bfloat16"],
            "model.overrides.param_dtype: the run's dtypes are train.param_dtype and train.dtype",
        ),
        (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay must be >= 0"),
        (
            ["optimizer.weight_decay_mask=norms"],
            "optimizer.weight_decay_mask must be all or matrices, got 'norms'",
        ),
        (["train.grad_clip=-1"], "train.grad_clip must be >= 0"),
        (["data.seed=-1"], "data.seed must be null or in [0, 2**32), got -1"),
        (["optimizer.mu_dtype=float16"], "optimizer.mu_dtype must be null (the parameters' dtype), float32"),
        (
            ["optimizer.host=q_galore", "optimizer.mu_dtype=float32"],
            "optimizer.mu_dtype float32 with host q_galore: its moments are 8-bit or float32",
        ),
        (["mode=profile", "profile.steps=6", "profile.every=10"], "profile.every (10) must be <="),
        (
            ["optimizer.host=apollo"],
            "optimizer.host: unknown host 'apollo': one of galore, fira, q_galore, osd, ldadam, subtrack_pp, "
            "or package.module:Class",
        ),
        (["optimizer.name=adamw", "optimizer.host=fira"], "optimizer.host fira needs optimizer.name galore"),
        (
            ["optimizer.host=fira", "optimizer.host_options={growth_limit: 0}"],
            "optimizer.host_options: growth_limit must be positive",
        ),
        (
            ["optimizer.host=q_galore", "optimizer.host_options={basis_group_size: 7}"],
            "optimizer: q_galore_project: the basis of",
        ),
        (
            ["optimizer.host=fira", "optimizer.host_options={gamma: 2}"],
            "unknown option(s) ['gamma'] for host fira (known: ['growth_limit'])",
        ),
        (["model.overrides.rope_scaling=5"], "model: rope_scaling must be a mapping or null, got 5"),
        (
            [
                "model.overrides.rope_scaling={rope_type: llama3, factor: abc, low_freq_factor: 1, "
                "high_freq_factor: 4, original_max_position_embeddings: 128}"
            ],
            "model: rope_scaling factor must be a positive number, got 'abc'",
        ),
        (
            ["model.overrides.num_attention_heads=3"],
            "hidden_size (64) must be divisible by num_attention_heads (3)",  # (llama: head_dim or not)
        ),
        (["mesh.fsdp=3"], "mesh fsdp x tensor = 3 x 1 does not divide the 1 available devices"),
        (["mesh.fsdp=0"], "mesh.fsdp and mesh.tensor must be >= 1, got 0 and 1"),
        (["data.paths=[a.jsonl]"], "data.paths is set but data.source is builtin, which reads no files"),
        (
            ["data.source=tfds", "data.validation_paths=[a.jsonl]"],
            "data.validation_paths is set but data.source is tfds",
        ),
        (["mode=profile", "profile.donors=[q,q]"], "profile.donors: repeated module types in ['q', 'q']"),
        (
            ["mode=profile", "profile.donors=[q_a,kv_b]"],
            "profile.donors: this model has no ['q_a'] (module types of this model: ['q', 'k', 'v', 'o'",
        ),
        (
            ["mode=profile", "profile.num_receivers=6"],
            "profile.num_receivers (6) is more than the 5 module types that are not donors",
        ),
    ],
)
def test_user_errors_exit_with_one_clear_line(tmp_path, sets, message, capsys):
    # In-process through the CLI's main (the same code path as python -m train, without starting
    # a JAX process per case); test_missing_config_file_is_a_clean_error runs the real command.
    from train.__main__ import main

    argv = ["--config", TINY, "--run-dir", str(tmp_path / "bad"), "--quiet"]
    code = main(argv + [x for s in sets for x in ("--set", s)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err


PROFILE = ["mode=profile", "optimizer.name=galore"]


@pytest.mark.parametrize(
    "sets,message",
    [
        (["train.steps=0"], "train.steps must be >= 1, got 0"),
        (["train.batch_size=0"], "train.batch_size must be >= 1, got 0"),
        (["train.micro_batch_size=0"], "train.micro_batch_size must be >= 1 (or null), got 0"),
        (["train.seq_len=1"], "train.seq_len must be >= 2, got 1"),
        (["train.lr=0"], "train.lr must be > 0, got 0"),
        (["train.lr=.inf"], "train.lr must be finite, got inf"),
        (["train.warmup_ratio=1"], "train.warmup_ratio must be in [0, 1), got 1"),
        (["train.warmup_ratio=-0.1"], "train.warmup_ratio must be in [0, 1), got -0.1"),
        (["train.min_lr_ratio=1.5"], "train.min_lr_ratio must be in [0, 1], got 1.5"),
        (["train.min_lr_ratio=-0.1"], "train.min_lr_ratio must be in [0, 1], got -0.1"),
        (["train.eval_every=0"], "train.eval_every and train.log_every must be >= 1"),
        (["train.log_every=0"], "train.eval_every and train.log_every must be >= 1"),
        (["train.param_dtype=float16"], "train.param_dtype and train.dtype must be float32 or bfloat16"),
        (["train.eval_batches=0"], "train.eval_batches must be >= 1, got 0"),
        (["train.divergence_factor=1"], "train.divergence_factor must be > 1 (or 0: off), got 1"),
        (["train.zero_grad_steps=-1"], "train.zero_grad_steps must be >= 0 (0: off), got -1"),
        (["optimizer.r_base=0"], "optimizer.r_base must be >= 1, got 0"),
        (["optimizer.block_size=0"], "optimizer.block_size must be >= 1, got 0"),
        (["optimizer.update_proj_gap=0"], "optimizer.update_proj_gap must be >= 1, got 0"),
        (["optimizer.b1=1"], "optimizer.b1 and b2 must be in [0, 1), got 1.0, 0.999"),
        (["optimizer.b2=-0.1"], "optimizer.b1 and b2 must be in [0, 1), got 0.9, -0.1"),
        (["optimizer.eps=-1e-8"], "optimizer.eps must be >= 0, got -1e-08"),
        (["optimizer.scale=0"], "optimizer.scale must be > 0, got 0"),
        (["checkpoint.keep=0"], "checkpoint.keep must be >= 1 and checkpoint.every >= 0"),
        (["checkpoint.every=-1"], "checkpoint.keep must be >= 1 and checkpoint.every >= 0"),
        (["profile.steps=0"], "profile.steps and profile.every must be >= 1"),
        (["mode=profile", "optimizer.name=adamw"], "mode profile needs optimizer.name galore or moara"),
        ([*PROFILE, "profile.num_receivers=0"], "profile.num_receivers must be >= 1, got 0"),
        ([*PROFILE, "profile.ema=1"], "profile.ema must be in [0, 1), got 1"),
        ([*PROFILE, "profile.donors=[]"], "profile.donors must be module types"),
        (["data.source=files"], "data.source is files but data.paths is empty"),
        (["data.source=store"], "data.source is store but data.store is not set"),
        (["data.workers=0"], "data.workers must be >= 1 (or null), got 0"),
        (["data.validation_fraction=0"], "data.validation_fraction must be in (0, 1)"),
        (["data.validation_fraction=1"], "data.validation_fraction must be in (0, 1)"),
        (["data.max_documents=0"], "data.max_documents must be >= 1 (or null), got 0"),
    ],
)
def test_each_setting_out_of_its_range_is_refused_by_name(sets, message):
    with pytest.raises(UserError) as e:
        load_config(TINY, sets)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    "sets",
    [
        ["train.steps=1", "train.seq_len=2", "train.lr=1e-9", "train.eval_every=1", "train.log_every=1"],
        ["train.warmup_ratio=0", "train.min_lr_ratio=0", "train.divergence_factor=0"],
        ["train.zero_grad_steps=0", "train.grad_clip=0"],
        ["train.warmup_ratio=0.99", "train.min_lr_ratio=1", "train.divergence_factor=1.01"],
        ["train.batch_size=8", "train.micro_batch_size=1", "train.eval_batches=1", "train.dtype=float32"],
        ["optimizer.r_base=1", "optimizer.block_size=1", "optimizer.update_proj_gap=1"],
        ["optimizer.b1=0", "optimizer.b2=0", "optimizer.eps=0", "optimizer.scale=1e-9"],
        ["checkpoint.keep=1", "checkpoint.every=0", "data.workers=1", "data.max_documents=1"],
        ["data.validation_fraction=0.001", *PROFILE, "profile.num_receivers=1", "profile.ema=0"],
    ],
)
def test_the_edges_of_each_settings_range_are_taken(sets):
    cfg = load_config(TINY, sets)
    for s in sets:
        key, value = s.split("=")
        got = functools.reduce(getattr, key.split("."), cfg)
        assert got == type(got)(value), s


def test_one_set_takes_several_keys():
    """``--set a=1 b=2`` sets both keys, as two ``--set``s do (the second was refused as an
    unrecognized argument), in every command that loads a config (they share the option)."""
    import argparse

    from train.__main__ import parse_args
    from train.arguments import add_config_arguments

    sets = ["--set", "train.steps=5", "mesh.fsdp=2", "--set", "train.seed=1"]
    want = ["train.steps=5", "mesh.fsdp=2", "train.seed=1"]
    assert parse_args(["--config", TINY, *sets, "--resume"]).overrides == want
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, config=False)
    assert parser.parse_args(sets).overrides == want and parser.parse_args([]).overrides == []


def test_a_later_config_file_changes_the_model_overrides_it_names_and_keeps_the_others(tmp_path):
    """Config files read in order (``base:`` and several ``--config``) merge ``model.overrides``
    field by field, as ``--set`` does: a file adding ``loss_chunk`` to the 7B config keeps its
    ``remat: full`` (the later file's overrides replaced the earlier's whole)."""
    from train.config import load_config

    paper = ROOT / "configs" / "paper" / "llama2-7b.yaml"
    layer, based = tmp_path / "layer.yaml", tmp_path / "based.yaml"
    layer.write_text("model: {overrides: {loss_chunk: 128}}\n")
    based.write_text(f"base: {paper}\nmodel: {{overrides: {{loss_chunk: 128}}}}\n")
    want = load_config(paper, ["model.overrides.loss_chunk=128"]).model.overrides
    assert want["remat"] == "full" and want["loss_chunk"] == 128, want
    assert load_config([paper, layer]).model.overrides == want
    assert load_config(based).model.overrides == want
    # A field is replaced, not merged: the later file's value wins.
    layer.write_text("model: {overrides: {remat: dots}}\n")
    assert load_config([paper, layer]).model.overrides["remat"] == "dots"


def test_config_files_that_cannot_be_read_are_one_clear_line(tmp_path, capsys):
    """A config that is a directory, not UTF-8, whose ``base`` is no file name, or that holds a key
    twice (a second ``train:`` section would replace the first whole); a ``--set`` value that does;
    a data path that is a directory. An empty section (``optimizer:`` with its keys commented out)
    is its defaults."""
    from train.__main__ import main
    from train.config import load_config

    binary, listed, sections = tmp_path / "binary.yaml", tmp_path / "listed.yaml", tmp_path / "empty.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    listed.write_text("base: [a.yaml, b.yaml]\n")
    sections.write_text(f"base: {TINY}\noptimizer:\n  # r_base: 8\n")
    twice = tmp_path / "twice.yaml"
    twice.write_text(
        f"base: {TINY}\ntrain:\n  lr: 0.01\n  steps: 4\nmodel: {{name: tiny}}\ntrain:\n  steps: 5\n"
    )
    unclosed, based = tmp_path / "unclosed.yaml", tmp_path / "based.yaml"
    unclosed.write_text(f"base: {TINY}\ndata:\n  paths: [a.txt, b.txt\ntrain: {{steps: 4}}\n")
    based.write_text("base: gone.yaml\n")
    (tmp_path / "corpus").mkdir()
    cases = [
        (["--config", str(tmp_path)], f"config file {tmp_path} is a directory"),
        (["--config", str(binary)], f"config file {binary} is not UTF-8 text (byte 0)"),
        (
            ["--config", str(listed)],
            f"config file {listed}: base must be a file name, got ['a.yaml', 'b.yaml']",
        ),
        (
            ["--config", str(twice)],
            f"config file {twice} is not valid YAML (line 6): key 'train' repeated (lines 2 and 6): the "
            "second would replace the first",
        ),
        (
            ["--config", str(unclosed)],
            f"config file {unclosed} is not valid YAML (line 4): expected ',' or ']'",
        ),
        (["--config", str(based)], f"config file not found: {tmp_path / 'gone.yaml'} (the base of {based})"),
        (
            ["--config", TINY, "--set", "model.overrides={remat: none, remat: full}"],
            "--set model.overrides: value '{remat: none, remat: full}' is not valid YAML (key 'remat' "
            "repeated (lines 1 and 1): the second would replace the first)",
        ),
        (
            ["--config", TINY, "--set", "data.source=files", "--set", f"data.paths=[{tmp_path / 'corpus'}]"],
            f"data file {tmp_path / 'corpus'} is a directory",
        ),
    ]
    for argv, message in cases:
        code = main([*argv, "--run-dir", str(tmp_path / "run"), "--quiet"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], (argv, lines)
    assert load_config(sections).optimizer == load_config(TINY).optimizer


@pytest.mark.parametrize("kind", ["a file", "under a file", "a link to nothing"])
def test_a_run_dir_that_cannot_be_one_is_a_clear_error(kind, tmp_path, capsys):
    """A dangling link was said to be 'File exists' (mkdir's refusal)."""
    from train.__main__ import main

    (tmp_path / "f").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    run_dir = {"a file": tmp_path / "f", "under a file": tmp_path / "f" / "run"}.get(kind, tmp_path / "link")
    code = main(["--config", TINY, "--run-dir", str(run_dir), "--quiet"])
    lines = capsys.readouterr().err.strip().splitlines()
    message = {"a file": "is a file, not a directory", "under a file": "as a run dir: Not a directory"}.get(
        kind, "is a link to nothing, not a directory"
    )
    assert code == 2 and len(lines) == 1 and message in lines[0] and str(run_dir) in lines[0], lines


@pytest.mark.slow
def test_micro_batches_off_the_data_split_name_the_numbers(tmp_path):
    proc = run_cli(
        tmp_path / "bad",
        *FAST,
        "train.batch_size=6",
        "train.micro_batch_size=3",
        "mesh.data=2",
        check=False,
        env=cpu_devices(2),
    )
    assert proc.returncode == 2, proc.stderr
    assert "train.micro_batch_size (3) must be divisible by the mesh's data x fsdp = 2 x 1 = 2" in proc.stderr
    # No micro-batch size set: the batch size is the one named.
    proc = run_cli(
        tmp_path / "bad", *FAST, "train.batch_size=6", "mesh.data=4", check=False, env=cpu_devices(4)
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "error: train.batch_size (6) must be divisible by the mesh's data x fsdp = 4 x 1 = 4" in proc.stderr
    )


@pytest.mark.slow
def test_missing_config_file_is_a_clean_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--config", str(tmp_path / "nope.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "config file not found" in proc.stderr


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    proc = run_cli(
        tmp_path / "nan",
        *FAST,
        "train.lr=1.0e+30",
        "train.warmup_ratio=0.0",
        "checkpoint.every=1",
        check=False,
    )
    assert proc.returncode == 1 and "loss is" in proc.stdout
    ckpts = sorted(int(p.name) for p in (tmp_path / "nan" / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts, "the last good checkpoint is kept"
    assert f"the last checkpoint before it, step {ckpts[-1]}, is kept in" in proc.stdout


@pytest.mark.slow
def test_bad_records_are_skipped_and_counted(tmp_path):
    p = tmp_path / "shard.jsonl.gz"
    with gzip.open(p, "wb") as f:
        f.write(b'{"text": "good one"}\n{broken json\n{"text": ""}\n{"other": 1}\n')
        f.write(b'{"text": "\xff\xfe bad bytes"}\n\n{"text": "good two"}\n')
    txt = tmp_path / "doc.txt"
    txt.write_text("a plain text document")
    counts = Counts()
    docs = list(file_documents([str(p), str(txt)], counts))
    assert docs == ["good one", "good two", "a plain text document"]
    assert counts.skipped == {"broken_json": 1, "empty_text": 1, "missing_text": 1, "non_utf8": 1}
    csv = tmp_path / "x.csv"
    csv.write_text("a,b")
    with pytest.raises(UserError, match="unsupported data file type"):
        list(file_documents([str(csv)], Counts()))


@pytest.mark.parametrize(
    # every run config (base files are layered under others; an experiment's plan is the evidence
    # runner's, checked in tests/test_evidence.py)
    "path",
    sorted(str(p) for p in (ROOT / "configs").rglob("*.yaml") if p.name not in ("base.yaml", "plan.yaml")),
)
def test_every_shipped_config_validates_and_names_a_model(path):
    import models
    from train.model import DEFAULT_MODEL

    cfg = load_config(path)
    # A layer that names no model (a condition or host file) trains the default one.
    assert (cfg.model.name or DEFAULT_MODEL) in models.list_configs()


@pytest.mark.parametrize(
    "condition,mib", [("galore", 538.57), ("decomp", 610.75), ("rank", 578.69), ("full", 650.88)]
)
def test_paper_configs_reproduce_paper_optimizer_state(condition, mib):
    """configs/paper/llama2-350m.yaml + conditions/X.yaml -> the optimizer the trainer builds ->
    the paper's optimizer-state MiB for that condition."""
    import jax

    import moara_jax as mj
    import models
    from train.model import model_config
    from train.step import make_optimizer

    paper = ROOT / "configs" / "paper"
    cfg = load_config([paper / "llama2-350m.yaml", paper / "conditions" / f"{condition}.yaml"])
    model_cfg = model_config(cfg, 32000)
    tx = make_optimizer(cfg.optimizer, 0.01, cfg.train.grad_clip)
    state = jax.eval_shape(tx.init, models.abstract_params(model_cfg))
    assert round(mj.state_bytes(state)["moments"] / 2**20, 2) == mib


@pytest.mark.slow
@pytest.mark.parametrize("condition,mib", [("galore", 538.57), ("full", 650.88)])
@pytest.mark.parametrize("host", ["fira", "q_galore", "osd", "ldadam", "subtrack_pp"])
def test_paper_host_configs_build_the_host(host, condition, mib):
    """configs/paper/hosts/X.yaml layered over a model and a condition: the trainer builds that
    host. Fira keeps GaLore's moments (the paper's MiB); Q-GaLore's 8-bit moments take about half
    of GaLore's bf16 ones (a quarter of the float32 magnitude moments)."""
    import jax

    import moara_jax as mj
    import models
    from train.model import model_config
    from train.step import make_optimizer

    paper = ROOT / "configs" / "paper"
    files = [
        paper / "llama2-350m.yaml",
        paper / "conditions" / f"{condition}.yaml",
        paper / "hosts" / f"{host}.yaml",
    ]
    cfg = load_config(files)
    assert cfg.optimizer.host == host
    tx = make_optimizer(cfg.optimizer, 0.01, cfg.train.grad_clip)
    state = jax.eval_shape(tx.init, models.abstract_params(model_config(cfg, 32000)))
    marker = {
        "fira": mj.FiraState,
        "q_galore": mj.QGaLoreProjectState,
        "osd": mj.OSDProjectState,
        "ldadam": mj.LDAdamState,
        "subtrack_pp": mj.SubTrackProjectState,
    }[host]
    assert any(isinstance(x, marker) for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, marker)))
    moments = mj.state_bytes(state)["moments"] / 2**20
    if host != "q_galore":  # the extra state of OSD, LDAdam and SubTrack++ is not moments
        assert round(moments, 2) == mib
    else:
        assert 0.4 * mib < moments < 0.55 * mib, moments
    if host == "ldadam":  # one bf16 error buffer per target matrix (the block direction's)
        layer = 4 * 1024 * 1024 + 3 * 1024 * 2736
        assert mj.state_bytes(state)["error_feedback"] == 24 * layer * 2
    if host == "q_galore" and condition == "galore":
        # By hand: two 8-bit moments of n entries take 2 (n + 4 ceil(n / 256)) bytes. Per layer,
        # q k v o project 256 x 1024 values, up/gate 2736 x 256, down 256 x 2736; embedding and
        # lm_head 32000 x 1024; each 1024-entry norm (two a layer, one final) float32 moments.
        def eight_bit(n):
            return 2 * (n + 4 * -(-n // 256))

        layer = 4 * eight_bit(256 * 1024) + 3 * eight_bit(2736 * 256)
        expected = 24 * layer + 2 * eight_bit(32000 * 1024) + (2 * 24 + 1) * 2 * 4 * 1024
        assert mj.state_bytes(state)["moments"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("host", ["fira", "q_galore", "osd", "ldadam", "subtrack_pp"])
def test_cli_trains_on_another_host(host, tmp_path):
    # Its state checkpointed once, at the end (each host's state through an orbax round trip:
    # tests/test_transforms.py).
    sets = [*FAST, "train.steps=30", "train.eval_every=10", "checkpoint.every=0"]
    run_cli(tmp_path / host, *sets, f"optimizer.host={host}")
    steps = [r["loss"] for r in read_metrics(tmp_path / host / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 30 and np.mean(steps[-5:]) < np.mean(steps[:5]) - 0.5
    summary = json.loads((tmp_path / host / "summary.json").read_text())
    assert summary["host"] == host and summary["optimizer"] == "moara"
    assert np.isfinite(summary["final_eval_ppl"])


def test_labels_command_prints_the_optimizer_view():
    from train.labels import describe

    paper = ROOT / "configs" / "paper" / "llama2-350m.yaml"
    text = describe(load_config(paper, ["data.tokenizer=/no/such/spiece.model"]))
    lines = text.splitlines()
    down = next(line for line in lines if "down_proj" in line)
    q = next(line for line in lines if "q_proj" in line)
    embed = next(line for line in lines if "embed_tokens" in line)
    assert down.split()[-3:] == ["down", "512", "-"] and q.split()[-3:] == ["q", "128", "-"]  # no decay
    assert embed.split()[-3:] == ["adamw", "-", "-"] and "(32000, 1024)" in embed  # no tokenizer file
    # Weight decay on the matrices only: each parameter says whether it decays (the paper config's
    # layers are scanned: their norms are (layers, hidden) arrays and do not).
    on = ["data.tokenizer=/no/such/spiece.model", "optimizer.weight_decay=0.1"]
    decays = describe(load_config(paper, [*on, "optimizer.weight_decay_mask=matrices"])).splitlines()
    decays = {line.split()[0]: line.split()[-1] for line in decays[2:-1]}
    assert {decays[k] for k in decays if "norm" in k} == {"no"}
    assert {decays[k] for k in decays if "norm" not in k} == {"yes"} and len(decays) > 8
    from train.setup import describe_optimizer  # the run's banner says it too

    assert describe_optimizer(load_config(paper, on)).endswith(", weight decay 0.1 on all")
    assert describe_optimizer(load_config(TINY, ["optimizer.name=adamw"])) == "adamw"
    profiling = describe_optimizer(load_config(TINY, ["mode=profile"]))  # not the run's moara
    assert profiling.startswith("galore profiling (uniform ranks, no decomposition), r_base 16, T ")
    assert "block" not in profiling and "moara" not in profiling
    # The tokenizer's vocabulary where it can be read (bytes: 257), padded by an override.
    embed = next(line for line in describe(load_config(TINY)).splitlines() if "embed_tokens" in line)
    assert "(257, 64)" in embed
    padded = describe(load_config(TINY, ["model.overrides.vocab_size=320"]))
    assert "(320, 64)" in next(line for line in padded.splitlines() if "embed_tokens" in line)
    assert "moments 650.88" in lines[-1]


def test_a_new_state_is_the_seeded_init_and_its_parameters_compile_apart_from_the_optimizer(monkeypatch):
    """A new run's parameters come from a program of the model alone, the same under GaLore and
    MoARa (so runs of one model under other optimizers find its compile in the compilation
    cache), and the state is exactly ``Setup.init`` of the run's seed."""
    import chex
    import jax

    from train import setup as setting

    sets = ["train.seed=3", "data.tokenizer=bytes"]
    galore, moara = (
        setting.make_setup(load_config(TINY, [*sets, f"optimizer.name={name}"]), True, setting.Clock())
        for name in ("galore", "moara")
    )
    key = jax.random.PRNGKey(3)
    assert galore.param_init().lower(key).as_text() == moara.param_init().lower(key).as_text()
    assert jax.jit(galore.init).lower(key).as_text() != jax.jit(moara.init).lower(key).as_text()
    made = []  # the programs restore_or_init makes the parameters with
    param_init = setting.Setup.param_init
    monkeypatch.setattr(setting.Setup, "param_init", lambda self: made.append(param_init(self)) or made[-1])
    start = setting.restore_or_init(moara, None, resume=False)
    assert len(made) == 1 and start.step == 0 and start.resumed_from is None
    chex.assert_trees_all_equal(start.state, jax.jit(moara.init)(key))


def test_model_override_numbers_written_as_yaml_reads_them():
    """PyYAML reads ``1e-5`` as a string; a float field of the model takes it as the number, as
    the typed config sections do."""
    from train.model import model_config

    cfg = model_config(
        load_config(TINY, ["model.overrides.rms_norm_eps=1e-5", "model.overrides.rope_theta=5e5"]), 64
    )
    assert (cfg.rms_norm_eps, cfg.rope_theta) == (1e-5, 5e5)
    assert model_config(load_config(TINY, ["model.overrides.initializer_range=0"]), 64).initializer_range == 0


@pytest.mark.parametrize("ratio,steps,warmup", [(0.29, 100, 29), (0.1, 12, 1), (0.07, 100, 7)])
def test_warmup_is_the_nearest_whole_number_of_steps(ratio, steps, warmup):
    from train.step import schedule

    cfg = load_config(TINY, [f"train.warmup_ratio={ratio}", f"train.steps={steps}", "train.lr=0.5"])
    lr = schedule(cfg)
    assert float(lr(warmup - 1)) < 0.5 and float(lr(warmup)) == pytest.approx(0.5)


def test_schedule_is_linear_warmup_then_one_cosine_to_the_last_step():
    """The paper's schedule (Appendix D): linear from 0 to lr over the warmup, then half a cosine
    period from lr to min_lr_ratio x lr ending at the run's last step, not warmup steps before."""
    from train.step import schedule

    steps, warmup, peak, end = 100, 10, 0.5, 0.05
    sets = ["train.warmup_ratio=0.1", f"train.steps={steps}", f"train.lr={peak}", "train.min_lr_ratio=0.1"]
    lr = schedule(load_config(TINY, sets))
    for t in (0, 5, 10, 32, 55, 77, 99, 100):
        cosine = end + (peak - end) * 0.5 * (1 + np.cos(np.pi * (t - warmup) / (steps - warmup)))
        want = peak * t / warmup if t < warmup else cosine
        assert float(lr(t)) == pytest.approx(want, rel=1e-5, abs=1e-7), t


def test_model_overrides_pad_the_vocabulary_and_rename_the_preset():
    """A vocabulary larger than the tokenizer's pads the embedding (e.g. to a multiple a tensor
    axis divides); ``name`` renames the preset."""
    from train.model import model_config

    sets = ["model.overrides.vocab_size=320", "model.overrides.name=mine"]
    cfg = model_config(load_config(TINY, sets), 259)
    assert (cfg.vocab_size, cfg.name, cfg.hidden_size) == (320, "mine", 64)
    assert model_config(load_config(TINY), 259).vocab_size == 259


@pytest.mark.parametrize(
    "key,value",
    [
        ("train.grad_clip", 1.0),
        ("train.param_dtype", "bfloat16"),
        ("train.seed", 3),
        ("optimizer.r_base", 4),
        ("train.eval_batches", 99),
    ],
)
def test_a_resume_refuses_settings_the_state_or_data_order_depend_on(key, value):
    """A gradient clip adds a stage (and its state) to the optimizer; the parameters' dtype is
    the checkpoint's; the windows every evaluation reads make the run's curve one curve: a resume
    that changes them is refused by name, before any restore."""
    from train.config import check_resumable, to_dict

    saved = to_dict(load_config(TINY))
    with pytest.raises(UserError, match=rf"differs in settings a resume cannot change \({key}: "):
        check_resumable(saved, to_dict(load_config(TINY, [f"{key}={value}"])))
    # How long it runs and how the model computes may change.
    free = ["train.steps=99", "train.lr=0.002", "model.overrides.remat=full", "train.dtype=bfloat16"]
    check_resumable(saved, to_dict(load_config(TINY, free)))
    # A key added since a run was saved has the default that does what the run did.
    del saved["optimizer"]["weight_decay_mask"]
    check_resumable(saved, to_dict(load_config(TINY)))


def test_a_resume_takes_its_data_and_init_from_at_new_paths_and_a_sweep_reuse_does_not():
    """Where the data, tokenizer, store and ``init_from`` are may change on a resume (the store's
    hash checks the tokens; the model is model.json's), not between a sweep's grid and a finished
    run it would reuse (nothing is restored there to check); starting from a directory or not is
    no such change."""
    import copy

    from train.config import changed_settings, check_resumable, to_dict

    saved = to_dict(load_config(TINY))
    moved = copy.deepcopy(saved)
    moved["data"] |= {"paths": ["/moved/a.jsonl"], "tokenizer": "/moved/sp.model", "store": "/moved/s"}
    check_resumable(saved, moved)
    assert [c.key for c in changed_settings(saved, moved)] == [
        "data.paths",
        "data.store",
        "data.tokenizer",
    ]
    started = copy.deepcopy(saved)
    started["model"] |= {"name": None, "init_from": "/models/a"}
    elsewhere = copy.deepcopy(started)
    elsewhere["model"]["init_from"] = "/moved/a"
    check_resumable(started, elsewhere)
    (change,) = changed_settings(started, elsewhere)
    assert change == ("model.init_from", "/models/a", "/moved/a")
    assert str(change) == "model.init_from: '/models/a' -> '/moved/a'"
    with pytest.raises(UserError, match=r"differs in model.init_from \('/models/a' -> None\): keep it"):
        check_resumable(started, saved)


def test_a_resume_on_another_host_names_the_host_and_the_options_stated_not_its_defaults():
    from train.config import check_resumable, to_dict

    saved = to_dict(load_config(TINY))
    with pytest.raises(UserError) as e:
        check_resumable(saved, to_dict(load_config(TINY, ["optimizer.host=q_galore"])))
    assert str(e.value).endswith("cannot change (optimizer.host: 'galore' -> 'q_galore')")
    stated = ["optimizer.host=q_galore", "optimizer.host_options.gamma=3.0"]
    with pytest.raises(UserError) as e:
        check_resumable(saved, to_dict(load_config(TINY, stated)))
    assert str(e.value).endswith("'galore' -> 'q_galore', optimizer.host_options.gamma: None -> 3.0)")


def test_a_resume_takes_stated_defaults_as_no_change_and_keeps_how_a_profile_records():
    """A host option or model override stated at the value it had by default changes nothing;
    a profiling run keeps how often and how smoothly it records (not how long it runs)."""
    from train.config import check_resumable, to_dict

    fira = to_dict(load_config(TINY, ["optimizer.host=fira"]))
    check_resumable(
        fira, to_dict(load_config(TINY, ["optimizer.host=fira", "optimizer.host_options.growth_limit=1.01"]))
    )
    check_resumable(
        fira, to_dict(load_config(TINY, ["optimizer.host=fira", "model.overrides.scan_layers=false"]))
    )
    with pytest.raises(UserError, match=r"optimizer.host_options.growth_limit: 1.01 -> 1.5"):
        check_resumable(
            fira,
            to_dict(load_config(TINY, ["optimizer.host=fira", "optimizer.host_options.growth_limit=1.5"])),
        )
    profile = ["mode=profile", "profile.steps=8", "profile.every=2"]
    saved = to_dict(load_config(TINY, profile))
    check_resumable(saved, to_dict(load_config(TINY, [*profile, "profile.steps=12"])))
    for key, value in (("profile.every", 4), ("profile.ema", 0.5)):
        with pytest.raises(UserError, match=rf"\({key}: "):
            check_resumable(saved, to_dict(load_config(TINY, [*profile, f"{key}={value}"])))
    train = to_dict(load_config(TINY))
    check_resumable(train, to_dict(load_config(TINY, ["profile.every=4"])))  # not profiling


def test_a_step_in_micro_batches_is_the_step_on_the_whole_batch():
    """Gradient accumulation averages the micro-batches' gradients (each loss a mean over its
    tokens): loss, gradient norm (what train.grad_clip and the logs read) and the gradient the
    optimizer gets are the whole batch's, to float32 rounding. A sum would scale the norm by the
    micro-batch count, which Adam's scale invariance hides from the loss."""
    import jax
    import jax.numpy as jnp
    import optax

    import models
    from train.step import TrainState, make_train_step

    cfg = models.get_config("tiny")
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    # SGD at lr 1: the step is minus the gradient itself. (Adam's first step, g / (|g| + eps),
    # magnifies the rounding of a gradient near zero into a difference of up to lr.)
    tx = optax.sgd(1.0)
    state = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))
    batch = jax.random.randint(jax.random.PRNGKey(1), (8, 17), 0, cfg.vocab_size)
    whole, in_four = (jax.jit(make_train_step(cfg, tx, k))(state, batch) for k in (1, 4))
    (want_state, want), (got_state, got) = jax.device_get((whole, in_four))
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    before = jax.device_get(params)
    got_grads, want_grads = (jax.tree.map(np.subtract, before, s.params) for s in (got_state, want_state))
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
    assert scale > 0
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale), got_grads, want_grads
    )


def test_a_profile_step_measures_the_alignment_only_at_the_steps_it_records():
    """``make_train_step(alignment_every=3)``, given the states the step that measures every step
    goes through: at steps 3 and 6 that step's alignments, zeros at the others (the measurement
    is under a ``lax.cond``), and the same step."""
    import jax
    import jax.numpy as jnp

    import models
    from train.step import TrainState, make_optimizer, make_train_step

    cfg = models.get_config("tiny")
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    opt = load_config(TINY, ["mode=profile", "optimizer.update_proj_gap=4"]).optimizer
    tx = make_optimizer(opt, 0.01, 0.0, profiling=True)
    each, some = (
        jax.jit(make_train_step(cfg, tx, 1, with_alignment=True, alignment_every=n)) for n in (1, 3)
    )
    state = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))
    for n in range(1, 7):
        batch = jax.random.randint(jax.random.PRNGKey(n), (2, 17), 0, cfg.vocab_size)
        (state, want), (other, got) = each(state, batch), some(state, batch)
        want, got = jax.device_get((want, got))
        # (two programs, which XLA may fuse apart: a float32 rounding here and there)
        assert (
            got["loss"] == pytest.approx(want["loss"], rel=1e-6)
            and got["alignment"].keys() == want["alignment"].keys()
        )
        np.testing.assert_allclose(
            other.params["lm_head"]["kernel"], state.params["lm_head"]["kernel"], rtol=1e-5
        )
        for key, value in want["alignment"].items():
            if n % 3:
                np.testing.assert_array_equal(got["alignment"][key], np.zeros_like(value))
            else:
                assert np.all(np.asarray(value) > 0)
                np.testing.assert_allclose(got["alignment"][key], value, rtol=1e-5, err_msg=f"{n} {key}")


@pytest.mark.parametrize("name,scan_layers", [("moara", False), ("moara", True), ("adamw", True)])
@pytest.mark.slow
def test_weight_decay_mask_matrices_leaves_norms_undecayed_from_a_train_steps_gradients(name, scan_layers):
    """``optimizer.weight_decay_mask: matrices``: the trainer's optimizer decays the matrices as
    ``all`` does and steps the norms (stacked ones of scanned layers too) as with no weight decay,
    each from the gradients of one train step (one program computes them: in three programs XLA
    may fuse the loss's backward apart, and a float32 rounding of a gradient turns the SVD's
    basis where singular values lie close)."""
    import jax
    import optax

    import models
    from train.step import loss_fn, make_optimizer

    cfg = models.get_config("tiny", scan_layers=scan_layers)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    batch = jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, cfg.vocab_size)
    grads = jax.jit(jax.grad(lambda p: loss_fn(cfg, p, batch)))(params)

    def step(*sets):
        opt = load_config(TINY, [f"optimizer.name={name}", "optimizer.weight_decay=0.5", *sets]).optimizer
        tx = make_optimizer(opt, 0.1, 0.0)
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        return jax.tree_util.tree_flatten_with_path(optax.apply_updates(params, updates))[0]

    masked, decayed, plain = (
        step("optimizer.weight_decay_mask=matrices"),
        step(),
        step("optimizer.weight_decay=0"),
    )
    norms = 0
    for (path, got), (_, want), (_, undecayed) in zip(masked, decayed, plain, strict=True):
        norm = jax.tree_util.keystr(path).endswith("['scale']")
        norms += norm
        assert not np.allclose(want, undecayed), path  # the decay shows
        np.testing.assert_allclose(got, undecayed if norm else want, rtol=1e-6, atol=1e-7, err_msg=str(path))
    assert norms == (3 if scan_layers else 5)


@pytest.mark.slow
def test_run_dir_with_checkpoints_needs_resume_and_an_unchanged_config(tmp_path):
    sets = [*FAST, "train.steps=4", "checkpoint.every=2"]
    first = run_cli(tmp_path / "run", *sets, extra=["--resume"])  # (quiet: what it starts from is said)
    assert f"no checkpoint in {tmp_path / 'run' / 'checkpoints'}; starting from scratch" in first.stdout
    saved = (tmp_path / "run" / "config.yaml").read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    fresh = run_cli(tmp_path / "run", *sets, check=False)
    assert fresh.returncode == 2 and "already holds checkpoints" in fresh.stderr
    changed = run_cli(tmp_path / "run", *sets, "optimizer.r_base=4", extra=["--resume"], check=False)
    assert changed.returncode == 2 and "optimizer.r_base: 16 -> 4" in changed.stderr, changed.stderr
    assert (tmp_path / "run" / "config.yaml").read_text() == saved  # the record is kept
    again = run_cli(tmp_path / "run", *sets, extra=["--resume"])
    assert "already complete" in again.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    # How the model computes may change on a resume: remat, attention, the loss in chunks.
    sets = [*sets[:-2], "train.steps=6", "checkpoint.every=2"]
    longer = run_cli(
        tmp_path / "run",
        *sets,
        "model.overrides.loss_chunk=8",
        "model.overrides.remat=full",
        extra=["--resume"],
    )
    assert longer.returncode == 0 and losses(tmp_path / "run").keys() >= {5, 6}
    assert "held a completed run: going on from step 4; its summary is summary.completed-4.json" in (
        longer.stdout
    )
    assert json.loads((tmp_path / "run" / "summary.completed-4.json").read_text()) == summary
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 6
    built = json.loads((tmp_path / "run" / "model.json").read_text())
    assert (built["loss_chunk"], built["remat"]) == (8, "full")
    # A completed run whose checkpoints were removed (a result kept without them) is not
    # started over in place: its metrics and summary stay.
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    kept = {name: (tmp_path / "run" / name).read_bytes() for name in ("metrics.jsonl", "summary.json")}
    for extra in ([], ["--resume"]):
        over = run_cli(tmp_path / "run", *sets, extra=extra, check=False)
        assert over.returncode == 2, over.stderr
        assert "holds a completed run (summary.json) and no checkpoint" in over.stderr
    assert {name: (tmp_path / "run" / name).read_bytes() for name in kept} == kept
    # Nor is a run the divergence guard stopped whose checkpoints were all set aside (a new run
    # replaced its metrics, where the same steps would diverge again).
    failed = json.loads(kept["summary.json"]) | {"status": "diverged"}
    (tmp_path / "run" / "summary.json").write_text(json.dumps(failed))
    kept["summary.json"] = (tmp_path / "run" / "summary.json").read_bytes()
    for extra in ([], ["--resume"]):
        over = run_cli(tmp_path / "run", *sets, extra=extra, check=False)
        assert over.returncode == 2, over.stderr
        assert "holds a run that stopped with status diverged (summary.json) and no checkpoint" in over.stderr
    assert {name: (tmp_path / "run" / name).read_bytes() for name in kept} == kept


def test_data_seed_fixes_the_data_order_over_train_seeds(tmp_path, monkeypatch):
    """``data.seed`` orders the train windows in place of ``train.seed``, which then sets the
    initialization alone: two runs of one data.seed and two train.seeds read the same batches from
    other starting parameters; without it the train.seed orders the windows too."""
    import train.loop

    drawn = {}
    original = train.loop.Batches.next

    def recording(self):
        batch = original(self)
        drawn.setdefault(run, np.asarray(batch))
        return batch

    monkeypatch.setattr(train.loop.Batches, "next", recording)
    sets = [*FAST, "train.steps=1", "train.eval_every=1", "checkpoint.every=0"]
    first = {}
    for run, seeds in {
        "a": ["train.seed=0", "data.seed=7"],
        "b": ["train.seed=1", "data.seed=7"],
        "c": ["train.seed=1"],
        "d": ["train.seed=7"],
    }.items():
        run_cli(tmp_path / run, *sets, *seeds)
        first[run] = losses(tmp_path / run)[1]
    np.testing.assert_array_equal(drawn["a"], drawn["b"])
    assert not np.array_equal(drawn["b"], drawn["c"]) and first["a"] != first["b"]
    np.testing.assert_array_equal(drawn["a"], drawn["d"])  # data.seed 7 is train.seed 7's order


@pytest.mark.slow
def test_a_resume_goes_on_with_the_model_it_began_with_where_its_preset_is_now_other(tmp_path, monkeypatch):
    """A preset this version defines otherwise than when a run began (a fix of its RoPE, say):
    the resume goes on with the model the run built (its ``model.json``), says which fields
    differ, and logs the uninterrupted run's losses; how the model computes (remat) still comes
    from the config."""
    import models

    sets = [*FAST, "train.steps=8", "train.eval_every=4"]
    run_cli(tmp_path / "full", *sets)
    sigterm_after(monkeypatch, 4)
    assert run_cli(tmp_path / "cut", *sets, check=False).returncode == EXIT_PREEMPTED
    monkeypatch.undo()
    tiny = models.PRESETS["tiny"]
    other = dataclasses.replace(tiny, rope_theta=tiny.rope_theta / 100)
    monkeypatch.setitem(models.PRESETS, "tiny", other)
    resumed = run_cli(tmp_path / "cut", *sets, "model.overrides.remat=full", extra=["--resume"])
    assert (
        f"note: the preset tiny is defined otherwise now (model.rope_theta: {tiny.rope_theta!r} -> "
        f"{other.rope_theta!r}); the run goes on with the model it began with "
        f"({tmp_path / 'cut' / 'model.json'})"
    ) in resumed.stdout, resumed.stdout
    built = json.loads((tmp_path / "cut" / "model.json").read_text())
    assert (built["rope_theta"], built["remat"]) == (tiny.rope_theta, "full")
    full, cut = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert cut.keys() == full.keys() == set(range(1, 9))
    np.testing.assert_allclose([cut[s] for s in full], [full[s] for s in full], rtol=1e-6)


@pytest.mark.parametrize("during", ["the last evaluation", "the summary"])
@pytest.mark.slow
def test_a_signal_after_the_last_step_waits_for_the_summary(tmp_path, monkeypatch, during):
    """SIGTERM while a run that finished its steps evaluates or writes its summary (a
    scheduler's deadline a moment late): the run is recorded as completed and exits 0, not
    stopped as interrupted nor killed half-written."""
    import train.loop

    owner, name = (
        (train.loop.StepLoop, "evaluate") if during == "the last evaluation" else (train.loop, "make_summary")
    )
    original = getattr(owner, name)

    def signalled(*args, **kwargs):
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None), "SIGTERM would kill"
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)
    proc = run_cli(tmp_path / "run", *FAST, "train.steps=3", check=False)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3


@pytest.mark.parametrize("zero_gradient", [False, True])
@pytest.mark.slow
def test_an_interrupted_run_says_which_checkpoint_a_resume_continues_from(
    tmp_path, monkeypatch, zero_gradient
):
    """SIGTERM at step 6 (checkpoints every 4): the steps done are saved, exit 75. While the
    gradient norm is exactly 0 no checkpoint is made, and the line names step 4 instead."""

    def as_after_a_zero_gradient(guard):  # as after a step whose gradient norm was exactly 0
        guard.zero_since = 6

    sigterm_after(monkeypatch, 6, as_after_a_zero_gradient if zero_gradient else None)
    proc = run_cli(tmp_path / "run", *FAST, check=False)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == 6
    last = proc.stderr.strip().splitlines()[-1]
    if zero_gradient:
        assert summary["last_checkpoint"] == 4
        assert last == (
            "interrupted after step 6, not saved: the gradient norm was exactly 0 there; "
            "--resume continues from the checkpoint of step 4"
        )
    else:
        assert summary["last_checkpoint"] == 6
        assert last == "interrupted: the checkpoint of step 6 was saved; continue with --resume"
    monkeypatch.undo()
    resumed = run_cli(tmp_path / "run", *FAST, extra=["--resume"])
    assert f"resuming from step {summary['last_checkpoint']}" in resumed.stdout


@pytest.mark.slow
def test_a_resume_to_the_checkpoints_step_ends_there_and_to_fewer_steps_is_refused(tmp_path, monkeypatch):
    """Stopped at step 4 (its checkpoint; no evaluation there), resumed with train.steps 3: refused in
    one line, nothing changed; with train.steps 4: the run ends at its checkpoint with the
    evaluation a 4-step run makes, and damaged lines in metrics.jsonl and a summary.json that
    is not UTF-8 do not stop it."""

    sigterm_after(monkeypatch, 4)
    run = tmp_path / "run"
    assert run_cli(run, *FAST, check=False).returncode == EXIT_PREEMPTED
    monkeypatch.undo()
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "loss": \xff\xfe}\n5\n["a row?"]\n')  # not UTF-8; not rows of a step
    (run / "summary.json").write_bytes(b"\xff\xfe{}")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    fewer = run_cli(run, *FAST, "train.steps=3", extra=["--resume"], check=False)
    assert fewer.returncode == 2, fewer.stderr
    assert fewer.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {run / 'checkpoints' / '4'}, the newest usable, is past this run's last "
        "step (3): resume with train.steps of at least 4, or choose another run dir"
    )
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert "resuming" not in fewer.stdout
    ended = run_cli(run, *FAST, "train.steps=4", extra=["--resume"])
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval_loss" in r] == [4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert summary["final_eval_ppl"] == pytest.approx(rows[-1]["eval_ppl"])
    assert "resuming from step 4" in ended.stdout


@pytest.mark.slow
def test_a_checkpoint_without_its_data_order_is_refused_and_a_lost_metrics_file_is_said(tmp_path):
    """metrics.jsonl gone: the resume says so and goes on. A checkpoint whose data item lacks
    the iterator (another version's, or damaged, here without checksums): refused in one line
    and kept, never resumed with the data from their start."""
    run = tmp_path / "run"
    sets = [*FAST, "train.steps=4", "checkpoint.every=2"]
    run_cli(run, *sets)
    (run / "metrics.jsonl").unlink()
    longer = run_cli(run, *[*sets, "train.steps=6"], extra=["--resume"])
    assert f"warning: {run / 'metrics.jsonl'} is missing: the record of steps 1-4 is lost" in longer.stderr
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [5, 6]
    item = run / "checkpoints" / "6" / "data" / "metadata"
    data = json.loads(item.read_text())
    del data["iterator"]
    item.write_text(json.dumps(data))
    (run / "checksums" / "6.json").unlink()
    refused = run_cli(run, *[*sets, "train.steps=8"], extra=["--resume"], check=False)
    assert refused.returncode == 2, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint {run / 'checkpoints' / '6'} lacks iterator in its data item")
    assert last.endswith("it is kept") and item.is_file()


def test_run_dir_files_that_are_not_utf8_are_one_line(tmp_path):
    from train.rundir import RunDir, write_atomically

    (tmp_path / "config.yaml").write_bytes(b"train: {steps: 4}\n# \xe9t\xe9\n")
    with pytest.raises(UserError, match=r"config.yaml is not UTF-8 text \(byte 20\)$"):
        RunDir(tmp_path).config()
    damaged = tmp_path / "summary.json"
    damaged.write_bytes(b"\xff{}")
    write_atomically(damaged, '{"status": "completed"}')  # replaced, not compared as text
    assert damaged.read_text() == '{"status": "completed"}'


SIGINT_IN_STARTUP = textwrap.dedent("""
    import os, signal, sys, time
    import train.loop

    def start_up(*args, **kwargs):  # the start-up, before the first step: Ctrl-C comes
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
        print("went on")
        return {}

    train.loop.train_and_evaluate = start_up
    from train.__main__ import main
    sys.exit(main(["--config", "configs/tiny.yaml", "--run-dir", sys.argv[1], "--quiet"]))
""")


def test_sigint_in_the_start_up_ends_it_at_once_as_sigterm_does(tmp_path):
    """Before the step loop there is nothing to save: Ctrl-C ends the process by the signal, not
    a ``KeyboardInterrupt`` raised wherever the start-up is (inside JAX it can be swallowed, or
    crash the process); a scheduler or the sweep sees a run ended by a signal."""
    proc = subprocess.run(
        [sys.executable, "-c", SIGINT_IN_STARTUP, str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stderr[-2000:])
    assert "went on" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_the_runs_own_warnings_are_one_line_each(tmp_path):
    """A warning about the run's settings (here a projection rank clipped to the matrices' size)
    reads ``warning: MESSAGE``, without the source line Python adds (the trainer's start-up)."""
    proc = run_cli(tmp_path / "run", *FAST, "train.steps=2", "optimizer.r_base=100000", in_process=False)
    lines = proc.stderr.strip().splitlines()
    assert lines and all(line.startswith("warning: projection rank ") for line in lines), lines
    assert any(
        "for module 'down' at 2 matrices (['layers_0']['mlp']['down_proj']['kernel'] and" in x for x in lines
    )


TWO_SIGNALS = textwrap.dedent("""
    import os, signal, sys, time
    from train.distributed import StopSignals

    sig = getattr(signal, sys.argv[1])
    with StopSignals() as stop:
        os.kill(os.getpid(), sig)
        time.sleep(0.2)
        print("asked to stop:", stop.requested, flush=True)
        os.kill(os.getpid(), sig)
        time.sleep(0.5)
        print("went on", flush=True)
""")


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_second_ctrl_c_ends_the_steps_at_once_and_a_second_sigterm_waits(name, tmp_path):
    """The first signal asks the step loop to stop after saving a checkpoint; a second SIGINT (Ctrl-C
    again, while a long compilation or a save keeps the first waiting) ends the process at once,
    by the signal, saying so in one line; a second SIGTERM (a scheduler's) changes nothing."""
    proc = subprocess.run(
        [sys.executable, "-c", TWO_SIGNALS, name], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.startswith("asked to stop: True\n"), proc.stdout + proc.stderr[-2000:]
    if name == "SIGTERM":
        assert proc.returncode == 0 and "went on" in proc.stdout and not proc.stderr, proc.stderr
        return
    assert proc.returncode == -signal.SIGINT and "went on" not in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: interrupted twice: stopped at once, without the checkpoint the first interrupt asked "
        "for (--resume goes on from the run's last complete checkpoint, or from step 0 where it has none)"
    ]


def test_the_closing_line_calls_only_the_last_steps_evaluation_final(tmp_path, capsys):
    """An interrupted run's last evaluation may be steps before its stop: the line gives its step
    rather than calling it final."""
    from train.__main__ import _report

    summary = {"status": "interrupted", "steps": 155, "wall_s": 10.2, "last_checkpoint": 155}
    assert _report({**summary, "final_eval_ppl": 11.683, "final_eval_step": 100}, tmp_path) == EXIT_PREEMPTED
    assert (
        capsys.readouterr().out.splitlines()[0]
        == "interrupted: 155 steps in 10.2s, eval ppl 11.68 at step 100"
    )
    done = {**summary, "status": "completed", "steps": 400, "final_eval_ppl": 5.776, "final_eval_step": 400}
    assert _report(done, tmp_path) == 0
    assert capsys.readouterr().out.splitlines()[0] == "completed: 400 steps in 10.2s, final eval ppl 5.78"
    assert _report({**summary, "final_eval_ppl": None, "final_eval_step": None}, tmp_path) == EXIT_PREEMPTED
    assert capsys.readouterr().out.splitlines()[0] == "interrupted: 155 steps in 10.2s"


def write_jsonl(path, n, seed):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 60))}) + "\n" for _ in range(n)))


def recorded_loop(monkeypatch) -> list[tuple[str, int]]:
    """The trainer's step loop, recording in order each step it dispatches and each step whose
    metrics it reads (``("dispatch", k)``, ``("read", k)``)."""
    from train import loop

    events, init, read = [], loop.StepLoop.__init__, loop.StepLoop.read_metrics

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        step_fn = self.step_fn

        def dispatch(state, batch):
            events.append(("dispatch", self.step + 1))
            return step_fn(state, batch)

        self.step_fn = dispatch

    def recording_read(self, step, metrics):
        events.append(("read", step))
        return read(self, step, metrics)

    monkeypatch.setattr(loop.StepLoop, "__init__", recording_init)
    monkeypatch.setattr(loop.StepLoop, "read_metrics", recording_read)
    return events


@pytest.mark.parametrize("mode", ["train", pytest.param("profile", marks=pytest.mark.slow)])
def test_the_host_reads_a_steps_metrics_only_after_dispatching_the_next(mode, monkeypatch, tmp_path):
    """The host never waits for the step it just dispatched (issue 22: the loop keeps the device
    busy): it reads step k's metrics after dispatching step k+1, except at the steps that
    evaluate or save and at the last, which read their own first. A profile, whose reads also
    take the alignments at every ``profile.every``-th step, records each of those steps."""
    events = recorded_loop(monkeypatch)
    profile = ["mode=profile", "profile.steps=12", "profile.every=3"]
    sets = [*FAST, "train.log_every=1"] + profile * (mode == "profile")
    run_cli(tmp_path / "run", *sets)  # 12 steps, evaluating every 6, saving every 4
    assert [k for e, k in events if e == "dispatch"] == list(range(1, 13)), events
    assert sorted(k for e, k in events if e == "read") == list(range(1, 13)), events
    at_once = {4, 6, 8, 12}
    for step in range(1, 13):
        before = events[: events.index(("read", step))]
        latest = max(k for e, k in before if e == "dispatch")
        assert latest == (step if step in at_once else step + 1), (step, events)
    if mode == "profile":
        alignment = json.loads((tmp_path / "run" / "alignment.json").read_text())
        assert alignment["steps"] == [3, 6, 9, 12] and set(alignment["s_tau"]) >= {"q", "down"}


@pytest.mark.slow
def test_the_last_step_is_evaluated_where_eval_every_does_not_divide_the_steps(tmp_path):
    """8 steps with eval_every 6 evaluate at 6 and at 8: the final ppl is the trained model's."""
    run = tmp_path / "run"
    run_cli(run, *FAST, "train.steps=8", "checkpoint.every=0")
    evaluated = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    summary = json.loads((run / "summary.json").read_text())
    assert evaluated == [6, 8] and summary["final_eval_step"] == 8
    assert summary["final_eval_ppl"] is not None


@pytest.mark.slow
def test_evaluation_reads_each_validation_window_once(tmp_path):
    """More validation batches asked for than the split holds: each window is read once (the
    last batch filled up with windows of weight 0), and the eval loss is the mean over exactly
    those windows' tokens; fewer asked for: the first ones, all counted."""
    import jax

    import models
    from train.config import DataSection
    from train.data import build_data
    from train.model import model_config
    from train.step import loss_fn, make_eval_step, mean_nll

    write_jsonl(tmp_path / "a.jsonl", 60, 0)
    section = DataSection(
        source="files", paths=[str(tmp_path / "a.jsonl")], validation_fraction=0.3, store=str(tmp_path / "s")
    )
    data = build_data(section, seq_len=15, quiet=True)
    n = data.n_windows("validation")
    batch = next(b for b in (4, 5, 6, 7) if n % b)  # a last batch only partly made of windows
    batches = data.val_batches(batch, n // batch + 3)
    assert len(batches) == n // batch + 1 and all(b.shape == (batch, 16) for b, _ in batches)
    windows = np.concatenate([b for b, _ in batches])
    weights = np.concatenate([w for _, w in batches])
    assert weights.tolist() == [1.0] * n + [0.0] * (len(batches) * batch - n)
    every = data.store.splits["validation"].windows(np.arange(n), 16)
    np.testing.assert_array_equal(windows[:n], every)
    first = data.val_batches(batch, 1)
    assert len(first) == 1 and first[0][1].tolist() == [1.0] * batch
    np.testing.assert_array_equal(first[0][0], every[:batch])

    cfg = model_config(load_config(TINY), data.vocab_size)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    got = mean_nll(jax.jit(make_eval_step(cfg)), params, batches)
    assert got == pytest.approx(float(loss_fn(cfg, params, every)), rel=1e-6)
    # The windows that only fill the last batch up would have moved it (a repeated window).
    assert got != pytest.approx(float(loss_fn(cfg, params, windows)), rel=1e-6)

    # A run in micro-batches evaluates the same windows a micro-batch at a time (the eval step is
    # compiled for its rows, as the train step is): batch 8 in micro-batches of 4, 2 batches.
    from train.loop import eval_batches

    t = load_config(TINY, ["train.batch_size=8", "train.micro_batch_size=4", "train.eval_batches=2"]).train
    micro = eval_batches(data, t)
    assert len(micro) == 4 and all(b.shape == (4, 16) and w.tolist() == [1.0] * 4 for b, w in micro)
    np.testing.assert_array_equal(np.concatenate([b for b, _ in micro]), every[:16])
    whole = data.val_batches(8, 2)
    got_micro = mean_nll(jax.jit(make_eval_step(cfg)), params, micro)
    assert got_micro == pytest.approx(mean_nll(jax.jit(make_eval_step(cfg)), params, whole), rel=1e-6)
    unsplit = eval_batches(data, dataclasses.replace(t, micro_batch_size=None))
    assert [b.shape for b, _ in unsplit] == [(8, 16)] * 2


@pytest.mark.slow
def test_a_resume_onto_other_data_is_refused(tmp_path):
    """A file added to the run's glob since its checkpoint: the store found on resume holds
    other windows, so the restored iterator would draw other batches; one line, nothing run. The
    same files at another path: the run goes on."""
    docs = tmp_path / "docs"
    docs.mkdir()
    write_jsonl(docs / "a.jsonl", 200, 0)
    data = ["data.source=files", f"data.paths=[{docs}/*.jsonl]", f"data.cache_dir={tmp_path / 'cache'}"]
    run_cli(tmp_path / "run", *FAST, "train.steps=4", *data)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    write_jsonl(docs / "b.jsonl", 50, 1)
    proc = run_cli(tmp_path / "run", *FAST, "train.steps=8", *data, extra=["--resume"], check=False)
    assert proc.returncode == 2, proc.stderr
    assert "holds other data than the one checkpoint 4 trained on" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics
    (docs / "b.jsonl").unlink()  # the same files again: the resume goes on
    again = run_cli(tmp_path / "run", *FAST, "train.steps=8", *data, extra=["--resume"])
    assert "resuming from step 4" in again.stdout and losses(tmp_path / "run").keys() >= {5, 8}
    # The same files moved elsewhere, given at their new paths: the same tokens, so the run goes
    # on (paths are not what a resume keeps; the store's content is).
    shutil.move(docs, tmp_path / "moved")
    moved = [*data[:1], f"data.paths=[{tmp_path / 'moved'}/*.jsonl]", *data[2:]]
    on = run_cli(tmp_path / "run", *FAST, "train.steps=10", *moved, extra=["--resume"])
    assert "resuming from step 8" in on.stdout and losses(tmp_path / "run").keys() >= {9, 10}


@pytest.mark.slow
def test_non_finite_parameters_are_never_checkpointed(tmp_path):
    proc = run_cli(
        tmp_path / "inf",
        *FAST,
        "train.lr=1.0e+39",
        "train.warmup_ratio=0.0",
        "checkpoint.every=1",
        check=False,
    )
    assert proc.returncode == 1 and "non-finite parameters after step 1" in proc.stdout, proc.stdout
    assert "no checkpoint was saved before it" in proc.stdout  # never a pointer to an empty dir
    ckpt_dir = tmp_path / "inf" / "checkpoints"
    assert not ckpt_dir.exists() or not [p for p in ckpt_dir.iterdir() if p.name.isdigit()]


@pytest.mark.slow
def test_resumed_profile_records_like_an_uninterrupted_one(tmp_path):
    sets = [*FAST, "mode=profile", "profile.every=2", "checkpoint.every=2"]
    run_cli(tmp_path / "whole", *sets, "profile.steps=8")
    run_cli(tmp_path / "parts", *sets, "profile.steps=4")
    run_cli(tmp_path / "parts", *sets, "profile.steps=8", extra=["--resume"])
    whole = json.loads((tmp_path / "whole" / "alignment.json").read_text())
    parts = json.loads((tmp_path / "parts" / "alignment.json").read_text())
    assert parts["steps"] == whole["steps"] == [2, 4, 6, 8]
    for label, value in whole["s_tau"].items():
        np.testing.assert_allclose(parts["s_tau"][label], value, rtol=1e-6)


def test_only_the_first_process_writes_the_run_dir_files(tmp_path, monkeypatch):
    import train.loop

    cfg = load_config(TINY, [*FAST, "train.steps=2", "checkpoint.every=0"])
    monkeypatch.setattr(train.loop, "_is_main_process", lambda: False)
    summary = train.loop.train_and_evaluate(cfg, tmp_path / "other", quiet=True)
    assert summary["status"] == "completed" and summary["steps"] == 2
    written = {p.name for p in (tmp_path / "other").iterdir()}
    assert not written & {"config.yaml", "metrics.jsonl", "summary.json"}, written


def test_the_logged_gradient_norm_of_bf16_gradients_is_float32s():
    """``train.step.global_norm``: the global norm of bf16 leaves as float32 computes it from
    them (optax's ``tree_norm``, the metric before, rounds each leaf's sum of squares to bf16
    first: 209.0 for these leaves, whose norm is 208.725, under optax 0.2.8)."""
    import jax
    import jax.numpy as jnp

    from train.step import global_norm

    rng = np.random.default_rng(0)
    tree = {k: jnp.asarray(rng.standard_normal((64, 48)) * i, jnp.bfloat16) for i, k in enumerate("abc", 1)}
    exact = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree.values()))
    assert float(global_norm(tree)) == pytest.approx(exact, rel=1e-6)
    assert global_norm(tree).dtype == jnp.float32
    assert float(jax.jit(global_norm)(tree)) == pytest.approx(exact, rel=1e-6)
