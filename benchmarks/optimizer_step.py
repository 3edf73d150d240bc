"""Time one optimizer update on Llama 2 parameter shapes (bf16): MoARa (Full), vanilla GaLore,
``optax.contrib.galore`` and ``optax.adamw``, separately for a plain step and a refresh step, plus
MoARa with the randomized refresh and the principal angles between its basis and the exact one.

The plain step is timed three ways: single jitted calls (median), calls dispatched back to back
(mean), and ``--loop-steps`` steps (update + ``apply_updates``) inside one jitted loop (median of
``--loop-repeats``), which leaves out the host's dispatch of every buffer of the parameter, gradient
and state trees: the device's time per step, as inside a jitted training step.

Usage:
  python benchmarks/optimizer_step.py [--size 350m|1b|7b|60m|tiny] [--repeats 10] [--out FILE.json]

Prints a table and writes JSON (device, medians in ms). Run on the accelerator for the figures
reported in ``docs/benchmarks.md``; ``--size tiny`` is a quick CPU check.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _args import check_names, check_out, non_negative, positive

import moara_jax as mj

# hidden, intermediate, layers, r_base, block size (paper Appendix D); vocab 32000.
SIZES = {
    "tiny": (128, 344, 2, 32, 32),
    "60m": (512, 1376, 8, 128, 32),
    "350m": (1024, 2736, 24, 256, 32),
    "1b": (2048, 5461, 24, 512, 64),
    "7b": (4096, 11008, 32, 1024, 128),
}
GAP = 200


def llama2_params(
    hidden: int, inter: int, layers: int, vocab: int = 32000, seed: int = 0, stacked: bool = False
):
    """Random bf16 Llama 2 parameters, one leaf per matrix (unscanned, like galore-torch), or with
    ``stacked=True`` one ``(layers, fan_in, fan_out)`` leaf per module type (a scanned model)."""
    key = jax.random.PRNGKey(seed)
    params = {
        "embed_tokens": {"embedding": None},
        "norm": {"scale": jnp.ones(hidden, jnp.bfloat16)},
        "lm_head": {"kernel": None},
    }
    shapes = {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, hidden),
        "v_proj": (hidden, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }

    def rnd(shape):
        nonlocal key
        key, sub = jax.random.split(key)
        return (0.02 * jax.random.normal(sub, shape)).astype(jnp.bfloat16)

    params["embed_tokens"]["embedding"] = rnd((vocab, hidden))
    params["lm_head"]["kernel"] = rnd((hidden, vocab))
    if stacked:
        params["layers"] = {"self_attn": {}, "mlp": {}}
        for name, shape in shapes.items():
            group = params["layers"]["self_attn" if name[0] in "qkvo" else "mlp"]
            group[name] = {"kernel": rnd((layers, *shape))}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            params["layers"][norm] = {"scale": jnp.ones((layers, hidden), jnp.bfloat16)}
        return params
    for i in range(layers):
        layer = {
            "self_attn": {},
            "mlp": {},
            "input_layernorm": {"scale": jnp.ones(hidden, jnp.bfloat16)},
            "post_attention_layernorm": {"scale": jnp.ones(hidden, jnp.bfloat16)},
        }
        for name, shape in shapes.items():
            layer["self_attn" if name[0] in "qkvo" else "mlp"][name] = {"kernel": rnd(shape)}
        params[f"layers_{i}"] = layer
    return params


def optimizers(r_base: int, block: int) -> dict[str, optax.GradientTransformation]:
    galore_mask = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, x: mj.module_label(path) != "other", p
    )
    return {
        "moara_full_exact": mj.moara_adamw(0.01, r_base=r_base, block_size=block, update_proj_gap=GAP),
        "moara_full_eigh": mj.moara_adamw(
            0.01, r_base=r_base, block_size=block, update_proj_gap=GAP, svd="eigh"
        ),
        "galore_vanilla_eigh": mj.moara_adamw(
            0.01, r_base=r_base, decompose=False, rank_allocation=False, update_proj_gap=GAP, svd="eigh"
        ),
        "moara_full_randomized": mj.moara_adamw(
            0.01, r_base=r_base, block_size=block, update_proj_gap=GAP, svd="randomized"
        ),
        "galore_vanilla_exact": mj.moara_adamw(
            0.01, r_base=r_base, decompose=False, rank_allocation=False, update_proj_gap=GAP
        ),
        # The cross-method hosts (Full MoARa on each; eigh refresh as the paper configs).
        "fira_full_eigh": mj.moara_adamw(
            0.01, r_base=r_base, block_size=block, update_proj_gap=GAP, svd="eigh", host="fira"
        ),
        "q_galore_full_eigh": mj.moara_adamw(
            0.01, r_base=r_base, block_size=block, update_proj_gap=GAP, svd="eigh", host="q_galore"
        ),
        # OSD's and LDAdam's bases move every step ("refresh" is then a plain step at a multiple of
        # the gap); SubTrack++'s refresh is its geodesic step.
        **{
            f"{host}_full_eigh": mj.moara_adamw(
                0.01, r_base=r_base, block_size=block, update_proj_gap=GAP, svd="eigh", host=host
            )
            for host in ("osd", "ldadam", "subtrack_pp")
        },
        "optax_contrib_galore": optax.partition(
            {
                True: optax.contrib.galore(0.01, rank=r_base, update_proj_gap=GAP, scale=0.25),
                False: optax.adamw(0.01, eps=1e-6, weight_decay=0.0),
            },
            galore_mask,
        ),
        "optax_adamw": optax.adamw(0.01, eps=1e-6, weight_decay=0.0),
    }


def with_count(state, value):
    """The state with every step counter set to ``value`` (refresh: a multiple of the gap)."""

    def set_count(path, x):
        names = [getattr(k, "name", getattr(k, "key", None)) for k in path]
        if names and names[-1] == "count" and x.ndim == 0:
            return jnp.asarray(value, x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(set_count, state)


def time_update(tx, params, grads, count: int, repeats: int) -> float:
    """Median wall time (ms) of one jitted update at step counter ``count``."""
    state = with_count(tx.init(params), count)
    update = jax.jit(tx.update)
    jax.block_until_ready(update(grads, state, params))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(update(grads, state, params))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_pipelined(tx, params, grads, steps: int = 20) -> float:
    """Mean ms per plain step over ``steps`` updates dispatched back to back, the state threaded
    through (as in a training loop: host dispatch overlaps device work)."""
    state = with_count(tx.init(params), 1)
    update = jax.jit(tx.update)
    _, state = jax.block_until_ready(update(grads, state, params))
    t0 = time.perf_counter()
    for _ in range(steps):
        upd, state = update(grads, state, params)
    jax.block_until_ready((upd, state))
    return (time.perf_counter() - t0) * 1e3 / steps


def plain_step_loop(tx, steps: int):
    """``run(params, state, grads)``: ``steps`` plain steps (update + ``optax.apply_updates``) in
    one jitted ``lax.fori_loop``; ``steps`` must stay below the refresh gap."""
    if steps >= GAP:
        raise ValueError(f"steps ({steps}) must stay below the refresh gap ({GAP})")

    @jax.jit
    def run(params, state, grads):
        def body(_, carry):
            p, s = carry
            u, s = tx.update(grads, s, p)
            return optax.apply_updates(p, u), s

        return jax.lax.fori_loop(0, steps, body, (params, state))

    return run


def time_device_loop(tx, params, grads, steps: int = 20, repeats: int = 5) -> float:
    """Median ms per plain step, ``steps`` steps (update + ``optax.apply_updates``) run inside one
    jitted ``lax.fori_loop``: the device's time per step, without the host's per-call dispatch of
    every parameter, gradient and state buffer (which dominates single calls at 350M)."""
    state = with_count(tx.init(params), 1)
    run = plain_step_loop(tx, steps)
    jax.block_until_ready(run(params, state, grads))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, state, grads))
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times)


def decaying_gradients(params, r_base: int, seed: int = 1):
    """Gradients with a decaying spectrum (singular values ~ exp(-i / r_base) times Gaussian
    factors) for the target matrices, as trained models' gradients have; Gaussian elsewhere.

    A random Gaussian matrix has a flat spectrum, on which no top-r subspace is well defined and
    any range finder (and any two exact SVD libraries) disagree.
    """
    key = jax.random.PRNGKey(seed)

    def make(path, p):
        nonlocal key
        key, k1, k2, k3 = jax.random.split(key, 4)
        if mj.module_label(path) == "other":
            return (0.02 * jax.random.normal(k1, p.shape)).astype(p.dtype)
        *batch, m, n = p.shape
        k = min(m, n)
        s = jnp.exp(-jnp.arange(k) / r_base)
        x = jax.random.normal(k1, (*batch, m, k)) / jnp.sqrt(m)
        y = jax.random.normal(k2, (*batch, k, n)) / jnp.sqrt(n)
        noise = 1e-3 * jax.random.normal(k3, p.shape)
        return ((x * s) @ y + noise).astype(p.dtype)

    return jax.tree_util.tree_map_with_path(make, params)


def _captured(g: np.ndarray, basis: np.ndarray) -> float:
    """Norm of the projection of ``g`` onto ``basis`` (on the side GaLore projects)."""
    if mj.projection_side(g.shape) == "in":
        return float(np.linalg.norm(basis.T @ g))
    return float(np.linalg.norm(g @ basis))


def principal_angles_deg(params, grads, r_base: int, block: int) -> dict[str, float]:
    """Largest principal angle (degrees) between the randomized and the exact basis of each
    target matrix after a refresh; max and median over matrices."""
    exact = mj.moara_adamw(0.01, r_base=r_base, block_size=block)
    rand = mj.moara_adamw(0.01, r_base=r_base, block_size=block, svd="randomized")
    _, s_exact = jax.jit(exact.update)(grads, exact.init(params), params)
    _, s_rand = jax.jit(rand.update)(grads, rand.init(params), params)
    be, br = mj.projection_bases(s_exact), mj.projection_bases(s_rand)
    flat_grads = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    worst, mean, energy = [], [], []
    for path, a in be.items():
        a32, b32 = np.asarray(a, np.float32), np.asarray(br[path], np.float32)
        c = np.clip(np.linalg.svd(a32.T @ b32, compute_uv=False), -1.0, 1.0)
        worst.append(float(np.degrees(np.arccos(c.min()))))
        mean.append(float(np.degrees(np.arccos(c)).mean()))
        # Gradient energy each basis captures (the bases of decomposed runs come from V, close
        # to G's row/column space); ratio randomized / exact.
        g = np.asarray(flat_grads[path], np.float32)
        energy.append(float((_captured(g, b32) / _captured(g, a32)) ** 2))
    return {
        "largest_angle_deg_max": max(worst),
        "largest_angle_deg_median": statistics.median(worst),
        "mean_angle_deg_median": statistics.median(mean),
        "energy_ratio_min": min(energy),
        "energy_ratio_median": statistics.median(energy),
        "matrices": len(worst),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="350m", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=positive, default=10)
    parser.add_argument("--refresh-repeats", type=non_negative, default=3, help="0 skips the refresh step")
    parser.add_argument("--loop-steps", type=positive, default=20, help="steps per in-jit loop")
    parser.add_argument("--loop-repeats", type=positive, default=5, help="timed in-jit loops")
    parser.add_argument("--only", nargs="*", help="subset of optimizer names")
    parser.add_argument(
        "--in-jit-only", action="store_true", help="time only the in-jit loop (no single/pipelined calls)"
    )
    parser.add_argument(
        "--stacked", action="store_true", help="one (layers, fan_in, fan_out) leaf per module type"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    check_names(parser, "--only", args.only, list(optimizers(8, 8)))
    check_out(parser, args.out)
    if args.loop_steps >= GAP:
        parser.error(
            f"--loop-steps must be under the refresh interval ({GAP}): a loop may not cross a refresh"
        )
    hidden, inter, layers, r_base, block = SIZES[args.size]
    params = llama2_params(hidden, inter, layers, stacked=args.stacked)
    grads = decaying_gradients(params, r_base)
    device = jax.devices()[0]
    result = {
        "size": args.size,
        "device": getattr(device, "device_kind", str(device)),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "repeats": args.repeats,
        "target_matrices": 7 * layers,
        "stacked": args.stacked,
        "ms": {},
    }
    for name, tx in optimizers(r_base, block).items():
        if args.only and name not in args.only:
            continue
        nan = float("nan")
        plain = nan if args.in_jit_only else time_update(tx, params, grads, count=1, repeats=args.repeats)
        refresh = (
            time_update(tx, params, grads, count=0, repeats=args.refresh_repeats)
            if args.refresh_repeats > 0
            else float("nan")
        )
        pipelined = nan if args.in_jit_only else time_pipelined(tx, params, grads)
        in_jit = time_device_loop(tx, params, grads, steps=args.loop_steps, repeats=args.loop_repeats)
        result["ms"][name] = {
            "plain": plain,
            "plain_pipelined": pipelined,
            "plain_in_jit_loop": in_jit,
            "refresh": refresh,
        }
        print(
            f"{name:24s} plain {plain:10.2f} ms  pipelined {pipelined:8.2f} ms  "
            f"in-jit loop {in_jit:8.2f} ms  refresh {refresh:10.2f} ms",
            flush=True,
        )
        _write(args.out, result)  # partial results survive a time limit
    if not args.stacked and (not args.only or "moara_full_randomized" in args.only):
        result["randomized_principal_angles"] = principal_angles_deg(params, grads, r_base, block)
        print("randomized vs exact basis:", result["randomized_principal_angles"])
    ms = result["ms"]
    if "moara_full_exact" in ms and "galore_vanilla_exact" in ms:
        moara, galore = ms["moara_full_exact"], ms["galore_vanilla_exact"]
        result["moara_plain_over_galore_plain"] = moara["plain"] / galore["plain"]
        print(f"MoARa plain / GaLore plain = {result['moara_plain_over_galore_plain']:.3f}")
        result["moara_pipelined_over_galore_pipelined"] = moara["plain_pipelined"] / galore["plain_pipelined"]
        print(f"pipelined: {result['moara_pipelined_over_galore_pipelined']:.3f}")
        result["moara_in_jit_over_galore_in_jit"] = moara["plain_in_jit_loop"] / galore["plain_in_jit_loop"]
        print(f"in-jit loop (update + apply_updates): {result['moara_in_jit_over_galore_in_jit']:.3f}")
    print(json.dumps({"device": result["device"], "size": args.size}))
    _write(args.out, result)


def _write(path: str | None, result: dict) -> None:
    """``result`` as JSON, a figure not measured (NaN: ``--in-jit-only``, ``--refresh-repeats 0``)
    as null: strict JSON readers refuse NaN."""
    if path:
        with open(path, "w") as f:
            json.dump(_nan_as_none(result), f, indent=2, allow_nan=False)


def _nan_as_none(x):
    if isinstance(x, dict):
        return {k: _nan_as_none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_nan_as_none(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


if __name__ == "__main__":
    main()
