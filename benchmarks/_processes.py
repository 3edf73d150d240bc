"""Child processes of the benchmark drivers (``evidence.py``, ``gpu_session.py``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import signal
import subprocess
import time

# Where both drivers record the process groups they start (``Groups``), relative to the repository
# root: either ends what a call cut off at its limit left of the other's.
CHILDREN_FILE = pathlib.Path(".evidence") / "children.json"


def kill_group(proc: subprocess.Popen) -> None:
    """Kills a process started with ``start_new_session`` and every process of its group (a
    run's data-loading workers, train.prepare's tokenizing workers, helpers a phase left behind)."""
    with contextlib.suppress(ProcessLookupError):  # the group has gone already
        os.killpg(proc.pid, signal.SIGKILL)


class Groups:
    """The process groups a driver started, recorded in a file so that the next call on the same
    machine can end those a killed call left running. A command cut off at its time limit loses
    the driver but not its children (each in a session of its own): on a machine kept warm for
    the next call they would go on sharing the GPU with its runs, which would then be timed as
    if alone. A recorded group is ended only while its leader is still the process recorded and
    the driver that started it is not (the same start times: a reused process id is left alone,
    and so are the children of a driver still running beside this one). The file is read and
    written under a lock (``fcntl.flock``), so that drivers beside each other lose no entry."""

    def __init__(self, path: pathlib.Path):
        self.path = pathlib.Path(path)
        self.me = {"driver": os.getpid(), "driver_start": start_time(os.getpid())}

    @contextlib.contextmanager
    def _locked(self):
        """The recorded groups, under the lock, written back on leaving."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                groups = json.loads(self.path.read_text())
            except (OSError, ValueError):
                groups = {}
            groups = groups if isinstance(groups, dict) else {}
            yield groups
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(groups))
            os.replace(tmp, self.path)

    def add(self, proc: subprocess.Popen, what: str) -> None:
        start = start_time(proc.pid)
        if start is None:  # gone already, or no /proc to tell it from a later process of its id
            return
        with self._locked() as groups:
            groups[str(proc.pid)] = {"what": what, "start": start, **self.me}

    def remove(self, proc: subprocess.Popen) -> None:
        with self._locked() as groups:
            groups.pop(str(proc.pid), None)

    def end_leftovers(self, wait_s: float = 10.0) -> list[str]:
        """SIGKILL to each recorded group whose leader still runs and whose driver does not,
        then up to ``wait_s`` for the leaders to be gone (a killed process may hold the GPU's
        memory a moment longer); returns what they were."""
        ended = []
        with self._locked() as groups:
            for pid, record in list(groups.items()):
                if not isinstance(record, dict) or not pid.isdigit():
                    del groups[pid]
                    continue
                if _alive(record.get("driver"), record.get("driver_start")):
                    continue  # its driver runs: not a leftover
                del groups[pid]
                if not _alive(int(pid), record.get("start")):
                    continue  # gone, or the id is another process's now
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(pid), signal.SIGKILL)
                    ended.append((int(pid), record))
        deadline = time.monotonic() + wait_s
        while any(_alive(pid, r.get("start")) for pid, r in ended) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [f"{r.get('what')} (process group {pid})" for pid, r in ended]


def _alive(pid, start) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``start``."""
    return isinstance(pid, int) and pid > 1 and start is not None and start_time(pid) == start


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``/proc/PID/stat``), None if it has
    gone (a zombie too: it holds nothing any more) or where ``/proc`` is not there."""
    if pid <= 0:
        return None
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: fields after its end.
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])
