"""The data pipeline at scale: how fast ``train.prepare`` tokenizes, how fast the training loader
delivers batches from a prepared store, and that training's memory and start-up do not grow with
the corpus.

Measures, on JSON-lines shards and a sentencepiece model (e.g. the English Wikipedia shards and
T5's ``spiece.model`` of this workplace's ``shared/data``):

1. prepare throughput (tokens/s, and per worker) for each ``--workers`` count, each into a fresh
   store (the last one is kept as the "all shards" store);
2. loader throughput: tokens/s delivered as ``(batch, seq_len + 1)`` int32 batches (grain index
   pipeline + reads from the memory-mapped shards) on one core, median of ``--repeats`` passes;
3. ``python -m train`` (a tiny model, a few steps) on a store of the first shard alone and on the
   store of all shards: the process's peak RSS and its start-up (``summary.json: startup``,
   everything before the first step but compilation).

Usage:
  python benchmarks/data_pipeline.py --shards 'shared/data/wikipedia_en_2015/train-*.jsonl.gz' \\
      --validation shared/data/wikipedia_en_2015/validation-00000.jsonl.gz \\
      --tokenizer shared/data/spiece.model [--workers 1,2] [--out result.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _args import check_files, check_out, positive  # noqa: E402  (this script's folder: sys.path[0])

from train import store as token_store  # noqa: E402
from train.config import DataSection  # noqa: E402
from train.data import Data  # noqa: E402
from train.rundir import RunDir  # noqa: E402

# Runs ``python -m train`` in this process and reports its peak RSS (the child's own, not the
# benchmark's) as the last line.
RSS = (
    "import resource, sys\n"
    "from train.__main__ import main\n"
    "code = main(sys.argv[1:])\n"
    "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    "sys.exit(code)\n"
)


def prepare(section: DataSection, directory: pathlib.Path, workers: int) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    plan = token_store.plan(section)
    t0 = time.perf_counter()
    manifest = token_store.build(directory, plan, workers, quiet=True)
    seconds = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    return {
        "workers": workers,
        "pieces": len(plan.pieces),
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_worker": tokens / seconds / workers,
    }


def loader(directory: pathlib.Path, batch: int, seq_len: int, batches: int, repeats: int) -> dict:
    data = Data(token_store.TokenStore(directory), seq_len + 1)
    rates = []
    for r in range(repeats):
        it = data.train_iterator(batch, seed=r)
        t0 = time.perf_counter()
        for _ in range(batches):
            rows = next(it)
        rates.append(batches * rows.size / (time.perf_counter() - t0))
    return {"batch": batch, "seq_len": seq_len, "batches": batches, "tokens_per_s": statistics.median(rates)}


def train_run(directory: pathlib.Path, tokenizer: str, run_dir: pathlib.Path, steps: int) -> dict:
    sets = {
        "data.source": "store",
        "data.store": str(directory),
        "data.tokenizer": tokenizer,
        "train.steps": steps,
        "train.batch_size": 8,
        "train.seq_len": 128,
        "train.eval_every": steps,
        "train.eval_batches": 1,
        "checkpoint.every": 0,
    }
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run_dir), "--quiet"]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RSS, *args], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    rss_kb = int(proc.stdout.strip().splitlines()[-1].split()[1])
    summary = RunDir(run_dir).summary()
    return {
        "train_tokens_in_store": summary["data"]["tokens"]["train"],
        "peak_rss_mb": rss_kb / 1024,
        "startup": summary["startup"],
        "process_wall_s": wall,
    }


def _counts(text: str) -> list[int]:
    """An argparse ``type``: comma-separated worker counts, each at least 1."""
    return [positive(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", required=True, help="glob of the train shards")
    parser.add_argument("--validation", required=True, help="the validation shard(s), comma-separated")
    parser.add_argument("--tokenizer", required=True, help="sentencepiece model (or 'bytes')")
    parser.add_argument("--workers", type=_counts, default="1,2", help="worker counts to time prepare with")
    parser.add_argument("--batch", type=positive, default=512)
    parser.add_argument("--seq-len", type=positive, default=256)
    parser.add_argument("--batches", type=positive, default=200)
    parser.add_argument("--repeats", type=positive, default=5)
    parser.add_argument("--train-steps", type=positive, default=20)
    parser.add_argument("--work-dir", default=None, help="where the stores go (default: a temporary dir)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    check_out(parser, args.out)
    shards = sorted(glob.glob(args.shards))
    if not shards:
        parser.error(f"--shards: no file matches {args.shards}")
    validation = args.validation.split(",")
    check_files(parser, validation + ([] if args.tokenizer == "bytes" else [args.tokenizer]))
    tokenizer = str(pathlib.Path(args.tokenizer).resolve()) if args.tokenizer != "bytes" else "bytes"
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="data_pipeline_"))
    section = DataSection(source="files", paths=shards, validation_paths=validation, tokenizer=tokenizer)
    result = {"cpus": os.cpu_count(), "shards": len(shards), "prepare": [], "python": sys.version.split()[0]}
    for w in args.workers:
        result["prepare"].append(prepare(section, work / "all", w))
        print(json.dumps(result["prepare"][-1]), flush=True)
    one = DataSection(source="files", paths=shards[:1], validation_paths=validation, tokenizer=tokenizer)
    prepare(one, work / "one", max(args.workers))
    result["loader"] = loader(work / "all", args.batch, args.seq_len, args.batches, args.repeats)
    print(json.dumps(result["loader"]), flush=True)
    result["train"] = {
        "one_shard": train_run(work / "one", tokenizer, work / "run_one", args.train_steps),
        "all_shards": train_run(work / "all", tokenizer, work / "run_all", args.train_steps),
    }
    runs = result["train"]
    result["train"]["peak_rss_difference_mb"] = (
        runs["all_shards"]["peak_rss_mb"] - runs["one_shard"]["peak_rss_mb"]
    )
    print(json.dumps(result["train"], indent=1), flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
