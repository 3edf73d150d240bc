"""``benchmarks/evidence.py``: the plan of issue 21's runs, the duration estimates, and the runner end
to end on CPU (a tiny setting, a 60-second budget), its archive unpacked into a results folder,
the next runs' state and estimates from there, and the reports written from it."""

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import types

import pytest
import yaml
from helpers import alive

from train import sweep
from train.rundir import RunDir
from train.sources import builtin_documents

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _evidence_plan as plan_module  # noqa: E402
import _evidence_runner as runner_module  # noqa: E402
import evidence  # noqa: E402

WIKI = ROOT / "configs" / "experiments" / "wiki60m"


def test_plan_orders_the_runs_as_the_issue_does_and_every_config_resolves():
    plan = plan_module.load_plan(WIKI / "plan.yaml")
    names = [p.name for p in plan.runs]
    four = ["galore", "full", "rank", "decomp"]
    assert names == [
        "wiki60m/profile-seed0",
        *[f"wiki60m/{c}-seed0" for c in four],
        *[f"wiki60m/{c}-seed{s}" for s in (1, 2) for c in four],
        *[f"wiki60m-lr/{c}-{lr}-seed0" for c in ("galore", "full") for lr in ("lr0.005", "lr0.02")],
        "wiki60m-moments/galore-f32-seed0",
        "wiki60m-moments/full-f32-seed0",
        "wiki60m-fira/galore-fira-seed0",
        "wiki60m-fira/full-fira-seed0",
        "wiki60m-osd/galore-osd-seed0",
        "wiki60m-osd/full-osd-seed0",
    ]
    configs = {p.name: plan_module.run_config(plan, p) for p in plan.runs}
    for config in configs.values():
        assert config["model"]["name"] == "llama2-60m" and config["train"]["seq_len"] == 256
        assert (config["train"]["steps"], config["train"]["batch_size"]) == (2000, 128)
        o = config["optimizer"]
        assert (o["r_base"], o["block_size"], o["update_proj_gap"], o["svd"], o["scale"]) == (
            128,
            64,
            200,
            "eigh",
            0.25,
        )
        assert config["data"]["validation_paths"] == [".data/wikipedia_en_2015/validation-00000.jsonl.gz"]
    profile = configs["wiki60m/profile-seed0"]
    assert profile["mode"] == "profile" and profile["optimizer"]["name"] == "galore"
    assert plan_module.steps_of(profile) == 400
    galore, rank = configs["wiki60m/galore-seed1"]["optimizer"], configs["wiki60m/rank-seed2"]["optimizer"]
    assert (galore["name"], galore["rank_allocation"], galore["decompose"]) == ("galore", "uniform", False)
    assert (rank["name"], rank["rank_allocation"], rank["decompose"]) == ("moara", "default", False)
    assert configs["wiki60m-osd/full-osd-seed0"]["optimizer"]["host"] == "osd"
    # The checks: the lr alone changed; their final ppl only, so they need no run alone.
    for name, config in configs.items():
        lr = {"lr0.005": 0.005, "lr0.02": 0.02}.get(name.split("-")[-2], 0.01)
        assert config["train"]["lr"] == lr
    assert [p.run.point for p in plan.runs if not p.timed] == [
        "galore-lr0.005",
        "galore-lr0.02",
        "full-lr0.005",
        "full-lr0.02",
        "galore-f32",
        "full-f32",
    ]
    # The moments' check: float32 moments alone changed (the base's follow the bf16 parameters).
    for name, config in configs.items():
        assert config["optimizer"]["mu_dtype"] == ("float32" if "-f32-" in name else None)
        assert config["train"]["param_dtype"] == "bfloat16"
    reports = ["wiki60m", "wiki60m-fira", "wiki60m-osd", "wiki60m-lr", "wiki60m-moments"]
    assert [r["experiment"] for r in plan.reports] == reports


def test_the_committed_profile_orders_the_modules_as_the_paper_once_the_first_basis_is_left_out():
    """The Llama 2 60M profile (T = 200, 400 steps): over all its recordings q and k are the least
    aligned and down second best, an order half of which the first basis (from step 1's gradient)
    makes; over the recordings after it, down is the lowest and the order is the paper's Table 5
    but for q and k, and the allocation the paper's default. ``profile.md`` says both."""
    text = evidence.profile_report(ROOT / "benchmarks" / "results" / "wiki60m" / "profile-seed0")
    assert (
        "over all 20 recordings (steps 20 to 400) and over the 10 after the first basis (steps 220 to 400)"
        in text
    )
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r[1] for r in rows] == ["o", "down", "v", "up", "gate", "q", "k"]
    assert [r[3] for r in rows] == ["v", "o", "up", "gate", "k", "q", "down"]
    assert "after the first basis (steps 220 to 400): lowest `down` (the paper: `down`)" in text
    assert "Spearman rank correlation 0.393." in text and "Spearman rank correlation 0.964." in text
    assert "receivers ['gate']" in text and "receivers ['down']" in text
    assert "python -m train.profile benchmarks/results/wiki60m/profile-seed0 --from-step 200" in text
    assert (ROOT / "benchmarks" / "results" / "wiki60m" / "profile.md").read_text() == text


def test_a_profile_of_more_module_types_than_the_papers_seven_is_reported_whole(tmp_path):
    """A model with another number of module types (MLA's eight, say) gets a row for each; the
    paper's columns end at its seven."""
    run = tmp_path / "profile-seed0"
    shutil.copytree(ROOT / "benchmarks" / "results" / "wiki60m" / "profile-seed0", run)
    alignment = json.loads((run / "alignment.json").read_text())
    for field in ("trajectories", "ema"):
        alignment[field]["extra"] = [v / 2 for v in alignment[field]["v"]]
    (run / "alignment.json").write_text(json.dumps(alignment))
    text = evidence.profile_report(run)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r[1] for r in rows] == ["o", "down", "v", "up", "gate", "q", "k", "extra"]
    assert rows[-1][5:] == ["", " |"] and rows[-2][5] == "down"
    assert "receivers ['extra']" in text


def test_estimates_scale_the_fixed_part_and_the_steps_of_finished_runs():
    kind = ("train", "galore", "galore", False, "uniform")
    other = ("profile", "galore", "galore", False, "uniform")
    # 100 s in all, of which 40 s fixed and 200 steps of 0.3 s.
    m = plan_module.Measured("a", kind, 200, 100.0, 0.3, 1, "cpu")
    p = plan_module.Measured("p", other, 100, 50.0, 0.4, 1, "cpu")
    assert plan_module.estimate(kind, 400, 1, [m, p], 999, 1.0) == (
        pytest.approx(160.0),
        "1 finished run(s) of the same kind",
    )
    # Only another kind: its fixed part (10 s) plus 400 x 0.4 s x 1.3, times the safety factor.
    est, basis = plan_module.estimate(kind, 400, 1, [p], 999, 1.5)
    assert est == pytest.approx((10 + 400 * 0.4 * plan_module.OTHER_KIND) * 1.5) and "other kinds" in basis
    # Two runs sharing the device: no gain from sharing is assumed (the fixed part is kept).
    assert plan_module.estimate(kind, 400, 2, [m], 999, 1.0)[0] == pytest.approx(40 + 400 * 0.3 * 2)
    assert plan_module.estimate(kind, 400, 2, [], 300, 1.0)[0] == 600
    # A run measured while it shared the device half its time with one other (concurrency 4/3).
    shared = plan_module.Measured("s", kind, 200, 100.0, 0.3, 4 / 3, "cpu")
    assert plan_module.estimate(kind, 400, 2, [shared], 999, 1.0)[0] == pytest.approx(40 + 400 * 0.3 * 1.5)


def test_estimates_take_the_gain_from_sharing_the_device_measured_so_far():
    kind = ("train", "galore", "galore", False, "uniform")
    alone = plan_module.Measured("a", kind, 200, 100.0, 0.3, 1, "gpu")  # 40 s fixed, 200 x 0.3 s
    paired = plan_module.Measured("b", kind, 200, 160.0, 0.6, 2, "gpu")  # 40 s fixed, 200 x 0.6 s
    costs = {1: 0.3, 2: 0.24}  # device-seconds per step: two at a time do 1.25x the work
    # From a run alone to two at a time: 2 x 0.24 / 0.3 = 1.6 times its step, not 2.
    assert plan_module.share_factor(1, 2, costs) == pytest.approx(1.6)
    assert plan_module.estimate(kind, 400, 2, [alone], 999, 1.0, costs)[0] == pytest.approx(
        40 + 400 * 0.3 * 1.6
    )
    # From a run two at a time to one alone: 0.3 / (2 x 0.24) of its step and of its fixed part,
    # which shared the device as well.
    assert plan_module.estimate(kind, 400, 1, [paired], 999, 1.0, costs)[0] == pytest.approx(
        40 * 0.625 + 400 * 0.375
    )
    # Three at a time, not measured: two's cost 1.1 times over, 3 x 0.24 x 1.1 / 0.3 = 2.64.
    assert plan_module.share_factor(1, 3, costs) == pytest.approx(3 * 0.24 * plan_module.UNMEASURED / 0.3)
    # ... but never more than no gain at all (from a run two at a time: 3 / 2).
    assert plan_module.share_factor(2, 3, {1: 0.3, 2: 0.29}) == pytest.approx(1.5)
    # Measured at three: its own cost, whatever the level below it gave.
    assert plan_module.share_factor(2, 3, {1: 0.3, 2: 0.24, 3: 0.2}) == pytest.approx(3 * 0.2 / (2 * 0.24))
    # A run that met 1.8 runs (level 2): its own device-seconds per step are its step over 1.8.
    three = {1: 0.3, 2: 0.24, 3: 0.2}
    assert plan_module.share_factor(1.8, 3, three) == pytest.approx(3 * 0.2 / (1.8 * 0.24))
    # No gain assumed where the costs are unknown: none measured, the run's own level not measured
    # (a run that ran half its time alone), or no level at or below the one asked for.
    assert plan_module.share_factor(1, 2, {}) == 2.0
    assert plan_module.share_factor(4 / 3, 2, costs) == pytest.approx(1.5)
    assert plan_module.share_factor(2, 1, {2: 0.24}) == 1.0
    assert plan_module.estimate(kind, 400, 2, [alone], 999, 1.0)[0] == pytest.approx(40 + 400 * 0.3 * 2)


def test_estimates_take_the_largest_fixed_part_of_the_kind_and_leave_profiles_out_of_training_runs():
    """A run whose program an earlier run compiled starts from XLA's cache: the fixed part is the
    largest of the kind's runs at any level (one measured among more runs sharing the device
    scaled down as its steps are), the steps from those of the level asked for. A training run
    of a kind not measured yet is estimated from training runs, not from a profile's start-up.
    The allocation counts only as uniform or moved."""
    kind = ("train", "moara", "galore", True, "allocated")
    cached = plan_module.Measured("cached", kind, 200, 70.0, 0.3, 2, "gpu")  # 10 s fixed, two at a time
    cold = plan_module.Measured("cold", kind, 200, 130.0, 0.4, 3, "gpu")  # 50 s fixed, three at a time
    costs = {1: 0.3, 2: 0.15, 3: 0.12}
    to_two = plan_module.share_factor(3, 2, costs)  # 2 x 0.15 / (3 x 0.12)
    est, basis = plan_module.estimate(kind, 400, 2, [cached, cold], 999, 1.0, costs)
    assert est == pytest.approx(50 * to_two + 400 * 0.3) and basis.startswith("1 finished run(s)")
    # Alone: the cold run's fixed part scaled down; its steps too, the larger of the two guesses.
    alone = [plan_module.share_factor(m.concurrency, 1, costs) for m in (cached, cold)]
    assert plan_module.estimate(kind, 400, 1, [cached, cold], 999, 1.0, costs)[0] == pytest.approx(
        50 * alone[1] + max(400 * 0.3 * alone[0], 400 * 0.4 * alone[1])
    )
    profile = plan_module.Measured("p", ("profile", *kind[1:]), 100, 90.0, 0.2, 1, "gpu")  # 70 s fixed
    other = ("train", "moara", "fira", True, "uniform")
    est, basis = plan_module.estimate(other, 400, 2, [cached, profile], 999, 1.0, costs)
    assert est == pytest.approx(10 + 400 * 0.3 * plan_module.OTHER_KIND) and "other kinds" in basis
    config = {"mode": "train", "optimizer": {"name": "moara", "host": "galore", "decompose": True}}
    kinds = {
        allocation: plan_module.kind_of(
            config | {"optimizer": config["optimizer"] | {"rank_allocation": allocation}}
        )
        for allocation in ("uniform", "default", "runs/profile/allocation.json")
    }
    assert kinds["default"] == kinds["runs/profile/allocation.json"] == kind != kinds["uniform"]


def test_the_safety_factor_applies_to_the_plans_estimate_too():
    kind = ("train", "galore", "galore", False, "uniform")
    est, basis = plan_module.estimate(kind, 400, 2, [], 300, 1.5)
    assert est == pytest.approx(300 * 2 * 1.5) and "x 1.5" in basis


def _probe_wheel(directory: pathlib.Path, dist: str, version: str = "0.1") -> pathlib.Path:
    """A pure-Python wheel of ``dist`` that requires a package no index has."""
    import zipfile

    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": "VALUE = 7\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        "Requires-Dist: not-on-any-index\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/RECORD": "",
    }
    directory.mkdir(exist_ok=True)
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_carried_wheels_install_offline_into_the_site_and_installed_ones_are_left(tmp_path):
    """The bare GPU machine's step: each carried wheel whose distribution is not installed goes
    into the site folder, without the package index (``--no-index``) or its requirements; one
    whose distribution is installed is left (this one would not install: it is no wheel)."""
    wheels = tmp_path / "whl"
    dist = "moara_carried_probe"
    _probe_wheel(wheels, dist)
    (wheels / "numpy-0.0-py3-none-any.whl").write_bytes(b"not a wheel")
    said = []
    assert runner_module.install_wheels(wheels, tmp_path / "site", said.append)
    assert said == [f"wheels: installed {dist} into {tmp_path / 'site'}"]
    assert (tmp_path / "site" / dist / "__init__.py").read_text() == "VALUE = 7\n"
    assert not (tmp_path / "site" / "numpy").exists()
    (wheels / f"{dist}-0.1-py3-none-any.whl").unlink()
    assert not runner_module.install_wheels(wheels, tmp_path / "site2", said.append)
    assert said[-1] == f"wheels: nothing to install from {wheels}"


@pytest.mark.parametrize("installed, replaced", [("5.27.9", True), ("5.28.3", False), ("6.33.0rc1", False)])
def test_a_carried_wheel_replaces_an_installed_one_older_than_its_floor(
    installed, replaced, tmp_path, monkeypatch
):
    """protobuf on the GPU machine: grain's generated code refuses a runtime older than 5.28.3,
    so the carried protobuf goes into the site (ahead of the machine's in the runs' path) only
    when the installed one is older; a newer one is left, as the machine's packages need it."""
    wheels = tmp_path / "whl"
    _probe_wheel(wheels, "moara_floor_probe", "5.29.6")
    monkeypatch.setattr(runner_module, "FLOORS", {"moara_floor_probe": "5.28.3"})
    real = runner_module.importlib.metadata.version
    monkeypatch.setattr(
        runner_module.importlib.metadata,
        "version",
        lambda d: installed if d == "moara_floor_probe" else real(d),
    )
    said = []
    assert runner_module.install_wheels(wheels, tmp_path / "site", said.append) == replaced
    assert (tmp_path / "site" / "moara_floor_probe").is_dir() == replaced
    assert ("older than the 5.28.3 grain needs" in said[0]) == replaced, said


def test_unpack_refuses_members_outside_the_results(tmp_path):
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        (tmp_path / "x").write_text("x")
        tar.add(tmp_path / "x", arcname="benchmarks/results/../../evil.txt")
    plan = plan_module.load_plan(WIKI / "plan.yaml")
    with pytest.raises(evidence.UserError, match="unexpected member"):
        evidence.unpack(archive, tmp_path, plan)
    assert not (tmp_path.parent / "evil.txt").exists()


# ---------------------------------------------------------------------------------- end to end

TINY_BASE = """\
mode: train
model: {name: tiny, overrides: {max_position_embeddings: 64}}
optimizer: {name: moara, r_base: 8, block_size: 8, update_proj_gap: 2, svd: eigh}
train: {steps: 4, batch_size: 4, seq_len: 16, eval_every: 2, eval_batches: 1, log_every: 1,
        param_dtype: float32, dtype: float32}
data: {source: files, paths: [.data/train.jsonl], validation_paths: [.data/validation.jsonl],
       tokenizer: bytes}
checkpoint: {every: 0, keep: 1}
profile: {steps: 4, every: 2}
"""

TINY_PLAN = """\
base: base.yaml
results: results
estimate_s: {train: 30, profile: 30}
runs:
  - {experiment: tiny, axes: [modes/profile], seeds: [0]}
  - {experiment: tiny, axes: [conditions/full], seeds: [0]}
  - {experiment: tiny, axes: ["conditions/galore,rank,decomp"], seeds: [0]}
  - {experiment: tiny, axes: [long/long], seeds: [0]}  # never fits: its steps x those measured
reports:
  - {experiment: tiny, axes: ["conditions/galore,rank,decomp,full"], seeds: [0]}
"""


def tiny_setting(tmp_path: pathlib.Path) -> pathlib.Path:
    """Configs (the repository's condition and profile layers over a tiny base) and a plan."""
    configs = tmp_path / "configs"
    for folder, names, source in (
        ("conditions", ("galore", "rank", "decomp", "full"), ROOT / "configs" / "paper" / "conditions"),
        ("modes", ("profile",), WIKI / "modes"),
    ):
        (configs / folder).mkdir(parents=True)
        for name in names:
            (configs / folder / f"{name}.yaml").write_text(f"base: {source / name}.yaml\n")
    (configs / "long").mkdir()
    (configs / "long" / "long.yaml").write_text("train:\n  steps: 1000000\n")
    (configs / "base.yaml").write_text(TINY_BASE)
    (configs / "plan.yaml").write_text(TINY_PLAN)
    return configs / "plan.yaml"


def machine(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """A checkout's root: the data files the tiny base names."""
    root = tmp_path / name
    (root / ".data").mkdir(parents=True)
    docs = [d for d in builtin_documents() if len(d) > 200]
    for split, part in (("train", docs[:40]), ("validation", docs[40:44])):
        lines = "".join(json.dumps({"text": t[:2000]}) + "\n" for t in part)
        (root / ".data" / f"{split}.jsonl").write_text(lines)
    return root


class FakeClock:
    """``runner_module.time`` for the runner's loop: seconds pass only as it sleeps. The runs alive
    share a device that does ``rate(n)`` runs' worth of work per second with ``n`` of them alive
    (by default ``n``: each goes as fast as alone)."""

    def __init__(self, rate=lambda n: n):
        self.now, self.rate, self.runs = 0.0, rate, []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.8e9 + self.now

    def sleep(self, seconds: float) -> None:
        alive = [r for r in self.runs if r.alive()]
        for r in alive:
            r.done += seconds * self.rate(len(alive)) / len(alive)
        self.now += seconds


class FakeRun:
    """A ``python -m train`` process that ends once it has done ``seconds`` of work alone (as the
    clock's device gives it): completed (a summary, a config and metrics of its time per step, as
    ``measure`` reads them) or crashed (exit 1, nothing written). SIGTERM ends it at once,
    unfinished, with the two steps it logged. ``fraction``: the device memory its environment lets
    it take (None: unset)."""

    def __init__(
        self, clock: FakeClock, run_dir: pathlib.Path, seconds: float, completes: bool, fraction=None
    ):
        self.clock, self.run_dir, self.completes, self.fraction = clock, run_dir, completes, fraction
        self.work, self.done, self.start = seconds, 0.0, clock.now
        self.returncode = None
        self.signals = []
        self.pid = -1  # no process: the runner's Groups record nothing
        clock.runs.append(self)

    def alive(self) -> bool:
        return self.returncode is None and not self.signals

    def poll(self):
        if self.returncode is None and self.signals:
            self.returncode = -signal.SIGTERM
            rows = [{"step": s, "loss": 1.0, "wall_s": float(s)} for s in (1, 2)]
            (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        elif self.returncode is None and self.done >= self.work - 1e-9:
            self.returncode = 0 if self.completes else 1
            if self.completes:
                optimizer = {
                    "name": "moara",
                    "host": "none",
                    "decompose": False,
                    "rank_allocation": "uniform",
                }
                (self.run_dir / "config.yaml").write_text(
                    json.dumps({"mode": "train", "optimizer": optimizer})
                )
                took = self.clock.now - self.start
                rows = [{"step": 0, "loss": 1.0, "wall_s": 0.0}, {"step": 4, "loss": 0.5, "wall_s": took}]
                (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                (self.run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 4}))
        return self.returncode

    def send_signal(self, sig) -> None:
        self.signals.append(sig)

    def wait(self, timeout=None):
        while self.poll() is None:
            self.clock.sleep(0.5)
        return self.returncode

    def kill(self) -> None:
        self.returncode = -signal.SIGKILL


def fake_runner(monkeypatch, plan_path, root, script, rate=lambda n: n, **options):
    """A Runner of the tiny plan on a fake clock whose runs are ``FakeRun``s: ``script`` gives each
    run's ``(seconds, completes)`` by name, ``rate`` the device's speed with n runs alive
    (``FakeClock``). Returns it, the processes it started by name, and its log lines."""
    clock, procs, lines = FakeClock(rate), {}, []

    def popen(cmd, **kwargs):
        assert kwargs["start_new_session"]  # a group of its own: a kill reaches its workers too
        run_dir = pathlib.Path(cmd[cmd.index("--run-dir") + 1])
        fraction = kwargs["env"].get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        fraction = None if fraction is None else float(fraction)
        procs[run_dir.name] = FakeRun(clock, run_dir, *script[run_dir.name], fraction=fraction)
        return procs[run_dir.name]

    monkeypatch.setattr(runner_module, "time", clock)
    fake = types.SimpleNamespace(Popen=popen, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(runner_module, "subprocess", fake)
    monkeypatch.setattr(runner_module, "kill_group", lambda proc: proc.kill())
    args = {"budget_s": 1000, "out": str(root / "out"), "concurrent": 1, "max_concurrent": 4}
    args |= {"max_runs": None, "estimate_s": None, "safety": 1.0, "no_timing_runs": True}
    args = types.SimpleNamespace(**{**args, **options})
    (root / "out").mkdir(parents=True, exist_ok=True)
    runner = runner_module.Runner(args, plan_module.load_plan(plan_path), root, lines.append)
    runner.site, runner.xla_cache, runner.device, runner.versions = None, None, "cpu", {}
    return runner, procs, lines


def runner_record(root: pathlib.Path, name: str) -> dict:
    return json.loads(
        (root / plan_module.SCRATCH / "runs" / "tiny" / name / plan_module.RUNNER_FILE).read_text()
    )


def test_each_run_records_the_concurrency_it_met_not_the_setting(tmp_path, monkeypatch):
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    # --concurrent 2: profile [0, 2] and full [0, 3] together, galore [2, 4] half of its time alone.
    script = {"profile-seed0": (2, True), "full-seed0": (3, True), "galore-seed0": (2, True)}
    runner, procs, _ = fake_runner(monkeypatch, plan_path, root, script, concurrent=2, max_runs=3)
    runner.loop()
    runner.table()  # prints the recorded concurrency
    assert sorted(procs) == sorted(script)
    met = {name: runner_record(root, name)["concurrency"] for name in script}
    assert met == {"profile-seed0": 2.0, "full-seed0": 2.0, "galore-seed0": pytest.approx(4 / 3, abs=1e-3)}
    galore = plan_module.measure(root / plan_module.SCRATCH / "runs" / "tiny" / "galore-seed0")
    assert galore.concurrency == pytest.approx(4 / 3, abs=1e-3)  # what the estimates scale from
    # The next call, under --concurrent 2 too, runs one run: alone.
    script = {"rank-seed0": (2, True)}
    runner, procs, _ = fake_runner(monkeypatch, plan_path, root, script, concurrent=2, max_runs=1)
    runner.loop()
    assert list(procs) == ["rank-seed0"] and runner_record(root, "rank-seed0")["concurrency"] == 1.0


def left_by_a_driver_gone(path: pathlib.Path, proc: subprocess.Popen, what: str) -> None:
    """Records ``proc``'s group in ``path`` as a driver that has ended would have left it."""
    from _processes import Groups

    Groups(path).add(proc, what)
    groups = json.loads(path.read_text())
    groups[str(proc.pid)]["driver_start"] -= 1  # its driver's id is another process's, or none's
    path.write_text(json.dumps(groups))


def test_groups_end_what_a_driver_that_ended_left_running_and_nothing_else(tmp_path):
    """``Groups`` (the runner's and gpu_session's record of their children's process groups): the
    next call on the machine ends the groups whose leader still runs and whose driver does not;
    it leaves a process that took a recorded id since (another start time) and the children of a
    driver still running beside it."""
    from _processes import Groups, start_time

    path = tmp_path / "children.json"
    left, other, mine = (subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(3))
    try:
        left_by_a_driver_gone(path, left, "tiny/full-seed0")
        left_by_a_driver_gone(path, other, "tiny/galore-seed0")
        Groups(path).add(mine, "tiny/rank-seed0")  # this process's: its driver runs
        groups = json.loads(path.read_text())
        groups[str(other.pid)]["start"] -= 1  # as if its id had been another process's
        path.write_text(json.dumps(groups))
        assert Groups(path).end_leftovers() == [f"tiny/full-seed0 (process group {left.pid})"]
        assert left.poll() == -signal.SIGKILL  # ended before end_leftovers returned
        assert other.poll() is None and mine.poll() is None
        assert list(json.loads(path.read_text())) == [str(mine.pid)]
        Groups(path).remove(mine)  # a child that ended is taken off the record
        assert json.loads(path.read_text()) == {} and start_time(-1) is None
    finally:
        for proc in (left, other, mine):
            proc.kill()
            proc.wait()


def test_auto_levels_go_up_while_sharing_pays_and_keep_the_fastest():
    one, two, three, four = 0.25, 0.25 / 1.6, 0.25 / 1.8, 0.25 / 1.85  # device-seconds per step
    assert plan_module.choose_level({}, 4)[0] == 1
    assert plan_module.choose_level({1: one}, 4)[0] == 2
    assert plan_module.choose_level({1: one, 2: two}, 4)[0] == 3  # 1.6x: the next level is measured
    assert plan_module.choose_level({1: one, 2: two, 3: three}, 4)[0] == 4  # 3 pays 1.125x over 2
    level, why = plan_module.choose_level({1: one, 2: two, 3: three, 4: four}, 4)  # 4: 1.03x over 3
    assert level == 3 and "3 at a time 0.1389 s (1.80x), 4 at a time 0.1351 s (1.85x)" in why
    assert plan_module.choose_level({1: one, 2: two, 3: two * 0.95}, 4)[0] == 2  # 3 did not pay
    assert plan_module.choose_level({1: one, 2: one * 0.95}, 4)[0] == 1  # sharing did not pay
    assert plan_module.choose_level({2: two}, 4)[0] == 1  # one at a time measured first
    assert plan_module.choose_level({1: one, 2: two}, 2)[0] == 2  # --max-concurrent 2
    assert plan_module.choose_level({1: one, 2: two, 3: three}, 3)[0] == 3
    # What a run met: a level, or none for one that ran half its time alone.
    assert [plan_module.level_of(c) for c in (1.0, 1.9, 4 / 3, 3.8)] == [1, 2, None, 4]
    kind = ("train", "galore", "galore", False, "uniform")
    runs = [
        plan_module.Measured("a", kind, 100, 30.0, 0.25, 1.0, "gpu"),
        plan_module.Measured("b", kind, 100, 40.0, 0.3, 2.0, "gpu"),
        plan_module.Measured("c", kind, 100, 45.0, 0.34, 2.0, "gpu"),
        plan_module.Measured("d", kind, 100, 30.0, 0.3, 4 / 3, "gpu"),  # mixed: left out
        plan_module.Measured("p", ("profile", *kind[1:]), 100, 30.0, 0.1, 1.0, "gpu"),  # no training run
    ]
    assert plan_module.sharing_costs(runs) == {1: 0.25, 2: pytest.approx(0.16)}
    # An estimate at 2 at a time takes the runs measured 2 at a time (none: no gain assumed).
    assert plan_module.estimate(kind, 100, 2, runs[:3], 999, 1.0) == (
        pytest.approx(11 + 34),  # c: its fixed part and 100 steps
        "2 finished run(s) of the same kind, measured 2 at a time",
    )
    assert plan_module.estimate(kind, 100, 2, runs[:1], 999, 1.0)[0] == pytest.approx(5 + 50)


SEEDS_PLAN = """\
base: base.yaml
results: results
estimate_s: {train: 30, profile: 30}
runs:
  - {experiment: tiny, axes: ["conditions/galore,rank,decomp,full"], seeds: [0, 1, 2]}
"""


def test_auto_measures_whether_sharing_the_device_pays_and_keeps_the_fastest(tmp_path, monkeypatch):
    """A device that does 1.6 runs' work per second with two runs on it, 1.8 with three and 1.85
    with four: the runner measures one run alone, then two, three and four, and goes back to
    three. A run never starts into memory other runs hold."""
    plan_path = tiny_setting(tmp_path)
    plan_path.write_text(SEEDS_PLAN)
    root = tmp_path / "gpu"
    names = [f"{c}-seed{s}" for s in range(3) for c in ("galore", "rank", "decomp", "full")]
    rates = {1: 1.0, 2: 1.6, 3: 1.8, 4: 1.85}
    runner, procs, lines = fake_runner(
        monkeypatch, plan_path, root, {n: (10, True) for n in names}, rates.get, concurrent="auto"
    )
    starts = []
    start = runner.start

    def checked(planned, estimate_s, basis, level, alone=False):
        alive = [p for p in procs.values() if p.alive()]
        r = start(planned, estimate_s, basis, level, alone)
        fraction = procs[planned.run.name].fraction
        if fraction is None:  # JAX's default share of the device: alone only
            assert not alive
        else:
            assert sum(p.fraction for p in alive) + fraction <= plan_module.MEMORY + 1e-9
        starts.append((planned.run.name, level))
        return r

    runner.start = checked
    runner.loop()
    runner.table()
    assert [level["level"] for level in runner.session["levels"]] == [1, 2, 3, 4, 3]
    assert [level for _, level in starts] == [1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 3, 3]
    met = [runner_record(root, name)["concurrency"] for name, _ in starts]
    assert met == [1.0, 2.0, 2.0, 3.0, 3.0, 3.0, 4.0, 4.0, 4.0, 4.0, 2.0, 2.0]  # the last two: no third
    assert "sharing the device: 2 at a time, to measure it (1 at a time 2.5 s)" in lines
    assert any(line.startswith("sharing the device: 3 at a time, the fastest measured") for line in lines)
    (table,) = [line for line in lines if line.startswith("device-seconds per training step: ")]
    # (the 0.5 s polls)
    assert "2 at a time 1.562 s (1.60x), 3 at a time 1.417 s (1.76x), 4 at a time 1.375 s (1.82x)" in table


def test_the_first_run_of_each_grid_point_runs_alone_so_that_the_report_can_time_it(tmp_path, monkeypatch):
    """Runs that share the device count in no time figure of the report, so the first training run
    of a grid point none of whose runs had the device to itself runs alone (nothing starts beside
    it); the others share it."""
    plan_path = tiny_setting(tmp_path)
    plan_path.write_text(SEEDS_PLAN)
    root = tmp_path / "gpu"
    names = [f"{c}-seed{s}" for c in ("galore", "rank", "decomp", "full") for s in range(3)]
    runner, procs, lines = fake_runner(
        monkeypatch, plan_path, root, {n: (10, True) for n in names}, concurrent=2, no_timing_runs=False
    )
    runner.loop()
    assert list(procs) == names  # in the plan's order
    met = {name: runner_record(root, name)["concurrency"] for name in names}
    assert met == {name: 1.0 if name.endswith("seed0") else 2.0 for name in names}
    timing = "alone: the first of its grid point's runs to be timed"
    alone = [line.split(":")[0] for line in lines if line.endswith(timing)]
    assert alone == [f"tiny/{c}-seed0" for c in ("galore", "rank", "decomp", "full")]
    runs = sweep.expand(runner.plan.base, ["conditions/galore,rank,decomp,full"], [0, 1, 2])
    scratch = root / plan_module.SCRATCH / "runs" / "tiny"
    assert evidence.shared_device(scratch, runs) == {n for n in names if not n.endswith("seed0")}
    # A timed run committed from this device counts; in an experiment timed on this device, one
    # committed from another does not: its point is timed again here.
    planned = runner.plan.runs[1]
    assert planned.run.name == "galore-seed1" and not runner.needs_alone(planned)
    shutil.move(scratch / "galore-seed0", runner.where(runner.plan.runs[0], False))
    assert not runner.needs_alone(planned)
    rank = {p.run.name: p for p in runner.plan.runs if p.run.point == "rank"}
    committed = runner.where(rank["rank-seed0"], False)
    shutil.move(scratch / "rank-seed0", committed)
    assert not runner.needs_alone(rank["rank-seed1"])
    record = json.loads((committed / plan_module.RUNNER_FILE).read_text())
    (committed / plan_module.RUNNER_FILE).write_text(json.dumps({**record, "device": "another"}))
    assert runner.needs_alone(rank["rank-seed1"]) and runner.untimed_here(runner.plan.runs) == {}
    assert not runner.needs_alone(dataclasses.replace(planned, timed=False))  # a plan entry's timed: false
    runner.args.no_timing_runs = True
    assert not runner.needs_alone(planned)


def test_in_an_experiment_timed_on_another_device_no_run_waits_for_the_device_to_itself(
    tmp_path, monkeypatch
):
    """The report times an experiment on the device its timed runs had, so on a machine of
    another device the experiment's runs are no timing runs: they run in the plan's order and
    share the device, for their final ppl; the log says why, once."""
    plan_path = tiny_setting(tmp_path)
    plan_path.write_text(SEEDS_PLAN)
    root = tmp_path / "gpu"
    first = {"galore-seed0": (10, True)}
    runner, _, _ = fake_runner(
        monkeypatch, plan_path, root, first, concurrent=2, no_timing_runs=False, max_runs=1
    )
    runner.device = "another"
    runner.loop()
    record = runner_record(root, "galore-seed0")  # timed there: it had that device to itself
    assert (record["device"], record["shared"]) == ("another", False)
    shutil.move(
        root / plan_module.SCRATCH / "runs" / "tiny" / "galore-seed0",
        runner.where(runner.plan.runs[0], False),
    )
    names = [f"{c}-seed{s}" for c in ("galore", "rank", "decomp", "full") for s in range(3)][1:]
    runner, procs, lines = fake_runner(
        monkeypatch, plan_path, root, {n: (10, True) for n in names}, concurrent=2, no_timing_runs=False
    )
    assert runner.untimed_here(runner.pending()) == {"tiny": "another"}
    runner.loop()
    assert sorted(procs) == sorted(names)
    assert not any("alone: the first of its grid point's runs to be timed" in line for line in lines)
    said = [line for line in lines if "timed on" in line]
    assert said == [
        "tiny: its runs were timed on another, not on cpu: its runs here give final ppl, not times, "
        "and may share the device"
    ]
    met = [runner_record(root, name)["concurrency"] for name in procs]
    assert met == [2.0] * 10 + [1.0]  # two at a time; the last one is left alone
    # Committed, that last run had this device to itself: the report still times the experiment
    # on the device its baseline's runs had alone, and so does the runner.
    for name in names:
        planned = next(p for p in runner.plan.runs if p.run.name == name)
        shutil.move(root / plan_module.SCRATCH / "runs" / "tiny" / name, runner.where(planned, False))
    runner, _, _ = fake_runner(monkeypatch, plan_path, root, {}, concurrent=2, no_timing_runs=False)
    assert runner.untimed_here(runner.plan.runs) == {"tiny": "another"}
    assert not any(runner.needs_alone(p) for p in runner.plan.runs)


def test_a_run_that_shared_the_device_before_a_resume_alone_is_not_timed(tmp_path, monkeypatch):
    """Its wall-clock times run on from the attempt that shared the device, so its record says it
    shared it and the report counts it in no time; an older record without ``shared`` is read
    from its concurrency."""
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    runner, procs, _ = fake_runner(monkeypatch, plan_path, root, {"profile-seed0": (2, True)}, max_runs=1)
    run_dir = runner.where(runner.plan.runs[0], True)
    (run_dir / "checkpoints" / "2").mkdir(parents=True)  # stopped short at the end of a budget
    earlier = {"status": "unfinished (resumable)", "concurrency": 2.0, "shared": True, "device": "cpu"}
    (run_dir / plan_module.RUNNER_FILE).write_text(json.dumps(earlier))
    runner.loop()
    record = runner_record(root, "profile-seed0")
    assert list(procs) == ["profile-seed0"] and record["resumed"] and record["status"] == "completed"
    assert record["concurrency"] == 1.0 and record["shared"] is True  # alone now, shared before
    assert not plan_module.ran_alone(run_dir)
    runs = sweep.expand(plan_path.parent / "base.yaml", ["modes/profile"], [0])
    assert evidence.shared_device(run_dir.parent, runs) == {"profile-seed0"}
    # An older record: its concurrency says it.
    for concurrency, alone in ((1.0, True), (1.5, False)):
        (run_dir / plan_module.RUNNER_FILE).write_text(
            json.dumps({"status": "completed", "concurrency": concurrency})
        )
        assert plan_module.ran_alone(run_dir) is alone
        assert evidence.shared_device(run_dir.parent, runs) == (set() if alone else {"profile-seed0"})


def test_a_run_stopped_short_on_this_machine_is_estimated_from_its_checkpoint_on(tmp_path, monkeypatch):
    """A start resumes a run this machine stopped short (at the end of an earlier call's budget):
    only the steps after its newest checkpoint are estimated, so it fits where a whole run would not."""
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    runner, _, _ = fake_runner(monkeypatch, plan_path, root, {})
    planned = runner.plan.runs[1]
    config = plan_module.run_config(runner.plan, planned)
    steps = plan_module.steps_of(config)
    m = plan_module.Measured("x", plan_module.kind_of(config), steps, 10.0 + steps * 0.5, 0.5, 1, "cpu")
    whole, basis = runner.estimate(planned, [m], 1, {})
    assert whole == pytest.approx(10 + steps * 0.5) and "left" not in basis
    (runner.where(planned, True) / "checkpoints" / "1").mkdir(parents=True)
    (runner.where(planned, True) / "checkpoints" / "3").mkdir()
    part, basis = runner.estimate(planned, [m], 1, {})
    assert part == pytest.approx(10 + (steps - 3) * 0.5)
    assert basis == f"1 finished run(s) of the same kind; {steps - 3} steps left after checkpoint 3"


def test_auto_starts_a_run_alone_where_only_alone_it_fits_the_budget(tmp_path, monkeypatch):
    """After one run alone the runner would measure two at a time, which assumes no gain (each
    twice as long): with too little budget left for that, the next run starts alone."""
    plan_path = tiny_setting(tmp_path)
    plan_path.write_text(SEEDS_PLAN)
    root = tmp_path / "gpu"
    script = {f"{c}-seed{s}": (10, True) for s in range(3) for c in ("galore", "rank", "decomp", "full")}
    # After the first run 15 s are left: one run alone (13 s: 10 s, times 1.3 for another kind of
    # run than the fakes record), not two at a time (26 s).
    budget = 10 + plan_module.RESERVE_S + 15
    runner, procs, lines = fake_runner(
        monkeypatch, plan_path, root, script, concurrent="auto", budget_s=budget, estimate_s=10
    )
    runner.loop()
    first, second, third = (p.run.name for p in runner.plan.runs[:3])
    assert list(procs) == [first, second]
    assert procs[second].fraction is None and runner_record(root, second)["concurrency"] == 1.0
    assert any(line.startswith(f"tiny/{third}: not started: needs ~") for line in lines)


def test_after_two_crashes_no_run_starts_and_the_running_ones_finish(tmp_path, monkeypatch):
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    script = {"profile-seed0": (1, False), "full-seed0": (1, False), "galore-seed0": (5, True)}
    runner, procs, lines = fake_runner(monkeypatch, plan_path, root, script, concurrent=3)
    runner.loop()
    assert sorted(procs) == sorted(script)  # rank-seed0 and the rest not started
    assert procs["galore-seed0"].signals == []
    galore = runner_record(root, "galore-seed0")
    assert galore["status"] == "completed" and not galore["stopped_at_deadline"]
    assert any("two runs in a row ended without a result: no more runs start" in line for line in lines)


def test_an_error_in_the_loop_stops_and_records_the_runs_and_packs_what_finished(tmp_path, monkeypatch):
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    script = {"profile-seed0": (1, True), "full-seed0": (5, True)}
    runner, procs, lines = fake_runner(monkeypatch, plan_path, root, script, concurrent=2)
    estimate, calls = runner.estimate, []

    def failing(planned, measured, level, costs):  # the third run's estimate fails, profile ended, full runs
        calls.append(planned.name)
        if len(calls) == 3:
            raise evidence.UserError("a config that does not resolve")
        return estimate(planned, measured, level, costs)

    runner.estimate = failing
    with pytest.raises(evidence.UserError, match="does not resolve"):
        runner.loop()
    full = procs["full-seed0"]
    assert full.signals == [signal.SIGTERM] and full.returncode is not None
    record = runner_record(root, "full-seed0")
    assert record["stopped_at_deadline"] and record["status"].startswith("unfinished")
    assert record["last_logged_step"] == 2 and runner_record(root, "profile-seed0")["last_logged_step"] == 4
    assert any(
        line.startswith("tiny/full-seed0: unfinished") and "last logged step 2" in line for line in lines
    )
    with tarfile.open(root / "out" / runner_module.ARCHIVE) as tar:
        names = tar.getnames()
        session = next(n for n in names if n.startswith("results/sessions/") and n.endswith(".json"))
        runs = json.loads(tar.extractfile(session).read())["runs"]
    assert "results/tiny/profile-seed0/summary.json" in names
    assert [r["run"] for r in runs] == ["tiny/profile-seed0", "tiny/full-seed0"]


@pytest.mark.slow
def test_prepare_gets_what_is_left_of_the_budget(tmp_path):
    """A ``train.prepare`` that would take 30 s (``python -m`` finds the root's ``train`` first)
    against a budget that leaves it about 5 s: one line saying so, not a hang, and its worker
    process killed with it."""
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    (root / "train").mkdir(parents=True)
    (root / "train" / "__init__.py").write_text("")
    worker_pid = tmp_path / "worker.pid"
    (root / "train" / "prepare.py").write_text(
        "import pathlib, subprocess, sys, time\n"
        "quiet = {'stdout': subprocess.DEVNULL, 'stderr': subprocess.DEVNULL}\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], **quiet)\n"
        f"pathlib.Path({str(worker_pid)!r}).write_text(str(worker.pid))\n"
        "time.sleep(30)\n"
    )
    args = types.SimpleNamespace(
        budget_s=plan_module.RESERVE_S + 5,
        out=str(tmp_path / "out"),
        concurrent=1,
        site=str(tmp_path / "site"),
        wheels=None,
        xla_cache=None,
        workers=None,
    )
    runner = runner_module.Runner(args, plan_module.load_plan(plan_path), root, lambda line: None)
    with pytest.raises(
        evidence.UserError, match=r"^train.prepare did not finish in the \d+s left of the budget$"
    ):
        runner.setup()
    pid = int(worker_pid.read_text())
    survived = alive(pid)
    if survived:
        os.kill(pid, signal.SIGKILL)
    assert not survived


def test_a_failed_setup_ends_in_one_line_and_the_archived_log_keeps_it(tmp_path):
    """A ``train.prepare`` that fails on the GPU machine (e.g. an import there): exit 2 with its
    line, which the archive's session log holds too (it was on stderr alone, and nothing came
    back)."""
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    (root / "train").mkdir(parents=True)
    (root / "train" / "__init__.py").write_text("")
    (root / "train" / "prepare.py").write_text("import sys\n\nsys.exit('no protobuf here')\n")
    proc, _ = run_runner(plan_path, root, tmp_path / "out")
    assert proc.returncode == 2 and "error: train.prepare failed: no protobuf here" in proc.stderr
    with tarfile.open(tmp_path / "out" / runner_module.ARCHIVE) as tar:
        (log,) = [m for m in tar.getmembers() if m.name.endswith(".log")]
        text = tar.extractfile(log).read().decode()
    assert "error: train.prepare failed: no protobuf here" in text


def run_runner(plan, root, out, budget=60):
    args = [sys.executable, str(ROOT / "benchmarks" / "evidence.py"), "run", "--plan", str(plan)]
    args += ["--root", str(root), "--out", str(out), "--budget-s", str(budget)]
    t0 = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=budget + 60)
    return proc, time.monotonic() - t0


def logged(stdout: str) -> list[str]:
    """The runner's log lines without their time stamps."""
    return [line.split("] ", 1)[1] for line in stdout.splitlines() if "] " in line]


@pytest.mark.slow
def test_runner_keeps_its_budget_packs_finished_runs_and_the_repository_reports_them(tmp_path):
    plan_path = tiny_setting(tmp_path)
    plan = plan_module.load_plan(plan_path)
    budget = 60
    gpu = machine(tmp_path, "gpu")
    # A run an earlier call cut off at its limit left running: the call ends it first.
    children = gpu / runner_module.CHILDREN_FILE
    left = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        left_by_a_driver_gone(children, left, "tiny/full-seed0")
        proc, wall = run_runner(plan_path, gpu, tmp_path / "out", budget)
        assert left.wait(timeout=10) == -signal.SIGKILL
    finally:
        left.kill()
        left.wait()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert wall < budget + 10  # the budget, plus the interpreter's start around it
    lines = logged(proc.stdout)
    ended = (
        f"ended tiny/full-seed0 (process group {left.pid}), left running by an earlier call that did not end"
    )
    assert lines[1] == ended, lines[:3]
    assert json.loads(children.read_text()) == {}  # each child recorded was taken off as it ended
    started = [line for line in lines if ": starting (estimate" in line]
    for line in started:  # each run started with its estimate inside what was left
        est = float(line.split("(estimate ")[1].split("s")[0])
        assert est <= float(line.split("; ")[-1].split("s left")[0]) + 1
    # The plan's first run ran to the end; a run that did not fit was not started. One refused
    # while others ran may start once they end, if the estimate then fits (more runs measured,
    # fewer sharing the device: each start above fitted); the last refusal stands.
    assert started[0].startswith("tiny/profile-seed0: starting")
    assert any(line.startswith("tiny/profile-seed0: completed, exit 0") for line in lines)
    refusals = [line for line in lines if ": not started: needs ~" in line]
    for refused in refusals:  # needs more than is left (both rounded to whole seconds in the log)
        assert float(refused.split("needs ~")[1].split("s")[0]) >= float(
            refused.split("; ")[-1].split("s left")[0]
        )
    done = [line.split(":")[0] for line in lines if ": completed, exit 0" in line]
    assert refusals and not any(line.startswith(refusals[-1].split(":")[0] + ": starting") for line in lines)
    assert any(line.startswith("tiny/profile-seed0 ") and " completed " in line for line in lines)  # table
    assert f"{len(done)} run(s) finished in" in proc.stdout

    # One archive: the finished runs' small files (no checkpoint) and the session's record.
    archive = tmp_path / "out" / runner_module.ARCHIVE
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [runner_module.ARCHIVE, runner_module.LOG]
    )
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert {n.rsplit("/", 1)[0] for n in names if n.endswith("/summary.json")} == {
        f"results/{r}" for r in done
    }
    assert not [n for n in names if "checkpoint" in n]
    for name in runner_module.PACKED:
        assert f"results/tiny/profile-seed0/{name}" in names
    with tarfile.open(archive) as tar:  # the session's log, its closing table included
        (log,) = [
            m
            for m in tar.getmembers()
            if m.name.startswith("results/sessions/session-") and m.name.endswith(".log")
        ]
        assert f"{len(done)} run(s) finished in" in tar.extractfile(log).read().decode()

    # The repository (no .evidence, no ../shared): the archive's runs go in, the reports come out.
    repo = tmp_path / "repo"
    repo.mkdir()
    added, kept, unplanned = evidence.unpack(archive, repo, plan)  # in the order of their names
    assert added == sorted(done) and kept == []
    assert unplanned == []
    assert evidence.unpack(archive, repo, plan) == ([], sorted(done), [])  # a second unpack keeps them
    evidence.write_reports(repo, plan, say=lambda *a: None)
    profile_dir = repo / "results" / "tiny" / "profile-seed0"
    assert RunDir(profile_dir).state() == "completed" and not (profile_dir / "checkpoints").exists()
    alignment = json.loads((profile_dir / "alignment.json").read_text())
    s_tau, steps = alignment["s_tau"], alignment["steps"]
    text = (repo / "results" / "tiny" / "profile.md").read_text()
    lowest = min(s_tau, key=s_tau.get)
    assert f"recordings (steps {steps[0]} to {steps[-1]}): lowest `{lowest}` (the paper: `down`)" in text
    first = next(line for line in text.splitlines() if line.startswith("| 1 | "))
    assert first.startswith(f"| 1 | {max(s_tau, key=s_tau.get)} | {max(s_tau.values()):.4f} |")
    assert first.endswith("| v | 0.959 |")

    # The next piece of GPU time continues after the committed runs, estimating from them.
    status = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "evidence.py"), "status", "--plan", str(plan_path)]
        + ["--root", str(repo)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert status.returncode == 0, status.stderr
    states = dict(line.split(": ", 1) for line in status.stdout.splitlines())
    # In the plan's order (runs sharing the machine may finish in another order than they started).
    assert [k for k, v in states.items() if v == "completed"] == [p.name for p in plan.runs if p.name in done]
    first_todo = next(p.name for p in plan.runs if p.name not in done)
    assert "finished run(s) of" in states[first_todo]
    committed = [plan_module.measure(repo / "results" / name) for name in done]
    costs = plan_module.sharing_costs(committed)  # the training runs' device-seconds per step
    assert ("sharing cpu" in states) == bool(costs)
    if costs:
        assert states["sharing cpu"].startswith(plan_module.describe_costs(costs) + " per training step")
    # Each run to do is estimated alone, and at the level auto starts with where that shares.
    level = plan_module.choose_level(costs, plan_module.LEVELS[-1])[0] if costs else 1
    assert states[first_todo].split("; estimate ")[1].split("s alone")[0].isdigit()
    assert (f"s {level} at a time (" in states[first_todo]) == (level > 1)

    # train.sweep's report from the committed runs, grid points without runs included.
    out = repo / "results" / "tiny"
    cmd = [sys.executable, "-m", "train.sweep", "--base", str(plan_path.parent / "base.yaml"), "--seeds", "0"]
    cmd += ["--axis", "conditions/galore,rank,decomp,full", "--out", str(out), "--report-only"]
    report = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    result = json.loads((out / "report.json").read_text())
    assert report.returncode == (1 if result["excluded"] else 0), report.stderr  # 1: some have not run
    conditions = ("galore", "rank", "decomp", "full")
    assert {e["run"] for e in result["excluded"]} == {
        f"{c}-seed0" for c in conditions if f"tiny/{c}-seed0" not in done
    }
    for c in conditions:
        if f"tiny/{c}-seed0" in done:
            final = json.loads((out / f"{c}-seed0" / "summary.json").read_text())["final_eval_ppl"]
            assert result["points"][c]["final_ppl"]["mean"] == pytest.approx(final)
    if "tiny/galore-seed0" not in done:
        assert result["target_ppl"] is None
        assert "No target: the baseline `galore` has no completed run yet" in (out / "report.md").read_text()
    # The curves where a run completed; no empty axes where none has.
    assert (out / "report.png").exists() == any(f"tiny/{c}-seed0" in done for c in conditions)


# ------------------------------------------------------------------------------------ bad input


def evidence_cli(*args) -> tuple[int, list[str]]:
    """``python benchmarks/evidence.py ARGS``: its exit status and stderr's lines."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "evidence.py"), *map(str, args)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.parametrize(
    "text,message",
    [
        ("base: [oops\n", " is not valid YAML (line 2): expected ',' or ']', but got '<stream end>'"),
        ("5\n", " must hold a mapping (base, results, runs, ...), got 5"),
        (
            TINY_PLAN.replace("seeds: [0]", "seeds: [zero]", 1),
            ": seeds must be whole numbers >= 0, each once, got ['zero']",
        ),
        (
            TINY_PLAN.replace("seeds: [0]", "seeds: [0, 0]", 1),
            ": seeds must be whole numbers >= 0, each once, got [0, 0]",
        ),
        (
            TINY_PLAN.replace("galore,rank,decomp,full", "galore,rank,decomp,fulll"),
            ": report tiny: --axis conditions/galore,rank,decomp,fulll: no config layer",
        ),
        (
            TINY_PLAN.replace('decomp,full"], seeds: [0]}', 'decomp,full"], seeds: [0], baseline: gallore}'),
            ": report tiny: --baseline gallore is not a grid point (galore, rank, decomp, full)",
        ),
        (TINY_PLAN.replace("{train: 30,", "{trian: 30,"), ": estimate_s has train and profile, not 'trian'"),
        (
            TINY_PLAN.replace("[conditions/full], seeds: [0]}", "[conditions/full], seeds: [0], timed: 1}"),
            ": timed must be true or false, got 1",
        ),
    ],
    ids=[
        "invalid-yaml",
        "scalar",
        "seed-not-a-number",
        "seed-twice",
        "report-layer-missing",
        "report-baseline-off-grid",
        "estimate-key",
        "timed-not-a-boolean",
    ],
)
def test_a_plan_that_cannot_be_read_is_one_line(tmp_path, text, message):
    plan = tiny_setting(tmp_path)
    plan.write_text(text)
    code, err = evidence_cli("report", "--plan", plan, "--root", tmp_path)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: plan {plan}{message}"), err


@pytest.mark.parametrize(
    "args,message",
    [
        (["report", "--root", "{file}"], "--root {file}: {file} is not a directory"),
        (["run", "--out", "{file}"], "--out {file}: {file} is not a directory"),
        (["run", "--safety", "-1"], "--safety must be a factor >= 1 on every estimate (a margin), got -1.0"),
        (["run", "--safety", "nan"], "--safety must be a factor >= 1 on every estimate (a margin), got nan"),
        (["run", "--budget-s", "nan"], "--budget-s must be a number of seconds > 0, got nan"),
        (["run", "--max-runs", "-1"], "--max-runs must be >= 1, got -1"),
        (
            ["status", "--root", "{file}.d"],
            "--root {file}.d: no such directory (the checkout the plan's paths are in)",
        ),
    ],
    ids=[
        "root-is-a-file",
        "out-is-a-file",
        "negative-safety",
        "nan-safety",
        "nan-budget",
        "negative-max-runs",
        "root-missing",
    ],
)
def test_arguments_that_cannot_be_are_one_line_before_any_work(tmp_path, args, message):
    """A folder that is a file, or a safety factor or budget that would turn the budget guard off
    (NaN passes no comparison): exit 2 with one line; nothing written, the file left."""
    plan, root, file = tiny_setting(tmp_path), tmp_path / "gpu", tmp_path / "file"
    root.mkdir()
    file.write_text("kept")
    fill = lambda text: text.format(file=file)  # noqa: E731
    argv = [args[0], "--plan", plan, "--root", root]
    if args[0] == "run":
        argv += ["--budget-s", 60, "--out", tmp_path / "out"]
    code, err = evidence_cli(*argv, *map(fill, args[1:]))
    assert code == 2 and err == [f"error: {fill(message)}"], err
    assert file.read_text() == "kept" and not (tmp_path / "out").exists() and not list(root.iterdir())


def test_a_configs_relative_paths_name_files_under_the_root_from_any_working_directory(tmp_path):
    """The runs run in the root, so a config's relative path (here an allocation file, which the
    config's check opens) names a file there, also for a command started elsewhere."""
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    (plan_path.parent / "alloc").mkdir()
    (plan_path.parent / "alloc" / "mine.yaml").write_text("optimizer: {rank_allocation: mine.json}\n")
    plan_path.write_text(
        "base: base.yaml\nresults: results\n"
        'runs: [{experiment: tiny, axes: ["conditions/full", "alloc/mine"], seeds: [0]}]\n'
    )
    root.mkdir()
    (root / "mine.json").write_text("{}")
    argv = [sys.executable, str(ROOT / "benchmarks" / "evidence.py"), "status", "--plan", str(plan_path)]
    proc = subprocess.run([*argv, "--root", "gpu"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("tiny/full-mine-seed0: new; estimate ")
    (root / "mine.json").unlink()
    proc = subprocess.run([*argv, "--root", "gpu"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "optimizer.rank_allocation: 'mine.json' is neither" in proc.stderr


def test_stage_outside_a_git_checkout_is_one_line_before_any_copy(tmp_path):
    """``stage`` measures what a GPU command takes from a checkout's files: a root that is none is
    refused before the data are copied into it."""
    plan, shared, root = tiny_setting(tmp_path), machine(tmp_path, "shared") / ".data", tmp_path / "root"
    root.mkdir()
    code, err = evidence_cli("stage", "--plan", plan, "--root", root, "--shared", shared, "--no-wheels")
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --root {root} is not a git checkout")
    assert not list(root.iterdir())


def test_stage_over_the_limit_names_the_untracked_files_that_travel(tmp_path):
    """What a GPU command takes over its 64 MiB: the refusal names the untracked, not ignored
    folders that take it there (an export's ``hf/`` in the root), largest first."""
    plan, shared, root = tiny_setting(tmp_path), machine(tmp_path, "shared") / ".data", tmp_path / "root"
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("/.data/\n/.whl/\n")
    subprocess.run(["git", "-C", str(root), "add", ".gitignore"], check=True)  # tracked
    (root / "hf" / "export").mkdir(parents=True)
    with (root / "hf" / "export" / "model.safetensors").open("wb") as f:
        f.truncate(70 * 2**20)  # (sparse: no disk used)
    (root / "notes.txt").write_text("x" * 1000)
    code, err = evidence_cli("stage", "--plan", plan, "--root", root, "--shared", shared, "--no-wheels")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: that is over the 64 MiB a GPU command may take; untracked files that ")
    assert (
        "travel with it: hf/ 70.00 MiB, notes.txt 0.00 MiB (move them, or ignore them in .gitignore)"
        in err[0]
    )


def finished_run(run_dir: pathlib.Path, config: dict) -> None:
    """A completed run's files as a run of ``config`` leaves them (what the checks read)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 4}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 0.5, "wall_s": 1.0}) + "\n")


def test_a_run_of_a_preset_defined_otherwise_now_is_refused_not_counted_as_done(tmp_path, monkeypatch):
    """A committed run whose config is the plan's but whose model (its ``model.json``) is not the
    one its preset makes in this version would be reported as the plan's: refused, naming it and
    the fields that differ."""
    import models
    from train.model import model_config

    plan_path = tiny_setting(tmp_path)
    plan = plan_module.load_plan(plan_path)
    full, root = plan.runs[1], tmp_path / "repo"
    committed = root / plan.results / full.experiment / full.run.name
    finished_run(committed, plan_module.run_config(plan, full))
    cfg = sweep.load_run(plan.base, full.run)
    built = model_config(cfg, 257)
    RunDir(committed).write_model(dataclasses.asdict(built))
    plan_module.check_finished_runs(plan, root)  # its own model: done
    name = cfg.model.name
    monkeypatch.setitem(models.PRESETS, name, dataclasses.replace(models.PRESETS[name], rope_theta=500.0))
    said = rf"{committed} \(model.rope_theta: {built.rope_theta} -> 500.0\); remove them"
    with pytest.raises(evidence.UserError, match=said):
        plan_module.check_finished_runs(plan, root)


def test_runs_of_other_settings_than_the_plans_are_refused_not_counted_as_done(tmp_path):
    """A run dir of the plan whose config is not what the plan gives that run now (a base edited
    after runs were committed, a rehearsal's runs unpacked into the repository) would be skipped
    as done and reported as the plan's: status, run, report and unpack refuse it in one line
    naming it and what differs (stage calls the same check), and unpack refuses an archive
    holding such a run before writing anything; a run of no plan it leaves out, naming it. What a
    run records or how it was split over devices is no difference."""
    plan_path = tiny_setting(tmp_path)
    plan = plan_module.load_plan(plan_path)
    root = tmp_path / "repo"
    profile, full = plan.runs[0], plan.runs[1]
    committed = root / plan.results / full.experiment / full.run.name
    config = plan_module.run_config(plan, full)
    finished_run(committed, {**config, "metrics": {**config["metrics"], "writers": ["tensorboard"]}})
    plan_module.check_finished_runs(plan, root)  # the same settings: done
    base = plan_path.parent / "base.yaml"
    base.write_text(base.read_text().replace("steps: 4, batch_size", "steps: 6, batch_size"))
    plan = plan_module.load_plan(plan_path)
    with pytest.raises(evidence.UserError, match=rf"{committed} \(train.steps: 4 -> 6\); remove them"):
        plan_module.check_finished_runs(plan, root)
    run = ["run", "--out", tmp_path / "out", "--budget-s", 5]
    for command in (["status"], ["report"], run):
        code, lines = evidence_cli(*command, "--plan", plan_path, "--root", root)
        assert code == 2 and "hold runs of other settings than it gives them now" in lines[-1], lines

    # An archive with a run of the old settings, and a run the plan does not have.
    shutil.rmtree(committed)
    scratch = tmp_path / "gpu" / plan.results
    finished_run(scratch / full.experiment / full.run.name, config)  # made before the edit
    finished_run(scratch / profile.experiment / "other-seed0", plan_module.run_config(plan, profile))
    archive = tmp_path / "evidence.tar.gz"

    def pack():
        with tarfile.open(archive, "w:gz") as tar:  # files only, as the runner packs them
            for path in sorted(p for p in scratch.rglob("*") if p.is_file()):
                tar.add(path, arcname=f"{plan.results}/{path.relative_to(scratch)}")

    pack()
    with pytest.raises(evidence.UserError) as e:
        evidence.unpack(archive, root, plan)
    assert str(e.value) == (
        f"{archive}: nothing unpacked: runs of other settings than the plan gives them: "
        "tiny/full-seed0 (train.steps: 4 -> 6)"
    )
    assert not [p for p in (root / plan.results).rglob("*") if p.is_file()]
    finished_run(scratch / profile.experiment / profile.run.name, plan_module.run_config(plan, profile))
    shutil.rmtree(scratch / full.experiment / full.run.name)
    pack()
    assert evidence.unpack(archive, root, plan) == ([profile.name], [], ["tiny/other-seed0"])
    assert not (root / plan.results / "tiny" / "other-seed0").exists()


def test_the_runs_token_stores_are_under_the_runners_folder_unless_the_caller_says(tmp_path, monkeypatch):
    """A bare GPU machine's home may not be writable: train.prepare and the runs find the token
    store under the runner's own folder (``MOARA_JAX_CACHE``), where none was set."""
    monkeypatch.setattr(runner_module, "ORIGINAL_ENV", {"PATH": "/bin"})
    assert runner_module.child_env(None, 1, None, tmp_path / "c")["MOARA_JAX_CACHE"] == str(tmp_path / "c")
    monkeypatch.setattr(runner_module, "ORIGINAL_ENV", {"PATH": "/bin", "MOARA_JAX_CACHE": "/mine"})
    assert runner_module.child_env(None, 1, None, tmp_path / "c")["MOARA_JAX_CACHE"] == "/mine"


def test_runs_going_at_the_budgets_end_are_stopped_before_it_and_are_not_crashes(tmp_path, monkeypatch):
    """Runs still going ``RESERVE_S - 5`` s before the budget's end get SIGTERM (a run saves a
    checkpoint and exits), not the kill that comes 3 s before it, and are recorded as stopped at
    the deadline; two ending so are not two runs that ended without a result."""
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    script = {"profile-seed0": (1000, True), "full-seed0": (1000, True)}
    runner, procs, lines = fake_runner(
        monkeypatch, plan_path, root, script, concurrent=2, budget_s=100, estimate_s=10
    )
    runner.loop()
    assert sorted(procs) == sorted(script)
    for name, proc in procs.items():
        assert proc.signals == [signal.SIGTERM] and proc.returncode == -signal.SIGTERM
        record = runner_record(root, name)
        assert record["stopped_at_deadline"] and record["status"] == "unfinished (new)"
        assert record["wall_s"] == pytest.approx(100 - (plan_module.RESERVE_S - 5), abs=0.6)
    assert not any("two runs in a row" in line for line in lines)
    assert any(line.startswith("tiny/galore-seed0: not started: needs ~") for line in lines)


def test_the_archive_holds_completed_and_failed_runs_not_unfinished_ones(tmp_path, monkeypatch):
    """A run the divergence guard stopped (``nan``, ``diverged``) is a result, as a completed one
    is: both come back; a run that did not finish does not."""
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    runner, _, _ = fake_runner(monkeypatch, plan_path, root, {})
    statuses = {"profile-seed0": "completed", "full-seed0": "nan", "galore-seed0": "diverged"}
    statuses["rank-seed0"] = "running"
    for planned in runner.plan.runs:
        if planned.run.name in statuses:
            run_dir = runner.where(planned, True)
            run_dir.mkdir(parents=True)
            (run_dir / "summary.json").write_text(json.dumps({"status": statuses[planned.run.name]}))
    assert runner.pack() == 3
    with tarfile.open(root / "out" / runner_module.ARCHIVE) as tar:
        runs = {name.split("/")[2] for name in tar.getnames() if name.startswith("results/tiny/")}
    assert runs == {"profile-seed0", "full-seed0", "galore-seed0"}


def _measurable_run(run_dir: pathlib.Path, device: str, resumed: bool = False) -> None:
    """A completed run's files as ``measure`` reads them: 4 steps in 2 s on ``device``."""
    optimizer = {"name": "moara", "host": "none", "decompose": False, "rank_allocation": "uniform"}
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"mode": "train", "optimizer": optimizer}))
    rows = [{"step": 0, "loss": 1.0, "wall_s": 0.0}, {"step": 4, "loss": 0.5, "wall_s": 2.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"status": "completed", "steps": 4, "device_kind": device}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    record = {"wall_s": 5.0, "resumed": resumed, "concurrency": 1.0}
    (run_dir / plan_module.RUNNER_FILE).write_text(json.dumps(record))


def test_estimates_come_from_committed_runs_of_this_device_alone_and_never_from_a_resumed_one(
    tmp_path, monkeypatch
):
    """A committed run of another GPU model says nothing of this one's times, and a resumed run's
    wall time is its last attempt's alone: neither is measured; a run of this machine's device
    is."""
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    runner, _, _ = fake_runner(monkeypatch, plan_path, root, {})
    by_name = {p.run.name: p for p in runner.plan.runs}
    _measurable_run(runner.where(by_name["profile-seed0"], False), "NVIDIA H100 80GB HBM3")
    _measurable_run(runner.where(by_name["full-seed0"], False), runner.device)
    _measurable_run(runner.where(by_name["galore-seed0"], False), runner.device, resumed=True)
    measured = runner.measured()
    assert [m.name for m in measured] == ["full-seed0"]
    assert measured[0].per_step_s == pytest.approx(0.5) and measured[0].wall_s == 5.0


def test_a_start_clears_an_attempt_that_left_no_checkpoint(tmp_path, monkeypatch):
    """A run dir with no checkpoint to resume from (a run a fault stopped before its first) is
    started afresh: the earlier attempt's files do not come back with the new run's."""
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    runner, _, _ = fake_runner(monkeypatch, plan_path, root, {"profile-seed0": (1, True)}, max_runs=1)
    stale = runner.where(runner.plan.runs[0], True)
    stale.mkdir(parents=True)
    (stale / "alignment.json").write_text("{}")
    runner.loop()
    assert runner_record(root, "profile-seed0")["status"] == "completed"
    assert not (stale / "alignment.json").exists()


def test_a_plan_entry_timed_false_never_waits_for_the_device_to_itself(tmp_path, monkeypatch):
    plan_path, root = tiny_setting(tmp_path), tmp_path / "gpu"
    text = plan_path.read_text()
    full = "  - {experiment: tiny, axes: [conditions/full], seeds: [0]}\n"
    assert full in text
    plan_path.write_text(text.replace(full, full.replace("}", ", timed: false}")))
    runner, _, _ = fake_runner(monkeypatch, plan_path, root, {}, no_timing_runs=False)
    alone = {p.run.name: runner.needs_alone(p) for p in runner.plan.runs}
    assert not alone["full-seed0"] and alone["galore-seed0"] and not alone["profile-seed0"]


def test_the_report_times_an_experiment_on_the_device_of_its_baselines_runs_alone(tmp_path):
    """``timing_device``: the device most runs of the baseline point (GaLore) had to themselves,
    though more runs of the other points had another device; without a baseline run alone, the
    device most runs had."""
    plan = plan_module.load_plan(tiny_setting(tmp_path))
    devices = {"galore-seed0": "H100", "full-seed0": "H200", "rank-seed0": "H200"}

    def alone(planned):
        device = devices.get(planned.run.name)
        return None if device is None else {"device": device}

    assert plan_module.timing_device(plan, "tiny", alone) == "H100"
    del devices["galore-seed0"]
    assert plan_module.timing_device(plan, "tiny", alone) == "H200"


def test_a_long_train_log_keeps_its_tail(tmp_path):
    """``_trim``: a run's output past ``TAIL_BYTES`` keeps its last bytes (where a stop or an
    error shows), marked as cut."""
    path = tmp_path / "train.log"
    lines = [f"line {i}\n".encode() for i in range(100_000)]
    path.write_bytes(b"".join(lines))
    runner_module._trim(path)
    data = path.read_bytes()
    assert data.startswith(b"[... cut ...]\n") and data.endswith(lines[-1])
    assert len(data) == runner_module.TAIL_BYTES + len(b"[... cut ...]\n")
