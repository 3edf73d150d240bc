"""``python -m train.compare RUN_DIR [RUN_DIR ...]``: final ppl, steps-to-target and
time-to-target of each run against the first run's final ppl (the paper's Table 3), with
reductions in %; ``compare.md`` and ``compare.png`` (eval ppl vs steps and vs wall-clock)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from train.errors import UserError
from train.metrics import dedupe_by_step, read_metrics


def load_run(run_dir: pathlib.Path) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"no metrics.jsonl in {run_dir}")
    evals = dedupe_by_step(read_metrics(path), "eval_ppl")
    if not evals:
        raise UserError(f"{run_dir} has no evaluation rows")
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    return {"name": run_dir.name, "dir": str(run_dir), "evals": evals, "summary": summary}


def reach(evals: list[dict], target: float) -> tuple[int | None, float | None]:
    for r in evals:
        if r["eval_ppl"] <= target:
            return r["step"], r["wall_s"]
    return None, None


def compare(run_dirs: list[pathlib.Path], out_dir: pathlib.Path | None = None) -> str:
    runs = [load_run(d) for d in run_dirs]
    base = runs[0]
    target = base["evals"][-1]["eval_ppl"]
    b_step, b_time = reach(base["evals"], target)
    lines = [
        f"Target: final eval ppl of `{base['name']}` = {target:.3f}",
        "",
        "| run | final ppl | steps to target | step reduction | time to target (s) | time reduction |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for run in runs:
        step, wall = reach(run["evals"], target)
        final = run["evals"][-1]["eval_ppl"]
        red_s = f"{100 * (1 - step / b_step):.1f}%" if step else "not reached"
        red_t = f"{100 * (1 - wall / b_time):.1f}%" if wall else "not reached"
        lines.append(
            f"| {run['name']} | {final:.3f} | {step if step else '-'} | {red_s} | "
            f"{f'{wall:.1f}' if wall else '-'} | {red_t} |"
        )
        rows.append(
            {"run": run["name"], "final_ppl": final, "steps_to_target": step, "time_to_target_s": wall}
        )
    text = "\n".join(lines) + "\n"
    out_dir = out_dir or run_dirs[0].parent
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.md").write_text(text)
    (out_dir / "compare.json").write_text(json.dumps({"target_ppl": target, "runs": rows}, indent=2))
    _plot(runs, target, out_dir / "compare.png")
    return text


def _plot(runs, target, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping compare.png")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.compare", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="where compare.md/png go")
    args = parser.parse_args(argv)
    try:
        print(compare(args.runs, args.out), end="")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
