"""Where the training loop's host time goes: ``python -m train`` in this process with each part of
the step loop's iterations timed on the host's clock.

An iteration runs from one step's dispatch to the next one's: the dispatch (``step_fn``: tracing
aside, the launch of the step's work), drawing the next batch (the grain iterator and its transfer
to the device), the wait for a step's metrics (``StepLoop.fetch``: one ``jax.device_get``), the
rest of reading them (the schedule's value, the divergence guard, logging) and whatever else the
loop does. Iterations that evaluate or save, and the two after them (whose reads follow the
evaluation's), are left out of the summary. Where the device is the bottleneck the waits hold the
time and the dispatch and the draw are short; a dispatch or a draw that takes about a step's time
says that the host cannot queue a step ahead, so that the device waits for the host's part of
every iteration (issue 22: on an H100, most steps that read their own metrics at once, the
evaluating ones, waited 0.6-5.5 ms for a 50 ms step).

  python benchmarks/loop_waits.py --out waits.json [--skip 3] -- --config FILE [--set k=v ...]

Everything after ``--`` is ``python -m train``'s command line. The JSON holds each part's median
and mean (``wait`` and ``read_rest`` together make the read) over the plain iterations after the
first ``--skip``, and each iteration's times.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ("dispatch", "draw", "read", "evaluate", "save")  # not nested: with "other", the period
SUMMARY = ("period", "dispatch", "draw", "wait", "read_rest", "other")


class Timings:
    """Each timed call: its part, the step the loop was at, its start and end."""

    def __init__(self):
        self.calls: list[tuple[str, int, float, float]] = []

    def wrap(self, part: str, fn, loop):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.append((part, loop.step, t0, time.perf_counter()))

        return timed

    def iterations(self) -> list[dict]:
        """One row per iteration (from a dispatch to the next): each part's milliseconds, and the
        rest of the iteration as ``other``."""
        starts = [(c[2], c[1] + 1) for c in self.calls if c[0] == "dispatch"]  # (time, step dispatched)
        rows = []
        for (t0, step), (t1, _) in zip(starts, starts[1:], strict=False):
            row = dict.fromkeys((*PARTS, "wait"), 0.0) | {"step": step, "period": (t1 - t0) * 1e3}
            for part, _, a, b in self.calls:
                if t0 <= a < t1:
                    row[part] += (b - a) * 1e3
            row["other"] = row["period"] - sum(row[p] for p in PARTS)
            row["read_rest"] = row["read"] - row["wait"]  # the wait happens inside the read
            rows.append(row)
        return rows


def summarize(rows: list[dict], skip: int) -> dict:
    """Medians and means of each part over the plain iterations after the first ``skip`` steps:
    neither evaluating nor saving, nor one of the two after such an iteration."""
    busy = {r["step"] for r in rows if r["evaluate"] or r["save"]}
    near = busy | {k + 1 for k in busy} | {k + 2 for k in busy}
    plain = [r for r in rows if r["step"] > skip and r["step"] not in near]
    out = {"plain_iterations": len(plain), "iterations": len(rows)}
    for part in SUMMARY:
        values = [r[part] for r in plain]
        out[f"{part}_ms"] = (
            {"median": statistics.median(values), "mean": statistics.fmean(values)} if values else None
        )
    return out


def instrument(timings: Timings) -> None:
    """Times the step loop's parts in every StepLoop made after this call."""
    from train import loop

    init = loop.StepLoop.__init__

    def timed_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.step_fn = timings.wrap("dispatch", self.step_fn, self)
        self.batches.next = timings.wrap("draw", self.batches.next, self)
        self.fetch = timings.wrap("wait", self.fetch, self)
        for part in ("read_metrics", "evaluate", "save"):
            setattr(self, part, timings.wrap(part.removesuffix("_metrics"), getattr(self, part), self))

    loop.StepLoop.__init__ = timed_init


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, train_argv = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--skip", type=int, default=3, help="iterations left out at the start (compilation)")
    args = parser.parse_args(ours)
    if not train_argv:
        parser.error("python -m train's arguments go after --")
    from train.__main__ import main as train_main

    timings = Timings()
    instrument(timings)
    code = train_main(train_argv)
    rows = timings.iterations()
    result = {"train_exit": code, "train_args": train_argv, "skip": args.skip, **summarize(rows, args.skip)}
    result["rows"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    parts = ", ".join(f"{p} {result[f'{p}_ms']['median']:.2f}" for p in SUMMARY if result[f"{p}_ms"])
    print(f"loop_waits: {result['plain_iterations']} plain iterations, median ms: {parts}")
    return code


if __name__ == "__main__":
    sys.exit(main())
