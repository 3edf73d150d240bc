"""Runs on several processes (hosts): ``jax.distributed`` set-up, one stop step for every
process on SIGTERM/SIGINT, and a launcher that turns the loss of a peer process into one line and
exit status ``EXIT_PEER_LOST``.

``python -m train`` runs this way when ``JAX_COORDINATOR_ADDRESS`` (with ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID``) is set, or as a task of a SLURM job step of several tasks (``multi_process``).
The command then is a small launcher (``launch``) that starts the trainer as its child process,
because jaxlib ends a process whose peer is lost from C++: its coordination client aborts
(``LOG(FATAL)``, a stack dump, status 134) as soon as the coordination service reports the error,
at once when process 0 (which hosts the service) is gone, after the heartbeat timeout when another
is; the client's ``missed_heartbeat_callback`` cannot take a Python function in jaxlib 0.10.2 (it
fails with ``std::bad_cast``). The launcher relays the trainer's C++ output (file descriptor 2;
the trainer's Python ``sys.stderr`` goes straight to the launcher's), drops jaxlib's dump, prints
``peer_lost_line()`` and exits ``EXIT_PEER_LOST``. A trainer that ends for its own reason declares
its status to the launcher first, so a failure at jax's shutdown barrier after that does not
change it.

Timeouts: a peer that stops sending heartbeats for ``$MOARA_JAX_HEARTBEAT_TIMEOUT`` seconds
(default ``HEARTBEAT_TIMEOUT_S``) is lost; every process must connect within
``INIT_TIMEOUT_S``; at exit a process waits ``SHUTDOWN_TIMEOUT_S`` at most for the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import threading
import time

from train.errors import EXIT_PEER_LOST, IOFault, ProcessLost, UserError

HEARTBEAT_ENV = "MOARA_JAX_HEARTBEAT_TIMEOUT"
HEARTBEAT_TIMEOUT_S = 30
INIT_TIMEOUT_S = 300
SHUTDOWN_TIMEOUT_S = 120

_WORKER_ENV = "MOARA_JAX_WORKER_STDERR"  # in the trainer: the fd of the launcher's stderr
_EXIT_TAG = b"moara-jax-worker-exit-status "  # the trainer's declared status, on its fd 2
_CONNECTED_TAG = b"moara-jax-worker-connected"  # the trainer's jax.distributed.initialize returned
_PEER_LOST = b"JAX distributed service detected fatal errors"  # jaxlib's last line before abort()
_GLOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
_HOLD_S = 1.0  # C++ log lines wait this long for a following fatal line that drops them

_initialized = False


# What jax.distributed reads from a SLURM job step (its SlurmCluster): all must be set.
SLURM_STEP_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
# Where jax.distributed puts the coordinator of a SLURM step.
SLURM_COORDINATOR = "on the step's first node, port 61440 + SLURM_JOB_ID mod 4096 or $JAX_COORDINATOR_PORT"


def slurm_step_tasks() -> int:
    """The number of tasks of the SLURM job step this process is a task of (0: none). The step's
    own count (``SLURM_STEP_NUM_TASKS``), which ``SLURM_NTASKS`` (what jax.distributed reads) is
    not where srun kept the allocation's environment (``--preserve-env``, salloc's interactive
    step); ``SLURM_NTASKS`` where a SLURM sets no step count."""
    env = os.environ
    if not all(env.get(v) for v in SLURM_STEP_VARS):
        return 0
    tasks = env.get("SLURM_STEP_NUM_TASKS", env["SLURM_NTASKS"]).strip()
    return int(tasks) if tasks.isdigit() else 0


def multi_process() -> bool:
    """Whether ``python -m train`` runs as one of several processes: ``JAX_COORDINATOR_ADDRESS``
    is set, or it is a task of a SLURM job step of several tasks (``srun``). In a SLURM
    allocation's shell or a step of one task (salloc's interactive step too) it runs alone."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or slurm_step_tasks() > 1


def is_worker() -> bool:
    """Whether this process is a trainer started by ``launch``."""
    return _WORKER_ENV in os.environ


def heartbeat_timeout() -> int:
    raw = os.environ.get(HEARTBEAT_ENV, "").strip()
    if not raw:
        return HEARTBEAT_TIMEOUT_S
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{HEARTBEAT_ENV} must be a whole number of seconds >= 1, got {raw!r}")
    return value


def _process() -> tuple[str, str]:
    """This process's id and the number of processes, as the environment gives them."""
    env = os.environ
    return (
        env.get("JAX_PROCESS_ID", env.get("SLURM_PROCID", "?")),
        env.get("JAX_NUM_PROCESSES", str(slurm_step_tasks() or "?")),
    )


def peer_lost_line(lost: list[int] | None = None, connected: bool = True) -> str:
    """The launcher's one line; ``lost``: the processes jaxlib named, when it named them;
    ``connected``: whether the trainer had connected to every process."""
    me, n = _process()
    if not connected:
        where = os.environ.get("JAX_COORDINATOR_ADDRESS", SLURM_COORDINATOR)
        return (
            f"error: process {me} of {n} did not connect to every process through the coordinator "
            f"{where} within {INIT_TIMEOUT_S} s (or one was lost meanwhile): start all {n} with the "
            "same coordinator address and number of processes"
        )
    peer = f"process {', '.join(map(str, lost))}" if lost else "a peer process"
    return (
        f"error: process {me} of {n} lost {peer} (it stopped, or its host is unreachable); the "
        "checkpoints saved so far are kept: restart every process with the same command and --resume"
    )


def lost_processes(dump: str) -> list[int]:
    """The processes a jaxlib fatal error names as lost (its wording in jaxlib 0.10.2), else []."""
    if "leader task was preempted/died" in dump:
        return [0]  # process 0 hosts the coordination service
    if m := re.search(r"stopped sending heartbeats\):\s*([\d,\s]+)", dump):
        return sorted({int(t) for t in re.findall(r"\d+", m.group(1))})
    return sorted({int(t) for t in re.findall(r"Task (\d+) heartbeat timeout", dump)})


# ------------------------------------------------------------------------------------ the trainer


def initialize() -> None:
    """``jax.distributed.initialize`` with this module's timeouts; JAX's preemption service is off
    (``StopSignals`` agrees on the stop step, and SIGTERM outside the step loop ends the process
    as it does in a one-process run)."""
    global _initialized
    import jax

    timeout = heartbeat_timeout()
    env = {}
    for key, var in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
        if var in os.environ:
            if not os.environ[var].strip().isdigit():
                raise UserError(f"{var} must be a whole number, got {os.environ[var]!r}")
            env[key] = int(os.environ[var])
    address = os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip()
    if address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"JAX_COORDINATOR_ADDRESS must be HOST:PORT (a port 1-65535), got {address!r}")
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and len(env) == 2:
        # JAX's three variables say it all: no cluster's (SLURM's) variables read, which would
        # also give the process one GPU of its host.
        env["cluster_detection_method"] = "deactivate"
    elif slurm_step_tasks() > 1:  # (the address alone given: SLURM's id and count are read)
        env.setdefault("num_processes", slurm_step_tasks())  # the step's, not the allocation's
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(
            **env,
            initialization_timeout=INIT_TIMEOUT_S,
            heartbeat_timeout_seconds=timeout,
            shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
        )
    except Exception as e:  # noqa: BLE001 - jaxlib raises several types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        where = os.environ.get("JAX_COORDINATOR_ADDRESS", SLURM_COORDINATOR)
        raise UserError(f"jax.distributed.initialize (coordinator {where}) failed: {first}") from None
    _initialized = True
    if is_worker():
        with contextlib.suppress(OSError):
            os.write(2, _CONNECTED_TAG + b"\n")


def use_launcher_stderr() -> None:
    """In a trainer started by ``launch``: Python's ``sys.stderr`` writes to the launcher's stderr
    directly (a terminal stays a terminal for the progress line); fd 2 is the relayed pipe."""
    fd = int(os.environ[_WORKER_ENV])
    sys.stderr = open(fd, "w", buffering=1, errors="backslashreplace")  # noqa: SIM115 - for the process


def declare_exit(status: int) -> None:
    """Tells the launcher the status this trainer ends with (before jax's shutdown barrier)."""
    if is_worker():
        sys.stderr.flush()
        with contextlib.suppress(OSError):
            os.write(2, _EXIT_TAG + str(status).encode() + b"\n")


def before_traceback(error: BaseException) -> None:
    """An unexpected runtime error in a multi-process trainer may come from a lost peer (a
    collective or a barrier that fails: jaxlib raises ``RuntimeError``s): waits for the
    coordination service's verdict, which ends this process when a peer is lost (the launcher
    then says so), before the traceback is shown. Other errors (bugs) show at once."""
    if _initialized and isinstance(error, RuntimeError):
        time.sleep(heartbeat_timeout() + 10)
    declare_exit(1)


class StopSignals:
    """SIGTERM/SIGINT ask the step loop to stop after saving a checkpoint; ``at_step`` is called
    once per step and says whether to stop after it, and why. A second SIGINT (Ctrl-C again, while
    a long compilation or a save keeps the first waiting) ends the process at once, by the signal,
    with a line saying so: the last complete checkpoint stays.

    One process: the loop stops after the step during which the request came. Several: every
    process must stop at the same step (the checkpoint is saved collectively), so each step's
    requests, and the faults of the machine a process holds (``HeldFaults``), are combined over
    the processes by a small jitted max, read at the next step: the loop stops one step later,
    at the same step in every process."""

    SIGNAL, FAULT = 1, 2  # what stops the steps: the votes' values (a fault outvotes a signal)

    def __init__(self):
        import jax

        self.requested = False
        self._interrupted = False  # a SIGINT came
        self._old: dict = {}
        self._vote = _Vote() if jax.process_count() > 1 else None
        self._pending = None

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self._interrupted:
            sys.stderr.write(
                "error: interrupted twice: stopped at once, without the checkpoint the first "
                "interrupt asked for (--resume goes on from the run's last complete checkpoint, "
                "or from step 0 where it has none)\n"
            )
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            return
        self._interrupted |= signum == signal.SIGINT
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def at_step(self, fault: bool = False) -> int:
        """0 to go on, else why to stop: ``FAULT`` when a process holds a fault of the machine
        (``fault``: this one does), ``SIGNAL`` when one was asked to stop."""
        mine = self.FAULT if fault else self.SIGNAL if self.requested else 0
        if self._vote is None:
            return mine
        previous, self._pending = self._pending, self._vote(mine)
        return 0 if previous is None else int(previous)


def any_process(flag: bool) -> bool:
    """Whether ``flag`` holds in any process (every process must call it at the same point)."""
    import jax

    return flag if jax.process_count() == 1 else bool(_shared_vote()(flag))


@contextlib.contextmanager
def errors_shared():
    """A block every process runs at the same point, whose ``UserError``, ``IOFault`` or
    ``ProcessLost`` (e.g. process 0's refusal of a run dir another run holds, its full disk, or
    one process's missing data file) ends every process: each raises the first process's error
    after the block (``first_error``). The others would otherwise go on to the next collective and
    wait there for the failed process until it is reported lost. The block itself must hold no
    collective that a process may fail before (it would meet another's exchange of errors)."""
    error = None
    try:
        yield
    except (UserError, IOFault, ProcessLost) as e:
        error = e
    error = first_error(error)
    if error is not None:
        raise error


def first_error(error: Exception | None) -> Exception | None:
    """The error of the first process (in process order) that has one, in every process (every
    process must call it at the same point); one process: ``error``. Another process's than
    process 0's names it (``process 1 of 2: ...``) in every process, so that each prints the same
    line. Sent pickled (at most ``_ERROR_BYTES``: a longer one as a ``UserError`` of its text)."""
    import jax

    if jax.process_count() == 1:
        return error
    data = b"" if error is None else pickle.dumps(error)
    if len(data) > _ERROR_BYTES:
        data = pickle.dumps(UserError(str(error)[: _ERROR_BYTES // 8]))
    for index, sent in enumerate(_gather(data)):
        if sent:
            found = pickle.loads(sent)
            return found if index == 0 else _naming(found, index, jax.process_count())
    return None


def _naming(error: Exception, index: int, count: int) -> Exception:
    where = f"process {index} of {count}:"
    if isinstance(error, IOFault):
        return IOFault(f"{where} {error.operation}", error.path, error.cause, error.note)
    return type(error)(f"{where} {error}")


def differs_from_first(value: str) -> bool:
    """Whether this process's ``value`` (a digest) differs from process 0's (every process must
    call it at the same point); one process: False."""
    import jax

    return jax.process_count() > 1 and _gather(value.encode())[0] != value.encode()


def _gather(data: bytes) -> list[bytes]:
    """Every process's ``data`` (at most ``_ERROR_BYTES``), in process order."""
    import numpy as np
    from jax.experimental import multihost_utils

    sent = np.zeros(_ERROR_BYTES + 4, np.uint8)
    sent[:4] = np.frombuffer(len(data).to_bytes(4, "little"), np.uint8)
    sent[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
    got = np.asarray(multihost_utils.process_allgather(sent))
    return [row[4 : 4 + int.from_bytes(row[:4].tobytes(), "little")].tobytes() for row in got]


_ERROR_BYTES = 4096


@functools.cache
def _shared_vote() -> _Vote:
    return _Vote()


class _Vote:
    """The maximum over every device of a per-process integer, as a replicated array."""

    def __init__(self):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh = Mesh(np.asarray(jax.devices()), ("all",))
        self.sharding = NamedSharding(mesh, PartitionSpec("all"))
        self.local = np.zeros(len(jax.local_devices()), np.int32)
        self.max = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def __call__(self, value: int):
        import jax

        return self.max(jax.make_array_from_process_local_data(self.sharding, self.local + int(value)))


# ----------------------------------------------------------------------------------- the launcher


def launch(argv: list[str]) -> int:
    """Runs ``python -m train ARGV`` as a child trainer and returns its exit status, or
    ``EXIT_PEER_LOST`` with one line when jaxlib ended it for a lost peer. SIGTERM and SIGINT are
    passed on; the child dies with the launcher (Linux)."""
    direct = os.dup(2)
    os.set_inheritable(direct, True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", *argv],
        env={**os.environ, _WORKER_ENV: str(direct)},
        stderr=subprocess.PIPE,
        pass_fds=(direct,),
        preexec_fn=dies_with_parent(),  # noqa: PLW1509 - no thread runs yet in this process
    )
    os.close(direct)
    relay = _Relay(proc.stderr.fileno())
    relay.start()

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = proc.wait()
    relay.join(timeout=10)
    if relay.declared is not None:
        return relay.declared
    if relay.peer_lost:
        lost = lost_processes(b"".join(relay.dropped).decode(errors="replace"))
        print(peer_lost_line(lost, relay.connected), file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    return code if code >= 0 else 128 - code


try:  # loaded before any fork: a child between fork and exec only calls it
    _LIBC = ctypes.CDLL(None)
except OSError:
    _LIBC = None


def dies_with_parent(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` by which the child gets ``sig`` when the process that started it ends,
    however it ends (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    parent = os.getpid()

    def arrange() -> None:
        with contextlib.suppress(Exception):  # (no prctl: not Linux)
            _LIBC.prctl(1, sig)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent ended before it was arranged
                os.kill(os.getpid(), sig)

    return arrange


class _Relay(threading.Thread):
    """Copies the trainer's fd 2 to the launcher's stderr, holding C++ log lines for ``_HOLD_S``:
    from jaxlib's fatal line for a lost peer on, it drops what it holds and the rest (the dump);
    it takes the trainer's messages (connected, its exit status) out of the stream."""

    def __init__(self, fd: int):
        super().__init__(daemon=True)
        self.fd = fd
        self.out = sys.stderr.buffer
        self.declared: int | None = None
        self.connected = False
        self.peer_lost = False
        self.dropped: list[bytes] = []  # from the held lines before jaxlib's fatal line on
        self.held: list[bytes] = []
        self.held_since = 0.0

    def run(self) -> None:
        partial = b""
        while True:
            ready, _, _ = select.select([self.fd], [], [], 0.25)
            if ready:
                data = os.read(self.fd, 1 << 16)
                if not data:
                    break
                *lines, partial = (partial + data).split(b"\n")
                for line in lines:
                    self.line(line)
            elif partial and not self.held and not self.peer_lost:
                self.emit(partial)  # a line without its end yet: not a C++ log line
                partial = b""
            if self.held and time.monotonic() - self.held_since > _HOLD_S:
                self.release()
        if partial:
            self.line(partial, end=b"")
        self.release()

    def line(self, line: bytes, end: bytes = b"\n") -> None:
        if self.peer_lost:
            if len(self.dropped) < 200:
                self.dropped.append(line + end)
            return
        for tag in (_CONNECTED_TAG, _EXIT_TAG):
            if tag in line:
                before, _, status = line.partition(tag)
                if tag == _CONNECTED_TAG:
                    self.connected = True
                else:
                    with contextlib.suppress(ValueError):
                        self.declared = int(status)
                if before:
                    self.line(before)
                return
        if _PEER_LOST in line:
            self.peer_lost, self.dropped, self.held = True, [*self.held, line + end], []
            return
        if self.held or _GLOG.match(line):
            if not self.held:
                self.held_since = time.monotonic()
            self.held.append(line + end)
            return
        self.emit(line + end)

    def release(self) -> None:
        if self.held and not self.peer_lost:
            self.emit(b"".join(self.held))
        self.held = []

    def emit(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            self.out.write(data)
            self.out.flush()
