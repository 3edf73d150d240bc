"""Online Subspace Descent's projection (Liang et al., https://arxiv.org/abs/2408.12857).

Instead of a new SVD every ``T`` steps, the basis takes an SVD once (step 0) and then follows the
gradient's principal subspace online: after each step's projection and back-projection, one
AdamW step (PyTorch's ``torch.optim.AdamW``: decoupled weight decay 0.01, ``eps`` 1e-8) on the
online-PCA loss of the normalised gradient ``X = G / ||G||``,
``L(P) = ||X - P P^T X||^2`` (in the paper's orientation, on the projected side), with step
size ``basis_lr(t)`` (the reference: ``lr_t / (lr_peak T)``, the model's learning-rate schedule
over ``T``). This is the official implementation's default ``continuous`` projection.

The step on update ``t``'s loss is taken when update ``t + 1`` begins (the same numbers for
float32 bases; bf16 ones step on their moments as stored, as PyTorch's do), so that the state
holds the basis the last update used (what the alignment diagnostic reads) and the moments of
its pending step.

Two deliberate differences: a zero gradient contributes a zero loss (the reference divides by
its zero norm and turns the basis into NaN), and the AdamW math runs in float32 with the basis
and its moments stored in the leaf's dtype (the reference computes in bf16 for bf16 weights),
but a float16 basis's moments in float32 (float16's range flushes the second moment to zero).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moara_jax._adam import inner_adam, moment_dtype, torch_adam_direction, torch_adam_from
from moara_jax._nodes import LowRank, is_node
from moara_jax._projection import (
    emit,
    matrix_of,
    project_value,
    projection_side,
    refreshed_bases,
    stage_settings,
    state_ranks,
    zero_bases,
)
from moara_jax.hosts._base import Host, StageOptions, real_number


class OSDProjectState(NamedTuple):
    """State of :func:`osd_project`."""

    count: jax.Array  # shape=(), dtype=jnp.int32: steps taken.
    basis: Any  # per leaf (..., d, r) in the leaf's dtype: the one the last update used.
    # AdamW first moments of the basis (its dtype; float32 for float16), with the last update's loss.
    basis_mu: Any
    basis_nu: Any  # AdamW second moments of the basis.
    # shape=(), float32: the step size of the basis's pending step, ``basis_lr`` at the last update
    # (an injected learning rate is known only at its own update).
    basis_lr: jax.Array


def pca_loss(basis: jax.Array, g: jax.Array, side: str) -> jax.Array:
    """``sum ||X - P P^T X||^2`` over the matrices of ``g`` (Flax layout), ``X = g / ||g||`` per
    matrix (a zero matrix contributes 0), ``P`` the basis of the projected side.

    Args:
      basis: ``P``, ``(..., d, r)``, ``d`` the size of the projected side of ``g``.
      g: the matrices, ``(..., fan_in, fan_out)``.
      side: ``'in'`` (``P`` spans the fan_in axis, ``P P^T X``) or ``'out'`` (the fan_out axis,
        ``X P P^T``); any other value is taken as ``'out'``.

    Returns:
      The loss, a float32 scalar (computed in float32, whatever the inputs' dtypes);
      :func:`osd_project` steps the basis on its gradient with respect to ``basis``.
    """
    g = g.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(g), axis=(-2, -1), keepdims=True))
    x = g / jnp.where(norm > 0, norm, 1.0)
    b = basis.astype(jnp.float32)
    if side == "in":  # the fan_in side: P P^T X on the rows
        recon = b @ (jnp.swapaxes(b, -1, -2) @ x)
    else:
        recon = (x @ b) @ jnp.swapaxes(b, -1, -2)
    return jnp.sum(jnp.square(recon - x))


def _adamw_step(p, mu, nu, step, lr, b1, b2, eps, weight_decay):
    """``torch.optim.AdamW``'s update of ``p`` from moments already updated at ``step`` (float32
    math, the result in ``p``'s dtype)."""
    mu32, nu32 = mu.astype(jnp.float32), nu.astype(jnp.float32)
    direction = torch_adam_from(mu32, nu32, step, b1, b2, eps, jnp.float32, jnp.float32, jnp.float32)[0]
    return (p.astype(jnp.float32) * (1.0 - lr * weight_decay) - lr * direction).astype(p.dtype)


def osd_project(
    rank: int | Callable[[Any], int],
    basis_lr: float | Callable[[jax.Array], jax.Array],
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    svd: str = "exact",
    seed: int = 0,
    canonical_signs: bool = False,
    name: str | Callable[[Any], str] | None = None,
) -> optax.GradientTransformation:
    """Projects every leaf (or a ``Decomposed`` direction) like :func:`project`, with OSD's basis:
    an SVD at step 0, then one AdamW step a step on the online-PCA loss of the matrix it projects.

    Args:
      rank: projection rank, or a function of the parameter's key path (clipped to
        ``min(fan_in, fan_out)``, with a warning).
      basis_lr: the basis's AdamW step size, a number or a schedule of the step count (the
        reference's: the model's learning-rate schedule over ``peak lr * T``). A schedule is
        called with each update's count (0 at the first); the step on that update's loss, taken
        when the next update begins, uses its value. Not checked here (:class:`OSD` checks it).
      b1, b2, eps, weight_decay: the basis's AdamW (PyTorch's defaults; ``weight_decay``
        decoupled, ``p (1 - lr wd)``). Not checked here (:class:`OSD` checks them).
      svd, seed, canonical_signs, name: as :func:`project` (for the step-0 basis; ``name`` for
        the rank-clipping warning).

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`OSDProjectState`: per leaf the
      basis ``(..., d, r)`` the last update used (in the leaf's dtype) and its AdamW moments,
      with the step size of the pending basis step. ``update`` emits :class:`LowRank` nodes of
      the projected matrices (inside ``Decomposed`` when given one, its gradient dropped). The
      first update uses the SVD basis and the second the same; each later one first steps the
      basis on the previous update's loss (:func:`pca_loss`).

    Raises:
      ValueError: for a bad ``rank`` or ``svd``; at ``init``, for a leaf that is not a
        non-empty matrix; at ``update``, for a state made with other ranks.
    """
    rank_fn, name_fn = stage_settings(rank, 1, "std", svd, name)
    lr_fn = basis_lr if callable(basis_lr) else (lambda count: basis_lr)

    def init_fn(params):
        basis = zero_bases("osd_project", params, rank_fn, name_fn)
        # Two trees of their own: a state whose leaves share a buffer cannot be donated.
        mu, nu = (jax.tree.map(lambda b: jnp.zeros_like(b, moment_dtype(b.dtype)), basis) for _ in range(2))
        return OSDProjectState(jnp.zeros([], jnp.int32), basis, mu, nu, jnp.zeros([], jnp.float32))

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_node)
        old, mus, nus = (treedef.flatten_up_to(f) for f in (state.basis, state.basis_mu, state.basis_nu))
        ranks = state_ranks("osd_project", updates, old, rank_fn)
        mats = [matrix_of(u) for u in leaves]

        def first():
            return refreshed_bases(leaves, old, ranks, svd, seed, state.count, canonical_signs)

        def later():
            # The basis's step on the last update's loss, taken now, so that the state holds the
            # basis each update used (step 1 has none: step 0's SVD has no loss to step on).
            last, lr = jnp.maximum(state.count - 1, 1), state.basis_lr
            return [
                jnp.where(state.count >= 2, _adamw_step(b, mu, nu, last, lr, b1, b2, eps, weight_decay), b)
                for b, mu, nu in zip(old, mus, nus, strict=True)
            ]

        bases = jax.lax.cond(state.count == 0, first, later) if leaves else []
        out, new_mus, new_nus = [], [], []
        for u, m, b, mu, nu in zip(leaves, mats, bases, mus, nus, strict=True):
            side = projection_side(m.shape)
            low = LowRank(project_value(m, b, side), b, side)
            out.append(emit(u, low))
            # The moments of the basis's step on this step's loss (none at step 0, where it was made).
            grad = jax.grad(pca_loss)(b, m, side)
            _, mu_new, nu_new = torch_adam_direction(grad, mu, nu, jnp.maximum(state.count, 1), b1, b2, eps)
            keep = state.count == 0
            new_mus.append(jnp.where(keep, mu, mu_new))
            new_nus.append(jnp.where(keep, nu, nu_new))
        new_state = OSDProjectState(
            optax.safe_increment(state.count),
            *(treedef.unflatten(x) for x in (bases, new_mus, new_nus)),
            jnp.asarray(lr_fn(state.count), jnp.float32),
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class OSD(Host):
    """Online Subspace Descent (Liang et al., https://arxiv.org/abs/2408.12857), its official
    implementation's default (``continuous``): an SVD basis at step 0, then one AdamW step a
    step on the online-PCA loss of the normalised gradient (:func:`moara_jax.osd_project`;
    ``update_proj_gap`` unused: its basis moves every step), and :func:`moara_jax.inner_adam`.

    Attributes:
      basis_lr: the basis's step size, a number or a schedule; ``None`` (the reference's):
        ``lr_t / (peak_lr * update_proj_gap)``, the model's learning rate ``lr_t``.
      peak_lr: the learning rate that schedule is divided by; with a constant learning rate
        ``None`` takes it, with a schedule it must be given (the trainer passes ``train.lr``).
      b1, b2, eps, weight_decay: the basis's AdamW (PyTorch's defaults).
    """

    name: ClassVar[str] = "osd"
    state_types: ClassVar[tuple[type, ...]] = (OSDProjectState,)
    basis_states: ClassVar[dict] = {OSDProjectState: projection_side}

    basis_lr: Any = None
    peak_lr: float | None = None
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self):
        if self.peak_lr is not None and not (real_number(self.peak_lr) and self.peak_lr > 0):
            raise ValueError(f"peak_lr must be a positive number, got {self.peak_lr!r}")
        if self.basis_lr is not None and not (
            callable(self.basis_lr) or (real_number(self.basis_lr) and self.basis_lr >= 0)
        ):
            raise ValueError(f"basis_lr must be a non-negative number or a schedule, got {self.basis_lr!r}")
        for field in ("b1", "b2"):
            if not (real_number(getattr(self, field)) and 0 <= getattr(self, field) < 1):
                raise ValueError(f"{field} must be in [0, 1), got {getattr(self, field)!r}")
        for field in ("eps", "weight_decay"):
            if not (real_number(getattr(self, field)) and getattr(self, field) >= 0):
                raise ValueError(f"{field} must be a non-negative number, got {getattr(self, field)!r}")

    def stages(self, o: StageOptions):
        if self.basis_lr is None:
            raise ValueError(
                "the osd host needs OSD(basis_lr=...) here (moara_adamw derives it from its learning rate)"
            )
        projection = osd_project(
            o.rank,
            self.basis_lr,
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            **o.basis,
        )
        return projection, inner_adam(o.b1, o.b2, o.eps, mu_dtype=o.mu_dtype, mag_dtype=o.mag_dtype)

    def with_learning_rate(self, learning_rate, update_proj_gap):
        """The basis step size as the reference sets it, ``lr_t / (peak_lr * T)``, unless given."""
        if self.basis_lr is not None:
            return self
        peak = self.peak_lr
        if peak is None:
            # Only a Python number is its own peak (an injected or scheduled rate changes).
            if not (real_number(learning_rate) and learning_rate > 0):
                raise ValueError(
                    f"host OSD with learning_rate={learning_rate!r} (a schedule, an injected array or "
                    "not positive) needs OSD(peak_lr=...) (its basis steps lr_t / (peak_lr * "
                    "update_proj_gap)) or OSD(basis_lr=...)"
                )
            peak = learning_rate

        def basis_lr(count):
            lr = learning_rate(count) if callable(learning_rate) else learning_rate
            return lr / (peak * update_proj_gap)

        return dataclasses.replace(self, basis_lr=basis_lr)

    @classmethod
    def trainer_defaults(cls, peak_lr):
        return {"peak_lr": peak_lr}
