"""Child processes of the benchmark drivers (``evidence.py``, ``gpu_session.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess


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
    if alone. A recorded group is ended only while its leader is still the process recorded
    (the same start time), so a reused process id is left alone."""

    def __init__(self, path):
        self.path = path

    def _read(self) -> dict:
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def _write(self, groups: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, self.path)

    def add(self, proc: subprocess.Popen, what: str) -> None:
        start = start_time(proc.pid)
        if start is None:  # gone already, or no /proc to tell it from a later process of its id
            return
        groups = self._read()
        groups[str(proc.pid)] = {"what": what, "start": start}
        self._write(groups)

    def remove(self, proc: subprocess.Popen) -> None:
        groups = self._read()
        if groups.pop(str(proc.pid), None) is not None:
            self._write(groups)

    def end_leftovers(self) -> list[str]:
        """SIGKILL to each recorded group whose leader still runs; returns what they were."""
        ended = []
        for pid, record in self._read().items():
            start = start_time(int(pid)) if pid.isdigit() and int(pid) > 1 else None
            if start is None or not isinstance(record, dict) or start != record.get("start"):
                continue  # gone, or the id is another process's now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)
                ended.append(f"{record.get('what')} (process group {pid})")
        self._write({})
        return ended


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``/proc/PID/stat``), None if it has
    gone or where ``/proc`` is not there."""
    if pid <= 0:
        return None
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: fields after its end.
    return int(stat.rsplit(")", 1)[1].split()[19])
