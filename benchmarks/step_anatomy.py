"""What one plain optimizer step compiles to: kernels, HBM traffic and scratch memory, per optimizer.

Compiles ``apply_updates(params, update(grads, state, params))`` (parameters and state donated) on
Llama 2 shapes in bf16, as a training step would run it, and reads the optimised HLO of the entry
computation, whose refresh is a conditional whose branch is not counted (a plain step's kernels):

- kernels: top-level fusions, custom calls and copies, each one launch on a GPU;
- HBM traffic: the sum over those kernels of the bytes of their operands and results (each buffer
  read or written once per kernel: an estimate, caches ignored);
- scratch: XLA's ``temp_size_in_bytes`` (buffers besides arguments and outputs, refresh branch
  included).

Nothing is run, so the figures do not vary from run to run. ``--target h100`` (``h200``) compiles
for an NVIDIA H100 (H200) without one (XLA's deviceless GPU compilation; needs the JAX CUDA plugin,
``pip install jax-cuda12-plugin==`` the installed JAX's version, and no GPU); ``--target local``
compiles for the default backend.
Without a device there is no autotuning, so GEMM tilings differ from a real run; fusion decisions
and buffer sizes do not depend on it.

Usage:
  python benchmarks/step_anatomy.py [--size 350m] [--target local|h100|h200] [--only NAME ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

# A deviceless CUDA compilation must not try to open a GPU (set before JAX is imported).
if any(t in sys.argv or f"--target={t}" in sys.argv for t in ("h100", "h200")):  # TARGETS' names
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import optax
from _args import check_names, check_out
from optimizer_step import SIZES, llama2_params, optimizers

# Facts of the GPUs XLA's deviceless compiler can target without one (GpuTargetConfig): the
# Hopper chip's, and each card's memory, bandwidth and L2. H100: the 80GB HBM3 SXM card
# (nvidia-smi: 81559 MiB; XLA's device memory is 565 MiB less). H200: the SXM card the device
# tool lends (nvidia-smi: 143771 MiB, taken here as 565 MiB less too; 60 MiB of L2 as PyTorch
# reported it there; the datasheet's 4.8 TB/s).
TARGETS = {
    "h100": {
        "description": "NVIDIA H100 80GB HBM3",
        "memory_bytes": 84929347584,
        "memory_bandwidth": 3352320000000,
        "l2_cache_size": 52428800,
    },
    "h200": {
        "description": "NVIDIA H200",
        "memory_bytes": (143771 - 565) * 2**20,
        "memory_bandwidth": 4800000000000,
        "l2_cache_size": 62914560,
    },
}

# The GpuTargetConfig of a target of ``TARGETS``. The cuDNN version is stated twice: jaxlib 0.11
# dropped ``dnn_version_info`` (its parser passes over it) and reads
# ``gpu_device_info.dnn_version``, which 0.10 has too. The CUDA runtime is the installed plugin's
# (``{cuda}``): 12.8 for jax-cuda12-plugin, 13.0 for jax-cuda13-plugin.
TARGET_CONFIG = """
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {memory_bandwidth}
  l2_cache_size: {l2_cache_size}
  clock_rate_ghz: 1.98
  device_memory_size: {memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  dnn_version: "9.7.0"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ {cuda} }}
device_description_str: "{description}"
"""


def target_config(target: str = "h100") -> str:
    """``TARGET_CONFIG`` for ``target`` and the CUDA plugin JAX has (its runtime's major version)."""
    import importlib.metadata

    try:
        importlib.metadata.version("jax-cuda13-plugin")
        cuda = "major: 13 minor: 0"
    except importlib.metadata.PackageNotFoundError:
        cuda = "major: 12 minor: 8"
    return TARGET_CONFIG.format(cuda=cuda, **TARGETS[target])


_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "f64": 8,
}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([\w\-]+)\((.*)$")
# Ops that launch nothing (views, bookkeeping) or whose work sits in a branch (the refresh).
_NO_KERNEL = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "conditional"}


def hlo_bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def entry_kernels(hlo_text: str) -> tuple[collections.Counter, int]:
    """Kernels by kind and estimated HBM bytes of the entry computation of optimised HLO text."""
    lines = hlo_text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    types: dict[str, str] = {}
    kinds: collections.Counter = collections.Counter()
    traffic = 0
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        name, type_text, op, rest = m.groups()
        types[name] = type_text
        if op in _NO_KERNEL:
            continue
        kind = op
        if op == "fusion":
            k = re.search(r'"kind":"(\w+)"', line) or re.search(r"kind=(\w+)", line)
            kind = f"fusion:{k.group(1) if k else '?'}"
        kinds[kind] += 1
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        traffic += hlo_bytes(type_text) + sum(hlo_bytes(types.get(o, "")) for o in operands)
    return kinds, traffic


def placement(target: str):
    """``(sharding or None, device label)`` for the compilation target."""
    if target == "local":
        device = jax.devices()[0]
        return None, getattr(device, "device_kind", str(device))
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(target), topology="1x1x1"
        )
    except (NotImplementedError, RuntimeError) as e:  # no CUDA plugin: "topology not implemented"
        sys.exit(
            f"error: --target {target} compiles with JAX's CUDA plugin ({e}): pip install "
            f"jax-cuda12-plugin=={jax.__version__} (no GPU is needed)"
        )
    mesh = topologies.make_mesh(topology, (1,), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return sharding, f"{TARGETS[target]['description']} (deviceless)"


def anatomy(tx: optax.GradientTransformation, params, sharding) -> dict:
    """Kernels, traffic and scratch of one plain step of ``tx`` on abstract ``params``."""
    state = jax.eval_shape(tx.init, params)

    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def spec(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    args = jax.tree.map(spec, (params, state, params))
    compiled = jax.jit(step, donate_argnums=(1, 2)).lower(*args).compile()
    kinds, traffic = entry_kernels(compiled.as_text())
    memory = compiled.memory_analysis()
    return {
        "kernels": sum(kinds.values()),
        "kernels_by_kind": dict(kinds),
        "hbm_traffic_gb": traffic / 1e9,
        "scratch_mib": memory.temp_size_in_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="350m", choices=sorted(SIZES))
    parser.add_argument("--target", default="local", choices=("local", *TARGETS))
    parser.add_argument("--only", nargs="*", help="subset of optimizer names")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    check_names(parser, "--only", args.only, list(optimizers(8, 8)))
    check_out(parser, args.out)
    hidden, inter, layers, r_base, block = SIZES[args.size]
    sharding, device = placement(args.target)
    params = jax.eval_shape(lambda: llama2_params(hidden, inter, layers))
    result = {"size": args.size, "device": device, "jax": jax.__version__, "target_matrices": 7 * layers}
    for name, tx in optimizers(r_base, block).items():
        if args.only and name not in args.only:
            continue
        result[name] = anatomy(tx, params, sharding)
        r = result[name]
        print(
            f"{name:24s} kernels {r['kernels']:5d}  HBM traffic {r['hbm_traffic_gb']:6.2f} GB  "
            f"scratch {r['scratch_mib']:8.1f} MiB",
            flush=True,
        )
    print(json.dumps({"device": device, "size": args.size}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
