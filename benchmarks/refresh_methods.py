"""Time and check ways of computing the projection bases of one refresh (all target matrices of a
Llama 2 model at once), in JAX and, where torch and galore-torch are importable, in PyTorch.

Usage:
  python benchmarks/refresh_methods.py [--size 350m] [--methods NAME ...] [--out FILE.json]
  python benchmarks/refresh_methods.py --spread [--size 60m] [--methods NAME ...] [--repeats 0]

``--spread`` compares, on all local devices, ``moara_jax``'s refresh (``top_basis`` per group)
with every device factoring every matrix (no context mesh: how the refresh ran before) against
the refresh spread over the devices (under ``jax.set_mesh``; ``moara_jax._bases.spread``), for
gradients replicated on every device (data parallel) and sharded over them (FSDP), side by side
in one process: times and XLA's scratch memory per device. The randomized refresh, which
``moara_jax`` does not spread, is run through ``spread`` to show why. On a CPU, fake devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) share the machine's cores: the spread
saves what the devices would have repeated. ``--repeats 0`` compiles only (the memory).

Each JAX method computes, for every target matrix, the top-r singular vectors of the side GaLore
projects (r as MoARa allocates: q/k r/2, down 2r, others r), batching same-shaped matrices.
Accuracy is the largest principal angle (degrees) between a method's subspace and a float64
NumPy reference, on the first two matrices of each shape. ``torch_galore_projector`` is
galore-torch's own ``GaLoreProjector.project`` on each matrix in turn (one ``torch.linalg.svd``
each), the reference figure the issue quotes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import check_names, check_out, positive  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from optimizer_step import SIZES  # noqa: E402

from moara_jax import _bases, _projection  # noqa: E402

HI = jax.lax.Precision.HIGHEST


def shape_groups(size: str, layers: int | None = None) -> list[tuple[int, tuple[int, int], int]]:
    """(count, Flax kernel shape, rank) per group of same-shaped target matrices (of ``layers``
    layers, or the size's)."""
    hidden, inter, size_layers, r_base, _ = SIZES[size]
    layers = layers or size_layers
    return [
        (4 * layers, (hidden, hidden), r_base),  # q k v o (q/k use r/2: nested in the top r)
        (2 * layers, (hidden, inter), r_base),  # gate up
        (layers, (inter, hidden), 2 * r_base),  # down
    ]


def decaying(key, count: int, shape: tuple[int, int], r_base: int) -> jax.Array:
    """Float32 matrices with singular values ~ exp(-i / r_base) and a small noise floor."""
    m, n = shape
    k = min(m, n)
    k1, k2, k3 = jax.random.split(key, 3)
    s = jnp.exp(-jnp.arange(k) / r_base)
    x = jax.random.normal(k1, (count, m, k)) / jnp.sqrt(m)
    y = jax.random.normal(k2, (count, k, n)) / jnp.sqrt(n)
    return (x * s) @ y + 1e-3 * jax.random.normal(k3, (count, m, n))


def _side_first(g: jax.Array) -> jax.Array:
    """The matrix with the projected side as rows: (..., d, e)."""
    side = _projection.projection_side(g.shape)
    return g if side == "in" else jnp.swapaxes(g, -1, -2)


def _top_basis(svd: str):
    """``moara_jax``'s basis of a group by ``svd`` (what a refresh computes)."""

    def fn(g, r, key):
        return _bases.top_basis(g, _projection.projection_side(g.shape), r, svd, key)

    return fn


def _svd_left(algorithm):
    def fn(g, r, key):
        a = _side_first(g)
        u, _, _ = jax.lax.linalg.svd(a, full_matrices=False, algorithm=algorithm)
        return u[..., :r]

    return fn


def _gram_eigh(implementation):
    def fn(g, r, key):
        a = _side_first(g)
        gram = jnp.einsum("...ij,...kj->...ik", a, a, precision=HI)
        vecs, _ = jax.lax.linalg.eigh(gram, implementation=implementation)  # ascending
        return vecs[..., ::-1][..., :r]

    return fn


ALG = jax.lax.linalg.SvdAlgorithm
EIG = jax.lax.linalg.EighImplementation
JAX_METHODS = {  # fastest candidates first
    "jax_randomized": _top_basis("randomized"),
    "jax_gram_eigh": _top_basis("eigh"),
    "jax_gram_eigh_jacobi": _gram_eigh(EIG.JACOBI),
    "jax_svd_jacobi": _svd_left(ALG.JACOBI),
    "jax_svd_polar": _svd_left(ALG.POLAR),
    "jax_exact_current": _top_basis("exact"),
    "jax_svd_qr": _svd_left(ALG.QR),
    "jax_gram_eigh_qdwh": _gram_eigh(EIG.QDWH),
}


# moara_jax's refreshes: exact and eigh spread, randomized as spread would run it (it is not)
SPREAD_METHODS = ("jax_exact_current", "jax_gram_eigh", "jax_randomized")


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if times[-1] > 20_000:  # slow method: one timed run is enough
            break
    return times


def reference_bases(groups_np, ranks) -> list[list[np.ndarray]]:
    refs = []
    for g, r in zip(groups_np, ranks, strict=True):
        per = []
        for mat in g[:2]:
            a = mat if _projection.projection_side(mat.shape) == "in" else mat.T
            u, _, _ = np.linalg.svd(a.astype(np.float64), full_matrices=False)
            per.append(u[:, :r])
        refs.append(per)
    return refs


def largest_angle_deg(a: np.ndarray, b: np.ndarray) -> float:
    c = np.linalg.svd(a.astype(np.float64).T @ b.astype(np.float64), compute_uv=False)
    return float(np.degrees(np.arccos(np.clip(c.min(), -1.0, 1.0))))


def accuracy(bases, refs, groups_np) -> dict[str, float]:
    """Largest principal angle to the reference subspace, and the smallest ratio of gradient
    energy captured (``|A^T basis|^2 / |A^T ref|^2``, A with the projected side first)."""
    worst, energy = 0.0, 1.0
    for b, per, g in zip(bases, refs, groups_np, strict=True):
        b = np.asarray(b, np.float64)
        for i, ref in enumerate(per):
            a = g[i] if _projection.projection_side(g[i].shape) == "in" else g[i].T
            a = a.astype(np.float64)
            worst = max(worst, largest_angle_deg(ref, b[i]))
            energy = min(energy, float(np.sum((a.T @ b[i]) ** 2) / np.sum((a.T @ ref) ** 2)))
    return {"largest_angle_deg": worst, "energy_ratio_min": energy}


def run_jax(groups, groups_np, ranks, refs, names, repeats) -> dict:
    out = {}
    key = jax.random.PRNGKey(3)
    for name in names:
        fn = JAX_METHODS[name]
        step = jax.jit(lambda gs, k, fn=fn: [fn(g, r, k) for g, r in zip(gs, ranks, strict=True)])
        try:
            t0 = time.perf_counter()
            bases = jax.block_until_ready(step(groups, key))
            first = (time.perf_counter() - t0) * 1e3
            times = _timed(lambda step=step: jax.block_until_ready(step(groups, key)), repeats)
            out[name] = {
                "ms_median": statistics.median(times),
                "ms_all": times,
                "ms_first_call_incl_compile": first,
                **accuracy(bases, refs, groups_np),
            }
        except Exception as exc:  # noqa: BLE001 - report and go on with the next method
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, json.dumps(out[name]), flush=True)
    return out


def _forced_spread_randomized(g, r, key):
    """The randomized refresh as ``spread`` would run it (``top_basis`` does not spread it)."""
    side = _projection.projection_side(g.shape)
    return _bases.spread(lambda a: _bases._randomized_basis(a, side, r, key, 8, 2), g)


def run_spread(groups, ranks, names, repeats) -> dict:
    """Each method's refresh on every local device: every device factoring all the matrices
    against the matrices spread over the devices, gradients replicated and sharded; times and
    XLA's scratch memory per device (``temp_size_in_bytes``)."""
    devices = jax.devices()
    mesh = Mesh(np.asarray(devices), ("devices",))
    n = len(devices)
    layouts = {
        "replicated": [NamedSharding(mesh, P()) for _ in groups],
        "sharded": [
            NamedSharding(mesh, P(None, None, "devices") if g.shape[-1] % n == 0 else P()) for g in groups
        ],
    }
    key = jax.random.PRNGKey(3)
    out = {"devices": n}
    for name in names:
        for layout, shardings in layouts.items():
            placed = [jax.device_put(g, s) for g, s in zip(groups, shardings, strict=True)]
            row = {}
            for mode in ("every_device", "spread"):
                fn = (
                    _forced_spread_randomized
                    if (name, mode) == ("jax_randomized", "spread")
                    else JAX_METHODS[name]
                )
                step = jax.jit(lambda gs, k, fn=fn: [fn(g, r, k) for g, r in zip(gs, ranks, strict=True)])
                context = (lambda: jax.set_mesh(mesh)) if mode == "spread" else contextlib.nullcontext
                with context():
                    compiled = step.lower(placed, key).compile()
                    temp = compiled.memory_analysis().temp_size_in_bytes
                    if repeats:
                        jax.block_until_ready(step(placed, key))  # compiles

                def once(step=step, x=placed, context=context):
                    with context():
                        jax.block_until_ready(step(x, key))

                times = _timed(once, repeats) if repeats else []
                median = statistics.median(times) if times else None
                row[mode] = {"ms_median": median, "ms_all": times, "temp_mib": temp / 2**20}
            timed = row["every_device"]["ms_median"] is not None
            row["speedup"] = row["every_device"]["ms_median"] / row["spread"]["ms_median"] if timed else None
            out[f"{name}/{layout}"] = row
            print(f"{name}/{layout}", json.dumps(row), flush=True)
    return out


def _galore_projector_class():
    """galore-torch's ``GaLoreProjector`` without importing the package's ``__init__`` (which
    pulls in bitsandbytes for the 8-bit optimizer)."""
    spec = importlib.util.find_spec("galore_torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = types.ModuleType("galore_torch")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("galore_torch", pkg)
    path = Path(pkg.__path__[0]) / "galore_projector.py"
    mod_spec = importlib.util.spec_from_file_location("galore_torch.galore_projector", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.GaLoreProjector


def run_torch(groups_np, ranks, refs, repeats) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch not importable"}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__}
    # PyTorch orientation W = kernel^T, in bf16 like a bf16 model's gradients.
    mats = [torch.from_numpy(np.ascontiguousarray(np.swapaxes(g, -1, -2))).to(dev) for g in groups_np]
    bf16 = [m.to(torch.bfloat16) for m in mats]

    projector_cls = _galore_projector_class()
    if projector_cls is not None:

        def galore_refresh():
            lows = []
            for group, r in zip(bf16, ranks, strict=True):
                for w in group:
                    p = projector_cls(r, update_proj_gap=200, scale=0.25, proj_type="std")
                    lows.append(p.project(w, 0))
            sync()
            return lows

        galore_refresh()
        times = _timed(galore_refresh, repeats)
        out["torch_galore_projector"] = {"ms_median": statistics.median(times), "ms_all": times}
        print("torch_galore_projector", json.dumps(out["torch_galore_projector"]), flush=True)
    else:
        out["torch_galore_projector"] = {"skipped": "galore_torch not importable"}

    def batched_svd():
        res = []
        for group, r in zip(mats, ranks, strict=True):
            # galore-torch 'std': W (m, n) with m >= n keeps right vectors (the fan_in side).
            u, _, vh = torch.linalg.svd(group, full_matrices=False)
            res.append(vh[:, :r, :].transpose(-1, -2) if group.shape[-2] >= group.shape[-1] else u[..., :r])
        sync()
        return res

    bases = batched_svd()
    times = _timed(batched_svd, repeats)
    out["torch_svd_batched"] = {
        "ms_median": statistics.median(times),
        "ms_all": times,
        **accuracy([b.cpu().numpy() for b in bases], refs, groups_np),
    }
    print("torch_svd_batched", json.dumps(out["torch_svd_batched"]), flush=True)
    return out


def _write(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="350m", choices=sorted(SIZES))
    parser.add_argument("--methods", nargs="*", default=list(JAX_METHODS))
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--layers", type=positive, default=None, help="layers (default: the size's)")
    parser.add_argument("--spread", action="store_true", help="every device vs spread over the devices")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    check_names(parser, "--methods", args.methods, list(JAX_METHODS))
    check_out(parser, args.out)
    r_base = SIZES[args.size][3]
    groups_spec = shape_groups(args.size, args.layers)
    key = jax.random.PRNGKey(0)
    groups = [decaying(jax.random.fold_in(key, i), c, s, r_base) for i, (c, s, _) in enumerate(groups_spec)]
    ranks = [r for _, _, r in groups_spec]
    groups_np = [np.asarray(g) for g in groups]
    refs = reference_bases(groups_np, ranks)
    if args.spread:
        names = [m for m in args.methods if m in SPREAD_METHODS] or list(SPREAD_METHODS)
        result = {"size": args.size, "layers": args.layers or SIZES[args.size][2]}
        result |= {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
        result["spread"] = run_spread(groups, ranks, names, args.repeats)
        _write(args.out, result)
        head = (
            "method/gradients",
            "every device ms",
            "spread ms",
            "speedup",
            "every device MiB",
            "spread MiB",
        )
        line = "{:32s} {:>16} {:>10} {:>8} {:>17} {:>11}"
        print("\n" + line.format(*head))
        for name, row in result["spread"].items():
            if isinstance(row, dict):
                every, spread = row["every_device"], row["spread"]
                cells = (
                    every["ms_median"],
                    spread["ms_median"],
                    row["speedup"],
                    every["temp_mib"],
                    spread["temp_mib"],
                )
                text = ["-" if c is None else f"{c:.{2 if i == 2 else 1}f}" for i, c in enumerate(cells)]
                print(line.format(name, *text))
        return
    dev = jax.devices()[0]
    result = {
        "size": args.size,
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "matrices": sum(c for c, _, _ in groups_spec),
        "groups": [{"count": c, "flax_shape": s, "rank": r} for c, s, r in groups_spec],
    }
    if not args.no_torch:  # first: the reference figure, whatever time limit the run has
        result["torch"] = run_torch(groups_np, ranks, refs, args.repeats)
        _write(args.out, result)
    result["jax_methods"] = {}
    for name in args.methods:
        result["jax_methods"].update(run_jax(groups, groups_np, ranks, refs, [name], args.repeats))
        _write(args.out, result)
    print(f"\n{'method':28s} {'median ms':>12s} {'angle deg':>10s} {'energy':>8s}")
    rows = dict(result["jax_methods"])
    rows.update({k: v for k, v in result.get("torch", {}).items() if isinstance(v, dict)})
    for name, row in rows.items():
        if "ms_median" in row:
            angle = row.get("largest_angle_deg", float("nan"))
            energy = row.get("energy_ratio_min", float("nan"))
            print(f"{name:28s} {row['ms_median']:12.1f} {angle:10.3f} {energy:8.5f}")
        else:
            print(f"{name:28s} {row}")


if __name__ == "__main__":
    main()
