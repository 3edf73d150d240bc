"""What orbax and the libraries under it print that the trainer says itself, in one line, kept
out of the run's output: the error records orbax logs for a save that a fault of the machine
fails and for a damaged checkpoint metadata file (filtered from import on), and the tracebacks
a read or save that fails part-way leaves behind (``drop_failed_read_leftovers``, from a
checkpointer's start)."""

from __future__ import annotations

import logging
import pathlib
import sys
import traceback

import orbax.checkpoint as ocp

from train.errors import errno_in_text, machine_errno

# What orbax logs, on finding a checkpoint's _CHECKPOINT_METADATA damaged, before the file's
# content: the checkpoint's verification names the file (then it is moved aside), or, with no
# checksums, its arrays are read as written (orbax does not need that file to read them).
_DAMAGED_METADATA = ("Failed to json parse Metadata file", "Failed to read Metadata file")


ORBAX_DIR = str(pathlib.Path(ocp.__file__).parent.parent) + "/"  # the orbax package


def drop_failed_read_leftovers() -> None:
    """Drops, from now on in this process, Python's reports of what a checkpoint read or write
    that failed part-way (a truncated file in a checkpoint without checksums, a disk that fills
    during an asynchronous save) leaves behind: orbax's coroutines that raise as they are
    discarded, and tensorstore's callbacks into the event loop orbax has closed, each reported as
    unraisable, and asyncio's records of orbax's gatherings whose exception nobody retrieved
    (``OrbaxLeftovers``): tens to hundreds of tracebacks after the line that says what happened.
    Every other report goes to the hook before."""
    logging.getLogger("asyncio").addFilter(_ORBAX_LEFTOVERS)  # (once: logging keeps no duplicate)
    previous = sys.unraisablehook
    if getattr(previous, "drops_failed_read_leftovers", False):
        return

    def hook(unraisable) -> None:
        error, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
        closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        orbax_coroutine = code is not None and code.co_filename.startswith(ORBAX_DIR)
        if not (closed_loop or orbax_coroutine):
            previous(unraisable)

    hook.drops_failed_read_leftovers = True
    sys.unraisablehook = hook


class _OrbaxRecords(logging.Filter):
    """Drops the error records orbax logs for what the trainer reports itself, in one line: a
    save that fails for a fault of the machine (no space, ...; logged by orbax's writer
    threads), and a damaged checkpoint metadata file (logged with the file's content)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "orbax" not in record.pathname:
            return True
        message = record.getMessage()
        if message.startswith(_DAMAGED_METADATA):
            return False
        error = record.exc_info[1] if record.exc_info else None
        return errno_in_text(message) is None and (error is None or machine_errno(error) is None)


logging.getLogger("absl").addFilter(_OrbaxRecords())


class OrbaxLeftovers(logging.Filter):
    """Drops asyncio's records of an orbax task or gathering whose exception nobody retrieved
    (``_GatheringFuture exception was never retrieved``, with its traceback): what a read that
    failed part-way leaves, reported by the trainer in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or "exception was never retrieved" not in record.getMessage():
            return True
        frames = traceback.extract_tb(error.__traceback__)
        return not any(frame.filename.startswith(ORBAX_DIR) for frame in frames)


_ORBAX_LEFTOVERS = OrbaxLeftovers()
