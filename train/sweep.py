"""``python -m train.sweep``: a grid of runs given as config layers, with seeds, and its report.

    python -m train.sweep --base configs/paper/llama2-60m.yaml \\
        --axis conditions/galore,rank,decomp,full --axis hosts/fira,osd --seeds 0,1,2 \\
        [--set train.steps=3000 ...] [--out runs/sweep] [--baseline galore-fira] [--report-only]

Each ``--axis DIR/a,b`` names config layers ``DIR/a.yaml``, ``DIR/b.yaml`` beside the base file
(or a path); the grid is their product, every point once per seed, each run in its own run dir
``OUT/POINT-seedS``. Finished runs are skipped and interrupted ones resumed, so a sweep can be
stopped (SIGTERM: the run in progress saves; exit 75) and started again with the same command;
a run there made with other settings than the grid now gives it is refused, not reused. Every
run's config is loaded and checked before the first run starts.
A run that fails or diverges is reported and left out of the statistics, never averaged.

The report (``report.md``, ``report.json``, ``report.png``): per grid point, the mean and
sample standard deviation over seeds of the final eval ppl, and the p-value of an exact permutation test
of its mean against the baseline's (``permutation_p``); the steps and wall-clock time at which the
point's mean curve (eval ppl averaged over its seeds at each evaluation) reaches the baseline
point's mean final ppl (the first evaluation at or below it), and the reductions against the
baseline in % from them; the mean and standard deviation of the same figures over the seeds that
reach the target on their own (about half the baseline's seeds do not, the target being their
mean), and each seed's; eval-ppl curves with a band of one standard deviation over seeds, against steps and
against wall-clock. Until the baseline has a completed run the report gives the final ppl
alone and says so. The wall-clock figures come only from runs that had the machine to
themselves: runs that ran at the same time on one host are flagged and count in no time (nor
does a run the caller names as having shared it), and from one device, the one the baseline's
timed runs had: a run on another counts in no time either.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import threading
import warnings
from dataclasses import asdict, dataclass

from train.arguments import add_config_arguments
from train.compare import eval_rows, evaluation, overlaps, problems, reach, reduction_pct
from train.config import (
    DEFAULT_MODEL,
    OPERATIONAL,
    Change,
    RunConfig,
    changed_settings,
    check_writers,
    load_config,
    to_dict,
)
from train.distributed import dies_with_parent
from train.errors import EXIT_IO_ERROR, EXIT_PREEMPTED, UserError, cli, io_operation
from train.plots import figure
from train.rundir import RunDir, RunLock, check_directory_path, make_directory


@dataclass(frozen=True)
class Run:
    point: str  # the grid point: its layers' names joined by "-"
    seed: int
    layers: tuple[str, ...]  # config files layered over the base

    @property
    def name(self) -> str:
        return f"{self.point}-seed{self.seed}"


def expand(base: pathlib.Path, axes: list[str], seeds: list[int]) -> list[Run]:
    """The grid's runs, point by point (axes in order, the first varying slowest), seed by seed."""
    choices = []
    for axis in axes:
        folder, _, names = axis.rpartition("/")
        options = []
        for name in (n.strip() for n in names.split(",") if n.strip()):
            path = base.parent / folder / f"{name}.yaml"
            if not path.is_file():
                raise UserError(f"--axis {axis}: no config layer {path}")
            if any(name == known for known, _ in options):
                raise UserError(f"--axis {axis}: {name} is named more than once")
            options.append((name, str(path)))
        if not options:
            raise UserError(f"--axis {axis}: names no config layer")
        choices.append(options)
    runs = []
    for combo in itertools.product(*choices):
        point = "-".join(name for name, _ in combo) or base.stem
        runs.extend(Run(point, seed, tuple(path for _, path in combo)) for seed in seeds)
    return runs


def load_run(base: pathlib.Path, run: Run, sets: list[str] = ()) -> RunConfig:
    """One run's config as ``python -m train`` loads and validates it from the run's arguments
    (``train_args``)."""
    return load_config([str(base), *run.layers], [*sets, f"train.seed={run.seed}"])


def run_config(base: pathlib.Path, run: Run, sets: list[str] = ()) -> dict:
    """``load_run``'s config as a mapping (what a run dir's ``config.yaml`` holds)."""
    return to_dict(load_run(base, run, sets))


def run_configs(base: pathlib.Path, runs: list[Run], sets: list[str]) -> dict[str, RunConfig]:
    """Each run's config (``load_run``): a bad layer, ``--set`` or seed is one line naming the
    run before any run starts, not the same failure once per run."""
    configs = {}
    for run in runs:
        try:
            configs[run.name] = load_run(base, run, sets)
            check_writers(configs[run.name].metrics.writers)
        except UserError as e:
            raise UserError(f"{run.name}: {e}") from None
    return configs


def check_starts(runs: list[Run], out: pathlib.Path, configs: dict[str, RunConfig]) -> None:
    """What the start-up of each run the sweep would start (one not finished in ``out``) would
    refuse, found without building anything (``train.setup.check_inputs``: the model's settings,
    a tokenizer or data file missing): one line naming the run, not the same failure per run."""
    checked = set()
    for run in runs:
        run_dir = RunDir(out / run.name)
        if run_dir.state() in ("completed", "failed"):
            continue  # skipped: its inputs need not be here
        from train.setup import check_inputs, resumed_model  # (JAX's import: where runs are to start)

        cfg = configs[run.name]
        try:
            # a resume takes the run's model from its model.json (an init_from run's directory
            # need not be there)
            built = resumed_model(run_dir, cfg, run_dir.state() == "resumable")
            t = cfg.train
            model = asdict(built) if built is not None else None
            inputs = json.dumps(
                [asdict(cfg.model), asdict(cfg.data), t.seq_len, t.param_dtype, t.dtype, model], default=str
            )
            if inputs not in checked:  # (the runs of a grid mostly share them)
                check_inputs(cfg, built)
                checked.add(inputs)
        except UserError as e:
            raise UserError(f"{run.name}: {e}") from None


def check_reuse(out: pathlib.Path, runs: list[Run], configs: dict[str, RunConfig]) -> None:
    """Refuses a run dir of the grid that holds a run (finished, or one to resume) whose settings
    differ from those the grid now gives it (``configs``): the sweep would skip or continue it
    and report it as this grid's. Every setting its results depend on counts (not
    ``OPERATIONAL``'s, nor how the model computes, which a resume may change too), compared as a
    resume compares them (``changed_settings``). So does its model (its ``model.json``) where
    this version defines its preset otherwise (``train.model.preset_changes``)."""
    for run in runs:
        run_dir = RunDir(out / run.name)
        state = run_dir.state()
        if state == "new" or not run_dir.config_file.is_file():
            continue  # nothing the sweep would reuse: a new run starts afresh
        cfg = configs[run.name]
        changed = changed_settings(run_dir.config(), to_dict(cfg), ignoring=OPERATIONAL)
        if changed:
            raise UserError(
                f"{run_dir} holds a {state} run whose config differs from the one this sweep gives it "
                f"({', '.join(map(str, changed))}): give the layers and --set it was made with, use another "
                "--out, or remove that run dir"
            )
        changed = preset_changed(run_dir, cfg)
        if changed:
            raise UserError(
                f"{run_dir} holds a {state} run of another model than the one the preset "
                f"{cfg.model.name or DEFAULT_MODEL} "
                f"makes now ({', '.join(map(str, changed))}): this version defines it otherwise; use "
                "another --out, or remove that run dir"
            )


def preset_changed(run_dir: RunDir, cfg: RunConfig) -> list[Change]:
    """What the model ``cfg``'s preset makes now has other than the one the run in ``run_dir``
    built (its ``model.json``; ``train.model.preset_changes``): none for a run from
    ``model.init_from``, or one of a version before runs wrote a model.json."""
    if cfg.model.init_from is not None or not run_dir.model_file.is_file():
        return []
    from train.model import model_config, preset_changes  # (JAX's import: only then)

    built = run_dir.model_config()
    return preset_changes(built, model_config(cfg, built.vocab_size))


def train_args(
    base: pathlib.Path, run: Run, run_dir: pathlib.Path, sets: list[str], resume: bool
) -> list[str]:
    """The ``python -m train`` arguments of one run of the grid."""
    args = ["--config", str(base)] + [x for layer in run.layers for x in ("--config", layer)]
    args += [x for s in [*sets, f"train.seed={run.seed}"] for x in ("--set", s)]
    return args + ["--run-dir", str(run_dir)] + (["--resume"] if resume else [])


# The trainer's command line, before a run's arguments.
TRAIN = [sys.executable, "-m", "train"]


class StopRequest:
    """SIGTERM or SIGINT to the sweep: passed on to the run in progress as SIGTERM (the trainer
    saves and exits 75; in its start-up, with nothing to save yet, it ends at once), and the
    sweep starts no other run. A second signal while the run winds up is passed on too and
    gives the signals back their earlier actions, so a third ends the sweep as before it ran.
    A signal the sweep was started to ignore (a background job's SIGINT) stays ignored."""

    def __init__(self):
        self.signum: int | None = None
        self.child: subprocess.Popen | None = None
        self._old: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # where handlers can be set
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            self.restore()
        self.signum = signum
        self.forward()

    def forward(self) -> None:
        if self.signum is not None and self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)


def launch(args: list[str], stop: StopRequest) -> int | None:
    """Runs ``python -m train ARGS`` and returns its exit status (the sweep's one side effect),
    with ``stop`` passing a signal to the sweep on to it; ``None`` when a signal came before the
    run started."""
    if stop.signum is not None:
        return None
    # A sweep that is killed takes its run with it: SIGTERM, on which the trainer saves and stops.
    child = subprocess.Popen(
        [*TRAIN, *args],
        env=os.environ.copy(),
        preexec_fn=dies_with_parent(signal.SIGTERM),  # noqa: PLW1509 - the sweep starts no thread
    )
    stop.child = child
    stop.forward()  # a signal that came while it started
    try:
        return child.wait()
    finally:
        stop.child = None


def run_grid(base: pathlib.Path, runs: list[Run], out: pathlib.Path, sets: list[str], say=print) -> dict:
    """Runs what is not finished; returns each run's outcome. A preempted run, or one stopped by
    a fault of the machine (a full disk fails the next run too), stops the sweep; so does SIGTERM
    or SIGINT to the sweep, once the run in progress has saved (:class:`StopRequest`)."""
    with StopRequest() as stop:
        return _run_grid(base, runs, out, sets, say, stop)


def _run_grid(base, runs, out, sets, say, stop: StopRequest) -> dict:
    outcomes = {}
    for run in runs:
        run_dir = out / run.name
        state = RunDir(run_dir).state()
        if state in ("completed", "failed"):
            say(f"{run.name}: {state}, skipped")
            outcomes[run.name] = state
            continue
        if stop.signum is not None:
            raise SweepStopped(run.name, EXIT_PREEMPTED, started=False)
        if RunLock.held(run_dir):  # not a run that fails: it would go on beside the next one
            raise UserError(
                f"run dir {run_dir} is in use by {RunLock.holder(run_dir)} (another sweep on "
                f"{out}, or a run of a sweep that was killed); the sweep stops: run it again once "
                "that process has ended"
            )
        args = train_args(base, run, run_dir, sets, state == "resumable")
        say(f"{run.name}: {'resuming' if state == 'resumable' else 'starting'}")
        code = launch(args, stop)
        if code is None:
            raise SweepStopped(run.name, EXIT_PREEMPTED, started=False)
        if code in (EXIT_PREEMPTED, EXIT_IO_ERROR):
            raise SweepStopped(run.name, code)
        if code < 0 and stop.signum is not None:
            if RunDir(run_dir).state() != "completed":  # ended by the signal in its start-up
                raise SweepStopped(run.name, EXIT_PREEMPTED)
            code = 0  # completed, then ended by a second signal (a group's) on its way out
        # A run that finished after the signal (it came during its wrap-up) keeps its outcome;
        # the sweep stops before the next one.
        outcomes[run.name] = "completed" if code == 0 else f"failed (exit {code})"
        if code:
            say(f"{run.name}: failed with exit status {code}; the sweep goes on without it")
    return outcomes


class SweepStopped(Exception):
    """A run of the sweep exited ``EXIT_PREEMPTED`` or ``EXIT_IO_ERROR``, or the sweep was
    signalled: it stops there (``started``: whether ``run`` had started)."""

    def __init__(self, run: str, code: int, started: bool = True):
        super().__init__(run, code)
        self.run, self.code, self.started = run, code, started

    def __str__(self) -> str:
        if not self.started:
            return f"stopped before {self.run}; run the same command again to continue the sweep"
        why = "was interrupted" if self.code == EXIT_PREEMPTED else "stopped on an I/O error (exit 74)"
        return f"{self.run} {why}; run the same command again to continue the sweep"


# ---------------------------------------------------------------------------------------- report


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,  # of one value: none
        "n": len(values),
    }


# An exact permutation test counts every split of the pooled seeds: at most this many (10 + 10
# seeds make 184,756), beyond which no p-value is given.
MAX_SPLITS = 200_000


def permutation_p(a: list[float], b: list[float]) -> float | None:
    """The two-sided p-value of an exact permutation test of the mean of ``a`` against that of
    ``b``: the share of the splits of the pooled values into groups of their sizes whose means
    differ at least as much as the observed split's (itself included), so it is never 0: at
    least 1 / C(n, len(a)), twice that for groups of equal size (0.1 for 3 and 3, and for 2 and
    3). None without a value on each side or with more splits than ``MAX_SPLITS``."""
    if not a or not b or math.comb(len(a) + len(b), len(a)) > MAX_SPLITS:
        return None
    pool, total = a + b, math.fsum(a + b)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    tolerance = 1e-9 * max(1.0, observed)  # the observed split, summed in another order
    as_far = splits = 0
    for chosen in itertools.combinations(pool, len(a)):
        part = math.fsum(chosen)
        splits += 1
        as_far += abs(part / len(a) - (total - part) / len(b)) >= observed - tolerance
    return as_far / splits


def grid_points(runs: list[Run], baseline: str | None = None) -> list[str]:
    """The grid's points in order, once ``baseline`` (when given) is found among them."""
    points = list(dict.fromkeys(r.point for r in runs))
    if baseline is not None and baseline not in points:
        raise UserError(f"--baseline {baseline} is not a grid point ({', '.join(points)})")
    return points


def report(
    out: pathlib.Path, runs: list[Run], baseline: str | None = None, shared: frozenset[str] = frozenset()
) -> dict:
    """The sweep's statistics from its run dirs (only completed runs count; the rest are listed).

    Wall-clock figures come only from the runs that had the machine to themselves: a run that
    shared it (its sessions overlap another completed run's on the same host, or its name is in
    ``shared``, what a caller knows of runs outside this grid) ran slower for it by an amount
    nothing here measures, so its time counts in no mean and no reduction."""
    points = grid_points(runs, baseline)
    baseline = baseline or points[0]
    done, excluded, summaries = _completed(out, runs, points)
    timing = _mark_timing(done, baseline, set(shared).union(*overlaps(summaries)), summaries)
    # Without a completed baseline run there is no target: the final ppl are still reported. The
    # target is the last point of the baseline's mean curve: its seeds' mean final ppl when they
    # end at the same step (else at the last step they all evaluated, which its curve reaches).
    curves = {point: mean_curve(done[point]) for point in points}
    target = curves[baseline][-1]["eval_ppl"] if curves[baseline] else None
    rows = {point: _point_row(done[point], curves[point], target) for point in points}
    _compare_to_baseline(rows, baseline)
    refusals, cautions = problems(summaries) if summaries else ([], [])
    ends = {point: sorted({r["evals"][-1]["step"] for r in done[point]}) for point in points}
    cautions += [
        f"the seeds of {point} end at different steps ({', '.join(map(str, ends[point]))}): their "
        "train.steps, and so their learning-rate schedules, differ"
        for point in points
        if len(ends[point]) > 1
    ]
    result = {
        "baseline": baseline,
        "target_ppl": target,
        "target_step": curves[baseline][-1]["step"] if curves[baseline] else None,
        "baseline_final_steps": ends[baseline],
        "timing_device": timing,
        "points": rows,
        "excluded": excluded,
        "warnings": refusals + cautions,
    }
    with io_operation("writing the sweep's report to", out):
        (out / "report.json").write_text(json.dumps(result, indent=2))
        (out / "report.md").write_text(markdown(result))
        seeds = {point: len(done[point]) for point in points}
        if any(curves.values()):
            timed = {point: rows[point]["timed"] for point in points}
            plot(out / "report.png", curves, seeds, timed, target)
        else:  # no completed run: no empty axes (nor an earlier report's curves)
            (out / "report.png").unlink(missing_ok=True)
    return result


def _completed(out: pathlib.Path, runs: list[Run], points: list[str]) -> tuple[dict, list, list]:
    """``(done, excluded, summaries)``: each point's completed runs with evaluations (``run``,
    ``seed``, ``evals``), the other runs with their status, and the completed runs' summaries
    and evaluation sessions (what :func:`overlaps` and :func:`problems` read)."""
    done, excluded = {p: [] for p in points}, []
    for run in runs:
        run_dir = RunDir(out / run.name)
        status = run_dir.state()
        evals = eval_rows(run_dir)
        if status != "completed" or not evals:
            if status == "failed":  # what stopped it: nan or diverged, and why
                summary = run_dir.summary() or {}
                why = summary.get("stop_reason")
                status = f"{summary.get('status')} ({why})" if why else str(summary.get("status"))
            excluded.append({"run": run.name, "status": status if evals else f"{status}, no evaluation"})
            continue
        done[run.point].append({"run": run.name, "seed": run.seed, "evals": evals})
    summaries = []
    for run in (RunDir(out / r["run"]) for point in points for r in done[point]):
        summary = run.summary() or {}
        seen = evaluation(run, summary)
        summaries.append({"name": run.name, "status": "completed", "summary": summary, "evaluation": seen})
    return done, excluded, summaries


def _mark_timing(done: dict, baseline: str, shared: set[str], summaries: list[dict]) -> str | None:
    """Marks each completed run ``shared``, ``device``, ``elsewhere`` and ``timed``; returns the
    device times compare on. Times compare on one device only: the one most of the baseline's
    timed runs had (without any, most of all timed runs); a run alone on another, or on one it
    does not name, counts in no time either. Where no timed run names its device, none is left
    out for it."""
    devices = {s["name"]: s["summary"].get("device_kind") for s in summaries}
    completed = [r for runs in done.values() for r in runs]
    for r in completed:
        r["shared"], r["device"] = r["run"] in shared, devices[r["run"]]
    timing = most_common([r["device"] for r in done[baseline] if not r["shared"]]) or most_common(
        [r["device"] for r in completed if not r["shared"]]
    )
    for r in completed:
        r["elsewhere"] = timing is not None and r["device"] != timing
        r["timed"] = not r["shared"] and not r["elsewhere"]
    return timing


def _point_row(runs: list[dict], curve: list[dict], target: float | None) -> dict:
    """A grid point's row of the report: its seeds' final ppl, steps and time to ``target``
    (None: no target), and its mean curve's."""
    seeds = []
    for r in runs:
        step, wall = reach(r["evals"], target) if target is not None else (None, None)
        seeds.append(
            {
                "seed": r["seed"],
                "final_ppl": r["evals"][-1]["eval_ppl"],
                "steps": step,
                "time_s": wall if r["timed"] else None,
                "timed": r["timed"],
                "shared": r["shared"],
                "device": r["device"],
                "elsewhere": r["elsewhere"],
            }
        )
    step, wall = reach(curve, target) if target is not None else (None, None)
    return {
        "final_ppl": _stats([s["final_ppl"] for s in seeds]),
        "mean_curve": {"steps_to_target": step, "time_to_target_s": wall},
        "steps_to_target": _stats([s["steps"] for s in seeds if s["steps"] is not None]),
        "time_to_target_s": _stats([s["time_s"] for s in seeds if s["time_s"] is not None]),
        "reached": sum(s["steps"] is not None for s in seeds),
        "timed": sum(s["timed"] for s in seeds),
        "seeds": seeds,
    }


def _compare_to_baseline(rows: dict, baseline: str) -> None:
    """Adds each row's p-value of its final ppl against the baseline's, and its mean curve's
    reductions of steps and time to the target."""
    finals = {point: [s["final_ppl"] for s in row["seeds"]] for point, row in rows.items()}
    for point, row in rows.items():
        row["final_ppl_p"] = None if point == baseline else permutation_p(finals[point], finals[baseline])
    base = rows[baseline]["mean_curve"]
    for row in rows.values():
        for key, red in (
            ("steps_to_target", "step_reduction_pct"),
            ("time_to_target_s", "time_reduction_pct"),
        ):
            m, b = row["mean_curve"][key], base[key]
            row[red] = reduction_pct(m, b) if m is not None and b else None


def most_common(devices: list[str | None]) -> str | None:
    """The device most of ``devices`` name (the first named of those tied), unnamed ones (None)
    left out; None where none is named."""
    named = [d for d in devices if d is not None]
    return max(named, key=named.count) if named else None


def mean_curve(seeds: list[dict]) -> list[dict]:
    """A grid point's eval curve averaged over its completed seeds, at the evaluation steps every
    seed has: ``step``, ``eval_ppl`` (mean), ``ppl_std`` (over seeds; 0 for one), ``wall_s`` (the
    mean over the seeds that had the machine to themselves, ``timed`` not false; None without one).
    At the last step the mean is the point's mean final ppl, computed in the same order."""
    if not seeds:
        return []
    by_step = [{r["step"]: r for r in reversed(s["evals"])} for s in seeds]  # a step's first row
    timed = [s.get("timed", True) for s in seeds]
    curve = []
    for step in sorted(set.intersection(*(set(rows) for rows in by_step))):
        rows = [seed[step] for seed in by_step]
        ppl = [r["eval_ppl"] for r in rows]
        walls = [r["wall_s"] for r, t in zip(rows, timed, strict=True) if t]
        curve.append(
            {
                "step": step,
                "eval_ppl": statistics.fmean(ppl),
                "ppl_std": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
                "wall_s": statistics.fmean(walls) if walls else None,
            }
        )
    return curve


def _pm(s: dict, fmt: str = ".2f") -> str:
    """``mean ± std``; the value alone for one run (its spread is unknown, not 0)."""
    if s["mean"] is None:
        return "-"
    return f"{s['mean']:{fmt}}" if s["std"] is None else f"{s['mean']:{fmt}} ± {s['std']:{fmt}}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def _num(v, fmt: str) -> str:
    return "-" if v is None else f"{v:{fmt}}"


def _target_line(result: dict) -> str:
    """The report's first line: what the target is, or why there is none."""
    baseline, ppl, ends = result["baseline"], result["target_ppl"], result["baseline_final_steps"]
    if ppl is None:
        return (
            f"No target: the baseline `{baseline}` has no completed run yet, so steps and time to "
            "target are not computed (final ppl only)"
        )
    if len(ends) == 1:
        return f"Target: the mean final eval ppl of `{baseline}` = {ppl:.3f}"
    return (
        f"Target: the mean eval ppl of `{baseline}` at step {result['target_step']}, the last its seeds "
        f"all evaluated (they end at steps {', '.join(map(str, ends))}) = {ppl:.3f}"
    )


def _seed_text(s: dict, has_target: bool) -> str:
    """A seed's part of the per-seed line: its final ppl, and its steps and seconds to the target
    (or why it has none)."""
    if s["time_s"] is not None:
        reached = f"{s['steps']} steps, {s['time_s']:.1f} s"
    elif s["steps"] is not None:
        device = s["device"] or "a device it does not name"
        why = " and ".join(["shared the machine"] * s["shared"] + [f"ran on {device}"] * s["elsewhere"])
        reached = f"{s['steps']} steps ({why}: no time)"
    else:
        reached = "target not reached" if has_target else "no target"
    return f"seed {s['seed']}: ppl {s['final_ppl']:.3f}, {reached}"


def markdown(result: dict) -> str:
    lines = [
        _target_line(result),
        "",
        "Steps and time (`wall_s`) to the target are those of the first evaluation at which a "
        "point's mean curve (its eval ppl averaged over its seeds at each evaluation) is at or "
        "below it, with no interpolation between evaluations; the reductions come from them. The "
        "per-seed columns are the mean ± std (the sample standard deviation, n - 1, as everywhere "
        "here) over the seeds that reach the target on their own, each at its first evaluation at "
        "or below it (`runs`: how many did). Times come from "
        "the runs that had the machine to themselves (`timed`): a run that shared it with "
        "another ran slower for it, by an amount nothing here measures. The mean curve's time at "
        "a step is the mean wall-clock of the point's timed seeds there. `p`: whether the final ppl "
        "differs from the baseline's more than its seeds do, the two-sided p-value of an exact "
        "permutation test of the two means over the seeds; with few seeds it cannot be small: at "
        "least 1 / C(n, k) for k seeds against n - k, twice that where k = n - k (0.1 for 3 against "
        "3, and for 2 against 3)."
        + (
            f" All times are {result['timing_device']}'s, the device the baseline's timed runs had "
            "(else most timed runs): a run on another device counts in no time."
            if result.get("timing_device")
            else ""
        ),
        "",
        "| point | runs | final ppl | p | steps to target | step reduction | per seed | time to target (s) "
        "| time reduction | per seed (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for point, row in result["points"].items():
        curve = row["mean_curve"]
        lines.append(
            f"| {point} | {row['final_ppl']['n']} ({row['reached']} reached, {row['timed']} timed) | "
            f"{_pm(row['final_ppl'], '.3f')} | {_num(row.get('final_ppl_p'), '.2f')} | "
            f"{_num(curve['steps_to_target'], 'd')} | {_pct(row['step_reduction_pct'])} | "
            f"{_pm(row['steps_to_target'], '.0f')} | "
            f"{_num(curve['time_to_target_s'], '.1f')} | {_pct(row['time_reduction_pct'])} | "
            f"{_pm(row['time_to_target_s'], '.1f')} |"
        )
    lines += ["", "Per seed (final ppl, steps and seconds to the target):", ""]
    seeds = [s for row in result["points"].values() for s in row["seeds"]]
    for point, row in result["points"].items():
        per = "; ".join(_seed_text(s, result["target_ppl"] is not None) for s in row["seeds"])
        lines.append(f"- {point}: {per or 'none completed'}")
    shared, elsewhere = sum(s["shared"] for s in seeds), sum(s["elsewhere"] for s in seeds)
    if shared:
        lines += ["", f"{shared} completed run(s) shared the machine and count in no time."]
    if elsewhere:
        lines += [
            "",
            f"{elsewhere} completed run(s) ran on another device than {result['timing_device']} "
            "and count in no time.",
        ]
    if result["excluded"]:
        lines += ["", "Not in the statistics:", ""]
        lines += [f"- {e['run']}: {e['status']}" for e in result["excluded"]]
    if result["warnings"]:
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in result["warnings"]]
    return "\n".join(lines) + "\n"


def plot(path: pathlib.Path, curves: dict, seeds: dict, timed: dict, target: float | None = None) -> None:
    """Each point's mean curve (``curves``, over its ``seeds``) with its band, against steps and
    against the wall-clock of its ``timed`` seeds (none: not drawn), labelled with both numbers;
    the target ppl as a dashed line."""
    fig = figure("report.png", figsize=(12, 4.5))
    if fig is None:
        return
    axes = fig.subplots(1, 2)
    for i, (point, curve) in enumerate(curves.items()):
        if not curve:
            continue
        steps, wall = [c["step"] for c in curve], [c["wall_s"] for c in curve]
        mean, std = [c["eval_ppl"] for c in curve], [c["ppl_std"] for c in curve]
        # No wall-clock curve for a point whose runs all shared the machine.
        panels = [(axes[0], steps, f"{point} (n={seeds[point]})")]
        if None not in wall:
            panels.append((axes[1], wall, f"{point} (n={seeds[point]}, timed {timed[point]})"))
        for ax, x, text in panels:
            color = f"C{i % 10}"  # a point's colour in both panels
            ax.plot(x, mean, color=color, label=text)
            ax.fill_between(
                x,
                [m - s for m, s in zip(mean, std, strict=True)],
                [m + s for m, s in zip(mean, std, strict=True)],
                color=color,
                alpha=0.2,
            )
    for ax, label in zip(axes, ("step", "wall-clock (s, mean over the timed seeds)"), strict=True):
        if target is not None and ax.has_data():
            ax.axhline(target, color="0.3", linestyle="--", linewidth=1, label=f"target {target:.3f}")
        ax.set_xlabel(label)
        ax.set_ylabel("eval ppl (mean ± std over seeds)")
        ax.set_yscale("log")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.sweep",
        description="Run a grid of config layers x seeds and report each grid point's final ppl, and its "
        "steps and time to the baseline's, over the seeds.",
    )
    parser.add_argument("--base", required=True, type=pathlib.Path, help="the base config file")
    parser.add_argument(
        "--axis", action="append", default=[], help="DIR/a,b,c: config layers beside the base"
    )
    parser.add_argument("--seeds", default="0", help="comma-separated train.seed values (default: 0)")
    add_config_arguments(parser, config=False)
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="the sweep dir (default runs/sweep-BASE)"
    )
    parser.add_argument(
        "--baseline", default=None, help="the grid point whose final ppl is the target (default: the first)"
    )
    parser.add_argument("--report-only", action="store_true", help="write the report from what has run")
    args = parser.parse_args(argv)
    return cli(lambda: _sweep(args, args.out or pathlib.Path("runs") / f"sweep-{args.base.stem}"))


def _sweep(args, out: pathlib.Path) -> int:
    """Every check first (the arguments, each run's config, the runs already in ``out``); then
    the runs, then the report."""
    if not args.base.is_file():
        raise UserError(f"--base: config file not found: {args.base}")
    check_directory_path(out, "--out")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--seeds expects comma-separated integers, got {args.seeds!r}") from None
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise UserError(f"--seeds {args.seeds}: seed {twice[0]} is given more than once")
    runs = expand(args.base, args.axis, seeds or [0])
    grid_points(runs, args.baseline)
    if not args.report_only:  # a report reads the runs as they are, on any machine
        configs = run_configs(args.base, runs, args.overrides)
        check_reuse(out, runs, configs)
        check_starts(runs, out, configs)
    elif args.overrides:
        warnings.warn(
            f"--report-only reads no --set ({' '.join(args.overrides)}): the report is of the runs "
            f"in {out} as they were made",
            stacklevel=2,
        )
    make_directory(out, "--out", "making the sweep's directory")
    if not args.report_only:  # the grid as it was run: a report alone leaves it as it is
        grid = {"base": str(args.base), "axes": args.axis, "seeds": seeds, "sets": args.overrides}
        with io_operation("writing the sweep's grid to", out):
            (out / "sweep.json").write_text(json.dumps(grid, indent=2))
        try:
            outcomes = run_grid(args.base, runs, out, args.overrides)
        except SweepStopped as e:
            print(f"{'error: ' if e.code == EXIT_IO_ERROR else ''}{e}", file=sys.stderr)
            return e.code
        failed = {k: v for k, v in outcomes.items() if v != "completed"}
        if failed:
            print(f"{len(failed)} run(s) did not complete: {failed}")
    result = report(out, runs, args.baseline)
    print((out / "report.md").read_text(), end="")
    return 0 if not result["excluded"] else 1


if __name__ == "__main__":
    sys.exit(main())
