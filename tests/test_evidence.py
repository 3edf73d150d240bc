"""``benchmarks/evidence.py``: the plan of issue 21's runs, the duration estimates, and the runner end
to end on CPU (a tiny setting, a 60-second budget), its archive unpacked into a results folder,
the next runs' state and estimates from there, and the reports written from it."""

import json
import pathlib
import subprocess
import sys
import tarfile
import time

import pytest

from train.rundir import RunDir
from train.sources import builtin_documents

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import evidence  # noqa: E402

WIKI = ROOT / "configs" / "experiments" / "wiki60m"


def test_plan_orders_the_runs_as_the_issue_does_and_every_config_resolves():
    plan = evidence.load_plan(WIKI / "plan.yaml")
    names = [p.name for p in plan.runs]
    four = ["galore", "full", "rank", "decomp"]
    assert names == [
        "wiki60m/profile-seed0",
        *[f"wiki60m/{c}-seed0" for c in four],
        *[f"wiki60m/{c}-seed{s}" for s in (1, 2) for c in four],
        "wiki60m-fira/galore-fira-seed0",
        "wiki60m-fira/full-fira-seed0",
        "wiki60m-osd/galore-osd-seed0",
        "wiki60m-osd/full-osd-seed0",
    ]
    configs = {p.name: evidence.run_config(plan, p) for p in plan.runs}
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
    assert evidence.steps_of(profile) == 400
    galore, rank = configs["wiki60m/galore-seed1"]["optimizer"], configs["wiki60m/rank-seed2"]["optimizer"]
    assert (galore["name"], galore["rank_allocation"], galore["decompose"]) == ("galore", "uniform", False)
    assert (rank["name"], rank["rank_allocation"], rank["decompose"]) == ("moara", "default", False)
    assert configs["wiki60m-osd/full-osd-seed0"]["optimizer"]["host"] == "osd"
    assert [r["experiment"] for r in plan.reports] == ["wiki60m", "wiki60m-fira", "wiki60m-osd"]


def test_estimates_scale_the_fixed_part_and_the_steps_of_finished_runs():
    kind = ("train", "galore", "galore", False, "uniform")
    other = ("profile", "galore", "galore", False, "uniform")
    # 100 s in all, of which 40 s fixed and 200 steps of 0.3 s.
    m = evidence.Measured("a", kind, 200, 100.0, 0.3, 1, "cpu")
    p = evidence.Measured("p", other, 100, 50.0, 0.4, 1, "cpu")
    assert evidence.estimate(kind, 400, 1, [m, p], 999, 1.0) == (
        pytest.approx(160.0),
        "1 finished run(s) of the same kind",
    )
    # Only another kind: its fixed part (10 s) plus 400 x 0.4 s x 1.3, times the safety factor.
    est, basis = evidence.estimate(kind, 400, 1, [p], 999, 1.5)
    assert est == pytest.approx((10 + 400 * 0.4 * evidence.OTHER_KIND) * 1.5) and "other kinds" in basis
    # Two runs sharing the device: no gain from sharing is assumed.
    assert evidence.estimate(kind, 400, 2, [m], 999, 1.0)[0] == pytest.approx(40 + 400 * 0.3 * 2)
    assert evidence.estimate(kind, 400, 2, [], 300, 1.0)[0] == 600


def test_unpack_refuses_members_outside_the_results(tmp_path):
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        (tmp_path / "x").write_text("x")
        tar.add(tmp_path / "x", arcname="benchmarks/results/../../evil.txt")
    plan = evidence.load_plan(WIKI / "plan.yaml")
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
    plan = evidence.load_plan(plan_path)
    budget = 60
    proc, wall = run_runner(plan_path, machine(tmp_path, "gpu"), tmp_path / "out", budget)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert wall < budget + 10  # the budget, plus the interpreter's start around it
    lines = logged(proc.stdout)
    started = [line for line in lines if ": starting (estimate" in line]
    for line in started:  # each run started with its estimate inside what was left
        est = float(line.split("(estimate ")[1].split("s")[0])
        assert est <= float(line.split("; ")[-1].split("s left")[0]) + 1
    # The plan's first run ran to the end; the first run that did not fit was not started.
    assert started[0].startswith("tiny/profile-seed0: starting")
    assert any(line.startswith("tiny/profile-seed0: completed, exit 0") for line in lines)
    refused = next(line for line in lines if ": not started: needs ~" in line)
    # needs more than is left (both rounded to whole seconds in the log)
    assert float(refused.split("needs ~")[1].split("s")[0]) >= float(
        refused.split("; ")[-1].split("s left")[0]
    )
    done = [line.split(":")[0] for line in lines if ": completed, exit 0" in line]
    assert not any(line.startswith(refused.split(":")[0] + ": starting") for line in lines)
    assert any(line.startswith("tiny/profile-seed0 ") and " completed " in line for line in lines)  # table
    assert f"{len(done)} run(s) finished in" in proc.stdout

    # One archive: the finished runs' small files (no checkpoint) and the session's record.
    archive = tmp_path / "out" / evidence.ARCHIVE
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([evidence.ARCHIVE, evidence.LOG])
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert {n.rsplit("/", 1)[0] for n in names if n.endswith("/summary.json")} == {
        f"results/{r}" for r in done
    }
    assert not [n for n in names if "checkpoint" in n]
    for name in evidence.PACKED:
        assert f"results/tiny/profile-seed0/{name}" in names
    assert any(n.startswith("results/sessions/session-") and n.endswith(".log") for n in names)

    # The repository (no .evidence, no ../shared): the archive's runs go in, the reports come out.
    repo = tmp_path / "repo"
    repo.mkdir()
    added, kept = evidence.unpack(archive, repo, plan)  # in the order of their names
    assert added == sorted(done) and kept == []
    assert evidence.unpack(archive, repo, plan) == ([], sorted(done))  # a second unpack keeps them
    evidence.write_reports(repo, plan, say=lambda *a: None)
    profile_dir = repo / "results" / "tiny" / "profile-seed0"
    assert RunDir(profile_dir).state() == "completed" and not (profile_dir / "checkpoints").exists()
    s_tau = json.loads((profile_dir / "alignment.json").read_text())["s_tau"]
    text = (repo / "results" / "tiny" / "profile.md").read_text()
    assert f"- Lowest: `{min(s_tau, key=s_tau.get)}` (the paper: `down`)" in text
    assert f"| 1 | {max(s_tau, key=s_tau.get)} | {max(s_tau.values()):.4f} | v | 0.959 |" in text

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
    assert [k for k, v in states.items() if v == "completed"] == done
    first_todo = next(p.name for p in plan.runs if p.name not in done)
    assert "finished run(s) of" in states[first_todo]

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
    assert (out / "report.png").stat().st_size > 0
