"""One call on a GPU machine: the issue-22 measurements in priority order, within a time budget.

Phases (run in the order given, each skipped when its estimate exceeds the time left):

- ``env``: device, driver and package versions (a child process; this driver never starts JAX,
  whose allocator would otherwise hold 75% of the GPU for the whole session);
- ``gpu_tests``: ``pytest -m gpu tests/test_gpu.py`` (cuDNN attention vs XLA, the refresh on the
  device, a donated sharded step), its counts;
- ``vs_torch_350m`` / ``vs_torch_1b``: ``benchmarks/vs_torch.py``, one process per optimizer (each
  its own peak memory, the peers' memory gone before JAX starts): galore-torch + torch.compile and
  MoARa Full first, then vanilla GaLore, torch's fused AdamW and this project's AdamW, merged into
  one JSON and PNG. This project's runs take the paper config's remat and layer layout for the
  size, ``--jax-args`` over them (e.g. the fastest variant of an earlier call). The 1B runs use
  fewer steps; their time is estimated from the 350M step times of the same call (times the
  parameter ratio) where those ran;
- ``variants_model`` / ``variants_flags``: MoARa Full's 350M step (``benchmarks/train_step.py``, one
  process each, median of ``--variant-steps``) for XLA instead of cuDNN attention, each remat
  policy, each layer layout and two micro-batch sizes / each XLA flag set of
  ``train.xla_flags.GPU_FLAG_SETS``, against a baseline (``configs/paper/llama2-350m.yaml``'s remat
  and layers, ``--jax-args`` over them) run before and after them (their difference is the drift
  of the device over the phase);
- ``train_loop`` / ``train_loop_60m``: ``python -m train.prepare`` (the builtin corpus, byte
  tokenizer) and ``python -m train`` at 350M (the paper's protocol) / 60M (the evidence runs'
  setting) with logging every step and two evaluations, its loop's parts timed on the host
  (``benchmarks/loop_waits.py``: dispatch, drawing the next batch, the reads that wait for a step,
  the rest; ``loop_waits-MODEL.json``), against ``train_step.py`` on the same model and batch: the
  loop's step times over the benchmark's;
- ``full_tests``: ``python -m pytest -q -n 8`` with JAX on the GPU, its counts and failures.

Everything goes to ``--out`` (the device's ``$OUT``): ``session.json`` (rewritten after every
phase), ``vs_torch_350m.json``/``.png``, ``vs_torch_1b.json``/``.png``; ``gpu_session.sh`` tees the
log to ``session.log``. ``--smoke`` runs the same phases at tiny sizes on any machine (CPU: the
check of this script without a GPU).

Usage (see gpu_session.sh, which installs the carried wheels first):
  python benchmarks/gpu_session.py --out DIR [--budget-s 560] [--phases env gpu_tests ...]
      [--jax-args "--remat dots"] [--variant-steps 5] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from _processes import CHILDREN_FILE, Groups, kill_group  # noqa: E402

from train.rundir import RunDir  # noqa: E402  (neither starts a JAX backend)
from train.xla_flags import GPU_FLAG_SETS  # noqa: E402

# Parameters of the Llama 2 presets with the T5 vocabulary (models.param_count, which would start a
# JAX backend in this driver), for estimates.
PARAMS = {"llama2-350m": 367_969_280, "llama2-1b": 1_339_082_752}
TAIL = 20_000  # characters of a captured child's output printed to the log
# Issue 22's figures in the order they need the runs: MoARa Full against this project's GaLore
# (one ratio), then against the peer's GaLore, then the AdamWs. The peer's GaLore is the slowest
# run (a cold Inductor compile and its refreshes' SVDs), so a short budget still brings the first.
VS_TORCH_ORDER = ("moara_full", "galore_vanilla", "galore_torch", "adamw", "adamw_torch")
# The pool of a JAX child that has the GPU to itself (JAX's default takes 75%: 59.3 GiB of an
# H100's 79.1, under the 60.0 GiB the 1B step needs without remat); what is left holds cuDNN's
# workspace and the CUDA context.
JAX_ALONE_MEM_FRACTION = "0.9"
# At most, so that a slow test cannot take the phases after it. 2026-11-28, H100: 7 of the 9
# tests had passed in 180 s (about 25 s each, JAX's start and the collection included).
GPU_TESTS_S = 300.0
# A child still running at its limit gets SIGINT this long before it (pytest then prints its
# summary and durations, if the test returns to Python in time), and SIGKILL with its process
# group at the limit.
GRACE_S = 10.0
# Off --smoke: the children's process groups, in the file the evidence runner keeps its runs' in
# (``CHILDREN_FILE``), so that either driver ends what a call cut off at its limit left running on
# a machine kept warm for the next call.
GROUPS: Groups | None = None


class Session:
    """The budget, the output directory and the results of one call."""

    def __init__(
        self,
        out: pathlib.Path,
        budget_s: float,
        smoke: bool,
        variant_steps: int = 5,
        jax_args: list | None = None,
    ):
        self.out, self.smoke, self.variant_steps = out, smoke, variant_steps
        self.jax_args = list(jax_args or [])
        self.deadline = time.monotonic() + budget_s
        self.results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": smoke, "phases": {}}
        self._work: pathlib.Path | None = None

    @property
    def work(self) -> pathlib.Path:
        """A scratch directory for the phases' own files, made when the first phase needs it;
        ``close`` removes it."""
        if self._work is None:
            self._work = pathlib.Path(tempfile.mkdtemp(prefix="gpu-session-"))
        return self._work

    def close(self) -> None:
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "session.json").write_text(json.dumps(self.results, indent=2))

    def run(self, cmd: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
        """Runs a child (its output goes to ours) within the time left; its exit, time and whether it
        was stopped at the deadline."""
        timeout = max(1.0, min(timeout or self.left(), self.left()))
        t0 = time.perf_counter()
        rc, _ = self._child(cmd, env, timeout, capture=False)
        return {"rc": rc, "seconds": time.perf_counter() - t0, "stopped_at_deadline": rc is None}

    def capture(
        self, cmd: list[str], env: dict | None = None, timeout: float | None = None
    ) -> tuple[int | None, str]:
        """Runs a child within the time left (and ``timeout``) and returns its exit code (None:
        stopped at the deadline) and output (its last ``TAIL`` characters also printed)."""
        timeout = max(1.0, min(timeout or self.left(), self.left()))
        rc, text = self._child(cmd, env, timeout, capture=True)
        print(text[-TAIL:], flush=True)
        return rc, text

    @staticmethod
    def _child(cmd: list[str], env: dict | None, timeout: float, capture: bool) -> tuple[int | None, str]:
        """A child in a process group of its own, stopped at ``timeout`` (then the exit code is
        None): SIGINT to the group ``GRACE_S`` before it, so that what the child says on an
        interrupt (pytest's summary) still comes; then SIGKILL to the whole group, so its helpers
        (torch.compile's workers, pytest-xdist's) cannot keep the log's pipe open and the call
        running past its limit."""
        print(f"\n$ {shlex.join(cmd)}", flush=True)
        pipe = subprocess.PIPE if capture else None
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=pipe,
            stderr=subprocess.STDOUT if capture else None,
            text=True,
            start_new_session=True,
        )
        if GROUPS is not None:
            GROUPS.add(proc, shlex.join(cmd[:4]))
        grace = min(GRACE_S, timeout / 2)
        out = None
        try:
            out, _ = proc.communicate(timeout=timeout - grace)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            # Reading on (a child blocked on a full pipe would print no more), the output so far kept.
            with contextlib.suppress(subprocess.TimeoutExpired):
                out, _ = proc.communicate(timeout=grace)
        kill_group(proc)  # at the deadline, or helpers it left behind
        if GROUPS is not None:
            GROUPS.remove(proc)
        if out is None:
            out, _ = proc.communicate()
        return rc, out or ""


def shapes(s: Session, model: str) -> dict:
    """Model, batch and step counts of the benchmarks (tiny ones with ``--smoke``)."""
    if s.smoke:
        return dict(model="llama2-tiny", batch=8, micro=4, seq=32, steps=2, warmup=1, refresh=1)
    if model == "llama2-1b":
        return dict(model=model, batch=512, micro=128, seq=256, steps=5, warmup=2, refresh=1)
    return dict(model=model, batch=512, micro=128, seq=256, steps=10, warmup=3, refresh=3)


def step_args(sh: dict) -> list[str]:
    return [
        "--model",
        sh["model"],
        "--batch",
        str(sh["batch"]),
        "--micro-batch",
        str(sh["micro"]),
        "--seq-len",
        str(sh["seq"]),
    ]


# ---------------------------------------------------------------- phases


def phase_env(s: Session) -> dict:
    code = (
        "import json, jax, jax.extend, jaxlib, flax, optax, importlib.metadata as md\n"
        "d = jax.devices()[0]\n"
        "v = {}\n"
        "names = ('torch', 'transformers', 'galore-torch', 'grain', 'orbax-checkpoint', 'numpy',\n"
        "         'protobuf')\n"
        "for p in names:\n"
        "    try: v[p] = md.version(p)\n"
        "    except md.PackageNotFoundError: v[p] = None\n"
        "print('ENV ' + json.dumps({'jax': jax.__version__, 'jaxlib': jaxlib.__version__, "
        "'flax': flax.__version__, 'optax': optax.__version__, 'backend': jax.default_backend(), "
        "'device_kind': d.device_kind, 'devices': jax.device_count(), "
        "'platform_version': jax.extend.backend.get_backend().platform_version, **v}))\n"
    )
    rc, text = s.capture([sys.executable, "-c", code], env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    found = re.search(r"^ENV (.*)$", text, re.M)
    result = {"rc": rc, **(json.loads(found.group(1)) if found else {"error": text[-2000:]})}
    query = [
        "nvidia-smi",
        "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
        "--format=csv,noheader",
    ]
    try:
        result["nvidia_smi"] = subprocess.run(
            query, capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        result["nvidia_smi"] = f"not read: {e}"
    result["python"] = sys.version.split()[0]
    return result


def pytest_counts(text: str) -> dict:
    """The counts of pytest's summary line (``3 passed, 1 skipped in 2.1s``)."""
    counts = {}
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", text):
        counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
    return counts


# `pytest -v` lines: a test id (parametrized ids may hold spaces), then each outcome it ends in
# (a test that passes and then errors in teardown gets a second line).
OUTCOME = re.compile(r"^(tests/\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
COUNTED = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}
COUNTED |= {"XFAIL": "xfailed", "XPASS": "xpassed"}  # as pytest's summary line names them
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown) +(tests/\S+::.+?) *$", re.M)


def stopped_test(text: str, outcomes: dict[str, list[str]]) -> str | None:
    """The test a stop came in, from ``pytest -v`` output: ``-v`` prints a test's node id as it
    starts and its outcome on the same line when it ends, so the last node id with no outcome
    (None where every test that started ended: a stop in a fixture's teardown after them)."""
    started = re.findall(
        r"^(tests/\S+::.+?)(?: (?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b.*)? *$", text, re.M
    )
    return next((t for t in reversed(started) if t not in outcomes), None)


def phase_gpu_tests(s: Session) -> dict:
    """The GPU tests, each test's outcome as it ends (``-v``), so that a run stopped at the cap
    still says which tests passed and which one it stopped in; each test's seconds (setup, call
    and teardown) where pytest got to its closing report."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-m",
        "gpu",
        "-rfEs",  # failures and errors named in the summary, skips with their reasons
        "--durations=0",
        "--durations-min=0",
        "-p",
        "no:cacheprovider",
        "tests/test_gpu.py",
    ]
    # No preallocation: a test that starts python -m train runs a second JAX process on the GPU.
    rc, text = s.capture(cmd, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, timeout=GPU_TESTS_S)
    failures = re.findall(r"^(FAILED|ERROR) (\S+)", text, re.M)
    outcomes: dict[str, list[str]] = {}
    for test, outcome in OUTCOME.findall(text):
        outcomes.setdefault(test, []).append(outcome)
    # The summary line ("=== 7 passed in 171.2s ==="), also printed when the cap's SIGINT stops it.
    summary = re.findall(r"^=+ (.+ in [\d.]+s(?: \([\d:]+\))?) =+$", text, re.M)
    counts = pytest_counts(summary[-1]) if summary else {}
    if not counts:  # killed before its summary: counted from the outcomes it printed
        for outcome in (o for seen in outcomes.values() for o in seen):
            key = COUNTED[outcome]
            counts[key] = counts.get(key, 0) + 1
    seconds: dict[str, float] = {}
    for value, _, test in DURATION.findall(text):
        seconds[test] = round(seconds.get(test, 0.0) + float(value), 2)
    stopped_in = stopped_test(text, outcomes) if rc is None else None
    return {
        "rc": rc,
        "counts": counts,
        "failures": [f[1] for f in failures],
        "tests": outcomes,
        "seconds": seconds,
        "stopped_in": stopped_in,
    }


def phase_full_tests(s: Session) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "8", "-p", "no:cacheprovider"]
    rc, text = s.capture(cmd, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    failures = re.findall(r"^(FAILED|ERROR) (.+)$", text, re.M)
    return {"rc": rc, "counts": pytest_counts(text), "failures": [f[1][:300] for f in failures]}


def _json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def phase_vs_torch(s: Session, model: str) -> dict:
    """vs_torch.py, one process per optimizer, merged."""
    sh = shapes(s, model)
    args = step_args(sh) + ["--steps", str(sh["steps"]), "--warmup", str(sh["warmup"])]
    args += ["--refresh-steps", str(sh["refresh"]), *paper_rank_args(sh["model"])]
    if s.smoke:
        args.append("--no-compile")
    step_s = _step_estimate(s, sh["model"])
    phase = f"vs_torch_{model.split('-')[-1]}"
    merged, runs, skipped = None, {}, []
    for name in VS_TORCH_ORDER:
        estimate = _run_estimate(name, sh, step_s, s.smoke)
        if s.left() < estimate:
            skipped.append({"run": name, "estimate_s": estimate, "left_s": s.left()})
            continue
        out = s.work / f"vs_torch_{sh['model']}_{name}.json"
        peer = name in ("galore_torch", "adamw_torch")
        ours = [] if peer else paper_args(sh["model"]) + s.jax_args
        run = s.run(
            [sys.executable, "benchmarks/vs_torch.py", *args, *ours, "--only", name, "--out", str(out)],
            env=None if peer else {"XLA_PYTHON_CLIENT_MEM_FRACTION": JAX_ALONE_MEM_FRACTION},
            timeout=child_cap(estimate),
        )
        data = _json(out)
        runs[name] = (
            {"error": "no result", **run}
            if data is None
            else {**data["runs"][name], "wall_s": run["seconds"]}
        )
        s.results["phases"][phase] = {"runs": runs, "skipped": skipped}  # so far, should the call end
        s.save()
        if data is None:
            continue
        merged = merged or {k: v for k, v in data.items() if k != "runs"}
        if "jax_model" in data:
            merged["jax_model"], merged["device"] = data["jax_model"], data["device"]
    if merged is None:
        return {"runs": runs, "skipped": skipped}
    merged["runs"] = {k: v for k, v in runs.items() if "plain_ms" in v}
    from vs_torch import plot, ratios  # (imports JAX: only once a run has come back)

    merged.update(ratios(merged["runs"]))
    ours = shlex.join(paper_args(sh["model"]) + s.jax_args)
    merged["command"] = (
        f"python benchmarks/vs_torch.py {shlex.join(args)} [{ours}] --only NAME (one process each; "
        f"this project's with XLA_PYTHON_CLIENT_MEM_FRACTION={JAX_ALONE_MEM_FRACTION})"
    )
    merged["skipped"] = skipped
    merged["errors"] = {k: v for k, v in runs.items() if "plain_ms" not in v}
    path = s.out / f"{phase}.json"
    path.write_text(json.dumps(merged, indent=2))
    if merged["runs"]:
        plot(merged, path.with_suffix(".png"))
    return merged


def _step_estimate(s: Session, model: str) -> float:
    """Seconds per training step of ``model``: measured here, or scaled from 350M by parameters."""
    measured = (s.results["phases"].get("vs_torch_350m") or {}).get("runs", {})
    ms = [r["plain_ms"] for r in measured.values() if "plain_ms" in r]
    if s.smoke:
        return 0.5
    base = statistics.median(ms) / 1e3 if ms else 1.0
    return base * PARAMS.get(model, PARAMS["llama2-350m"]) / PARAMS["llama2-350m"]


def _run_estimate(name: str, sh: dict, step_s: float, smoke: bool) -> float:
    """Seconds one vs_torch.py run takes: start and compilation, the steps, the refreshes (the
    peer's refresh, 168 SVDs, took 10.6 s at 350M on an H100 and grows about 8x at 1B; it runs
    the warm-up's step 0 and the timed ones, this project's side one untimed and the timed)."""
    if smoke:
        return 20.0
    steps = sh["warmup"] + sh["steps"]
    if name in ("galore_torch", "adamw_torch"):
        svd = 10.6 * (8 if sh["model"] == "llama2-1b" else 1)
        refreshes = (sh["refresh"] + 1) * svd if name == "galore_torch" else 0.0
        return 90 + steps * 0.8 * step_s + refreshes
    return 60 + (steps + sh["refresh"] + 1) * step_s


def child_cap(estimate: float) -> float:
    """The most a child whose run is estimated at ``estimate`` seconds may take: twice that, and at
    least a minute over it, so that one that hangs or compiles far longer (a flag set's command
    buffers, an unrolled scan) leaves the rest of the call to the runs after it."""
    return max(2 * estimate, estimate + 60)


def paper_rank_args(model: str) -> list[str]:
    """``--r-base`` and ``--block-size`` of ``configs/paper/MODEL.yaml`` (512 and 64 at 1B; both
    sides of vs_torch.py take them); none for a model without a paper config."""
    from train.config import load_config

    path = ROOT / "configs" / "paper" / f"{model}.yaml"
    if not path.is_file():
        return []
    o = load_config(path).optimizer
    return ["--r-base", str(o.r_base), "--block-size", str(o.block_size)]


def paper_args(model: str) -> list[str]:
    """``train_step.py`` arguments for the model settings of ``configs/paper/MODEL.yaml`` (its
    ``remat`` and layer layout, resolved as ``python -m train`` resolves them: the config's layers
    over the model preset); none for a model without a paper config."""
    import models
    from train.config import load_config
    from train.model import model_config

    path = ROOT / "configs" / "paper" / f"{model}.yaml"
    if not path.is_file():
        return []
    cfg = load_config(path)
    resolved = model_config(cfg, models.get_config(cfg.model.name).vocab_size)
    return ["--remat", resolved.remat, "--layers", "scanned" if resolved.scan_layers else "unrolled"]


def variant_list(s: Session, group: str) -> list[tuple[str, list[str]]]:
    """``(label, train_step.py arguments over the baseline's)`` of one group of step-speed variants
    (``model``: attention, remat, layer layout, micro-batch, the loss in chunks; ``flags``: each XLA
    flag set), the baseline (the paper config's settings, ``s.jax_args`` over them) first and last."""
    if group == "flags":
        out = [(f"xla flags {name}", ["--xla-flag-sets", name]) for name in GPU_FLAG_SETS]
    else:  # in the order of what they tell, in case the time runs out
        small, large = ("2", "8") if s.smoke else ("64", "256")
        chunk = "8" if s.smoke else "32"
        out = [
            ("attention xla", ["--attention", "xla"]),
            ("remat dots, scanned layers", ["--remat", "dots", "--layers", "scanned"]),
            ("remat dots", ["--remat", "dots"]),
            (f"micro-batch {small}", ["--micro-batch", small]),
            ("remat full", ["--remat", "full"]),
            ("remat none", ["--remat", "none"]),
            ("unrolled layers", ["--layers", "unrolled"]),
            (f"micro-batch {large}", ["--micro-batch", large]),
            # (62.9 GiB at 350M by the deviceless H200 compile: inside the pool a child takes
            # alone, JAX_ALONE_MEM_FRACTION, of an H200, 125.9 GiB, and of an H100, 71.2 GiB)
            (
                f"remat none, unrolled layers, micro-batch {large}",
                ["--remat", "none", "--layers", "unrolled", "--micro-batch", large],
            ),
            (f"loss in chunks of {chunk}", ["--loss-chunk", chunk]),
            (
                f"remat none, unrolled layers, loss in chunks of {chunk}",
                ["--remat", "none", "--layers", "unrolled", "--loss-chunk", chunk],
            ),
        ]
    return [("baseline", [])] + out + [("baseline again (drift)", [])]


def _baseline(s: Session) -> list[str]:
    return paper_args(shapes(s, "llama2-350m")["model"]) + s.jax_args


def _options(args: list[str]) -> dict[str, tuple[str, ...]]:
    """``--name values...`` tokens as a dict (the last occurrence of a name wins, as in argparse)."""
    out: dict[str, tuple[str, ...]] = {}
    name = None
    for a in args:
        if a.startswith("--"):
            name = a
            out[name] = ()
        elif name is not None:
            out[name] += (a,)
    return out


def _same_as_baseline(s: Session, extra: list[str]) -> bool:
    """Whether the variant ``extra`` only repeats settings the baseline already has."""
    base = _options(_baseline(s))
    return bool(extra) and all(base.get(k) == v for k, v in _options(extra).items())


def phase_variants(s: Session, group: str) -> dict:
    sh = shapes(s, "llama2-350m")
    steps = (
        ["--steps", "2", "--warmup", "1"] if s.smoke else ["--steps", str(s.variant_steps), "--warmup", "2"]
    )
    base = _baseline(s)
    rows = []
    estimate = 20.0 if s.smoke else 45.0 + (2 + s.variant_steps) * _step_estimate(s, "llama2-350m")
    for label, extra in variant_list(s, group):
        if _same_as_baseline(s, extra):
            continue
        if s.left() < estimate:
            rows.append({"variant": label, "skipped": f"{s.left():.0f}s left, estimate {estimate:.0f}s"})
            continue
        out = s.work / f"variant_{group}_{len(rows)}.json"
        # The variant's arguments come last: argparse keeps the last value of a repeated option.
        cmd = [sys.executable, "benchmarks/train_step.py", *step_args(sh), *steps, "--only", "moara_full"]
        run = s.run(cmd + base + extra + ["--out", str(out)], timeout=child_cap(estimate))
        data = _json(out)
        row = {"variant": label, "args": extra, "wall_s": run["seconds"]}
        if data is None:
            stopped = " (stopped at the deadline)" if run["stopped_at_deadline"] else ""
            row["error"] = f"rc {run['rc']}{stopped}"
        else:
            row |= {"ms": data["ms"]["moara_full"], "attention": data["attention"], "remat": data["remat"]}
            row |= {"scan_layers": data["scan_layers"], "micro_batch": data["micro_batch"]}
            row["xla_flags"] = data["xla_flags"]
        rows.append(row)
        s.results["phases"][f"variants_{group}"] = {"rows": rows}
        s.save()
    base_ms = [r["ms"] for r in rows if r["variant"].startswith("baseline") and "ms" in r]
    for r in rows:
        if base_ms and "ms" in r:
            r["over_baseline"] = r["ms"] / base_ms[0]
    result = {"rows": rows, "model": sh["model"], "batch": sh["batch"], "seq_len": sh["seq"]}
    result["baseline_args"] = base
    if len(base_ms) == 2:
        result["baseline_drift"] = base_ms[1] / base_ms[0] - 1
    timed = [r for r in rows if "ms" in r]
    if timed:
        result["fastest"] = min(timed, key=lambda r: r["ms"])["variant"]
    return result


# The train_loop phases' configs, and the settings over them that make them run on the builtin
# corpus: the 350M paper protocol, and the evidence runs' 60M setting (with its Wikipedia files
# left out and T5's 32,000-id vocabulary kept, so that the step is the evidence runs' step).
LOOP_SETTINGS = {
    "llama2-350m": ("configs/paper/llama2-350m.yaml", []),
    "llama2-60m": (
        "configs/experiments/wiki60m/base.yaml",
        ["data.paths=[]", "data.validation_paths=[]", "model.overrides.vocab_size=32000"],
    ),
}


def phase_train_loop(s: Session, model: str) -> dict:
    """python -m train with logging and evaluation on, its loop's parts timed (loop_waits.py),
    against train_step.py on the same model and batch."""
    config, extra = LOOP_SETTINGS[model]
    store, run_dir = s.work / f"store-{model}", s.work / f"run-{model}"
    data = ["data.tokenizer=bytes", *extra]
    base = ["--config", config, *(a for x in ["data.source=builtin", *data] for a in ("--set", x))]
    prep = s.run([sys.executable, "-m", "train.prepare", *base, "--out", str(store), "--quiet"])
    if prep["rc"] != 0:
        return {"error": "prepare failed", **prep}
    steps, every = (8, 4) if s.smoke else (40, 20)
    sets = [
        "data.source=store",
        f"data.store={store}",
        *data,
        f"train.steps={steps}",
        f"train.eval_every={every}",
        "train.eval_batches=2",
        "train.log_every=1",
        "checkpoint.every=0",
    ]
    if s.smoke:
        sets += ["model.name=tiny", "model.overrides={}", "train.batch_size=16", "train.micro_batch_size=8"]
        sets += ["train.seq_len=32", "optimizer.r_base=16", "optimizer.block_size=16"]
    waits = s.work / f"loop_waits-{model}.json"
    cmd = [sys.executable, "benchmarks/loop_waits.py", "--out", str(waits), "--skip", "3", "--"]
    cmd += ["--config", config, "--run-dir", str(run_dir)]
    train = s.run(cmd + [a for x in sets for a in ("--set", x)] + ["--quiet"])
    if train["rc"] != 0:
        return {"error": "python -m train failed", **train}
    run = RunDir(run_dir)
    model_file = json.loads(run.model_file.read_text())
    rows = run.rows(None)
    result = {"train": train, "loop": loop_step_times(rows, skip=3), "vocab_size": model_file["vocab_size"]}
    host = _json(waits)
    if host is not None:
        result["host_ms"] = {k: v for k, v in host.items() if k.endswith("_ms") or k.endswith("iterations")}
        shutil.copy(waits, s.out / waits.name)
    out = s.work / f"train_step_same_model-{model}.json"
    try:
        args = same_step_args(run)
    except ValueError as e:
        return {**result, "error": f"no benchmark of the same step: {e}"}
    cmd = [sys.executable, "benchmarks/train_step.py", *args]
    cmd += ["--only", "moara_full", "--steps", "10", "--warmup", "3", "--out", str(out)]
    bench = s.run(cmd)
    data = _json(out)
    if data is None:
        return {**result, "error": "train_step.py failed", "bench": bench}
    ms = data["ms"]["moara_full"]
    loop = result["loop"]
    result |= {"benchmark_ms": ms, "benchmark_command": shlex.join(cmd[1:])}
    result |= {f"{k[:-2]}_over_benchmark": v * 1e3 / ms for k, v in loop.items() if k.endswith("_s") and v}
    return result


def same_step_args(run: RunDir) -> list[str]:
    """train_step.py's arguments for the step a run took: its model (preset, vocabulary, remat,
    layer layout, attention, loss chunks), batch, micro-batch, sequence length, r_base and block
    size. A ValueError for a run whose parameters or compute are not bf16 (train_step.py's)."""
    model, config = json.loads(run.model_file.read_text()), run.config()
    if (model["param_dtype"], model["dtype"]) != ("bfloat16", "bfloat16"):
        raise ValueError(
            f"the run's parameters and compute are {model['param_dtype']} and {model['dtype']}; "
            "train_step.py times bf16 steps only"
        )
    t, o = config["train"], config["optimizer"]
    sh = dict(model=config["model"]["name"], batch=t["batch_size"], seq=t["seq_len"])
    args = step_args(sh | {"micro": t["micro_batch_size"] or t["batch_size"]})
    args += ["--vocab-size", str(model["vocab_size"]), "--r-base", str(o["r_base"])]
    layers = "scanned" if model["scan_layers"] else "unrolled"
    args += ["--block-size", str(o["block_size"]), "--remat", model["remat"], "--layers", layers]
    return args + ["--attention", model["attention_impl"] or "auto", "--loss-chunk", str(model["loss_chunk"])]


def loop_step_times(rows: list[dict], skip: int) -> dict:
    """Step times of a run's metrics rows (``log_every`` 1) after the first ``skip`` steps: the
    median (the steady step), the mean of the steps that neither evaluate, nor follow or precede an
    evaluation, and the wall time per step with everything (logging, evaluation) in it. The step
    before an evaluation is left out because its read may also wait for the evaluating step (read
    at once, so then logged at a few milliseconds: seen on an H100)."""
    steps = {r["step"]: r for r in rows if "step_time_s" in r}
    evals = {r["step"] for r in rows if "eval_loss" in r}
    kept = [steps[k] for k in sorted(steps) if k > skip]
    if len(kept) < 2:
        return {}
    near = evals | {k - 1 for k in evals} | {k + 1 for k in evals}
    plain = [r["step_time_s"] for r in kept if r["step"] not in near]
    first, last = kept[0], kept[-1]
    return {
        "median_step_s": statistics.median(r["step_time_s"] for r in kept),
        "mean_plain_step_s": statistics.fmean(plain) if plain else None,
        "wall_per_step_s": (last["wall_s"] - first["wall_s"]) / (last["step"] - first["step"]),
        "steps": len(kept),
        "evaluations": len(evals),
    }


PHASES = {
    "env": (lambda s: 20.0, phase_env),
    # 2026-11-28, H100: 7 of the 9 tests in 180 s (GPU_TESTS_S)
    "gpu_tests": (lambda s: 240.0, phase_gpu_tests),
    "vs_torch_350m": (lambda s: 150.0, lambda s: phase_vs_torch(s, "llama2-350m")),
    "vs_torch_1b": (lambda s: 150.0, lambda s: phase_vs_torch(s, "llama2-1b")),
    "variants_model": (lambda s: 60.0, lambda s: phase_variants(s, "model")),
    "variants_flags": (lambda s: 60.0, lambda s: phase_variants(s, "flags")),
    "train_loop": (lambda s: 60.0 if s.smoke else 170.0, lambda s: phase_train_loop(s, "llama2-350m")),
    "train_loop_60m": (lambda s: 60.0 if s.smoke else 100.0, lambda s: phase_train_loop(s, "llama2-60m")),
    "full_tests": (lambda s: 240.0, phase_full_tests),
}


# train_step.py options that say what both sides run (the peers take them from the session's
# shapes): --jax-args may not set them for this project's runs alone.
SHARED_WORKLOAD = (
    "--model",
    "--batch",
    "--seq-len",
    "--vocab-size",
    "--r-base",
    "--block-size",
    "--steps",
    "--warmup",
    "--refresh-steps",
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-session-out")
    parser.add_argument("--budget-s", type=float, default=560.0, help="stop starting work after this")
    parser.add_argument("--phases", nargs="+", default=["env", "vs_torch_350m", "gpu_tests"])
    parser.add_argument("--variant-steps", type=int, default=5)
    parser.add_argument(
        "--jax-args",
        default="",
        help="train_step.py options over the paper config's for this project's runs (vs_torch, variants), "
        "e.g. '--remat dots --micro-batch 64'",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU): a check of this script")
    args = parser.parse_args(argv)
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phase(s) {unknown}; known: {', '.join(PHASES)}")
    jax_args = shlex.split(args.jax_args)
    # (argparse takes an option's unambiguous prefix too: --seq is --seq-len)
    names = [a.split("=")[0] for a in jax_args if a.startswith("--")]
    shared = [n for n in names if any(s.startswith(n) for s in SHARED_WORKLOAD)]
    if shared:
        parser.error(
            f"--jax-args: {' '.join(shared)} would change the workload of this project's runs alone "
            f"({', '.join(SHARED_WORKLOAD)} are both sides'); give how the step runs (remat, layers, "
            "attention, micro-batch, loss chunks, XLA flag sets)"
        )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        global GROUPS
        GROUPS = Groups(ROOT / CHILDREN_FILE)
        for what in GROUPS.end_leftovers():
            print(f"ended {what}, left running by an earlier call that did not end", flush=True)
    s = Session(out, args.budget_s, args.smoke, args.variant_steps, jax_args)
    s.results["jax_args"] = s.jax_args
    # Off --smoke the phases time a GPU: env first, which says whether JAX has one.
    phases = args.phases if args.smoke else ["env", *(p for p in args.phases if p != "env")]
    try:
        return run_phases(s, phases)
    finally:
        s.close()


def run_phases(s: Session, phases: list[str]) -> int:
    """Runs the phases in order; 2 where ``env`` finds no GPU off ``--smoke`` (nothing more runs)."""
    for name in phases:
        need = PHASES[name][0](s)
        if s.left() < need:
            s.results["phases"][name] = {"skipped": f"{s.left():.0f}s left, needs at least {need:.0f}s"}
            print(f"\n=== {name}: skipped ({s.results['phases'][name]['skipped']})", flush=True)
            s.save()
            continue
        print(f"\n=== {name} ({s.left():.0f}s left)", flush=True)
        t0 = time.perf_counter()
        try:
            s.results["phases"][name] = PHASES[name][1](s)
        except Exception as e:  # a phase's fault is recorded; the phases after it still run
            traceback.print_exc()
            s.results["phases"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        s.results["phases"][name]["phase_s"] = time.perf_counter() - t0
        s.save()
        backend = s.results["phases"][name].get("backend")
        if name == "env" and not s.smoke and backend not in (None, "gpu"):  # (None: env failed, said above)
            print(
                f"error: JAX's backend here is {backend}, not a GPU: the phases time a GPU (--smoke "
                "checks this script on a CPU)",
                file=sys.stderr,
                flush=True,
            )
            return 2
    s.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    s.save()
    print(json.dumps({k: v for k, v in s.results.items() if k != "phases"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
