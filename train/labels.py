"""``python -m train.labels --config FILE [--set k=v]``: print the optimizer's view of a model
(every parameter's path, shape, module label, projection rank requested/used, whether weight decay
applies to it) and the optimizer state by component, without allocating anything."""

from __future__ import annotations

import argparse
import sys

import jax

import moara_jax as mj
import models
from train.arguments import add_config_arguments
from train.config import load_config
from train.errors import UserError, cli
from train.model import model_config
from train.sources import make_tokenizer
from train.step import Allocation, decay_mask, make_optimizer

# The vocabulary where the config's tokenizer file is not at hand (Llama 2's and T5's).
FALLBACK_VOCAB = 32000


def tokenizer_vocab(cfg) -> int:
    """The ids of the config's tokenizer (``data.tokenizer``), or ``FALLBACK_VOCAB`` where it
    cannot be read here."""
    try:
        return make_tokenizer(cfg.data.tokenizer).vocab_size
    except UserError:
        return FALLBACK_VOCAB


def describe(cfg, vocab_size: int | None = None) -> str:
    """The table for ``cfg`` with ``vocab_size`` ids (default: its tokenizer's, ``tokenizer_vocab``)."""
    model_cfg = model_config(cfg, tokenizer_vocab(cfg) if vocab_size is None else vocab_size)
    params = models.abstract_params(model_cfg)
    opt = cfg.optimizer
    profiling = cfg.mode == "profile"  # what it measures: uniform ranks, no decomposition
    allocation = Allocation.of(opt, params, profiling=profiling)  # the file read once
    rows = {r["path"]: r for r in allocation.table(opt, params)} if opt.name != "adamw" else {}
    lines = [
        f"{model_cfg.name}: {models.param_count(model_cfg):,} parameters, optimizer {opt.name}"
        + ("" if opt.name == "adamw" or opt.host == "galore" else f" on {opt.host}")
        + (" (profiling: uniform ranks, no decomposition)" if profiling and opt.name != "adamw" else ""),
        f"{'parameter':64s} {'shape':>22s} {'label':>6s} {'rank':>11s} {'decay':>5s}",
    ]
    # Whether optimizer.weight_decay applies (optimizer.weight_decay_mask); "-": no weight decay.
    mask = decay_mask(opt)
    decayed = jax.tree.leaves(mask(params) if mask else jax.tree.map(lambda _: True, params))
    if opt.weight_decay == 0:
        decayed = [None] * len(decayed)
    for (path, x), decays in zip(jax.tree_util.tree_flatten_with_path(params)[0], decayed, strict=True):
        key = jax.tree_util.keystr(path)
        row = rows.get(key)
        rank = (
            f"{row['used']}" + ("" if row["used"] == row["requested"] else f" (<{row['requested']})")
            if row
            else "-"
        )
        label = row["module"] if row else "adamw"
        decay = "-" if decays is None else ("yes" if decays else "no")
        lines.append(f"{key:64s} {str(tuple(x.shape)):>22s} {label:>6s} {rank:>11s} {decay:>5s}")
    tx = make_optimizer(opt, 0.01, cfg.train.grad_clip, profiling=profiling, allocation=allocation)
    state = jax.eval_shape(tx.init, params)
    sizes = mj.state_bytes(state)
    lines.append(
        "optimizer state (MiB): "
        + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sizes.items() if k != "other")
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.labels",
        description="Print the optimizer's view of a run config's model: each parameter's label, rank "
        "and weight decay, and the state's MiB (nothing allocated).",
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"the tokenizer's ids (default: data.tokenizer's; {FALLBACK_VOCAB:,} where it cannot be read)",
    )
    args = parser.parse_args(argv)

    def body() -> int:
        print(describe(load_config(args.config, args.overrides), args.vocab_size))
        return 0

    return cli(body)


if __name__ == "__main__":
    sys.exit(main())
