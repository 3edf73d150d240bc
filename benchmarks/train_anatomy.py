"""What a whole training step compiles to: memory against the device, kernels, launches and
whether cuDNN attention lowered, per remat policy, layer layout, attention, micro-batch size and
the loss's chunk of positions.

Compiles ``python -m train``'s step (``train.step.make_train_step``: forward and backward over the
micro-batches with gradients accumulated in a ``lax.scan``, the optimizer update and
``apply_updates``, the state donated) of a Llama 2 preset in bf16 on a global batch of
``--batch`` sequences of ``--seq-len`` tokens, and reads the compiled program:

- memory: XLA's memory analysis of the compiled step: arguments (parameters, optimizer state,
  tokens), outputs, the bytes outputs share with donated arguments, and temporaries (activations
  kept for the backward pass, gradients, the accumulator, the refresh branch's scratch). The peak is
  arguments + outputs - aliased + temporaries: what the step holds at once, against the target
  card's memory (the H100's 80 GB: 79.1 GiB; the H200's: 139.8 GiB) and against JAX's pool of it
  (deviceless: the 75% JAX's allocator takes by default; on a local GPU: the pool it has);
- kernels: launching instructions of the program (fusions, library and custom calls, copies) in
  the entry computation and the loops and branches it runs, each counted once; launches: those
  weighted by the loops' trip counts (the micro-batch scan, the layer scan), taking at each
  conditional the branch with fewest kernels (a plain step, not a basis refresh);
- cudnn: the cuDNN custom calls in the program (``__cudnn$fmhaSoftmax`` forward and
  ``...Backward``): flash attention lowered.

These are compile-time figures, not measurements of a run. ``--target h100`` (``h200``) compiles
for an NVIDIA H100 (H200) without one (XLA's deviceless GPU compilation, as ``step_anatomy.py``;
its memory also sets XLA's own rematerialisation target; needs the JAX
CUDA plugin, no GPU). Without a device there is no autotuning and cuDNN builds no graph (its
workspace is not in the figures); buffer sizes and fusion do not depend on either.

Usage:
  python benchmarks/train_anatomy.py --target h100|h200 [--models llama2-350m llama2-1b]
      [--remat none dots full] [--layers scanned unrolled] [--attention xla cudnn]
      [--micro-batch 128] [--loss-chunk 0 32] [--optimizer moara_full] [--profile-every N]
      [--xla-flag-sets SET ...]
      [--out FILE.json]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import sys
import time

# A deviceless CUDA compilation must not try to open a GPU (set before JAX is imported).
if any(t in sys.argv or f"--target={t}" in sys.argv for t in ("h100", "h200")):  # step_anatomy.TARGETS
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from _args import check_micro_batches, check_names, check_out, non_negative, positive
from step_anatomy import TARGETS, placement
from train_step import apply_flag_sets, compiled_peak_bytes, optimizers

import models
from train.step import TrainState, make_train_step
from train.xla_flags import GPU_FLAG_SETS

JAX_DEFAULT_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([\w\-]+)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) ")
# Instructions that launch nothing: views, bookkeeping, the ends of asynchronous pairs.
_NO_KERNEL = {
    "parameter",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "constant",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "domain",
}


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Instruction lines of each computation of HLO text, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.split("\n"):
        if current is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{"):
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
        elif line.startswith("}"):
            current = None
        else:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _called(line: str, key: str) -> list[str]:
    m = re.search(key + r"=\{([^}]*)\}", line) or re.search(key + r"=(%[\w.\-]+)", line)
    return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


def program_kernels(hlo_text: str) -> dict:
    """Kernels (each launching instruction once), launches per plain step (trip-count weighted, the
    smallest branch of each conditional), the same with the largest branches, kernel kinds, and the
    cuDNN custom-call targets of optimised HLO text."""
    comps, entry = _computations(hlo_text)
    kinds: collections.Counter = collections.Counter()
    seen: set[str] = set()
    unknown_trips = 0

    def walk(name: str) -> tuple[int, int]:
        """(launches with smallest branches, with largest branches) of one run of ``name``."""
        nonlocal unknown_trips
        first = name not in seen
        seen.add(name)
        low = high = 0
        for line in comps[name]:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(3)
            if op in _NO_KERNEL or op.endswith("-done"):
                continue
            if op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                n = int(trip.group(1)) if trip else 1
                unknown_trips += trip is None
                body_lo, body_hi = walk(_called(line, "body")[0])
                cond_lo, cond_hi = walk(_called(line, "condition")[0])
                low += n * body_lo + (n + 1) * cond_lo
                high += n * body_hi + (n + 1) * cond_hi
            elif op == "conditional":
                branches = _called(line, "branch_computations") or (
                    _called(line, "true_computation") + _called(line, "false_computation")
                )
                runs = [walk(b) for b in branches]
                low += min(r[0] for r in runs)
                high += max(r[1] for r in runs)
            elif op == "call":
                lo, hi = walk(_called(line, "to_apply")[0])
                low, high = low + lo, high + hi
            else:
                if first:
                    kind = op
                    if op == "fusion":
                        k = re.search(r'"kind":"(\w+)"', line) or re.search(r"kind=(\w+)", line)
                        kind = f"fusion:{k.group(1) if k else '?'}"
                    kinds[kind] += 1
                low += 1
                high += 1
        return low, high

    low, high = walk(entry)
    cudnn = sorted(set(re.findall(r'custom_call_target="(__cudnn[^"]*)"', hlo_text)))
    return {
        "kernels": sum(kinds.values()),
        "launches_plain_step": low,
        "launches_largest_branches": high,
        "loops_without_trip_count": unknown_trips,
        "kernels_by_kind": dict(kinds),
        "cudnn_calls": cudnn,
    }


def abstract_state(cfg: models.ModelConfig, tx, sharding) -> TrainState:
    """The train state of ``cfg`` under ``tx`` as ``ShapeDtypeStruct``s (nothing allocated)."""
    params = models.abstract_params(cfg)
    state = TrainState(jax.ShapeDtypeStruct([], jnp.int32), params, jax.eval_shape(tx.init, params))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def anatomy(
    cfg: models.ModelConfig,
    tx,
    batch: int,
    micro_batch: int,
    seq_len: int,
    sharding,
    memory: tuple[int | None, int | None],
    profile_every: int = 0,
    block_size: int | None = None,
) -> dict:
    """Memory, kernels and cuDNN calls of the compiled, donated training step of ``cfg``, its
    peak against ``memory``: the card's bytes and those of JAX's pool (``device_memory``).
    ``profile_every``: a profiling run's step, measuring the alignment (of ``block_size`` blocks)
    every that many steps (0: a training step)."""
    state = abstract_state(cfg, tx, sharding)
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32, sharding=sharding)
    profiling = dict(with_alignment=True, alignment_every=profile_every, alignment_block=block_size)
    train_step = make_train_step(cfg, tx, batch // micro_batch, **(profiling if profile_every else {}))
    step = jax.jit(train_step, donate_argnums=0)
    t0 = time.perf_counter()
    compiled = step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    peak = compiled_peak_bytes(compiled)
    return {
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
        "peak_bytes": peak,
        "fits_device": None if memory[0] is None else peak <= memory[0],
        "fits_jax_pool": None if memory[1] is None else peak <= memory[1],
        "compile_s": compile_s,
        **program_kernels(compiled.as_text()),
    }


def device_memory(target: str) -> tuple[int | None, int | None]:
    """``(card, pool)``: the bytes of ``target``'s card and of the pool JAX's allocator takes of
    it: a deviceless target's memory and JAX's default 75% of it; on the local device, the pool
    its allocator has (``bytes_limit``: the fraction in effect, the card unknown); None where a
    device does not say (a CPU)."""
    if target in TARGETS:
        card = TARGETS[target]["memory_bytes"]
        return card, int(JAX_DEFAULT_MEM_FRACTION * card)
    stats = jax.devices()[0].memory_stats() or {}
    return None, stats.get("bytes_limit")


def yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| model | remat | layers | attention | micro-batch | loss chunk | peak (GiB) | temp (GiB) | "
        "fits the card | fits JAX's pool | kernels | launches/step | cuDNN calls |",
        "|---|---|---|---|---:|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for r in rows:
        cudnn = ", ".join(c.replace("__cudnn$", "") for c in r["cudnn_calls"]) or "none"
        lines.append(
            f"| {r['model']} | {r['remat']} | {r['layers']} | {r['attention']} | {r['micro_batch']} | "
            f"{r.get('loss_chunk', 0) or 'none'} | "
            f"{r['peak_bytes'] / 2**30:.1f} | {r['temp_bytes'] / 2**30:.1f} | "
            f"{yes_no(r['fits_device'])} | {yes_no(r['fits_jax_pool'])} | "
            f"{r['kernels']} | {r['launches_plain_step']} | {cudnn} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="local", choices=("local", *TARGETS))
    parser.add_argument("--models", nargs="+", default=["llama2-350m", "llama2-1b"])
    parser.add_argument("--remat", nargs="+", default=["none", "dots", "full"])
    parser.add_argument(
        "--layers", nargs="+", default=["scanned", "unrolled"], choices=("scanned", "unrolled")
    )
    parser.add_argument("--attention", nargs="+", default=["xla", "cudnn"], choices=("xla", "cudnn"))
    parser.add_argument("--micro-batch", nargs="+", type=positive, default=[128])
    parser.add_argument(
        "--loss-chunk",
        nargs="+",
        type=non_negative,
        default=[0],
        help="positions per chunk of the loss (0: none)",
    )
    parser.add_argument("--batch", type=positive, default=512)
    parser.add_argument("--seq-len", type=positive, default=256)
    parser.add_argument("--vocab-size", type=positive, default=None, help="default: the preset's (32000)")
    parser.add_argument(
        "--optimizer", default="moara_full", choices=("adamw", "galore_vanilla", "moara_full")
    )
    parser.add_argument(
        "--profile-every",
        type=non_negative,
        default=0,
        help="compile a profiling run's step, measuring the alignment every N steps (0: training)",
    )
    parser.add_argument("--xla-flag-sets", nargs="*", default=[], help="train.xla_flags.GPU_FLAG_SETS names")
    parser.add_argument("--out", default=None, help="JSON path (rewritten after every compile)")
    args = parser.parse_args()
    check_micro_batches(parser, args.batch, args.micro_batch)
    check_names(parser, "--xla-flag-sets", args.xla_flag_sets, list(GPU_FLAG_SETS))
    check_out(parser, args.out)
    apply_flag_sets(args.xla_flag_sets)  # before the backend starts

    sharding, device = placement(args.target)
    memory = device_memory(args.target)
    tx, block = optimizers(256, 32)[args.optimizer], (32 if args.optimizer == "moara_full" else None)
    result = {
        "device": device,
        "device_memory_bytes": memory[0],
        "jax_pool_bytes": memory[1],
        "jax": jax.__version__,
        "optimizer": args.optimizer,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "profile_every": args.profile_every,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "note": "compile-time figures (XLA memory analysis of the compiled step), not measurements",
        "rows": [],
    }
    grid = itertools.product(
        args.models, args.remat, args.layers, args.attention, args.micro_batch, args.loss_chunk
    )
    for name, remat, layers, attention, micro, chunk in grid:
        overrides = dict(
            param_dtype="bfloat16", dtype="bfloat16", remat=remat, attention_impl=attention, loss_chunk=chunk
        )
        if args.vocab_size:
            overrides["vocab_size"] = args.vocab_size
        cfg = models.get_config(name, scan_layers=layers == "scanned", **overrides)
        row = dict(
            model=name, remat=remat, layers=layers, attention=attention, micro_batch=micro, loss_chunk=chunk
        )
        try:
            shape = (args.batch, micro, args.seq_len)
            row |= anatomy(cfg, tx, *shape, sharding, memory, args.profile_every, block)
        except Exception as e:  # a configuration XLA cannot compile is a result too
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            continue
        result["rows"].append(row)
        print(
            f"{name} remat={remat} {layers} {attention} micro={micro} loss_chunk={chunk}: "
            f"peak {row['peak_bytes'] / 2**30:.2f} GiB "
            f"(temp {row['temp_bytes'] / 2**30:.2f}), kernels {row['kernels']}, launches "
            f"{row['launches_plain_step']}, cudnn {row['cudnn_calls']}, compile {row['compile_s']:.0f}s",
            flush=True,
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    print(table([r for r in result["rows"] if "error" not in r]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
