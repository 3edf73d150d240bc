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
from moara_jax._labels import OTHER
from moara_jax._validate import is_int
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


# The paper's structural mapping between the donors of a Llama-style block and of MLA's (DeepSeek-V2
# donates from Q(b) and KV(b) where Llama donates from q and k, Section 4.1), both ways: an
# allocation profiled on one family applies to the other through it.
_PAIRS = list(zip(mj.DEFAULT_DONORS, mj.MLA_DONORS, strict=True))
STRUCTURAL = dict(_PAIRS) | {mla: llama for llama, mla in _PAIRS}


def paper_order(types) -> tuple[str, ...]:
    """Module type names in their model family's order (``moara_jax.LLAMA_MODULE_TYPES``: q k v o
    up gate down; an MLA model's ``MLA_MODULE_TYPES``: q_a q_b kv_a kv_b o up gate down), others
    after them by name."""
    types = set(types)
    mla = types & (set(mj.MLA_MODULE_TYPES) - set(mj.LLAMA_MODULE_TYPES))
    order = (*mj.MLA_MODULE_TYPES, *mj.LLAMA_MODULE_TYPES) if mla else mj.MODULE_TYPES
    known = tuple(dict.fromkeys(t for t in order if t in types))
    return known + tuple(sorted(types - set(known)))


def module_types(abstract_params) -> tuple[str, ...]:
    """The module types of a model's parameters, in the paper's order."""
    return paper_order(set(jax.tree.leaves(mj.label_tree(abstract_params))) - {OTHER})


def on_model(what: str, names: list[str], types: tuple[str, ...]) -> list[str]:
    """Module type ``names`` on a model of ``types``: one the model lacks by its structural
    counterpart (``STRUCTURAL``); one still missing, or two that land on the same type, refused
    (``ValueError`` naming ``what``)."""
    mapped = [n if n in types else STRUCTURAL.get(n, n) for n in names]
    missing = [n for n, m in zip(names, mapped, strict=True) if m not in types]
    if missing:
        raise ValueError(f"{what}: this model has no {missing}")
    if len(set(mapped)) != len(mapped):
        raise ValueError(f"{what}: {names} are the same module types of this model twice ({mapped})")
    return mapped


def _allocation_file(path: str) -> tuple[dict[str, int], int | None, list[str], list[str]]:
    """An allocation file's ranks, ``r_base`` (None where it has none), donors and receivers,
    each of the type it must have (a rank of 2.9, ``true`` or a string of names is refused)."""
    where = f"optimizer.rank_allocation: {path} is not a valid allocation file"
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{where} ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), dict) or not data["ranks"]:
        raise UserError(f'{where}: it holds no "ranks" object of module types and ranks')
    bad = {k: v for k, v in data["ranks"].items() if not is_int(v)}
    if bad:
        raise UserError(f"{where}: ranks must be positive integers, got {bad}")
    profiled = data.get("r_base")
    if profiled is not None and not is_int(profiled):
        raise UserError(f"{where}: r_base must be a positive integer, got {profiled!r}")
    groups = []
    for key in ("donors", "receivers"):
        names = data.get(key, [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UserError(f"{where}: {key} must be a list of module types, got {names!r}")
        groups.append(names)
    return dict(data["ranks"]), profiled, *groups


def read_allocation(path: str, r_base: int, types: tuple[str, ...]) -> dict[str, int]:
    """Per-module ranks for a model of module ``types`` from a profiling run's ``allocation.json``:
    its ranks where it was profiled at this ``r_base`` on these module types (they must keep the
    budget, ``len(types) * r_base``); otherwise its donors and receivers, with this ``r_base``'s
    transfer, on this model's types (the paper profiles Llama 2 350M once and keeps which types
    donate and receive at 1B and 7B, whose ranks follow their own ``r_base``, and on the other
    families, DeepSeek-V2's MLA through ``STRUCTURAL``)."""
    ranks, profiled, donors, receivers = _allocation_file(path)
    where = f"optimizer.rank_allocation: {path}"
    if set(ranks) == set(types) and profiled in (None, r_base):
        budget = len(types) * r_base
        if sum(ranks.values()) != budget:
            raise UserError(
                f"{where}: its ranks sum to {sum(ranks.values())}, not the budget of {len(types)} module "
                f"types x r_base {r_base} = {budget} (an allocation moves rank between module types, "
                "it adds none)"
            )
        return {t: ranks[t] for t in types}
    if not donors or not receivers:
        differs = []
        if profiled not in (None, r_base):
            differs.append(f"profiled at r_base {profiled}, this run's is {r_base}")
        if set(ranks) != set(types):
            differs.append(f"its module types are {list(ranks)}, this model's {list(types)}")
        raise UserError(
            f"{where}: {'; '.join(differs)}; it names no donors and receivers to move rank between "
            "on this run's"
        )
    try:
        donors = on_model("its donors", donors, types)
        receivers = on_model("its receivers", receivers, types)
        return mj.allocate_ranks(
            r_base, types, donors, receivers, donor_delta(r_base, len(donors), len(receivers))
        )
    except ValueError as e:
        raise UserError(f"{where}: {e} (this model's module types: {list(types)})") from None


@dataclass(frozen=True)
class Allocation:
    """``optimizer.rank_allocation``, interpreted (the one place that reads it)."""

    rule: bool  # the default rule: q/k donate half their rank to down
    ranks: dict[str, int] | None  # per-module ranks of a profiling run's allocation file

    @classmethod
    def of(cls, opt: OptimizerSection, abstract_params, *, profiling: bool = False) -> Allocation:
        """``uniform``, ``default`` or the path of an allocation file, for the model of
        ``abstract_params``; a profiling run (which measures uniform ranks) always gets uniform
        ranks, and AdamW (which has none) reads no file."""
        if profiling or opt.name == "adamw" or opt.rank_allocation == "uniform":
            return cls(False, None)
        if opt.rank_allocation == "default":
            return cls(True, None)
        if abstract_params is None:
            raise TypeError("an allocation file is read for a model: give its abstract_params")
        return cls(False, read_allocation(opt.rank_allocation, opt.r_base, module_types(abstract_params)))

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
    allocation: Allocation | None = None,
) -> optax.GradientTransformation:
    """AdamW, or GaLore/MoARa on the configured host (GaLore, Fira, Q-GaLore, OSD, LDAdam or
    SubTrack++), per the config; ``profiling``: what a profile measures, the configured host with
    uniform ranks and no decomposition. ``allocation``: ``optimizer.rank_allocation`` as
    ``Allocation.of`` reads it for the model (needed for an allocation file; else made here)."""
    if opt.name == "adamw":
        tx = mj.adamw(lr, opt.b1, opt.b2, opt.eps, opt.weight_decay, opt.mu_dtype, mask=decay_mask(opt))
    else:
        allocation = allocation or Allocation.of(opt, None, profiling=profiling)
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
            mu_dtype=opt.mu_dtype,
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


def global_norm(tree) -> jax.Array:
    """The gradients' global L2 norm in float32: each leaf's sum of squares summed in float32
    (``optax.tree_utils.tree_norm`` rounds each leaf's to its dtype, bf16's three digits, first)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_train_step(
    model_cfg: models.ModelConfig,
    tx: optax.GradientTransformation,
    micro_batches: int,
    alignment_block: int | None = None,
    with_alignment=False,
    alignment_every: int = 1,
):
    """``step(state, batch) -> (state, metrics)``; gradients are averaged over ``micro_batches``
    slices of the batch (gradient accumulation with ``lax.scan``). With ``with_alignment`` the
    metrics also hold ``S(W, t)`` of every projected matrix (profiling), measured at the steps
    ``alignment_every`` divides (the profile's recordings; zeros at the others, under a
    ``lax.cond``: at the wiki60m model and batch, a plain step of GaLore's profile launches 1627
    kernels measuring every step, 899 measuring every 20th, 843 not profiling;
    ``benchmarks/train_anatomy.py --profile-every``)."""

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
        metrics = {"loss": loss, "grad_norm": global_norm(grads)}
        if with_alignment:

            def measure():
                return mj.matrix_alignment(grads, opt_state, block_size=alignment_block)

            if alignment_every == 1:
                metrics["alignment"] = measure()
            else:
                shapes = jax.eval_shape(measure)
                metrics["alignment"] = jax.lax.cond(
                    (state.step + 1) % alignment_every == 0,
                    measure,
                    lambda: jax.tree.map(jnp.zeros_like, shapes),
                )
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


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every entry of every array in ``tree`` is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
