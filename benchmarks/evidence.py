"""Issue 21's evidence (MoARa against GaLore at 60M with seeds) in short pieces of GPU time whose
results accumulate in the repository.

    python benchmarks/evidence.py stage [--shared ../shared/data]   # here: .data/ and .whl/
    python benchmarks/evidence.py run --budget-s 540 --out $OUT [--concurrent auto|N]   # the GPU machine
    python benchmarks/evidence.py unpack evidence.tar.gz             # here: runs in, reports out
    python benchmarks/evidence.py report                            # reports from what is here
    python benchmarks/evidence.py status                            # each planned run's state

A plan (``configs/experiments/wiki60m/plan.yaml``) lists the runs in order, as small
``train.sweep`` grids (run dirs ``RESULTS/EXPERIMENT/POINT-seedS``), and the reports to write.
This file is the command line, the staging and the reports; ``_evidence_plan.py`` reads the plan
and estimates durations, ``_evidence_runner.py`` is what ``run`` runs on the GPU machine.

``stage`` copies the input files the plan's base config names under ``.data/`` from the
workplace's shared data folder, downloads the wheels a bare GPU machine lacks into ``.whl/``, and
prints the size of what a GPU command would take along (at most 64 MiB).

``run`` is the one command on a bare GPU machine, from the repository root: it installs the
carried wheels that are missing, builds the token store with all cores (``train.prepare``, given
what is left of the budget), then runs the plan's next unfinished runs, ``--concurrent`` at a time
sharing the GPU: ``auto`` (the default) runs one at a time, then two, three and four while each
step up measurably paid, and keeps the fastest level measured (``choose_level``); but the first
training run of a grid point none of whose runs has had the device to itself runs alone, nothing
beside it (``Runner.needs_alone``; ``--no-timing-runs``: never), because the report's wall-clock
times come from such runs alone (``shared_device``), and from one device: an experiment whose
runs were timed on another device than this machine's has no timing run here. A run is started
only when its estimated duration fits in what is left of ``--budget-s`` (estimated from finished
runs' measured times, scaled by the gain from sharing measured so far, else from the plan's
deliberately generous ``estimate_s``, both times ``--safety``); at the end of the budget the runs
still going are stopped (SIGTERM: they save a checkpoint) and the runner exits. A stopped run is
lost in practice: checkpoints never come back in the archive, and this workplace gives the GPU
machine back 30 s after a call, so only a next call that finds the same machine still warm
resumes it (its estimate: the steps after its newest checkpoint).
After two runs in a row end without a result no run is started, but those running go on to the
end; an error stops and records what runs and still packs what finished. Runs go to
``.evidence/runs`` (git-ignored); runs already finished in ``RESULTS`` (committed) or there are
skipped. The runs share an XLA compilation cache (``.evidence/xla-cache``): the seeds of a
condition compile one program; the token store goes to ``.evidence/cache`` (``MOARA_JAX_CACHE``,
unless set), not the home directory. After each finished run, the small files of every finished run
(``PACKED``; never checkpoints) and the session's record go into one archive,
``OUT/evidence.tar.gz``, beside the log ``OUT/evidence.log``, so a command cut short loses no
finished run. The log ends with a table: each run's status, wall time, final ppl and tokens/s.

``unpack`` puts an archive's runs into ``RESULTS`` (a run already finished there is kept, a run
the plan does not have is left out and named) and writes the reports: ``train.sweep``'s report
(``report.md``, ``report.json``, ``report.png``) per experiment, and ``profile.md`` (``S_tau``
order against the paper's Table 5, ``tab:profiling_length``) for profiling runs. A run whose
config is not what the plan now gives it would count as done and be reported as the plan's: an
archive holding one is refused whole, and ``stage``, ``status``, ``run``, ``unpack`` and
``report`` refuse such run dirs in place.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile

CODE = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CODE))

import yaml  # noqa: E402
from _evidence_plan import (  # noqa: E402  (this script's folder: sys.path[0])
    LEVELS,
    RUNNER_FILE,
    SCRATCH,
    Plan,
    alone_record,
    check_finished_runs,
    choose_level,
    describe_costs,
    differs_from_plan,
    estimate,
    kind_of,
    load_plan,
    measure,
    ran_alone,
    run_config,
    sharing_costs,
    steps_of,
    timed_points,
    timing_device,
)
from _evidence_runner import ARCHIVE, FINISHED, LOG, ORIGINAL_ENV, PACKED, WHEELS, Log, Runner  # noqa: E402

from train import sweep  # noqa: E402
from train.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from train.rundir import (  # noqa: E402
    ALIGNMENT,
    ALLOCATION,
    CONFIG,
    RunDir,
    check_directory_path,
)

DEFAULT_PLAN = CODE / "configs" / "experiments" / "wiki60m" / "plan.yaml"
DATA = ".data"  # the inputs the configs name (relative to the root); carried to the GPU machine
# The wheels a bare GPU machine lacks (.library/device/KINDS.md lists what it has): grain and the
# two of its requirements that are not there. Python 3.12, manylinux x86_64.
WHEELS_SCRIPT = CODE / "benchmarks" / "gpu_wheels.sh"  # the GPU sessions' one wheel set
TRAVEL_LIMIT_MIB = 64
# Table 5 of the paper (Llama 2 350M, 1k-step profile; `tab:profiling_length` in its source):
# S_tau per module type, highest first.
PAPER_S_TAU = {"v": 0.959, "o": 0.932, "up": 0.922, "gate": 0.921, "q": 0.899, "k": 0.885, "down": 0.819}


def cmd_run(args) -> int:
    plan = load_plan(pathlib.Path(args.plan))
    root = pathlib.Path(args.root).resolve()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args, plan, root, None)
    say = Log(out / LOG, runner.t0)
    runner.say = say

    def stop(signum, frame):
        runner.stop_requested = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sharing = f"auto, up to {args.max_concurrent}" if args.concurrent == "auto" else args.concurrent
    say(f"plan {args.plan}; budget {runner.budget:.0f}s; runs at a time: {sharing}; root {root}")
    try:
        check_finished_runs(plan, root)
        runner.setup()
    except UserError as e:  # in the archived log too, beside the session's record
        say(f"error: {e}")
        runner.pack()
        raise
    runner.loop()
    runner.table()
    runs = runner.pack()  # again: the archived log ends with the table
    say(f"archive: {out / ARCHIVE} ({runs} finished run(s) of this machine)")
    return 0


# ---------------------------------------------------------------------------------- stage here


def checkout_files(root: pathlib.Path, tracked: bool = True) -> list[bytes]:
    """The files of the git checkout at ``root`` that a GPU command takes along (tracked, unless
    ``tracked`` is false, and untracked but not ignored); a ``root`` that is no checkout is one
    line."""
    which = ["--cached", "--others"] if tracked else ["--others"]
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", *which, "--exclude-standard"], capture_output=True
        )
    except OSError as e:
        raise UserError(f"git, which lists what a GPU command takes along, did not run: {e}") from None
    if listed.returncode:
        raise UserError(f"--root {root} is not a git checkout: {listed.stderr.decode().strip()[-300:]}")
    return listed.stdout.split(b"\0")


def travel_size(root: pathlib.Path, carried: list[str]) -> dict:
    """Bytes a GPU command takes along: the tracked and untracked-not-ignored files, and the
    carried folders."""
    listed = checkout_files(root)
    tree = sum((root / p.decode()).stat().st_size for p in listed if p and (root / p.decode()).is_file())
    sizes = {"tree": tree}
    for folder in carried:
        files = [p for p in (root / folder).rglob("*") if p.is_file()] if (root / folder).is_dir() else []
        sizes[folder] = sum(p.stat().st_size for p in files)
    return sizes


def data_inputs(config) -> list[str]:
    """The input patterns of a data section (train, validation, tokenizer)."""
    d = config.data
    return [*d.paths, *d.validation_paths] + ([d.tokenizer] if d.tokenizer != "bytes" else [])


def cmd_stage(args) -> int:
    from train.config import load_config

    plan = load_plan(pathlib.Path(args.plan))
    root = pathlib.Path(args.root).resolve()
    shared = pathlib.Path(args.shared)
    checkout_files(root)  # before any copy: what is staged must travel from a checkout
    check_finished_runs(plan, root)  # here, not on the GPU machine
    copied = 0
    for pattern in data_inputs(load_config([str(plan.base)])):
        rel = pathlib.PurePosixPath(pattern)
        if rel.parts[0] != DATA:
            raise UserError(f"the plan's data input {pattern} is not under {DATA}/: nothing to stage")
        matches = sorted(glob.glob(str(shared.joinpath(*rel.parts[1:]))))
        if not matches:
            raise UserError(f"{pattern}: no file matches {shared.joinpath(*rel.parts[1:])}")
        for src in map(pathlib.Path, matches):
            dest = root / DATA / src.relative_to(shared)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.is_file() or dest.stat().st_size != src.stat().st_size:
                shutil.copyfile(src, dest)
            copied += 1
    print(f"data: {copied} file(s) in {root / DATA}")
    if not args.no_wheels:
        print(f"wheels: bash {WHEELS_SCRIPT.relative_to(CODE)} {root / WHEELS}")
        subprocess.run(
            ["bash", str(WHEELS_SCRIPT), str(root / WHEELS)], check=True, stdout=subprocess.DEVNULL
        )
    sizes = travel_size(root, [DATA, WHEELS])
    total = sum(sizes.values())
    parts = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sizes.items())
    print(f"a GPU command with carry [{DATA}, {WHEELS}] takes {total / 2**20:.2f} MiB ({parts})")
    if total > TRAVEL_LIMIT_MIB * 2**20:
        largest = ", ".join(f"{name} {size / 2**20:.2f} MiB" for name, size in untracked(root)[:3])
        raise UserError(
            f"that is over the {TRAVEL_LIMIT_MIB} MiB a GPU command may take"
            + (
                f"; untracked files that travel with it: {largest} (move them, or ignore them in .gitignore)"
                if largest
                else ""
            )
        )
    return 0


def untracked(root: pathlib.Path) -> list[tuple[str, int]]:
    """The checkout's untracked, not ignored files (an export's folder, say) by top-level entry,
    largest first: the part of what a GPU command takes that the repository does not need."""
    sizes: dict[str, int] = {}
    for rel in filter(None, (p.decode() for p in checkout_files(root, tracked=False))):
        path = root / rel
        if path.is_file():
            top = rel.split("/")[0] + ("/" if "/" in rel else "")
            sizes[top] = sizes.get(top, 0) + path.stat().st_size
    return sorted(sizes.items(), key=lambda item: -item[1])


# ------------------------------------------------------------------------------ unpack, report


def unpack(archive: pathlib.Path, root: pathlib.Path, plan: Plan) -> tuple[list[str], list[str], list[str]]:
    """Puts the archive's runs into ``RESULTS`` (a run already finished there is kept; one the
    plan does not have is left out) and its session records into ``RESULTS/sessions``; returns
    the runs added, those kept and those left out."""
    prefix = pathlib.PurePosixPath(plan.results).parts
    try:
        tar = tarfile.open(archive, "r:gz")
    except (OSError, tarfile.TarError) as e:
        raise UserError(f"{archive}: not a readable archive ({e})") from None
    with tar:
        runs: dict[tuple, list] = {}
        sessions = []
        for m in tar.getmembers():
            parts = pathlib.PurePosixPath(m.name).parts
            rest = parts[len(prefix) :]
            bad = not m.isfile() or parts[: len(prefix)] != prefix or any(p in ("..", "") for p in parts)
            if bad or m.name.startswith("/"):
                raise UserError(f"{archive}: unexpected member {m.name!r}")
            if len(rest) == 2 and rest[0] == "sessions":
                sessions.append(m)
            elif len(rest) == 3 and rest[2] in PACKED:
                runs.setdefault(rest[:2], []).append(m)
            else:
                raise UserError(f"{archive}: unexpected member {m.name!r}")
        planned = {(p.experiment, p.run.name): p for p in plan.runs}
        unplanned = [key for key in runs if key not in planned]
        refused = []
        for key, members in sorted(runs.items()):
            if key in unplanned:
                continue
            config = next((m for m in members if pathlib.PurePosixPath(m.name).name == CONFIG), None)
            try:
                saved = yaml.safe_load(tar.extractfile(config).read()) if config is not None else None
            except yaml.YAMLError:
                saved = None
            changed = differs_from_plan(plan, planned[key], saved) if isinstance(saved, dict) else None
            if changed is None or changed:
                why = ", ".join(changed[:3]) if changed else "no readable config"
                refused.append(f"{'/'.join(key)} ({why})")
        if refused:
            raise UserError(
                f"{archive}: nothing unpacked: runs of other settings than the plan gives them: "
                + "; ".join(refused)
            )
        added, kept = [], []
        for (experiment, name), members in sorted(runs.items()):
            if (experiment, name) in unplanned:
                continue
            dest = root / plan.results / experiment / name
            if RunDir(dest).state() in FINISHED:
                kept.append(f"{experiment}/{name}")
                continue
            if dest.exists():
                shutil.rmtree(dest)
            dest.mkdir(parents=True)
            for m in members:
                (dest / pathlib.PurePosixPath(m.name).name).write_bytes(tar.extractfile(m).read())
            added.append(f"{experiment}/{name}")
        for m in sessions:
            dest = root / plan.results / "sessions" / pathlib.PurePosixPath(m.name).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tar.extractfile(m).read())
    return added, kept, ["/".join(key) for key in sorted(unplanned)]


def spearman(a: list[str], b: list[str]) -> float:
    """Spearman's rank correlation of two orders of the same names."""
    n = len(a)
    d2 = sum((a.index(x) - b.index(x)) ** 2 for x in a)
    return 1 - 6 * d2 / (n * (n * n - 1))


def profile_report(run_dir: pathlib.Path) -> str:
    """``S_tau`` per module type of a profiling run against the paper's Table 5
    (``tab:profiling_length``), over every recording (the paper's ``S_p``) and over those after
    the first basis (made from step 1's gradient, at the initial weights; ``profile.from_step``
    = ``update_proj_gap``), with the allocation each gives against the default one (donors q, k;
    receiver down) that the +Rank and Full runs use."""
    from train import profile as profiling
    from train.config import load_config

    run = RunDir(run_dir)
    rec = profiling.recordings(run)
    cfg = load_config(run.config_file)
    gap, steps = profiling.refresh_gap(cfg), rec.steps
    views = [(f"all {len(steps)} recordings (steps {steps[0]} to {steps[-1]})", 0)]
    later = [s for s in steps if gap and s > gap]
    if later and steps[0] <= gap:
        views.append((f"the {len(later)} after the first basis (steps {later[0]} to {later[-1]})", gap))
    paper = sorted(PAPER_S_TAU, key=PAPER_S_TAU.get, reverse=True)
    tables = []
    for _, from_step in views:
        s_tau = rec.s_tau(from_step)
        tables.append((s_tau, sorted(s_tau, key=s_tau.get, reverse=True)))
    head = " | ".join(f"{'all' if f == 0 else f'after step {f}'} | S_tau" for _, f in views)
    lines = [
        f"# Profiling run {run_dir.name}",
        "",
        "`S_tau` per module type: the mean of `S(W, t) = cos(G, G_recon)` over the type's matrices "
        f"and the recorded steps, block size {cfg.optimizer.block_size}, rank {cfg.optimizer.r_base}, "
        + (f"a new basis every {gap} steps; over " if gap else "over ")
        + " and over ".join(what for what, _ in views)
        + "; highest first, against the paper's Table 5 (`tab:profiling_length`: Llama 2 350M, "
        "1k-step profile). Each basis ages until the next, and the alignment falls with it; the "
        "first is made from the first step's gradient, at the initial weights.",
        "",
        f"| rank | {head} | paper | paper S_tau |",
        "|---:|" + "---|---:|" * len(views) + "---|---:|",
    ]
    # A model of other module types (MLA's, say) has another number of rows than the paper's 7.
    for i in range(max(len(paper), *(len(order) for _, order in tables))):
        cells = " | ".join(
            f"{order[i]} | {s_tau[order[i]]:.4f}" if i < len(order) else " | " for s_tau, order in tables
        )
        theirs = f"{paper[i]} | {PAPER_S_TAU[paper[i]]:.3f}" if i < len(paper) else " | "
        lines.append(f"| {i + 1} | {cells} | {theirs} |")
    lines.append("")
    for (what, from_step), (s_tau, order) in zip(views, tables, strict=True):
        common = [m for m in order if m in PAPER_S_TAU]
        rho = spearman(common, [m for m in paper if m in common]) if len(common) > 1 else None
        allocation = profiling.choose_allocation(s_tau, cfg)
        default = allocation["donors"] == ["q", "k"] and allocation["receivers"] == ["down"]
        lines += [
            f"- Over {what}: lowest `{order[-1]}` (the paper: `{paper[-1]}`); the paper's order "
            + ("holds exactly" if order == paper else "differs")
            + (f"; Spearman rank correlation {rho:.3f}." if rho is not None else "."),
            f"  Allocation: donors {allocation['donors']} -> receivers {allocation['receivers']}, "
            f"ranks {allocation['ranks']}: "
            + ("the default (q, k -> down), the +Rank and Full runs'" if default else "not the default")
            + (
                " (the run's own `allocation.json`)."
                if from_step == cfg.profile.from_step
                else f" (`python -m train.profile {_from_root(run_dir)} --from-step {from_step}`)."
            ),
        ]
    return "\n".join(lines) + "\n"


def _from_root(path: pathlib.Path) -> pathlib.Path:
    """``path`` relative to the repository root where it lies under it."""
    try:
        return path.resolve().relative_to(CODE)
    except ValueError:
        return path


def shared_device(out: pathlib.Path, runs: list) -> frozenset[str]:
    """The runs the runner ran beside others in any attempt (``runner.json``, ``ran_alone``),
    whether or not those were runs of the same report: their wall-clock times count in no time
    figure. A run dir without the runner's record is left to the report's own overlap check."""
    runner_made = [run.name for run in runs if (out / run.name / RUNNER_FILE).is_file()]
    return frozenset(name for name in runner_made if not ran_alone(out / name, finished=False))


def write_reports(root: pathlib.Path, plan: Plan, say=print) -> list[pathlib.Path]:
    """The plan's sweep reports and each experiment's ``profile.md``; returns the files written."""
    written = []
    for rep in plan.reports:
        out = root / plan.results / rep["experiment"]
        out.mkdir(parents=True, exist_ok=True)
        runs = sweep.expand(plan.base, rep["axes"], rep["seeds"])
        result = sweep.report(out, runs, rep.get("baseline"), shared_device(out, runs))
        done = sum(row["final_ppl"]["n"] for row in result["points"].values())
        say(f"{out / 'report.md'}: {done} of {len(runs)} run(s) completed")
        written.append(out / "report.md")
    for experiment in dict.fromkeys(p.experiment for p in plan.runs):
        folder = root / plan.results / experiment
        runs = sorted(folder.iterdir()) if folder.is_dir() else []
        profiles = [d for d in runs if (d / ALIGNMENT).is_file() and (d / ALLOCATION).is_file()]
        if profiles:
            (folder / "profile.md").write_text("\n".join(profile_report(d) for d in profiles))
            say(f"{folder / 'profile.md'}: {', '.join(d.name for d in profiles)}")
            written.append(folder / "profile.md")
    return written


def cmd_unpack(args) -> int:
    plan = load_plan(pathlib.Path(args.plan))
    root = pathlib.Path(args.root).resolve()
    check_finished_runs(plan, root)
    added, kept, unplanned = unpack(pathlib.Path(args.archive), root, plan)
    print(f"added {len(added)} run(s): {', '.join(added) or '-'}")
    if kept:
        print(f"kept {len(kept)} run(s) already finished here: {', '.join(kept)}")
    if unplanned:
        print(f"left out {len(unplanned)} run(s) the plan does not have: {', '.join(unplanned)}")
    write_reports(root, plan)
    return 0


def cmd_report(args) -> int:
    plan, root = load_plan(pathlib.Path(args.plan)), pathlib.Path(args.root).resolve()
    check_finished_runs(plan, root)
    write_reports(root, plan)
    return 0


def cmd_status(args) -> int:
    plan = load_plan(pathlib.Path(args.plan))
    root = pathlib.Path(args.root).resolve()
    check_finished_runs(plan, root)
    measured = [m for p in plan.runs if (m := measure(root / plan.results / p.experiment / p.run.name))]
    devices = sorted({m.device for m in measured})
    # The estimates at the level --concurrent auto starts with, where the runs come from one device.
    costs = sharing_costs(measured) if len(devices) == 1 else {}
    level = choose_level(costs, LEVELS[-1])[0] if costs else 1
    # The grid points a committed run timed (it had the device to itself), and the device each
    # experiment is timed on: a machine of another has no timing runs of it (``needs_alone``).
    committed = lambda p: root / plan.results / p.experiment / p.run.name  # noqa: E731
    timed = timed_points(plan, lambda p: ran_alone(committed(p)))
    experiments = dict.fromkeys(p.experiment for p in plan.runs)
    timing = {e: timing_device(plan, e, lambda p: alone_record(committed(p))) for e in experiments}
    for planned in plan.runs:
        state = RunDir(root / plan.results / planned.experiment / planned.run.name).state()
        local = RunDir(root / SCRATCH / "runs" / planned.experiment / planned.run.name).state()
        text = state if state != "new" or local == "new" else f"{local} in {SCRATCH}"
        if state not in FINISHED:
            config = run_config(plan, planned)
            default = plan.estimate_s["profile" if config["mode"] == "profile" else "train"]
            kind, steps = kind_of(config), steps_of(config)
            est, basis = estimate(kind, steps, 1, measured, default, args.safety, costs)
            text += f"; estimate {est:.0f}s alone"
            if level > 1:
                shared = estimate(kind, steps, level, measured, default, args.safety, costs)[0]
                text += f", {shared:.0f}s {level} at a time"
            text += f" ({basis})"
            point = (planned.experiment, planned.run.point)
            if planned.timed and config["mode"] == "train" and point not in timed:
                timed.add(point)
                device = timing.get(planned.experiment)
                where = f" on {device} only (the report times {planned.experiment} there)" if device else ""
                text += f"; runs alone{where}: no run of its grid point timed yet"
        print(f"{planned.name}: {text}")
    for device in devices:  # what --concurrent auto starts from there
        found = sharing_costs([m for m in measured if m.device == device])
        if found:
            start = choose_level(found, LEVELS[-1])[0]
            print(f"sharing {device}: {describe_costs(found)} per training step; auto starts {start} at once")
    return 0


def concurrency_arg(text: str):
    """``--concurrent``: ``auto`` or a whole number >= 1."""
    if text == "auto":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"auto or a whole number >= 1, got {text!r}")


def check_args(args) -> None:
    """The numbers and folders of the command line, before any work: one line for the first
    that cannot be. NaN and infinity are refused too (a NaN budget or safety factor fails every
    comparison, which turns the budget guard off)."""
    numbers = [("--safety", args.safety, args.safety >= 1, "a factor >= 1 on every estimate (a margin)")]
    if args.command == "run":
        numbers.append(("--budget-s", args.budget_s, args.budget_s > 0, "a number of seconds > 0"))
        if args.estimate_s is not None:
            numbers.append(("--estimate-s", args.estimate_s, args.estimate_s > 0, "a number of seconds > 0"))
    for flag, value, ok, what in numbers:  # (NaN fails every comparison)
        if not (ok and math.isfinite(value)):
            raise UserError(f"{flag} must be {what}, got {value}")
    if getattr(args, "max_concurrent", 1) < 1:
        raise UserError(f"--max-concurrent must be >= 1, got {args.max_concurrent}")
    if getattr(args, "max_runs", None) is not None and args.max_runs < 1:
        raise UserError(f"--max-runs must be >= 1, got {args.max_runs}")
    check_directory_path(pathlib.Path(args.root), "--root")
    if args.command == "run":
        check_directory_path(pathlib.Path(args.out), "--out")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/evidence.py", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--plan", default=str(DEFAULT_PLAN), help="the plan file")
    common.add_argument("--root", default=str(CODE), help="where results, .data, .whl and .evidence are")
    common.add_argument(
        "--safety", type=float, default=1.2, help="factor >= 1 on every estimated duration (a margin)"
    )
    p = sub.add_parser("run", parents=[common], help="on the GPU machine: the next runs within a budget")
    p.add_argument("--budget-s", type=float, required=True, help="seconds this command may take in all")
    p.add_argument("--out", required=True, help="where the archive and the log go ($OUT)")
    p.add_argument(
        "--concurrent",
        type=concurrency_arg,
        default="auto",
        help="runs sharing the device at a time, or auto (default): one at a time, then more while "
        "sharing measurably pays (see choose_level)",
    )
    p.add_argument("--max-concurrent", type=int, default=4, help="the most runs auto lets share the device")
    p.add_argument("--wheels", default=None, help=f"wheels to install when missing (default ROOT/{WHEELS})")
    p.add_argument("--site", default="/tmp/moara-jax-site", help="where the wheels are installed")
    p.add_argument(
        "--xla-cache",
        default=None,
        help=f"XLA compilation cache (default ROOT/{SCRATCH}/xla-cache; none: off)",
    )
    p.add_argument("--workers", type=int, default=None, help="train.prepare processes (default: all cores)")
    p.add_argument("--max-runs", type=int, default=None, help="start at most this many runs")
    p.add_argument(
        "--no-timing-runs",
        action="store_true",
        help="do not run alone the first run of a grid point none of whose runs has had the device "
        "to itself (the report's wall-clock times come from such runs alone)",
    )
    p.add_argument("--estimate-s", type=float, default=None, help="seconds a run takes before any finished")
    p = sub.add_parser("stage", parents=[common], help="here: copy the data into .data/, wheels into .whl/")
    p.add_argument("--shared", default=str(CODE.parent / "shared" / "data"), help="the shared data folder")
    p.add_argument("--no-wheels", action="store_true", help="do not download the wheels")
    p = sub.add_parser("unpack", parents=[common], help="here: an archive's runs into the results, reports")
    p.add_argument("archive")
    sub.add_parser("report", parents=[common], help="the plan's reports from the runs in the results")
    sub.add_parser("status", parents=[common], help="each planned run's state and estimated duration")
    args = parser.parse_args(argv)
    # This process never uses the accelerator: a JAX backend here (moara_jax is imported to read
    # configs) would take GPU memory from the runs. The runs get the environment as it was.
    ORIGINAL_ENV.update(os.environ)
    os.environ["JAX_PLATFORMS"] = "cpu"
    # The paths given as the caller's working directory has them; then the root is the working
    # directory, so that a config's relative paths (.data/..., an allocation file under results)
    # name here what they name for the runs, which run there.
    for name in ("plan", "root", "out", "archive", "wheels", "site", "shared", "xla_cache"):
        value = getattr(args, name, None)
        if isinstance(value, str) and not (name == "xla_cache" and value == "none"):
            setattr(args, name, os.path.abspath(value))
    caller = os.getcwd()
    try:
        check_args(args)
        if not os.path.isdir(args.root):
            raise UserError(f"--root {args.root}: no such directory (the checkout the plan's paths are in)")
        os.chdir(args.root)
        return {
            "run": cmd_run,
            "stage": cmd_stage,
            "unpack": cmd_unpack,
            "report": cmd_report,
            "status": cmd_status,
        }[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        os.chdir(caller)  # for a caller in this process


if __name__ == "__main__":
    sys.exit(main())
