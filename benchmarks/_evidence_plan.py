"""The evidence runner's plan and its duration estimates (``benchmarks/evidence.py``): the plan
file's runs in order and their configs, and how long a run should take from the finished runs'
measured times, alone or sharing the device, and how many runs to share it with. Nothing here
starts a process."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable

import yaml

from train import sweep
from train.errors import UserError, yaml_problem
from train.rundir import CONFIG, METRICS, SUMMARY, RunDir, dedupe_by_step, read_metrics

SCRATCH = ".evidence"  # run dirs on the GPU machine
RUNNER_FILE = "runner.json"  # the runner's record of a run: process wall time, concurrency, versions
# Duration estimates: a margin for a run of another kind than the measured one (mode, optimizer,
# host, decomposition, allocation), and seconds kept back at the end of the budget to stop and pack.
OTHER_KIND = 1.3
RESERVE_S = 15.0
# ``--concurrent auto``: the numbers of runs sharing the device it measures, in this order (up to
# ``--max-concurrent``); a level is taken over the one below it only where the training runs it
# measured take ``PAYS`` times fewer device-seconds per step. ``MEMORY``: the share of the
# device's memory the runs split between them (``XLA_PYTHON_CLIENT_MEM_FRACTION``).
LEVELS = (1, 2, 3, 4)
PAYS = 1.1
MEMORY = 0.9
# An estimate at a level not measured yet takes the device-seconds per step of the nearest level
# below it that was, times this margin (sharing more is assumed to gain nothing more, and to lose
# at most this much).
UNMEASURED = 1.1


# ------------------------------------------------------------------------------------------ plan


@dataclasses.dataclass(frozen=True)
class Planned:
    experiment: str
    run: sweep.Run
    timed: bool = True  # its grid point needs a run alone for the report's times (``needs_alone``)

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.run.name}"


@dataclasses.dataclass(frozen=True)
class Plan:
    base: pathlib.Path
    results: str  # relative to the root
    estimate_s: dict
    runs: list[Planned]
    reports: list[dict]


def load_plan(path: pathlib.Path) -> Plan:
    """The plan file: its runs in order (duplicates dropped), reports and estimates. Its form is
    checked here, each mistake one line naming the plan, before any command does its work."""
    if not path.is_file():
        raise UserError(f"plan file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"plan {path} is not valid YAML{yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"plan {path} must hold a mapping (base, results, runs, ...), got {data!r}")
    missing = [k for k in ("base", "results", "runs") if k not in data]
    if missing:
        raise UserError(f"plan {path}: missing key(s) {missing}")
    kinds = {"base": str, "results": str, "runs": list, "reports": list, "estimate_s": dict}
    for key, kind in kinds.items():
        if key in data and not isinstance(data[key], kind):
            raise UserError(f"plan {path}: {key} must be a {kind.__name__}, got {data[key]!r}")
    for kind, seconds in data.get("estimate_s", {}).items():
        if kind not in ("train", "profile"):
            raise UserError(f"plan {path}: estimate_s has train and profile, not {kind!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            raise UserError(f"plan {path}: estimate_s.{kind} must be a positive number, got {seconds!r}")
    base = path.resolve().parent / data["base"]
    if not base.is_file():
        raise UserError(f"plan {path}: base config not found: {base}")
    runs, seen = [], set()
    for entry in [*data["runs"], *data.get("reports", [])]:
        check_entry(path, entry)
    for entry in data["runs"]:
        if not isinstance(entry.get("timed", True), bool):
            raise UserError(f"plan {path}: timed must be true or false, got {entry['timed']!r} in {entry}")
    for entry in data["runs"]:
        for run in sweep.expand(base, entry["axes"], entry["seeds"]):
            planned = Planned(entry["experiment"], run, entry.get("timed", True))
            if planned.name not in seen:
                seen.add(planned.name)
                runs.append(planned)
    for entry in data.get("reports", []):  # a report's grid and baseline, before any run or unpack
        try:
            sweep.grid_points(sweep.expand(base, entry["axes"], entry["seeds"]), entry.get("baseline"))
        except UserError as e:
            raise UserError(f"plan {path}: report {entry['experiment']}: {e}") from None
    estimate_s = {"train": 600.0, "profile": 600.0, **data.get("estimate_s", {})}
    return Plan(base, data["results"], estimate_s, runs, data.get("reports", []))


def check_entry(path: pathlib.Path, entry) -> None:
    """A run or report of the plan: experiment (a folder name), axes (config layers, as
    ``train.sweep --axis`` takes them) and seeds (whole numbers >= 0, each once)."""
    if not isinstance(entry, dict) or not {"experiment", "axes", "seeds"} <= set(entry):
        raise UserError(f"plan {path}: each run and report needs experiment, axes and seeds: {entry}")
    if not isinstance(entry["experiment"], str) or not entry["experiment"]:
        raise UserError(f"plan {path}: experiment must be a folder name, got {entry['experiment']!r}")
    axes, seeds = entry["axes"], entry["seeds"]
    if not isinstance(axes, list) or not all(isinstance(a, str) for a in axes):
        raise UserError(f"plan {path}: axes must be a list of DIR/a,b strings, got {axes!r} in {entry}")
    ints = isinstance(seeds, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    if not ints or not all(s >= 0 for s in seeds) or len(set(seeds)) < len(seeds):
        raise UserError(f"plan {path}: seeds must be whole numbers >= 0, each once, got {seeds!r} in {entry}")


def run_config(plan: Plan, planned: Planned) -> dict:
    """The resolved config of a planned run (validated, as ``python -m train`` resolves it)."""
    return sweep.run_config(plan.base, planned.run)


def differs_from_plan(plan: Plan, planned: Planned, config: dict, resolved=None) -> list[str]:
    """The settings a run's saved ``config`` has other than the plan now gives it (``key: old ->
    new``), as a sweep compares them (``train.sweep.check_reuse``: not how it was split over
    devices or what it recorded along the way); ``resolved``: the planned run's ``RunConfig``,
    where the caller has it."""
    from train.config import changed_settings, to_dict

    wanted = to_dict(resolved) if resolved is not None else run_config(plan, planned)
    return [str(c) for c in changed_settings(config, wanted, ignoring=sweep.OPERATIONAL)]


def check_finished_runs(plan: Plan, root: pathlib.Path) -> None:
    """Refuses, in one line, run dirs of the plan (committed, or on this machine) whose config
    differs from the plan's for them, or whose model (``model.json``) is not the one its preset
    makes now: they would be skipped as done and reported as this plan's (a base config edited
    after runs were committed, a rehearsal's runs left in place, a preset defined otherwise)."""
    stale = []
    for planned in plan.runs:
        resolved = None  # (resolved once per planned run, where a run dir holds one)
        for run_dir in (root / plan.results, root / SCRATCH / "runs"):
            run = RunDir(run_dir / planned.experiment / planned.run.name)
            if run.state() != "new" and run.config_file.is_file():
                resolved = resolved or sweep.load_run(plan.base, planned.run)
                changed = differs_from_plan(plan, planned, run.config(), resolved)
                changed = changed or [str(c) for c in sweep.preset_changed(run, resolved)]
                if changed:
                    stale.append(
                        f"{run.path} ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})"
                    )
    if stale:
        raise UserError(
            f"{len(stale)} run dir(s) of the plan hold runs of other settings than it gives them now: "
            f"{'; '.join(stale)}; remove them, or restore the plan's configs"
        )


def kind_of(config: dict) -> tuple:
    """What a run's time per step depends on besides the model and batch: mode and optimizer
    (the allocation only as uniform ranks or moved ones: which modules give and take rank hardly
    changes a step)."""
    o = config["optimizer"]
    moved = "uniform" if o["rank_allocation"] == "uniform" else "allocated"
    return (config["mode"], o["name"], o["host"], o["decompose"], moved)


def steps_of(config: dict) -> int:
    t = config["train"]["steps"]
    return min(t, config["profile"]["steps"]) if config["mode"] == "profile" else t


# ------------------------------------------------------------------------------------- estimates


@dataclasses.dataclass(frozen=True)
class Measured:
    """A finished run's times: the process's wall time and the loop's seconds per step (evals
    included), measured at ``concurrency`` runs sharing the device (``Runner.share``)."""

    name: str
    kind: tuple
    steps: int
    wall_s: float
    per_step_s: float
    concurrency: float
    device: str


def measure(run_dir: pathlib.Path) -> Measured | None:
    """The times of a completed run the runner ran in one go (None otherwise)."""
    try:
        runner = json.loads((run_dir / RUNNER_FILE).read_text())
        summary = json.loads((run_dir / SUMMARY).read_text())
        config = yaml.safe_load((run_dir / CONFIG).read_text())
        rows = read_metrics(run_dir / METRICS)
    except (OSError, ValueError):
        return None
    if summary.get("status") != "completed" or runner.get("resumed") or not runner.get("wall_s"):
        return None
    train = dedupe_by_step(rows, "loss")
    steps = int(summary["steps"])
    if not train or steps <= train[0]["step"]:
        return None
    end = max(r["wall_s"] for r in rows if "wall_s" in r)
    per_step = (end - train[0]["wall_s"]) / (steps - train[0]["step"])
    return Measured(
        run_dir.name,
        kind_of(config),
        steps,
        float(runner["wall_s"]),
        per_step,
        float(runner.get("concurrency", 1)),  # 1 in a record without it
        str(summary.get("device_kind")),
    )


def estimate(
    kind: tuple,
    steps: int,
    concurrency: int,
    measured: list[Measured],
    default_s: float,
    safety: float,
    costs: dict[int, float] | None = None,
) -> tuple[float, str]:
    """Seconds a run should take, and on what basis: a fixed part (start-up, compilation, the last
    checkpoint) plus ``steps`` x a finished run's seconds per step, times ``OTHER_KIND`` for
    another kind of run and times ``share_factor`` for ``concurrency`` runs sharing the device
    (from ``costs``, the device-seconds per step measured at each level, ``sharing_costs``; without
    them no gain from sharing is assumed); the largest such sum over the finished runs of the same
    kind (else of the same mode, else over all), of those measured at ``concurrency`` runs sharing
    the device where there are any, times ``safety``. Without any: ``default_s x concurrency x
    safety``.

    The fixed part is the largest of those runs' at any level: a run whose program an earlier one
    compiled starts sooner, from XLA's cache, and another learning rate is another program. A
    fixed part measured among more runs sharing the device than ``concurrency`` is scaled down
    as its steps are, and otherwise kept as measured: on the H100 the fixed parts took 86-89 s
    three at a time and 13-45 s in training runs alone or two at a time."""
    same = [m for m in measured if m.kind == kind]
    pool = same or [m for m in measured if m.kind[0] == kind[0]] or measured
    if not pool:
        basis = f"the plan's estimate x {concurrency} x {safety} (no run finished yet)"
        return default_s * concurrency * safety, basis
    fixed = max(
        max(0.0, m.wall_s - m.steps * m.per_step_s)
        * min(1.0, share_factor(m.concurrency, concurrency, costs or {}))
        for m in pool
    )
    level = [m for m in pool if level_of(m.concurrency) == concurrency]
    guesses = []
    for m in level or pool:
        share = share_factor(m.concurrency, concurrency, costs or {})
        other = 1.0 if m.kind == kind else OTHER_KIND
        guesses.append((fixed + steps * m.per_step_s * other * share) * safety)
    what = "the same kind" if same else "other kinds"
    at = f", measured {concurrency} at a time" if level and concurrency > 1 else ""
    return max(guesses), f"{len(level or pool)} finished run(s) of {what}{at}"


def share_factor(met: float, concurrency: int, costs: dict[int, float]) -> float:
    """How many times longer a step takes with ``concurrency`` runs sharing the device than in a
    run that met ``met`` runs (its recorded concurrency, ``level_of`` which is its level): the
    run's own device-seconds per step (its step over ``met``) scaled by the level costs,
    ``concurrency x cost(concurrency) / (met x cost(its level))``, the costs being the
    device-seconds per step measured at each level (``sharing_costs``). At a level not measured,
    the cost of the nearest measured level below it times ``UNMEASURED``, but never more than with
    no gain over the run's own sharing (``concurrency / met``). Where its level's cost or any lower
    level's is unknown (or it met no one level for long): that no gain, at least 1."""
    no_gain = max(1.0, concurrency / met)
    at = level_of(met)
    below = [n for n in costs if n < concurrency]
    if at not in costs or (concurrency not in costs and not below):
        return no_gain
    if concurrency in costs:
        return concurrency * costs[concurrency] / (met * costs[at])
    return min(no_gain, concurrency * costs[max(below)] * UNMEASURED / (met * costs[at]))


def level_of(concurrency: float) -> int | None:
    """The number of runs a run shared the device with (its recorded concurrency rounded), or None
    for one that met different numbers for long (e.g. half its time alone)."""
    n = round(concurrency)
    return n if n >= 1 and abs(concurrency - n) <= 0.25 else None


def alone_record(run_dir: pathlib.Path, finished: bool = True) -> dict | None:
    """The runner's record of a completed run (any attempt, ``finished=False``) where it says the
    run had the device to itself the whole time, in every attempt (``shared`` false; a
    concurrency of 1 in a record without it), so that its wall-clock times count in the report
    (``shared_device``); else None."""
    try:
        record = json.loads((run_dir / RUNNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (finished and record.get("status") != "completed"):
        return None
    concurrency = record.get("concurrency", 1)
    alone = isinstance(concurrency, (int, float)) and concurrency <= 1
    alone = not record["shared"] if isinstance(record.get("shared"), bool) else alone
    return record if alone else None


def ran_alone(run_dir: pathlib.Path, device: str | None = None, finished: bool = True) -> bool:
    """Whether ``run_dir``'s run had the device to itself (``alone_record``), on ``device`` when
    given."""
    record = alone_record(run_dir, finished)
    return record is not None and (device is None or record.get("device") == device)


def timed_points(plan: Plan, alone: Callable[[Planned], bool]) -> set[tuple[str, str]]:
    """The grid points ``(experiment, point)`` of which a planned run ran alone (``alone``: where
    its records are looked for, ``ran_alone``): the points the report can time."""
    return {(p.experiment, p.run.point) for p in plan.runs if alone(p)}


def report_points(plan: Plan, experiment: str) -> tuple[list[str], str]:
    """The grid points of ``experiment``'s report and its baseline point (the report's
    ``baseline``, else its first point, as ``train.sweep.report`` takes it); without a report,
    the points of the experiment's runs in the plan, the first of them the baseline."""
    for rep in plan.reports:
        if rep["experiment"] == experiment:
            points = sweep.grid_points(sweep.expand(plan.base, rep["axes"], rep["seeds"]))
            return points, rep.get("baseline") or points[0]
    points = list(dict.fromkeys(p.run.point for p in plan.runs if p.experiment == experiment))
    return points, points[0]


def timing_device(
    plan: Plan,
    experiment: str,
    alone: Callable[[Planned], dict | None],
    report: tuple[list[str], str] | None = None,
) -> str | None:
    """The device ``experiment``'s report times it on, by the report's rule
    (``train.sweep.report``): the one most of its baseline point's runs that had a device to
    themselves had (``alone``: a run's ``alone_record``, where it is looked for), else most of its
    report's runs that did; None before any did. ``report``: its ``report_points``, if known."""
    points, baseline = report or report_points(plan, experiment)
    runs = [p for p in plan.runs if p.experiment == experiment and p.run.point in points]
    devices = {p: record.get("device") for p in runs if (record := alone(p)) is not None}
    return sweep.most_common([d for p, d in devices.items() if p.run.point == baseline]) or sweep.most_common(
        list(devices.values())
    )


def sharing_costs(measured: list[Measured]) -> dict[int, float]:
    """Device-seconds per training step at each number of runs sharing the device that finished
    training runs measured: a run's seconds per step over its concurrency, averaged over a level's
    runs. The lower, the more steps (runs) per minute."""
    found: dict[int, list[float]] = {}
    for m in measured:
        n = level_of(m.concurrency)
        if m.kind[0] == "train" and n is not None:
            found.setdefault(n, []).append(m.per_step_s / m.concurrency)
    return {n: sum(v) / len(v) for n, v in sorted(found.items())}


def describe_costs(costs: dict[int, float]) -> str:
    """``1 at a time 0.071 s, 2 at a time 0.045 s (1.58x)``: each level's device-seconds per step,
    and its speed over one at a time."""
    parts = []
    for n, c in costs.items():
        gain = f" ({costs[1] / c:.2f}x)" if n > 1 and 1 in costs else ""
        parts.append(f"{n} at a time {c:.4g} s{gain}")
    return ", ".join(parts) or "none"


def choose_level(costs: dict[int, float], most: int) -> tuple[int, str]:
    """``--concurrent auto``'s number of runs sharing the device, and why: the levels (``LEVELS``
    up to ``most``) in order, each measured while the one before it paid (``PAYS``); then the
    fastest measured, a higher one only where it pays over the lower."""
    levels = [n for n in LEVELS if n < most] + [most]
    best, last = None, None
    for n in levels:
        if n not in costs:
            if best is None or best == last:
                what = "no training run measured yet" if best is None else describe_costs(costs)
                return n, f"{n} at a time, to measure it ({what})"
            break
        if best is None or costs[n] * PAYS <= costs[best]:
            best = n
        last = n
    return best, f"{best} at a time, the fastest measured ({describe_costs(costs)})"
