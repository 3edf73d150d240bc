"""Where the device time of one plain optimizer step goes: a profiler trace of the in-jit loop of
``optimizer_step.py`` (update + ``apply_updates``), summed per kernel name.

For each optimizer, ``--loop-steps`` plain steps run inside one jitted ``fori_loop`` under
``jax.profiler.trace``; the device plane's events (GPU kernels; on a CPU, where there is no device
plane, every event of the host plane, Python's included: a smoke check only) are grouped by name
and reported as total device time per step, the kernel count per step, and the largest kernels.
Kernel time summed is busy time: gaps between kernels (launch latency) are not in it, which is why
it can be less than the loop's wall time per step.

Usage:
  python benchmarks/kernel_profile.py [--size 350m] [--only moara_full_exact galore_vanilla_exact] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile

import jax
from _args import check_names, check_out, positive
from optimizer_step import SIZES, decaying_gradients, llama2_params, optimizers, plain_step_loop, with_count


def _device_plane(data):
    planes = list(data.planes)
    for plane in planes:
        if plane.name.startswith("/device:GPU") or plane.name.startswith("/device:TPU"):
            return plane
    return next((p for p in planes if p.name.startswith("/host:CPU")), None)


def kernel_times(tx, params, grads, steps: int, trace_dir: str) -> dict:
    """Per-name device time (ms per step) and launches per step of ``steps`` in-jit plain steps."""
    state = with_count(tx.init(params), 1)
    run = plain_step_loop(tx, steps)
    jax.block_until_ready(run(params, state, grads))  # compile and warm up outside the trace
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(run(params, state, grads))
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        raise RuntimeError(f"no xplane.pb written under {trace_dir}")
    plane = _device_plane(jax.profiler.ProfileData.from_file(files[-1]))
    if plane is None:
        raise RuntimeError("the trace holds no device plane")
    per_name: collections.Counter = collections.Counter()
    launches: collections.Counter = collections.Counter()
    lines = {}
    for line in plane.lines:
        lines[line.name] = sum(1 for _ in line.events)
    # Kernels sit on the stream lines; skip the derived lines (XLA Ops/Modules, step markers).
    skip = ("XLA Modules", "XLA Ops", "Steps", "Source", "XLA TraceMe", "TensorFlow Name Scope")
    for line in plane.lines:
        if plane.name.startswith("/device:") and any(line.name.startswith(s) for s in skip):
            continue
        for event in line.events:
            per_name[event.name] += event.duration_ns
            launches[event.name] += 1
    total = sum(per_name.values())
    return {
        "plane": plane.name,
        "lines": lines,
        "busy_ms_per_step": total / 1e6 / steps,
        "launches_per_step": sum(launches.values()) / steps,
        "kernels": [
            {"name": name, "ms_per_step": t / 1e6 / steps, "launches_per_step": launches[name] / steps}
            for name, t in per_name.most_common()
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="350m", choices=sorted(SIZES))
    parser.add_argument("--only", nargs="*", default=["moara_full_exact", "galore_vanilla_exact"])
    parser.add_argument("--loop-steps", type=positive, default=10)
    parser.add_argument("--top", type=positive, default=15)
    parser.add_argument("--stacked", action="store_true", help="one stacked leaf per module type")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    check_names(parser, "--only", args.only, list(optimizers(8, 8)))
    check_out(parser, args.out)
    hidden, inter, layers, r_base, block = SIZES[args.size]
    params = llama2_params(hidden, inter, layers, stacked=args.stacked)
    grads = decaying_gradients(params, r_base)
    txs = optimizers(r_base, block)
    result = {"size": args.size, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for name in args.only:
        with tempfile.TemporaryDirectory() as d:
            r = kernel_times(txs[name], params, grads, args.loop_steps, d)
        result[name] = r
        print(
            f"\n{name}: busy {r['busy_ms_per_step']:.3f} ms/step, "
            f"{r['launches_per_step']:.0f} launches/step ({r['plane']})"
        )
        for k in r["kernels"][: args.top]:
            print(f"  {k['ms_per_step']:8.3f} ms  x{k['launches_per_step']:6.1f}  {k['name'][:100]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
