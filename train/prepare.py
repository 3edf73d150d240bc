"""``python -m train.prepare``: tokenize a data section's text once, in parallel, into a token
store that every later run reads (``python -m train`` builds it itself when it is missing; this
command does it ahead of time, e.g. on a CPU machine before a GPU job).

    python -m train.prepare --config configs/paper/llama2-350m.yaml \\
        --set data.source=files --set "data.paths=[c4/c4-train.000*-of-01024.json.gz]" \\
        --set data.tokenizer=spiece.model [--out DIR] [--workers N]

``data.paths`` and ``data.validation_paths`` entries may be globs. Without ``--out`` the store
goes to ``data.store`` or to the cache entry that ``python -m train`` looks up for the same
data section. Run the same command again after an interruption: completed shards are kept.
``--verify`` then reads every shard of the store and checks it against the sha256 its manifest
recorded when it was built (a run checks the shards' sizes, and the tokens it reads).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from train.arguments import add_config_arguments
from train.errors import EXIT_PREEMPTED, IOFault, UserError, cli
from train.rundir import check_directory_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.prepare",
        description="Tokenize a run config's data section once, in parallel, into the token store its "
        "runs read (python -m train builds it itself when it is missing; this builds it ahead of time, "
        "e.g. on a CPU machine before a GPU job).",
    )
    add_config_arguments(parser, required=False)
    parser.add_argument("--out", default=None, help="store directory (default: data.store or the cache)")
    parser.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: all cores)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="then read every shard and check it against the sha256 the manifest recorded "
        "(with data.source store: the store data.store names)",
    )
    args = parser.parse_args(argv)
    from train import store
    from train.config import load_config

    def body() -> int:
        if args.workers is not None and args.workers < 1:
            raise UserError(f"--workers must be >= 1, got {args.workers}")
        cfg = load_config(args.config, args.overrides).data
        if cfg.source == "store" and not args.verify:
            raise UserError(
                "data.source is store: there is nothing to prepare (give files, tfds or builtin, "
                "or --verify to check the store)"
            )
        if args.out is not None:
            check_directory_path(pathlib.Path(args.out), "--out")
        t0 = time.perf_counter()
        try:
            opened = store.open_store(cfg, quiet=args.quiet, out=args.out, workers=args.workers)
        except IOFault as e:
            raise e.with_note("once that is fixed, run the same command again to continue") from None
        except store.Interrupted as e:
            print(
                f"interrupted ({e}): completed shards are kept; run the same command again to continue",
                file=sys.stderr,
            )
            return EXIT_PREEMPTED
        report(opened, time.perf_counter() - t0)
        if args.verify:
            t0 = time.perf_counter()
            read = opened.verify(args.workers or store.default_workers())
            shards = sum(len(s["shards"]) for s in opened.manifest["splits"].values())
            print(
                f"verified: {shards} shards ({read / 2**20:,.1f} MiB) match the manifest's sha256; "
                f"{time.perf_counter() - t0:.1f}s"
            )
        return 0

    return cli(body)


def report(opened, seconds: float) -> None:
    splits = opened.manifest["splits"]
    counts = ", ".join(f"{n} {s['documents']:,} documents {s['tokens']:,} tokens" for n, s in splits.items())
    skipped = json.dumps(opened.manifest["skipped"])
    print(f"token store {opened.directory}: {counts}; skipped {skipped}; {seconds:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
