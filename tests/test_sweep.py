"""``python -m train.sweep``: grid expansion, skipping and resuming, and the report's statistics
(on hand-made run dirs; the end-to-end sweep runs in ``test_train.test_sweep_then_compare``)."""

import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from train import sweep
from train.config import load_config, to_dict
from train.errors import EXIT_IO_ERROR, EXIT_PREEMPTED, UserError
from train.rundir import RunDir, RunLock

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs" / "paper" / "llama2-60m.yaml"
TINY = ROOT / "configs" / "tiny.yaml"


def test_grid_is_the_product_of_the_axes_once_per_seed():
    runs = sweep.expand(PAPER, ["conditions/galore,full", "hosts/fira,osd"], [0, 1])
    assert [r.name for r in runs] == [
        f"{c}-{h}-seed{s}" for c in ("galore", "full") for h in ("fira", "osd") for s in (0, 1)
    ]
    assert runs[0].layers == (
        str(PAPER.parent / "conditions" / "galore.yaml"),
        str(PAPER.parent / "hosts" / "fira.yaml"),
    )
    assert [r.name for r in sweep.expand(PAPER, [], [3])] == ["llama2-60m-seed3"]
    with pytest.raises(UserError, match=r"--axis conditions/nope: no config layer .*nope.yaml"):
        sweep.expand(PAPER, ["conditions/nope"], [0])


def make_run(root, name, status=None, ppl=(), checkpoint=False, step_every=10, seconds_per_step=1.0):
    run = root / name
    run.mkdir(parents=True)
    rows = [
        {
            "step": step_every * (i + 1),
            "eval_ppl": p,
            "eval_loss": math.log(p),
            "wall_s": seconds_per_step * step_every * (i + 1),
        }
        for i, p in enumerate(ppl)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if status:
        (run / "summary.json").write_text(json.dumps({"status": status}))
    if checkpoint:
        (run / "checkpoints" / "20").mkdir(parents=True)
    return run


def test_finished_and_failed_runs_are_skipped_interrupted_ones_resumed(tmp_path, monkeypatch):
    runs = sweep.expand(PAPER, ["conditions/galore,rank,decomp,full"], [0])
    make_run(tmp_path, "galore-seed0", "completed", [30, 20])
    make_run(tmp_path, "rank-seed0", "interrupted", [30], checkpoint=True)
    make_run(tmp_path, "decomp-seed0", "diverged", [30], checkpoint=True)  # the one before it kept
    calls = []

    def launch(args, stop=None):
        calls.append(args)
        return 1 if "full-seed0" in args[args.index("--run-dir") + 1] else 0

    monkeypatch.setattr(sweep, "launch", launch)
    said = []
    outcomes = sweep.run_grid(PAPER, runs, tmp_path, ["train.steps=20"], say=said.append)
    assert outcomes == {
        "galore-seed0": "completed",
        "rank-seed0": "completed",
        "decomp-seed0": "failed",
        "full-seed0": "failed (exit 1)",
    }
    assert [a[a.index("--run-dir") + 1] for a in calls] == [
        str(tmp_path / "rank-seed0"),
        str(tmp_path / "full-seed0"),
    ]
    assert calls[0][-1] == "--resume" and "--resume" not in calls[1]
    assert calls[1][:4] == [
        "--config",
        str(PAPER),
        "--config",
        str(PAPER.parent / "conditions" / "full.yaml"),
    ]
    assert "train.steps=20" in calls[1] and "train.seed=0" in calls[1]
    assert "full-seed0: failed with exit status 1; the sweep goes on without it" in said
    for code in (EXIT_PREEMPTED, EXIT_IO_ERROR):  # preempted, or a fault of the machine: stop
        monkeypatch.setattr(sweep, "launch", lambda args, stop=None, code=code: code)
        with pytest.raises(sweep.SweepStopped, match="rank-seed0") as stopped:  # the first still to do
            sweep.run_grid(PAPER, runs, tmp_path, [], say=said.append)
        assert stopped.value.code == code


# A stand-in for ``python -m train``: the scheduler's signal reaches the sweep (or its whole
# process group) while this run is in progress. "saves" stops as the trainer does (exit 75 after
# SIGTERM); "startup" has no handler yet, as the trainer before its step loop; "completes" gets
# it in its wrap-up and finishes (exit 0); "completes-then-killed" is ended by a second signal
# once its summary is written.
FAKE_RUN = textwrap.dedent("""
    import os, pathlib, signal, sys, time
    log, mode, target = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    got = []
    if mode != "startup":
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    with log.open("a") as f:
        f.write("start\\n")
    sweep = os.getppid()
    if target == "group":
        os.killpg(os.getpgid(sweep), signal.SIGTERM)
    elif target != "none":  # (none: the test itself ends the sweep)
        os.kill(sweep, signal.SIGINT if target == "sweep-sigint" else signal.SIGTERM)
    deadline = time.time() + 60
    while not got and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # its wrap-up, in which a group's signal passed on by the sweep arrives too
    with log.open("a") as f:
        f.write("stopped\\n" if got else "no signal\\n")
    if mode == "completes-then-killed":  # its summary written, a late signal ends it on its way out
        run_dir = pathlib.Path(sys.argv[sys.argv.index("--run-dir") + 1])
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text('{"status": "completed"}')
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(0 if mode == "completes" else 75)
""")

SWEEP = textwrap.dedent("""
    import sys
    from train import sweep
    log, mode, target, out = sys.argv[1:]
    sweep.TRAIN = [sys.executable, "-c", sys.stdin.read(), log, mode, target]
    sys.exit(sweep.main(["--base", "configs/tiny.yaml", "--seeds", "0,1", "--out", out]))
""")


@pytest.mark.parametrize("target", ["sweep", "sweep-sigint", "group"])
@pytest.mark.parametrize("mode", ["saves", "startup", "completes", "completes-then-killed"])
@pytest.mark.slow
def test_a_signal_to_the_sweep_stops_it_after_the_run_in_progress(tmp_path, mode, target):
    """SIGTERM or SIGINT to the sweep, or SIGTERM to its process group: the run in progress gets
    SIGTERM (it saves, or is in its start-up with nothing to save, or finishes its wrap-up and
    completes), the sweep waits for it, starts no other run and exits 75; the same command
    continues."""
    log = tmp_path / "runs.log"
    proc = subprocess.run(
        [sys.executable, "-c", SWEEP, str(log), mode, target, str(tmp_path / "out")],
        input=FAKE_RUN,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # its own process group, which the fake run signals
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "start" and lines.count("start") == 1  # no second run started
    if mode.startswith("completes"):  # its outcome kept: the sweep stops before the next run
        assert "stopped before tiny-seed1; run the same command again" in proc.stderr
    else:
        assert "tiny-seed0 was interrupted; run the same command again to continue the sweep" in proc.stderr
    assert lines[1:] == ([] if mode == "startup" else ["stopped"])  # in its start-up: killed by it


@pytest.mark.slow
def test_a_killed_sweep_takes_its_run_with_it(tmp_path):
    """``kill -9`` of the sweep: the run in progress gets SIGTERM (it saves and stops), not
    left training beside the next sweep's runs."""
    log = tmp_path / "runs.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", SWEEP, str(log), "saves", "none", str(tmp_path / "out")],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    proc.stdin.write(FAKE_RUN)
    proc.stdin.close()
    lines = lambda: log.read_text().splitlines() if log.exists() else []  # noqa: E731
    deadline = time.monotonic() + 60
    while lines() != ["start"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lines() == ["start"]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30  # (unsignalled, the fake run waits 60 s and says so)
    while len(lines()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lines() == ["start", "stopped"]


def test_a_run_dir_in_use_stops_the_sweep(tmp_path, monkeypatch):
    """A run dir whose lock a process holds (another sweep's run, or one a killed sweep left):
    the sweep stops there with one line, starting nothing beside it and counting no failure."""
    runs = sweep.expand(PAPER, ["conditions/galore,full"], [0])
    make_run(tmp_path, "galore-seed0", "completed", [30, 20])
    calls = []
    monkeypatch.setattr(sweep, "launch", lambda args, stop=None: calls.append(args) or 0)
    with RunLock(tmp_path / "full-seed0"):
        with pytest.raises(UserError) as refused:
            sweep.run_grid(PAPER, runs, tmp_path, [], say=lambda line: None)
    assert str(refused.value).startswith(
        f"run dir {tmp_path / 'full-seed0'} is in use by pid {os.getpid()} on host "
    )
    assert "the sweep stops" in str(refused.value) and calls == []
    assert sweep.run_grid(PAPER, runs, tmp_path, [], say=lambda line: None)["full-seed0"] == "completed"
    assert len(calls) == 1


def test_a_sweep_started_to_ignore_sigint_keeps_ignoring_it():
    """A background job of a non-interactive shell starts with SIGINT ignored: the sweep leaves
    it so (and its runs inherit that); SIGTERM is still the sweep's."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sweep.StopRequest():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sessions_overlap_only_where_they_share_time_on_one_host():
    """Back to back (one ends as the next starts) is not sharing the machine; another host's
    session, or a run with itself, never overlaps; a session without a host may be anywhere."""
    from train.compare import overlaps

    def run(name, *sessions):
        return {"name": name, "summary": {"sessions": [list(x) for x in sessions]}}

    assert overlaps([run("a", (0, 10, "h")), run("b", (10, 20, "h"))]) == []
    assert overlaps([run("a", (0, 10, "h")), run("b", (9.5, 20, "h"))]) == [("a", "b")]
    assert overlaps([run("a", (0, 10, "h")), run("b", (5, 20, "g"))]) == []
    assert overlaps([run("a", (0, 10, "h"), (5, 15, "h"))]) == []
    assert overlaps([run("a", (0, 10)), run("b", (5, 20, "g"))]) == [("a", "b")]


def test_report_statistics_on_hand_made_runs(tmp_path):
    runs = sweep.expand(PAPER, ["conditions/galore,full"], [0, 1, 2])
    # The baseline ends at ppl 20 and 22 (mean 21: the target); seed 2 diverged and is left out.
    make_run(tmp_path, "galore-seed0", "completed", [40, 30, 20])
    make_run(tmp_path, "galore-seed1", "completed", [40, 30, 22])
    make_run(tmp_path, "galore-seed2", "diverged", [40, 900])
    make_run(tmp_path, "full-seed0", "completed", [35, 21, 18])
    make_run(tmp_path, "full-seed1", "completed", [35, 21.5, 19], seconds_per_step=2.0)
    make_run(tmp_path, "full-seed2", "completed", [30, 20, 17])
    result = sweep.report(tmp_path, runs)
    assert result["baseline"] == "galore" and result["target_ppl"] == 21.0
    galore, full = result["points"]["galore"], result["points"]["full"]
    assert galore["final_ppl"] == {"mean": 21.0, "std": statistics.stdev([20, 22]), "n": 2}
    # The mean curves reach ppl <= 21: galore's (40, 30, 21) at step 30, its last, in 30 s;
    # full's (33.3, 20.8, 18) at step 20, in (20 + 40 + 20) / 3 s. The reductions come from them.
    assert galore["mean_curve"] == {"steps_to_target": 30, "time_to_target_s": 30.0}
    assert full["mean_curve"] == {"steps_to_target": 20, "time_to_target_s": pytest.approx(80 / 3)}
    assert full["step_reduction_pct"] == pytest.approx(100 * (1 - 20 / 30))
    assert full["time_reduction_pct"] == pytest.approx(100 * (1 - (80 / 3) / 30))
    assert galore["step_reduction_pct"] == 0.0 and galore["time_reduction_pct"] == 0.0
    # Each seed on its own: galore seed 0 at 30, seed 1 (final 22) never; full at 20, 30, 20.
    # One seed's mean has no spread to tell (not a spread of 0).
    assert galore["steps_to_target"] == {"mean": 30.0, "std": None, "n": 1} and galore["reached"] == 1
    assert full["steps_to_target"]["mean"] == pytest.approx(70 / 3)
    assert full["time_to_target_s"]["mean"] == pytest.approx((20 + 60 + 20) / 3)
    assert [s["steps"] for s in full["seeds"]] == [20, 30, 20]
    assert result["excluded"] == [{"run": "galore-seed2", "status": "diverged"}]  # (no stop_reason)
    text = (tmp_path / "report.md").read_text()
    # point | runs | final ppl, p | steps, reduction, per seed | time (s), reduction, per seed
    # (p: of the 10 splits of the five final ppl into 3 and 2, only the observed one has means 3 apart)
    assert galore["final_ppl_p"] is None and full["final_ppl_p"] == pytest.approx(0.1)
    assert (
        "| galore | 2 (1 reached, 2 timed) | 21.000 ± 1.414 | - | 30 | +0.0% | 30 | 30.0 | +0.0% | 30.0 |"
        in text
    )
    assert (
        "| full | 3 (3 reached, 3 timed) | 18.000 ± 1.000 | 0.10 | 20 | +33.3% | 23 ± 6 | 26.7 | +11.1% "
        "| 33.3 ± 23.1 |" in text
    )
    assert "- galore-seed2: diverged" in text
    assert "- galore: seed 0: ppl 20.000, 30 steps, 30.0 s; seed 1: ppl 22.000, target not reached" in text
    assert (tmp_path / "report.png").stat().st_size > 0
    with pytest.raises(UserError, match="--baseline nope is not a grid point"):
        sweep.report(tmp_path, runs, baseline="nope")


def test_permutation_p_is_the_share_of_splits_whose_means_differ_as_much():
    # Every seed of one side above every seed of the other: only the observed split and its
    # mirror (equal sizes) are that far apart, 2 of C(6, 3) = 20.
    assert sweep.permutation_p([50.8, 50.7, 50.3], [49.8, 47.7, 49.7]) == pytest.approx(0.1)
    # Sides of 2 and 3: the observed split alone is that far, 1 of C(5, 2) = 10.
    assert sweep.permutation_p([52.3, 51.9], [49.8, 47.7, 49.7]) == pytest.approx(0.1)
    # The same values on both sides: every split differs at least as much (by 0).
    assert sweep.permutation_p([1.0, 1.0], [1.0, 1.0]) == 1.0
    # Interleaved: 1, 3 against 2, 4 differ by 1; the splits (1,2|3,4) and (3,4|1,2) by 2, (1,4|2,3)
    # and (2,3|1,4) by 0: 4 of 6 as far or farther.
    assert sweep.permutation_p([1.0, 3.0], [2.0, 4.0]) == pytest.approx(4 / 6)
    assert sweep.permutation_p([], [1.0]) is None and sweep.permutation_p([1.0], []) is None
    assert sweep.permutation_p([1.0] * 11, [2.0] * 11) is None  # C(22, 11) = 705,432 splits: too many


def test_report_times_only_the_runs_that_had_the_machine_to_themselves(tmp_path):
    """A run that shared the machine (its session overlaps another's on the same host, or the
    caller says so) counts in the steps but in no time: not in the mean curve's wall-clock, not
    in the per-seed times, not in the reductions; a point with no such run has no time at all."""
    runs = sweep.expand(PAPER, ["conditions/galore,rank,full"], [0, 1, 2])
    make_run(tmp_path, "galore-seed0", "completed", [40, 30, 20])
    make_run(tmp_path, "galore-seed1", "completed", [40, 30, 22])
    make_run(tmp_path, "rank-seed0", "completed", [38, 25, 19])
    make_run(tmp_path, "full-seed0", "completed", [35, 21, 18])
    make_run(tmp_path, "full-seed1", "completed", [35, 21.5, 19], seconds_per_step=2.0)
    make_run(tmp_path, "full-seed2", "completed", [30, 20, 17])
    sessions = {
        "galore-seed0": [0.0, 100.0, "gpu"],  # alone
        "galore-seed1": [200.0, 300.0, "gpu"],  # beside full-seed0
        "full-seed0": [250.0, 350.0, "gpu"],
        "full-seed1": [200.0, 300.0, "other"],  # at the same time, on another machine: alone
        "full-seed2": [400.0, 500.0, "gpu"],  # alone here, but the caller knows better
        "rank-seed0": [600.0, 700.0, "gpu"],
    }
    for name, span in sessions.items():
        (tmp_path / name / "summary.json").write_text(json.dumps({"status": "completed", "sessions": [span]}))
    result = sweep.report(tmp_path, runs, shared=frozenset({"full-seed2", "rank-seed0"}))
    galore, rank, full = (result["points"][p] for p in ("galore", "rank", "full"))
    assert result["target_ppl"] == 21.0
    # galore's mean curve reaches 21 at step 30, timed by seed 0 alone (30 s, not seed 1's too);
    # full's at step 20, timed by seed 1 alone (2 s a step): 40 s, so its time is 33% longer.
    assert galore["mean_curve"] == {"steps_to_target": 30, "time_to_target_s": 30.0}
    assert full["mean_curve"] == {"steps_to_target": 20, "time_to_target_s": 40.0}
    assert full["time_reduction_pct"] == pytest.approx(100 * (1 - 40 / 30))
    assert full["step_reduction_pct"] == pytest.approx(100 / 3)
    assert [(s["steps"], s["time_s"], s["timed"]) for s in full["seeds"]] == [
        (20, None, False),
        (30, 60.0, True),
        (20, None, False),
    ]
    assert full["steps_to_target"]["n"] == 3 and full["time_to_target_s"] == {
        "mean": 60.0,
        "std": None,
        "n": 1,
    }
    assert (galore["timed"], full["timed"], rank["timed"]) == (1, 1, 0)
    assert rank["mean_curve"] == {"steps_to_target": 30, "time_to_target_s": None}
    assert rank["time_reduction_pct"] is None and rank["step_reduction_pct"] == 0.0
    assert result["warnings"] == [
        "galore-seed1 and full-seed0 ran at the same time: their wall-clock times may be contended"
    ]
    text = (tmp_path / "report.md").read_text()
    assert (
        "| full | 3 (3 reached, 1 timed) | 18.000 ± 1.000 | 0.10 | 20 | +33.3% | 23 ± 6 | 40.0 "
        "| -33.3% | 60.0 |" in text
    )
    assert "| rank | 1 (1 reached, 0 timed) | 19.000 | 0.67 | 30 | +0.0% | 30 | - | - | - |" in text
    assert (
        "- full: seed 0: ppl 18.000, 20 steps (shared the machine: no time); "
        "seed 1: ppl 19.000, 30 steps, 60.0 s" in text
    )
    assert "4 completed run(s) shared the machine and count in no time." in text
    assert (tmp_path / "report.png").stat().st_size > 0


def test_report_times_only_the_runs_on_the_device_the_baselines_timed_runs_had(tmp_path):
    """Wall-clock times compare on one device only: the one most of the baseline's timed runs
    had, even where most runs had another. A run alone on another device, or on one it does not
    name, counts in the steps but in no time, as a shared one; the report says why each such
    seed has no time."""
    runs = sweep.expand(PAPER, ["conditions/galore,rank,full"], [0, 1, 2])
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    made = {
        "galore-seed0": ([40, 30, 20], 1.0, h100),
        "galore-seed1": ([40, 30, 22], 1.0, h200),
        "galore-seed2": ([40, 30, 21], 3.0, h100),
        "rank-seed0": ([38, 25, 19], 0.5, h200),
        "rank-seed1": ([38, 26, 20], 0.5, h200),
        "rank-seed2": ([38, 25, 19], 0.5, None),  # a summary without device_kind
        "full-seed0": ([35, 21, 18], 2.0, h100),
        "full-seed1": ([35, 20, 19], 0.5, h200),
        "full-seed2": ([35, 21, 18], 0.5, h200),  # shared the machine, the caller says
    }
    for i, (name, (ppl, per_step, device)) in enumerate(made.items()):
        make_run(tmp_path, name, ppl=ppl, seconds_per_step=per_step)
        span = [100.0 * i, 100.0 * i + 50, "gpu"]  # one after another: each alone
        summary = {"status": "completed", "sessions": [span]} | ({"device_kind": device} if device else {})
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    result = sweep.report(tmp_path, runs, shared=frozenset({"full-seed2"}))
    galore, rank, full = (result["points"][p] for p in ("galore", "rank", "full"))
    # Of the runs alone, four had the H200 and three the H100; the baseline's two of three the H100.
    assert result["timing_device"] == h100 and result["target_ppl"] == 21.0
    # galore reaches 21 at step 30 on its mean curve, timed by its H100 seeds: (30 + 90) / 2 s.
    assert galore["mean_curve"] == {"steps_to_target": 30, "time_to_target_s": 60.0}
    assert [(s["time_s"], s["timed"], s["device"]) for s in galore["seeds"]] == [
        (30.0, True, h100),
        (None, False, h200),
        (90.0, True, h100),
    ]
    # full's mean curve reaches 20.67 at step 20: 40 s from seed 0 alone, not seed 1's 10 s.
    assert full["mean_curve"] == {"steps_to_target": 20, "time_to_target_s": 40.0}
    assert full["time_reduction_pct"] == pytest.approx(100 * (1 - 40 / 60))
    assert [(s["shared"], s["elsewhere"]) for s in full["seeds"]] == [
        (False, False),
        (False, True),
        (True, True),
    ]
    assert (galore["timed"], rank["timed"], full["timed"]) == (2, 0, 1)
    assert rank["mean_curve"] == {"steps_to_target": 30, "time_to_target_s": None}
    assert rank["time_reduction_pct"] is None and rank["steps_to_target"]["n"] == 3
    assert result["warnings"] == [
        f"the runs ran on different devices ({h100}, {h200}): times differ by device"
    ]
    text = (tmp_path / "report.md").read_text()
    assert f"All times are {h100}'s, the device the baseline's timed runs had" in text
    assert (
        f"- rank: seed 0: ppl 19.000, 30 steps (ran on {h200}: no time); seed 1: ppl 20.000, 30 steps "
        f"(ran on {h200}: no time); seed 2: ppl 19.000, 30 steps (ran on a device it does not name: no time)"
    ) in text
    assert f"seed 2: ppl 18.000, 20 steps (shared the machine and ran on {h200}: no time)" in text
    assert "1 completed run(s) shared the machine and count in no time." in text
    assert f"6 completed run(s) ran on another device than {h100} and count in no time." in text
    # Without a timed baseline run, the device most timed runs had.
    result = sweep.report(
        tmp_path, runs, shared=frozenset({"full-seed2", *(f"galore-seed{s}" for s in range(3))})
    )
    assert result["timing_device"] == h200
    timed = {p: [s["timed"] for s in result["points"][p]["seeds"]] for p in ("galore", "rank", "full")}
    assert timed == {"galore": [False] * 3, "rank": [True, True, False], "full": [False, True, False]}
    # Where no run names its device, none is left out for it.
    for name in made:
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        (tmp_path / name / "summary.json").write_text(
            json.dumps({"status": "completed", "sessions": summary["sessions"]})
        )
    result = sweep.report(tmp_path, runs)
    assert result["timing_device"] is None
    assert all(s["timed"] for row in result["points"].values() for s in row["seeds"])
    assert "All times are" not in (tmp_path / "report.md").read_text()


def test_report_baseline_seeds_that_end_at_other_steps_still_give_a_target(tmp_path):
    """A baseline seed resumed for more steps: the target is the baseline's mean at the last step
    its seeds all evaluated, which its mean curve reaches, so the reductions are computed."""
    runs = sweep.expand(PAPER, ["conditions/galore,full"], [0, 1])
    make_run(tmp_path, "galore-seed0", "completed", [30, 20, 15])
    make_run(tmp_path, "galore-seed1", "completed", [31, 21, 16, 14])
    make_run(tmp_path, "full-seed0", "completed", [25, 15, 12])
    make_run(tmp_path, "full-seed1", "completed", [26, 16, 13])
    result = sweep.report(tmp_path, runs)
    assert result["target_ppl"] == 15.5  # (15 + 16) / 2 at step 30
    assert result["points"]["galore"]["mean_curve"]["steps_to_target"] == 30
    assert result["points"]["full"]["mean_curve"]["steps_to_target"] == 20
    assert result["points"]["full"]["step_reduction_pct"] == pytest.approx(100 / 3)
    # Said as what it is: not the seeds' mean final ppl (15.0 at step 30 and 14.0 at step 40).
    text = (tmp_path / "report.md").read_text()
    assert text.startswith(
        "Target: the mean eval ppl of `galore` at step 30, the last its seeds all evaluated (they end "
        "at steps 30, 40) = 15.500"
    ), text
    assert result["warnings"] == [
        "the seeds of galore end at different steps (30, 40): their train.steps, and so their "
        "learning-rate schedules, differ"
    ]
    assert "train.steps, and so their learning-rate schedules, differ" in text


def test_runs_that_stopped_before_their_first_evaluation_say_why(tmp_path, capsys):
    """A run the divergence guard stopped at its first steps: the sweep's report lists it with its
    status and reason (it said "failed, no evaluation"), and compare says it has no eval ppl, even
    with --force (it said "no metrics.jsonl")."""
    from train.compare import compare

    runs = sweep.expand(PAPER, ["conditions/galore,full"], [0])
    make_run(tmp_path, "galore-seed0", "completed", [30, 20])
    hot = make_run(tmp_path, "full-seed0")
    (hot / "metrics.jsonl").unlink()
    why = "loss 9.1 > 3 x the best 2.5 at step 4"
    (hot / "summary.json").write_text(json.dumps({"status": "diverged", "stop_reason": why}))
    sweep.report(tmp_path, runs)
    assert f"- full-seed0: diverged ({why}), no evaluation" in (tmp_path / "report.md").read_text()
    for force in (False, True):
        with pytest.raises(
            UserError,
            match=re.escape(
                f"{hot}: the run stopped (diverged: {why}) before its first evaluation: no eval ppl to "
                "compare, even with --force"
            ),
        ):
            compare([tmp_path / "galore-seed0", hot], tmp_path / "out", force=force)


def test_report_without_a_completed_baseline_gives_the_final_ppl_and_says_so(tmp_path):
    runs = sweep.expand(PAPER, ["conditions/galore,full"], [0, 1])
    make_run(tmp_path, "galore-seed0", "interrupted", [40], checkpoint=True)
    make_run(tmp_path, "full-seed0", "completed", [35, 21, 18])
    make_run(tmp_path, "full-seed1", "completed", [35, 25, 20])
    # Two runs that shared the machine: their wall-clock times are flagged.
    for name, span in (("full-seed0", [0.0, 100.0]), ("full-seed1", [50.0, 150.0])):
        summary = {"status": "completed", "sessions": [[*span, "gpu"]], "device_kind": "NVIDIA H100"}
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    result = sweep.report(tmp_path, runs)
    assert result["target_ppl"] is None
    full = result["points"]["full"]
    assert full["final_ppl"]["mean"] == 19.0 and full["steps_to_target"]["n"] == 0
    assert full["step_reduction_pct"] is None and result["points"]["galore"]["final_ppl"]["n"] == 0
    assert result["warnings"] == [
        "full-seed0 and full-seed1 ran at the same time: their wall-clock times may be contended"
    ]
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("No target: the baseline `galore` has no completed run yet")
    assert "| full | 2 (0 reached, 0 timed) | 19.000 ± 1.414 | - | - | - | - | - | - | - |" in text
    assert "- full: seed 0: ppl 18.000, no target; seed 1: ppl 20.000, no target" in text
    assert result["points"]["full"]["mean_curve"] == {"steps_to_target": None, "time_to_target_s": None}
    assert "- galore-seed0: resumable" in text and "- galore-seed1: new, no evaluation" in text
    assert "ran at the same time" in text and (tmp_path / "report.png").stat().st_size > 0


def sweep_cli(argv, monkeypatch, capsys):
    """``python -m train.sweep ARGV`` in this process with every run's launch recorded, none run:
    its exit status, stdout, stderr's lines and the arguments of the runs it started."""
    started = []
    monkeypatch.setattr(sweep, "launch", lambda args, stop=None: started.append(args) or 0)
    code = sweep.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines(), started


@pytest.mark.parametrize(
    "args,message",
    [
        (["--out", "{file}"], "--out {file}: {file} is not a directory"),
        (["--out", "/proc/sweep"], "--out /proc/sweep: cannot create it ("),
        (
            ["--axis", "paper/conditions/galore,full", "--baseline", "nope"],
            "--baseline nope is not a grid point (galore, full)",
        ),
        (
            ["--set", "train.stepz=3"],
            "tiny-seed0: unknown config key train.stepz (did you mean train.steps? valid: ",
        ),
        (["--seeds", "-1"], "tiny-seed-1: train.seed must be in [0, 2**32), got -1"),
        (["--seeds", "0,1,0"], "--seeds 0,1,0: seed 0 is given more than once"),
        (["--base", "{broken}"], "broken-seed0: config file {broken} is not valid YAML"),
        (
            ["--axis", "paper/conditions/galore,full,galore"],
            "--axis paper/conditions/galore,full,galore: galore is named more than once",
        ),
        # what the trainer's start-up refuses, found before any run starts
        (
            ["--set", "data.tokenizer=no-such-spiece.model"],
            "tiny-seed0: data.tokenizer: no-such-spiece.model: no such file or directory (a relative path",
        ),
        (
            ["--set", "data.source=files", "data.paths=[/no/such/c4.json.gz]"],
            "tiny-seed0: data file not found: /no/such/c4.json.gz",
        ),
        (
            ["--axis", "paper/conditions/galore,full", "--set", "train.seq_len=300"],
            "galore-seed0: train.seq_len (300) exceeds the model's max_position_embeddings (256)",
        ),
    ],
    ids=[
        "out-is-a-file",
        "out-cannot-be-made",
        "baseline-off-grid",
        "unknown-key",
        "negative-seed",
        "seed-twice",
        "broken-base",
        "layer-twice",
        "tokenizer-missing",
        "data-file-missing",
        "too-few-positions",
    ],
)
def test_bad_input_is_one_line_before_any_run_starts(tmp_path, monkeypatch, capsys, args, message):
    """A wrong argument, a config that does not load (a bad ``--set``, seed or base file: every
    run's config is loaded as ``python -m train`` loads it), one whose model or data inputs the
    trainer's start-up would refuse, or a baseline off the grid: exit 2
    with one line, no run started and nothing written (no ``sweep.json``, the file left)."""
    file, broken = tmp_path / "file", tmp_path / "broken.yaml"
    file.write_text("kept\n")
    broken.write_text("train: {steps: [oops\n")
    fill = lambda text: text.format(file=file, broken=broken)  # noqa: E731
    argv = ["--base", TINY, "--out", tmp_path / "sweep", *map(fill, args)]
    code, _, err, started = sweep_cli(argv, monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: " + fill(message)), err
    assert started == [] and not (tmp_path / "sweep").exists() and file.read_text() == "kept\n"


def test_the_inputs_of_finished_runs_are_not_looked_for(tmp_path, monkeypatch, capsys):
    """A grid whose runs are finished in ``--out`` (made on another machine, whose tokenizer file
    is not here) is reported, not refused: only runs the sweep would start need their inputs.
    The one run not finished is refused by name for the missing file."""
    sets = ["data.tokenizer=elsewhere/spiece.model"]
    runs = sweep.expand(pathlib.Path(TINY), [], [0, 1])
    out = tmp_path / "sweep"
    for run in runs:
        made = make_run(out, run.name, "completed", [30, 20])
        (made / "config.yaml").write_text(yaml.safe_dump(sweep.run_config(pathlib.Path(TINY), run, sets)))
    argv = ["--base", TINY, "--out", out, "--seeds", "0,1", "--set", *sets]
    code, stdout, err, started = sweep_cli(argv, monkeypatch, capsys)
    assert code == 0 and started == [] and "tiny-seed1: completed, skipped" in stdout, err
    (out / "tiny-seed1" / "summary.json").unlink()  # no summary, no checkpoint: a run to start
    code, _, err, started = sweep_cli(argv, monkeypatch, capsys)
    assert code == 2 and started == [], err
    assert err[0].startswith("error: tiny-seed1: data.tokenizer: elsewhere/spiece.model: no such file"), err


def test_a_resumable_init_from_run_needs_not_its_directory_nor_a_store_its_manifest(tmp_path, monkeypatch):
    """A run to resume takes an ``init_from`` model from its ``model.json`` (the directory may be
    gone), so the sweep's checks do not ask for the directory; a new run of the same grid does.
    A ``source: store`` whose store has no manifest is refused before any run starts."""
    import dataclasses

    import models

    out, gone = tmp_path / "sweep", tmp_path / "gone-model"
    sets = [f"model.init_from={gone}", "model.name=null", "model.overrides={}"]
    (run,) = sweep.expand(pathlib.Path(TINY), [], [0])
    made = out / run.name
    (made / "checkpoints" / "10").mkdir(parents=True)
    (made / "config.yaml").write_text(yaml.safe_dump(sweep.run_config(pathlib.Path(TINY), run, sets)))
    model = dataclasses.asdict(models.get_config("tiny", vocab_size=257))
    (made / "model.json").write_text(json.dumps(model))
    assert RunDir(made).state() == "resumable"
    # no refusal: the resume needs no directory
    sweep.check_starts([run], out, sweep.run_configs(pathlib.Path(TINY), [run], sets))
    with pytest.raises(UserError, match=rf"tiny-seed0: model.init_from: {gone} is not a directory"):
        sweep.check_starts([run], tmp_path / "new", sweep.run_configs(pathlib.Path(TINY), [run], sets))
    store = ["data.source=store", f"data.store={tmp_path / 'no-store'}"]
    with pytest.raises(UserError, match=r"tiny-seed0: .*no-store is not a complete token store"):
        sweep.check_starts([run], tmp_path / "new", sweep.run_configs(pathlib.Path(TINY), [run], store))


@pytest.mark.parametrize("state", ["completed", "resumable"])
def test_a_run_made_with_other_settings_is_refused_not_reused(tmp_path, monkeypatch, capsys, state):
    """A sweep run again into its ``--out`` with other settings: a run there (finished, or one to
    resume) whose config differs from the one the sweep now gives it is neither skipped nor
    resumed as this grid's; one line names its run dir and the settings that differ, before any
    run starts or ``sweep.json`` is rewritten. With the same settings it is reused, and with
    other settings its results do not depend on (micro-batches, checkpoints, logging) too;
    ``--report-only`` reports the runs as they are, and leaves ``sweep.json`` as it is."""
    out = tmp_path / "sweep"
    status = "completed" if state == "completed" else "interrupted"
    run = make_run(out, "tiny-seed0", status, [30, 20], checkpoint=state == "resumable")
    RunDir(run).write_config(to_dict(load_config([TINY], ["train.steps=2", "train.seed=0"])))
    argv = ["--base", TINY, "--out", out, "--set", "train.steps=2"]
    code, text, _, started = sweep_cli(argv, monkeypatch, capsys)
    if state == "completed":
        assert code == 0 and "tiny-seed0: completed, skipped" in text and started == []
    else:
        assert [a[-1] for a in started] == ["--resume"]
    grid = (out / "sweep.json").read_text()
    code, _, err, started = sweep_cli(
        [*argv, "--set", "train.steps=5", "--set", "train.lr=0.001"], monkeypatch, capsys
    )
    assert code == 2 and len(err) == 1 and started == [], err
    assert err[0] == (
        f"error: {run} holds a {state} run whose config differs from the one this sweep gives it "
        "(train.lr: 0.01 -> 0.001, train.steps: 2 -> 5): give the layers and --set it was made with, "
        "use another --out, or remove that run dir"
    )
    assert (out / "sweep.json").read_text() == grid and RunDir(run).state() == state
    operational = ["train.micro_batch_size=4", "checkpoint.every=1", "train.log_every=1", "mesh.data=1"]
    code, text, err, started = sweep_cli(
        [*argv, *(x for s in operational for x in ("--set", s))], monkeypatch, capsys
    )
    if state == "completed":
        assert code == 0 and "tiny-seed0: completed, skipped" in text and started == [], err
    else:
        assert [a[-1] for a in started] == ["--resume"], err
    grid = (out / "sweep.json").read_text()
    # --report-only reads no --set, and says so (it reported the runs of lr 0.01 as they were).
    said = (
        rf"^--report-only reads no --set \(train.steps=2 train.lr=0.001\): the report is of the runs in {out}"
    )
    with pytest.warns(UserWarning, match=said):
        code, text, err, started = sweep_cli(
            [*argv, "--set", "train.lr=0.001", "--report-only"], monkeypatch, capsys
        )
    assert started == [] and "- tiny: " in text and not any("differs" in line for line in err), err
    assert ("- tiny: seed 0: ppl 20.000" in text) == (state == "completed"), text
    # The record of the grid as it ran is left as it was (a report wrote its own --set there).
    assert (out / "sweep.json").read_text() == grid and "train.micro_batch_size=4" in grid


@pytest.mark.parametrize("state", ["completed", "resumable"])
def test_a_run_of_a_preset_defined_otherwise_now_is_refused_not_reused(tmp_path, monkeypatch, capsys, state):
    """A run in the sweep's ``--out`` whose ``model.json`` is not the model its preset makes now
    (this version defines it otherwise) is neither skipped nor resumed as this grid's, though its
    config is the same: one line names its run dir and the fields. Its own model is reused."""
    import dataclasses

    import models

    out = tmp_path / "sweep"
    status = "completed" if state == "completed" else "interrupted"
    run = make_run(out, "tiny-seed0", status, [30, 20], checkpoint=state == "resumable")
    RunDir(run).write_config(to_dict(load_config([TINY], ["train.steps=2", "train.seed=0"])))
    tiny = models.get_config("tiny", vocab_size=257, max_position_embeddings=256)
    RunDir(run).write_model(dataclasses.asdict(tiny))
    argv = ["--base", TINY, "--out", out, "--set", "train.steps=2"]
    code, text, err, started = sweep_cli(argv, monkeypatch, capsys)
    assert not err and [a[-1] for a in started] == ([] if state == "completed" else ["--resume"]), err
    other = dataclasses.replace(models.PRESETS["tiny"], rms_norm_eps=1e-5)
    monkeypatch.setitem(models.PRESETS, "tiny", other)
    code, _, err, started = sweep_cli(argv, monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and started == [], err
    assert err[0] == (
        f"error: {run} holds a {state} run of another model than the one the preset tiny makes now "
        f"(model.rms_norm_eps: {tiny.rms_norm_eps!r} -> 1e-05): this version defines it otherwise; use "
        "another --out, or remove that run dir"
    )


PLOTS_IN_A_NOTEBOOK = textwrap.dedent("""
    import json, pathlib, sys
    import matplotlib
    matplotlib.use("svg")  # the backend a notebook or an application chose
    from train import sweep
    from train.rundir import RunDir, plot_curves
    run = pathlib.Path(sys.argv[1])
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 11)] + [{"step": 10, "eval_ppl": 40.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    curve = [{"step": 10, "wall_s": 1.0, "eval_ppl": 40.0, "ppl_std": 0.0}]
    written = [plot_curves(RunDir(run)), run / "report.png"]
    sweep.plot(written[1], {"full": curve}, {"full": 1}, {"full": 1})
    for path in written:
        assert path.read_bytes()[:8] == b"\\x89PNG\\r\\n\\x1a\\n", path
    print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
""")


def test_plots_leave_the_processes_matplotlib_as_it_was(tmp_path):
    """A run's curves and a sweep's report are PNGs drawn on figures of their own: the backend the
    process chose stays (a notebook's inline plots go on) and pyplot is never imported."""
    proc = subprocess.run(
        [sys.executable, "-c", PLOTS_IN_A_NOTEBOOK, str(tmp_path / "run")],
        cwd=pathlib.Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["svg", "False"], proc.stdout


def test_a_plot_without_matplotlib_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    """Without matplotlib (the Quick start's ``pip install -e .``) a run's curves, like every
    other plot, are not drawn and one line says so and how to get them (they went unsaid)."""
    from train.rundir import RunDir, plot_curves

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # its import raises ImportError
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    assert plot_curves(RunDir(run)) is None and not (run / "curves.png").exists()
    said = capsys.readouterr().out
    assert said == "matplotlib is not installed; no curves.png (pip install 'moara-jax[plot]')\n", said
