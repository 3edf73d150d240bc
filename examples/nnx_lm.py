"""MoARa on a Flax NNX model of your own: a small byte-level language model, trained on CPU.

The model names its layers its own way (Flax's ``nnx.MultiHeadAttention`` with ``query key value
out`` kernels of shape ``(embed, heads, head_dim)`` and ``(heads, head_dim, embed)``, an MLP with
``gate up down``), so the optimizer is told two things the Hugging Face names and 2-D kernels of
``models/`` give it for free:

- ``label_fn``: which module type each kernel is (the rank allocation moves rank from ``q`` and
  ``k`` to ``down``; every parameter labelled ``other`` gets AdamW);
- ``matrix_axes``: which axes of an attention kernel form its matrix, so that ``query`` is one
  ``embed x (heads * head_dim)`` matrix, not ``embed`` small ones.

Run it (200 steps took 16-21 s on a 2-core CPU, compiling included)::

    python examples/nnx_lm.py --steps 200
    python examples/nnx_lm.py --optimizer galore   # vanilla GaLore, the paper's baseline

It trains on its own source text, so it needs no data and no network.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import moara_jax as mj

# Flax's attention kernels and this MLP's, as the optimizer's module types.
MODULE_TYPES = {
    "query": "q",
    "key": "k",
    "value": "v",
    "out": "o",
    "gate": "gate",
    "up": "up",
    "down": "down",
}
QKV = mj.MatrixAxes(fan_in=-3, fan_out=(-2, -1))  # (embed, heads, head_dim)
OUT = mj.MatrixAxes(fan_in=(-3, -2), fan_out=-1)  # (heads, head_dim, embed)


def label(path) -> str:
    """A ``kernel`` under a layer of ``MODULE_TYPES`` is that module type; anything else ``other``."""
    names = mj.path_names(path)
    return MODULE_TYPES.get(names[-2], "other") if names[-1:] == ("kernel",) and len(names) > 1 else "other"


def matrix_axes(params):
    """``QKV``/``OUT`` for the attention kernels (3 axes); ``None`` (the last two axes) elsewhere."""

    def spec(path, x):
        names = mj.path_names(path)
        if names[-1:] != ("kernel",) or x.ndim < 3:
            return None
        return OUT if names[-2] == "out" else QKV

    return jax.tree_util.tree_map_with_path(spec, params)


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, hidden: int, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=dim, use_bias=False, decode=False, rngs=rngs
        )
        self.mlp_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.gate = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x_BxLxD, mask):
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), mask=mask)
        h = self.mlp_norm(x_BxLxD)
        return x_BxLxD + self.down(nnx.silu(self.gate(h)) * self.up(h))


class ByteLM(nnx.Module):
    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 172, layers: int = 2, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, hidden, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, 256, use_bias=False, rngs=rngs)  # "head": AdamW, as GaLore does

    def __call__(self, tokens_BxL):
        x = self.embed(tokens_BxL)
        mask = nnx.make_causal_mask(tokens_BxL)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def make_optimizer(name: str, lr, rank: int, block_size: int) -> optax.GradientTransformation:
    if name == "adamw":
        return mj.adamw(lr)
    full = name == "moara"  # the paper's Full: decomposition and rank allocation
    return mj.moara_adamw(
        lr,
        r_base=rank,
        block_size=block_size,
        decompose=full,
        rank_allocation=full,
        update_proj_gap=50,
        label_fn=label,
        matrix_axes=matrix_axes,
    )


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int):
    """Random windows of ``seq_len + 1`` bytes, forever."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        yield jnp.asarray(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32))


@nnx.jit
def train_step(model: ByteLM, optimizer: nnx.Optimizer, window_BxL1):
    def loss_fn(model):
        logits = model(window_BxL1[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, window_BxL1[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main(argv: list[str] | None = None) -> list[float]:
    """Trains and prints the loss every ``--log-every`` steps; returns the logged losses."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizer", choices=["moara", "galore", "adamw"], default="moara")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=16, help="r_base: q and k get half, down twice")
    p.add_argument("--block-size", type=int, default=16, help="the decomposition's block size B")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    data = np.frombuffer(pathlib.Path(__file__).read_bytes(), dtype=np.uint8)
    model = ByteLM(rngs=nnx.Rngs(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 10, args.steps, args.lr / 10)
    tx = make_optimizer(args.optimizer, schedule, args.rank, args.block_size)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if args.optimizer != "adamw":
        params = nnx.state(model, nnx.Param)
        full = args.optimizer == "moara"
        table = mj.rank_table(
            params, r_base=args.rank, rank_allocation=full, label_fn=label, matrix_axes=matrix_axes
        )
        for row in table:
            print(f"{row['path']}: {row['module']}, matrix {row['shape']}, rank {row['used']}")
    print(f"optimizer state: {mj.state_bytes(optimizer.opt_state)['total'] / 2**10:.1f} KiB")

    losses = []
    windows = batches(data, args.batch, args.seq_len, args.seed)
    for step in range(1, args.steps + 1):
        loss = train_step(model, optimizer, next(windows))
        if step % args.log_every == 0 or step == 1:
            losses.append(float(loss))
            print(f"step {step:4d}  loss {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
