"""``python -m train --config FILE.yaml [--run-dir DIR] [--set key=value ...] [--resume]
[--print-config]``."""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shlex
import signal
import sys
import threading

from train import distributed
from train.arguments import add_config_arguments
from train.errors import EXIT_PREEMPTED, IOFault, UserError, cli


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m train",
        description="Pretrain a model from a run config with AdamW, GaLore or MoARa (or profile module "
        "alignment).",
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--run-dir", default=None, help="output directory (default runs/<config name>, several joined by -)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config, every key with its value (defaults included), and exit",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Several processes: a launcher that runs the trainer as its child (``train.distributed``)."""
    if distributed.multi_process() and not distributed.is_worker():
        return distributed.launch(sys.argv[1:] if argv is None else list(argv))
    if distributed.is_worker():
        distributed.use_launcher_stderr()
    status = train(argv)
    distributed.declare_exit(status)
    return status


def train(argv=None) -> int:
    """One process's run: its exit status (a ``UserError`` or ``IOFault`` is one line)."""
    args = parse_args(argv)
    stem = "-".join(pathlib.Path(c).stem for c in args.config)
    run_dir = pathlib.Path(args.run_dir or pathlib.Path("runs") / stem)

    def body() -> int:
        from train.config import check_writers, load_config
        from train.store import Interrupted

        cfg = load_config(args.config, args.overrides)
        if args.print_config:  # what the run would save as its config.yaml; nothing starts
            from train.config import to_dict
            from train.rundir import config_text

            print(config_text(to_dict(cfg)), end="")
            return 0
        check_writers(cfg.metrics.writers)
        _set_xla_flags(cfg, args.quiet)
        if distributed.multi_process():
            distributed.initialize()
        _check_attention(cfg)
        from train.loop import train_and_evaluate

        try:
            summary = train_and_evaluate(cfg, run_dir, resume=args.resume, quiet=args.quiet)
        except Interrupted as e:
            print(
                f"interrupted while building the token store ({e}): run the same command again",
                file=sys.stderr,
            )
            return EXIT_PREEMPTED
        except IOFault as e:
            raise e.with_note(f"once that is fixed, continue with: {_resume_command(argv)}") from None
        return _report(summary, run_dir)

    try:
        with _interrupt_ends_startup():
            return cli(body)
    except Exception as e:
        distributed.before_traceback(e)  # an unexpected runtime error may be a lost peer's doing
        raise


@contextlib.contextmanager
def _interrupt_ends_startup():
    """SIGINT ends the start-up at once, as SIGTERM does: nothing is saved before the first step,
    and Python's ``KeyboardInterrupt`` raised inside JAX's start-up (a callback, a C++ frame) can
    be swallowed or crash the process. The step loop then takes both signals over
    (``StopSignals``: save, exit 75), as a token store build does (exit 75)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _set_xla_flags(cfg, quiet: bool) -> None:
    """The config's XLA flags, before anything starts a JAX backend (XLA reads ``XLA_FLAGS`` once,
    when it starts)."""
    from train import xla_flags

    gpu = xla_flags.gpu_platform_expected()
    added = xla_flags.apply(xla_flags.configured_flags(cfg.xla.gpu_flag_sets, cfg.xla.flags, gpu))
    if added and not quiet:
        print(f"XLA flags added: {' '.join(added)}")


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


def _resume_command(argv) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", "train", *args, *([] if "--resume" in args else ["--resume"])])


def _interrupted(steps: int, checkpoint: int | None) -> str:
    """What an interrupted run kept: a stop saves the steps done, unless the gradient norm is
    exactly 0 then (such a checkpoint could replace the last good one; ``StepLoop.save``)."""
    if checkpoint == steps:
        return f"interrupted: the checkpoint of step {steps} was saved; continue with --resume"
    unsaved = f"interrupted after step {steps}, not saved: the gradient norm was exactly 0 there"
    if checkpoint is None:
        return f"{unsaved}, and no earlier checkpoint; --resume starts from step 0"
    return f"{unsaved}; --resume continues from the checkpoint of step {checkpoint}"


def _report(summary: dict, run_dir: pathlib.Path) -> int:
    if summary["status"] in ("nan", "diverged"):
        return 1
    ppl, at = summary["final_eval_ppl"], summary.get("final_eval_step")
    line = f"{summary['status']}: {summary['steps']} steps in {summary['wall_s']:.1f}s"
    if ppl is not None:  # an interrupted run's last evaluation may be steps before its end
        line += (
            f", final eval ppl {ppl:.2f}"
            if at in (None, summary["steps"])
            else f", eval ppl {ppl:.2f} at step {at}"
        )
    print(line)
    print(f"run dir: {run_dir}")
    if summary["status"] == "interrupted":
        print(_interrupted(summary["steps"], summary.get("last_checkpoint")), file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
