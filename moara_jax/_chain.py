"""Algorithm 1's training step as an Optax chain, and its stages.

For each target weight, with ``G`` its gradient (a Flax kernel ``(..., fan_in, fan_out)``):

1. ``M, V <- Decompose(G, B)``: :func:`decompose` (block magnitudes along fan_in);
2. ``P <- TruncatedSVD(V, r)`` every ``T`` steps and ``V~ <- P^T V``: the host's projection,
   :func:`moara_jax.project` for GaLore;
3. ``dV~, dM <- Optimizer(V~), Optimizer(M)``: the host's Adam, :func:`moara_jax.inner_adam`;
4. ``Rep_B(dM) * (P dV~)``: :func:`recompose`; ``moara_adamw`` then applies ``-eta``.

:func:`scale_by_moara` is that chain (:func:`stage_chain` sizes each stage's state on what the
previous one emits); :func:`scale_by_galore` the chain without steps 1 and 4's magnitudes. Each
(and ``moara_adamw``) builds one :class:`StageOptions` from its keywords and passes it down to
:func:`direction_chain`, which asks the host for its stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from moara_jax._decomposition import (
    DEFAULT_EPS,
    FAN_IN_AXIS,
    decompose_along,
    recompose_along,
)
from moara_jax._nodes import Decomposed, LowRank, is_node
from moara_jax._projection import project_back
from moara_jax._sharding import follow_params, placing
from moara_jax._validate import check_block_size, number
from moara_jax.hosts import Fira, Host, StageOptions, resolve_host
from moara_jax.hosts.fira import DEFAULT_GROWTH_LIMIT


@placing
def scale_by_moara(
    rank: int | Callable[[Any], int],
    block_size: int,
    *,
    update_proj_gap: int = StageOptions.update_proj_gap,
    scale: float = StageOptions.scale,
    b1: float = StageOptions.b1,
    b2: float = StageOptions.b2,
    eps: float = StageOptions.eps,
    decompose_eps: float = DEFAULT_EPS,
    mu_dtype: Any = StageOptions.mu_dtype,
    mag_dtype: Any = StageOptions.mag_dtype,
    proj_type: str = StageOptions.proj_type,
    svd: str = StageOptions.svd,
    seed: int = StageOptions.seed,
    canonical_signs: bool = StageOptions.canonical_signs,
    name: str | Callable[[Any], str] | None = StageOptions.name,
    host: str | Host = "galore",
) -> optax.GradientTransformation:
    """MoARa's direction for every leaf: decompose -> project -> inner Adam -> recompose.

    Every leaf is a target matrix (Flax layout ``(..., fan_in, fan_out)``); the output is a
    direction with no learning rate, so ``optax.chain(scale_by_moara(...), optax.scale(-lr))`` is
    a full optimizer. See :func:`moara_adamw` for per-module ranks and non-target parameters.

    ``host`` (a name or settings: :mod:`moara_jax`'s ``GaLore``, ``Fira``, ``QGaLore``, ``OSD``,
    ``LDAdam`` or ``SubTrackPP``) picks the projection and Adam stages (:func:`host_stages`); they
    then work on the block direction. ``rank`` and the keywords but ``decompose_eps``
    (``decompose``'s) and ``host`` are :class:`StageOptions`' fields, with its defaults.

    Args:
      rank: the projection rank, or a function of the parameter's key path giving it.
      block_size: the decomposition block size ``B`` along fan_in (:func:`decompose`).
      update_proj_gap: steps between basis refreshes (GaLore's ``T``; unused by OSD and LDAdam,
        whose bases move every step).
      scale: the factor :func:`recompose` applies to the back-projected direction (Fira's
        ``alpha``).
      b1, b2, eps: the host's Adam of the low-rank values and block magnitudes.
      mu_dtype: dtype of the low-rank moments; ``None`` follows the parameter's (float32 for
        float16). Q-GaLore takes only ``None`` (``ValueError``).
      mag_dtype: dtype of the block magnitudes' moments (float32 by default; Q-GaLore's follow
        ``QGaLore.mag_bits`` instead).
      proj_type: which side is projected; ``'std'`` (galore-torch's rule) is the only one.
      svd, seed, canonical_signs, name: how bases are made and named, as :func:`project` takes
        them.
      decompose_eps: the stabiliser in the block direction ``g / (m + eps)`` (:func:`decompose`).
      host: the low-rank method (:func:`host_stages`): a name (``'galore'``, ``'fira'``,
        ``'q_galore'``, ``'ldadam'``, ``'subtrack_pp'`` or a registered host's) or a settings
        object (:mod:`moara_jax.hosts`). OSD needs ``OSD(basis_lr=...)``: ``'osd'`` by name is a
        ``ValueError``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose update maps each gradient to
      ``Rep_B(dM) * (scale * P dV~)`` of its shape, with no learning rate (in the parameter's dtype
      when ``params`` is passed). Its state is the tuple of the stages' states (:func:`stage_chain`),
      ``(EmptyState(), *host stages' states, EmptyState())``: under GaLore ``(EmptyState(),
      ProjectState, InnerAdamState, EmptyState())``. ``init`` places it as the parameters are
      (:func:`state_shardings`) and refuses a leaf that is not a matrix (``ValueError``).

    Raises:
      ValueError: a bad setting (:class:`StageOptions`' checks, ``block_size``, ``rank``,
        ``host``); arrays (injected hyperparameters) are not checked.

    References:
      MoARa (Algorithm 1); Zhao et al., GaLore, https://arxiv.org/abs/2403.03507.
    """
    check_block_size(block_size)
    options = StageOptions(
        rank=rank,
        update_proj_gap=update_proj_gap,
        scale=scale,
        b1=b1,
        b2=b2,
        eps=eps,
        mu_dtype=mu_dtype,
        mag_dtype=mag_dtype,
        proj_type=proj_type,
        svd=svd,
        seed=seed,
        canonical_signs=canonical_signs,
        name=name,
    )
    return direction_chain(resolve_host(host), options, block_size, decompose_eps)


@placing
def scale_by_galore(
    rank: int | Callable[[Any], int],
    *,
    update_proj_gap: int = StageOptions.update_proj_gap,
    scale: float = StageOptions.scale,
    b1: float = StageOptions.b1,
    b2: float = StageOptions.b2,
    eps: float = StageOptions.eps,
    mu_dtype: Any = StageOptions.mu_dtype,
    proj_type: str = StageOptions.proj_type,
    svd: str = StageOptions.svd,
    seed: int = StageOptions.seed,
    canonical_signs: bool = StageOptions.canonical_signs,
    name: str | Callable[[Any], str] | None = StageOptions.name,
    host: str | Host = "galore",
) -> optax.GradientTransformation:
    """GaLore-Adam's direction for every leaf (galore-torch ``GaLoreAdamW``, without the lr), or
    another ``host``'s without decomposition (:func:`host_stages`). ``rank`` and the keywords
    but ``host`` are :class:`StageOptions`' fields, with its defaults.

    Args:
      rank: the projection rank, or a function of the parameter's key path giving it.
      update_proj_gap: steps between basis refreshes (GaLore's ``T``; unused by OSD and LDAdam,
        whose bases move every step).
      scale: the factor :func:`recompose` applies to the back-projected direction (Fira's
        ``alpha``).
      b1, b2, eps: the host's Adam of the low-rank values.
      mu_dtype: dtype of the low-rank moments; ``None`` follows the parameter's (float32 for
        float16). Q-GaLore takes only ``None`` (``ValueError``).
      proj_type: which side is projected; ``'std'`` (galore-torch's rule) is the only one.
      svd, seed, canonical_signs, name: how bases are made and named, as :func:`project` takes
        them.
      host: the low-rank method (:func:`host_stages`): a name (``'galore'``, ``'fira'``,
        ``'q_galore'``, ``'ldadam'``, ``'subtrack_pp'`` or a registered host's) or a settings
        object (:mod:`moara_jax.hosts`). OSD needs ``OSD(basis_lr=...)``: ``'osd'`` by name is a
        ``ValueError``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose update maps each gradient ``G`` to
      ``scale * P dV~`` (``dV~`` the Adam direction of ``P^T G``, or ``G P`` for the other side;
      Fira and SubTrack++ add their full-rank residual) of its shape, with no learning rate (in
      the parameter's dtype when ``params`` is passed). Its state is the tuple of the host's
      stages' states and ``recompose``'s ``EmptyState()``: under GaLore ``(ProjectState,
      InnerAdamState, EmptyState())``. ``init`` places it as the parameters are
      (:func:`state_shardings`) and refuses a leaf that is not a matrix (``ValueError``).

    Raises:
      ValueError: a bad setting (:class:`StageOptions`' checks, ``rank``, ``host``); arrays
        (injected hyperparameters) are not checked.
    """
    options = StageOptions(
        rank=rank,
        update_proj_gap=update_proj_gap,
        scale=scale,
        b1=b1,
        b2=b2,
        eps=eps,
        mu_dtype=mu_dtype,
        proj_type=proj_type,
        svd=svd,
        seed=seed,
        canonical_signs=canonical_signs,
        name=name,
    )
    return direction_chain(resolve_host(host), options)


def scale_by_fira(
    rank: int | Callable[[Any], int],
    *,
    growth_limit: float = DEFAULT_GROWTH_LIMIT,
    **kwargs: Any,
) -> optax.GradientTransformation:
    """Fira's direction for every leaf (the reference ``fira.FiraAdamW``, without the lr):
    ``project(keep_projected=True) -> fira_adam -> recompose``; ``scale`` is Fira's ``alpha``.
    Other keyword arguments are :func:`scale_by_galore`'s, but ``host`` (it is Fira).

    Args:
      rank: the projection rank, or a function of the parameter's key path giving it.
      growth_limit: Fira's ``gamma``, the most the residual's norm may grow from one step to the
        next (:class:`Fira`; not positive: ``ValueError``).
      **kwargs: :func:`scale_by_galore`'s keywords; ``host`` is a ``ValueError``.

    Returns:
      :func:`scale_by_galore` with ``host=Fira(growth_limit)``: its state is ``(ProjectState,
      FiraState, EmptyState())``.
    """
    if "host" in kwargs:
        raise ValueError("scale_by_fira takes no host (it is Fira); use scale_by_galore(host=...)")
    return scale_by_galore(rank, host=Fira(growth_limit), **kwargs)


def _check_matrix(path, x) -> None:
    if x.ndim < 2:
        raise ValueError(
            f"decompose: parameter {jax.tree_util.keystr(path)} has shape {x.shape}; only "
            "matrices (..., fan_in, fan_out) can be decomposed (label it as a non-target)"
        )


def decompose(
    block_size: int, eps: float = DEFAULT_EPS, *, keep_gradient: bool = False
) -> optax.GradientTransformation:
    """Splits every leaf (a Flax kernel ``(..., fan_in, fan_out)``) into block magnitude and direction.

    Blocks of ``block_size`` run along fan_in within each fan_out unit, exactly the paper's rows
    of ``W = kernel^T``. Emits :class:`Decomposed` nodes with ``mag`` of shape
    ``(..., ceil(fan_in / B), fan_out)`` (float32) and a direction of the leaf's shape and dtype.
    Stateless.

    ``keep_gradient=True`` also carries the gradient in the node (``Decomposed.gradient``), from
    which a directly following ``project`` recomputes the direction inside its refresh branch (so
    a plain step never keeps every direction alive at once; :func:`scale_by_moara` sets it). Leave
    it off when other transforms sit between ``decompose`` and ``project``: they would see, and
    change, the gradient.

    Args:
      block_size: the block size ``B``, a positive integer of any integer type (``ValueError``
        otherwise).
      eps: the stabiliser in the direction ``g / (m + eps)``. An array (an injected
        hyperparameter) works, but then no gradient is carried (``keep_gradient`` has no effect).
      keep_gradient: carry the gradient in each node, as above.

    Returns:
      An ``optax.GradientTransformation`` mapping every leaf to a :class:`Decomposed` node, with
      state ``optax.EmptyState()``. ``init`` refuses a leaf with fewer than two axes
      (``ValueError``).
    """
    block_size = check_block_size(block_size)

    def init_fn(params):
        jax.tree_util.tree_map_with_path(_check_matrix, params)
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params

        # The node's eps is static (pytree aux data): an injected (array) eps keeps it out, and
        # then the refresh takes the direction itself rather than recomputing it.
        static_eps = number(eps)
        carry = keep_gradient and static_eps

        def split(g):
            mag, direction = decompose_along(g, block_size, FAN_IN_AXIS, eps)
            return Decomposed(
                mag,
                direction,
                block_size,
                eps=float(eps) if static_eps else None,
                gradient=g if carry else None,
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

    Args:
      scale: the factor on the back-projected direction (GaLore's scale, Fira's ``alpha``;
        :class:`StageOptions`' default). A plain (not projected) direction is multiplied by it
        too; a host's full-rank ``residual`` (Fira) is added unscaled.
      block_size: if given, the block size every ``Decomposed`` update must carry: a positive
        integer (``ValueError`` otherwise), and a mismatch is a ``ValueError`` at update.

    Returns:
      An ``optax.GradientTransformation`` mapping each node (and plain leaf) to a full-shape
      array, in the parameter's dtype when ``params`` is passed, else in the basis's dtype for a
      ``LowRank`` and the direction's otherwise; state ``optax.EmptyState()``.
    """
    if block_size is not None:
        check_block_size(block_size)

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


def stage_chain(*transforms: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Like ``optax.chain``, but each transform is initialised on what the previous one emits.

    The chain's stages change the shape of what flows between them (``project`` emits low-rank
    values, which ``inner_adam`` keeps moments for), so ``optax.chain``, which initialises every
    transform on the parameters, cannot size their states. Here transform ``i + 1`` is initialised
    on ``jax.eval_shape`` of transform ``i``'s update applied to the parameters (as a stand-in
    gradient); nothing is computed or allocated for that. Where a stage preserves the parameters'
    tree, shapes and dtypes, the next is initialised on the parameters themselves, so for
    shape-preserving transforms this is ``optax.chain``. The state is placed as the parameters
    are, and the stages run on Explicit mesh axes (:func:`moara_jax.state_shardings`).

    Args:
      *transforms: the stages, in order, each an ``optax.GradientTransformation``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose update runs the transforms in order,
      each given ``params`` (extra keyword arguments are dropped), and whose state is the tuple
      of their states.
    """
    return follow_params(_unplaced_stage_chain(*transforms))


def _unplaced_stage_chain(*transforms: optax.GradientTransformation) -> optax.GradientTransformation:
    """:func:`stage_chain` without its placement of the state (the stages inside a transform
    that places its own)."""

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


def host_stages(
    host: str | Host,
    rank: int | Callable[[Any], int],
    *,
    update_proj_gap: int = StageOptions.update_proj_gap,
    scale: float = StageOptions.scale,
    b1: float = StageOptions.b1,
    b2: float = StageOptions.b2,
    eps: float = StageOptions.eps,
    mu_dtype: Any = StageOptions.mu_dtype,
    mag_dtype: Any = StageOptions.mag_dtype,
    proj_type: str = StageOptions.proj_type,
    svd: str = StageOptions.svd,
    seed: int = StageOptions.seed,
    canonical_signs: bool = StageOptions.canonical_signs,
    name: str | Callable[[Any], str] | None = StageOptions.name,
) -> tuple[optax.GradientTransformation, ...]:
    """A host's stages between ``decompose`` (if any) and ``recompose``: GaLore's :func:`project`
    and :func:`inner_adam`; Fira's ``project`` keeping the projected matrix and :func:`fira_adam`;
    Q-GaLore's :func:`q_galore_project` and :func:`adam8bit`; OSD's :func:`osd_project`
    (``update_proj_gap`` unused: its basis moves every step) and :func:`inner_adam`; LDAdam's
    single :func:`ldadam` (projection and Adam in one: each needs the other; ``update_proj_gap``
    unused); SubTrack++'s :func:`subtrack_project` and :func:`fira_adam` inside
    :func:`transport_moments`. ``rank`` and the keywords are :class:`StageOptions`' fields, with
    its defaults.

    Q-GaLore's moments are 8-bit or float32 (``QGaLore.min_8bit_size``, ``mag_bits``), so it
    takes no ``mu_dtype``; its INT8 weights and 8-bit AdamW of non-target parameters are not
    stages of the chain (they act on the learning-rate-scaled update and the other parameters):
    :func:`moara_adamw` adds them, by hand use :func:`quantize_weights` and :func:`adam8bit`.

    Args:
      host: the low-rank method: a name (``'galore'``, ``'fira'``, ``'q_galore'``, ``'ldadam'``,
        ``'subtrack_pp'`` or a registered host's) or a settings object (:mod:`moara_jax.hosts`).
        OSD needs ``OSD(basis_lr=...)``: ``'osd'`` by name is a ``ValueError``.
      rank: the projection rank, or a function of the parameter's key path giving it.
      update_proj_gap: steps between basis refreshes (GaLore's ``T``).
      scale: Fira's ``alpha`` in :func:`fira_adam`'s residual (Fira, SubTrack++); the other
        hosts' stages do not use it (``recompose`` applies it).
      b1, b2, eps: the host's Adam of the low-rank values and block magnitudes (OSD's basis
        AdamW takes ``OSD``'s own).
      mu_dtype: dtype of the low-rank moments; ``None`` follows the parameter's (float32 for
        float16). Q-GaLore takes only ``None``.
      mag_dtype: dtype of the block magnitudes' moments (Q-GaLore's follow ``QGaLore.mag_bits``).
      proj_type: which side is projected; ``'std'`` (galore-torch's rule) is the only one.
      svd, seed, canonical_signs, name: how bases are made and named, as :func:`project` takes
        them.

    Returns:
      A tuple of ``optax.GradientTransformation`` (two; LDAdam's one), to run with
      :func:`stage_chain` between :func:`decompose` (if any) and :func:`recompose`. They take the
      gradient or ``Decomposed`` nodes and emit :class:`LowRank` nodes (inside the
      ``Decomposed``), whose ``recompose`` is the direction with no learning rate.

    Raises:
      ValueError: a bad setting (:class:`StageOptions`' checks, ``rank``, the host's); arrays
        (injected hyperparameters) are not checked.
    """
    options = StageOptions(
        rank=rank,
        update_proj_gap=update_proj_gap,
        scale=scale,
        b1=b1,
        b2=b2,
        eps=eps,
        mu_dtype=mu_dtype,
        mag_dtype=mag_dtype,
        proj_type=proj_type,
        svd=svd,
        seed=seed,
        canonical_signs=canonical_signs,
        name=name,
    )
    return stages_of(resolve_host(host), options)


def stages_of(host: Host, options: StageOptions) -> tuple[optax.GradientTransformation, ...]:
    """``host.stages(options)``, once the host has accepted ``options.proj_type``."""
    if host.proj_types is not None and options.proj_type not in host.proj_types:
        allowed = ", ".join(f"proj_type={p!r}" for p in host.proj_types)
        raise ValueError(f"the {host.name} host projects with {allowed} only, got {options.proj_type!r}")
    return tuple(host.stages(options))


def direction_chain(
    host: Host, options: StageOptions, block_size: int | None = None, decompose_eps: float = DEFAULT_EPS
) -> optax.GradientTransformation:
    """The direction of the target matrices: the host's stages (:func:`stages_of`) and
    ``recompose``, after ``decompose`` into blocks of ``block_size`` unless it is ``None``
    (:func:`scale_by_moara`, else :func:`scale_by_galore`)."""
    stages = stages_of(host, options)
    if block_size is None:
        return _unplaced_stage_chain(*stages, recompose(options.scale))
    return _unplaced_stage_chain(
        decompose(block_size, decompose_eps, keep_gradient=True),
        *stages,
        recompose(options.scale, block_size),
    )
