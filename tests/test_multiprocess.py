"""``python -m train`` as 2 processes x 2 CPU devices through ``jax.distributed`` on localhost
against 1 process x 4 devices: the same losses, SIGTERM, the loss of either process, and
``--resume`` after each, on one run dir that only process 0 writes."""

import contextlib
import io
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import cpu_devices

from train import distributed
from train.distributed import HEARTBEAT_ENV
from train.errors import EXIT_IO_ERROR, EXIT_PEER_LOST, EXIT_PREEMPTED, UserError
from train.rundir import CHECKPOINTS, METRICS, SUMMARY, RunLock, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 24
SETS = [
    f"train.steps={STEPS}",
    "train.eval_every=12",
    "train.batch_size=8",  # 2 rows per device of 4
    "train.seq_len=32",
    "train.eval_batches=1",
    "optimizer.update_proj_gap=5",
    "checkpoint.every=6",
    "checkpoint.keep=2",
]
HEARTBEAT_S = 10  # the coordination service's heartbeat timeout in these runs
LOST_BOUND_S = 60  # a survivor stops this long after its peer's death at most (busy CI included)


def environment(devices: int, **more: str) -> dict:
    """This session's environment: tests/conftest.py took a scheduler's and an outer run's process
    settings out of it, and keeps every program in the session's persistent compilation cache,
    where each test's runs find the programs of the tests before it (one run compiles them)."""
    env = os.environ | {"PYTHONPATH": str(ROOT), HEARTBEAT_ENV: str(HEARTBEAT_S)}
    return cpu_devices(devices, env) | more


def _args(run_dir, extra=()) -> list[str]:
    args = [sys.executable, "-m", "train", "--config", TINY, "--run-dir", str(run_dir), "--quiet"]
    return args + [x for s in SETS for x in ("--set", s)] + list(extra)


def free_port(candidates=range(0, 1)) -> int:
    """A port nothing listens on: the system's pick, or the first free one of ``candidates``."""
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise AssertionError(f"no free port in {candidates}")


def slurm_step(process: int, job_id: int, allocation_tasks: int = 2) -> dict:
    """SLURM's variables that jax.distributed and the trainer read, as ``srun --ntasks=2`` sets them
    on one node for task ``process`` (the coordinator is the step's first node on port 61440 + job
    id mod 4096); ``SLURM_NTASKS`` the allocation's ``allocation_tasks`` where srun kept the
    allocation's environment (``--preserve-env``)."""
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NTASKS": str(allocation_tasks),
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": str(process),
        "SLURM_LOCALID": str(process),
    }


class Pair:
    """Two launchers of one run (processes 0 and 1), their output in files beside the run dir;
    started with JAX's variables, or (``slurm``) as the two tasks of a SLURM job step."""

    def __init__(
        self, run_dir: pathlib.Path, name: str, *extra: str, slurm: bool = False, more: dict | None = None
    ):
        self.run_dir, self.logs, self.procs = run_dir, [], []
        metrics = run_dir / METRICS
        self.stale = metrics.stat().st_ino if metrics.exists() else None  # replaced when resuming
        if slurm:
            job_id = free_port(range(61440, 65536)) - 61440
        else:
            port = free_port()
        for i in range(2):
            if slurm:
                launch = slurm_step(i, job_id, allocation_tasks=4)
            else:
                launch = {
                    "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                    "JAX_NUM_PROCESSES": "2",
                    "JAX_PROCESS_ID": str(i),
                }
            env = environment(2, **launch, **(more or {}))
            out, err = (run_dir.parent / f"{name}.{i}.{ext}" for ext in ("out", "err"))
            self.logs.append((out, err))
            with open(out, "w") as o, open(err, "w") as e:
                self.procs.append(
                    subprocess.Popen(_args(run_dir, extra), cwd=ROOT, env=env, stdout=o, stderr=e)
                )

    def err(self, i: int) -> str:
        return self.logs[i][1].read_text()

    def report(self) -> str:
        return "\n".join(f"--- process {i} stderr:\n{self.err(i)[-3000:]}" for i in range(2))

    def wait_for_step(self, step: int, checkpoint: int | None = None) -> None:
        """Until this session has logged ``step`` (a resume first rewrites metrics.jsonl without
        the rows the last session logged after its checkpoint) and finished ``checkpoint``."""
        deadline, metrics = time.time() + 600, self.run_dir / METRICS
        while time.time() < deadline and all(p.poll() is None for p in self.procs):
            with contextlib.suppress(FileNotFoundError):
                if (
                    metrics.stat().st_ino != self.stale
                    and max(logged_steps(self.run_dir), default=0) >= step
                    and (checkpoint is None or (self.run_dir / CHECKPOINTS / str(checkpoint)).is_dir())
                ):
                    return
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"step {step} was not logged\n{self.report()}")

    def resumed_from(self) -> int:
        return int(self.logs[0][0].read_text().split("resuming from step ")[1].split()[0])

    def wait(self, i: int, timeout: float = 600) -> int:
        try:
            return self.procs[i].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"process {i} did not end in {timeout} s\n{self.report()}") from None

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def logged_steps(run_dir: pathlib.Path) -> list[int]:
    path = run_dir / METRICS
    return [r["step"] for r in read_metrics(path) if "loss" in r] if path.exists() else []


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / METRICS) if "loss" in r}


def assert_peer_lost(pair: Pair, survivor: int, killed_at: float) -> float:
    """The survivor ends with EXIT_PEER_LOST in time, its last line saying so, no dump."""
    code = pair.wait(survivor, timeout=LOST_BOUND_S + 60)
    took = time.time() - killed_at
    err = pair.err(survivor)
    assert code == EXIT_PEER_LOST, f"exit {code}\n{pair.report()}"
    assert took < LOST_BOUND_S, f"stopped {took:.0f} s after its peer\n{pair.report()}"
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith(f"error: process {survivor} of 2 lost process {1 - survivor} (")
        and "--resume" in last
    ), err
    for dump in ("Check failure stack trace", "Terminating process", "Traceback", "\nF1", "\nE1"):
        assert dump not in "\n" + err, f"{dump!r} in stderr:\n{err}"
    return took


@pytest.mark.slow
def test_two_processes_match_one_and_survive_sigterm_and_a_lost_peer(tmp_path):
    """One run dir through four sessions of 2 processes x 2 devices: stopped by SIGTERM to both
    (75 each, the same step), resumed and process 1 killed (process 0 ends with EXIT_PEER_LOST),
    resumed from the checkpoint it kept and process 0 killed (process 1 ends so), resumed to the
    end. Every step is logged once with the losses of one process x 4 devices, and the run dir
    holds what a one-process run's holds (one writer)."""
    one = tmp_path / "one"
    ref = subprocess.run(
        _args(one),
        cwd=ROOT,
        env=environment(4),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "two"

    # 1. SIGTERM to both: each saves the same checkpoint and exits 75.
    pair = Pair(run, "sigterm")
    pair.wait_for_step(4)
    for p in pair.procs:
        p.send_signal(signal.SIGTERM)
    codes = [pair.wait(i) for i in range(2)]
    assert codes == [EXIT_PREEMPTED] * 2, pair.report()
    summary = json.loads((run / SUMMARY).read_text())
    assert summary["status"] == "interrupted" and 4 <= summary["steps"] < STEPS, summary
    assert summary["devices"] == 4 and summary["mesh"]["data"] == 4
    stopped = summary["steps"]
    assert (run / CHECKPOINTS / str(stopped)).is_dir()

    # 2. Resumed; process 1 killed after checkpoint 12 (its trainer dies with its launcher):
    # process 0 says so.
    pair = Pair(run, "kill1", "--resume")
    pair.wait_for_step(13, checkpoint=12)
    deadline = time.time() + 120  # process 0 records its checksums at a step after orbax is done
    while not (run / "checksums" / "12.json").is_file() and time.time() < deadline:
        time.sleep(0.05)
    assert pair.resumed_from() == stopped
    killed_at = time.time()
    pair.procs[1].kill()
    took1 = assert_peer_lost(pair, 0, killed_at)

    # 3. Resumed from what the survivor kept; process 0 (which hosts the coordination service)
    # killed: process 1 says so.
    pair = Pair(run, "kill0", "--resume")
    pair.wait_for_step(14)
    assert pair.resumed_from() == 12
    killed_at = time.time()
    pair.procs[0].kill()
    took0 = assert_peer_lost(pair, 1, killed_at)

    # 4. Resumed to the end, as the two tasks of a SLURM job step of an allocation of 4 tasks
    # (jax.distributed finds the coordinator and each one's id in SLURM's variables; the number
    # of processes is the step's), after the newest checkpoint's largest file was deleted:
    # process 0 alone verifies it against its checksums, moves it aside once both are done with
    # it, and both resume from the one before (processes that verified on their own restored
    # different steps, or read files being moved, and hung).
    kept = sorted(int(p.name) for p in (run / CHECKPOINTS).iterdir() if p.name.isdigit())
    assert kept[-1] == 12, kept
    files = [p for p in (run / CHECKPOINTS / "12").rglob("*") if p.is_file()]
    max(files, key=lambda p: p.stat().st_size).unlink()
    pair = Pair(run, "finish", "--resume", slurm=True)
    codes = [pair.wait(i) for i in range(2)]
    assert codes == [0, 0], pair.report()
    assert pair.resumed_from() == kept[-2], pair.logs[0][0].read_text()
    assert "checkpoint 12 is not usable: files missing: " in pair.logs[0][0].read_text()
    assert (run / "rejected_checkpoints" / "12").is_dir()
    shutil.rmtree(run / "rejected_checkpoints")  # the run dir compared with the one-process one below
    steps = logged_steps(run)
    assert steps == list(range(1, STEPS + 1)), steps  # every step once, in order
    evals = [r["step"] for r in read_metrics(run / METRICS) if "eval_loss" in r]
    assert evals == [12, 24], evals
    want, got = losses(one), losses(run)
    # The same program on the same 4-device mesh; only the all-reduces differ (gloo across the
    # two processes), which may add the 4 partial sums in another order: float32 rounding, at
    # most 1.6e-7 relative (1-2 ulps of the loss) with JAX 0.10.2 on some CPUs. An exact SVD at
    # a projection refresh can turn such a difference into a turn of the basis where singular
    # values near the rank cut almost tie, and the steps after it drift apart: up to 3.5e-5 at
    # steps 20-24, after the refresh at step 16, with JAX 0.11.2 (Python 3.12); 2.3e-4 at step
    # 24 with JAX 0.10.2 on an AVX-512 Xeon (2026-11-25; 2.4e-6 at step 17). A resume off by a
    # step, or a lost all-reduce, is off by more than 1e-2 (the losses of neighbouring steps
    # differ by 0.5% or more).
    np.testing.assert_allclose([got[s] for s in want], [want[s] for s in want], rtol=1e-3)
    # One writer: the files and checkpoints of a one-process run, nothing else.
    names = {p.name for p in run.iterdir()}
    assert names == {p.name for p in one.iterdir()}, names
    kept = sorted(p.name for p in (run / CHECKPOINTS).iterdir())
    assert kept == sorted(p.name for p in (one / CHECKPOINTS).iterdir()), kept
    assert json.loads((run / SUMMARY).read_text())["status"] == "completed"
    print(f"survivor stopped {took1:.1f} s after process 1 was killed, {took0:.1f} s after process 0")


# What jaxlib 0.10.2 wrote to stderr in process 0 when process 1 stopped sending heartbeats (its
# stack trace shortened), between a line of the trainer's and its declared exit status.
JAXLIB_DUMP = b"""\
[Gloo] a line of the run's own
E1124 04:06:09.291011   15628 coordination_service.cc:1549] [66994] Use error polling to propagate \
the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error.
E1124 04:06:09.291530   15639 coordination_service_agent.cc:289] Polled an error from coordination service
F1124 04:06:09.291684   15639 client.h:80] Terminating process because the JAX distributed service \
detected fatal errors. This most likely indicates that another task died. absl::Status: UNAVAILABLE: \
The following tasks are unhealthy (stopped sending heartbeats):
1
*** Check failure stack trace: ***
    @     0x7f25a0040634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""


def _relay(*pieces: bytes, pause: float = 0.0) -> tuple[bytes, distributed._Relay]:
    """``pieces`` through the launcher's relay, ``pause`` seconds apart."""
    read, write = os.pipe()
    relay = distributed._Relay(read)
    relay.out = io.BytesIO()
    relay.start()
    for k, piece in enumerate(pieces):
        time.sleep(pause if k else 0)
        os.write(write, piece)
    os.close(write)
    relay.join(timeout=10)
    os.close(read)
    return relay.out.getvalue(), relay


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.slow
def test_a_run_dir_in_use_ends_every_process_with_the_same_line(resume, tmp_path):
    """A second run of 2 processes on a run dir another run holds: process 0 cannot lock it, and
    process 1 ends with process 0's line at once (it went on before, to a barrier where it failed
    with a traceback once process 0 had gone); nothing is written."""
    run = tmp_path / "run"
    holder = RunLock(run).acquire()  # as a run in progress holds it
    try:
        pair = Pair(run, "busy", *["--resume"] * resume)
        # seconds each here; once in CI process 0 had not ended 120 s after its line (at
        # exit JAX's shutdown barrier waits SHUTDOWN_TIMEOUT_S at most; the cause is not known)
        codes = [pair.wait(i, timeout=distributed.SHUTDOWN_TIMEOUT_S + 120) for i in range(2)]
    finally:
        holder.release()
    line = f"error: run dir {run} is in use by pid {os.getpid()} on host {socket.gethostname()}; "
    for i in range(2):
        errors = [x for x in pair.err(i).splitlines() if x.startswith("error:")]
        assert codes[i] == 2 and len(errors) == 1 and errors[0].startswith(line), pair.report()
        assert "Traceback" not in pair.err(i), pair.report()
    assert [p.name for p in run.iterdir()] == [".lock"]


# The processes' sitecustomize: no space left for a file of that name after that many writes.
FULL_DISK = """
import errno, os, pathlib

_name, _after, _writes = os.environ["TEST_FULL_FILE"], int(os.environ["TEST_FULL_AFTER"]), [0]
_open = pathlib.Path.open

def open_(self, mode="r", *args, **kwargs):
    if self.name == _name and set(mode) & set("wax"):
        _writes[0] += 1
        if _writes[0] > _after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _open(self, mode, *args, **kwargs)

pathlib.Path.open = open_
"""


def with_sitecustomize(tmp_path: pathlib.Path, code: str, **env: str) -> dict:
    """The environment (``env`` added) of processes that run ``code`` at start-up (their
    ``sitecustomize``)."""
    faults = tmp_path / "faults"
    faults.mkdir(exist_ok=True)
    (faults / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": f"{faults}{os.pathsep}{ROOT}", **env}


def full_disk(tmp_path: pathlib.Path, name: str, after: int) -> dict:
    """The environment of processes whose writes of ``name`` fail for no space after ``after``."""
    return with_sitecustomize(tmp_path, FULL_DISK, TEST_FULL_FILE=name, TEST_FULL_AFTER=str(after))


def assert_same_io_error(pair: Pair, starts: str) -> None:
    """Both processes exit 74 with the same one ``error:`` line, no traceback."""
    codes = [pair.wait(i, timeout=300) for i in range(2)]
    lines = []
    for i in range(2):
        errors = [x for x in pair.err(i).splitlines() if x.startswith("error:")]
        assert codes[i] == EXIT_IO_ERROR and len(errors) == 1, pair.report()
        assert errors[0].startswith(starts) and errors[0].endswith(" --resume"), pair.report()
        assert "Traceback" not in pair.err(i), pair.report()
        lines.append(errors[0])
    assert lines[0] == lines[1], pair.report()


@pytest.mark.slow
def test_a_full_disk_before_the_first_step_ends_every_process_with_the_same_line(tmp_path):
    """Process 0 cannot write the run's config: every process ends with its line and 74 (process
    1 waited for it in a barrier before, and failed there with a traceback)."""
    run = tmp_path / "run"
    pair = Pair(run, "full", more=full_disk(tmp_path, "config.yaml.tmp", 0))
    assert_same_io_error(pair, f"error: writing the run's config to {run} failed: no space left on device; ")
    assert not (run / "config.yaml").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fails", ["metrics", "checksums"])
def test_a_full_disk_during_the_steps_stops_every_process_at_one_step(fails, tmp_path):
    """Process 0 alone writes metrics.jsonl and the checkpoints' checksums: when step 9's row, or
    checkpoint 6's checksums, cannot be written, every process stops at the same step with its
    line and 74, saving no checkpoint after it (process 1 went on to the next collective and
    waited there for the shutdown timeout, 132 s, then ended with the lost-peer line). After the
    metrics' fault, a resume on a disk still full (metrics.jsonl rewritten first) ends both
    processes so too, and once there is room ``--resume`` logs every step once."""
    run = tmp_path / "run"
    started = time.time()
    metrics_full = f"error: writing metrics to {run / METRICS} failed: no space left on device; "
    if fails == "metrics":
        pair = Pair(run, "full", more=full_disk(tmp_path, METRICS, 8))  # steps 1-8 written
        line = metrics_full
    else:
        pair = Pair(run, "full", more=full_disk(tmp_path, "6.json.tmp", 0))
        line = f"error: writing checkpoint checksums to {run / 'checksums'} failed: no space left on device; "
    assert_same_io_error(pair, line)
    assert time.time() - started < LOST_BOUND_S + 30, pair.report()
    assert "the last complete checkpoint, step 6, is in" in pair.err(1), pair.report()
    assert sorted(int(p.name) for p in (run / CHECKPOINTS).iterdir() if p.name.isdigit()) == [6]
    logged = logged_steps(run)
    if fails == "metrics":
        assert logged == list(range(1, 9)), logged
    else:  # a step or two after the checksums failed, or at the save of step 12
        assert logged == list(range(1, max(logged) + 1)) and 6 < max(logged) <= 12, logged
    if fails == "checksums":
        assert not (run / "checksums" / "6.json").exists()
    summary = json.loads((run / SUMMARY).read_text())
    assert (summary["status"], summary["last_checkpoint"]) == ("io_error", 6)
    if fails == "checksums":
        return  # the resumes below are the metrics case's
    still_full = Pair(run, "still-full", "--resume", more=full_disk(tmp_path, f"{METRICS}.tmp", 0))
    assert_same_io_error(still_full, metrics_full)
    resumed = Pair(run, "resumed", "--resume")
    assert [resumed.wait(i) for i in range(2)] == [0, 0], resumed.report()
    assert logged_steps(run) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("fails", ["summary", "checksums"])
def test_a_write_after_the_steps_process_0_cannot_make_ends_every_process(fails, tmp_path):
    """Process 0 alone writes the last checkpoint's checksums and summary.json once the steps are
    done: when it cannot write either, every process exits 74 with its line (process 1 exited 0
    before, as if the run had been recorded), and ``--resume`` then records the run."""
    run = tmp_path / "run"
    if fails == "summary":
        pair = Pair(run, "full", more=full_disk(tmp_path, f"{SUMMARY}.tmp", 0))
        line = f"error: writing the summary to {run / SUMMARY} failed: no space left on device; "
    else:
        pair = Pair(run, "full", more=full_disk(tmp_path, f"{STEPS}.json.tmp", 0))
        line = f"error: writing checkpoint checksums to {run / 'checksums'} failed: no space left on device; "
    assert_same_io_error(pair, line)
    assert logged_steps(run) == list(range(1, STEPS + 1))
    if fails == "summary":
        assert "the last complete checkpoint, step 24, is in" in pair.err(1) and not (run / SUMMARY).exists()
    else:
        summary = json.loads((run / SUMMARY).read_text())
        assert summary["status"] == "io_error" and line[len("error: ") :] in summary["stop_reason"] + "; "
    resumed = Pair(run, "resumed", "--resume")
    assert [resumed.wait(i) for i in range(2)] == [0, 0], resumed.report()
    summary = json.loads((run / SUMMARY).read_text())
    assert (summary["status"], summary["steps"]) == ("completed", STEPS), summary
    assert logged_steps(run) == list(range(1, STEPS + 1))


# The processes' sitecustomize: process 1's trainer finds no file named corpus.jsonl (its host
# lacks it).
FILE_MISSING_IN_1 = """
import os, pathlib

if os.environ.get("JAX_PROCESS_ID") == "1" and os.environ.get("MOARA_JAX_WORKER_STDERR"):
    _is_file = pathlib.Path.is_file
    pathlib.Path.is_file = lambda self: self.name != "corpus.jsonl" and _is_file(self)
"""


@pytest.mark.slow
def test_a_data_file_one_process_lacks_ends_every_process_with_its_line(tmp_path):
    """Process 1 cannot find its data file: every process exits 2 with process 1's line, at once
    (process 0 went on to the first collective and waited there for the lost-peer verdict)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(200)))
    run, started = tmp_path / "run", time.time()
    files = ["--set", "data.source=files", "--set", f"data.paths=[{corpus}]"]
    pair = Pair(run, "missing", *files, more=with_sitecustomize(tmp_path, FILE_MISSING_IN_1))
    codes = [pair.wait(i, timeout=300) for i in range(2)]
    assert codes == [2, 2] and time.time() - started < LOST_BOUND_S, pair.report()
    for i in range(2):
        errors = [x for x in pair.err(i).splitlines() if x.startswith("error:")]
        assert errors == [f"error: process 1 of 2: data file not found: {corpus}"], pair.report()


# The processes' sitecustomize: process 1's trainer reads a token store of other content (a
# node-local cache built from other inputs).
OTHER_STORE_IN_1 = """
import os

if os.environ.get("JAX_PROCESS_ID") == "1" and os.environ.get("MOARA_JAX_WORKER_STDERR"):
    import train.data

    train.data.Data.identity = lambda self: "0" * 64
"""


@pytest.mark.slow
def test_token_stores_of_other_content_end_every_process_before_the_steps(tmp_path):
    run = tmp_path / "run"
    pair = Pair(run, "other", more=with_sitecustomize(tmp_path, OTHER_STORE_IN_1))
    codes = [pair.wait(i, timeout=300) for i in range(2)]
    assert codes == [2, 2], pair.report()
    for i in range(2):
        errors = [x for x in pair.err(i).splitlines() if x.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith("error: process 1 of 2: the token store "), (
            pair.report()
        )
        assert "holds other tokens than process 0's" in errors[0], pair.report()
    assert not logged_steps(run)


# The processes' sitecustomize: process 0's trainer may not move anything (permission denied).
MOVE_DENIED_IN_0 = """
import errno, os, shutil

if os.environ.get("JAX_PROCESS_ID") == "0" and os.environ.get("MOARA_JAX_WORKER_STDERR"):
    def move(src, dst, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    shutil.move = move
"""


@pytest.mark.slow
def test_a_checkpoint_process_0_cannot_move_aside_ends_every_process(tmp_path):
    """``--resume`` finds the newest checkpoint damaged, and process 0 may not move it aside:
    every process exits 74 with its line (process 1 waited in the next vote before)."""
    run = tmp_path / "run"
    first = Pair(run, "first")
    assert [first.wait(i) for i in range(2)] == [0, 0], first.report()
    files = [p for p in (run / CHECKPOINTS / str(STEPS)).rglob("*") if p.is_file()]
    max(files, key=lambda p: p.stat().st_size).unlink()
    pair = Pair(run, "denied", "--resume", more=with_sitecustomize(tmp_path, MOVE_DENIED_IN_0))
    rejected = run / "rejected_checkpoints"
    assert_same_io_error(pair, f"error: moving checkpoint {STEPS} to {rejected} failed: permission denied")
    assert (run / CHECKPOINTS / str(STEPS)).is_dir()


# The processes' sitecustomize: process 1's trainer cannot read its filesystem's free space
# (an I/O error) from its second look on, the check before the save of step 12.
FREE_SPACE_UNREADABLE = """
import errno, os, shutil

if os.environ.get("JAX_PROCESS_ID") == "1" and os.environ.get("MOARA_JAX_WORKER_STDERR"):
    _disk_usage, _calls = shutil.disk_usage, [0]

    def disk_usage(path):
        _calls[0] += 1
        if _calls[0] >= 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return _disk_usage(path)

    shutil.disk_usage = disk_usage
"""


@pytest.mark.slow
def test_a_save_one_process_cannot_make_ends_every_process(tmp_path):
    """Process 1 cannot tell its free space before the save of step 12: both processes refuse
    the save at once and exit 74, each with its line (process 0 waited for process 1 in the save
    before, for the shutdown timeout, then ended with the lost-peer line: 131 s)."""
    run = tmp_path / "run"
    started = time.time()
    pair = Pair(run, "unreadable", more=with_sitecustomize(tmp_path, FREE_SPACE_UNREADABLE))
    codes = [pair.wait(i, timeout=300) for i in range(2)]
    assert codes == [EXIT_IO_ERROR, EXIT_IO_ERROR] and time.time() - started < LOST_BOUND_S, pair.report()
    save = f"error: saving checkpoint 12 to {run / CHECKPOINTS} failed: "
    lines = [[x for x in pair.err(i).splitlines() if x.startswith("error:")] for i in range(2)]
    assert lines[0][0].startswith(save + "another process has no room for its share or cannot tell; ")
    assert lines[1][0].startswith(save + "input/output error; "), pair.report()
    assert sorted(int(p.name) for p in (run / CHECKPOINTS).iterdir() if p.name.isdigit()) == [6]


def test_launcher_relay_drops_jaxlib_dump_and_names_the_lost_process(monkeypatch):
    monkeypatch.setattr(distributed, "_HOLD_S", 10.0)  # the fatal line comes well inside the hold
    fatal = JAXLIB_DUMP.index(b"F1124")
    connected = b"moara-jax-worker-connected\n"
    out, relay = _relay(connected + JAXLIB_DUMP[:fatal], JAXLIB_DUMP[fatal:] + b"more\n", pause=0.5)
    assert out == b"[Gloo] a line of the run's own\n"  # the C++ log lines just before go too
    assert relay.peer_lost and relay.connected and relay.declared is None
    lost = distributed.lost_processes(b"".join(relay.dropped).decode())
    assert lost == [1]
    several = JAXLIB_DUMP[fatal:].replace(b"heartbeats):\n1\n", b"heartbeats):\n3, 1\n").decode()
    assert distributed.lost_processes(several) == [1, 3]
    assert distributed.lost_processes("Either the leader task was preempted/died/restarted") == [0]
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    assert distributed.peer_lost_line(lost).startswith("error: process 0 of 2 lost process 1 (")
    # jaxlib ends a process the same way when the others do not all connect in time
    _, relay = _relay(JAXLIB_DUMP[fatal:])
    assert relay.peer_lost and not relay.connected
    line = distributed.peer_lost_line([], relay.connected)
    assert line.startswith("error: process 0 of 2 did not connect to every process through the coordinator")
    # The trainer's status after output without its line's end: the output is passed on, ended
    out, relay = _relay(b"a line without its end" + b"moara-jax-worker-exit-status 75\n")
    assert out == b"a line without its end\n" and relay.declared == 75


@pytest.mark.slow
def test_launcher_relay_passes_other_output_and_takes_the_declared_status(monkeypatch):
    monkeypatch.setattr(distributed, "_HOLD_S", 0.2)  # released well before the next piece
    log = b"E1124 04:06:09.291011   15628 some_file.cc:12] a C++ error, then nothing fatal\n"
    out, relay = _relay(b"plain\n" + log, b"no newline", b"moara-jax-worker-exit-status 75\n", pause=1.5)
    assert out == b"plain\n" + log + b"no newline"
    assert relay.declared == 75 and not relay.peer_lost and not relay.connected


def test_which_environments_run_as_several_processes(monkeypatch):
    """JAX's coordinator variables, or a SLURM job step of several tasks; not a SLURM allocation's
    shell (no step: jax.distributed could not find the nodes) nor a step of one task, also where
    ``SLURM_NTASKS`` is still the allocation's."""
    assert not distributed.multi_process()  # the test session: none of them
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")
    assert distributed.multi_process()
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    for name, value in slurm_step(1, 7, allocation_tasks=4).items():
        monkeypatch.setenv(name, value)
    assert distributed.multi_process() and distributed.slurm_step_tasks() == 2
    assert distributed.peer_lost_line([0]).startswith("error: process 1 of 2 lost process 0 (")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # salloc's interactive step (--preserve-env)
    assert not distributed.multi_process()
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")  # no step count: SLURM_NTASKS
    assert distributed.slurm_step_tasks() == 4
    monkeypatch.delenv("SLURM_STEP_NODELIST")  # salloc's shell: a job, no step
    assert not distributed.multi_process()


def test_jax_variables_take_precedence_over_slurms(tmp_path):
    """JAX's three variables in a SLURM step (one task per host driving all its GPUs): nothing is
    read from SLURM, whose ``SLURM_LOCALID`` would leave the process that one GPU of its host."""
    launch = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "1"}
    env = environment(2, **slurm_step(1, 7), **launch, JAX_PROCESS_ID="0")
    probe = (
        "from train import distributed; distributed.initialize(); import jax; "
        "print(jax.process_count(), jax.config.read('jax_cuda_visible_devices'), jax.device_count())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "all", "2"], proc.stdout


def test_a_slurm_step_gives_jax_the_steps_number_of_processes(monkeypatch):
    """SLURM_NTASKS (what jax.distributed reads) may be the allocation's: the trainer passes the
    step's count, also where the coordinator's address alone is given (SLURM's process id is
    read then); JAX's three variables are passed as they are, and checked."""
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_initialized", False)
    for name, value in slurm_step(1, 7, allocation_tasks=4).items():
        monkeypatch.setenv(name, value)
    distributed.initialize()
    assert calls[-1]["num_processes"] == 2 and "cluster_detection_method" not in calls[-1]
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")  # the coordinator alone named:
    distributed.initialize()  # SLURM's process id is read, with the step's count
    assert calls[-1]["num_processes"] == 2 and "cluster_detection_method" not in calls[-1]
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    distributed.initialize()  # JAX's three variables: nothing read from SLURM
    given = {key: calls[-1].get(key) for key in ("num_processes", "process_id", "cluster_detection_method")}
    assert given == {"num_processes": 2, "process_id": 1, "cluster_detection_method": "deactivate"}
    monkeypatch.setenv("JAX_PROCESS_ID", "one")
    with pytest.raises(UserError, match="JAX_PROCESS_ID must be a whole number"):
        distributed.initialize()


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:notaport", ":1234", "host0:0", "host0:70000"])
def test_a_coordinator_address_without_a_port_is_one_line(address, monkeypatch):
    """Checked before JAX reads it (which fails with an IndexError, or logs a second line)."""
    import jax

    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"JAX got {kw}"))
    monkeypatch.setattr(distributed, "_initialized", False)
    for name, value in (
        ("JAX_COORDINATOR_ADDRESS", address),
        ("JAX_NUM_PROCESSES", "2"),
        ("JAX_PROCESS_ID", "0"),
    ):
        monkeypatch.setenv(name, value)
    with pytest.raises(
        UserError, match=rf"JAX_COORDINATOR_ADDRESS must be HOST:PORT \(a port 1-65535\), got '{address}'"
    ):
        distributed.initialize()


def test_heartbeat_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv(HEARTBEAT_ENV, "12")
    assert distributed.heartbeat_timeout() == 12
    monkeypatch.delenv(HEARTBEAT_ENV)
    assert distributed.heartbeat_timeout() == distributed.HEARTBEAT_TIMEOUT_S
    monkeypatch.setenv(HEARTBEAT_ENV, "soon")
    with pytest.raises(UserError, match=HEARTBEAT_ENV):
        distributed.heartbeat_timeout()
