"""LDAdam's low-rank Adam (Robert et al., https://arxiv.org/abs/2410.16103).

The official implementation (IST-DASLab/LDAdam, ``LDAdamW``, no published package) keeps Adam's
moments in a rank-``r`` subspace that moves every step and carries what the projection drops
forward as error feedback. Per target matrix, with ``G = g + E`` (the gradient plus the previous
error), ``P`` the previous basis and ``M, V`` the moments in it:

* the basis: at the first step the top-``r`` singular vectors of ``G``; after it one block
  power-iteration step warm-started at ``P`` on ``A = rho M_back / (1 - b1^(t-1)) + (1 - rho) G``
  (``M_back = P M`` back-projected): ``Q = qr(A A^T P)``;
* the moments move into the new basis with ``C = Q^T P``: ``M~ = C M`` and
  ``V~ = c2 |(C * C) (V / c2 - M^2 / c1^2) + M~^2 / c1^2|`` (``c1, c2 = 1 - b1^(t-1), 1 - b2^(t-1)``:
  the old basis's variance rotated by ``C * C`` plus the transported mean's square);
* the new error is what the projection of ``G`` and the moment transport drop:
  ``E = G - Q Q^T G + b1 / (1 - b1) (P M - Q M~)``;
* Adam in the new basis with PyTorch's ``AdamW`` formula, ``eps`` outside the root:
  ``D = (M / (1 - b1^t)) / (sqrt(V / (1 - b2^t)) + eps)``.

The projected side is the smaller one, as GaLore's; on a square matrix LDAdam's ``'std'``
projects the fan_out side (GaLore's the fan_in side). Under decomposition the block direction
takes the gradient's place (with its own error feedback) and the block magnitudes get the same
Adam formula with ``mag_dtype`` moments.

Deliberate differences: the math runs in float32 with moments, basis and error stored in their
dtypes (the reference computes in bf16 for bf16 weights); the error is explicit state of the
matrix's shape and dtype (the reference keeps it in PyTorch's gradient buffer, which its
``zero_grad`` leaves alone).

Under ``jit`` with a sharded state, give the state's shardings as ``out_shardings`` (as the
trainer does): bases and moments are computed anew each step, and XLA's sharding propagation
may otherwise lay them out differently from the inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moara_jax._adam import moment_dtype, pytorch_adam, torch_adam_direction, torch_adam_from
from moara_jax._bases import orthonormal
from moara_jax._labels import unboxed
from moara_jax._nodes import Decomposed, LowRank, is_node
from moara_jax._projection import (
    basis_shape,
    grouped_rank_warnings,
    matrix_of,
    project_back,
    project_value,
    refresh_bases,
    stage_settings,
    state_ranks,
    step_key,
    swap,
    transport,
)
from moara_jax._sharding import as_before
from moara_jax._validate import check_adam, dtype_arg
from moara_jax.hosts._base import Host, StageOptions, is_zero, real_number


class LDAdamState(NamedTuple):
    """State of :func:`ldadam`. Per leaf, the groups that do not apply are ``None``."""

    count: jax.Array  # shape=(), dtype=jnp.int32: steps taken.
    basis: Any  # per leaf (..., d, r) in the leaf's dtype (zeros before the first step).
    dir_mu: Any  # first moments in the subspace.
    dir_nu: Any  # second moments in the subspace.
    mag_mu: Any  # first moments of block magnitudes (Decomposed leaves).
    mag_nu: Any  # second moments of block magnitudes.
    error: Any  # the error-feedback buffer, the projected matrix's shape and dtype (or None).


def ldadam_side(shape: tuple[int, ...]) -> str:
    """LDAdam's ``'std'`` rule in Flax layout: ``'in'`` (project fan_in) when fan_out > fan_in,
    else ``'out'`` (a square matrix projects its fan_out side).

    Args:
      shape: a matrix's shape, ``(..., fan_in, fan_out)``; only the last two entries are read.

    Returns:
      ``'in'`` or ``'out'``: the side :func:`ldadam` projects (it differs from
      :func:`project`'s only on square matrices).
    """
    return "in" if shape[-1] > shape[-2] else "out"


def _power_step(a: jax.Array, basis: jax.Array, side: str) -> jax.Array:
    """``orth(A A^T P)`` with ``A`` the matrix with its projected side first, as
    ``orth(A orth(A^T P))``: the same span and, both orthonormalisations being QR-like (an upper
    triangular factor), the same basis up to signs, without squaring ``A``'s condition number
    (which on accelerators sends CholeskyQR2 to its Householder fallback)."""
    if side == "out":
        a = swap(a)
    return orthonormal(a @ orthonormal(swap(a) @ basis))


def ldadam(
    rank: int | Callable[[Any], int],
    *,
    rho: float = 0.908,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    error_feedback: bool = True,
    mu_dtype: Any = None,
    mag_dtype: Any = "float32",
    svd: str = "exact",
    seed: int = 0,
    canonical_signs: bool = False,
    name: str | Callable[[Any], str] | None = None,
) -> optax.GradientTransformation:
    """LDAdam's projection and Adam for every leaf (or a ``Decomposed`` direction), one stage.

    The two are one stage because each needs the other: the basis is found from the first
    moment, and the moments move with the basis. Emits :class:`LowRank` nodes holding the Adam
    direction in the new basis (with the magnitudes' Adam direction for a ``Decomposed``), for
    :func:`recompose`. The reference applies no ``scale`` (``recompose(1.0)``).

    Args:
      rank: projection rank, or a function of the parameter's key path (clipped to
        ``min(fan_in, fan_out)``, with a warning).
      rho: weight of the back-projected first moment in the matrix the basis follows, in
        ``[0, 1)``.
      b1, b2, eps: Adam, in PyTorch ``AdamW``'s formula (the reference's defaults are
        ``0.908, 0.99, 1e-8``).
      error_feedback: carry the dropped part of each step into the next (the reference's default);
        ``False`` keeps no error state.
      mu_dtype, mag_dtype: dtypes of the subspace moments (``None``: the leaf's, float32 for
        float16) and of the block magnitudes' moments.
      svd, seed, canonical_signs, name: as :func:`project`, for the first step's basis (the
        power iteration's orthonormalisation is sign-free: the update does not depend on it);
        ``name`` names the module in the rank-clipping warning.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`LDAdamState`: the bases
      ``(..., d, r)`` and the error buffers in each matrix's dtype, the subspace moments in
      ``mu_dtype``, the magnitudes' in ``mag_dtype``. ``update`` maps each matrix to a
      :class:`LowRank` of its Adam direction (in the matrix's dtype) in the new basis, and a
      :class:`Decomposed` to one whose ``mag`` is the magnitudes' Adam direction, its direction
      that ``LowRank`` and its gradient dropped.

    Raises:
      ValueError: for a bad ``rank``, ``svd``, ``b1``, ``b2``, ``eps``, ``rho``,
        ``error_feedback`` (not a bool), ``mu_dtype`` or ``mag_dtype``; at ``init``, for a leaf
        that is not a non-empty matrix; at ``update``, for a state made with other ranks.
    """
    rank_fn, name_fn = stage_settings(rank, 1, "std", svd, name)
    check_adam(b1, b2, eps)
    if not (real_number(rho) and 0 <= rho < 1):
        raise ValueError(f"rho must be in [0, 1), got {rho!r}")
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
    mu_dtype = dtype_arg("mu_dtype", mu_dtype)
    mag_dtype = dtype_arg("mag_dtype", mag_dtype)

    def init_fn(params):
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_node)
        fields: dict[str, list] = {k: [] for k in LDAdamState._fields[1:]}
        with grouped_rank_warnings():
            for path, u in with_paths:
                m, d, r = basis_shape("ldadam", path, u, rank_fn(unboxed(path)), name_fn(unboxed(path)))
                lead, (fan_in, fan_out) = m.shape[:-2], m.shape[-2:]
                low = lead + ((r, fan_out) if ldadam_side(m.shape) == "in" else (fan_in, r))
                mag = u.mag if isinstance(u, Decomposed) else None
                fields["basis"].append(jnp.zeros(lead + (d, r), m.dtype))
                fields["dir_mu"].append(jnp.zeros(low, mu_dtype or moment_dtype(m.dtype)))
                fields["dir_nu"].append(jnp.zeros(low, mu_dtype or moment_dtype(m.dtype)))
                fields["mag_mu"].append(None if mag is None else jnp.zeros(mag.shape, mag_dtype))
                fields["mag_nu"].append(None if mag is None else jnp.zeros(mag.shape, mag_dtype))
                fields["error"].append(jnp.zeros(m.shape, m.dtype) if error_feedback else None)
        trees = {k: treedef.unflatten(v) for k, v in fields.items()}
        return LDAdamState(jnp.zeros([], jnp.int32), **trees)

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_node)
        old, mus, nus, mag_mus, mag_nus, errors = (treedef.flatten_up_to(f) for f in state[1:])
        ranks = state_ranks("ldadam", updates, old, rank_fn)
        count_inc = optax.safe_increment(state.count)
        t = count_inc.astype(jnp.float32)
        first = state.count == 0
        # The previous step's bias corrections (1 at the first step, where nothing is carried).
        c1 = jnp.where(first, 1.0, 1.0 - b1 ** (t - 1.0))
        c2 = jnp.where(first, 1.0, 1.0 - b2 ** (t - 1.0))
        grads = []
        for u, e in zip(leaves, errors, strict=True):
            g = matrix_of(u).astype(jnp.float32)
            grads.append(g if e is None else g + e.astype(jnp.float32))
        sides = [ldadam_side(g.shape) for g in grads]
        carried = [
            project_back(mu.astype(jnp.float32), b.astype(jnp.float32), side)
            for mu, b, side in zip(mus, old, sides, strict=True)
        ]

        def svd_bases():
            key = step_key(seed, state.count)
            sources = [g if s == "in" else swap(g) for g, s in zip(grads, sides, strict=True)]
            # refresh_bases picks the side by GaLore's rule; handing it the matrix with the
            # projected side first (fan_in) makes that the side it returns.
            return refresh_bases(sources, ranks, svd, key, canonical_signs=canonical_signs)

        def power_bases():
            out = []
            for g, m_back, b, side in zip(grads, carried, old, sides, strict=True):
                a = rho * (m_back / c1) + (1.0 - rho) * g
                out.append(_power_step(a, b.astype(jnp.float32), side))
            return out

        bases = jax.lax.cond(first, svd_bases, power_bases) if leaves else []
        out, new = [], {k: [] for k in LDAdamState._fields[1:]}
        for u, g, m_back, q, p, mu, nu, mag_mu, mag_nu, e, side in zip(
            leaves, grads, carried, bases, old, mus, nus, mag_mus, mag_nus, errors, sides, strict=True
        ):
            q = q.astype(p.dtype).astype(jnp.float32)  # the basis as stored
            low = project_value(g, q, side)
            c = swap(q) @ p.astype(jnp.float32)  # (r, r); zero at the first step
            mu32, nu32 = mu.astype(jnp.float32), nu.astype(jnp.float32)
            mu_t = transport(c, mu32, side)
            centred = nu32 / c2 - jnp.square(mu32) / jnp.square(c1)
            # (At the first step the moments are zero and so is this.)
            nu_t = c2 * jnp.abs(transport(jnp.square(c), centred, side) + jnp.square(mu_t) / jnp.square(c1))
            if e is not None:
                k = b1 / (1.0 - b1)
                e = (g - project_back(low + k * mu_t, q, side) + k * m_back).astype(e.dtype)
            mu32 = b1 * mu_t + (1.0 - b1) * low
            nu32 = b2 * nu_t + (1.0 - b2) * jnp.square(low)
            m = matrix_of(u)
            d, mu, nu = torch_adam_from(mu32, nu32, count_inc, b1, b2, eps, m.dtype, mu.dtype, nu.dtype)
            node = LowRank(d, q.astype(p.dtype), side)
            if isinstance(u, Decomposed):
                dm, mag_mu, mag_nu = torch_adam_direction(u.mag, mag_mu, mag_nu, count_inc, b1, b2, eps)
                node = u.replace(mag=dm, direction=node, gradient=None)
            out.append(node)
            for k_, v in zip(new, (q.astype(p.dtype), mu, nu, mag_mu, mag_nu, e), strict=True):
                new[k_].append(v)
        new_state = LDAdamState(count_inc, *(treedef.unflatten(new[k]) for k in new))
        # Every leaf is made anew (a new basis, moments transported onto it): placed as it came
        # (count_inc > 0 at every step, safe_increment saturates).
        return jax.tree.unflatten(treedef, out), as_before(new_state, state, count_inc > 0)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class LDAdam(Host):
    """LDAdam (Robert et al., https://arxiv.org/abs/2410.16103), its official ``LDAdamW``: the
    basis moves every step (one warm-started power-iteration step on the gradient mixed with
    the back-projected first moment), the moments move with it, and what projection and
    transport drop is fed back into the next step (:func:`moara_jax.ldadam`, one stage:
    projection and Adam each need the other; ``update_proj_gap`` unused). Its Adam, for
    the target matrices and every other parameter, is PyTorch ``AdamW``'s (``eps`` added to the
    bias-corrected root, weight decay before the step); the reference applies no ``scale``
    (``scale=1``) and defaults to ``b1, b2, eps = 0.908, 0.99, 1e-8``. Gradient clipping (the
    trainer's ``train.grad_clip``) clips the fresh gradient; the reference, whose error lives in
    the gradient buffer, would clip gradient plus error.

    Attributes:
      rho: weight of the back-projected first moment in the matrix the basis follows.
      error_feedback: carry the dropped part of each step into the next.
    """

    name: ClassVar[str] = "ldadam"
    state_types: ClassVar[tuple[type, ...]] = (LDAdamState,)
    basis_states: ClassVar[dict] = {LDAdamState: ldadam_side}  # a square matrix: its fan_out side

    rho: float = 0.908
    error_feedback: bool = True

    def __post_init__(self):
        if not (real_number(self.rho) and 0 <= self.rho < 1):
            raise ValueError(f"rho must be a number in [0, 1), got {self.rho!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")

    def stages(self, o: StageOptions):
        stage = ldadam(
            o.rank,
            rho=self.rho,
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            error_feedback=self.error_feedback,
            mu_dtype=o.mu_dtype,
            mag_dtype=o.mag_dtype,
            **o.basis,
        )
        return (stage,)

    def other_adam(self, b1, b2, eps, mu_dtype, weight_decay, decay_mask=None):
        return pytorch_adam(b1, b2, eps, mu_dtype=mu_dtype)  # LDAdamW's full-rank path

    def finish(self, learning_rate, weight_decay, targets, seed, decay_mask=None):
        # LDAdamW: decoupled decay of every (masked-in) parameter before the step.
        decay = [] if is_zero(weight_decay) else [optax.add_decayed_weights(weight_decay, decay_mask)]
        return [*decay, optax.scale_by_learning_rate(learning_rate)]
