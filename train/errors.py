"""User-facing errors, faults of the machine, and the exit statuses of the command-line programs."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import sys
import warnings
from collections.abc import Callable, Iterator

# Exit statuses: a user error (config, files, environment) is 2; a run stopped by SIGTERM/SIGINT
# after saving what it had done is EXIT_PREEMPTED (sysexits' EX_TEMPFAIL: "try again later"),
# which a scheduler can requeue on; a write the machine refused (no space, I/O error, read-only
# filesystem, permission) is EXIT_IO_ERROR (sysexits' EX_IOERR), after keeping what was complete.
EXIT_USER_ERROR = 2
EXIT_IO_ERROR = 74
EXIT_PREEMPTED = 75
# A process of a multi-process run whose peer process was lost (stopped, or its host unreachable),
# or a command whose worker process ended unasked (killed, e.g. out of memory): sysexits'
# EX_UNAVAILABLE, "a service is unavailable"; the same command run again continues.
EXIT_PEER_LOST = 69


class UserError(Exception):
    """A problem with the user's config, files or environment (not a bug)."""


class ProcessLost(Exception):
    """A process the program needs ended unasked (a worker killed by the system, for example out
    of memory); what was complete is kept. One ``error:`` line and ``EXIT_PEER_LOST``."""


class IOFault(Exception):
    """The machine failed an operation on a file (no space, I/O error, read-only filesystem,
    permission): the program stops with one line naming the operation, the path and the cause.
    ``note`` adds what was kept and how to continue."""

    def __init__(self, operation: str, path, cause: str, note: str = ""):
        super().__init__(operation, str(path), cause, note)
        self.operation, self.path, self.cause, self.note = operation, str(path), cause, note

    def with_note(self, note: str) -> IOFault:
        return IOFault(self.operation, self.path, self.cause, "; ".join(filter(None, [self.note, note])))

    def __str__(self) -> str:
        text = f"{self.operation} {self.path} failed: {self.cause}"
        return f"{text}; {self.note}" if self.note else text


# The errno values that are the machine's fault, not the program's (ENOENT and the like are not:
# a missing input is a user error, a missing file the program wrote itself is a bug).
MACHINE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}

# Libraries that write through their own I/O layer (orbax through tensorstore) raise their own
# exception types with an absl status ("RESOURCE_EXHAUSTED: ... No space left on device
# [os_error_code='28']"): the system error is in the message.
_OS_ERROR_CODE = re.compile(r"os_error_code\s*=\s*'?(\d+)")
_ABSL_STATUS = re.compile(
    r"\b(RESOURCE_EXHAUSTED|PERMISSION_DENIED|DATA_LOSS|UNAVAILABLE|INTERNAL|UNKNOWN|FAILED_PRECONDITION): "
)
_STRERRORS = {os.strerror(code): code for code in MACHINE_ERRNOS}


def machine_errno(e: BaseException) -> int | None:
    """The errno of a machine fault that ``e`` reports: an ``OSError`` (``e`` or what it was
    raised from), or a library's error whose message carries one; else None. A ``UserError`` is
    never one (its text may quote a system message about the user's own file)."""
    seen = e
    while seen is not None:
        if isinstance(seen, UserError):
            return None
        if isinstance(seen, OSError):
            return seen.errno if seen.errno in MACHINE_ERRNOS else None
        seen = seen.__cause__ or seen.__context__
    return errno_in_text(str(e))


def errno_in_text(text: str) -> int | None:
    """The errno of a machine fault that a library's status message names: its
    ``os_error_code``, or a system message after an absl status code; else None."""
    match = _OS_ERROR_CODE.search(text)
    if match:
        return int(match.group(1)) if int(match.group(1)) in MACHINE_ERRNOS else None
    if not _ABSL_STATUS.search(text):
        return None
    return next((code for message, code in _STRERRORS.items() if message in text), None)


def cause(code: int) -> str:
    """``no space left on device``, ``read-only file system``, ... for an errno."""
    return os.strerror(code)[0].lower() + os.strerror(code)[1:]


@contextlib.contextmanager
def io_operation(operation: str, path) -> Iterator[None]:
    """Turns a machine fault inside the block into an ``IOFault`` naming ``operation`` and
    ``path``; every other exception passes through."""
    try:
        yield
    except IOFault:
        raise
    except Exception as e:
        code = machine_errno(e)
        if code is None:
            raise
        raise IOFault(operation, path, cause(code)) from None


class HeldFaults:
    """The writes the first process makes alone (metrics, checksums) during the steps of a
    multi-process run: while ``active``, a machine fault of one is held (the first kept in
    ``fault``) rather than raised, so that every process stops at the same step (``StepLoop``)
    instead of that process alone while the others wait for it in the next collective; raised as
    ``io_operation`` raises it otherwise."""

    def __init__(self):
        self.active = False
        self.fault: IOFault | None = None

    @contextlib.contextmanager
    def operation(self, operation: str, path) -> Iterator[None]:
        try:
            with io_operation(operation, path):
                yield
        except IOFault as e:
            if not self.active:
                raise
            self.fault = self.fault or e


# This project's packages: a warning whose location is in them is about the run's settings.
_OWN = tuple(
    str(pathlib.Path(__file__).resolve().parents[1] / name) + "/" for name in ("train", "moara_jax", "models")
)


@contextlib.contextmanager
def one_line_warnings():
    """The run's own warnings (a clipped projection rank, ...; issued in this project's packages)
    as one line each, ``warning: MESSAGE``, without the source line Python adds, which points into
    the command's start-up, not at the settings; other packages' warnings as Python writes them."""
    previous = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None):
        if str(filename).startswith(_OWN):
            return f"warning: {message}\n"
        return previous(message, category, filename, lineno, line)

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = previous


def yaml_problem(e: Exception) -> str:
    """A YAML parser's error for a one-line message: ``" (line N): PROBLEM"`` (the line where the
    parser has it), to follow the file's name and ``is not valid YAML``."""
    where = getattr(e, "problem_mark", None)
    line = f" (line {where.line + 1})" if where is not None else ""
    return f"{line}: {getattr(e, 'problem', None) or next(iter(str(e).splitlines()), type(e).__name__)}"


def cli(body: Callable[[], int]) -> int:
    """Runs a command's body: a ``UserError``, an ``IOFault`` or a ``ProcessLost`` becomes one
    ``error:`` line on stderr and the status ``EXIT_USER_ERROR``, ``EXIT_IO_ERROR`` or
    ``EXIT_PEER_LOST``; this project's warnings are one line each (:func:`one_line_warnings`)."""
    statuses = {UserError: EXIT_USER_ERROR, IOFault: EXIT_IO_ERROR, ProcessLost: EXIT_PEER_LOST}
    try:
        with one_line_warnings():
            return body()
    except tuple(statuses) as e:
        print(f"error: {e}", file=sys.stderr)
        return next(status for kind, status in statuses.items() if isinstance(e, kind))
