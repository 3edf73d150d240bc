"""Child processes of the benchmark drivers (``evidence.py``, ``gpu_session.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def kill_group(proc: subprocess.Popen) -> None:
    """Kills a process started with ``start_new_session`` and every process of its group (a
    run's data-loading workers, train.prepare's tokenizing workers, helpers a phase left behind)."""
    with contextlib.suppress(ProcessLookupError):  # the group has gone already
        os.killpg(proc.pid, signal.SIGKILL)
