"""``decompose`` and ``recompose`` stages, ``stage_chain``, and the two scale-by transforms.

``scale_by_moara = stage_chain(decompose, project, inner_adam, recompose)`` (Algorithm 1, one
target matrix per leaf) and ``scale_by_galore = stage_chain(project, inner_adam, recompose)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from moara_jax._adam import inner_adam
from moara_jax._decomposition import (
    DEFAULT_EPS,
    FAN_IN_AXIS,
    _check_block_size,
    decompose_along,
    recompose_along,
)
from moara_jax._fira import DEFAULT_GROWTH_LIMIT, fira_adam
from moara_jax._hosts import HOSTS, OSD, Fira, GaLore, Host, LDAdam, QGaLore, SubTrackPP, resolve_host
from moara_jax._ldadam import ldadam
from moara_jax._nodes import Decomposed, LowRank, is_node
from moara_jax._osd import osd_project
from moara_jax._projection import project, project_back
from moara_jax._qgalore import q_galore_project
from moara_jax._quant import adam8bit
from moara_jax._subtrack import subtrack_project, transport_moments


def stage_chain(*transforms: optax.GradientTransformation) -> optax.GradientTransformation:
    """Like ``optax.chain``, but each transform is initialised on what the previous one emits.

    The chain's stages change the shape of what flows between them (``project`` emits low-rank
    values, which ``inner_adam`` keeps moments for), so ``optax.chain``, which initialises every
    transform on the parameters, cannot size their states. Here transform ``i + 1`` is initialised
    on ``jax.eval_shape`` of transform ``i``'s update applied to the parameters (as a stand-in
    gradient); nothing is computed or allocated for that. Where a stage preserves the parameters'
    tree, shapes and dtypes, the next is initialised on the parameters themselves, so for
    shape-preserving transforms this is ``optax.chain``.
    """

    def init_fn(params):
        states = []
        example = params
        for i, tx in enumerate(transforms):
            state = tx.init(example)
            states.append(state)
            if i + 1 < len(transforms):
                shaped = jax.eval_shape(lambda u, s, t=tx: t.update(u, s, params)[0], example, state)
                # A shape-preserving stage hands on the parameters themselves, as optax.chain
                # does (some transforms' init reads values).
                example = params if _same_layout(shaped, params) else shaped
        return tuple(states)

    def update_fn(updates, state, params=None):
        new_states = []
        for tx, s in zip(transforms, state, strict=True):
            updates, s = tx.update(updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    return optax.GradientTransformation(init_fn, update_fn)


def _same_layout(shaped: Any, params: Any) -> bool:
    """Whether ``shaped`` (from ``eval_shape``) has ``params``' tree, shapes and dtypes."""
    if jax.tree.structure(shaped) != jax.tree.structure(params):
        return False
    pairs = zip(jax.tree.leaves(shaped), jax.tree.leaves(params), strict=True)
    return all(jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b) for a, b in pairs)


def _check_matrix(path, x) -> None:
    if x.ndim < 2:
        raise ValueError(
            f"decompose: parameter {jax.tree_util.keystr(path)} has shape {x.shape}; only "
            "matrices (..., fan_in, fan_out) can be decomposed (label it as a non-target)"
        )


def decompose(
    block_size: int, eps: float = DEFAULT_EPS, *, keep_source: bool = False
) -> optax.GradientTransformation:
    """Splits every leaf (a Flax kernel ``(..., fan_in, fan_out)``) into block magnitude and direction.

    Blocks of ``block_size`` run along fan_in within each fan_out unit, exactly the paper's rows
    of ``W = kernel^T``. Emits :class:`Decomposed` nodes with ``mag`` of shape
    ``(..., ceil(fan_in / B), fan_out)`` (float32) and a direction of the leaf's shape and dtype.
    Stateless.

    ``keep_source=True`` also carries the gradient in the node, from which a directly following
    ``project`` recomputes the direction inside its refresh branch (so a plain step never keeps
    every direction alive at once; :func:`scale_by_moara` sets it). Leave it off when other
    transforms sit between ``decompose`` and ``project``: they would see, and change, the source.
    """
    block_size = _check_block_size(block_size)

    def init_fn(params):
        jax.tree_util.tree_map_with_path(_check_matrix, params)
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params

        # The node's eps is static (pytree aux data): an injected (array) eps keeps it out, and
        # then the refresh takes the direction itself rather than recomputing it.
        static_eps = isinstance(eps, (int, float))
        carry = keep_source and static_eps

        def split(g):
            mag, direction = decompose_along(g, block_size, FAN_IN_AXIS, eps)
            return Decomposed(
                mag,
                direction,
                block_size,
                eps=float(eps) if static_eps else None,
                source=g if carry else None,
            )

        return jax.tree.map(split, updates), state

    return optax.GradientTransformation(init_fn, update_fn)


def recompose(scale: float = 0.25, block_size: int | None = None) -> optax.GradientTransformation:
    """Maps nodes back to full-shape updates: ``Rep_B(dM) * (scale * P dV_low)``.

    A :class:`LowRank` becomes ``scale * P low`` (GaLore's ``project_back``); a
    :class:`Decomposed` multiplies its (back-projected) direction by the repeated block
    magnitudes, with the blocks of the ``decompose`` that made it. ``block_size``, if given, is
    checked against that. The result is cast to the parameter dtype when ``params`` is passed
    (else to the direction's dtype). Stateless.
    """
    if block_size is not None:
        _check_block_size(block_size)

    def back(u: Any, p: Any):
        core = u.direction if isinstance(u, Decomposed) else u
        dtype = p.dtype if p is not None else (core.basis.dtype if isinstance(core, LowRank) else core.dtype)
        if isinstance(core, LowRank):
            full = scale * project_back(core.value, core.basis, core.side)
            if core.residual is not None:  # a host's full-rank term (Fira)
                full = full + core.residual.astype(full.dtype)
        else:
            full = scale * core.astype(jnp.float32)
        if isinstance(u, Decomposed):
            # The back-projected direction is rounded to the update's dtype before the block
            # magnitudes multiply it: for bf16 parameters half the bytes between the two kernels
            # (the product is rounded to bf16 anyway); float32 parameters are unchanged.
            full = full.astype(dtype)
            if block_size is not None and block_size != u.block_size:
                raise ValueError(
                    f"recompose: block_size={block_size} but the update was decomposed with "
                    f"block_size={u.block_size}"
                )
            full = recompose_along(u.mag, full, u.block_size, FAN_IN_AXIS)
        return full.astype(dtype)

    def update_fn(updates, state, params=None):
        if params is None:
            out = jax.tree.map(lambda u: back(u, None), updates, is_leaf=is_node)
        else:
            out = jax.tree.map(back, updates, params, is_leaf=is_node)
        return out, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def host_stages(
    host: str | Host,
    rank: int | Callable[[Any], int],
    *,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    mu_dtype: Any = None,
    mag_dtype: Any = "float32",
    proj_type: str = "std",
    svd: str = "exact",
    seed: int = 0,
    canonical_signs: bool = False,
    name: str | Callable[[Any], str] | None = None,
) -> tuple[optax.GradientTransformation, ...]:
    """A host's stages between ``decompose`` (if any) and ``recompose``: GaLore's :func:`project`
    and :func:`inner_adam`; Fira's ``project`` keeping its source and :func:`fira_adam`;
    Q-GaLore's :func:`q_galore_project` and :func:`adam8bit`; OSD's :func:`osd_project`
    (``update_proj_gap`` unused: its basis moves every step) and :func:`inner_adam`; LDAdam's
    single :func:`ldadam` (projection and Adam in one: each needs the other; ``update_proj_gap``
    unused); SubTrack++'s :func:`subtrack_project` and :func:`fira_adam` inside
    :func:`transport_moments`.

    Q-GaLore's moments are 8-bit or float32 (``QGaLore.min_8bit_size``, ``mag_bits``), so it
    takes no ``mu_dtype``; its INT8 weights and 8-bit AdamW of non-target parameters are not
    stages of the chain (they act on the learning-rate-scaled update and the other parameters):
    :func:`moara_adamw` adds them, by hand use :func:`quantize_weights` and :func:`adam8bit`.
    """
    host = resolve_host(host)
    where = dict(svd=svd, seed=seed, canonical_signs=canonical_signs, name=name)
    if proj_type != "std" and not isinstance(host, (GaLore, Fira)):
        host_name = next(k for k, v in HOSTS.items() if isinstance(host, v))
        raise ValueError(f"the {host_name} host projects with proj_type='std' only, got {proj_type!r}")

    def fira(growth_limit):
        return fira_adam(
            b1, b2, eps, scale=scale, growth_limit=growth_limit, mu_dtype=mu_dtype, mag_dtype=mag_dtype
        )

    if isinstance(host, QGaLore):
        if mu_dtype is not None:
            raise ValueError(
                f"mu_dtype={mu_dtype!r}: the q_galore host keeps 8-bit or float32 moments "
                "(QGaLore.min_8bit_size, mag_bits)"
            )
        projection = q_galore_project(
            rank,
            update_proj_gap,
            bits=host.basis_bits,
            group_size=host.basis_group_size,
            cos_threshold=host.cos_threshold,
            gamma=host.gamma,
            queue_size=host.queue_size,
            **where,
        )
        adam = adam8bit(b1, b2, eps, min_8bit_size=host.min_8bit_size, mag_bits=host.mag_bits)
        return projection, adam
    if isinstance(host, LDAdam):
        stage = ldadam(
            rank,
            rho=host.rho,
            b1=b1,
            b2=b2,
            eps=eps,
            error_feedback=host.error_feedback,
            mu_dtype=mu_dtype,
            mag_dtype=mag_dtype,
            **where,
        )
        return (stage,)
    if isinstance(host, OSD):
        if host.basis_lr is None:
            raise ValueError(
                "the osd host needs OSD(basis_lr=...) here (moara_adamw derives it from its learning rate)"
            )
        projection = osd_project(
            rank,
            host.basis_lr,
            b1=host.b1,
            b2=host.b2,
            eps=host.eps,
            weight_decay=host.weight_decay,
            **where,
        )
        return projection, inner_adam(b1, b2, eps, mu_dtype=mu_dtype, mag_dtype=mag_dtype)
    if isinstance(host, SubTrackPP):
        projection = subtrack_project(
            rank, update_proj_gap, step_size=host.step_size, track_all=host.track_all, **where
        )
        return projection, transport_moments(fira(host.growth_limit), update_proj_gap, b2)
    if isinstance(host, Fira):
        return project(rank, update_proj_gap, proj_type, keep_source=True, **where), fira(host.growth_limit)
    projection = project(rank, update_proj_gap, proj_type, **where)
    return projection, inner_adam(b1, b2, eps, mu_dtype=mu_dtype, mag_dtype=mag_dtype)


_STAGE_ARGS = (
    "update_proj_gap",
    "scale",
    "b1",
    "b2",
    "eps",
    "mu_dtype",
    "proj_type",
    "svd",
    "seed",
    "canonical_signs",
    "name",
)


def _stage_args(arguments: dict) -> dict:
    """The :func:`host_stages` keyword arguments among a scale-by function's ``locals()``."""
    return {k: arguments[k] for k in _STAGE_ARGS}


def scale_by_moara(
    rank: int | Callable[[Any], int],
    block_size: int,
    *,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    decompose_eps: float = DEFAULT_EPS,
    mu_dtype: Any = None,
    mag_dtype: Any = "float32",
    proj_type: str = "std",
    svd: str = "exact",
    seed: int = 0,
    canonical_signs: bool = False,
    name: str | Callable[[Any], str] | None = None,
    host: str | Host = "galore",
) -> optax.GradientTransformation:
    """MoARa's direction for every leaf: decompose -> project -> inner Adam -> recompose.

    Every leaf is a target matrix (Flax layout ``(..., fan_in, fan_out)``); the output is a
    direction with no learning rate, so ``optax.chain(scale_by_moara(...), optax.scale(-lr))`` is
    a full optimizer. See :func:`moara_adamw` for per-module ranks and non-target parameters.

    ``host`` (a name or settings, :mod:`moara_jax` ``GaLore``/``Fira``/``QGaLore``) picks the
    projection and Adam stages (:func:`host_stages`); they then work on the block direction.

    References:
      MoARa (Algorithm 1); Zhao et al., GaLore, https://arxiv.org/abs/2403.03507.
    """
    _check_block_size(block_size)
    stages = host_stages(host, rank, mag_dtype=mag_dtype, **_stage_args(locals()))
    return stage_chain(
        decompose(block_size, decompose_eps, keep_source=True),
        *stages,
        recompose(scale, block_size),
    )


def scale_by_galore(
    rank: int | Callable[[Any], int],
    *,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    mu_dtype: Any = None,
    proj_type: str = "std",
    svd: str = "exact",
    seed: int = 0,
    canonical_signs: bool = False,
    name: str | Callable[[Any], str] | None = None,
    host: str | Host = "galore",
) -> optax.GradientTransformation:
    """GaLore-Adam's direction for every leaf (galore-torch ``GaLoreAdamW``, without the lr), or
    another ``host``'s without decomposition (:func:`host_stages`)."""
    return stage_chain(*host_stages(host, rank, **_stage_args(locals())), recompose(scale))


def scale_by_fira(
    rank: int | Callable[[Any], int],
    *,
    growth_limit: float = DEFAULT_GROWTH_LIMIT,
    **kwargs: Any,
) -> optax.GradientTransformation:
    """Fira's direction for every leaf (the reference ``fira.FiraAdamW``, without the lr):
    ``project(keep_source=True) -> fira_adam -> recompose``; ``scale`` is Fira's ``alpha``.
    Other keyword arguments are :func:`scale_by_galore`'s, but ``host`` (it is Fira)."""
    if "host" in kwargs:
        raise ValueError("scale_by_fira takes no host (it is Fira); use scale_by_galore(host=...)")
    return scale_by_galore(rank, host=Fira(growth_limit), **kwargs)
