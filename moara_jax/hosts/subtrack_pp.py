"""SubTrack++ (Rajabi et al., https://arxiv.org/abs/2502.01586), as its official code runs it.

The official implementation (criticalml-uw/SubTrack, ``LowRankAdamW`` with
``subspace_update_method='subtrack'``, ``adaptive_optimizer`` and ``recovery_scaling``; no
published package) keeps GaLore's low-rank Adam and changes three things:

* **the basis** is the SVD's at step 0 and then, every ``T`` steps, takes one step along a
  Grassmann geodesic that lowers the subspace estimation error ``min_W ||G - P W||^2`` of the
  current gradient: with ``W = (P^T P)^-1 P^T G``, the tangent ``(I - P P^T)(-2 (G - P W) W^T)``
  is cut to its top singular triplet ``(u, s, v)`` and
  ``P <- (P v cos(eta s) - u sin(eta s)) v^T + P (I - v v^T)`` (:func:`subtrack_project`);
* **the moments** are moved into the current basis from the initial one (``C = P^T P_0``) every
  ``T`` steps, after the step whose count is a multiple of ``T``:
  ``m <- C m``, ``v <- |(1 - b2) (C*C (v - m^2) + (C m)^2)|`` (:func:`transport_moments`);
* **the dropped gradient** is added back as Fira does: ``(G - scale P P^T G)``, scaled per row
  by Adam's norm ratio and growth-limited (:func:`fira_adam`).

Four behaviours of the reference code are reproduced as they are, because they are what its
published numbers (and the MoARa paper's SubTrack++ column) were run with: (1) the tangent of a
basis on the fan_in side (PyTorch ``'right'``: square and tall weights, in Llama everything but
``down_proj``) is ``(I_r - P^T P) ...`` there, zero up to rounding, so those bases stay at the
step-0 SVD (here exactly; ``SubTrackPP(track_all=True)`` tracks them with the same geodesic);
(2) the moments are always moved from the *initial* basis; (3) that happens one step before the
basis moves; (4) the ``(1 - b2)`` factor shrinks ``v`` a thousandfold each time.

One deliberate difference: the tracking and the moments' transport compute in float32, with
bases and moments stored in their dtypes (the reference computes in bf16 for bf16 weights,
where the transport's ``v - m^2`` can cancel to exactly zero).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moara_jax._adam import InnerAdamState
from moara_jax._bases import thin_svd
from moara_jax._nodes import LowRank, is_node
from moara_jax._projection import (
    emit,
    matrix_of,
    project_value,
    projection_side,
    refreshed_bases,
    stage_settings,
    state_ranks,
    swap,
    transport,
    zero_bases,
)
from moara_jax._validate import is_int
from moara_jax.hosts._base import Host, StageOptions, real_number
from moara_jax.hosts.fira import DEFAULT_GROWTH_LIMIT, fira_stage


class SubTrackProjectState(NamedTuple):
    """State of :func:`subtrack_project`."""

    count: jax.Array  # shape=(), dtype=jnp.int32: steps taken.
    basis: Any  # per leaf (..., d, r) in the leaf's dtype.
    initial_basis: Any  # the step-0 basis, which the moments are transported from.


def geodesic_step(basis: jax.Array, a: jax.Array, step_size: float) -> jax.Array:
    """One SubTrack++ step of ``basis`` (``(..., d, r)``) toward the column space of ``a``
    (``(..., d, e)``), float32: the Grassmann geodesic along the top singular triplet of the
    tangent of ``min_W ||a - P W||^2``, of length ``step_size`` times its singular value.

    Args:
      basis: ``P``, ``(..., d, r)``, of full column rank (``P^T P`` is inverted; a rank-deficient
        one gives NaNs).
      a: the matrix whose column space is tracked, ``(..., d, e)``.
      step_size: the geodesic's ``eta``.

    Returns:
      The moved basis, ``(..., d, r)``, float32 (``basis`` unchanged where the tangent is zero).
    """
    p, a = basis.astype(jnp.float32), a.astype(jnp.float32)
    pt = swap(p)
    w = jnp.linalg.solve(pt @ p, pt @ a)  # least squares (P has full column rank)
    d = -2.0 * (a - p @ w) @ swap(w)  # dF/dP
    tangent = d - p @ (pt @ d)
    u, s, vh = thin_svd(tangent)
    u1, s1, v1 = u[..., :, :1], s[..., :1, None], swap(vh[..., :1, :])  # (d,1), (1,1), (r,1)
    pv = p @ v1
    moved = pv * jnp.cos(step_size * s1) - u1 * jnp.sin(step_size * s1)
    return p + (moved - pv) @ swap(v1)


def subtrack_project(
    rank: int | Callable[[Any], int],
    update_proj_gap: int = 200,
    *,
    step_size: float = 10.0,
    track_all: bool = False,
    svd: str = "exact",
    seed: int = 0,
    canonical_signs: bool = False,
    name: str | Callable[[Any], str] | None = None,
) -> optax.GradientTransformation:
    """Projects every leaf (or a ``Decomposed`` direction) like :func:`project`, with SubTrack++'s
    basis: an SVD at step 0, then a geodesic step (:func:`geodesic_step`) every
    ``update_proj_gap`` steps on the matrix it projects.

    Emits :class:`LowRank` nodes carrying the projected matrix (``projected``, for
    :func:`fira_adam`) and the initial basis (``prev_basis``, for :func:`transport_moments`).

    Args:
      rank, update_proj_gap: as :func:`project` (the interval is the reference's
        ``subspace_update_interval``): the basis moves at the updates whose step count (0 at
        the first) is a positive multiple of it.
      step_size: the geodesic's ``eta``, a non-negative number (the reference's Llama scripts: 10).
      track_all: also move bases of the fan_in side (the reference leaves them at step 0's).
      svd, seed, canonical_signs, name: as :func:`project`, for the step-0 basis (``name`` for
        the rank-clipping warning).

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`SubTrackProjectState`: per leaf
      the current basis ``(..., d, r)`` and the step-0 one, in the leaf's dtype. ``update`` emits
      those :class:`LowRank` nodes (inside ``Decomposed`` when given one, its gradient dropped).

    Raises:
      ValueError: for a bad ``rank``, ``update_proj_gap``, ``svd``, ``step_size`` or
        ``track_all`` (not a bool); at ``init``, for a leaf that is not a non-empty matrix; at
        ``update``, for a state made with other ranks.
    """
    rank_fn, name_fn = stage_settings(rank, update_proj_gap, "std", svd, name)
    if not (real_number(step_size) and step_size >= 0):
        raise ValueError(f"step_size must be a non-negative number, got {step_size!r}")
    if not isinstance(track_all, bool):
        raise ValueError(f"track_all must be True or False, got {track_all!r}")

    def init_fn(params):
        basis = zero_bases("subtrack_project", params, rank_fn, name_fn)
        return SubTrackProjectState(jnp.zeros([], jnp.int32), basis, jax.tree.map(jnp.zeros_like, basis))

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_node)
        old, initial = (treedef.flatten_up_to(f) for f in state[1:])
        ranks = state_ranks("subtrack_project", updates, old, rank_fn)
        mats = [matrix_of(u) for u in leaves]
        sides = [projection_side(m.shape) for m in mats]
        tracked = [track_all or side == "out" for side in sides]

        # Each branch gives (bases, initial bases); step 0's SVD basis is both.
        def first():
            new = refreshed_bases(leaves, old, ranks, svd, seed, state.count, canonical_signs)
            return new, new

        def track():
            out = []
            for m, b, side, moves in zip(mats, old, sides, tracked, strict=True):
                a = m if side == "in" else swap(m)  # the projected side first
                out.append(geodesic_step(b, a, step_size).astype(b.dtype) if moves else b)
            return out, list(initial)

        if leaves:
            branch = jnp.where(state.count == 0, 0, jnp.where(state.count % update_proj_gap == 0, 1, 2))
            bases, initial = jax.lax.switch(branch, [first, track, lambda: (list(old), list(initial))])
        else:
            bases = []
        out = []
        for u, m, b, b0, side in zip(leaves, mats, bases, initial, sides, strict=True):
            low = LowRank(project_value(m, b, side), b, side, projected=m, prev_basis=b0)
            out.append(emit(u, low))
        new_state = SubTrackProjectState(
            optax.safe_increment(state.count), treedef.unflatten(bases), treedef.unflatten(initial)
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def transport_moments(
    adam: optax.GradientTransformation, every: int, b2: float = 0.999
) -> optax.GradientTransformation:
    """Wraps an Adam stage (:func:`inner_adam`, :func:`fira_adam`) with SubTrack++'s
    projection-aware moments: after each update whose step count is a multiple of ``every``,
    the subspace moments of every :class:`LowRank` that carries a ``prev_basis`` ``P_0`` move into
    its ``basis`` ``P`` (``C = P^T P_0``): ``m <- C m``, ``v <- |(1 - b2) (C*C (v - m^2) + (C m)^2)|``
    (the reference's formula). The state is the wrapped stage's.

    Args:
      adam: the Adam stage wrapped; its state must be :class:`InnerAdamState` or hold one as
        ``inner`` (:class:`FiraState`).
      every: the interval, a positive integer (SubTrack++'s ``update_proj_gap``): the moments
        move after the updates whose step count (that after the update) is a multiple of it.
      b2: the ``b2`` of the formula's ``(1 - b2)`` factor (the wrapped Adam's). Not checked.

    Returns:
      An ``optax.GradientTransformation`` with ``adam``'s ``init`` and state, whose ``update``
      returns ``adam``'s output unchanged and its state with the subspace moments (``dir_mu``,
      ``dir_nu``) moved.

    Raises:
      ValueError: for an ``every`` that is not a positive integer.
      TypeError: at ``update``, when ``adam``'s state is not one of those above.
    """
    if not is_int(every):
        raise ValueError(f"every must be a positive integer, got {every!r}")

    def update_fn(updates, state, params=None):
        out, new_state = adam.update(updates, state, params)
        inner = new_state.inner if hasattr(new_state, "inner") else new_state
        if not isinstance(inner, InnerAdamState):
            raise TypeError("transport_moments wraps inner_adam or fira_adam")
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_node)
        mus, nus = treedef.flatten_up_to(inner.dir_mu), treedef.flatten_up_to(inner.dir_nu)

        def moved():
            new_mus, new_nus = [], []
            for u, mu, nu in zip(leaves, mus, nus, strict=True):
                low = matrix_of(u)
                if not isinstance(low, LowRank) or low.prev_basis is None:
                    new_mus.append(mu)
                    new_nus.append(nu)
                    continue
                c = swap(low.basis.astype(jnp.float32)) @ low.prev_basis.astype(jnp.float32)
                m32, v32 = mu.astype(jnp.float32), nu.astype(jnp.float32)
                m_new = transport(c, m32, low.side)
                v_new = jnp.abs((1.0 - b2) * (transport(jnp.square(c), v32 - jnp.square(m32), low.side)
                                               + jnp.square(m_new)))  # fmt: skip
                new_mus.append(m_new.astype(mu.dtype))
                new_nus.append(v_new.astype(nu.dtype))
            return new_mus, new_nus

        if leaves:
            mus, nus = jax.lax.cond(inner.count % every == 0, moved, lambda: (list(mus), list(nus)))
        inner = inner._replace(dir_mu=treedef.unflatten(mus), dir_nu=treedef.unflatten(nus))
        new_state = new_state._replace(inner=inner) if hasattr(new_state, "inner") else inner
        return out, new_state

    return optax.GradientTransformation(adam.init, update_fn)


@dataclasses.dataclass(frozen=True)
class SubTrackPP(Host):
    """SubTrack++ (Rajabi et al., https://arxiv.org/abs/2502.01586), as its official code runs
    it: an SVD basis at step 0, then every ``T`` steps one Grassmann geodesic step toward the
    gradient's subspace, Adam moments moved into the current basis (from the initial one) every
    ``T`` steps, and Fira's recovery scaling of the dropped gradient
    (:func:`moara_jax.subtrack_project`, :func:`moara_jax.transport_moments`, :func:`moara_jax.fira_adam`).

    Attributes:
      step_size: the geodesic's ``eta`` (the reference's Llama scripts: 10).
      growth_limit: the recovery term's norm-growth limit per step (Fira's ``gamma``).
      track_all: also move the bases of the fan_in side; the reference code leaves them at the
        step-0 SVD (its tangent there is zero up to rounding), which ``False`` reproduces.
    """

    name: ClassVar[str] = "subtrack_pp"
    state_types: ClassVar[tuple[type, ...]] = (SubTrackProjectState,)
    basis_states: ClassVar[dict] = {SubTrackProjectState: projection_side}

    step_size: float = 10.0
    growth_limit: float = DEFAULT_GROWTH_LIMIT
    track_all: bool = False

    def __post_init__(self):
        if not (real_number(self.step_size) and self.step_size >= 0):
            raise ValueError(f"step_size must be a non-negative number, got {self.step_size!r}")
        if not (real_number(self.growth_limit) and self.growth_limit > 0):
            raise ValueError(f"growth_limit must be positive, got {self.growth_limit!r}")
        if not isinstance(self.track_all, bool):
            raise ValueError(f"track_all must be True or False, got {self.track_all!r}")

    def stages(self, o: StageOptions):
        projection = subtrack_project(
            o.rank, o.update_proj_gap, step_size=self.step_size, track_all=self.track_all, **o.basis
        )
        return projection, transport_moments(fira_stage(o, self.growth_limit), o.update_proj_gap, o.b2)
