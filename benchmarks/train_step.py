"""Time whole training steps (forward, backward, optimizer update, ``apply_updates``; one jitted,
donated step as ``python -m train`` runs it) of a model preset with AdamW, vanilla GaLore and
MoARa Full, on random tokens: what the optimizer adds to a real step.

The optimizer states start at step 1 (no basis refresh inside the timed steps, which are far
fewer than the refresh gap). Medians of ``--steps`` steps after ``--warmup`` steps.

``--remat``, ``--attention`` (``auto``: cuDNN's flash attention on a CUDA GPU, see
``models.attention_implementation``), ``--layers`` and ``--micro-batch`` vary the model's step;
``--xla-flag-sets`` adds named sets of ``train.xla_flags.GPU_FLAG_SETS`` to ``XLA_FLAGS`` (the
user's own flags win) before JAX starts its backend.

Usage:
  python benchmarks/train_step.py [--model llama2-350m] [--batch 512] [--micro-batch 128]
      [--seq-len 256] [--steps 5] [--remat dots] [--attention auto] [--layers preset]
      [--loss-chunk 0] [--xla-flag-sets SET ...] [--only NAME ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from _args import check_micro_batches, check_names, check_out, non_negative, positive
from optimizer_step import GAP, with_count

import moara_jax as mj
import models
from models.configs import REMAT_POLICIES
from train.step import TrainState, make_train_step


def optimizers(r_base: int, block: int) -> dict[str, optax.GradientTransformation]:
    common = dict(r_base=r_base, update_proj_gap=GAP, svd="eigh")
    return {
        "adamw": mj.adamw(0.01),
        "galore_vanilla": mj.moara_adamw(0.01, decompose=False, rank_allocation=False, **common),
        "moara_full": mj.moara_adamw(0.01, block_size=block, **common),
    }


def build_step(cfg, tx, batch: int, micro: int, seq_len: int, count: int = 1):
    """``(compiled step, state, tokens)``: the donated training step compiled ahead of time (one
    compilation, its memory analysis at hand), a state whose optimizer counters are ``count``
    (built inside jit, so that no two state leaves share a buffer: the step donates them all), and
    random tokens."""
    state = jax.jit(
        lambda key: (lambda p: TrainState(jnp.zeros([], jnp.int32), p, with_count(tx.init(p), count)))(
            models.init_params(cfg, key)
        )
    )(jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq_len + 1), 0, cfg.vocab_size)
    step = jax.jit(make_train_step(cfg, tx, batch // micro), donate_argnums=0)
    return step.lower(state, tokens).compile(), state, tokens


def median_ms(step, state, tokens, steps: int, warmup: int, before=None):
    """``(median ms per step, last state)`` of ``steps`` calls after ``warmup``; ``before(state)``, when
    given, rewrites the state before each call, outside the timing. Raises on a non-finite loss."""
    times = []
    for i in range(warmup + steps):
        if before is not None:
            state = jax.block_until_ready(before(state))
        t0 = time.perf_counter()
        state, metrics = step(state, tokens)
        jax.block_until_ready(state)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    if not bool(jnp.isfinite(metrics["loss"])):
        raise RuntimeError("non-finite loss")
    return statistics.median(times), state


def time_steps(cfg, tx, batch: int, micro: int, seq_len: int, steps: int, warmup: int) -> float:
    """Median ms per training step (no basis refresh: the counters start at 1)."""
    step, state, tokens = build_step(cfg, tx, batch, micro, seq_len)
    return median_ms(step, state, tokens, steps, warmup)[0]


def model_config(args: argparse.Namespace) -> models.ModelConfig:
    """The benchmarked model: ``--model`` in bf16 with ``--remat``, ``--attention``, ``--layers``,
    ``--loss-chunk`` and ``--vocab-size``."""
    overrides = dict(param_dtype="bfloat16", dtype="bfloat16", remat=args.remat, loss_chunk=args.loss_chunk)
    overrides["attention_impl"] = None if args.attention == "auto" else args.attention
    if args.layers != "preset":
        overrides["scan_layers"] = args.layers == "scanned"
    if args.vocab_size:
        overrides["vocab_size"] = args.vocab_size
    return models.get_config(args.model, **overrides)


def describe(cfg: models.ModelConfig) -> dict:
    """The settings of a benchmarked model that change its step time."""
    return {
        "model": cfg.name,
        "remat": cfg.remat,
        "scan_layers": cfg.scan_layers,
        "attention": models.attention_implementation(cfg),
        "loss_chunk": cfg.loss_chunk,
        "vocab_size": cfg.vocab_size,
        "params": models.param_count(cfg),
    }


def add_step_arguments(parser: argparse.ArgumentParser, steps: int = 5, warmup: int = 2) -> None:
    """The shape of the timed training step (model, batch, micro-batch, sequence, rank, block)."""
    parser.add_argument("--model", default="llama2-350m", choices=models.list_configs())
    parser.add_argument("--batch", type=positive, default=512)
    parser.add_argument("--micro-batch", type=positive, default=128)
    parser.add_argument("--seq-len", type=positive, default=256)
    parser.add_argument("--r-base", type=positive, default=256)
    parser.add_argument("--block-size", type=positive, default=32)
    parser.add_argument("--steps", type=positive, default=steps)
    parser.add_argument("--warmup", type=non_negative, default=warmup)
    parser.add_argument("--remat", default="dots", choices=REMAT_POLICIES)
    parser.add_argument(
        "--attention", default="auto", choices=("auto", "xla", "cudnn"), help="auto: cuDNN where it applies"
    )
    parser.add_argument("--layers", default="preset", choices=("preset", "scanned", "unrolled"))
    parser.add_argument(
        "--loss-chunk",
        type=non_negative,
        default=0,
        help="LM head and loss this many positions at a time (0: all)",
    )
    parser.add_argument("--vocab-size", type=positive, default=None, help="default: the preset's")
    parser.add_argument(
        "--xla-flag-sets", nargs="*", default=[], help="names of train.xla_flags.GPU_FLAG_SETS"
    )


def check_step_arguments(parser: argparse.ArgumentParser, args) -> None:
    """What ``add_step_arguments``' flags cannot check one by one, in argparse's one line."""
    from train.xla_flags import GPU_FLAG_SETS

    check_micro_batches(parser, args.batch, [args.micro_batch])
    check_names(parser, "--xla-flag-sets", args.xla_flag_sets, list(GPU_FLAG_SETS))


def compiled_peak_bytes(compiled) -> int:
    """XLA's peak device memory of a compiled program: arguments + outputs - donated + temporaries."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def apply_flag_sets(names: list[str]) -> list[str]:
    """Adds the named GPU flag sets to ``XLA_FLAGS`` (before JAX starts its backend); the flags added."""
    from train import xla_flags

    return xla_flags.apply(xla_flags.configured_flags(names, [], gpu=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(parser)
    parser.add_argument("--only", nargs="*", help="subset of optimizer names")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    check_step_arguments(parser, args)
    check_names(parser, "--only", args.only, list(optimizers(8, 8)))
    check_out(parser, args.out)
    apply_flag_sets(args.xla_flag_sets)
    cfg = model_config(args)
    result = {
        **describe(cfg),
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "ms": {},
    }
    for name, tx in optimizers(args.r_base, args.block_size).items():
        if args.only and name not in args.only:
            continue
        ms = time_steps(cfg, tx, args.batch, args.micro_batch, args.seq_len, args.steps, args.warmup)
        result["ms"][name] = ms
        print(f"{name:16s} {ms:9.2f} ms/step", flush=True)
    ms = result["ms"]
    if "moara_full" in ms and "galore_vanilla" in ms:
        result["moara_over_galore"] = ms["moara_full"] / ms["galore_vanilla"]
        print(f"MoARa / GaLore training step: {result['moara_over_galore']:.4f}")
    print(json.dumps({k: v for k, v in result.items() if k != "ms"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
