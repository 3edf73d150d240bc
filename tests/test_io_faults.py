"""Faults of the machine while a program writes (no space, an I/O error, a read-only filesystem):
one ``error:`` line naming the operation, the path and the cause, exit status 74 (``EX_IOERR``),
no traceback, what was complete kept, and ``--resume`` once the fault is gone continuing with the
losses of an uninterrupted run.

Faults are injected in-process at each write (the programs' own ``main``); one test fills a real
size-limited filesystem (a tmpfs, where this machine lets the test mount one)."""

import errno
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import cpu_devices
from test_train import FAST, TINY, losses, run_cli

from train import __main__ as trainer
from train.errors import EXIT_IO_ERROR, IOFault, UserError, errno_in_text, io_operation, machine_errno
from train.metrics import TensorBoardSink
from train.rundir import RunDir

# Steps 1-12, a checkpoint every 4 (4, 8, 12), evaluations at 6 and 12.
SETS = [*FAST, "checkpoint.every=4", "checkpoint.keep=5"]


def fault(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def failing(code: int, when=lambda *args, **kwargs: True, otherwise=None):
    """A stand-in for a method that raises ``OSError(code)`` when ``when(*args)`` holds, and
    calls ``otherwise`` (the original) when not."""

    def replacement(*args, **kwargs):
        if when(*args, **kwargs):
            raise fault(code)
        return otherwise(*args, **kwargs)

    return replacement


def train(run_dir, capsys, *sets, resume=False):
    """``python -m train`` in-process: its exit status and its stderr lines."""
    argv = ["--config", TINY, "--run-dir", str(run_dir), "--quiet"]
    argv += [x for s in [*SETS, *sets] for x in ("--set", s)] + ["--resume"] * resume
    code = trainer.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The losses of the run the faulty ones are compared with (in-process, as they are)."""
    run = tmp_path_factory.mktemp("whole") / "run"
    argv = ["--config", TINY, "--run-dir", str(run), "--quiet"] + [x for s in SETS for x in ("--set", s)]
    assert trainer.main(argv) == 0
    return losses(run)


def assert_one_io_error(code, err, starts):
    """Exit 74, one ``error:`` line (warnings may come too, never a traceback) that ends with the
    command to continue."""
    errors = [line for line in err if line.startswith("error:")]
    assert code == EXIT_IO_ERROR and "Traceback" not in "\n".join(err), err
    assert len(errors) == 1 and errors[0].startswith(f"error: {starts}"), err
    assert errors[0].endswith("--resume"), err
    return errors[0]


def test_errors_of_the_machine_are_told_from_others():
    assert machine_errno(fault(errno.ENOSPC)) == errno.ENOSPC
    assert machine_errno(fault(errno.ENOENT)) is None  # a missing file is not the machine's fault
    # orbax writes through tensorstore, whose errors carry the errno in their message
    message = "RESOURCE_EXHAUSTED: Failed writing: \"x/d/1\": No space left on device [os_error_code='28']"
    assert machine_errno(ValueError(message)) == errno.ENOSPC == errno_in_text(message)
    assert (
        machine_errno(ValueError('PERMISSION_DENIED: Error opening "x": Read-only file system'))
        == errno.EROFS
    )
    assert machine_errno(ValueError("Read-only file system")) is None  # no library status: not told
    assert machine_errno(ValueError("shapes differ")) is None
    try:  # an OSError under another exception
        try:
            raise fault(errno.EIO)
        except OSError as e:
            raise RuntimeError("writing failed") from e
    except RuntimeError as e:
        assert machine_errno(e) == errno.EIO
    # a user's error that quotes a system message about the user's own file stays the user's
    assert machine_errno(UserError("cannot read data file x: [Errno 13] Permission denied")) is None
    with pytest.raises(IOFault, match=r"^writing x /p failed: input/output error$"):
        with io_operation("writing x", "/p"):
            raise fault(errno.EIO)
    with pytest.raises(ValueError, match="shapes"), io_operation("writing x", "/p"):
        raise ValueError("shapes differ")


@pytest.mark.slow
def test_a_failed_checkpoint_save_stops_cleanly_and_resume_continues(
    tmp_path, capsys, monkeypatch, uninterrupted
):
    run = tmp_path / "run"
    save = ocp.CheckpointManager.save
    full_at_8 = failing(errno.ENOSPC, lambda self, step, *a, **k: step == 8, otherwise=save)
    monkeypatch.setattr(ocp.CheckpointManager, "save", full_at_8)
    code, err = train(run, capsys)
    line = assert_one_io_error(code, err, f"saving checkpoint 8 to {run.resolve() / 'checkpoints'} failed")
    assert "no space left on device; the last complete checkpoint, step 4, is in" in line
    summary = RunDir(run).summary()
    assert summary["status"] == "io_error" and "no space left on device" in summary["stop_reason"]
    assert RunDir(run).state() == "resumable"  # train.sweep resumes it, never counts it as diverged
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    code, err = train(run, capsys, resume=True)
    assert code == 0, err
    assert losses(run) == pytest.approx(uninterrupted, rel=1e-6)
    assert RunDir(run).summary()["status"] == "completed"


@pytest.mark.slow
def test_a_save_the_filesystem_has_no_room_for_is_refused_before_it_starts(tmp_path, capsys, monkeypatch):
    from train import checkpoint as checkpointing

    run = tmp_path / "run"
    usage = checkpointing.shutil.disk_usage

    def full_after_4(path):
        real = usage(path)
        saved = [p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
        return real._replace(free=256 << 10) if saved else real  # 256 KiB once checkpoint 4 is there

    monkeypatch.setattr(checkpointing.shutil, "disk_usage", full_after_4)
    code, err = train(run, capsys)
    line = assert_one_io_error(code, err, "saving checkpoint 8 to")
    assert "failed: no space left on device (it needs " in line and " MiB, 0.2 MiB are free)" in line
    assert "the last complete checkpoint, step 4," in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4"]  # nothing begun for 8


@pytest.mark.slow
def test_resume_finishes_a_run_whose_last_writes_failed(tmp_path, capsys, monkeypatch):
    """All steps done and checkpointed, but the metric writer's files failed when they were
    flushed at the end: the summary says io_error; ``--resume`` runs no step and completes it."""
    pytest.importorskip("tensorboardX")  # the writer whose flush fails (the test extra has it)
    run = tmp_path / "run"
    sets = ["metrics.writers=[jsonl,tensorboard]"]
    monkeypatch.setattr(TensorBoardSink, "close", failing(errno.EIO))
    code, err = train(run, capsys, *sets)
    line = assert_one_io_error(code, err, f"writing TensorBoard events to {run / 'tensorboard'} failed")
    assert "the last complete checkpoint, step 12," in line
    assert RunDir(run).summary()["status"] == "io_error" and RunDir(run).summary()["steps"] == 12
    monkeypatch.undo()
    code, err = train(run, capsys, *sets, resume=True)
    summary = RunDir(run).summary()
    assert code == 0 and summary["status"] == "completed" and summary["steps"] == 12, err
    assert summary["final_eval_ppl"] == RunDir(run).evals()[-1]["eval_ppl"]


@pytest.mark.slow
def test_a_full_disk_when_events_are_flushed_at_a_checkpoint_loses_no_step(tmp_path, capsys, monkeypatch):
    """The TensorBoard events are on the disk before the checkpoint of their step is saved: when
    writing them out fails at checkpoint 8, there is no checkpoint 8, and the resume from 4
    writes the lost steps again, so TensorBoard shows each of steps 1-12 once (the file cut
    back to its whole records)."""
    pytest.importorskip("tensorboardX")
    from tensorboardX.record_writer import RecordWriter
    from test_metrics_writers import read_events

    run = tmp_path / "run"
    sets = ["metrics.writers=[jsonl,tensorboard]", "train.log_every=1"]
    flushes = []

    def full_at_8(self):
        flushes.append(1)
        if len(flushes) != 2:  # the flush before checkpoint 8 fails (the first: checkpoint 4)
            return False
        self._writer.write(b"\x40\x00\x00\x00")  # the disk took the buffer and a part of a record
        self._writer.flush()
        return True

    monkeypatch.setattr(RecordWriter, "flush", failing(errno.ENOSPC, full_at_8, otherwise=RecordWriter.flush))
    code, err = train(run, capsys, *sets)
    line = assert_one_io_error(code, err, f"writing TensorBoard events to {run / 'tensorboard'} failed")
    assert "no space left on device" in line and "the last complete checkpoint, step 4," in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4"]
    monkeypatch.undo()
    code, err = train(run, capsys, *sets, resume=True)
    assert code == 0 and RunDir(run).summary()["status"] == "completed", err
    assert [step for step, _ in read_events(run)["train/loss"]] == list(range(1, 13))


@pytest.mark.slow
def test_a_save_that_fails_in_orbaxs_writer_thread_leaves_no_partial_checkpoint(
    tmp_path, capsys, monkeypatch
):
    # An asynchronous save fails after the step went on: orbax's temporary directory is left
    # behind, the save is over (no longer in progress), and the failure surfaces at the next
    # wait, as a tensorstore error, naming that save.
    run = tmp_path / "run"
    wait, in_progress = ocp.CheckpointManager.wait_until_finished, ocp.CheckpointManager.is_saving_in_progress
    failed = []

    def fail_8(self):
        if (run / "checkpoints" / "8").is_dir():
            (run / "checkpoints" / "8").rename(run / "checkpoints" / "8.orbax-checkpoint-tmp-123")
            failed.append(8)

    def fail_finishing_8(self):
        wait(self)
        fail_8(self)
        if failed == [8]:
            failed.append("raised")
            raise ValueError(
                "RESOURCE_EXHAUSTED: Failed to write: No space left on device [os_error_code='28']"
            )

    def saving_in_progress(self):
        if in_progress(self):
            return True
        fail_8(self)
        return False

    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", fail_finishing_8)
    monkeypatch.setattr(ocp.CheckpointManager, "is_saving_in_progress", saving_in_progress)
    code, err = train(run, capsys)
    line = assert_one_io_error(code, err, "saving checkpoint 8 to")
    assert "the last complete checkpoint, step 4," in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4"]


@pytest.mark.parametrize(
    "where",
    # the fast lane: one write during the steps and one before them
    ["metrics", "run files"]
    + [
        pytest.param(w, marks=pytest.mark.slow)
        for w in ("tensorboard", "summary", "plot", "metrics and summary")
    ],
)
@pytest.mark.slow
def test_a_failed_write_of_the_runs_files_stops_cleanly(where, tmp_path, capsys, monkeypatch):
    if where == "tensorboard":
        pytest.importorskip("tensorboardX")
    run = tmp_path / "run"
    sets = ["metrics.writers=[jsonl,tensorboard]"] if where == "tensorboard" else []
    appends = []

    def metrics_full(self, mode="r", *args, **kwargs):
        appending = self.name == "metrics.jsonl" and mode == "a"
        appends.extend([1] if appending else [])
        return appending and len(appends) > 7  # after the rows of steps 1-6 and eval 6

    unwritable = {
        "summary": ["summary.json"],
        "metrics and summary": ["summary.json"],
        "run files": ["config.yaml"],
    }
    if "metrics" in where:
        monkeypatch.setattr(
            pathlib.Path, "open", failing(errno.ENOSPC, metrics_full, otherwise=pathlib.Path.open)
        )
    if where in unwritable:
        names = unwritable[where]
        write_text = failing(
            errno.EROFS,
            lambda self, *a, **k: self.name.removesuffix(".tmp") in names,
            otherwise=pathlib.Path.write_text,
        )
        monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    if where == "tensorboard":
        scalars = failing(errno.EIO, lambda self, step, values: step >= 7, otherwise=TensorBoardSink.scalars)
        monkeypatch.setattr(TensorBoardSink, "scalars", scalars)
    if where == "plot":
        import matplotlib.figure

        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", failing(errno.ENOSPC))
    code, err = train(run, capsys, *sets)
    expected = {
        "metrics": f"writing metrics to {run / 'metrics.jsonl'} failed: no space left on device",
        "metrics and summary": f"writing metrics to {run / 'metrics.jsonl'} failed: no space left on device",
        "tensorboard": f"writing TensorBoard events to {run / 'tensorboard'} failed: input/output error",
        "summary": f"writing the summary to {run / 'summary.json'} failed: read-only file system",
        "plot": f"writing the plot {run / 'curves.png'} failed: no space left on device",
        "run files": f"writing the run's config to {run} failed: read-only file system",
    }[where]
    line = assert_one_io_error(code, err, expected)
    summary = RunDir(run).summary()
    if where == "run files":  # before any step: no checkpoint, no summary
        assert summary is None and not RunDir(run).has_checkpoints()
        return
    kept = "step 4" if where in ("metrics", "metrics and summary", "tensorboard") else "step 12"
    assert f"the last complete checkpoint, {kept}, is in" in line
    assert ("summary.json was not written" in line) == (where == "metrics and summary")
    if where in ("summary", "metrics and summary"):
        assert summary is None
    elif where == "plot":
        assert summary["status"] == "completed"  # written before the plot
    else:  # step 7's metrics passed their checks; its row (or event) failed; step 8 ran unread
        assert summary["status"] == "io_error" and summary["steps"] == 7


@pytest.mark.slow
def test_a_completed_run_resumed_on_a_full_disk_keeps_its_record(tmp_path, capsys, monkeypatch):
    """Resumed to more steps, a completed run first keeps its summary as
    ``summary.completed-N.json``: when that write fails, the run is left as it was (its summary
    and config), and the same command once there is space goes on."""
    run = tmp_path / "run"
    assert train(run, capsys, "train.steps=4")[0] == 0
    before = {name: (run / name).read_text() for name in ("summary.json", "config.yaml")}
    full = failing(
        errno.ENOSPC,
        lambda self, *a, **k: self.name.startswith("summary.completed-"),
        otherwise=pathlib.Path.write_text,
    )
    monkeypatch.setattr(pathlib.Path, "write_text", full)
    code, err = train(run, capsys, "train.steps=8", resume=True)
    expected = f"keeping the completed run's record in {run} failed: no space left on device"
    assert_one_io_error(code, err, expected)
    assert {name: (run / name).read_text() for name in before} == before
    assert not list(run.glob("summary.completed-*"))
    monkeypatch.undo()
    assert train(run, capsys, "train.steps=8", resume=True)[0] == 0
    assert (run / "summary.completed-4.json").read_text() == before["summary.json"]
    assert RunDir(run).summary()["steps"] == 8


def test_a_lock_file_that_cannot_be_written_is_one_error_and_no_lock(tmp_path, monkeypatch):
    import builtins

    from train import rundir

    class Full:
        """The lock file, on a disk with no room for its text."""

        def __init__(self, *args, **kwargs):
            self.file = builtins.open(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def flush(self):
            raise fault(errno.ENOSPC)

        def close(self):  # as a real file's: its buffer's text flushed first, in vain
            self.file.close()
            raise fault(errno.ENOSPC)

    monkeypatch.setattr(rundir, "open", Full, raising=False)
    lock = rundir.RunLock(tmp_path / "run")
    with pytest.raises(IOFault, match=r"^writing the run dir's lock file .*/run/\.lock failed: no space"):
        lock.acquire()
    assert lock.file is None  # released
    monkeypatch.undo()
    with rundir.RunLock(tmp_path / "run"):
        assert "pid " in (tmp_path / "run" / ".lock").read_text()


def test_a_run_dir_on_a_read_only_disk_is_named_as_made_or_as_found(tmp_path, monkeypatch):
    """The lock file on a read-only filesystem: the line said "creating the run dir" of a run dir
    that was there already."""
    from train import rundir

    def read_only(*args, **kwargs):
        raise fault(errno.EROFS)

    monkeypatch.setattr(rundir, "open", read_only, raising=False)
    (tmp_path / "there").mkdir()
    with pytest.raises(
        IOFault, match=r"^opening the run dir's lock file in .*/there failed: read-only file system"
    ):
        rundir.RunLock(tmp_path / "there").acquire()
    with pytest.raises(IOFault, match=r"^creating the run dir .*/new failed: read-only file system"):
        rundir.RunLock(tmp_path / "new").acquire()


def test_a_run_file_written_over_keeps_its_old_text_when_the_write_fails(tmp_path, monkeypatch):
    """``config.yaml``, ``model.json`` and ``summary.json`` are replaced whole or not at all: a
    resume stopped by a full disk leaves the config the next ``--resume`` compares with. Unchanged
    text is not written again, unless a new file is asked for."""
    from train.rundir import write_atomically

    path = tmp_path / "config.yaml"
    path.write_text("train: {steps: 4}\n")
    before = path.stat().st_mtime_ns
    write_atomically(path, "train: {steps: 4}\n")  # unchanged: not written again
    assert path.stat().st_mtime_ns == before
    inode = path.stat().st_ino
    write_atomically(path, "train: {steps: 4}\n", if_changed=False)  # a new file all the same, as a
    assert path.stat().st_ino != inode  # resume's metrics.jsonl is, for a reader following the old

    def half_then_full(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise fault(errno.ENOSPC)

    monkeypatch.setattr(pathlib.Path, "write_text", half_then_full)
    with pytest.raises(OSError):
        write_atomically(path, "train: {steps: 8, lr: 0.001}\n")
    assert path.read_text() == "train: {steps: 4}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # no torn .tmp left


def test_a_torn_config_is_one_clear_error(tmp_path):
    (tmp_path / "config.yaml").write_text("train: {steps: 4, lr: [0.1\n")
    with pytest.raises(UserError, match=r"config.yaml is not valid YAML \(line 2\): "):
        RunDir(tmp_path).config()
    (tmp_path / "config.yaml").write_text("- a list\n")
    with pytest.raises(UserError, match="config.yaml is not a mapping of settings"):
        RunDir(tmp_path).config()


@pytest.mark.slow
def test_commands_other_than_the_trainer_exit_74(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")  # the export writes config.json through it (the hf extra)
    from train import evaluate, export, prepare
    from train.store import building

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"line {i} of the corpus"}) for i in range(50)))
    monkeypatch.setattr(building._ShardWriter, "write", failing(errno.ENOSPC))
    argv = ["--config", TINY, "--set", "data.source=files", "--set", f"data.paths=['{corpus}']"]
    assert (
        prepare.main([*argv, "--out", str(tmp_path / "store"), "--workers", "1", "--quiet"]) == EXIT_IO_ERROR
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: building the token store {tmp_path / 'store'} failed: no space left on device; completed "
        "shards are kept; once that is fixed, run the same command again to continue"
    ]
    # The trainer building it: one way to go on, its own.
    store_run = [*argv, "--set", f"data.store={tmp_path / 'store'}", "--run-dir", str(tmp_path / "r")]
    assert trainer.main([*store_run, "--quiet"]) == EXIT_IO_ERROR
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: building the token store {tmp_path / 'store'} failed: no space left on device; completed "
        f"shards are kept; once that is fixed, continue with: python -m train {shlex.join(store_run)} "
        "--quiet --resume"
    ]
    monkeypatch.undo()

    run = tmp_path / "run"
    run_cli(run, *FAST, "train.steps=2")
    import models

    monkeypatch.setattr(models, "write_hf_dir", failing(errno.ENOSPC))
    assert export.main(["--run-dir", str(run), "--out", str(tmp_path / "hf")]) == EXIT_IO_ERROR
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: exporting to {tmp_path / 'hf'} failed: no space left on device; the export there is "
        "incomplete: run the same command with --overwrite"
    ]
    monkeypatch.undo()

    text = tmp_path / "t.txt"
    text.write_text("some text to score " * 20)
    eval_json = failing(
        errno.EROFS, lambda self, *a, **k: self.name == "eval.json", otherwise=pathlib.Path.write_text
    )
    monkeypatch.setattr(pathlib.Path, "write_text", eval_json)
    code = evaluate.main(["--run-dir", str(run), "--ppl-files", f"t={text}", "--out", str(tmp_path / "ev")])
    assert code == EXIT_IO_ERROR
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: writing the evaluation to {tmp_path / 'ev'} failed: read-only file system"
    ]


def _mount_tmpfs(where: pathlib.Path, size_bytes: int) -> str | None:
    """Mounts a tmpfs of ``size_bytes`` at ``where``; the reason when this machine does not allow it."""
    where.mkdir(parents=True)
    if shutil.which("mount") is None:
        return "no mount command"
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    return None if proc.returncode == 0 else f"cannot mount a tmpfs here: {proc.stderr.strip()}"


@pytest.mark.slow
def test_a_real_full_disk_ends_the_run_with_74_and_resume_after_freeing_space(tmp_path):
    # The filesystem holds the run's small files and two checkpoints (plus the space check's
    # margin for neither a third): the save at step 12 finds it full.
    reference = tmp_path / "reference"
    run_cli(reference, *SETS, in_process=False)  # processes of their own, as the ones on the disk
    uninterrupted = losses(reference)
    checkpoint = sum(p.stat().st_size for p in (reference / "checkpoints" / "4").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    reason = _mount_tmpfs(disk, int(2.5 * checkpoint) + (1 << 20) + (256 << 10))
    if reason:
        pytest.skip(reason)
    try:
        proc = run_cli(disk / "run", *SETS, check=False, in_process=False)
        assert proc.returncode == EXIT_IO_ERROR, proc.stderr[-3000:]
        err = proc.stderr.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert err[0].startswith("error: saving checkpoint ") and "no space left on device" in err[0]
        assert not list((disk / "run" / "checkpoints").glob("*orbax-checkpoint-tmp*"))
        kept = sorted(int(p.name) for p in (disk / "run" / "checkpoints").iterdir())
        assert kept and f"the last complete checkpoint, step {kept[-1]}," in err[0]
        subprocess.run(["mount", "-o", f"remount,size={64 << 20}", str(disk)], check=True)
        run_cli(disk / "run", *SETS, extra=["--resume"], in_process=False)
        got = losses(disk / "run")
        assert sorted(got) == list(range(1, 13))
        np.testing.assert_allclose(
            [got[s] for s in sorted(got)], [uninterrupted[s] for s in sorted(got)], rtol=1e-6
        )
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


SPACE_OF_A_SHARE = """
import shutil, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from train import checkpoint
from train.errors import IOFault
from train.rundir import RunDir

mesh = Mesh(np.asarray(jax.devices()), ("d",))
mib = jnp.zeros((256, 1024), jnp.float32)  # 1 MiB
state = {
    "replicated": jax.device_put(mib, NamedSharding(mesh, PartitionSpec())),  # a copy on each device
    "sharded": jax.device_put(mib, NamedSharding(mesh, PartitionSpec("d"))),  # a quarter on each
}
ckpt = checkpoint.Checkpointer(RunDir(sys.argv[1]), keep=1, every=1)
usage = shutil.disk_usage
checkpoint.shutil.disk_usage = lambda path: usage(path)._replace(free=0)
try:
    ckpt.save(1, state, {})
except IOFault as e:
    print(e)
"""


@pytest.mark.slow  # a process of its own on 4 devices
def test_the_room_a_save_needs_counts_a_replicated_array_once(tmp_path):
    """On 4 devices, a state of 1 MiB replicated on each and 1 MiB sharded over them: the save
    writes 2 MiB (orbax writes one copy of a replicated array), and the refusal on a full disk
    says so with the margin for orbax's metadata (1 MiB), not 5 MiB of copies plus it."""
    proc = subprocess.run(
        [sys.executable, "-c", SPACE_OF_A_SHARE, str(tmp_path / "run")],
        env=cpu_devices(4),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no space left on device (it needs 3.0 MiB, 0.0 MiB are free)" in proc.stdout, proc.stdout
    assert not any(p.name.isdigit() for p in (tmp_path / "run" / "checkpoints").iterdir())
