"""``metrics.jsonl`` (one object per logged step and per eval), a progress line, ``summary.json``."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time


class MetricsWriter:
    def __init__(
        self, run_dir: pathlib.Path, total_steps: int, resume: bool, quiet: bool = False, enabled: bool = True
    ):
        """``enabled=False`` (processes other than the first of a multi-host run) writes nothing."""
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        quiet = quiet or not enabled
        if enabled and not resume and self.path.exists():
            self.path.unlink()
        self.total = total_steps
        self.quiet = quiet
        self.t0 = time.perf_counter()
        self.wall_offset = 0.0
        if resume and self.path.exists():
            rows = read_metrics(self.path)
            self.wall_offset = max((r.get("wall_s", 0.0) for r in rows), default=0.0)

    def wall(self) -> float:
        return self.wall_offset + time.perf_counter() - self.t0

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def progress(self, step: int, loss: float, tokens_per_s: float, step_time: float) -> None:
        if self.quiet:
            return
        tty = sys.stderr.isatty()
        if not tty and step % max(1, self.total // 20) and step != self.total:
            return  # writing to a log file: about 20 lines per run
        eta = (self.total - step) * step_time
        ppl = math.exp(min(loss, 50.0))
        line = (
            f"step {step}/{self.total}  loss {loss:.4f}  ppl {ppl:.1f}  "
            f"{tokens_per_s:,.0f} tok/s  ETA {eta:,.0f}s"
        )
        sys.stderr.write(f"\r{line}   " if tty else line + "\n")
        sys.stderr.flush()

    def end_progress(self) -> None:
        if not self.quiet and sys.stderr.isatty():
            sys.stderr.write("\n")


def read_metrics(path: pathlib.Path) -> list[dict]:
    rows = []
    for line in pathlib.Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def dedupe_by_step(rows: list[dict], key: str) -> list[dict]:
    """Rows holding ``key``, one per step (the last written wins: a resumed run rewrites the
    steps after its checkpoint)."""
    by_step = {}
    for r in rows:
        if key in r:
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]
