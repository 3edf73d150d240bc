"""Whole training steps of this project against its PyTorch peer, on the same device, in one run.

The peer: ``transformers``' model of the same config (``LlamaForCausalLM`` for Llama, the family's
own class for the others; causal SDPA attention, bf16, ``torch.compile``), trained with
``galore_torch.GaLoreAdamW`` on the paper's two parameter groups (attention and MLP matrices: rank
``--r-base``, T = 200, scale 0.25, ``proj_type='std'``; the rest plain) and with
``torch.optim.AdamW`` (fused on CUDA) as the full-rank reference. This project: AdamW, vanilla
GaLore and MoARa Full (``svd='eigh'``), one jitted donated step as ``python -m train`` runs it.
Both sides run the same shapes and the same tokens per optimizer step (the global batch in
micro-batches, gradients accumulated).

Per optimizer: median ms of a plain step (no basis refresh), tokens/s, MFU, peak device memory,
and tokens/s with the refresh amortized over T (a refresh step timed on its own: galore-torch's
per-matrix ``torch.linalg.svd`` at ``state['step'] % T == 0``, this project's batched ``eigh``
at ``count % T == 0``). MFU = 6 x N x tokens / step time / peak FLOP/s, N every parameter (the
embedding and LM head included; attention's own FLOPs left out), peak ``--peak-tflops`` (989.4:
an H100 or H200's dense bf16).

This project's step is compiled once per optimizer (plain and refresh steps run the same program);
its model takes ``--remat``, ``--attention``, ``--layers`` and ``--xla-flag-sets`` as
``train_step.py`` does. JAX's peak memory is the process's peak so far (``memory_stats``): run one
optimizer per process (``--only``) for each its own, as ``benchmarks/gpu_session.py`` does; the
compiled step's own peak (XLA's memory analysis) is recorded beside it. The peers run first, before
JAX starts its backend; when both sides share a process JAX allocates on demand
(``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless set) instead of taking 75% of the device at its start.
galore-torch's package imports bitsandbytes for its 8-bit optimizer; where that is missing,
``GaLoreAdamW`` is loaded from its own module without it.

Usage (on the GPU machine; galore-torch, transformers and torch must be installed):
  python benchmarks/vs_torch.py --model llama2-350m --batch 512 --micro-batch 128 --seq-len 256 \\
      [--steps 10] [--only galore_torch moara_full] [--out vs_torch.json]
CPU smoke run: --model llama2-tiny --batch 8 --micro-batch 4 --seq-len 32 --steps 2 --no-compile
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import time
import types

import jax
from _args import check_names, check_out, positive
from optimizer_step import GAP, with_count
from train_step import (
    add_step_arguments,
    apply_flag_sets,
    build_step,
    check_step_arguments,
    compiled_peak_bytes,
    describe,
    median_ms,
    model_config,
    optimizers,
)

import models
from train.plots import figure

GALORE_MODULES = ("self_attn", "mlp")  # the paper's low-rank group: every attention and MLP matrix


def paper_groups(model) -> tuple[list, list]:
    """The paper's two parameter groups of an HF model: the attention and MLP matrices (GaLore's
    low-rank group), and everything else (embedding, norms, LM head)."""
    low_rank = [p for n, p in model.named_parameters() if p.ndim == 2 and any(m in n for m in GALORE_MODULES)]
    ids = {id(p) for p in low_rank}
    return low_rank, [p for p in model.parameters() if id(p) not in ids]


def galore_adamw():
    """``galore_torch.GaLoreAdamW``; loaded from its module alone where the package's ``__init__``
    fails for lack of bitsandbytes (which only its 8-bit optimizer needs)."""
    try:
        from galore_torch import GaLoreAdamW
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "bitsandbytes":
            raise
        spec = importlib.util.find_spec("galore_torch")
        if spec is None or not spec.submodule_search_locations:
            raise
        package = types.ModuleType("galore_torch")  # the package without its __init__
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["galore_torch"] = package
        GaLoreAdamW = importlib.import_module("galore_torch.adamw").AdamW
    return GaLoreAdamW


# The peer's attention: SDPA told the attention is causal, with no mask tensor. transformers' own
# "sdpa" builds a (batch, 1, T, T) mask while torch.compile traces (it cannot tell a tracer from
# torch.export before torch 2.14) and passes it with is_causal=False, which rules out SDPA's flash
# kernel on CUDA. The peer's tokens are never padded, so causal is the whole mask.
CAUSAL_SDPA = "sdpa_causal"


def _register_causal_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, **kwargs):
        del attention_mask  # None: the mask function below makes none
        return sdpa_attention_forward(module, query, key, value, None, **{**kwargs, "is_causal": True})

    AttentionInterface.register(CAUSAL_SDPA, attention)
    AttentionMaskInterface.register(CAUSAL_SDPA, lambda *args, **kwargs: None)


def peer_model(cfg, device: str = "cpu", dtype=None):
    """The ``transformers`` model of ``cfg`` (its family's class: ``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``, ...), with causal SDPA attention (``CAUSAL_SDPA``) and no key/value
    cache, built on ``device`` in ``dtype`` (default float32)."""
    import torch
    import transformers

    _register_causal_sdpa()
    hf_config = models.to_hf_config(cfg)
    hf_config._attn_implementation = CAUSAL_SDPA
    hf_config.use_cache = False  # training: no key/value cache returned
    with torch.device(device):  # built where it runs: 5.4 GB of float32 at 1B not made on the host
        return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype or torch.float32)


def torch_peer(cfg, optimizer: str, args) -> dict:
    """The PyTorch peer at ``--micro-batch``, or where that runs out of device memory (the peer has
    no remat) at the largest half of it that fits: the row says which (``micro_batch``)."""
    import torch

    micro_batch = args.micro_batch
    while True:
        try:
            return _torch_peer_at(cfg, optimizer, args, micro_batch)
        except torch.OutOfMemoryError:
            if micro_batch % 2:
                raise
        # Outside the handler, whose traceback held the failed attempt's model and optimizer.
        print(f"{optimizer}: out of memory at micro-batch {micro_batch}, trying {micro_batch // 2}")
        micro_batch //= 2
        torch.compiler.reset()  # the compiled graphs of the failed attempt
        gc.collect()
        torch.cuda.empty_cache()


def _torch_peer_at(cfg, optimizer: str, args, micro_batch: int) -> dict:
    """Median plain-step and refresh-step ms, peak memory of the PyTorch peer."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = peer_model(cfg, device, torch.bfloat16)
    low_rank, rest = paper_groups(model)
    if optimizer == "galore_torch":
        GaLoreAdamW = galore_adamw()
        groups = [
            {"params": rest},
            {
                "params": low_rank,
                "rank": args.r_base,
                "update_proj_gap": GAP,
                "scale": 0.25,
                "proj_type": "std",
            },
        ]
        opt = GaLoreAdamW(groups, lr=0.01, eps=1e-6, weight_decay=0.0, no_deprecation_warning=True)
    else:
        opt = torch.optim.AdamW(
            model.parameters(), lr=0.01, eps=1e-6, weight_decay=0.0, fused=device == "cuda"
        )
    micro = args.batch // micro_batch
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g).to(device)

    def chunk_loss(chunk):
        logits = model(input_ids=chunk[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten()) / micro

    # The loss compiled with the model, as this project's step has its loss in the same program:
    # Inductor fuses the float32 cast into the cross entropy instead of keeping a float32 copy
    # of the logits (4.2 GB at micro-batch 128) for the backward.
    loss_of = torch.compile(chunk_loss) if args.compile else chunk_loss

    def step():
        for chunk in tokens.chunk(micro):
            loss = loss_of(chunk)
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
                opt.state[p]["step"] = GAP * (1 + opt.state[p]["step"] // GAP)

    refresh = plain
    if optimizer == "galore_torch":  # its first refresh, untimed, was the warm-up's step 0
        refresh = statistics.median(timed(args.refresh_steps, due))
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "plain_ms": plain,
        "refresh_ms": refresh,
        "peak_memory_bytes": peak,
        "params": n_params,
        "micro_batch": micro_batch,
    }


def jax_side(cfg, name: str, tx, args) -> dict:
    """Median plain-step and refresh-step ms of this project's step, compiled once, and its memory."""
    step, state, tokens = build_step(cfg, tx, args.batch, args.micro_batch, args.seq_len)
    plain, state = median_ms(step, state, tokens, args.steps, args.warmup)
    refresh = plain
    # Every optimizer counter on a refresh (count % T == 0) before each step; the first refresh is
    # untimed (the counters started at 1: none came in the warm-up), as the peer's step 0 is.
    if name != "adamw":

        def due(s):
            return s._replace(opt_state=with_count(s.opt_state, 0))

        refresh, state = median_ms(step, state, tokens, args.refresh_steps, 1, before=due)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "plain_ms": plain,
        "refresh_ms": refresh,
        "peak_memory_bytes": stats.get("peak_bytes_in_use"),
        "compiled_peak_bytes": compiled_peak_bytes(step),
        "params": models.param_count(cfg),
        "micro_batch": args.micro_batch,
    }


def derive(row: dict, tokens: int, peak_tflops: float, gap: int = GAP) -> dict:
    amortized = row["plain_ms"] + (row["refresh_ms"] - row["plain_ms"]) / gap
    return {
        **row,
        "tokens_per_s": tokens / row["plain_ms"] * 1e3,
        "tokens_per_s_refresh_amortized": tokens / amortized * 1e3,
        "mfu": 6 * row["params"] * tokens / (row["plain_ms"] * 1e-3) / (peak_tflops * 1e12),
    }


def ratios(runs: dict) -> dict:
    """Issue 22's figures from the runs there are: MoARa Full's tokens/s over the peer's GaLore
    (plain steps, and the refresh amortized), and its step time over this project's vanilla
    GaLore with the refresh amortized."""
    out = {}
    if "moara_full" in runs and "galore_torch" in runs:
        for key in ("tokens_per_s", "tokens_per_s_refresh_amortized"):
            out[f"moara_over_peer_{key}"] = runs["moara_full"][key] / runs["galore_torch"][key]
    if "moara_full" in runs and "galore_vanilla" in runs:
        key = "tokens_per_s_refresh_amortized"
        out["moara_step_time_over_galore_refresh_amortized"] = (
            runs["galore_vanilla"][key] / runs["moara_full"][key]
        )
    return out


def plot(result: dict, path: pathlib.Path) -> None:
    fig = figure("chart", figsize=(8, 4))
    if fig is None:
        return
    names = list(result["runs"])
    ax = fig.subplots()
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [result["runs"][n]["tokens_per_s"] for n in names], 0.4, label="plain step")
    ax.bar(
        [i + 0.2 for i in x],
        [result["runs"][n]["tokens_per_s_refresh_amortized"] for n in names],
        0.4,
        label=f"refresh amortized over T = {GAP}",
    )
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{result['model']}, batch {result['batch']} x {result['seq_len']}, {result['device']}")
    ax.legend()
    fig.savefig(path, dpi=120)


def _installed_version(package: str) -> str | None:
    """The installed version of ``package`` (None where it is not), without importing it: a run of
    the JAX side alone records the torch its peers' runs had."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


PEERS = ("galore_torch", "adamw_torch")
JAX_RUNS = ("adamw", "galore_vanilla", "moara_full")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser, steps=10, warmup=3)
    parser.add_argument("--refresh-steps", type=positive, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.4)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="the peer runs eagerly")
    parser.add_argument("--only", nargs="*", help=f"subset of {', '.join(PEERS + JAX_RUNS)}")
    parser.add_argument("--out", default=None, help="JSON path (a PNG chart goes beside it)")
    args = parser.parse_args()
    check_step_arguments(parser, args)
    check_names(parser, "--only", args.only, PEERS + JAX_RUNS)
    check_out(parser, args.out)
    wanted = [n for n in PEERS + JAX_RUNS if not args.only or n in args.only]
    peers, ours = [n for n in wanted if n in PEERS], [n for n in wanted if n in JAX_RUNS]
    needed = ["torch", "transformers"] * bool(peers) + ["galore_torch"] * ("galore_torch" in peers)
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(
            f"error: the peer runs ({', '.join(peers)}) need {', '.join(missing)}: pip install "
            f"{' '.join(missing).replace('_', '-')} (or --only {' '.join(ours) or 'moara_full'})"
        )
    if peers and ours:  # JAX's backend starts after the peers ran: let it allocate on demand
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    flags = apply_flag_sets(args.xla_flag_sets)
    torch = importlib.import_module("torch") if peers else None  # not for the JAX side alone

    cfg = model_config(args)
    tokens = args.batch * args.seq_len
    result = {
        "model": args.model,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "versions": {"jax": jax.__version__, "torch": _installed_version("torch")},
        "date": time.strftime("%Y-%m-%d"),
        "flop_formula": "6 x params x tokens per step (attention FLOPs not counted)",
        "xla_flags_added": flags,
        "jax_preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true"),
        "runs": {},
    }
    for name in peers:
        result["runs"][name] = derive(torch_peer(cfg, name, args), tokens, args.peak_tflops)
        print(name, json.dumps(result["runs"][name]), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the peer's model and optimizer are gone with its frame
    if ours:
        result["jax_model"] = describe(cfg)  # starts JAX's backend
    all_tx = optimizers(args.r_base, args.block_size)
    for name in ours:
        result["runs"][name] = derive(jax_side(cfg, name, all_tx[name], args), tokens, args.peak_tflops)
        print(name, json.dumps(result["runs"][name]), flush=True)
    if ours:
        result["device"] = jax.devices()[0].device_kind
    else:
        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result.update(ratios(result["runs"]))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
        plot(result, pathlib.Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
