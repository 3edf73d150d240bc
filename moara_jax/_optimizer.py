"""``moara_adamw``: the user-level optimizer (MoARa or GaLore on target modules, AdamW elsewhere)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from moara_jax._allocation import resolve_module_ranks, tree_ranks, type_names
from moara_jax._chain import direction_chain
from moara_jax._labels import MODULE_TYPES, OTHER, label_tree, module_label
from moara_jax._matrices import MatrixAxesOrFn, as_matrices
from moara_jax._sharding import placing
from moara_jax._validate import check_block_size
from moara_jax.hosts import Host, StageOptions, resolve_host
from moara_jax.hosts._base import decay_mask_fn, is_zero, with_decay_mask

TARGET = "target"


# moara_adamw's arguments that shape the optimizer (ranks, blocks, the refresh period, the labels,
# the weight-decay mask): ``static_args`` for ``optax.inject_hyperparams``, which would otherwise
# inject every numeric or boolean default as an array and call ``label_fn`` as a schedule.
MOARA_ADAMW_STATIC_ARGS = (
    "r_base",
    "block_size",
    "decompose",
    "rank_allocation",
    "delta",
    "update_proj_gap",
    "seed",
    "canonical_signs",
    "label_fn",
    "host",
    "matrix_axes",
    "weight_decay_mask",
    "mu_dtype",
    "mag_dtype",
)


@placing  # the state placed as the parameters are; Explicit mesh axes (moara_jax._sharding)
def moara_adamw(
    learning_rate: optax.ScalarOrSchedule,
    *,
    r_base: int,
    block_size: int | None = None,
    decompose: bool = True,
    rank_allocation: bool = True,
    ranks: Mapping[str, int] | None = None,
    donors: Iterable[str] | None = None,
    receivers: Iterable[str] | None = None,
    delta: int | None = None,
    update_proj_gap: int = StageOptions.update_proj_gap,
    scale: float = StageOptions.scale,
    b1: float = StageOptions.b1,
    b2: float = StageOptions.b2,
    eps: float = StageOptions.eps,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: Any = StageOptions.mu_dtype,
    mag_dtype: Any = StageOptions.mag_dtype,
    svd: str = StageOptions.svd,
    seed: int = StageOptions.seed,
    canonical_signs: bool = StageOptions.canonical_signs,
    label_fn: Callable[[Any], str] = module_label,
    host: str | Host = "galore",
    matrix_axes: MatrixAxesOrFn | None = None,
) -> optax.GradientTransformation:
    """MoARa-AdamW: per-module-rank GaLore projection with optional block decomposition.

    Parameters whose path ``label_fn`` maps to a module type (``q k v o up gate down``, MLA's
    ``q_a q_b kv_a kv_b``) and that are matrices get :func:`scale_by_moara` (``decompose=True``) or
    :func:`scale_by_galore`, with their module type's rank; every other parameter gets AdamW. On
    the default host all Adams use galore-torch's formulation, so ``decompose=False,
    rank_allocation=False`` is galore-torch's ``GaLoreAdamW`` with the paper's two parameter groups.

    The paper's four conditions: vanilla GaLore (``decompose=False, rank_allocation=False``),
    +Rank (``decompose=False``), +Decomp (``rank_allocation=False``), Full (defaults).
    ``host`` runs the same four conditions on another low-rank method (the paper's cross-method
    study): ``'fira'`` (``fira.FiraAdamW`` with both flags off), ``'q_galore'``
    (q-galore-torch's ``QGaLoreAdamW8bit``: INT4 bases with layer-adaptive refresh, 8-bit
    Adam for every parameter, INT8 target weights), ``'osd'`` (Online Subspace Descent),
    ``'ldadam'`` (``LDAdamW``'s method: a basis moving every step, transported moments, error
    feedback; with this function's defaults, not LDAdamW's scale 1, b1 0.908, b2 0.99 and eps
    1e-8) or ``'subtrack_pp'`` (SubTrack++'s Grassmann tracking), or their settings objects
    (:class:`Fira`, :class:`QGaLore`, :class:`OSD`, :class:`LDAdam`, :class:`SubTrackPP`).

    To change ``learning_rate``, ``b1``, ``b2``, ``eps``, ``scale`` or ``weight_decay`` during
    training, wrap it in ``optax.inject_hyperparams(moara_adamw,
    static_args=MOARA_ADAMW_STATIC_ARGS)``; with bf16 parameters also pass
    ``hyperparam_dtype=jnp.float32`` (in bf16, ``b2 = 0.999`` rounds to 1).

    Args:
      learning_rate: a float or an optax schedule.
      r_base: the uniform baseline rank.
      block_size: the decomposition block size ``B`` (required when ``decompose``).
      decompose: carry block magnitudes outside the projection.
      rank_allocation: move rank from donors to receivers (``allocate_ranks``).
      ranks: explicit per-module-type ranks (e.g. a profiled allocation); overrides the rule.
        Module types it does not name get ``r_base``.
      donors, receivers, delta: the allocation rule; donors default to ``('q', 'k')``, or
        ``('q_b', 'kv_b')`` for MLA models, receivers to ``('down',)``. Types named here must
        be in the parameters (``ValueError`` at init otherwise; with the default labels, at once
        for a name that is no module type).
      update_proj_gap, scale: GaLore's refresh interval ``T`` and scale.
      b1, b2, eps: Adam hyperparameters (paper: 0.9, 0.999, 1e-6).
      weight_decay: decoupled weight decay on every parameter (those ``weight_decay_mask``
        marks), applied after the step as in galore-torch (``p <- (p + step) (1 - lr * wd)``,
        :func:`decay_after_step`); before it under LDAdam (all parameters) and Q-GaLore
        (non-targets), as their references do.
      weight_decay_mask: which parameters ``weight_decay`` applies to, as ``optax.adamw``'s
        ``mask``: a tree of booleans with the parameters' structure (or a prefix of it), or a
        function of the parameters returning one (under ``matrix_axes`` it is given the matrix
        views); ``None`` decays every parameter. Pretraining usually decays only the matrices:
        ``lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)`` leaves norms and biases undecayed
        (a stacked layer axis, as of ``nn.scan``, makes a norm 2-D: count it out). Masked-out
        parameters step as with ``weight_decay=0``, on every host.
      mu_dtype: moment dtype; ``None`` follows the parameter dtype (float32 for float16
        parameters, whose moments would underflow).
      mag_dtype: the dtype of the block magnitudes' Adam moments (``decompose``; float32,
        the paper's).
      svd: ``'exact'`` (SVD), ``'eigh'`` (Gram eigendecomposition, fast on GPU) or
        ``'randomized'`` basis refresh; see :func:`project`.
      seed: seeds the randomized refresh (``svd='randomized'``, folded with the step) on every
        host, and Q-GaLore's stochastic rounding of the target weights; unused otherwise.
      canonical_signs: make each basis vector's largest entry positive (backend-independent).
      label_fn: maps a parameter path (JAX key path) to a module type or ``'other'``. The
        default, :func:`module_label`, targets HF-named ``kernel`` leaves in Flax layout
        ``(..., fan_in, fan_out)`` (boxed ones too; not PyTorch-layout ``weight`` leaves).
        ``init`` warns when no parameter is a target, and when rank allocation is on but the
        model has none of the default donors or receivers (no rank moves).
      host: the low-rank method: ``'galore'``, ``'fira'``, ``'q_galore'``, ``'osd'``, ``'ldadam'``,
        ``'subtrack_pp'``, a registered host's name or a settings object
        (:mod:`moara_jax.hosts`); the host says what the other parameters get and where weight
        decay goes. Under Q-GaLore the non-target AdamW is bitsandbytes' 8-bit one, with its
        weight decay before the step; under LDAdam every Adam is PyTorch's ``AdamW`` formula and
        all weight decay comes before the step.
      matrix_axes: which axes of a multi-axis kernel are its matrix (:class:`MatrixAxes`): a tree
        of ``MatrixAxes`` or ``None`` matched to the parameters by path (an entry stands for its
        subtree), or a function of the parameters (also called on the updates) returning one
        (:func:`as_matrices`). By default a target's last two axes are its
        ``(fan_in, fan_out)`` and leading axes are stacked layers; Flax's multi-head attention
        kernels ``(embed, heads, head_dim)`` and ``(heads, head_dim, embed)`` need
        ``MatrixAxes(fan_in=-3, fan_out=(-2, -1))`` and ``MatrixAxes(fan_in=(-3, -2),
        fan_out=-1)``; pass the same to :func:`module_alignment` and :func:`rank_table`.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> params = {
      ...     "self_attn": {"q_proj": {"kernel": jnp.ones((32, 32))}},
      ...     "mlp": {"down_proj": {"kernel": jnp.ones((64, 32))}},
      ...     "norm": jnp.ones(32),
      ... }
      >>> tx = moara_adamw(1e-3, r_base=8, block_size=16)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> params = optax.apply_updates(params, updates)
    """
    # The target matrices' stage options; their rank is set per module type once the model's
    # module types are known (``build``), r_base until then.
    options = StageOptions(
        rank=r_base,
        update_proj_gap=update_proj_gap,
        scale=scale,
        b1=b1,
        b2=b2,
        eps=eps,
        mu_dtype=mu_dtype,
        mag_dtype=mag_dtype,
        svd=svd,
        seed=seed,
        canonical_signs=canonical_signs,
        name=label_fn,
    )
    host = resolve_host(host).with_learning_rate(learning_rate, update_proj_gap)
    # With no weight decay a mask changes nothing (a host written before masks then takes one).
    decay_mask = None if is_zero(weight_decay) else decay_mask_fn(weight_decay_mask)
    if block_size is not None:  # checked whether or not it is used
        check_block_size(block_size)
    elif decompose:
        raise ValueError("block_size is required when decompose=True")
    allocation = _allocation_arguments(r_base, rank_allocation, ranks, donors, receivers, delta, label_fn)

    # A host whose methods predate weight-decay masks is called as before; given a mask to use, refused.
    other = with_decay_mask(host, "other_adam", decay_mask, b1, b2, eps, mu_dtype, weight_decay)

    def build(tree, warn: bool = False) -> optax.GradientTransformation:
        labels, module_ranks = tree_ranks(tree, label_fn, warn=warn, **allocation)
        # One transform over all target matrices (ranks per leaf): one refresh cond per step and
        # SVD batches shared across module types of the same shape.
        rank_of = lambda path: module_ranks[label_fn(path)]  # noqa: E731
        target_options = dataclasses.replace(options, rank=rank_of)
        target = direction_chain(host, target_options, block_size if decompose else None)
        groups = jax.tree.map(lambda lab: OTHER if lab == OTHER else TARGET, labels)
        return optax.partition({TARGET: target, OTHER: other}, groups)

    def init_fn(params):
        _refuse_discrete_targets(params, label_fn)
        # Warns (once per init, not per update) when no parameter is a target, or when the
        # requested allocation finds no donors or receivers and moves no rank.
        return build(params, warn=True).init(params)

    def update_fn(updates, state, params=None):
        return build(updates).update(updates, state, params)

    def targets(tree):
        return jax.tree.map(lambda lab: lab != OTHER, label_tree(tree, label_fn))

    finish = with_decay_mask(host, "finish", decay_mask, learning_rate, weight_decay, targets, seed)
    directions = optax.GradientTransformation(init_fn, update_fn)
    tx = optax.chain(directions, *finish)
    return tx if matrix_axes is None else as_matrices(tx, matrix_axes)


def _allocation_arguments(r_base, rank_allocation, ranks, donors, receivers, delta, label_fn) -> dict:
    """The rank arguments as :func:`tree_ranks` takes them, checked now, not at the first update,
    on a block with every module type the labels can name (with a custom ``label_fn``, also the
    types named here); whether the model has the donors and receivers is checked at init."""
    donors = None if donors is None else type_names("donors", donors)
    receivers = None if receivers is None else type_names("receivers", receivers)
    allocation = dict(
        r_base=r_base,
        rank_allocation=rank_allocation,
        ranks=ranks,
        donors=donors,
        receivers=receivers,
        delta=delta,
    )
    known = MODULE_TYPES if label_fn is module_label else (*MODULE_TYPES, *(donors or ()), *(receivers or ()))
    resolve_module_ranks(known, present=False, **allocation)
    if ranks is not None and label_fn is module_label:
        unknown = sorted(set(ranks) - set(MODULE_TYPES))
        if unknown:
            raise ValueError(f"ranks: unknown module types {unknown}; known: {list(MODULE_TYPES)}")
    return allocation


def _refuse_discrete_targets(params, label_fn) -> None:
    """A target matrix (a leaf the labels give a module type) of an integer or boolean dtype,
    refused naming it: it has no gradient to project (OSD failed deep in JAX, the other hosts
    gave it a float step to truncate). The labels come from the updates' tree at each step,
    whose dtype is the gradients', so such a leaf cannot be left out there instead."""
    labels = jax.tree.leaves(label_tree(params, label_fn))
    for (path, x), label in zip(jax.tree_util.tree_leaves_with_path(params), labels, strict=True):
        dtype = jnp.result_type(x)
        if label != OTHER and not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                f"{jax.tree_util.keystr(path)} is {dtype} and labelled {label!r}: a target matrix "
                f"must be floating point; a label_fn that gives it {OTHER!r} leaves it to AdamW"
            )
