"""Whole training steps of this project against its PyTorch peer, on the same device, in one run.

The peer: ``transformers``' ``LlamaForCausalLM`` with the same config (SDPA attention, bf16,
``torch.compile``), trained with ``galore_torch.GaLoreAdamW`` on the paper's two parameter groups
(attention and MLP matrices: rank ``--r-base``, T = 200, scale 0.25, ``proj_type='std'``; the rest
plain) and with ``torch.optim.AdamW`` (fused on CUDA) as the full-rank reference. This project:
AdamW, vanilla GaLore and MoARa Full (``svd='eigh'``), one jitted donated step as ``python -m
train`` runs it. Both sides run the same shapes and the same tokens per optimizer step (the global
batch in micro-batches, gradients accumulated).

Per optimizer: median ms of a plain step (no basis refresh), tokens/s, MFU, peak device memory,
and tokens/s with the refresh amortized over T (a refresh step timed on its own: galore-torch's
per-matrix ``torch.linalg.svd`` at ``state['step'] % T == 0``, this project's batched ``eigh``
at ``count % T == 0``). MFU = 6 x N x tokens / step time / peak FLOP/s, N every parameter (the
embedding and LM head included; attention's own FLOPs left out), peak ``--peak-tflops`` (989.4:
an H100 or H200's dense bf16).

Usage (on the GPU machine; galore-torch, transformers and torch must be installed):
  python benchmarks/vs_torch.py --model llama2-350m --batch 512 --micro-batch 128 --seq-len 256 \\
      [--steps 10] [--only galore_torch moara_full] [--out vs_torch.json]
CPU smoke run: --model llama2-tiny --batch 8 --micro-batch 4 --seq-len 32 --steps 2 --no-compile
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from optimizer_step import _with_count
from train_step import add_step_arguments, optimizers, time_steps

import models
from train.plots import pyplot
from train.step import TrainState, make_train_step

GALORE_MODULES = ("self_attn", "mlp")  # the paper's low-rank group: every attention and MLP matrix


def paper_groups(model) -> tuple[list, list]:
    """The paper's two parameter groups of an HF model: the attention and MLP matrices (GaLore's
    low-rank group), and everything else (embedding, norms, LM head)."""
    low_rank = [p for n, p in model.named_parameters() if p.ndim == 2 and any(m in n for m in GALORE_MODULES)]
    ids = {id(p) for p in low_rank}
    return low_rank, [p for p in model.parameters() if id(p) not in ids]


def torch_peer(cfg, optimizer: str, args) -> dict:
    """Median plain-step and refresh-step ms, peak memory of the PyTorch peer."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_config = models.to_hf_config(cfg)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).to(device=device, dtype=torch.bfloat16)
    low_rank, rest = paper_groups(model)
    if optimizer == "galore_torch":
        from galore_torch import GaLoreAdamW

        groups = [
            {"params": rest},
            {
                "params": low_rank,
                "rank": args.r_base,
                "update_proj_gap": 200,
                "scale": 0.25,
                "proj_type": "std",
            },
        ]
        opt = GaLoreAdamW(groups, lr=0.01, eps=1e-6, weight_decay=0.0, no_deprecation_warning=True)
    else:
        opt = torch.optim.AdamW(
            model.parameters(), lr=0.01, eps=1e-6, weight_decay=0.0, fused=device == "cuda"
        )
    forward = torch.compile(model) if args.compile else model
    micro = args.batch // args.micro_batch
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g).to(device)

    def step():
        for chunk in tokens.chunk(micro):
            logits = forward(input_ids=chunk[:, :-1]).logits
            loss = (
                torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
                / micro
            )
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def timed(n: int, before=None) -> list[float]:
        out = []
        for _ in range(n):
            if before:
                before()
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed(args.warmup)  # step 0 (a GaLore refresh), compilation
    plain = statistics.median(timed(args.steps))

    def due():  # every GaLore matrix refreshes at the next step
        for p in low_rank:
            if p in opt.state:
                opt.state[p]["step"] = 200 * (1 + opt.state[p]["step"] // 200)

    refresh = statistics.median(timed(args.refresh_steps, due)) if optimizer == "galore_torch" else plain
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    n_params = sum(p.numel() for p in model.parameters())
    return {"plain_ms": plain, "refresh_ms": refresh, "peak_memory_bytes": peak, "params": n_params}


def jax_side(cfg, name: str, tx, args) -> dict:
    plain = time_steps(cfg, tx, args.batch, args.micro_batch, args.seq_len, args.steps, args.warmup)
    refresh = plain
    if name != "adamw":
        refresh = time_refresh(cfg, tx, args)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "plain_ms": plain,
        "refresh_ms": refresh,
        "peak_memory_bytes": stats.get("peak_bytes_in_use"),
        "params": models.param_count(cfg),
    }


def time_refresh(cfg, tx, args) -> float:
    """Median ms of whole steps whose optimizer counters sit on a refresh (count % T == 0)."""
    state = jax.jit(
        lambda k: (lambda p: TrainState(jnp.zeros([], jnp.int32), p, tx.init(p)))(models.init_params(cfg, k))
    )(jax.random.PRNGKey(0))
    step = jax.jit(make_train_step(cfg, tx, args.batch // args.micro_batch), donate_argnums=0)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.seq_len + 1), 0, cfg.vocab_size)
    times = []
    for i in range(args.refresh_steps + 1):
        state = state._replace(opt_state=_with_count(state.opt_state, 0))
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, _ = step(state, tokens)
        jax.block_until_ready(state)
        if i:  # the first call compiles
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def derive(row: dict, tokens: int, peak_tflops: float, gap: int = 200) -> dict:
    amortized = row["plain_ms"] + (row["refresh_ms"] - row["plain_ms"]) / gap
    return {
        **row,
        "tokens_per_s": tokens / row["plain_ms"] * 1e3,
        "tokens_per_s_refresh_amortized": tokens / amortized * 1e3,
        "mfu": 6 * row["params"] * tokens / (row["plain_ms"] * 1e-3) / (peak_tflops * 1e12),
    }


def plot(result: dict, path: pathlib.Path) -> None:
    plt = pyplot("chart")
    if plt is None:
        return
    names = list(result["runs"])
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [result["runs"][n]["tokens_per_s"] for n in names], 0.4, label="plain step")
    ax.bar(
        [i + 0.2 for i in x],
        [result["runs"][n]["tokens_per_s_refresh_amortized"] for n in names],
        0.4,
        label="refresh amortized over T = 200",
    )
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{result['model']}, batch {result['batch']} x {result['seq_len']}, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser, steps=10, warmup=3)
    parser.add_argument("--refresh-steps", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.4)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="the peer runs eagerly")
    parser.add_argument(
        "--only", nargs="*", help="subset of galore_torch, adamw_torch, adamw, galore_vanilla, moara_full"
    )
    parser.add_argument("--out", default=None, help="JSON path (a PNG chart goes beside it)")
    args = parser.parse_args()
    import torch

    cfg = models.get_config(args.model, param_dtype="bfloat16", dtype="bfloat16", remat="dots")
    tokens = args.batch * args.seq_len
    result = {
        "model": args.model,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "device": jax.devices()[0].device_kind,
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
        "flop_formula": "6 x params x tokens per step (attention FLOPs not counted)",
        "runs": {},
    }
    for name in ("galore_torch", "adamw_torch"):
        if not args.only or name in args.only:
            result["runs"][name] = derive(torch_peer(cfg, name, args), tokens, args.peak_tflops)
            print(name, json.dumps(result["runs"][name]), flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the peer's model and optimizer are gone with its frame
    for name, tx in optimizers(args.r_base, args.block_size).items():
        if not args.only or name in args.only:
            result["runs"][name] = derive(jax_side(cfg, name, tx, args), tokens, args.peak_tflops)
            print(name, json.dumps(result["runs"][name]), flush=True)
    runs = result["runs"]
    if "moara_full" in runs and "galore_torch" in runs:
        for key in ("tokens_per_s", "tokens_per_s_refresh_amortized"):
            result[f"moara_over_peer_{key}"] = runs["moara_full"][key] / runs["galore_torch"][key]
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
        plot(result, pathlib.Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
