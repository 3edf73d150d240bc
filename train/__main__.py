"""``python -m train --config FILE.yaml [--run-dir DIR] [--set key=value ...] [--resume]``."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from train.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train",
        description="Pretrain a models config with AdamW, GaLore or MoARa (or profile module alignment).",
    )
    parser.add_argument(
        "--config",
        required=True,
        action="append",
        help="YAML run config (see configs/); repeat to layer files, later ones win",
    )
    parser.add_argument("--run-dir", default=None, help="output directory (default runs/<config name>)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key; the value is parsed as YAML",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    try:
        from train.config import load_config

        cfg = load_config(args.config, args.overrides)
        # Before anything starts a JAX backend: XLA reads XLA_FLAGS once, at that start.
        from train import xla_flags

        gpu = xla_flags.gpu_platform_expected()
        added = xla_flags.apply(xla_flags.configured_flags(cfg.xla.gpu_flag_sets, cfg.xla.flags, gpu))
        if added and not args.quiet:
            print(f"XLA flags added: {' '.join(added)}")
        if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("SLURM_JOB_ID"):
            import jax

            env = {
                k: int(os.environ[v])
                for k, v in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID"))
                if v in os.environ
            }
            jax.distributed.initialize(**env)
        _check_attention(cfg)
        from train.loop import train_and_evaluate

        stem = "-".join(pathlib.Path(c).stem for c in args.config)
        run_dir = pathlib.Path(args.run_dir or pathlib.Path("runs") / stem)
        summary = train_and_evaluate(cfg, run_dir, resume=args.resume, quiet=args.quiet)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as e:
        from train.store import Interrupted

        if not isinstance(e, Interrupted):
            raise
        print(
            f"interrupted while building the token store ({e}): run the same command again", file=sys.stderr
        )
        return EXIT_PREEMPTED
    if summary["status"] in ("nan", "diverged"):
        return 1
    ppl = summary["final_eval_ppl"]
    print(
        f"{summary['status']}: {summary['steps']} steps in {summary['wall_s']:.1f}s, final eval ppl {ppl:.2f}"
        if ppl is not None
        else f"{summary['status']}"
    )
    print(f"run dir: {run_dir}")
    if summary["status"] == "interrupted":
        print("interrupted: a checkpoint was saved; continue with --resume", file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


def _check_attention(cfg) -> None:
    """``attention_impl: cudnn`` runs on a CUDA GPU only: a one-line error elsewhere."""
    if cfg.model.overrides.get("attention_impl") != "cudnn":
        return
    from models.layers import default_platform

    platform = default_platform()
    if platform != "cuda":
        raise UserError(
            f"model.overrides.attention_impl: cudnn needs a CUDA GPU, but JAX runs on {platform}; "
            "leave it unset for cuDNN where it applies and XLA's attention elsewhere"
        )


if __name__ == "__main__":
    sys.exit(main())
