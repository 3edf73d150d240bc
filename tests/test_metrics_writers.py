"""Metric writers besides ``metrics.jsonl``: TensorBoard event files (read back) and Weights &
Biases (against a stand-in module), and the trainer's profile run writing both kinds of scalars."""

import pathlib
import struct
import sys
import types

import pytest

from train.errors import UserError
from train.metrics import MetricsWriter, make_sinks


def read_events(run_dir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value)]`` from the TFRecord event files under ``RUN_DIR/tensorboard``,
    each checked to hold whole records (lengths and checksums) and nothing else."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    scalars: dict = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            header = data[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            record = data[pos + 12 : pos + 12 + length]
            checksums = struct.unpack(
                "<II", data[pos + 8 : pos + 12] + data[pos + 12 + length : pos + 16 + length]
            )
            assert checksums == (masked_crc32c(header), masked_crc32c(record)), (
                f"{path}: a broken record at {pos}"
            )
            event = event_pb2.Event.FromString(record)
            pos += 12 + length + 4
            if event.session_log.status == event.session_log.START:  # a purge, as TensorBoard reads it
                scalars = {tag: [(s, v) for s, v in seen if s < event.step] for tag, seen in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_a_resumed_run_continues_its_event_files_with_no_step_lost_or_twice(tmp_path):
    """Killed after step 6 with a checkpoint at 4 (its scalars flushed there), resumed from 4:
    TensorBoard shows steps 1-8 once each."""
    pytest.importorskip("tensorboardX")
    first = MetricsWriter(tmp_path, 8, None, quiet=True, sinks=make_sinks(["tensorboard"], tmp_path, {}, "p"))
    for step in range(1, 7):
        first.write({"step": step, "loss": float(step), "wall_s": 0.0})
        if step == 4:
            first.flush()  # the checkpoint of step 4
    assert [s for s, _ in read_events(tmp_path)["train/loss"]] == [1, 2, 3, 4]
    first.sinks[0].file.close()  # 5-6 written too, as a later write may have before a kill
    sinks = make_sinks(["tensorboard"], tmp_path, {}, "p", resume_step=4)
    second = MetricsWriter(tmp_path, 8, 4, quiet=True, sinks=sinks)
    for step in range(5, 9):
        second.write({"step": step, "loss": 10.0 + step, "wall_s": 0.0})
    second.close()
    assert read_events(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)] + [
        (s, 10.0 + s) for s in range(5, 9)
    ]


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboardX")
    sinks = make_sinks(["jsonl", "tensorboard"], tmp_path, {"a": 1}, "p")
    writer = MetricsWriter(tmp_path, 10, None, quiet=True, sinks=sinks)
    writer.write({"step": 1, "loss": 5.5, "lr": 0.01, "grad_norm": 2.0, "tokens_per_s": 100.0, "wall_s": 1.0})
    writer.write({"step": 2, "loss": 4.5, "lr": 0.02, "grad_norm": 1.5, "tokens_per_s": 110.0, "wall_s": 2.0})
    writer.write({"step": 2, "eval_loss": 4.6, "eval_ppl": 99.5, "wall_s": 2.5})
    writer.scalars(2, {"alignment/S_down": 0.25})
    writer.close()
    events = read_events(tmp_path)
    assert events["train/loss"] == [(1, 5.5), (2, 4.5)]
    assert events["train/lr"] == [(1, pytest.approx(0.01)), (2, pytest.approx(0.02))]
    assert events["eval/ppl"] == [(2, 99.5)] and events["alignment/S_down"] == [(2, 0.25)]
    assert "wall_s" not in events and "step" not in events
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # jsonl as always


def test_wandb_runs_offline_with_the_config_and_logs_by_step(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, dict(values)))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    writer = MetricsWriter(
        tmp_path, 10, None, quiet=True, sinks=make_sinks(["wandb"], tmp_path, {"x": 2}, "proj")
    )
    writer.write({"step": 3, "loss": 1.25, "wall_s": 0.5})
    writer.close()
    (_, kw), log, finish = calls
    assert kw["mode"] == "offline" and kw["project"] == "proj" and kw["config"] == {"x": 2}
    assert kw["dir"] == str(tmp_path) and kw["name"] == tmp_path.name
    assert kw["resume"] == "allow" and len(kw["id"]) == 32  # a resume continues the same W&B run
    again = make_sinks(["wandb"], tmp_path / ".." / tmp_path.name, {}, "proj")[0]
    assert calls[-1][1]["id"] == kw["id"] and again is not None
    assert log == ("log", 3, {"train/loss": 1.25}) and finish == ("finish",)


def test_a_writer_whose_package_is_missing_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        UserError, match=r"tensorboardX is not installed: pip install 'moara-jax\[tensorboard\]'"
    ):
        make_sinks(["tensorboard"], tmp_path, {}, "p")
    with pytest.raises(UserError, match=r"wandb is not installed: pip install 'moara-jax\[wandb\]'"):
        make_sinks(["wandb"], tmp_path, {}, "p")
    # Said by python -m train before the data is built and the run dir is written, and by a
    # sweep's check of its grid before any run; a command that writes no metrics reads the config.
    from train import sweep
    from train.__main__ import main
    from train.config import load_config

    root = pathlib.Path(__file__).resolve().parents[1]
    tiny = str(root / "configs" / "tiny.yaml")
    for writer, package in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
        sets = [f"metrics.writers=[jsonl, {writer}]"]
        assert main(["--config", tiny, "--run-dir", str(tmp_path / writer), "--quiet", "--set", sets[0]]) == 2
        err = capsys.readouterr().err.strip()
        assert f"names {writer} but {package} is not installed" in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / writer).exists()
        runs = sweep.expand(pathlib.Path(tiny), [], [0])
        with pytest.raises(UserError, match=rf"seed0: metrics.writers names {writer} but {package}"):
            sweep.run_configs(pathlib.Path(tiny), runs, sets)
        assert load_config(tiny, sets).metrics.writers == ["jsonl", writer]
