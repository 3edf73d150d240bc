"""A run's metrics: ``metrics.jsonl`` (one object per logged step and per eval), a progress line,
and the sinks ``metrics.writers`` adds (TensorBoard events, Weights & Biases)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pathlib
import socket
import sys
import time
from typing import NamedTuple

from train.config import writer_not_installed
from train.errors import HeldFaults, IOFault, UserError, io_operation
from train.rundir import METRICS, TENSORBOARD, RunDir, write_atomically


def perplexity(loss: float) -> float:
    """``exp(loss)``, capped at ``exp(50)`` (a diverged loss stays a number)."""
    return math.exp(min(loss, 50.0))


class TensorBoardSink:
    """Scalars as TensorBoard event files in ``RUN_DIR/tensorboard`` (tensorboardX's event
    protos and record writer). A resumed run's file starts with a purge of the steps after its
    checkpoint (TensorBoard drops the interrupted session's events from there on), so no step
    shows twice.

    The events are written here, in the trainer's thread, not by tensorboardX's
    ``SummaryWriter``, whose writer thread and exit hook meet a full disk with tracebacks of
    their own after the run's one-line error. A write that fails closes the file and cuts it
    back to what its last flush wrote (whole records; the steps after them run again on the
    resume from the checkpoint that flush preceded), and raises."""

    name = "TensorBoard events"

    def __init__(self, run_dir: RunDir | pathlib.Path, resume_step: int | None = None):
        try:
            from tensorboardX import summary
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            from tensorboardX.record_writer import RecordWriter
        except ImportError:
            raise UserError(writer_not_installed("tensorboard")) from None
        self.path = run_dir / TENSORBOARD
        self._record_writer, self._event, self._scalar = RecordWriter, Event, summary.scalar
        self.file, self.file_path, self.flushed = None, None, 0
        self._open()
        if resume_step is not None:  # TensorBoard hides the events of steps from here on
            self._write(step=resume_step + 1, session_log=SessionLog(status=SessionLog.START))

    def _open(self) -> None:
        """A new event file, its first event the file version; each file its own name, in the
        order written (tensorboardX's names, which go by the second, and the nanosecond)."""
        self.path.mkdir(parents=True, exist_ok=True)
        ns = time.time_ns()
        name = f"events.out.tfevents.{ns // 10**9}.{socket.gethostname()}.{ns}"
        self.file_path, self.flushed = self.path / name, 0
        self.file = self._record_writer(str(self.file_path))
        self._write(file_version="brain.Event:2")

    def _write(self, **event) -> None:
        data = self._event(wall_time=time.time(), **event).SerializeToString()
        self._guarded(lambda: self.file.write(data))

    def _guarded(self, operation) -> None:
        try:
            operation()
        except OSError:
            file, self.file = self.file, None
            with contextlib.suppress(OSError):  # closing flushes the buffer: it fails again
                file.close()
            with contextlib.suppress(OSError):  # (cutting a file back takes no space)
                os.truncate(self.file_path, self.flushed)
            raise

    def scalars(self, step: int, values: dict) -> None:
        if self.file is None:
            self._open()
        for tag, value in values.items():
            self._write(step=step, summary=self._scalar(tag, value))

    def flush(self) -> None:
        """Every scalar so far in the file, on the disk."""
        if self.file is not None:
            self._guarded(self.file.flush)  # (with an fsync)
            self.flushed = self.file_path.stat().st_size

    def close(self) -> None:
        if self.file is not None:
            self.flush()
            file, self.file = self.file, None
            file.close()


class WandbSink:
    """Scalars to Weights & Biases: offline (files under ``RUN_DIR/wandb``) unless ``WANDB_MODE``
    says otherwise; the run config goes with them. The W&B run's id is the run dir's (its
    absolute path hashed), so a resumed run continues the same W&B run."""

    name = "Weights & Biases files"

    def __init__(self, run_dir: RunDir | pathlib.Path, config: dict, project: str = "moara-jax"):
        try:
            import wandb
        except ImportError:
            raise UserError(writer_not_installed("wandb")) from None
        self.path = run_dir
        self.run = wandb.init(
            project=project,
            name=run_dir.name,
            id=hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:32],
            dir=str(run_dir),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            resume="allow",
        )

    def scalars(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def flush(self) -> None:
        pass  # wandb writes as it logs

    def close(self) -> None:
        self.run.finish()


def make_sinks(
    writers: list,
    run_dir: RunDir | pathlib.Path,
    config: dict,
    wandb_project: str,
    resume_step: int | None = None,
) -> list:
    """The metric sinks besides ``metrics.jsonl`` that ``metrics.writers`` names (``resume_step``:
    the checkpoint's step when resuming)."""
    sinks = []
    if "tensorboard" in writers:
        sinks.append(TensorBoardSink(run_dir, resume_step))
    if "wandb" in writers:
        sinks.append(WandbSink(run_dir, config, wandb_project))
    return sinks


# metrics.jsonl keys -> the scalar names the sinks get
SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/ppl",
}


class MetricsWriter:
    def __init__(
        self,
        run_dir: RunDir | pathlib.Path,
        total_steps: int,
        resume_step: int | None,
        quiet: bool = False,
        enabled: bool = True,
        sinks: list = (),
    ):
        """``resume_step``: the checkpoint's step when resuming; the rows of later steps (written
        after that checkpoint by the interrupted run) are dropped, so no step appears twice.
        ``enabled=False`` (processes other than the first of a multi-host run) writes nothing."""
        self.path = run_dir / METRICS
        self.enabled = enabled
        self.faults = HeldFaults()  # the writes' faults, held during a multi-process run's steps
        self.sinks = list(sinks) if enabled else []
        quiet = quiet or not enabled
        self.total = total_steps
        self.quiet = quiet
        self.t0 = time.perf_counter()
        self.wall_offset = 0.0
        if enabled and resume_step is not None and not self.path.exists():
            print(
                f"warning: {self.path} is missing: the record of steps 1-{resume_step} is lost "
                "(the run goes on from its checkpoint)",
                file=sys.stderr,
            )
        if not enabled or not self.path.exists():
            return
        with io_operation("writing metrics to", self.path):
            if resume_step is None:
                self.path.unlink()
                return
            rows = [r for r in RunDir(run_dir).rows(None) if r.get("step", 0) <= resume_step]
            # always a new file: a reader following the old one sees that the resume rewrote it
            write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in rows), if_changed=False)
        self.wall_offset = max((r.get("wall_s", 0.0) for r in rows), default=0.0)

    def wall(self) -> float:
        return self.wall_offset + time.perf_counter() - self.t0

    def write(self, row: dict) -> None:
        if not self.enabled or self.faults.fault:  # nothing after a held fault
            return
        with self.faults.operation("writing metrics to", self.path), self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.scalars(row["step"], {SCALARS[k]: v for k, v in row.items() if k in SCALARS})

    def scalars(self, step: int, values: dict) -> None:
        """Scalars for the sinks alone (e.g. the per-module ``S_tau`` of a profile)."""
        for sink in self.sinks if not self.faults.fault else []:
            with self.faults.operation(f"writing {sink.name} to", sink.path):
                sink.scalars(step, values)

    def flush(self) -> None:
        """The sinks' buffered scalars to their files (at each checkpoint: a run killed later
        resumes from it with every step up to it written)."""
        for sink in self.sinks if not self.faults.fault else []:
            with self.faults.operation(f"writing {sink.name} to", sink.path):
                sink.flush()

    def close(self) -> None:
        """Closes the sinks (each flushes its files); the first fault is raised after all are
        closed."""
        sinks, self.sinks = self.sinks, []
        fault = None
        for sink in sinks:
            try:
                with io_operation(f"writing {sink.name} to", sink.path):
                    sink.close()
            except IOFault as e:
                fault = fault or e
        if fault is not None:
            raise fault

    def progress(self, step: int, loss: float, tokens_per_s: float, step_time: float) -> None:
        if self.quiet:
            return
        tty = sys.stderr.isatty()
        if not tty and step % max(1, self.total // 20) and step != self.total:
            return  # writing to a log file: about 20 lines per run
        eta = (self.total - step) * step_time
        ppl = perplexity(loss)
        line = (
            f"step {step}/{self.total}  loss {loss:.4f}  ppl {ppl:.1f}  "
            f"{tokens_per_s:,.0f} tok/s  ETA {eta:,.0f}s"
        )
        sys.stderr.write(f"\r{line}   " if tty else line + "\n")
        sys.stderr.flush()

    def note(self, line: str) -> None:
        """A line of its own (e.g. an evaluation), after the progress line."""
        if self.quiet:
            return
        if sys.stderr.isatty():
            sys.stderr.write("\n")
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end_progress(self) -> None:
        if not self.quiet and sys.stderr.isatty():
            sys.stderr.write("\n")


class Stop(NamedTuple):
    """Why a run stops before its last step, and the first step whose result it does not keep."""

    status: str  # nan | diverged
    reason: str
    first_bad_step: int


class DivergenceGuard:
    """Stops a run whose loss is not finite, rises above ``factor`` x its running minimum, or
    whose gradient norm is exactly zero for ``zero_grad_steps`` steps in a row while the
    learning rate is not (a dead model that would otherwise "complete" at ppl = vocabulary size).
    ``factor`` or ``zero_grad_steps`` 0 turns that check off. Its state is checkpointed."""

    def __init__(self, factor: float, zero_grad_steps: int):
        self.factor, self.zero_grad_steps = factor, zero_grad_steps
        self.min_loss = math.inf
        self.zero_since: int | None = None

    def check(self, step: int, loss: float, grad_norm: float, lr: float) -> Stop | None:
        """Why the run must stop after ``step``, or None."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return Stop("nan", f"loss is {loss} (gradient norm {grad_norm}) at step {step}", step)
        if self.factor and loss > self.factor * self.min_loss:
            return Stop(
                "diverged",
                f"loss {loss:.4g} at step {step} is above {self.factor:g} x its running minimum "
                f"{self.min_loss:.4g} (train.divergence_factor)",
                step,
            )
        self.min_loss = min(self.min_loss, loss)
        if grad_norm == 0.0 and lr > 0.0:
            self.zero_since = self.zero_since or step
        else:
            self.zero_since = None
        streak = 0 if self.zero_since is None else step - self.zero_since + 1
        if self.zero_grad_steps and streak >= self.zero_grad_steps:
            return Stop(
                "diverged",
                f"the gradient norm has been exactly 0 since step {self.zero_since} ({streak} steps, "
                f"train.zero_grad_steps) while the learning rate is {lr:.3g}",
                self.zero_since,
            )
        return None

    @property
    def suspicious(self) -> bool:
        """In a run of zero gradient norms: a checkpoint now could replace the last good one."""
        return self.zero_since is not None

    def state(self) -> dict:
        return {
            "min_loss": None if math.isinf(self.min_loss) else self.min_loss,
            "zero_since": self.zero_since,
        }

    def load(self, state: dict) -> None:
        self.min_loss = math.inf if state.get("min_loss") is None else state["min_loss"]
        self.zero_since = state.get("zero_since")
