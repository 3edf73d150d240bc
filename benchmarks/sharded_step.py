"""Bytes through collectives in ``python -m train``'s compiled step on a mesh, with the model's
activation constraints (``train.sharding.ACTIVATION_RULES``) and without them, side by side.

Compiles the trainer's step (``train.loop.jit_train_step``: forward, backward, the optimizer,
the refresh branch included) for a config on each mesh ``data x fsdp x tensor`` and sums, per kind
(all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute), the bytes of the
collectives' results in the optimised HLO: what one device receives per step, each collective
counted once (both branches of the refresh ``cond``, so a plain step moves less). Nothing is run:
the figures do not vary from run to run. On a CPU, fake the devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/sharded_step.py \\
      [--config configs/tiny.yaml] [--set KEY=VALUE ...] [--meshes 1x8x1 2x4x1 2x2x2 8x1x1] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import check_out  # noqa: E402
from step_anatomy import hlo_bytes  # noqa: E402

from train import loop  # noqa: E402
from train import setup as setting  # noqa: E402
from train.config import load_config  # noqa: E402
from train.sharding import ACTIVATION_RULES  # noqa: E402

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) (" + "|".join(KINDS) + r")(?:-start)?\(")


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes of the results of each kind of collective in optimised HLO text (an async
    collective counted at its start)."""
    out: collections.Counter = collections.Counter()
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.match(line)
        if m:
            out[m.group(2)] += hlo_bytes(m.group(1))
    return dict(out)


def step_collectives(config: str, sets: list[str], mesh: tuple[int, int, int], rules: bool) -> dict:
    """The collectives' bytes of the trainer's step for ``config`` + ``sets`` on ``mesh``, with
    the activation rules or none."""
    data, fsdp, tensor = mesh
    cfg = load_config(config, [*sets, f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"])
    setup = setting.make_setup(cfg, True, setting.Clock())
    state = jax.eval_shape(setup.init, jax.random.PRNGKey(0))
    batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32)
    step = loop.jit_train_step(setup, ACTIVATION_RULES if rules else ())
    text = step.lower(state, batch).compile().as_text()
    per_kind = collective_bytes(text)
    return {"bytes": per_kind, "total_bytes": sum(per_kind.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--meshes", nargs="+", default=["1x8x1", "2x4x1", "2x2x2", "8x1x1"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for text in args.meshes:
        sizes = text.split("x")
        if len(sizes) != 3 or not all(s.isdigit() and int(s) >= 1 for s in sizes):
            parser.error(f"--meshes: {text!r} is not data x fsdp x tensor (e.g. 2x4x1)")
        devices = math.prod(int(s) for s in sizes)
        if devices != jax.device_count():
            parser.error(
                f"--meshes: {text} needs {devices} devices, this process has {jax.device_count()} "
                "(XLA_FLAGS=--xla_force_host_platform_device_count=8 on a CPU)"
            )
    check_out(parser, args.out)
    result = {"config": args.config, "sets": args.sets, "devices": jax.device_count(), "meshes": {}}
    print(f"{'data x fsdp x tensor':>22s} {'without rules MB':>17s} {'with rules MB':>14s} {'ratio':>6s}")
    for text in args.meshes:
        mesh = tuple(int(x) for x in text.split("x"))
        row = {
            name: step_collectives(args.config, args.sets, mesh, rules)
            for name, rules in (("without_rules", False), ("with_rules", True))
        }
        row["ratio"] = row["with_rules"]["total_bytes"] / max(row["without_rules"]["total_bytes"], 1)
        result["meshes"][text] = row
        without, with_ = row["without_rules"]["total_bytes"] / 1e6, row["with_rules"]["total_bytes"] / 1e6
        print(f"{text:>22s} {without:17.2f} {with_:14.2f} {row['ratio']:6.2f}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
