"""Issue 21's evidence (MoARa against GaLore at 60M with seeds) in short pieces of GPU time whose
results accumulate in the repository.

    python benchmarks/evidence.py stage [--shared ../shared/data]   # here: .data/ and .whl/
    python benchmarks/evidence.py run --budget-s 540 --out $OUT [--concurrent auto|N]   # the GPU machine
    python benchmarks/evidence.py unpack evidence.tar.gz             # here: runs in, reports out
    python benchmarks/evidence.py report                            # reports from what is here
    python benchmarks/evidence.py status                            # each planned run's state

A plan (``configs/experiments/wiki60m/plan.yaml``) lists the runs in order, as small
``train.sweep`` grids (run dirs ``RESULTS/EXPERIMENT/POINT-seedS``), and the reports to write.

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
import dataclasses
import datetime
import glob
import importlib.metadata
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time

CODE = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CODE))

import yaml  # noqa: E402
from _evidence_plan import (  # noqa: E402
    LEVELS,
    MEMORY,
    RESERVE_S,
    RUNNER_FILE,
    SCRATCH,
    Measured,
    Plan,
    Planned,
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
    report_points,
    run_config,
    sharing_costs,
    steps_of,
    timed_points,
    timing_device,
)
from _processes import CHILDREN_FILE, Groups, kill_group  # noqa: E402  (this script's folder: sys.path[0])

from train import sweep  # noqa: E402
from train.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from train.rundir import (  # noqa: E402
    ALIGNMENT,
    ALLOCATION,
    CONFIG,
    METRICS,
    RECORD_FILES,
    SUMMARY,
    RunDir,
    check_directory_path,
    dedupe_by_step,
    read_metrics,
)

DEFAULT_PLAN = CODE / "configs" / "experiments" / "wiki60m" / "plan.yaml"
DATA = ".data"  # the inputs the configs name (relative to the root); carried to the GPU machine
WHEELS = ".whl"  # wheels of what the GPU machine lacks; carried
ARCHIVE = "evidence.tar.gz"
LOG = "evidence.log"
TRAIN_LOG = "train.log"  # the run's output (its tail)
# What comes back of a finished run: its record (no checkpoints) and the runner's files.
PACKED = (*RECORD_FILES, RUNNER_FILE, TRAIN_LOG)
FINISHED = ("completed", "failed")  # RunDir.state: a summary that says completed, nan or diverged
# The wheels a bare GPU machine lacks (.library/device/KINDS.md lists what it has): grain and the
# two of its requirements that are not there. Python 3.12, manylinux x86_64.
WHEELS_SCRIPT = CODE / "benchmarks" / "gpu_wheels.sh"  # the GPU sessions' one wheel set
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint")
VERSIONS += ("grain", "numpy", "sentencepiece", "protobuf")  # grain's generated code checks protobuf's
TRAVEL_LIMIT_MIB = 64
# Installed distributions the carried wheel replaces (in the runs' path, ahead of the machine's)
# when older than this: grain's generated protobuf code refuses a runtime older than its own.
FLOORS = {"protobuf": "5.28.3"}
ORIGINAL_ENV: dict = {}  # the environment before main() set JAX_PLATFORMS for this process
TAIL_BYTES = 200_000
# Table 5 of the paper (Llama 2 350M, 1k-step profile; `tab:profiling_length` in its source):
# S_tau per module type, highest first.
PAPER_S_TAU = {"v": 0.959, "o": 0.932, "up": 0.922, "gate": 0.921, "q": 0.899, "k": 0.885, "down": 0.819}


def device_name() -> str:
    """The GPU's name as nvidia-smi gives it (JAX's device_kind); ``cpu`` without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else "cpu"


# ------------------------------------------------------------------------------------------ run


class Log:
    """Lines to stdout and appended to ``OUT/evidence.log``."""

    def __init__(self, path: pathlib.Path, t0: float):
        self.path, self.t0 = path, t0

    def __call__(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {text}"
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def versions() -> dict:
    found = {"python": sys.version.split()[0]}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _losses(run_dir: pathlib.Path) -> list[dict]:
    """The training rows of a run's metrics.jsonl (none when it has none or is unreadable)."""
    try:
        return dedupe_by_step(read_metrics(run_dir / METRICS), "loss")
    except (OSError, ValueError):
        return []


def install_wheels(wheels: pathlib.Path, site: pathlib.Path, say) -> bool:
    """Installs the carried wheels whose distribution is not installed, or is installed older than
    ``FLOORS`` asks (``--no-deps``: the wheel set is complete); returns whether any was."""
    from packaging.version import Version  # pip's and pytest's requirement; on the GPU image too

    missing = []
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        dist = wheel.name.split("-")[0]
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(wheel)
            continue
        floor = FLOORS.get(dist.lower().replace("-", "_"))
        if floor and Version(have) < Version(floor):
            say(f"wheels: {dist} {have} is older than the {floor} grain needs: the carried one goes first")
            missing.append(wheel)
    if not missing:
        say(f"wheels: nothing to install from {wheels}")
        return False
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, missing)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise UserError(f"pip install of {[w.name for w in missing]} failed: {proc.stderr.strip()[-500:]}")
    say(f"wheels: installed {', '.join(w.name.split('-')[0] for w in missing)} into {site}")
    return True


def child_env(
    site: pathlib.Path | None, concurrency: int, xla_cache: str | None, stores: pathlib.Path
) -> dict:
    """The environment of the training processes: this one's as it was when ``main`` started, the
    token stores (``train.prepare``'s and the runs') under ``stores`` unless the caller set
    ``MOARA_JAX_CACHE`` (not in the home directory, which a bare machine may not let it write)."""
    env = dict(ORIGINAL_ENV or os.environ)
    env.setdefault("MOARA_JAX_CACHE", str(stores))
    paths = [str(CODE)] + ([str(site)] if site else []) + [p for p in [env.get("PYTHONPATH")] if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    if concurrency > 1:  # each run preallocates its share of the GPU's memory (rounded down)
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{math.floor(1000 * MEMORY / concurrency) / 1000:.3f}"
    if xla_cache:  # seeds of one condition compile the same program: compile it once
        env["JAX_COMPILATION_CACHE_DIR"] = xla_cache
    return env


@dataclasses.dataclass
class Running:
    planned: Planned
    run_dir: pathlib.Path
    proc: subprocess.Popen
    log: object
    started: float  # monotonic
    started_at: float  # epoch
    estimate_s: float
    resumed: bool
    fraction: float  # of the device's memory it may take
    stopped: bool = False
    share_s: float = 0.0  # its share of the device: the integral over its life of 1 / runs alive
    alone: bool = False  # a timing run: nothing else starts while it runs (``Runner.needs_alone``)


class Runner:
    def __init__(self, args, plan: Plan, root: pathlib.Path, say):
        self.args, self.plan, self.root, self.say = args, plan, root, say
        self.t0 = time.monotonic()
        self.budget = float(args.budget_s)
        self.out = pathlib.Path(args.out)
        self.scratch = root / SCRATCH / "runs"
        self.results = root / plan.results
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        self.session_name = f"session-{stamp}"
        self.session = {
            "started_at": time.time(),
            "host": socket.gethostname(),
            "budget_s": self.budget,
            "concurrency": args.concurrent,
            "levels": [],  # --concurrent auto's choices: when, how many at a time, why
            "runs": [],
        }
        self.stop_requested = False
        self.shared_at = self.t0  # when Runner.share last counted
        self.groups = Groups(root / CHILDREN_FILE)  # the children's process groups
        self.configs: dict = {}  # each planned run's config, as resolved once
        self.reports: dict = {}  # each experiment's report_points, as resolved once

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def where(self, planned: Planned, scratch: bool) -> pathlib.Path:
        return (self.scratch if scratch else self.results) / planned.experiment / planned.run.name

    # ---- set-up

    def setup(self) -> None:
        """Wheels, the device and versions, the token store (which needs the training code's
        imports: grain among them)."""
        args = self.args
        for what in self.groups.end_leftovers():
            self.say(f"ended {what}, left running by an earlier call that did not end")
        site = pathlib.Path(args.site)
        if site.is_dir():  # a warm machine: installed by an earlier call
            sys.path.insert(0, str(site))
        wheels = self.root / WHEELS if args.wheels is None else pathlib.Path(args.wheels)
        if install_wheels(wheels, site, self.say):
            sys.path.insert(0, str(site))
        self.site = site if site.is_dir() else None
        self.xla_cache = {None: str(self.root / SCRATCH / "xla-cache"), "none": None}.get(
            args.xla_cache, args.xla_cache
        )
        env = child_env(self.site, 1, None, self.root / SCRATCH / "cache")
        self.versions = versions()
        self.device = device_name()
        self.session.update(versions=self.versions, device=self.device)
        self.say(f"device: {self.device}; versions: {json.dumps(self.versions)}")
        cmd = [sys.executable, "-m", "train.prepare", "--config", str(self.plan.base), "--quiet"]
        if args.workers:
            cmd += ["--workers", str(args.workers)]
        t = time.monotonic()
        limit = max(1.0, self.left() - RESERVE_S)
        # Its own process group: on a timeout its workers are killed with it.
        proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.groups.add(proc, "train.prepare")
        try:
            stdout, stderr = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.communicate()
            raise UserError(f"train.prepare did not finish in the {limit:.0f}s left of the budget") from None
        finally:
            self.groups.remove(proc)
        if proc.returncode:
            raise UserError(f"train.prepare failed: {(stderr or stdout).strip()[-800:]}")
        self.say(f"{stdout.strip()} (prepare {time.monotonic() - t:.1f}s)")
        self.session["setup_s"] = time.monotonic() - self.t0

    # ---- the plan's state

    def measured(self) -> list[Measured]:
        """Finished runs' times: this machine's, and committed ones from the same device."""
        found = []
        for planned in self.plan.runs:
            for scratch in (True, False):
                m = measure(self.where(planned, scratch))
                if m is not None and (scratch or m.device == self.device):
                    found.append(m)
                    break
        return found

    def pending(self) -> list[Planned]:
        todo = []
        for planned in self.plan.runs:
            committed = RunDir(self.where(planned, False)).state()
            local = RunDir(self.where(planned, True)).state()
            if committed in FINISHED or local in FINISHED:
                continue
            todo.append(planned)
        return todo

    # ---- packing

    def pack(self) -> int:
        """Rewrites ``OUT/evidence.tar.gz``: every finished run of this machine and the session's
        record and log. Returns the number of runs in it."""
        self.session["ended_at"] = time.time()
        sessions = self.root / SCRATCH / "sessions"
        sessions.mkdir(parents=True, exist_ok=True)
        (sessions / f"{self.session_name}.json").write_text(json.dumps(self.session, indent=1) + "\n")
        if (self.out / LOG).is_file():
            shutil.copyfile(self.out / LOG, sessions / f"{self.session_name}.log")
        members, runs = [], 0
        for planned in self.plan.runs:
            run_dir = self.where(planned, True)
            if RunDir(run_dir).state() not in FINISHED:
                continue
            runs += 1
            prefix = f"{self.plan.results}/{planned.experiment}/{planned.run.name}"
            members += [(run_dir / n, f"{prefix}/{n}") for n in PACKED if (run_dir / n).is_file()]
        members += [(p, f"{self.plan.results}/sessions/{p.name}") for p in sorted(sessions.iterdir())]
        tmp = self.out / (ARCHIVE + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for path, name in members:
                tar.add(path, arcname=name, recursive=False)
        os.replace(tmp, self.out / ARCHIVE)
        return runs

    # ---- the loop

    def share(self, running: list[Running]) -> None:
        """Adds to each running run its share of the device since the last call (call it before
        the runs alive change): the time passed over the number of runs alive."""
        now = time.monotonic()
        for r in running:
            r.share_s += (now - self.shared_at) / len(running)
        self.shared_at = now

    def start(
        self, planned: Planned, estimate_s: float, basis: str, level: int, alone: bool = False
    ) -> Running:
        run_dir = self.where(planned, True)
        resumed = RunDir(run_dir).state() == "resumable"
        if not resumed and run_dir.exists():
            shutil.rmtree(run_dir)  # an attempt that saved nothing to resume from
        run_dir.mkdir(parents=True, exist_ok=True)
        # Not --quiet: the set-up lines and about 20 progress lines, so that the tail the log shows
        # of a run stopped at the budget's end says how far it got.
        args = sweep.train_args(self.plan.base, planned.run, run_dir, [], resumed)
        log = (run_dir / TRAIN_LOG).open("ab")
        env = child_env(self.site, level, self.xla_cache, self.root / SCRATCH / "cache")
        # Its own process group, so that a kill reaches its data-loading workers too.
        proc = subprocess.Popen(
            [sys.executable, "-m", "train", *args],
            cwd=self.root,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        self.groups.add(proc, planned.name)
        verb = "resuming" if resumed else "starting"
        left = self.left() - RESERVE_S
        alone_why = ", alone: the first of its grid point's runs to be timed" if alone else ""
        self.say(
            f"{planned.name}: {verb} (estimate {estimate_s:.0f}s from {basis}; {left:.0f}s left){alone_why}"
        )
        now, epoch = time.monotonic(), time.time()
        fraction = MEMORY / level
        return Running(planned, run_dir, proc, log, now, epoch, estimate_s, resumed, fraction, alone=alone)

    def finish(self, r: Running) -> dict:
        r.log.close()
        self.groups.remove(r.proc)
        wall = time.monotonic() - r.started
        _trim(r.run_dir / TRAIN_LOG)
        state = RunDir(r.run_dir).state()
        summary = {}
        if (r.run_dir / SUMMARY).is_file():
            summary = json.loads((r.run_dir / SUMMARY).read_text())
        concurrency = round(wall / r.share_s, 3) if r.share_s > 0 else 1.0
        # A resumed run's wall-clock times run on from its earlier attempts: it shared the device
        # if any attempt did.
        shared = concurrency > 1 or (r.resumed and not ran_alone(r.run_dir, finished=False))
        record = {
            "run": r.planned.name,
            "exit_code": r.proc.returncode,
            "status": summary.get("status") if state in FINISHED else f"unfinished ({state})",
            "wall_s": wall,
            "estimate_s": r.estimate_s,
            # The runs it shared the device with, as it experienced them: its wall time over its
            # share of the device (the time-weighted harmonic mean of the runs alive), so that
            # ``estimate``'s no-gain model gives back its time alone (wall / concurrency).
            "concurrency": concurrency,
            "shared": shared,  # this attempt or an earlier one: its times count in no report figure
            "resumed": r.resumed,
            "stopped_at_deadline": r.stopped,
            "started_at": r.started_at,
            "ended_at": time.time(),
            "host": socket.gethostname(),
            "device": self.device,
            "versions": self.versions,
            "final_eval_ppl": summary.get("final_eval_ppl"),
            "tokens_per_s": summary.get("tokens_per_s"),
            "steps": summary.get("steps"),
            # How far it got: the last step whose loss metrics.jsonl holds.
            "last_logged_step": max((row["step"] for row in _losses(r.run_dir)), default=None),
        }
        (r.run_dir / RUNNER_FILE).write_text(json.dumps(record, indent=1) + "\n")
        self.session["runs"].append(record)
        ppl = record["final_eval_ppl"]
        self.say(
            f"{r.planned.name}: {record['status']}, exit {r.proc.returncode}, {wall:.1f}s"
            + (f", final eval ppl {ppl:.3f}" if ppl is not None else "")
            + (f", last logged step {record['last_logged_step']}" if state not in FINISHED else "")
        )
        if state not in FINISHED:
            tail = (r.run_dir / TRAIN_LOG).read_text(errors="replace").strip().splitlines()[-15:]
            for line in tail:
                self.say(f"  | {line}")
        return record

    def estimate(
        self, planned: Planned, measured: list[Measured], level: int, costs: dict[int, float]
    ) -> tuple[float, str]:
        """``estimate`` of ``planned`` at ``level`` (``costs``: ``sharing_costs(measured)``), from
        its newest checkpoint on where this machine stopped it short."""
        config = self.config(planned)
        default = self.plan.estimate_s["profile" if config["mode"] == "profile" else "train"]
        if self.args.estimate_s is not None:
            default = self.args.estimate_s
        done = self.checkpointed(planned)
        left = steps_of(config) - done
        est, basis = estimate(kind_of(config), left, level, measured, default, self.args.safety, costs)
        return est, basis + (f"; {left} steps left after checkpoint {done}" if done else "")

    def config(self, planned: Planned) -> dict:
        if planned.name not in self.configs:
            self.configs[planned.name] = run_config(self.plan, planned)
        return self.configs[planned.name]

    def needs_alone(self, planned: Planned) -> bool:
        """Whether ``planned`` runs alone, as a timing run: a training run of a grid point none of
        whose finished runs had the device to itself (here, or committed from the same device),
        so that the report has a wall-clock time for every point (a run that shared the device
        counts in no time figure). Never for the runs of a plan entry with ``timed: false``, nor
        under ``--no-timing-runs``, nor in an experiment timed on another device than this one
        (``timed_elsewhere``): the report times it on that device only, so here the run gives its
        final ppl and may share the device."""
        if self.args.no_timing_runs or not planned.timed or self.config(planned)["mode"] != "train":
            return False
        if self.timed_elsewhere(planned):
            return False
        timed = timed_points(
            self.plan,
            lambda p: ran_alone(self.where(p, True)) or ran_alone(self.where(p, False), self.device),
        )
        return (planned.experiment, planned.run.point) not in timed

    def timed_elsewhere(self, planned: Planned) -> str | None:
        """The device the report times ``planned``'s experiment on (``timing_device``, from its
        runs that had one to themselves, committed or finished here), where that is not this
        machine's: a timing run here would count in no time of the report."""
        experiment = planned.experiment
        if experiment not in self.reports:  # (asked at every poll of the schedule's loop)
            self.reports[experiment] = report_points(self.plan, experiment)
        device = timing_device(
            self.plan,
            experiment,
            lambda p: alone_record(self.where(p, False)) or alone_record(self.where(p, True)),
            self.reports[experiment],
        )
        return device if device is not None and device != self.device else None

    def untimed_here(self, todo: list[Planned]) -> dict[str, str]:
        """The experiments of ``todo`` timed on another device than this one, with that device."""
        found = {}
        for planned in todo:
            if planned.experiment not in found and (elsewhere := self.timed_elsewhere(planned)):
                found[planned.experiment] = elsewhere
        return found

    def checkpointed(self, planned: Planned) -> int:
        """The step of the newest checkpoint of a run this machine stopped short (0: none), from
        which a start resumes it: only its steps after it are estimated."""
        run = RunDir(self.where(planned, True))
        if run.state() != "resumable":
            return 0
        return max(int(p.name) for p in run.checkpoints.iterdir() if p.name.isdigit())

    def loop(self) -> int:
        """Runs the plan's next runs (``schedule``); on an error too, stops and records what still
        runs and packs what finished. Returns the number of runs in the archive."""
        running: list[Running] = []
        try:
            self.schedule(running)
        finally:
            self.end(running)
            packed = self.pack()
        return packed

    def terminate(self, r: Running, why: str) -> None:
        """Asks a run to stop (SIGTERM: it saves a checkpoint and exits)."""
        self.say(f"{r.planned.name}: stopping ({why}; SIGTERM)")
        r.stopped = True
        r.proc.send_signal(signal.SIGTERM)

    def kill(self, r: Running) -> None:
        self.say(f"{r.planned.name}: killed (did not stop in time)")
        kill_group(r.proc)
        r.proc.wait()

    def end(self, running: list[Running]) -> None:
        """Stops the runs still going (after an error in ``schedule``) and records them."""
        for r in running:
            if r.proc.poll() is None:
                self.terminate(r, "the runner stops")
        for r in running:
            try:
                r.proc.wait(timeout=max(1.0, self.left() - 3))
            except subprocess.TimeoutExpired:
                self.kill(r)
        self.share(running)
        while running:
            self.finish(running.pop(0))

    def level(self, measured: list[Measured]) -> int:
        """How many runs share the device now: ``--concurrent N``, or ``auto``'s choice from the
        finished runs of this device (``choose_level``), logged when it changes."""
        if self.args.concurrent != "auto":
            return self.args.concurrent
        level, why = choose_level(sharing_costs(measured), self.args.max_concurrent)
        levels = self.session["levels"]
        if not levels or levels[-1]["level"] != level:
            levels.append({"at_s": round(time.monotonic() - self.t0, 1), "level": level, "why": why})
            self.say(f"sharing the device: {why}")
        return level

    def next_start(
        self, planned: Planned, running: list[Running], measured: list[Measured], alone: bool = False
    ):
        """``(level, estimate, basis)`` for starting ``planned`` now, or ``None`` with the smallest
        estimate tried and its basis when it must wait or does not fit. The level's memory share
        must be free (runs started at a lower level hold a larger one); under ``auto``, a run that
        does not fit at the chosen level may start at a lower one (fewer runs sharing, a shorter
        estimate), down to alone. A timing run (``alone``) starts only at level 1."""
        chosen = 1 if alone else self.level(measured)
        lower = [n for n in reversed(LEVELS) if n < chosen] if self.args.concurrent == "auto" else []
        held, costs = sum(r.fraction for r in running), sharing_costs(measured)
        least = None  # the smallest estimate that did not fit (what a refusal names)
        for level in (chosen, *lower):
            if len(running) >= level or held + MEMORY / level > MEMORY + 1e-9:
                continue
            est, basis = self.estimate(planned, measured, level, costs)
            if est <= self.left() - RESERVE_S:
                return level, est, basis
            least = (est, basis) if least is None or est < least[0] else least
        return None, *(least or (None, None))

    def schedule(self, running: list[Running]) -> None:
        """Starts the next runs in the plan's order while they fit in the budget, packs after each
        run that ends, stops what still runs at the end of the budget. After two runs in a row
        ended without a result it starts no more; those running go on."""
        todo = self.pending()
        for experiment, device in self.untimed_here(todo).items():
            self.say(
                f"{experiment}: its runs were timed on {device}, not on {self.device}: its runs here "
                "give final ppl, not times, and may share the device"
            )
        crashes, started, refused = 0, 0, None
        names = ", ".join(p.name for p in todo[:6]) + (" ..." if len(todo) > 6 else "")
        self.say(f"{len(todo)} run(s) of the plan to do: {names}")
        measured = self.measured()
        while True:
            while todo and not self.stop_requested:
                if self.args.max_runs is not None and started >= self.args.max_runs:
                    todo = []
                    break
                planned = todo[0]
                alone = self.needs_alone(planned)
                if any(r.alone for r in running) or (alone and running):
                    break  # a timing run has, or waits for, the device to itself
                level, est, basis = self.next_start(planned, running, measured, alone)
                if level is None:
                    if est is not None:  # the device has room for it, the budget has not
                        left = self.left() - RESERVE_S
                        if refused != (planned.name, round(est)):
                            refused = (planned.name, round(est))
                            why = f"needs ~{est:.0f}s from {basis}; {left:.0f}s left"
                            if running:  # their ends may bring an estimate that fits
                                why += f" (for now: {len(running)} run(s) still going)"
                            self.say(f"{planned.name}: not started: {why}")
                        if not running:
                            todo = []
                    break
                self.share(running)
                running.append(self.start(planned, est, basis, level, alone))
                todo.pop(0)
                started += 1
            if not running:
                break
            time.sleep(0.5)
            if (self.left() <= RESERVE_S - 5 or self.stop_requested) and not any(r.stopped for r in running):
                for r in running:
                    self.terminate(r, "the end of the budget")
            if self.left() <= 3:
                for r in running:
                    if r.proc.poll() is None:
                        self.kill(r)
            ended = [r for r in running if r.proc.poll() is not None]
            if ended:
                self.share(running)
            for r in ended:
                running.remove(r)
                record = self.finish(r)
                finished = not record["status"].startswith("unfinished")
                crashes = 0 if finished or r.stopped else crashes + 1
                self.pack()
                measured = self.measured()
            if crashes >= 2 and todo:
                self.say(
                    "two runs in a row ended without a result: no more runs start, those running go "
                    "on (see their output above)"
                )
                todo = []

    def table(self) -> None:
        """The closing table: each run's status, wall time, concurrency, final ppl and tokens/s."""
        rows = self.session["runs"]
        lines = ["", f"{'run':38} {'status':22} {'wall s':>7} {'conc':>4} {'final ppl':>10} {'tokens/s':>10}"]
        for r in rows:
            ppl = "-" if r["final_eval_ppl"] is None else f"{r['final_eval_ppl']:.3f}"
            tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
            lines.append(
                f"{r['run']:38} {str(r['status'])[:22]:22} {r['wall_s']:7.1f} {r['concurrency']:4.1f} "
                f"{ppl:>10} {tps:>10}"
            )
        done = [r for r in rows if r["status"] in ("completed", "nan", "diverged")]
        spent = time.monotonic() - self.t0
        lines.append(
            f"{len(done)} run(s) finished in {spent:.0f}s of a {self.budget:.0f}s budget "
            f"(set-up {self.session.get('setup_s', 0):.0f}s); {len(self.pending())} still to do"
        )
        if done:  # what tells whether sharing the device pays: runs finished per minute of running
            span = max(r["ended_at"] for r in rows) - min(r["started_at"] for r in rows)
            lines.append(
                f"{60 * len(done) / span:.2f} finished run(s) per minute of running time ({span:.0f}s), "
                f"runs at a time: {self.args.concurrent}"
            )
        # What says whether sharing the device pays, from every finished run of this device.
        lines.append(f"device-seconds per training step: {describe_costs(sharing_costs(self.measured()))}")
        for line in lines:
            self.say(line)


def _trim(path: pathlib.Path) -> None:
    if path.is_file() and path.stat().st_size > TAIL_BYTES:
        data = path.read_bytes()[-TAIL_BYTES:]
        path.write_bytes(b"[... cut ...]\n" + data)


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


def checkout_files(root: pathlib.Path) -> list[bytes]:
    """The files of the git checkout at ``root`` that a GPU command takes along (tracked, and
    untracked but not ignored); a ``root`` that is no checkout is one line."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
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
        raise UserError(f"that is over the {TRAVEL_LIMIT_MIB} MiB a GPU command may take")
    return 0


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
