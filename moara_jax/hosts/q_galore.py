"""Q-GaLore's projection and weight quantization (Zhang et al., https://arxiv.org/abs/2407.08296).

- :func:`q_galore_project`: GaLore's projection with the basis stored group-quantized (INT4 by
  default) and a layer-adaptive refresh: each matrix records the cosine between the first basis
  vector of consecutive refreshes; once its last ``queue_size`` cosines average at least
  ``cos_threshold``, its refresh interval is multiplied by ``gamma`` (and again at later
  refreshes while that holds). A matrix refreshes when the step is a multiple of its own interval.
- :func:`quantize_weights`: each update ``u`` becomes ``Q(p + u) - p``, with ``Q`` group-wise
  INT8 min-max quantization (stochastic rounding by default), so that the parameters stay on
  the INT8 grid as in q-galore-torch's simulated INT8 weights.

Both follow the reference package ``q_galore_torch`` (its ``GaLoreProjector`` and the simulated
``QGaLoreAdamW8bit``), tested against it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections import defaultdict
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moara_jax._adam import decay_after_step
from moara_jax._labels import unboxed
from moara_jax._nodes import LowRank, is_node
from moara_jax._projection import (
    basis_shape,
    emit,
    grouped_rank_warnings,
    matrix_of,
    path_str,
    project_value,
    projection_side,
    refresh_bases,
    refresh_matrix,
    stage_settings,
    state_ranks,
    step_key,
)
from moara_jax._quant import (
    adam8bit,
    flax_serializable,
    group_dequantize,
    group_quantize,
    unit_flat,
    unit_restore,
)
from moara_jax._validate import in_made_form_on_update, is_int
from moara_jax.hosts._base import Host, StageOptions, is_zero, real_number


@flax_serializable("codes", "scales", "zeros")
@jax.tree_util.register_pytree_node_class
class QuantizedBasis:
    """A projection basis ``(..., d, r)`` stored as ``bits``-bit group codes (uint8), with a
    float32 scale and zero point per group of ``group_size`` entries of each matrix in PyTorch
    orientation (``basis^T`` for a projected fan_in side, ``basis`` for fan_out). ``shape``,
    ``side``, ``bits``, ``group_size`` and ``dtype`` (the float basis's) are static."""

    def __init__(self, codes, scales, zeros, shape, side, bits, group_size, dtype):
        self.codes, self.scales, self.zeros = codes, scales, zeros
        self.shape, self.side, self.bits = tuple(shape), side, bits
        self.group_size, self.dtype = group_size, jnp.dtype(dtype).name

    def tree_flatten(self):
        aux = (self.shape, self.side, self.bits, self.group_size, self.dtype)
        return (self.codes, self.scales, self.zeros), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @classmethod
    def quantize(cls, basis: jax.Array, side: str, bits: int, group_size: int) -> QuantizedBasis:
        flat = unit_flat(basis, basis.ndim - 2, transpose=side == "in")
        codes, scales, zeros = group_quantize(flat, group_size, bits)
        return cls(codes, scales, zeros, basis.shape, side, bits, group_size, basis.dtype)

    def dequantize(self) -> jax.Array:
        flat = group_dequantize(self.codes, self.scales, self.zeros).astype(self.dtype)
        return unit_restore(flat, self.shape, transpose=self.side == "in")

    def __repr__(self) -> str:
        return f"QuantizedBasis(shape={self.shape}, bits={self.bits})"


def dequantized(basis: Any) -> jax.Array | jax.ShapeDtypeStruct:
    """The float basis of a stored one (a :class:`QuantizedBasis`, or an array as it is); of an
    abstract one (``jax.eval_shape``'s), its shape and dtype."""
    if not isinstance(basis, QuantizedBasis):
        return basis
    if isinstance(basis.codes, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(basis.shape, basis.dtype)
    return basis.dequantize()


class QGaLoreProjectState(NamedTuple):
    """State of :func:`q_galore_project` (per target leaf, over its leading batch axes)."""

    count: jax.Array  # shape=(), dtype=jnp.int32: steps taken.
    basis: Any  # QuantizedBasis (or the float basis with bits=None), (..., d, r).
    gap: Any  # int32 (...): each matrix's refresh interval.
    cosines: Any  # float32 (..., queue_size): the last cosines between refreshes, oldest first.
    refreshes: Any  # int32 (...): refreshes so far.
    top: Any  # float32 (..., d): the first basis vector of the last refresh.


def _cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    dot = jnp.sum(a * b, axis=-1)
    return dot / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-8)


MAX_INTERVALS = 1 << 16
_INT32_MAX = 2**31 - 1


def refresh_intervals(update_proj_gap: int, gamma: float) -> np.ndarray:
    """The refresh intervals a matrix goes through: ``T``, then ``int(gap * gamma)`` at each
    growth, in float64 as q-galore-torch computes it (float32 rounds some products down: 90 x 1.3
    gave 116, not 117, and the schedule drifted from there), until the interval stops growing or
    passes the int32 step counter (then the counter's largest value: no refresh again)."""
    gaps, gamma = [int(update_proj_gap)], float(gamma)
    while len(gaps) < MAX_INTERVALS:
        grown = int(gaps[-1] * gamma)
        if grown == gaps[-1]:
            return np.asarray(gaps, np.int32)
        if grown >= _INT32_MAX:
            return np.asarray([*gaps, _INT32_MAX], np.int32)
        gaps.append(grown)
    raise ValueError(
        f"gamma={gamma!r} with update_proj_gap={update_proj_gap} grows the refresh interval so "
        f"slowly that it takes more than {MAX_INTERVALS} intervals to pass 2^31 steps; take a larger gamma"
    )


def q_galore_project(
    rank: int | Callable[[Any], int],
    update_proj_gap: int = 200,
    *,
    bits: int | None = 4,
    group_size: int = 256,
    cos_threshold: float = 0.4,
    gamma: float = 2.0,
    queue_size: int = 5,
    svd: str = "exact",
    seed: int = 0,
    canonical_signs: bool = False,
    name: str | Callable[[Any], str] | None = None,
) -> optax.GradientTransformation:
    """Projects every leaf (or a ``Decomposed`` direction) like :func:`project`, with Q-GaLore's
    quantized basis and layer-adaptive refresh (see the module docstring).

    One ``lax.cond`` per matrix shape a step computes new bases when any matrix of that shape is
    due; only the due matrices take theirs. ``bits=None`` keeps float bases. ``group_size`` must
    divide each basis's size.

    Args:
      rank: projection rank, or a function of the parameter's key path (clipped to
        ``min(fan_in, fan_out)``, with a warning).
      update_proj_gap: every matrix's first refresh interval ``T`` (step 0 refreshes).
      bits: width of the basis codes, 1 to 8 (INT4 by default), or ``None`` for float bases.
      group_size: entries per quantization group (one float32 scale and zero point each) of each
        basis matrix in PyTorch orientation; must divide ``d * r`` (unused when ``bits`` is
        ``None``).
      cos_threshold: the mean ``|cos|`` between the first basis vectors of consecutive refreshes
        at or above which a matrix's interval grows.
      gamma: the interval's growth factor, a finite number ``>= 1``: the new interval is
        ``int(interval * gamma)`` (from 2^31 - 1 on, the matrix refreshes no more).
      queue_size: how many of the last cosines are averaged; none grows before that many are
        recorded.
      svd, seed, canonical_signs, name: as :func:`project` (``name`` for the rank-clipping
        warning).

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`QGaLoreProjectState`: per leaf
      the basis (a :class:`QuantizedBasis`, or the float basis when ``bits`` is ``None``), and per
      matrix its interval, its last cosines, its refresh count and its last first basis vector.
      ``update`` emits :class:`LowRank` nodes of the matrices projected onto the dequantized
      bases (in the matrix's dtype; inside ``Decomposed`` when given one, its gradient dropped);
      it also takes the state as Flax nnx's ``Optimizer`` hands it back.

    Raises:
      ValueError: for a bad ``rank``, ``update_proj_gap``, ``svd``, ``bits``, ``group_size``,
        ``queue_size`` or ``gamma`` (also one so close to 1 that the interval would take more
        than 65536 growths to pass 2^31 steps); at ``init``, for a leaf that is not a non-empty
        matrix or a basis whose size ``group_size`` does not divide; at ``update``, for a state
        made with other ranks.
    """
    rank_fn, name_fn = stage_settings(rank, update_proj_gap, "std", svd, name)
    if bits is not None and not (is_int(bits) and bits <= 8):
        raise ValueError(f"bits must be an integer in [1, 8] or None, got {bits!r}")
    if not is_int(group_size):
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if not is_int(queue_size):
        raise ValueError(f"queue_size must be a positive integer, got {queue_size!r}")
    if not (isinstance(gamma, numbers.Real) and math.isfinite(gamma) and gamma >= 1):
        raise ValueError(f"gamma must be a finite number >= 1, got {gamma!r}")
    intervals = refresh_intervals(update_proj_gap, gamma)

    def store(basis: jax.Array, side: str):
        return basis if bits is None else QuantizedBasis.quantize(basis, side, bits, group_size)

    def init_fn(params):
        def make(path, u):
            m, d, r = basis_shape("q_galore_project", path, u, rank_fn(unboxed(path)), name_fn(unboxed(path)))
            side = projection_side(m.shape)
            if bits is not None and (d * r) % group_size:
                raise ValueError(
                    f"q_galore_project: the basis of {path_str(path)} has {d} x {r} = {d * r} "
                    f"entries, not a multiple of group_size={group_size} "
                    "(the host's QGaLore(basis_group_size=...))"
                )
            batch = m.shape[:-2]
            return (
                store(jnp.zeros(batch + (d, r), m.dtype), side),
                jnp.full(batch, update_proj_gap, jnp.int32),
                jnp.zeros(batch + (queue_size,), jnp.float32),
                jnp.zeros(batch, jnp.int32),
                jnp.zeros(batch + (d,), jnp.float32),
            )

        with grouped_rank_warnings():
            made = jax.tree_util.tree_map_with_path(make, params, is_leaf=is_node)
        leaves, treedef = jax.tree.flatten(params, is_leaf=is_node)
        per = treedef.flatten_up_to(made)
        fields = [treedef.unflatten([p[i] for p in per]) for i in range(5)]
        return QGaLoreProjectState(jnp.zeros([], jnp.int32), *fields)

    def refreshed(basis_new, due, fields):
        """One leaf's state after a refresh of its due matrices (``due``: bool, batch shape)."""
        basis, gap, cos, refreshes, top = fields
        basis_new = basis_new.astype(basis.dtype)  # the stored basis's, whatever the gradient's
        first = basis_new[..., :, 0].astype(jnp.float32)
        # |cos|: a singular vector's sign is arbitrary (the reference's signed cosine makes the
        # schedule depend on the SVD backend's sign convention).
        similarity = jnp.abs(_cosine(top, first))
        pushed = jnp.concatenate([cos[..., 1:], similarity[..., None]], axis=-1)
        cos_new = jnp.where((refreshes > 0)[..., None], pushed, cos)
        full = refreshes >= queue_size  # queue_size cosines recorded
        grow = full & (jnp.mean(cos_new, axis=-1) >= cos_threshold)
        table = jnp.asarray(intervals)  # the next interval: the table's entry after gap's (its last: none)
        grown = table[jnp.minimum(jnp.searchsorted(table, gap, side="right"), len(intervals) - 1)]
        gap_new = jnp.where(grow, grown, gap)

        def pick(a, b):  # the due matrices take the new value
            return jnp.where(due.reshape(due.shape + (1,) * (a.ndim - due.ndim)), a, b)

        stored = store(basis_new, basis.side) if isinstance(basis, QuantizedBasis) else basis_new
        return (
            jax.tree.map(pick, stored, basis),
            pick(gap_new, gap),
            pick(cos_new, cos),
            pick(refreshes + 1, refreshes),
            pick(first, top),
        )

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_node)
        # Per leaf: (basis, gap, cosines, refreshes, top).
        old = list(zip(*(treedef.flatten_up_to(f) for f in state[1:]), strict=True)) if leaves else []
        # A QuantizedBasis keeps the float basis's shape.
        ranks = state_ranks("q_galore_project", updates, [fields[0] for fields in old], rank_fn)
        due = [state.count % fields[1] == 0 for fields in old]
        key = step_key(seed, state.count)
        fields = list(old)
        # One cond per shape: a group's SVDs (one batched call) run only when one of its
        # matrices is due, so matrices whose intervals grew skip them.
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, u in enumerate(leaves):
            groups[tuple(matrix_of(u).shape[-2:])].append(i)
        for gi, idx in enumerate(groups.values()):

            def refresh(idx=idx, gi=gi):
                sources = [refresh_matrix(leaves[i]) for i in idx]
                group_ranks, group_key = [ranks[i] for i in idx], jax.random.fold_in(key, gi)
                new = refresh_bases(sources, group_ranks, svd, group_key, canonical_signs=canonical_signs)
                return [refreshed(n, due[i], old[i]) for n, i in zip(new, idx, strict=True)]

            def keep(idx=idx):
                return [old[i] for i in idx]

            any_due = jnp.any(jnp.stack([jnp.any(due[i]) for i in idx]))
            for i, f in zip(idx, jax.lax.cond(any_due, refresh, keep), strict=True):
                fields[i] = f
        out = []
        for u, (basis, *_) in zip(leaves, fields, strict=True):
            m = matrix_of(u)
            side = projection_side(m.shape)
            b = dequantized(basis).astype(m.dtype)
            low = LowRank(project_value(m, b, side), b, side)
            out.append(emit(u, low))
        if leaves:
            columns = [treedef.unflatten([f[i] for f in fields]) for i in range(5)]
        else:
            columns = list(state[1:])
        new_state = QGaLoreProjectState(optax.safe_increment(state.count), *columns)
        return jax.tree.unflatten(treedef, out), new_state

    # Its quantized bases are nodes that Flax nnx's Optimizer hands back as mappings.
    return in_made_form_on_update(optax.GradientTransformation(init_fn, update_fn))


class QuantizeWeightsState(NamedTuple):
    """State of :func:`quantize_weights`."""

    count: jax.Array  # shape=(), dtype=jnp.int32: steps taken (folded into the rounding key).


def quantize_weights(
    group_size: int = 256, bits: int = 8, *, stochastic: bool = True, seed: int = 0
) -> optax.GradientTransformation:
    """Keeps the parameters on a ``bits``-bit group grid: ``u -> Q(p + u) - p`` (place it last).

    ``Q`` is group-wise min-max quantization followed by dequantization, groups of
    ``group_size`` consecutive entries of each matrix in PyTorch orientation (``kernel^T``; a
    vector as it is), with stochastic rounding (``seed``, folded with the step) or
    round-to-nearest. The parameters stay float arrays holding grid values (q-galore-torch's
    simulated INT8 weights). ``group_size`` must divide each matrix's size. The grid holds for
    float32 parameters; bfloat16 ones cannot hold most of an 8-bit min-max grid's values (its
    spacing is near their precision), as in the reference run in bfloat16.

    Args:
      group_size: entries per group (one scale and zero point each); must divide the size of
        each matrix (a leaf's last two axes) and of each leaf of fewer axes.
      bits: width of the grid's codes, 1 to 8.
      stochastic: round stochastically (unbiased on the grid); ``False`` rounds to nearest
        (ties to even).
      seed: seed of the stochastic rounding, folded with the step count and the leaf's index.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`QuantizeWeightsState` (the
      step count). ``update(updates, state, params)`` returns ``Q(p + u) - p`` per leaf, computed
      in float32 and cast to ``u``'s dtype; an entry where ``p + u`` is not finite keeps that
      value, and the other entries of its group come out NaN.

    Raises:
      ValueError: for a bad ``bits`` or ``group_size``; at ``init``, for a leaf whose matrix
        size ``group_size`` does not divide; at ``update``, when ``params`` is not given.
    """
    if not (is_int(bits) and bits <= 8):
        raise ValueError(f"bits must be an integer in [1, 8], got {bits!r}")
    if not is_int(group_size):
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")

    def unit(x):
        return jnp.swapaxes(x, -1, -2) if x.ndim >= 2 else x

    def init_fn(params):
        def check(path, p):
            n = math.prod(p.shape[-2:]) if p.ndim >= 2 else p.size
            if n % group_size:
                raise ValueError(
                    f"quantize_weights: {path_str(path)} has {n} entries per matrix, not a "
                    f"multiple of group_size={group_size} (the host's QGaLore(weight_group_size=...))"
                )

        jax.tree_util.tree_map_with_path(check, params)
        return QuantizeWeightsState(jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("quantize_weights needs the parameters: update(updates, state, params)")
        leaves, treedef = jax.tree.flatten(updates)
        plist = treedef.flatten_up_to(params)
        base = step_key(seed, state.count)
        out = []
        for i, (u, p) in enumerate(zip(leaves, plist, strict=True)):
            new = unit(p.astype(jnp.float32) + u.astype(jnp.float32))
            flat = new.reshape(new.shape[:-2] + (-1,)) if new.ndim >= 2 else new
            key = jax.random.fold_in(base, i) if stochastic else None
            q = group_dequantize(*group_quantize(flat, group_size, bits, key))
            # A non-finite weight stays so: its code would be a finite grid value (NaN's a 0),
            # and a NaN gradient would corrupt the weight silently instead of showing.
            q = unit(jnp.where(jnp.isfinite(flat), q, flat).reshape(new.shape))
            out.append((q - p.astype(jnp.float32)).astype(u.dtype))
        return treedef.unflatten(out), QuantizeWeightsState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class QGaLore(Host):
    """Q-GaLore (Zhang et al., https://arxiv.org/abs/2407.08296), q-galore-torch's defaults.

    Attributes:
      basis_bits, basis_group_size: the projection basis stored in ``basis_bits``-bit groups
        (``None``: float).
      cos_threshold, gamma, queue_size: layer-adaptive refresh: a matrix whose last
        ``queue_size`` first-vector cosines average at least ``cos_threshold`` multiplies its
        refresh interval by ``gamma``.
      min_8bit_size: Adam moments of units with at least this many entries are 8-bit blockwise
        (bitsandbytes' ``AdamW8bit``), smaller ones float32.
      mag_bits: 8 or 32: the block magnitudes' moments under decomposition (the paper's
        precision ablation uses 32).
      weight_bits, weight_group_size, stochastic_round: target weights kept on a
        ``weight_bits``-bit group grid after every step (``None``: off), with stochastic rounding.

    As a host: :func:`q_galore_project` and :func:`moara_jax.adam8bit` for the targets (8-bit or
    float32 moments, so no ``mu_dtype``); bitsandbytes' 8-bit AdamW, decay before the step, for
    every other parameter; after the step, the targets' decay and their INT8 grid
    (:func:`quantize_weights`).
    """

    name: ClassVar[str] = "q_galore"
    state_types: ClassVar[tuple[type, ...]] = (QGaLoreProjectState,)
    basis_states: ClassVar[dict] = {QGaLoreProjectState: projection_side}

    basis_bits: int | None = 4
    basis_group_size: int = 256
    cos_threshold: float = 0.4
    gamma: float = 2.0
    queue_size: int = 5
    min_8bit_size: int = 4096
    mag_bits: int = 8
    weight_bits: int | None = 8
    weight_group_size: int = 256
    stochastic_round: bool = True

    def __post_init__(self):
        for field in ("basis_bits", "weight_bits"):
            value = getattr(self, field)
            if value is not None and not (is_int(value) and value <= 8):
                raise ValueError(f"{field} must be an integer in [1, 8] or None, got {value!r}")
        for field in ("basis_group_size", "weight_group_size", "queue_size"):
            if not is_int(getattr(self, field)):
                raise ValueError(f"{field} must be a positive integer, got {getattr(self, field)!r}")
        if not is_int(self.min_8bit_size, minimum=0):
            raise ValueError(f"min_8bit_size must be a non-negative integer, got {self.min_8bit_size!r}")
        if self.mag_bits not in (8, 32):
            raise ValueError(f"mag_bits must be 8 or 32, got {self.mag_bits!r}")
        if not (real_number(self.gamma) and 1 <= self.gamma < 2**20):
            raise ValueError(f"gamma must be a number in [1, 2^20), got {self.gamma!r}")
        if not real_number(self.cos_threshold):
            raise ValueError(f"cos_threshold must be a finite number, got {self.cos_threshold!r}")
        if not isinstance(self.stochastic_round, bool):
            raise ValueError(f"stochastic_round must be True or False, got {self.stochastic_round!r}")

    def stages(self, o: StageOptions):
        if o.mu_dtype is not None:
            raise ValueError(
                f"mu_dtype={o.mu_dtype!r}: the q_galore host keeps 8-bit or float32 moments "
                "(QGaLore.min_8bit_size, mag_bits)"
            )
        projection = q_galore_project(
            o.rank,
            o.update_proj_gap,
            bits=self.basis_bits,
            group_size=self.basis_group_size,
            cos_threshold=self.cos_threshold,
            gamma=self.gamma,
            queue_size=self.queue_size,
            **o.basis,
        )
        return projection, adam8bit(
            o.b1, o.b2, o.eps, min_8bit_size=self.min_8bit_size, mag_bits=self.mag_bits
        )

    def other_adam(self, b1, b2, eps, mu_dtype, weight_decay, decay_mask=None):
        # bitsandbytes' AdamW8bit: decoupled decay before the step.
        other = adam8bit(b1, b2, eps, min_8bit_size=self.min_8bit_size)
        if is_zero(weight_decay):
            return other
        return optax.chain(other, optax.add_decayed_weights(weight_decay, decay_mask))

    def finish(self, learning_rate, weight_decay, targets, seed, decay_mask=None):
        # Target matrices: decay after the back-projected step, then back onto the INT8 grid.
        out = [
            optax.scale_by_learning_rate(learning_rate),
            optax.masked(decay_after_step(learning_rate, weight_decay, decay_mask), targets),
        ]
        if self.weight_bits is not None:
            grid = quantize_weights(
                self.weight_group_size, self.weight_bits, stochastic=self.stochastic_round, seed=seed
            )
            out.append(optax.masked(grid, targets))
        return out
