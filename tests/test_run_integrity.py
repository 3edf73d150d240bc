"""Runs whose results can be trusted: one writer per run dir, verified checkpoints with fallback,
the divergence guard, exit statuses, no step logged twice, and honest comparisons (CLI
subprocesses on tiny configs, and the guard and compare logic on hand-made inputs)."""

import errno
import json
import logging
import math
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_train import FAST, ROOT, TINY, losses, run_cli

from train.compare import compare
from train.errors import EXIT_PREEMPTED, IOFault, UserError
from train.metrics import DivergenceGuard
from train.rundir import RunDir, RunLock, dedupe_by_step, read_metrics


def start_cli(run_dir, *sets, extra=()):
    args = [sys.executable, "-m", "train", "--config", TINY, "--run-dir", str(run_dir), "--quiet"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(
        args + list(extra), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_steps(proc, run_dir, n, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach {n} logged steps: {proc.communicate()[1][-2000:]}")


def test_a_directory_of_the_users_own_files_is_no_run_dir(tmp_path, capsys):
    """``--run-dir`` at a directory holding files of a run's names (the config a user keeps
    there, metrics of their own) that no run made: refused in one line, nothing replaced. A run
    dir copied without its lock file, or one holding only the runner's ``train.log``, is one."""
    from train import __main__ as trainer

    mine = tmp_path / "exp"
    mine.mkdir()
    (mine / "config.yaml").write_text("# my notes\nmodel: {name: tiny}\n")
    (mine / "metrics.jsonl").write_text('{"x": 1}\n')
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    code = trainer.main(["--config", TINY, "--run-dir", str(mine), "--quiet", "--set", "train.steps=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        f"error: run dir {mine} holds config.yaml, metrics.jsonl but no run (no .lock, model.json, "
        "summary.json or checkpoints/): a run there would replace them; choose another --run-dir"
    ]
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
    copied = tmp_path / "copied"  # a run's files, its lock file left behind
    copied.mkdir()
    for name in ("config.yaml", "model.json", "metrics.jsonl"):
        (copied / name).write_text("{}")
    logged = tmp_path / "logged"
    logged.mkdir()
    (logged / "train.log").write_text("")
    for run_dir in (copied, logged, tmp_path / "new"):
        with RunLock(run_dir):
            assert RunLock.held(run_dir)


def test_the_rows_of_a_metrics_file_are_its_objects_of_a_step(tmp_path):
    """A line cut short by a kill, bytes that are not UTF-8, and JSON that is not an object with a
    whole-number step are left out; the rows that are stay, in their order."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        b'{"step": 1, "loss": 2.5}\n'
        b'{"step": 2, "lo\n'  # cut short
        b'{"step": 2, "loss": \xff}\n'  # not UTF-8
        b"\n5\n[1, 2]\n"
        b'{"note": "no step"}\n{"step": "3", "loss": 1.0}\n{"step": 3.5, "loss": 1.0}\n'
        b'{"step": 4, "eval_ppl": 9.0}'  # the last line, without its end
    )
    assert read_metrics(path) == [{"step": 1, "loss": 2.5}, {"step": 4, "eval_ppl": 9.0}]


def test_a_step_written_again_is_read_as_its_last_row():
    """A resumed run writes again the steps after its checkpoint: each step's last row is the one
    read, in step order, and rows without the key asked for are left out."""
    rows = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0},
        {"step": 2, "eval_ppl": 9.0},
        {"step": 1, "loss": 1.5},  # written again after a resume from step 0
    ]
    assert dedupe_by_step(rows, "loss") == [{"step": 1, "loss": 1.5}, {"step": 2, "loss": 2.0}]
    assert dedupe_by_step(rows, "eval_ppl") == [{"step": 2, "eval_ppl": 9.0}]


def test_a_run_dir_whose_first_save_did_not_finish_is_a_new_run(tmp_path):
    """orbax writes a checkpoint under a temporary name and renames it when it is complete: a run
    killed during its first save has no checkpoint to resume from, and starts again."""
    run = RunDir(tmp_path / "run")
    (run.checkpoints / "4.orbax-checkpoint-tmp-1732912345").mkdir(parents=True)
    assert not run.has_checkpoints() and run.state() == "new"
    (run.checkpoints / "4").mkdir()
    assert run.has_checkpoints() and run.state() == "resumable"


def test_a_reopened_runs_last_checkpoint_is_kept_as_links_to_its_files(tmp_path):
    """A completed run resumed to go on keeps its last checkpoint out of orbax's rotation as hard
    links to its files: no second copy of the weights on the disk."""
    run = RunDir(tmp_path / "run")
    weights = run.checkpoints / "4" / "state" / "weights"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(bytes(1024))
    run.write_summary({"status": "completed", "steps": 4})
    assert run.reopen(4).name == "summary.completed-4.json"
    kept = run / "checkpoints.completed-4" / "state" / "weights"
    assert kept.stat().st_ino == weights.stat().st_ino and weights.stat().st_nlink == 2
    assert run.summary()["status"] == "interrupted"


@pytest.mark.slow
def test_a_second_run_on_a_busy_run_dir_is_refused_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    first = start_cli(run, *FAST, "train.steps=400", "checkpoint.every=0")
    wait_for_steps(first, run, 2)
    config = (run / "config.yaml").read_bytes()
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name != "metrics.jsonl"}
    second = run_cli(run, *FAST, "train.seed=7", check=False)
    assert second.returncode == 2
    assert f"run dir {run} is in use by pid {first.pid} on host" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    assert (run / "config.yaml").read_bytes() == config
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name != "metrics.jsonl"} == before
    # SIGTERM: saved and stopped, with the status a scheduler requeues on.
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=300)
    assert first.returncode == EXIT_PREEMPTED, err[-2000:]
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run of 8 steps with checkpoints at 4, 6 and 8 (and their checksums)."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    run_cli(run, *FAST, "train.steps=8", "checkpoint.every=2", "checkpoint.keep=3")
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [4, 6, 8]
    return run


def largest_array_file(step_dir):
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "metadata" not in p.name.lower()]
    return max(files, key=lambda p: p.stat().st_size)


def truncate(step_dir):
    f = largest_array_file(step_dir)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def flip_bytes(step_dir):
    f = largest_array_file(step_dir)
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(255 - b for b in data[mid : mid + 64])
    f.write_bytes(bytes(data))


def delete_state_metadata(step_dir):
    """Deletes the state's metadata file (its name depends on the orbax version)."""
    for name in ("_METADATA", "_sharding", "ocdbt.process_0/manifest.ocdbt"):
        if (step_dir / "state" / name).is_file():
            (step_dir / "state" / name).unlink()
            return f"files missing: state/{name}"
    raise AssertionError(f"no state metadata file in {step_dir}")


def delete_data_metadata(step_dir):
    (step_dir / "data" / "metadata").unlink()
    return "files missing: data/metadata"


@pytest.mark.slow
def test_verification_names_each_kind_of_damage(finished_run, tmp_path):
    from train.checkpoint import Checkpointer
    from train.rundir import RunDir

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    damages = {4: flip_bytes, 6: delete_data_metadata, 8: delete_state_metadata}
    reasons = {step: damage(run / "checkpoints" / str(step)) for step, damage in damages.items()}
    ckpt = Checkpointer(RunDir(run), keep=3, every=2)
    assert ckpt.verify(4) == "files changed since it was written: " + str(
        largest_array_file(run / "checkpoints" / "4").relative_to(run / "checkpoints" / "4")
    )
    assert ckpt.verify(6) == reasons[6] and ckpt.verify(8) == reasons[8]
    ckpt.close()
    # Export and evaluation read the newest checkpoint, refuse a damaged one and name the next.
    from train.checkpoint import read_params

    with pytest.raises(UserError, match=re.escape(f"{reasons[8]}; --step 6 reads the one before")):
        read_params(run)
    with pytest.raises(UserError, match="fails verification: files changed since it was written: [^;]*$"):
        read_params(run, 4)  # none before it


@pytest.mark.slow
def test_a_checkpoint_removed_while_it_is_read_is_read_again_or_named(finished_run, tmp_path, monkeypatch):
    """A run still training removes its older checkpoints (``checkpoint.keep``), one perhaps while
    export or evaluation reads it (orbax then raised, and tensorstore's callbacks printed hundreds
    of lines): the newest is read again; one asked for by step, or removed at every try, is one
    line saying what happened."""
    import threading

    from train import checkpoint
    from train.rundir import RunLock

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    read, removed, budget = checkpoint._read_checkpoint_params, [], [1]

    def removed_under_it(manager, run_dir, step, *args):
        if len(removed) < budget[0]:
            shutil.rmtree(run / "checkpoints" / str(step))
            removed.append(step)
            raise ValueError(f'NOT_FOUND: Error opening "zarr" driver: checkpoints/{step}/state')
        return read(manager, run_dir, step, *args)

    monkeypatch.setattr(checkpoint, "_read_checkpoint_params", removed_under_it)
    step, params = checkpoint.read_params(run)
    assert removed == [8] and step == 6 and params
    budget[0] = 2
    with pytest.raises(UserError) as refused:
        checkpoint.read_params(run, 6)
    assert removed == [8, 6] and str(refused.value) == (
        f"checkpoint {(run / 'checkpoints' / '6').resolve()} was removed while it was read (the run is "
        "still training, and checkpoint.keep removed it): pass the --step of one it keeps"
    )
    shutil.copytree(finished_run / "checkpoints", run / "checkpoints", dirs_exist_ok=True)
    budget[0] = 2 + checkpoint.READ_TRIES
    with pytest.raises(UserError, match=r"checkpoints/4 was removed while it was read .*: read it again$"):
        checkpoint.read_params(run)
    assert removed == [8, 6, 8, 6, 4]

    # orbax removes a checkpoint's files first, its directory last: a read fails while the
    # directory is still there. Under a run training (its lock held) it is given time to go;
    # with no run training, a checkpoint that fails to read is damaged: its own error.
    shutil.copytree(finished_run / "checkpoints", run / "checkpoints", dirs_exist_ok=True)
    removed.clear()
    timers: list[threading.Timer] = []  # each removal, joined before the next case

    def going_under_it(manager, run_dir, step, *args):
        if not removed:
            step_dir = run / "checkpoints" / str(step)
            removed.append(step)
            (step_dir / "_CHECKPOINT_METADATA").unlink()
            timers.append(threading.Timer(0.3, shutil.rmtree, [step_dir]))
            timers[-1].start()
            raise ValueError(f'NOT_FOUND: Error opening "zarr" driver: checkpoints/{step}/state')
        return read(manager, run_dir, step, *args)

    monkeypatch.setattr(checkpoint, "_read_checkpoint_params", going_under_it)
    with RunLock(run):
        assert checkpoint.read_params(run)[0] == 6 and removed == [8]
    shutil.copytree(finished_run / "checkpoints", run / "checkpoints", dirs_exist_ok=True)
    removed.clear()
    with pytest.raises(ValueError, match="NOT_FOUND"):
        checkpoint.read_params(run)  # no run holds the lock: not waited for
    timers[-1].join()

    # The same where verification finds the files missing: under the lock, the newest read again;
    # without it, the checkpoint is damaged.
    monkeypatch.setattr(checkpoint, "_read_checkpoint_params", read)
    for held in (True, False):
        shutil.copytree(finished_run / "checkpoints", run / "checkpoints", dirs_exist_ok=True)
        (run / "checkpoints" / "8" / "_CHECKPOINT_METADATA").unlink()
        if held:
            timers.append(threading.Timer(0.3, shutil.rmtree, [run / "checkpoints" / "8"]))
            timers[-1].start()
            with RunLock(run):
                assert checkpoint.read_params(run)[0] == 6
            timers[-1].join()
        else:
            with pytest.raises(UserError, match="fails verification: files missing: _CHECKPOINT_METADATA"):
                checkpoint.read_params(run)


@pytest.mark.parametrize("checksums", [True, False])
def test_a_damaged_checkpoint_metadata_file_is_not_dumped_in_the_log(
    checksums, finished_run, tmp_path, caplog
):
    """orbax logs a damaged ``_CHECKPOINT_METADATA`` with the file's content (here binary
    garbage) as soon as the run's checkpoints are opened: that record is dropped. Verification
    names the file and the checkpoint is moved aside; with no checksums its arrays, which orbax
    reads without that file, are restored as written."""
    from train.checkpoint import Checkpointer

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checkpoints" / "8" / "_CHECKPOINT_METADATA").write_bytes(bytes(range(256)) * 8)
    if not checksums:
        shutil.rmtree(run / "checksums")
    said = []
    with caplog.at_level(logging.DEBUG):
        ckpt = Checkpointer(RunDir(run), keep=3, every=2)
        step, state, _ = ckpt.restore_latest(None, lambda state: None, say=said.append)
        ckpt.close()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if checksums:
        assert said == [
            f"checkpoint 8 is not usable: files changed since it was written: _CHECKPOINT_METADATA; "
            f"moved to {run / 'rejected_checkpoints'}"
        ]
        assert step == 6
    else:
        assert said == [] and step == 8 and state["step"] == 8


def test_the_checksums_are_those_of_the_checkpoints_kept(finished_run):
    """orbax removes the checkpoints beyond ``checkpoint.keep`` (2 here); their checksums go too."""
    assert sorted(p.name for p in (finished_run / "checksums").iterdir()) == ["4.json", "6.json", "8.json"]


def test_a_save_drops_the_checksums_an_earlier_checkpoint_of_its_step_left(tmp_path):
    """A run dir whose checkpoints were removed but not its checksums: a new checkpoint of the
    same step is not judged by the old one's files, also before its own are recorded."""
    import jax.numpy as jnp

    from train.checkpoint import Checkpointer
    from train.rundir import RunDir

    run = tmp_path / "run"
    (run / "checksums").mkdir(parents=True)
    (run / "checksums" / "2.json").write_text(json.dumps({"state/gone": "0" * 64}))
    ckpt = Checkpointer(RunDir(run), keep=3, every=2)
    ckpt.save(2, {"w": jnp.ones(4)}, {"iterator": 1})
    ckpt.wait()  # saved, its checksums not yet recorded: a kill here leaves it so
    assert ckpt.verify(2) is None and not (run / "checksums" / "2.json").exists()
    ckpt.close()
    assert ckpt.verify(2) is None and (run / "checksums" / "2.json").is_file()


@pytest.mark.slow
def test_a_checkpoint_is_verifiable_before_the_next_save(tmp_path):
    """The checksums of a checkpoint are recorded once orbax has finished it, not at the next
    save: a run killed between two saves leaves its newest checkpoint verifiable."""
    from train.checkpoint import Checkpointer
    from train.rundir import RunDir

    run = tmp_path / "run"
    proc = start_cli(run, *FAST, "train.steps=5000", "checkpoint.every=50", "train.eval_every=1000")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (run / "checksums" / "50.json").is_file():
        time.sleep(0.02)
    logged = max(losses(run), default=0)
    proc.kill()
    proc.communicate()
    assert (run / "checksums" / "50.json").is_file(), "no checksums of checkpoint 50"
    assert logged < 100  # recorded before the save of checkpoint 100
    ckpt = Checkpointer(RunDir(run), keep=3, every=50)
    assert ckpt.verify(50) is None
    ckpt.close()


@pytest.mark.slow
def test_a_steps_time_leaves_out_the_evaluation_before_it(tmp_path, monkeypatch):
    """``step_time_s`` (and tokens/s) of the step after an evaluation is that step's own."""
    from train.loop import StepLoop

    evaluate = StepLoop.evaluate

    def slow_evaluation(self, step, params):
        evaluate(self, step, params)
        time.sleep(1.5)

    monkeypatch.setattr(StepLoop, "evaluate", slow_evaluation)
    run_cli(tmp_path / "run", *FAST, "checkpoint.every=0")
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step_time_s" in r}
    assert rows[7]["step_time_s"] < 1.0, rows[7]  # the evaluation at step 6 took 1.5 s more


@pytest.mark.slow
def test_a_rows_step_time_is_the_mean_since_the_last_row_so_a_late_read_is_not_lost(tmp_path, monkeypatch):
    """On a GPU the read of step k - 1's metrics may return only when step k is nearly done; a
    step that reads its own metrics at once (an evaluation's) then waits a few ms (seen on an
    H100: 11M tokens/s logged for a 60M model). A row's step time is the mean over the steps
    since the previous row, so the wait counts wherever it fell; the session's first step (its
    compilation) stays out of it."""
    from train.loop import StepLoop

    read = StepLoop.read_metrics

    def late_read(self, step, metrics):
        # step 1: as if compiling; step 5: read after step 6 is dispatched, and step 6 evaluates,
        # so reads its own metrics at once
        if step in (1, 5):
            time.sleep(0.6)
        return read(self, step, metrics)

    monkeypatch.setattr(StepLoop, "read_metrics", late_read)
    run_cli(tmp_path / "run", *FAST, "train.log_every=3", "checkpoint.every=0")
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step_time_s" in r}
    assert sorted(rows) == [3, 6, 9, 12]
    assert rows[6]["step_time_s"] >= 0.6 / 3, rows[6]  # steps 4-6: 0.2 s each at least
    assert rows[6]["tokens_per_s"] == pytest.approx(8 * 32 / rows[6]["step_time_s"])
    assert rows[9]["step_time_s"] < rows[6]["step_time_s"] / 2, rows  # the late read counts once
    # steps 2-3 alone: the first step's time is left out (logged alone only where it is a row)
    assert rows[3]["step_time_s"] < rows[6]["step_time_s"] / 2 and "includes_compile" not in rows[3], rows


def failing_checkpointer(run, failure):
    """The run's checkpoints, each of whose reads raises ``failure``."""
    from train.checkpoint import Checkpointer
    from train.rundir import RunDir

    ckpt = Checkpointer(RunDir(run), keep=3, every=2)

    def fails(step, abstract_state):
        raise failure

    ckpt.restore = fails
    return ckpt


OUT_OF_MEMORY = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.0GiB")


@pytest.mark.parametrize(
    "failure, error, words",
    [
        (OUT_OF_MEMORY, UserError, "matches its checksums but could not be restored (RuntimeError: "),
        (OSError(errno.EIO, "Input/output error"), IOFault, "reading checkpoint"),
    ],
)
def test_a_failed_read_of_a_verified_checkpoint_moves_nothing(failure, error, words, finished_run, tmp_path):
    """A read that fails on files matching their checksums is the machine's or the library's
    problem, not the checkpoint's: one error, every checkpoint kept for a later resume."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    ckpt = failing_checkpointer(run, failure)
    with pytest.raises(error) as e:
        ckpt.restore_latest(None, lambda state: None, say=pytest.fail)
    assert words in str(e.value) and "it is kept" in str(e.value) and "\n" not in str(e.value)
    assert ckpt.steps() == [4, 6, 8] and not (run / "rejected_checkpoints").exists()
    ckpt.close()


def test_an_unreadable_checkpoint_without_checksums_is_refused(finished_run, tmp_path):
    """No checksums (a crash right after orbax finished it) and a read that fails: the
    checkpoint itself is suspect, so it is moved aside and the next older one is tried."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checksums" / "8.json").unlink()
    ckpt = failing_checkpointer(run, OUT_OF_MEMORY)
    said = []
    with pytest.raises(UserError, match="matches its checksums"):  # step 6 has its checksums
        ckpt.restore_latest(None, lambda state: None, say=said.append)
    assert [m.split(":")[0] for m in said] == ["checkpoint 8 is not usable"]
    assert ckpt.steps() == [4, 6] and (run / "rejected_checkpoints" / "8").is_dir()
    ckpt.close()


@pytest.mark.slow
@pytest.mark.parametrize("kept", [0.5, 0.1])
def test_a_truncated_checkpoint_without_checksums_is_one_line_not_a_flood(finished_run, tmp_path, kept):
    """A truncated array file in the newest checkpoint, whose checksums were never written: the
    resume says in one line that it is not usable and goes on from the one before; what orbax's
    failed read leaves (reads calling back into its closed event loop, coroutines raising as
    they are discarded, a gathering whose exception nobody retrieved) prints nothing (tens to
    hundreds of tracebacks after that line before)."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checksums" / "8.json").unlink()
    f = largest_array_file(run / "checkpoints" / "8")
    f.write_bytes(f.read_bytes()[: int(f.stat().st_size * kept)])
    proc = run_cli(
        run,
        *FAST,
        "train.steps=10",
        "checkpoint.every=2",
        "checkpoint.keep=3",
        extra=["--resume"],
        quiet=False,
        in_process=False,
    )  # Python's own reporting
    assert "checkpoint 8 is not usable: unreadable (" in proc.stdout
    assert "resuming from step 6" in proc.stdout
    for noise in ("Traceback", "Event loop is closed"):
        assert noise not in proc.stderr, proc.stderr[:3000]


def test_only_a_failed_reads_leftovers_are_dropped(monkeypatch):
    """The hook drops the closed event loop's callbacks and orbax's read coroutines; any other
    unraisable report (a coroutine of another module's) reaches the hook before it, installed once."""
    from types import SimpleNamespace

    from train import orbax_noise

    got = []
    monkeypatch.setattr(sys, "unraisablehook", got.append)
    orbax_noise.drop_failed_read_leftovers()
    hook = sys.unraisablehook
    orbax_noise.drop_failed_read_leftovers()

    async def read_elsewhere():
        pass

    coroutine = read_elsewhere()
    hook(SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None))
    hook(SimpleNamespace(exc_value=ValueError("other"), object=None))
    hook(SimpleNamespace(exc_value=Exception("not orbax's"), object=coroutine))
    coroutine.close()
    assert [u.exc_value.args[0] for u in got] == ["other", "not orbax's"]
    # asyncio's record of a gathering whose exception nobody retrieved: dropped when the
    # exception came from orbax's code, kept otherwise.
    records = []
    for where in (orbax_noise.ORBAX_DIR + "checkpoint/_src/read.py", __file__):
        try:
            exec(compile("raise ValueError('read failed')", where, "exec"))
        except ValueError as e:
            message = "_GatheringFuture exception was never retrieved"
            records.append(
                logging.LogRecord("asyncio", logging.ERROR, "", 0, message, (), (type(e), e, None))
            )
    leftovers = orbax_noise.OrbaxLeftovers()
    assert [leftovers.filter(r) for r in records] == [False, True]
    assert sys.unraisablehook is hook  # the second call added no second layer


def test_a_checkpointer_drops_a_failed_saves_leftovers_from_its_start(monkeypatch, tmp_path):
    """A disk that fills during an asynchronous save leaves orbax's coroutines and tensorstore's
    callbacks into a closed event loop as a failed read does (about 100 lines of tracebacks after
    the run's one error line): the hook is in place from the checkpointer's start, not only
    from a restore's."""
    from types import SimpleNamespace

    from train import checkpoint
    from train.rundir import RunDir

    got = []
    monkeypatch.setattr(sys, "unraisablehook", got.append)
    checkpoint.Checkpointer(RunDir(tmp_path / "run"), keep=1, every=1)
    sys.unraisablehook(SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None))
    sys.unraisablehook(SimpleNamespace(exc_value=ValueError("other"), object=None))
    assert [u.exc_value.args[0] for u in got] == ["other"]


def test_in_a_multi_process_run_an_unreadable_checkpoint_without_checksums_is_reported(
    finished_run, tmp_path, monkeypatch
):
    """A read that fails may fail in one process only, while the others wait in orbax's closing
    barrier: the process says so in one line and keeps the checkpoint, moved by hand."""
    import train.checkpoint

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checksums" / "8.json").unlink()
    monkeypatch.setattr(train.checkpoint, "multi_process", lambda: True)
    ckpt = failing_checkpointer(run, OUT_OF_MEMORY)
    with pytest.raises(
        UserError, match=r"checkpoint .*8 has no checksums and could not be read in process 0 "
    ):
        ckpt.restore_latest(None, lambda state: None, say=pytest.fail)
    assert ckpt.steps() == [4, 6, 8] and not (run / "rejected_checkpoints").exists()
    ckpt.close()


@pytest.mark.slow
def test_a_resume_onto_checkpoints_of_other_settings_or_of_no_config_is_refused_in_one_line(
    finished_run, tmp_path
):
    """A run dir whose config.yaml was edited (its checkpoints made with another block size) is
    refused before any array is read: one line naming the first state leaf and both shapes, no
    traceback after it (a read that failed part-way left orbax's reads calling into a closed
    event loop), every checkpoint kept. One whose config.yaml is gone is refused as well: the
    batch, seed and model it resumes with could not be checked."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "summary.json").unlink()
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("block_size: 16", "block_size: 8"))
    sets = [*FAST, "train.steps=10", "checkpoint.every=2", "checkpoint.keep=3", "optimizer.block_size=8"]
    proc = run_cli(run, *sets, extra=["--resume"], check=False, in_process=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"checkpoint {run / 'checkpoints' / '8'} holds another state than this run's settings make" in (
        proc.stderr
    )
    # The magnitudes' blocks: twice as many under half the block size.
    stored, expected = map(
        int, re.search(r"stored \((\d+), 64\), expected \((\d+), 64\)", proc.stderr).groups()
    )
    assert expected == 2 * stored and "it is kept" in proc.stderr, proc.stderr
    kept = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [4, 6, 8] and not (run / "rejected_checkpoints").exists()
    config.unlink()
    proc = run_cli(run, *FAST, "train.steps=10", extra=["--resume"], check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"--resume: {run} holds checkpoints but no config.yaml to check" in proc.stderr


@pytest.mark.parametrize(
    ("stored", "expected", "found"),
    [
        ({"w": (4,)}, {"w": (4,), "x": (3,)}, "['x']: stored nothing, expected (3,)"),
        ({"w": (4,), "x": (3,)}, {"w": (4,)}, "['x']: stored (3,), expected nothing"),
    ],
    ids=["a leaf the run adds", "a leaf the run lacks"],
)
def test_a_state_with_a_leaf_more_or_fewer_than_the_checkpoints_is_refused_by_name(
    stored, expected, found, tmp_path
):
    """Settings whose state has a leaf the checkpoint lacks, or lacks one it holds (as a host
    of other state would): the resume names that leaf, before any array is read, and keeps
    the checkpoint."""
    import jax
    import jax.numpy as jnp

    from train.checkpoint import Checkpointer

    run = RunDir(tmp_path / "run")
    ckpt = Checkpointer(run, keep=3, every=2)
    ckpt.save(2, {key: jnp.ones(shape) for key, shape in stored.items()}, {"iterator": 1})
    ckpt.close()
    ckpt = Checkpointer(run, keep=3, every=2)
    abstract = {key: jax.ShapeDtypeStruct(shape, jnp.float32) for key, shape in expected.items()}
    refusal = f"holds another state than this run's settings make ({found})"
    with pytest.raises(UserError, match=re.escape(refusal)):
        ckpt.restore_latest(abstract, lambda state: None, say=pytest.fail)
    assert ckpt.steps() == [2] and not run.rejected.exists()
    ckpt.close()


@pytest.mark.parametrize(
    ("message", "said"),
    [
        ("Read failed. Tensorstore says more here.\nand a second line", "Read failed"),
        ("shape (4,) vs. stored (8,). More", "shape (4,) vs. stored (8,)"),  # "vs. s": not a sentence's end
        ("word " * 60, ("word " * 40).strip() + " ..."),  # over 200 characters: cut at a word
        ("", ""),
    ],
    ids=["two sentences", "an abbreviation", "a long one", "none"],
)
def test_a_failed_reads_error_is_said_by_its_first_sentence(message, said):
    """What a refused checkpoint's line quotes of the library's error: its first sentence of
    its first line, at most 200 characters."""
    from train.checkpoint import _first_sentence

    assert _first_sentence(RuntimeError(message)) == said


@pytest.mark.slow
@pytest.mark.parametrize("damage", [truncate])  # each kind of damage: test_verification_names_...
def test_a_damaged_newest_checkpoint_falls_back_to_the_next_older(damage, finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    written = (run / "checksums" / "8.json").read_text()
    reason = damage(run / "checkpoints" / "8") or "files changed since it was written"
    proc = run_cli(
        run, *FAST, "train.steps=10", "checkpoint.every=2", "checkpoint.keep=3", extra=["--resume"]
    )
    assert f"checkpoint 8 is not usable: {reason}" in proc.stdout, proc.stdout
    assert "resuming from step 6" in proc.stdout and "Traceback" not in proc.stderr
    assert (run / "rejected_checkpoints" / "8").is_dir()
    # Its checksums go with it: what it held when it was written.
    assert (run / "rejected_checkpoints" / "8.checksums.json").read_text() == written
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 10
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == list(range(1, 11))


@pytest.mark.slow
def test_a_checkpoint_of_non_finite_weights_is_passed_over_for_the_one_before(finished_run, tmp_path):
    """A checkpoint that verifies and reads but holds a NaN weight (written by hand here; a run
    saves none) is not resumed from: it is set aside and the run goes on from the one before."""
    import jax
    import numpy as np

    from train.checkpoint import Checkpointer

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    ckpt = Checkpointer(RunDir(run), keep=3, every=2)
    state, data = ckpt.restore(8, None)
    leaves, treedef = jax.tree.flatten(state["params"])
    leaves[0] = np.full_like(leaves[0], np.nan)
    shutil.rmtree(run / "checkpoints" / "8")
    ckpt.manager.reload()
    ckpt.save(8, jax.device_put({**state, "params": jax.tree.unflatten(treedef, leaves)}), data)
    ckpt.wait()
    ckpt.close()
    assert Checkpointer(RunDir(run), keep=3, every=2).verify(8) is None  # its files are as written
    proc = run_cli(
        run, *FAST, "train.steps=10", "checkpoint.every=2", "checkpoint.keep=3", extra=["--resume"]
    )
    assert "checkpoint 8 is not usable: non-finite parameters" in proc.stdout, proc.stdout
    assert "resuming from step 6" in proc.stdout and (run / "rejected_checkpoints" / "8").is_dir()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_no_usable_checkpoint_is_one_error_naming_each_tried(finished_run, tmp_path, capsys):
    from train.checkpoint import Checkpointer
    from train.rundir import RunDir

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for step in (4, 6, 8):
        truncate(run / "checkpoints" / str(step))
    said = []
    ckpt = Checkpointer(RunDir(run), keep=3, every=2)
    with pytest.raises(UserError) as e:
        ckpt.restore_latest(None, lambda state: None, say=said.append)  # verification refuses all
    message = str(e.value)
    assert message.startswith("no usable checkpoint in ") and "\n" not in message
    assert [m.split(":")[0] for m in said] == [f"checkpoint {s} is not usable" for s in (8, 6, 4)]
    assert all(f"step {s} (files changed since it was written" in message for s in (8, 6, 4))
    assert sorted(p.name for p in (run / "rejected_checkpoints").iterdir() if p.name.isdigit()) == [
        "4",
        "6",
        "8",
    ]
    ckpt.close()
    # A second --resume of the run (stopped short: interrupted) does not start it over quietly,
    # replacing its records: one line says what is left to do.
    from train.__main__ import main

    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "status": "interrupted"}))
    metrics = (run / "metrics.jsonl").read_text()
    code = main(["--config", TINY, "--run-dir", str(run), "--quiet", "--resume"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        f"error: --resume: {run} holds no checkpoint to continue from: the run's were set aside as "
        f"not usable ({run / 'rejected_checkpoints'}); run without --resume to start it over (its "
        f"metrics and summary are replaced), or move a checkpoint back into {run / 'checkpoints'}"
    )
    assert (run / "metrics.jsonl").read_text() == metrics


@pytest.mark.slow
def test_divergence_stops_the_run_keeps_the_checkpoint_before_it_and_the_completed_summary(tmp_path):
    run = tmp_path / "run"
    run_cli(run, *FAST, "train.steps=4", "checkpoint.every=2")
    completed = (run / "summary.json").read_text()
    # Resumed with a learning rate that blows the loss up: the guard stops it.
    proc = run_cli(
        run,
        *FAST,
        "train.steps=40",
        "train.lr=1.0e+4",
        "train.warmup_ratio=0.0",
        "train.zero_grad_steps=3",
        "checkpoint.every=1",
        extra=["--resume"],
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "stopping (diverged)" in proc.stdout
    failed = json.loads((run / "summary.json").read_text())
    # the loss blows up, or the model dies (gradient norm exactly 0), whichever comes first
    assert failed["status"] == "diverged"
    assert (
        "running minimum" in failed["stop_reason"]
        or "gradient norm has been exactly 0" in failed["stop_reason"]
    )
    assert (run / "summary.completed-4.json").read_text() == completed  # the completed record
    assert RunDir(run).state() == "failed"
    bad = failed["first_bad_step"]  # its loss came from the weights after step bad - 1
    assert failed["steps"] == bad - 1
    kept = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert kept and max(kept) < bad - 1 and f"step {max(kept)}, is kept" in proc.stdout
    rejected = [int(p.name) for p in (run / "rejected_checkpoints").iterdir() if p.name.isdigit()]
    assert bad - 1 in rejected and min(rejected) >= bad - 1  # those weights were set aside


@pytest.mark.slow
def test_a_completed_run_resumed_to_go_on_is_not_completed_until_it_ends(tmp_path):
    """A completed run resumed to more steps: its summary is kept as summary.completed-N.json,
    and summary.json records a resumable run until the attempt ends, so a SIGKILL on the way
    leaves no "completed" run whose metrics and config go on past it."""
    run = tmp_path / "run"
    run_cli(run, *FAST, "train.steps=4", "checkpoint.every=2", "checkpoint.keep=2")
    completed = (run / "summary.json").read_text()
    config = (run / "config.yaml").read_text()
    files = sorted(p.relative_to(run / "checkpoints" / "4") for p in (run / "checkpoints" / "4").rglob("*"))
    longer = start_cli(
        run, *FAST, "train.steps=400", "checkpoint.every=2", "checkpoint.keep=2", extra=["--resume"]
    )
    wait_for_steps(longer, run, 8)
    longer.kill()
    longer.wait(timeout=60)
    assert (run / "summary.completed-4.json").read_text() == completed
    # Its config, and its last checkpoint, out of orbax's rotation (checked below).
    assert (run / "config.completed-4.yaml").read_text() == config
    assert "steps: 400" in (run / "config.yaml").read_text()
    kept = run / "checkpoints.completed-4"
    assert sorted(p.relative_to(kept) for p in kept.rglob("*")) == files
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["last_checkpoint"]) == ("interrupted", 4, 4)
    assert (
        "resumed from step 4 to go on from the completed run (summary.completed-4.json)"
        in (summary["stop_reason"])
    )
    assert RunDir(run).state() == "resumable"  # a sweep resumes it, train.compare does not count it
    resumed = run_cli(run, *FAST, "train.steps=10", "checkpoint.every=2", extra=["--resume"])
    assert "resuming from step" in resumed.stdout
    assert "--resume: settings changed since the run's config.yaml: train.steps: 400 -> 10" in resumed.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["10", "8"]  # keep 2
    assert sorted(p.relative_to(kept) for p in kept.rglob("*")) == files  # the completed run's, kept
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("completed", 10)
    assert len(summary["sessions"]) == 2  # the first session's, kept through the kill, and this one
    # The change stays on record (config.yaml now says 10), for compare and sweep to say.
    step = int(resumed.stdout.split("resuming from step ")[1].split()[0])
    assert summary["changed_on_resume"] == [{"step": step, "changes": ["train.steps: 400 -> 10"]}]
    assert (run / "summary.completed-4.json").read_text() == completed


def test_a_completed_run_reopened_from_an_earlier_checkpoint_drops_its_final_results(tmp_path):
    """Resumed from a checkpoint before its end, the completed run's final evaluation is not the
    interrupted run's: summary.json leaves it out (the kept record has it)."""
    completed = {"status": "completed", "steps": 8, "final_eval_loss": 2.0, "final_eval_ppl": 7.39}
    completed |= {"profile": {"allocation": "allocation.json"}, "sessions": [[0.0, 1.0, "host"]]}
    (tmp_path / "summary.json").write_text(json.dumps(completed))
    for step, kept_results in ((8, True), (4, False)):
        run = RunDir(tmp_path)
        (tmp_path / "summary.json").write_text(json.dumps(completed))
        kept = run.reopen(step)
        assert kept.name == "summary.completed-8.json" and json.loads(kept.read_text()) == completed
        summary = run.summary()
        assert (summary["status"], summary["steps"]) == ("interrupted", step)
        assert summary["last_checkpoint"] == step
        assert summary["sessions"] == completed["sessions"]
        results = {k: summary[k] for k in ("final_eval_loss", "final_eval_ppl", "profile")}
        assert results == ({k: completed[k] for k in results} if kept_results else dict.fromkeys(results))


def test_guard_catches_nan_a_loss_spike_and_a_dead_gradient():
    guard = DivergenceGuard(factor=3.0, zero_grad_steps=4)
    assert guard.check(1, 5.0, 1.0, 0.1) is None and guard.check(2, 2.0, 1.0, 0.1) is None
    assert guard.check(3, 5.9, 1.0, 0.1) is None  # under 3 x the running minimum 2.0
    status, reason, first = guard.check(4, 6.1, 1.0, 0.1)
    assert status == "diverged" and first == 4 and "3 x its running minimum 2" in reason
    dead = DivergenceGuard(factor=0.0, zero_grad_steps=4)
    for step in range(1, 4):
        assert dead.check(step, 5.5, 0.0, 0.1) is None
    status, reason, first = dead.check(4, 5.5, 0.0, 0.1)
    assert status == "diverged" and first == 1 and "exactly 0 since step 1 (4 steps" in reason
    warm = DivergenceGuard(factor=0.0, zero_grad_steps=2)  # a zero learning rate is not a dead model
    assert all(warm.check(s, 5.5, 0.0, 0.0) is None for s in range(1, 10))
    assert DivergenceGuard(3.0, 4).check(1, math.nan, 1.0, 0.1)[0] == "nan"
    restored = DivergenceGuard(3.0, 4)
    restored.load(guard.state())
    assert restored.min_loss == 2.0


def fake_run(
    root,
    name,
    status="completed",
    tokenizer="bytes",
    validation="v1",
    device="cpu",
    session=(0, 10),
    evaluation=(32, 2, 8),
    validation_tokens=None,
):
    """A run dir's files for compare; ``evaluation`` is its ``(seq_len, eval_batches,
    batch_size)`` in ``config.yaml`` (``None``: no config, as a run dir copied without it)."""
    run = root / name
    run.mkdir()
    if evaluation is not None:
        seq_len, eval_batches, batch_size = evaluation
        train = {"seq_len": seq_len, "eval_batches": eval_batches, "batch_size": batch_size}
        (run / "config.yaml").write_text(json.dumps({"train": train}))
    rows = [
        {"step": s, "eval_loss": math.log(p), "eval_ppl": p, "wall_s": float(s)}
        for s, p in ((5, 30.0), (10, 20.0))
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "status": status,
        "data": {
            "tokenizer": {"kind": tokenizer},
            "validation_sha256": validation,
            **({"tokens": {"validation": validation_tokens}} if validation_tokens else {}),
        },
        "device_kind": device,
        "sessions": [[session[0], session[1], "host"]],
    }
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def with_summary(run: pathlib.Path, **fields) -> pathlib.Path:
    """``run`` with ``fields`` set in its ``summary.json``."""
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, **fields}))
    return run


def test_compare_refuses_runs_that_do_not_compare_and_force_marks_them(tmp_path, capsys):
    base = fake_run(tmp_path, "base")
    for name, kw, why in (
        ("cut", {"status": "interrupted"}, "cut did not complete (status: interrupted)"),
        ("sp", {"tokenizer": "sentencepiece"}, "sp has another tokenizer than base"),
        ("val", {"validation": "v2"}, "val has another validation data than base"),
        (
            "seq",
            {"evaluation": (64, 2, 8)},
            "seq evaluates other validation windows than base (train.seq_len 64 vs 32, "
            "windows 16 vs 16: train.eval_batches x batch_size, or the whole split where it holds fewer)",
        ),
        (
            "all",
            {"evaluation": (32, 100000, 8)},
            "all evaluates other validation windows than base (train.seq_len 32 vs 32, "
            "windows 800000 vs 16: train.eval_batches x batch_size, or the whole split where it holds fewer)",
        ),
    ):
        other = fake_run(tmp_path, name, **kw)
        with pytest.raises(UserError, match=re.escape(why)):
            compare([base, other], tmp_path / "out")
        text = compare([base, other], tmp_path / "out", force=True)
        assert f"not comparable (--force): {why}" in text
    # A run resumed with other settings: comparable, with a warning that stays in the report.
    changed = with_summary(
        fake_run(tmp_path, "changed"), changed_on_resume=[{"step": 5, "changes": ["train.lr: 0.01 -> 0.02"]}]
    )
    capsys.readouterr()
    text = compare([base, changed], tmp_path / "out")
    said = (
        "changed was resumed at step 5 with other settings (train.lr: 0.01 -> 0.02): its steps before "
        "and after ran under each"
    )
    assert said in text and f"warning: {said}" in capsys.readouterr().err
    # The same tokenizer under another file name: the same tokens, comparable.
    renamed = fake_run(tmp_path, "renamed")
    summary = json.loads((renamed / "summary.json").read_text())
    summary["data"]["tokenizer"]["name"] = "renamed.model"
    (renamed / "summary.json").write_text(json.dumps(summary))
    compare([base, renamed], tmp_path / "out")
    # Another eval_batches x batch_size of the same windows (4 x 4 against 2 x 8), and a run dir
    # without its config.yaml (nothing to compare): comparable.
    compare([base, fake_run(tmp_path, "same", evaluation=(32, 4, 4))], tmp_path / "out")
    compare([base, fake_run(tmp_path, "bare", evaluation=None)], tmp_path / "out")
    # A split of 10 windows of 33 tokens, read whole by 2 x 8 and by 100 x 8: the same windows.
    small = [fake_run(tmp_path, f"small{n}", evaluation=(32, n, 8), validation_tokens=330) for n in (2, 100)]
    compare(small, tmp_path / "out")
    # 362 tokens are 10 windows of 33 (the last 32 tokens no window): as 1 x 10 reads them.
    ten = fake_run(tmp_path, "ten", evaluation=(32, 1, 10))
    whole = fake_run(tmp_path, "whole", evaluation=(32, 100, 8), validation_tokens=362)
    compare([ten, whole], tmp_path / "out")
    compare([base, fake_run(tmp_path, "gpu", device="H100", session=(5, 15))], tmp_path / "out")
    err = capsys.readouterr().err
    assert "different devices (H100, cpu)" in err and "base and gpu ran at the same time" in err
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert report["runs"][0]["status"] == "completed" and len(report["warnings"]) == 2


def test_compare_names_runs_apart_refuses_one_given_twice_and_warns_of_resumed_times(tmp_path, capsys):
    """Two sweeps' runs of one name were two rows of the same name (and in the plot's legend);
    a resumed run's time counts its restarts, which compare now says."""
    for sweep in ("a", "b"):
        (tmp_path / sweep).mkdir()
    first, second = (
        fake_run(tmp_path / "a", "galore-seed0"),
        fake_run(tmp_path / "b", "galore-seed0", session=(20, 30)),
    )
    compare([first, second], tmp_path / "out")
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert [r["run"] for r in report["runs"]] == ["a/galore-seed0", "b/galore-seed0"]
    assert "| b/galore-seed0 | completed |" in (tmp_path / "out" / "compare.md").read_text()
    other = fake_run(tmp_path, "moara-seed0", session=(20, 30))
    compare([first, other], tmp_path / "out")  # names apart already: the directory's name
    assert [r["run"] for r in json.loads((tmp_path / "out" / "compare.json").read_text())["runs"]] == [
        "galore-seed0",
        "moara-seed0",
    ]
    (tmp_path / "baseline").symlink_to(first)  # a link keeps the name it was given by
    compare([tmp_path / "baseline", other], tmp_path / "out")
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["runs"][0]["run"] == "baseline"
    with pytest.raises(UserError, match=r"galore-seed0 is given twice"):
        compare([first, tmp_path / "a" / ".." / "a" / "galore-seed0"], tmp_path / "out")
    with_summary(other, sessions=[[20, 25, "host"], [40, 50, "host"]])
    capsys.readouterr()
    text = compare([first, other], tmp_path / "out")
    resumed = (
        "moara-seed0 ran in 2 sessions (resumed): its wall-clock time counts each session's compilation "
        "(not its restore)"
    )
    assert f"warning: {resumed}" in capsys.readouterr().err and f"- warning: {resumed}" in text


@pytest.mark.parametrize(
    "damage", ["out is a file", "out cannot be made", "summary is a list", "eval row without wall_s"]
)
def test_compare_bad_input_is_one_line_naming_the_file(tmp_path, capsys, damage):
    """``python -m train.compare`` on an ``--out`` that is a file or cannot be made (it was a
    traceback), or on a damaged run dir (a
    summary that is no JSON object, an evaluation row without its time): exit 2 and one line
    naming the file and what is wrong, the file left as it was, and no --out directory made."""
    from train.compare import main

    base, other = fake_run(tmp_path, "base"), fake_run(tmp_path, "other")
    out = tmp_path / "out"
    if damage == "out is a file":
        out.write_text("kept")
        file, message = out, f"--out {out}: {out} is not a directory"
    elif damage == "out cannot be made":
        out = pathlib.Path("/proc/compare")
        file, message = base / "summary.json", f"--out {out}: cannot create it ("
    elif damage == "summary is a list":
        file, message = other / "summary.json", f"{other / 'summary.json'} is not a JSON object"
        file.write_text("[1, 2]")
    else:
        file = other / "metrics.jsonl"
        file.write_text(file.read_text() + '{"step": 15, "eval_ppl": 50}\n')
        message = f'{file}: the row {{"step": 15, "eval_ppl": 50}} has no number wall_s'
    before = file.read_text()
    if damage in ("summary is a list", "eval row without wall_s"):
        out = tmp_path / "new" / "out"  # made for the comparison, left as it was by the refusal
    code = main([str(base), str(other), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert file.read_text() == before
    assert damage == "out is a file" or not (tmp_path / "new").exists()


def test_banner_warns_when_the_embedding_and_head_hold_most_parameters(tmp_path):
    from train.rundir import banner

    common = dict(
        model="tiny", optimizer="adamw", ranks=None, data="data: x", tokens_per_step=256, run_dir=tmp_path
    )
    lines = banner(params=4_196_672, embedding_params=4_096_000, **common)
    assert "98% in the embedding and LM head" in lines[0]
    assert lines[-1].startswith("warning: the embedding and LM head hold 98% of the parameters")
    assert not banner(params=133_568, embedding_params=32_896, **common)[-1].startswith("warning")


def test_the_banner_says_where_magnitude_blocks_span_two_devices(tmp_path):
    """A block size that does not divide a target matrix's fan_in shard puts blocks across two
    devices (XLA then gathers the matrix: "Involuntary full rematerialization", seen with
    tiny.yaml on fsdp=8 at block 16 and gone at block 8): said at start, naming the block size,
    how many matrices, and one of them with its shard; nothing where every block lies on one
    device."""
    import jax

    import models
    from train.rundir import banner
    from train.sharding import param_shardings, straddling_blocks

    cfg = models.get_config("tiny")  # hidden 64, intermediate 176
    logical, abstract = models.logical_axes(cfg), models.abstract_params(cfg)

    def said(fsdp: int, tensor: int, block: int):
        mesh = jax.sharding.AbstractMesh((1, fsdp, tensor), ("data", "fsdp", "tensor"))
        return straddling_blocks(param_shardings(logical, abstract, mesh), abstract, block)

    # fsdp=8 shards the fan_in of q, k, v, gate and up (64 -> 8 rows a device) in both layers.
    straddle = said(8, 1, 16)
    assert straddle.startswith(
        "optimizer.block_size 16 does not divide the device shard of 10 target matrices' fan_in "
        "(['layers_0']['mlp']['gate_proj']['kernel']: fan_in 64 over fsdp=8 and 9 more)"
    ), straddle
    assert said(8, 1, 8) is None and said(2, 1, 16) is None  # 8 rows in blocks of 8; 32 in 16
    # tensor=2 shards o's and down's fan_in (64 -> 32, 176 -> 88): only 88 is no multiple of 16.
    down = "['layers_0']['mlp']['down_proj']['kernel']: fan_in 176 over tensor=2 and 1 more"
    assert f"of 2 target matrices' fan_in ({down})" in said(1, 2, 16)
    common = dict(model="tiny", optimizer="moara", ranks=None, data="data: x", tokens_per_step=256)
    lines = banner(params=133_568, embedding_params=32_896, run_dir=tmp_path, straddle=straddle, **common)
    assert lines[-1] == f"warning: {straddle}"


def test_the_banner_names_the_mesh_and_the_dimensions_its_axes_do_not_divide(tmp_path):
    """A mesh axis that does not divide a dimension the rules put on it leaves that dimension
    whole on every device (right numbers, none of the memory the axis was for): said at start,
    beside the mesh as made (``mesh.data: -1`` takes what is left)."""
    import jax

    import models
    from train.rundir import banner
    from train.sharding import split_heads, whole_dims

    cfg = models.get_config("tiny")
    logical, abstract = models.logical_axes(cfg), models.abstract_params(cfg)
    mesh = jax.sharding.AbstractMesh((1, 2, 3), ("data", "fsdp", "tensor"))
    whole = whole_dims(logical, abstract, mesh)
    assert f"['embed_tokens']['embedding'] ({cfg.vocab_size}, 64) dim 0 over tensor=3" in whole, whole
    assert all(" over tensor=3" in w for w in whole)  # hidden 64 divides by fsdp=2
    assert not whole_dims(logical, abstract, jax.sharding.AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor")))
    common = dict(model="tiny", optimizer="adamw", ranks=None, data="data: x", tokens_per_step=256)
    lines = banner(
        params=133_568, embedding_params=32_896, run_dir=tmp_path, mesh="mesh: m", whole=whole, **common
    )
    assert lines[3] == "mesh: m" and lines[4].startswith("tokens per step")
    assert lines[-1].startswith(
        f"warning: {len(whole)} parameter dimension(s) the mesh would shard stay whole"
    )
    assert lines[-1].endswith(f"and {len(whole) - 2} more")
    # tensor=8 against the 4 heads of 16 dims: every dimension divides, and heads are split.
    assert split_heads(cfg, jax.sharding.AbstractMesh((1, 1, 2), ("data", "fsdp", "tensor"))) is None
    # tensor=3 leaves the 4 x 16 dimensions whole (whole_dims says so): no head is split.
    assert split_heads(cfg, mesh) is None
    split = split_heads(cfg, jax.sharding.AbstractMesh((1, 1, 8), ("data", "fsdp", "tensor")))
    assert split.startswith(
        "mesh tensor=8 does not divide the 4 query and 4 key/value heads, so heads are split"
    )
    lines = banner(params=133_568, embedding_params=32_896, run_dir=tmp_path, split_heads=split, **common)
    assert lines[-1] == f"warning: {split}"
