"""``python -m train.compare RUN_DIR [RUN_DIR ...] [--force]``: final ppl, steps-to-target and
time-to-target of each run against the first run's final ppl (the paper's Table 3), with
reductions in %; ``compare.md`` and ``compare.png`` (eval ppl vs steps and vs wall-clock).

Runs that did not complete (interrupted, diverged, NaN, still running), or whose tokenizer or
validation data differ from the first run's, are refused: their numbers do not compare.
``--force`` compares them anyway and marks them. Wall-clock figures from different devices, from
runs that overlapped in time (sharing the machine), or from resumed runs (each session's
compilation counted) are reported with a warning. A run is named by its directory's name, or
by as many of its last path parts as tell it from the others."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys

from train.errors import UserError, cli, io_operation
from train.plots import figure
from train.rundir import METRICS, SUMMARY, RunDir, check_directory_path, make_directory
from train.store.reading import tokenizer_key


def run_names(run_dirs: list[pathlib.Path]) -> list[str]:
    """Each run's name in the tables and the plot: its directory's name, or as many of its last
    path parts as tell it from the others (two sweeps' ``galore-seed0``); the same run given
    twice is refused."""
    resolved = [pathlib.Path(d).resolve() for d in run_dirs]
    for i, path in enumerate(resolved):
        if path in resolved[:i]:
            raise UserError(f"{run_dirs[i]} is given twice")
    given = [pathlib.Path(os.path.abspath(d)) for d in run_dirs]  # as typed: a link keeps its name
    depth = 1
    while True:
        names = ["/".join(p.parts[-depth:]) for p in given]
        if len(set(names)) == len(names) or depth >= max(len(p.parts) for p in given):
            return names
        depth += 1


def load_run(run_dir: pathlib.Path, name: str | None = None) -> dict:
    run = RunDir(run_dir)
    summary = run.summary()
    if summary is None and run.summary_file.is_file():
        raise UserError(f"{run.summary_file} is not a JSON object of a run's summary: the run dir is damaged")
    evals = eval_rows(run) if run.metrics_file.is_file() else []
    if not evals:
        status = (summary or {}).get("status")
        if status not in (None, "completed"):  # e.g. diverged at its first steps: nothing to compare
            why = (summary or {}).get("stop_reason")
            raise UserError(
                f"{run_dir}: the run stopped ({status}{f': {why}' if why else ''}) before its first "
                "evaluation: no eval ppl to compare, even with --force"
            )
        raise UserError(
            f"no {METRICS} in {run_dir}"
            if not run.metrics_file.is_file()
            else f"{run_dir} has no evaluation rows"
        )
    summary = summary or {}
    status = summary.get("status", f"running or killed (no {SUMMARY})")
    return {
        "name": name or run.name,
        "dir": str(run_dir),
        "evals": evals,
        "summary": summary,
        "status": status,
        "evaluation": evaluation(run, summary),
    }


def evaluation(run: RunDir, summary: dict | None = None) -> tuple[int, int] | None:
    """What the run's evaluations read, from its ``config.yaml``: ``(train.seq_len, windows)``,
    the windows being ``train.eval_batches x train.batch_size``, or the whole validation split's
    when it has fewer (from the tokens its ``summary`` records: windows of ``seq_len + 1``);
    ``None`` when the run dir holds no readable config."""
    try:
        t = run.config().get("train") or {}
    except UserError:
        return None
    values = (t.get("seq_len"), t.get("eval_batches"), t.get("batch_size"))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    seq_len, windows = values[0], values[1] * values[2]
    tokens = ((summary or {}).get("data") or {}).get("tokens", {}).get("validation")
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        windows = min(windows, tokens // (seq_len + 1))
    return seq_len, windows


def eval_rows(run: RunDir) -> list[dict]:
    """The run's evaluation rows (``RunDir.evals``), once every row of its ``metrics.jsonl`` is
    checked to be a JSON object and every evaluation row to give its step, eval ppl and wall-clock
    time as numbers: a damaged file is one line naming it, not a failure deep in the figures."""
    for row in run.rows(None):
        where = f"{run.metrics_file}: the row {json.dumps(row)[:100]}"
        for key in ("step", "eval_ppl", "wall_s") if "eval_ppl" in row else ():
            if isinstance(row.get(key), bool) or not isinstance(row.get(key), (int, float)):
                raise UserError(f"{where} has no number {key}: the run dir is damaged")
    return run.evals()


def _identity(key: str, value):
    """What decides whether two runs' data settings are the same: a tokenizer's identity (its
    kind, file hash, vocabulary and special tokens; not its file's name), a hash as it is."""
    if key == "tokenizer" and isinstance(value, dict):
        return tokenizer_key(value)
    return value


def problems(runs: list[dict]) -> tuple[list[str], list[str]]:
    """``(refusals, warnings)``: what makes the runs' numbers not comparable, and what makes
    their wall-clock times doubtful."""
    base = runs[0]["summary"].get("data", {})
    refusals, warnings = [], []
    for run in runs:
        if run["status"] != "completed":
            refusals.append(f"{run['name']} did not complete (status: {run['status']})")
        data = run["summary"].get("data", {})
        for key, what in (("tokenizer", "tokenizer"), ("validation_sha256", "validation data")):
            if key in base and key in data and _identity(key, data[key]) != _identity(key, base[key]):
                refusals.append(f"{run['name']} has another {what} than {runs[0]['name']}")
        mine, first = run.get("evaluation"), runs[0].get("evaluation")
        if mine and first and mine != first:
            refusals.append(
                f"{run['name']} evaluates other validation windows than {runs[0]['name']} (train.seq_len "
                f"{mine[0]} vs {first[0]}, windows {mine[1]} vs {first[1]}: train.eval_batches x "
                "batch_size, or the whole split where it holds fewer)"
            )
    kinds = {run["summary"].get("device_kind") for run in runs} - {None}
    if len(kinds) > 1:
        warnings.append(
            f"the runs ran on different devices ({', '.join(sorted(kinds))}): times differ by device"
        )
    for an, bn in overlaps(runs):
        warnings.append(f"{an} and {bn} ran at the same time: their wall-clock times may be contended")
    for run in runs:
        for resumed in run["summary"].get("changed_on_resume") or []:
            warnings.append(
                f"{run['name']} was resumed at step {resumed.get('step')} with other settings "
                f"({', '.join(resumed.get('changes', []))}): its steps before and after ran under each"
            )
        sessions = len(run["summary"].get("sessions", []))
        if sessions > 1:
            warnings.append(
                f"{run['name']} ran in {sessions} sessions (resumed): its wall-clock time counts each "
                "session's compilation (not its restore)"
            )
    return refusals, sorted(set(warnings))


def overlaps(runs: list[dict]) -> list[tuple[str, str]]:
    """The pairs of runs (by name, in the order given) of which a session of one overlapped a
    session of the other on the same machine (``summary["sessions"]``: ``[start, end, host]``)."""
    spans = [
        (s[0], s[1], s[2] if len(s) > 2 else None, run["name"])
        for run in runs
        for s in run["summary"].get("sessions", [])
    ]
    pairs = []
    for i, (a0, a1, ah, an) in enumerate(spans):
        for b0, b1, bh, bn in spans[i + 1 :]:
            if an != bn and a0 < b1 and b0 < a1 and (ah is None or bh is None or ah == bh):
                pairs.append((an, bn))
    return list(dict.fromkeys(pairs))


def reduction_pct(value: float, base: float) -> float:
    """How much less than ``base`` a step count or time ``value`` is, in percent of ``base``."""
    return 100 * (1 - value / base)


def reach(evals: list[dict], target: float) -> tuple[int | None, float | None]:
    for r in evals:
        if r["eval_ppl"] <= target:
            return r["step"], r["wall_s"]
    return None, None


def compare(run_dirs: list[pathlib.Path], out_dir: pathlib.Path | None = None, force: bool = False) -> str:
    runs = [load_run(d, name) for d, name in zip(run_dirs, run_names(run_dirs), strict=True)]
    refusals, warnings = problems(runs)
    if refusals and not force:
        raise UserError(
            "these runs do not compare: " + "; ".join(refusals) + " (--force compares them anyway)"
        )
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    base = runs[0]
    target = base["evals"][-1]["eval_ppl"]
    b_step, b_time = reach(base["evals"], target)
    lines = [
        f"Target: final eval ppl of `{base['name']}` = {target:.3f}",
        "",
        "| run | status | final ppl | steps to target | step reduction | time to target (s) "
        "| time reduction |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for run in runs:
        step, wall = reach(run["evals"], target)
        final = run["evals"][-1]["eval_ppl"]
        red_s = f"{reduction_pct(step, b_step):.1f}%" if step else "not reached"
        red_t = f"{reduction_pct(wall, b_time):.1f}%" if wall else "not reached"
        lines.append(
            f"| {run['name']} | {run['status']} | {final:.3f} | {step if step else '-'} | {red_s} | "
            f"{f'{wall:.1f}' if wall else '-'} | {red_t} |"
        )
        rows.append(
            {
                "run": run["name"],
                "status": run["status"],
                "final_ppl": final,
                "steps_to_target": step,
                "time_to_target_s": wall,
            }
        )
    notes = [f"- not comparable (--force): {r}" for r in refusals] + [f"- warning: {w}" for w in warnings]
    text = "\n".join(lines + ([""] + notes if notes else [])) + "\n"
    out_dir = out_dir or run_dirs[0].parent
    report = {"target_ppl": target, "runs": rows, "not_comparable": refusals, "warnings": warnings}
    make_directory(out_dir, "--out", "making the comparison's directory")
    with io_operation("writing the comparison to", out_dir):
        (out_dir / "compare.md").write_text(text)
        (out_dir / "compare.json").write_text(json.dumps(report, indent=2))
        _plot(runs, target, out_dir / "compare.png")
    return text


def _plot(runs, target, path) -> None:
    fig = figure("compare.png", figsize=(11, 4))
    if fig is None:
        return
    axes = fig.subplots(1, 2)
    for run in runs:
        steps = [r["step"] for r in run["evals"]]
        walls = [r["wall_s"] for r in run["evals"]]
        ppl = [r["eval_ppl"] for r in run["evals"]]
        axes[0].plot(steps, ppl, label=run["name"])
        axes[1].plot(walls, ppl, label=run["name"])
    for ax, xlabel in zip(axes, ("step", "wall-clock (s)"), strict=True):
        ax.axhline(target, ls="--", color="gray")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval ppl")
        ax.set_yscale("log")
        ax.legend()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.compare",
        description="Final ppl, steps and time to target of each run against the first run's final ppl "
        "(the paper's Table 3), with reductions in %: compare.md, compare.json and compare.png.",
    )
    parser.add_argument(
        "runs",
        nargs="+",
        type=pathlib.Path,
        help="run dirs; the first is the baseline, whose final ppl is the target",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="where compare.md, compare.json and compare.png go (default: the first run's parent dir)",
    )
    parser.add_argument("--force", action="store_true", help="compare runs that do not compare, marked")
    args = parser.parse_args(argv)

    def body() -> int:
        # The first directory of --out that is not there yet: one a refusal then leaves as it was.
        made = [p for p in ([args.out, *args.out.parents] if args.out is not None else []) if not p.exists()]
        if args.out is not None:  # refused before the runs are read and their warnings given
            check_directory_path(args.out, "--out")
            make_directory(args.out, "--out", "making the comparison's directory")
        try:
            text = compare(args.runs, args.out, args.force)
        except UserError:
            if made and not any(p.is_file() for p in made[-1].rglob("*")):
                shutil.rmtree(made[-1])
            raise
        print(text, end="")
        return 0

    return cli(body)


if __name__ == "__main__":
    sys.exit(main())
