"""Time whole training steps (forward, backward, optimizer update, ``apply_updates``; one jitted,
donated step as ``python -m train`` runs it) of a model preset with AdamW, vanilla GaLore and
MoARa Full, on random tokens: what the optimizer adds to a real step.

The optimizer states start at step 1 (no basis refresh inside the timed steps, which are far
fewer than the refresh gap). Medians of ``--steps`` steps after ``--warmup`` steps.

Usage:
  python benchmarks/train_step.py [--model llama2-350m] [--batch 512] [--micro-batch 128]
      [--seq-len 256] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from optimizer_step import _with_count

import moara_jax as mj
import models
from train.step import TrainState, make_train_step


def optimizers(r_base: int, block: int) -> dict[str, optax.GradientTransformation]:
    common = dict(r_base=r_base, update_proj_gap=200, svd="eigh")
    return {
        "adamw": mj.adamw(0.01),
        "galore_vanilla": mj.moara_adamw(0.01, decompose=False, rank_allocation=False, **common),
        "moara_full": mj.moara_adamw(0.01, block_size=block, **common),
    }


def time_steps(cfg, tx, batch: int, micro: int, seq_len: int, steps: int, warmup: int) -> float:
    """Median ms per training step."""
    # Built inside jit, so that no two state leaves share a buffer (the step donates them all).
    state = jax.jit(
        lambda key: (lambda p: TrainState(jnp.zeros([], jnp.int32), p, _with_count(tx.init(p), 1)))(
            models.init_params(cfg, key)
        )
    )(jax.random.PRNGKey(0))
    step = jax.jit(make_train_step(cfg, tx, batch // micro), donate_argnums=0)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq_len + 1), 0, cfg.vocab_size)
    for _ in range(warmup):
        state, metrics = step(state, tokens)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, tokens)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) * 1e3)
    if not bool(jnp.isfinite(metrics["loss"])):
        raise RuntimeError("non-finite loss")
    return statistics.median(times)


def add_step_arguments(parser: argparse.ArgumentParser, steps: int = 5, warmup: int = 2) -> None:
    """The shape of the timed training step (model, batch, micro-batch, sequence, rank, block)."""
    parser.add_argument("--model", default="llama2-350m")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--r-base", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(parser)
    parser.add_argument("--only", nargs="*", help="subset of optimizer names")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = models.get_config(args.model, param_dtype="bfloat16", dtype="bfloat16", remat="dots")
    result = {"model": args.model, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "ms": {}}
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
