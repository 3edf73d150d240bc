"""Orbax checkpoints: train state (params, optimizer state with bases and counters, step) and
the data iterator state, every N steps, keeping K, written atomically by orbax, and verified.

Each finished checkpoint gets a record of the sha256 of every file it holds
(``RUN_DIR/checksums/STEP.json``). A resume tries the newest checkpoint first: one that fails
verification (a file missing, truncated or changed), holds non-finite parameters, or has no
checksums and cannot be read is moved to ``RUN_DIR/rejected_checkpoints/`` with a one-line
reason, and the next older one is tried. A checkpoint whose files verify but whose read fails
(device memory, the filesystem) is kept, and the run stops with one line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import pathlib
import re
import shutil
import time
from collections.abc import Callable

import jax
import orbax.checkpoint as ocp

from train.distributed import any_process, errors_shared, multi_process
from train.errors import HeldFaults, IOFault, UserError, cause, io_operation, machine_errno
from train.orbax_noise import drop_failed_read_leftovers
from train.rundir import CHECKPOINTS, CONFIG, MODEL, RunDir, RunLock, write_atomically


def _file_sums(directory: pathlib.Path) -> dict[str, str]:
    sums = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        sums[str(path.relative_to(directory))] = h.hexdigest()
    return sums


def _verify(directory: pathlib.Path, sums: pathlib.Path) -> str | None:
    if not sums.is_file():
        return None
    try:
        want = json.loads(sums.read_text())
    except ValueError:
        return None
    have = _file_sums(directory)
    missing = sorted(set(want) - set(have))
    changed = sorted(k for k in want if k in have and have[k] != want[k])
    if missing:
        return f"files missing: {', '.join(missing[:3])}"
    if changed:
        return f"files changed since it was written: {', '.join(changed[:3])}"
    return None


# Room left beside a checkpoint's arrays: orbax's metadata and the checksums file.
SPACE_MARGIN_BYTES = 1 << 20


class Checkpointer:
    def __init__(self, run: RunDir, keep: int, every: int, enabled: bool = True):
        """The checkpoints of ``run`` (its ``checkpoints/``, ``checksums/`` and
        ``rejected_checkpoints/``); ``enabled``: this process records checksums and moves
        rejected checkpoints (the first process of a multi-host run)."""
        self.directory = run.checkpoints.resolve()
        self.every = every
        self.enabled = enabled
        self.sums_dir = run.checksums.resolve()
        self.rejected_dir = run.rejected.resolve()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        drop_failed_read_leftovers()  # and of a save the disk fills during
        self._remove_partial()  # a save that was killed (orbax would warn when it saves that step)
        with io_operation("creating the checkpoint directory", self.directory):
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._unrecorded: list[int] = []
        self.faults = HeldFaults()  # the checksums' faults, held during a multi-process run's steps

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_state: dict, force: bool = False) -> None:
        if step in self.manager.all_steps():
            return
        self.record_finished()
        self._check_space(step, state, data_state)
        self._forget_stale_sums()  # an earlier checkpoint of this step's, removed, is not this one
        self._unrecorded.append(step)  # a fault of this save may surface at the next wait
        with io_operation(f"saving checkpoint {step} to", self.directory):
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
                ),
                force=force,
            )

    def _check_space(self, step: int, state, data_state: dict) -> None:
        """Refuses a save the filesystem has no room for before orbax starts writing it (a save
        that runs out of space midway fails too, but through orbax's writer threads, which
        print their own tracebacks). The bytes are this process's share of the state."""
        need = (
            SPACE_MARGIN_BYTES
            + len(json.dumps(data_state))
            + sum(
                shard.data.nbytes
                for x in jax.tree.leaves(state)
                for shard in x.addressable_shards
                if shard.replica_id == 0
            )
        )
        operation = f"saving checkpoint {step} to"
        unreadable = None
        try:
            with io_operation(operation, self.directory):
                free = shutil.disk_usage(self.directory).free
        except IOFault as e:  # e.g. an I/O error
            unreadable, free = e, 0
        # The save is collective: every process refuses it when one has no room (or cannot tell).
        if any_process(free < need):
            if unreadable is not None:
                raise unreadable
            if free >= need:
                elsewhere = "another process has no room for its share or cannot tell"
                raise IOFault(operation, self.directory, elsewhere)
            room = f"it needs {need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free"
            raise IOFault(operation, self.directory, f"{cause(errno.ENOSPC)} ({room})")

    def record_finished(self) -> None:
        """Checksums of the checkpoints saved so far (waits for an asynchronous save to end: a
        save that failed in orbax's threads raises here)."""
        if not self._unrecorded:
            return
        with io_operation(f"saving checkpoint {self._unrecorded[-1]} to", self.directory):
            self.manager.wait_until_finished()
        self._write_sums(self._unrecorded)
        self._unrecorded.clear()

    def record_if_finished(self) -> None:
        """Checksums of the saves orbax has put in place, as soon as it has, without waiting
        (called once per step: a run killed before its next save leaves its newest checkpoint
        verifiable). The first process's alone; a save not in place (failed in orbax's threads)
        stays for the next wait to report."""
        if not self.enabled or not self._unrecorded or self.manager.is_saving_in_progress():
            return
        done = [s for s in self._unrecorded if (self.directory / str(s)).is_dir()]
        if done:
            self._write_sums(done)
            self._unrecorded = [s for s in self._unrecorded if s not in done]

    def _write_sums(self, steps: list[int]) -> None:
        if not self.enabled:
            return
        with self.faults.operation("writing checkpoint checksums to", self.sums_dir):
            self.sums_dir.mkdir(exist_ok=True)
            for step in steps:
                if (self.directory / str(step)).is_dir():
                    sums = json.dumps(_file_sums(self.directory / str(step)), indent=0)
                    write_atomically(self.sums_dir / f"{step}.json", sums)
        self._forget_stale_sums()  # orbax removes the oldest checkpoints beyond `keep`

    def _forget_stale_sums(self) -> None:
        """Removes the checksums of checkpoints no longer on disk (the first process's)."""
        if not self.enabled or not self.sums_dir.is_dir():
            return
        kept = {str(s) for s in self.complete_steps()}
        with self.faults.operation("writing checkpoint checksums to", self.sums_dir):
            for stale in self.sums_dir.glob("*.json"):
                if stale.stem.isdigit() and stale.stem not in kept:
                    stale.unlink(missing_ok=True)

    def abandon(self) -> None:
        """After a fault of the machine: ends the manager without waiting on the failed save,
        and removes what an unfinished save left (orbax's ``*.orbax-checkpoint-tmp*``
        directories; a checkpoint without checksums is also one whose save failed after
        orbax finished it: it fails nothing, so it stays, as after a crash)."""
        with contextlib.suppress(Exception):  # the failed save raises again here
            self.manager.wait_until_finished()
        with contextlib.suppress(Exception):
            self.manager.close()
        self._unrecorded.clear()
        self._remove_partial()

    def _remove_partial(self) -> None:
        """Removes what an unfinished save left: orbax's ``*.orbax-checkpoint-tmp*`` directories
        (none is being written: the run dir is locked, and this process saves nothing now)."""
        if self.enabled and self.directory.is_dir():
            for partial in self.directory.glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)

    def complete_steps(self) -> list[int]:
        """The checkpoints on disk (orbax renames a save into place once it is complete), read
        from the directory: also after ``abandon``."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def verify(self, step: int) -> str | None:
        """Why checkpoint ``step`` fails verification against its checksums, or None (also when
        it has none: a run killed right after orbax finished it never recorded them)."""
        return _verify(self.directory / str(step), self.sums_dir / f"{step}.json")

    def restore(self, step: int, abstract_state):
        """``abstract_state``: ``jax.ShapeDtypeStruct``s with the target shardings."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
            ),
        )
        return out.state, out.data

    def restore_latest(self, abstract_state, usable: Callable[[object], str | None], say=print):
        """The newest checkpoint that verifies, reads and passes ``usable(state)`` (a reason to
        refuse it, or None): ``(step, state, data_state)``; ``None`` when there is none at all.
        Refused checkpoints are moved aside with a line each; a ``UserError`` names every one
        tried when none is usable.

        Only evidence against the checkpoint itself refuses it: files that fail their checksums,
        non-finite weights, or a read that fails on a checkpoint without checksums (a crash
        right after orbax finished it). A read that fails on files that verify (the device's
        memory, the filesystem, a library's version) moves nothing: an ``IOFault`` for a fault
        of the machine, else a ``UserError``; a later run can still resume from it.

        In a multi-process run every process restores the same step: the first process alone
        verifies the checksums (it also moves what is refused, once every process is done
        with it) and the others follow its verdict; a checkpoint without checksums whose read
        fails is not refused but reported (``_restore_verified``)."""
        tried = []
        for step in reversed(self.steps()):
            reason = self.verify(step) if self.enabled else None
            if any_process(reason is not None) and reason is None:
                reason = "fails verification (checked by the first process)"
            if reason is None:
                reason, restored = self._restore_verified(step, abstract_state, usable)
                if reason is None:
                    return (step, *restored)
            tried.append(f"step {step} ({reason})")
            say(f"checkpoint {step} is not usable: {reason}; moved to {self.rejected_dir}")
            self.reject(step)
        if tried:
            raise UserError(f"no usable checkpoint in {self.directory}: tried {'; '.join(tried)}")
        return None

    def _restore_verified(self, step: int, abstract_state, usable) -> tuple[str | None, tuple]:
        """Reads checkpoint ``step`` (which passed verification): ``(None, (state, data))``, or
        the reason to refuse it; raises for a read that fails on files that verify.

        In a multi-process run a failed read raises in the process it failed in: the others may
        have read the checkpoint and wait for it in orbax's closing barrier, which no vote can
        reach (they end with the lost-peer error when it exits). Checksums refuse a checkpoint
        in every process together; one without them is refused there by hand."""
        path = self.directory / str(step)
        drop_failed_read_leftovers()  # of a read that fails part-way, reported after it
        try:
            # Shapes first, from the metadata: a read that fails part-way leaves orbax's reads
            # calling back into a closed event loop.
            found = None if abstract_state is None else _first_difference(stored_state(path), abstract_state)
            if found is not None:  # (None: as stored)
                raise UserError(
                    f"checkpoint {path} holds another state than this run's settings make ({found}): "
                    f"it was made with other settings than its run dir's {CONFIG} holds, or by another "
                    "version of moara-jax; resume with what made it, or choose another run dir; it is kept"
                )
            state, data = self.restore(step, abstract_state)
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 - orbax/tensorstore raise many types
            first = _first_sentence(error)
            code = machine_errno(error)
            if code is not None:
                raise IOFault("reading checkpoint", path, cause(code), "it is kept") from error
            if (self.sums_dir / f"{step}.json").is_file():
                raise UserError(
                    f"checkpoint {path} matches its checksums but could not be restored "
                    f"({type(error).__name__}: {first}); it is kept"
                ) from error
            if multi_process():
                raise UserError(
                    f"checkpoint {path} has no checksums and could not be read in process "
                    f"{jax.process_index()} ({type(error).__name__}: {first}); it is kept: move it "
                    f"out of {self.directory} to resume from the one before"
                ) from error
            return f"unreadable ({type(error).__name__}: {first})", ()
        # Every process has read it: the check is of the global arrays, the same verdict in all.
        return usable(state), (state, data)

    def reject(self, step: int) -> None:
        """Moves checkpoint ``step`` (and its checksums) out of the way of later runs. In a
        multi-process run the first process moves it once every process has reached this point
        (none reads it any more), and every process then reads the directory again: they agree
        on the checkpoints there, and so on the saves to make (a save of a step they see is
        skipped)."""
        self.manager.wait_until_finished()
        any_process(False)  # every process is here
        with errors_shared():  # it is moved, or the first process's fault is every process's
            if self.enabled:
                with io_operation(f"moving checkpoint {step} to", self.rejected_dir):
                    self._move_aside(step)
        self.manager.reload()

    def _move_aside(self, step: int) -> None:
        self.rejected_dir.mkdir(exist_ok=True)
        target = self.rejected_dir / str(step)
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(self.directory / str(step)), str(target))
        sums = self.sums_dir / f"{step}.json"
        if sums.is_file():
            shutil.move(str(sums), str(target) + ".checksums.json")

    def reject_from(self, step: int) -> None:
        """Rejects every checkpoint at ``step`` or later (saved while a run was diverging). A
        fault on the way (the last save's checksums, a move) is every process's."""
        with errors_shared():
            self.record_finished()
        for s in self.steps():
            if s >= step:
                self.reject(s)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.record_finished()
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


READ_TRIES = 3  # reads of the newest checkpoint, each removed while it was read, before giving up
REMOVAL_WAIT_S = 5.0  # how long a checkpoint that failed to read may take to go, under a run training


def _removed_under_read(step_dir: pathlib.Path, run: RunDir) -> bool:
    """Whether a checkpoint whose read failed is one its run removes: gone, or going under a run
    still training (its lock held), whose ``checkpoint.keep`` removes the older checkpoints.
    orbax removes a checkpoint's files first and its directory last, so a read fails while the
    directory is still there: it is given :data:`REMOVAL_WAIT_S` to go."""
    if not step_dir.is_dir():
        return True
    if not RunLock.held(run.path):
        return False
    deadline = time.monotonic() + REMOVAL_WAIT_S
    while step_dir.is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not step_dir.is_dir()


def read_params(
    run_dir: pathlib.Path, step: int | None = None, shardings=None, expected=None
) -> tuple[int, dict]:
    """The parameters alone of checkpoint ``step`` (default: the newest) of a run dir, after
    verifying its checksums; the optimizer state is not read. ``shardings``: a tree like the
    parameters (default: the host's CPU). ``expected``: the parameters' shapes as the run dir's
    ``model.json`` makes them (``models.abstract_params``), checked against the stored ones
    before anything is read. Returns ``(step, params)`` in the checkpoint's dtypes.

    A run still training removes its older checkpoints (``checkpoint.keep``), one perhaps while
    it is read: the newest is then read again (up to :data:`READ_TRIES` times). While its lock is
    held, a read that fails waits up to :data:`REMOVAL_WAIT_S` to see whether the checkpoint goes.

    Raises:
      UserError: no checkpoint, no checkpoint of that step, one that fails verification, one
        whose parameters are not of ``expected``'s shapes, or one removed while it was read.
    """
    run = RunDir(run_dir)
    ckpt_dir = run.checkpoints.resolve()
    if not ckpt_dir.is_dir():
        raise UserError(f"{run_dir} holds no {CHECKPOINTS}/ (not a run dir, or no checkpoint was saved)")
    drop_failed_read_leftovers()  # of a read whose checkpoint is removed under it
    for attempt in range(1, READ_TRIES + 1):
        chosen = step
        handlers = {"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
        manager = ocp.CheckpointManager(ckpt_dir, item_handlers=handlers)
        try:
            steps = sorted(manager.all_steps())
            if not steps:
                raise UserError(f"{ckpt_dir} holds no checkpoint")
            chosen = steps[-1] if step is None else step
            if chosen not in steps:
                raise UserError(f"{ckpt_dir} has no checkpoint of step {chosen} (it has steps {steps})")
            return chosen, _read_checkpoint_params(manager, run, chosen, steps, shardings, expected)
        except UserError:
            raise
        except Exception:  # orbax's and tensorstore's errors of files gone, whatever their type
            if chosen is None or not _removed_under_read(ckpt_dir / str(chosen), run):
                raise
            if step is not None or attempt == READ_TRIES:
                again = "read it again" if step is None else "pass the --step of one it keeps"
                raise UserError(
                    f"checkpoint {ckpt_dir / str(chosen)} was removed while it was read (the run is "
                    f"still training, and checkpoint.keep removed it): {again}"
                ) from None
        finally:
            manager.close()
    raise AssertionError("each try returns or raises")


def _read_checkpoint_params(manager, run: RunDir, step: int, steps: list[int], shardings, expected) -> dict:
    """:func:`read_params`' read of checkpoint ``step`` (of ``steps``) once it is chosen."""
    ckpt_dir = run.checkpoints.resolve()
    reason = _verify(ckpt_dir / str(step), run.checksums / f"{step}.json")
    if reason is not None and _removed_under_read(ckpt_dir / str(step), run):
        raise FileNotFoundError(ckpt_dir / str(step))  # read_params reads the newest again
    if reason is not None:
        older = [s for s in steps if s < step]
        other = f"; --step {older[-1]} reads the one before" if older else ""
        raise UserError(f"checkpoint {ckpt_dir / str(step)} fails verification: {reason}{other}")
    meta = stored_state(ckpt_dir / str(step))["params"]
    found = None if expected is None else _first_difference(meta, expected)
    if found is not None:
        raise UserError(
            f"checkpoint {ckpt_dir / str(step)} does not hold the parameters its run dir describes "
            f"({MODEL}, or {CONFIG} without one) ({found}): the model was described otherwise "
            "since it was written (edited, another run's, or another version of moara-jax)"
        )
    if shardings is None:
        cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        shardings = jax.tree.map(lambda _: cpu, meta)
    abstract = {"params": abstract_with_shardings(meta, shardings)}
    args = ocp.args.PyTreeRestore(
        item=abstract,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True,
    )
    return manager.restore(step, args=ocp.args.Composite(state=args)).state["params"]


def stored_state(path: pathlib.Path) -> dict:
    """The tree of a checkpoint's saved state (at ``path``, a step's directory) as orbax's metadata
    gives it: nested dicts and lists of array metadata (``.shape``, ``.dtype``); nothing is read."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        meta = handler.metadata(path / "state")
    finally:
        handler.close()
    return getattr(meta, "tree", meta)


def _first_difference(stored, expected) -> str | None:
    """The first leaf whose stored shape (or presence) is not ``expected``'s (a tree of arrays or
    ``ShapeDtypeStruct``s, put in the stored tree's form), as ``key: stored X, expected Y``; None
    when all agree."""
    shapes = lambda tree: {  # noqa: E731
        jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    have, want = shapes(stored), shapes(ocp.tree.serialize_tree(expected, keep_empty_nodes=True))
    for key in sorted(set(have) | set(want)):
        if have.get(key) != want.get(key):
            return f"{key}: stored {have.get(key, 'nothing')}, expected {want.get(key, 'nothing')}"
    return None


def _first_sentence(error: BaseException, limit: int = 200) -> str:
    """The first sentence of an error's first line, at most ``limit`` characters (cut at a word)."""
    line = (str(error).strip().splitlines() or [""])[0]
    sentence = re.split(r"\.\s+(?=[A-Z])", line)[0]  # not at "vs. stored"
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0] + " ..."
