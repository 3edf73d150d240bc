"""``benchmarks/evidence.py run``'s runner, on the GPU machine: installs the carried wheels, builds
the token store, runs the plan's next runs in a time budget (``Runner``) and packs the finished
runs' small files into one archive. The plan, the estimates and the choice of how many runs share
the device are ``_evidence_plan``'s; the command line is ``evidence.py``'s."""

from __future__ import annotations

import dataclasses
import datetime
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

from _evidence_plan import (
    LEVELS,
    MEMORY,
    RESERVE_S,
    RUNNER_FILE,
    SCRATCH,
    Measured,
    Plan,
    Planned,
    alone_record,
    choose_level,
    describe_costs,
    estimate,
    kind_of,
    measure,
    ran_alone,
    report_points,
    run_config,
    sharing_costs,
    steps_of,
    timed_points,
    timing_device,
)
from _processes import CHILDREN_FILE, Groups, kill_group

from train import sweep
from train.errors import UserError
from train.rundir import METRICS, RECORD_FILES, SUMMARY, RunDir, dedupe_by_step, read_metrics

CODE = pathlib.Path(__file__).resolve().parents[1]
WHEELS = ".whl"  # wheels of what the GPU machine lacks (relative to the root); carried
ARCHIVE = "evidence.tar.gz"
LOG = "evidence.log"
TRAIN_LOG = "train.log"  # the run's output (its tail)
# What comes back of a finished run: its record (no checkpoints) and the runner's files.
PACKED = (*RECORD_FILES, RUNNER_FILE, TRAIN_LOG)
FINISHED = ("completed", "failed")  # RunDir.state: a summary that says completed, nan or diverged
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint")
VERSIONS += ("grain", "numpy", "sentencepiece", "protobuf")  # grain's generated code checks protobuf's
# Installed distributions the carried wheel replaces (in the runs' path, ahead of the machine's)
# when older than this: grain's generated protobuf code refuses a runtime older than its own.
FLOORS = {"protobuf": "5.28.3"}
ORIGINAL_ENV: dict = {}  # the environment before main() set JAX_PLATFORMS for this process
TAIL_BYTES = 200_000


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
