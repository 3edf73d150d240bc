"""An experiment, not part of the package: a fused Pallas (Triton) kernel for MoARa's block
decomposition + projection, against XLA's decompose-then-project, per tile configuration, on the
target shapes of a Llama 2 size (stacked over its layers).

XLA runs ``decompose`` then ``project`` as three kernels per target matrix: the block norms (a
reduction over the gradient), the direction (a second pass, writing the direction) and the
projection GEMM (reading the direction back). The norms of a block need only that block's rows in
each fan_out column, so a GEMM tile that walks the fan_in axis in whole blocks has every norm it
needs on chip: this kernel reads each gradient tile once, computes the norms, normalises the tile,
feeds it to the matrix units and writes the magnitudes and the low-rank value (the same function:
float32 norms, direction rounded to the gradient's dtype, float32 accumulation).

Measured on an H100 it is not faster than XLA's three kernels at Llama 2 350M shapes
(``docs/benchmarks.md``), so the package does not use it. Times one call of each (median of
``--repeats``, after a warm-up) and checks each result against XLA's. GPU only (``decompose_project(...,
interpret=True)`` runs the kernel in Pallas' interpreter on any backend: the tests check it so).

Usage:
  python benchmarks/fused_kernel.py [--size 350m] [--repeats 50]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from _args import positive
from jax.experimental import pallas as pl
from optimizer_step import SIZES

import moara_jax as mj
from moara_jax._decomposition import decompose_along
from moara_jax._projection import project_value, projection_side

try:  # the Triton backend of Pallas (GPU)
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - very old or stripped jaxlib
    plgpu = None

# Output tile sizes: rows of the low-rank value (TR) and the free axis (TF).
_TR = 64
_TF = 64
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def supported(shape: tuple[int, ...], dtype, rank: int, block_size: int) -> bool:
    """Whether the kernel handles a leaf of ``shape``/``dtype`` at ``rank`` and ``block_size``: a
    power-of-two block size in [16, 128], a rank that is a multiple of the row tile, and a 16-bit
    or float32 gradient."""
    if plgpu is None or len(shape) < 2:
        return False
    return (
        _pow2(block_size)
        and 16 <= block_size <= 128
        and rank % _TR == 0
        and jnp.dtype(dtype) in [jnp.dtype(d) for d in _DTYPES]
    )


class _Tiles(NamedTuple):
    """Static shape of a kernel launch: the block size, eps, the leaf's sides, the rank tile
    ``tr``, the free-axis tile ``tf`` and the blocks ``nbk`` in each step."""

    block: int
    eps: float
    fan_in: int
    fan_out: int
    tr: int
    tf: int
    nbk: int


def _direction_tile(g_ref, mag_ref, mi, kb, c, write_mag, t: _Tiles):
    """The block direction of rows ``[kb * nbk * B, (kb + 1) * nbk * B)`` and columns
    ``[c * tf, (c + 1) * tf)`` of matrix ``mi`` (zero outside the matrix), in ``g``'s dtype; the
    tile's block norms are stored in ``mag_ref`` where ``write_mag``."""
    bk = t.nbk * t.block
    rows_ok = (kb * bk + jnp.arange(bk)) < t.fan_in
    cols_ok = (c * t.tf + jnp.arange(t.tf)) < t.fan_out
    mask = rows_ok[:, None] & cols_ok[None, :]
    x = plgpu.load(g_ref.at[mi, pl.ds(kb * bk, bk), pl.ds(c * t.tf, t.tf)], mask=mask, other=0.0)
    x = x.astype(jnp.float32).reshape(t.nbk, t.block, t.tf)
    norm = jnp.sqrt(jnp.sum(x * x, axis=1))  # (nbk, tf)

    @pl.when(write_mag)
    def _():
        blocks_ok = (kb * t.nbk + jnp.arange(t.nbk)) < -(-t.fan_in // t.block)
        ok = blocks_ok[:, None] & cols_ok[None, :]
        plgpu.store(mag_ref.at[mi, pl.ds(kb * t.nbk, t.nbk), pl.ds(c * t.tf, t.tf)], norm, mask=ok)

    return (x / (norm[:, None, :] + t.eps)).reshape(bk, t.tf).astype(g_ref.dtype)


def _in_kernel(g_ref, p_ref, low_ref, mag_ref, *, t: _Tiles):
    """Side 'in': ``low[l, r, j] = sum_i P[l, i, r] dir[l, i, j]``, blocks along i (contracted).

    Each program owns a ``tr x tf`` tile of ``low`` and walks fan_in in ``nbk`` whole blocks."""
    mi, tr, tf = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ranks = pl.ds(tr * t.tr, t.tr)
    bk = t.nbk * t.block

    def body(k, acc):
        d = _direction_tile(g_ref, mag_ref, mi, k, tf, tr == 0, t)
        rows_ok = (k * bk + jnp.arange(bk)) < t.fan_in
        p = plgpu.load(p_ref.at[mi, pl.ds(k * bk, bk), ranks], mask=rows_ok[:, None], other=0.0)
        return acc + jax.lax.dot_general(
            p.astype(g_ref.dtype), d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    acc = jax.lax.fori_loop(0, pl.cdiv(t.fan_in, bk), body, jnp.zeros((t.tr, t.tf), jnp.float32))
    cols_ok = (tf * t.tf + jnp.arange(t.tf)) < t.fan_out
    plgpu.store(
        low_ref.at[mi, ranks, pl.ds(tf * t.tf, t.tf)], acc.astype(low_ref.dtype), mask=cols_ok[None, :]
    )


def _out_kernel(g_ref, p_ref, low_ref, mag_ref, *, t: _Tiles):
    """Side 'out': ``low[l, i, r] = sum_j dir[l, i, j] Q[l, j, r]``, blocks along i (free).

    Each program owns ``nbk`` whole blocks of rows and a ``tr`` rank tile, and walks fan_out."""
    mi, kb, tr = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ranks = pl.ds(tr * t.tr, t.tr)
    bk = t.nbk * t.block

    def body(c, acc):
        d = _direction_tile(g_ref, mag_ref, mi, kb, c, tr == 0, t)
        cols_ok = (c * t.tf + jnp.arange(t.tf)) < t.fan_out
        q = plgpu.load(p_ref.at[mi, pl.ds(c * t.tf, t.tf), ranks], mask=cols_ok[:, None], other=0.0)
        return acc + jnp.dot(d, q.astype(g_ref.dtype), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, pl.cdiv(t.fan_out, t.tf), body, jnp.zeros((bk, t.tr), jnp.float32))
    rows_ok = (kb * bk + jnp.arange(bk)) < t.fan_in
    plgpu.store(low_ref.at[mi, pl.ds(kb * bk, bk), ranks], acc.astype(low_ref.dtype), mask=rows_ok[:, None])


@functools.partial(
    jax.jit, static_argnames=("block_size", "eps", "side", "interpret", "tiles", "num_warps", "num_stages")
)
def decompose_project(
    g: jax.Array,
    basis: jax.Array,
    *,
    block_size: int,
    eps: float,
    side: str,
    interpret: bool = False,
    tiles: tuple[int, int, int] | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> tuple[jax.Array, jax.Array]:
    """``(mag, low)`` of a Flax-layout gradient ``g`` ``(..., fan_in, fan_out)``: the block
    magnitudes ``(..., ceil(fan_in / B), fan_out)`` (float32) and the projection of the block
    direction on ``basis`` ``(..., d, r)`` (``basis^T dir`` for side 'in', ``dir basis`` for
    'out'), in ``g``'s dtype. ``interpret=True`` runs the kernel in Pallas' interpreter (any
    backend; for tests)."""
    *batch, fan_in, fan_out = g.shape
    rank = basis.shape[-1]
    lead = math.prod(batch)
    g3 = g.reshape(lead, fan_in, fan_out)
    p3 = basis.reshape(lead, *basis.shape[-2:]).astype(g.dtype)
    nb = -(-fan_in // block_size)
    tr, tf, nbk = tiles or (_TR, _TF, 1)
    t = _Tiles(block_size, float(eps), fan_in, fan_out, min(tr, rank), tf, nbk)
    if side == "in":
        kernel = functools.partial(_in_kernel, t=t)
        grid = (lead, rank // t.tr, pl.cdiv(fan_out, t.tf))
        low_shape = (lead, rank, fan_out)
    else:
        kernel = functools.partial(_out_kernel, t=t)
        grid = (lead, pl.cdiv(nb, nbk), rank // t.tr)
        low_shape = (lead, fan_in, rank)
    low, mag = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(low_shape, g.dtype),
            jax.ShapeDtypeStruct((lead, nb, fan_out), jnp.float32),
        ),
        grid=grid,
        compiler_params=None
        if interpret
        else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="moara_decompose_project",
    )(g3, p3)
    return mag.reshape(*batch, nb, fan_out), low.reshape(*batch, *low_shape[1:])


# (rank tile, free-axis tile, blocks per step, warps, pipeline stages)
CONFIGS = [
    (64, 64, 1, 4, 3),
    (64, 64, 2, 4, 3),
    (64, 64, 4, 4, 3),
    (64, 128, 2, 4, 3),
    (128, 64, 2, 8, 3),
    (128, 64, 4, 8, 3),
    (128, 128, 2, 8, 3),
    (256, 64, 2, 8, 3),
]


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# The projected direction's error relative to XLA's above which a configuration is marked as
# computing something else, and is no candidate for the best (both sides round to bf16).
WRONG_ABOVE = 1e-2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="350m", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=positive, default=50)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":  # Pallas' Triton kernels; on a CPU Pallas only interprets
        sys.exit(f"error: fused_kernel.py times a GPU kernel: JAX's backend is {jax.default_backend()}")
    hidden, inter, layers, r_base, block = SIZES[args.size]
    ranks = mj.allocate_ranks(r_base, ("q", "k", "v", "o", "gate", "up", "down"))
    shapes = {
        "q": (hidden, hidden),
        "v": (hidden, hidden),
        "up": (hidden, inter),
        "down": (inter, hidden),
    }
    key = jax.random.PRNGKey(0)
    print(f"{jax.devices()[0].device_kind}, {args.size}, {layers} stacked layers, block {block}; ms")
    for name, shape in shapes.items():
        rank = ranks[name]
        side = projection_side(shape)
        d = shape[0] if side == "in" else shape[1]
        k1, k2, key = jax.random.split(key, 3)
        g = jax.random.normal(k1, (layers, *shape)).astype(jnp.bfloat16)
        basis = (jax.random.normal(k2, (layers, d, rank)) / np.sqrt(d)).astype(jnp.bfloat16)

        @jax.jit
        def xla(g, basis, side=side):
            mag, direction = decompose_along(g, block, -2, 1e-12)
            return mag, project_value(direction, basis, side)

        ref_mag, ref_low = xla(g, basis)
        row = [
            f"{name:5s} {str(shape):13s} r={rank:4d} xla {_time(xla, g, basis, repeats=args.repeats):7.3f}"
        ]
        for tr, tf, nbk, warps, stages in CONFIGS:
            if not supported(shape, g.dtype, rank, block):
                row.append("unsupported")
                break
            fused = jax.jit(
                lambda g, b, c=(tr, tf, nbk), w=warps, s=stages, side=side: decompose_project(
                    g, b, block_size=block, eps=1e-12, side=side, tiles=c, num_warps=w, num_stages=s
                )
            )
            try:
                mag, low = fused(g, basis)
                err = float(
                    jnp.linalg.norm((low - ref_low).astype(jnp.float32))
                    / jnp.linalg.norm(ref_low.astype(jnp.float32))
                )
                merr = float(jnp.max(jnp.abs(mag - ref_mag)))
                ms = _time(fused, g, basis, repeats=args.repeats)
                wrong = "" if err <= WRONG_ABOVE else " WRONG: not a candidate"
                row.append(f"{tr}/{tf}/{nbk}/{warps}w {ms:7.3f} (err {err:.1e}, mag {merr:.0e}){wrong}")
            except Exception as e:  # a configuration the compiler refuses (registers, shared memory)
                why = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
                row.append(f"{tr}/{tf}/{nbk}/{warps}w failed: {type(e).__name__} {why}")
        print("\n   ".join(row), flush=True)


if __name__ == "__main__":
    main()
