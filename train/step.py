"""The optimizer, schedule and the pure train/eval step functions (jitted by the loop)."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import moara_jax as mj
import models
from train.config import OptimizerSection, RunConfig, host_settings
from train.errors import UserError


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar
    params: Any
    opt_state: Any


def schedule(cfg: RunConfig) -> optax.Schedule:
    """Linear warmup to ``train.lr`` over ``warmup_ratio`` of the steps, then cosine to
    ``min_lr_ratio * lr`` (the paper's Appendix D)."""
    t = cfg.train
    warmup = round(t.warmup_ratio * t.steps)  # the nearest step: 0.29 x 100 is 28.999999999999996
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1),
        end_value=t.lr * t.min_lr_ratio,
    )


def donor_delta(r_base: int, donors: int, receivers: int) -> int:
    """The rank each donor gives (``delta``): ``r_base // 2``, lowered until the receivers share
    ``delta * donors`` evenly."""
    delta = r_base // 2
    while delta and (delta * donors) % max(receivers, 1):
        delta -= 1
    return delta


def read_allocation(path: str, r_base: int) -> dict[str, int]:
    """Per-module ranks from a profiling run's ``allocation.json``: its ranks where it was profiled
    at this ``r_base``; at another (the paper profiles 350M once and keeps which module types
    donate and receive at 1B and 7B, whose ranks follow their own ``r_base``), its donors and
    receivers with this ``r_base``'s transfer."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
        ranks = {str(k): int(v) for k, v in data["ranks"].items()}
        profiled = int(data.get("r_base", r_base))
        donors, receivers = ([str(t) for t in data.get(key) or ()] for key in ("donors", "receivers"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"optimizer.rank_allocation: {path} is not a valid allocation file ({e})") from None
    if profiled == r_base:
        return ranks
    if not donors or not receivers:
        raise UserError(
            f"optimizer.rank_allocation: {path} was profiled at r_base {profiled}, this run's is "
            f"{r_base}, and it names no donors and receivers to move rank between at {r_base}"
        )
    try:
        return mj.allocate_ranks(
            r_base, list(ranks), donors, receivers, donor_delta(r_base, len(donors), len(receivers))
        )
    except ValueError as e:
        raise UserError(f"optimizer.rank_allocation: {path}: {e}") from None


@dataclass(frozen=True)
class Allocation:
    """``optimizer.rank_allocation``, interpreted (the one place that reads it)."""

    rule: bool  # the default rule: q/k donate half their rank to down
    ranks: dict[str, int] | None  # per-module ranks of a profiling run's allocation file

    @classmethod
    def of(cls, opt: OptimizerSection, profiling: bool = False) -> Allocation:
        """``uniform``, ``default`` or the path of an allocation file; a profiling run (which
        measures uniform-rank GaLore) always gets uniform ranks."""
        if profiling or opt.rank_allocation == "uniform":
            return cls(False, None)
        if opt.rank_allocation == "default":
            return cls(True, None)
        return cls(False, read_allocation(opt.rank_allocation, opt.r_base))

    def table(self, opt: OptimizerSection, abstract_params) -> list[dict]:
        """``moara_jax.rank_table`` of a model's parameters under this allocation."""
        return mj.rank_table(abstract_params, r_base=opt.r_base, rank_allocation=self.rule, ranks=self.ranks)


def decay_mask(opt: OptimizerSection):
    """``optimizer.weight_decay_mask`` as the optimizers take it: ``None`` (every parameter) or,
    for ``matrices``, a function marking the parameters of 2 or more dimensions per layer (the
    layer axis of a scanned model's ``layers`` not counted), so no norm or bias."""
    if opt.weight_decay_mask == "all":
        return None

    def matrix(path, x) -> bool:
        stacked = mj.path_names(path)[:1] == ("layers",)  # nn.scan's layer axis in front
        return x.ndim - int(stacked) >= 2

    return lambda params: jax.tree_util.tree_map_with_path(matrix, params)


def make_optimizer(
    opt: OptimizerSection,
    lr: optax.ScalarOrSchedule,
    grad_clip: float,
    *,
    profiling: bool = False,
    peak_lr: float | None = None,
) -> optax.GradientTransformation:
    """AdamW, or GaLore/MoARa on the configured host (GaLore, Fira, Q-GaLore, OSD, LDAdam or
    SubTrack++), per the config; ``profiling``: uniform-rank GaLore (what a profile measures)."""
    if opt.name == "adamw":
        tx = mj.adamw(lr, opt.b1, opt.b2, opt.eps, opt.weight_decay, mask=decay_mask(opt))
    else:
        allocation = Allocation.of(opt, profiling)
        tx = mj.moara_adamw(
            lr,
            r_base=opt.r_base,
            block_size=opt.block_size,
            decompose=opt.name == "moara" and opt.decompose and not profiling,
            rank_allocation=allocation.rule,
            ranks=allocation.ranks,
            update_proj_gap=opt.update_proj_gap,
            scale=opt.scale,
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            weight_decay_mask=decay_mask(opt),
            svd=opt.svd,
            host=host_settings(opt, peak_lr),
        )
    if grad_clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(grad_clip), tx)
    return tx


def loss_fn(model_cfg: models.ModelConfig, params, batch: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of ``batch (B, seq_len + 1)`` (in chunks of
    ``model_cfg.loss_chunk`` positions where set)."""
    return models.cross_entropy(model_cfg, params, batch[:, :-1], batch[:, 1:])


def make_train_step(
    model_cfg: models.ModelConfig,
    tx: optax.GradientTransformation,
    micro_batches: int,
    alignment_block: int | None = None,
    with_alignment=False,
):
    """``step(state, batch) -> (state, metrics)``; gradients are averaged over ``micro_batches``
    slices of the batch (gradient accumulation with ``lax.scan``). With ``with_alignment`` the
    metrics also hold ``S(W, t)`` of every projected matrix (profiling)."""

    grad_fn = jax.value_and_grad(lambda p, b: loss_fn(model_cfg, p, b))

    def step(state: TrainState, batch: jax.Array):
        if micro_batches == 1:
            loss, grads = grad_fn(state.params, batch)
        else:
            # Strided micro-batches (rows i, i + k, i + 2k, ...): each keeps the batch's split
            # over the data-parallel devices, where contiguous slices would sit on a subset of
            # them and need an all-gather.
            micro = batch.reshape((-1, micro_batches) + batch.shape[1:]).swapaxes(0, 1)

            def accumulate(carry, mb):
                loss, grads = grad_fn(state.params, mb)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = (
                jnp.zeros([], jnp.float32),
                jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params),
            )
            (loss, grads), _ = jax.lax.scan(accumulate, zeros, micro)
            loss = loss / micro_batches
            grads = jax.tree.map(lambda g, p: (g / micro_batches).astype(p.dtype), grads, state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree_utils.tree_norm(grads)}
        if with_alignment:
            metrics["alignment"] = mj.matrix_alignment(grads, opt_state, block_size=alignment_block)
        return TrainState(state.step + 1, params, opt_state), metrics

    return step


def make_eval_step(model_cfg: models.ModelConfig):
    """``eval_step(params, batch, weights) -> (nll_sum, tokens)``: the next-token cross entropy of
    ``batch (B, seq_len + 1)`` summed over its positions with each row weighted by ``weights (B,)``
    (0 for a row that only fills the batch up), and the number of tokens so counted."""

    def eval_step(params, batch, weights):
        nll = models.token_nll(model_cfg, params, batch[:, :-1], batch[:, 1:])
        return jnp.sum(nll.sum(axis=1) * weights), jnp.sum(weights) * nll.shape[1]

    return eval_step


def mean_nll(eval_step, params, batches) -> float:
    """The mean next-token cross entropy over every counted token of ``batches`` (pairs of
    windows and row weights, as ``Data.val_batches`` gives them) under ``eval_step`` (from
    ``make_eval_step``, jitted). Every batch is dispatched before the first is read: the host
    waits on the device once."""
    sums = jax.device_get([eval_step(params, b, w) for b, w in batches])
    return float(sum(float(x) for x, _ in sums) / sum(float(n) for _, n in sums))
