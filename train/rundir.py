"""A run directory's bookkeeping: one writer at a time (a lock), the summary (a failed attempt
never overwrites a completed run's), the training-curve plot and the start-up banner."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import socket

from train.errors import UserError
from train.metrics import dedupe_by_step, read_metrics
from train.plots import pyplot

LOCK = ".lock"


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/.lock`` held for the run's life. The kernel releases
    it when the process ends, however it ends, so a lock left by a dead process never blocks;
    the file names the holder (pid, host) for the error a second process gets."""

    def __init__(self, run_dir: pathlib.Path):
        self.path = run_dir / LOCK
        self.file = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open until release
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise UserError(
                f"run dir {self.path.parent} is in use by {holder}; wait for it to end or choose "
                "another --run-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on host {socket.gethostname()}")
        f.flush()
        self.file = f
        return self

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing the descriptor releases the flock
            self.file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def recorded_tokenizer(run_dir: pathlib.Path) -> dict | None:
    """The tokenizer identity a run's ``summary.json`` records (None without one)."""
    path = pathlib.Path(run_dir) / "summary.json"
    return json.loads(path.read_text()).get("data", {}).get("tokenizer") if path.is_file() else None


def write_summary(run_dir: pathlib.Path, summary: dict) -> pathlib.Path:
    """``summary.json``, unless it records a completed run and this attempt did not complete:
    then ``summary.STATUS.json`` beside it (the completed record is kept)."""
    path = run_dir / "summary.json"
    if summary["status"] != "completed" and path.is_file():
        try:
            previous = json.loads(path.read_text()).get("status")
        except ValueError:
            previous = None
        if previous == "completed":
            path = run_dir / f"summary.{summary['status']}.json"
    path.write_text(json.dumps(summary, indent=2, default=str))
    return path


def plot_curves(run_dir: pathlib.Path) -> pathlib.Path | None:
    """``curves.png``: training loss and eval ppl against step (when matplotlib is installed)."""
    plt = pyplot("curves.png", quiet=True)
    if plt is None:
        return None
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    train, evals = dedupe_by_step(rows, "loss"), dedupe_by_step(rows, "eval_ppl")
    if not train:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train])
    axes[0].set_ylabel("training loss")
    if evals:
        axes[1].plot([r["step"] for r in evals], [r["eval_ppl"] for r in evals], marker="o")
        axes[1].set_yscale("log")
    axes[1].set_ylabel("eval ppl")
    for ax in axes:
        ax.set_xlabel("step")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    path = run_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def banner(
    *,
    model: str,
    params: int,
    embedding_params: int,
    optimizer: str,
    ranks: dict | None,
    data: str,
    tokens_per_step: int,
    run_dir: pathlib.Path,
) -> list[str]:
    """The lines printed when a run starts (a warning when the embedding and LM head hold most
    of the parameters: the step's cost is then mostly theirs, not the blocks')."""
    share = embedding_params / params
    lines = [
        f"model: {model}, {params:,} parameters ({share:.0%} in the embedding and LM head)",
        f"optimizer: {optimizer}" + (f", ranks {ranks}" if ranks else ""),
        data,
        f"tokens per step: {tokens_per_step:,}; run dir: {run_dir}",
    ]
    if share > 0.5:
        lines.append(
            f"warning: the embedding and LM head hold {share:.0%} of the parameters, so they dominate "
            "the step's time and memory (a small model with a large vocabulary); a smaller "
            "tokenizer or a larger model spends the compute on the blocks"
        )
    return lines
