"""``inner_adam``: Adam in galore-torch's formulation, on plain leaves and on stage nodes.

The Adams of GaLore and its hosts compute ``step_size * mu / (sqrt(nu) + eps)`` with
``step_size = sqrt(1 - b2**t) / (1 - b1**t)``, i.e. ``m_hat / (sqrt(v_hat) + eps / sqrt(1 - b2**t))``:
galore-torch's ``GaLoreAdamW`` (and HF's ``AdamW``) step. ``optax.scale_by_adam`` and PyTorch's
``torch.optim.AdamW`` add ``eps`` to ``sqrt(v_hat)`` instead, which differs in the first steps;
the hosts whose references use that (LDAdam, OSD's basis) take :func:`torch_adam_direction`.

On a :class:`LowRank` leaf the moments are the *direction* moments (low-rank shaped); on a
:class:`Decomposed` leaf the block magnitudes get their own Adam, fed ``M`` itself as if it were a
gradient, with float32 moments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moara_jax._nodes import Decomposed, LowRank, is_node
from moara_jax._validate import check_adam, dtype_arg, number


def moment_dtype(dtype) -> jnp.dtype:
    """The dtype Adam's moments are stored in for values of ``dtype`` (no ``mu_dtype`` given): its
    own, but float32 for float16, whose range flushes the second moment ``(1 - b2) g^2`` of
    gradients below about 2e-3 to zero (the step then divides by ``eps`` alone: Adam's updates
    came out 4 to 11 times too large). bfloat16 has float32's range and keeps its own."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


class InnerAdamState(NamedTuple):
    """State of :func:`inner_adam`. Per leaf, exactly the groups that apply are arrays; the
    others are ``None``.
    """

    count: jax.Array  # shape=(), dtype=jnp.int32: steps taken.
    mu: Any  # first moments of plain (unprojected) leaves.
    nu: Any  # second moments of plain leaves.
    dir_mu: Any  # first moments of low-rank (projected direction / gradient) values.
    dir_nu: Any  # second moments of low-rank values.
    mag_mu: Any  # first moments of block magnitudes (float32 by default).
    mag_nu: Any  # second moments of block magnitudes.


def adam_direction(
    g: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    count_inc: jax.Array,
    b1: float,
    b2: float,
    eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One galore-torch Adam step on ``g``: returns ``(direction, new_mu, new_nu)``.

    Math in float32; moments stored in their own dtype; direction in ``g``'s dtype.
    """
    g32 = g.astype(jnp.float32)
    mu32 = b1 * mu.astype(jnp.float32) + (1.0 - b1) * g32
    nu32 = b2 * nu.astype(jnp.float32) + (1.0 - b2) * jnp.square(g32)
    t = count_inc.astype(jnp.float32)
    step_size = jnp.sqrt(1.0 - b2**t) / (1.0 - b1**t)
    direction = step_size * (mu32 / (jnp.sqrt(nu32) + eps))
    return direction.astype(g.dtype), mu32.astype(mu.dtype), nu32.astype(nu.dtype)


def inner_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    mu_dtype: Any = None,
    mag_dtype: Any = "float32",
) -> optax.GradientTransformation:
    """Adam (galore-torch formulation) on every leaf, understanding the chain's nodes.

    Args:
      b1, b2, eps: Adam's decay rates and stabiliser.
      mu_dtype: dtype of the (direction and plain) moments; ``None`` follows the leaf's dtype
        (float32 for float16 parameters, whose moments would underflow).
      mag_dtype: dtype of the magnitude moments (float32 by default, as in the paper).

    Returns:
      A transform mapping a gradient to its Adam direction (no learning rate), a ``LowRank`` to a
      ``LowRank`` of Adam directions with the same basis, a ``Decomposed`` to a ``Decomposed`` of
      Adam directions.
    """
    check_adam(b1, b2, eps)
    mu_dtype = dtype_arg("mu_dtype", mu_dtype)
    mag_dtype = dtype_arg("mag_dtype", mag_dtype)

    def step(g, mu, nu, count_inc, kind):
        del kind
        return adam_direction(g, mu, nu, count_inc, b1, b2, eps)

    return node_adam(zero_moments(mu_dtype, mag_dtype), step)


class LeafMoments(NamedTuple):
    """One leaf's slots of :class:`InnerAdamState` (``None`` where the leaf has no such part)."""

    mu: Any
    nu: Any
    dir_mu: Any
    dir_nu: Any
    mag_mu: Any
    mag_nu: Any


# What an Adam moment belongs to (node_adam's ``kind``): a plain (unprojected) leaf, a projected
# low-rank value, or block magnitudes.
PLAIN, DIRECTION, MAG = "plain", "direction", "magnitude"


def zero_moments(mu_dtype: Any, mag_dtype: Any) -> Callable[[jax.Array, str, Any], tuple[Any, Any]]:
    """:func:`node_adam`'s ``init_moments`` for plain arrays: zeros in ``mag_dtype`` for block
    magnitudes, else in ``mu_dtype`` (``None``: :func:`moment_dtype` of the value's)."""

    def zeros(x, kind, path):
        del path
        dtype = mag_dtype if kind == MAG else (mu_dtype or moment_dtype(x.dtype))
        return jnp.zeros(x.shape, dtype), jnp.zeros(x.shape, dtype)

    return zeros


def node_adam(
    init_moments: Callable[[jax.Array, str, Any], tuple[Any, Any]],
    step: Callable[..., tuple[jax.Array, Any, Any]],
) -> optax.GradientTransformation:
    """An Adam over leaves and the chain's nodes, with its moment storage and step supplied.

    ``init_moments(x, kind, path)`` makes the two stored moments ``(mu, nu)`` (arrays, or pytrees
    such as quantized ones) for a value like ``x`` at parameter ``path`` (a JAX key path);
    ``step(g, mu, nu, count_inc, kind)`` returns ``(direction, mu, nu)``. ``kind`` is
    :data:`PLAIN`, :data:`DIRECTION` (a ``LowRank`` value) or :data:`MAG` (the block magnitudes
    of a ``Decomposed``). The state is :class:`InnerAdamState`, so ``state_bytes`` sorts the
    moments by component whatever their storage.
    """

    def init_fn(params):
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_node)
        groups = {k: [] for k in ("mu", "nu", "dir_mu", "dir_nu", "mag_mu", "mag_nu")}
        for path, u in with_paths:
            mag = u.mag if isinstance(u, Decomposed) else None
            core = u.direction if isinstance(u, Decomposed) else u
            low = core.value if isinstance(core, LowRank) else None
            plain = core if low is None else None
            for prefix, x, kind in (("mag_", mag, MAG), ("dir_", low, DIRECTION), ("", plain, PLAIN)):
                mu, nu = (None, None) if x is None else init_moments(x, kind, path)
                groups[prefix + "mu"].append(mu)
                groups[prefix + "nu"].append(nu)
        trees = {k: treedef.unflatten(v) for k, v in groups.items()}
        return InnerAdamState(jnp.zeros([], jnp.int32), **trees)

    def update_fn(updates, state, params=None):
        del params
        count_inc = optax.safe_increment(state.count)
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_node)

        def up(x):
            return treedef.flatten_up_to(x)

        def leaf_step(u, moments: LeafMoments) -> tuple[Any, LeafMoments]:
            """One leaf: its plain value, low-rank value and block magnitudes (whichever it
            has) each take an Adam step with their own moments."""
            core = u.direction if isinstance(u, Decomposed) else u
            if (isinstance(core, LowRank) and moments.dir_mu is None) or (
                isinstance(u, Decomposed) and moments.mag_mu is None
            ):
                raise ValueError(
                    "an Adam stage got projected or decomposed values, but its state was made "
                    "for the parameters: chain the stages with moara_jax.stage_chain (which "
                    "initialises each on what the previous emits), not optax.chain"
                )
            if isinstance(core, LowRank):
                d, dir_mu, dir_nu = step(core.value, moments.dir_mu, moments.dir_nu, count_inc, DIRECTION)
                core_out, moments = (
                    LowRank(d, core.basis, core.side),
                    moments._replace(dir_mu=dir_mu, dir_nu=dir_nu),
                )
            else:
                core_out, mu, nu = step(core, moments.mu, moments.nu, count_inc, PLAIN)
                moments = moments._replace(mu=mu, nu=nu)
            if not isinstance(u, Decomposed):
                return core_out, moments
            dm, mag_mu, mag_nu = step(u.mag, moments.mag_mu, moments.mag_nu, count_inc, MAG)
            return u.replace(mag=dm, direction=core_out), moments._replace(mag_mu=mag_mu, mag_nu=mag_nu)

        per_leaf = [LeafMoments(*m) for m in zip(*(up(f) for f in state[1:]), strict=True)]
        stepped = [leaf_step(u, m) for u, m in zip(leaves, per_leaf, strict=True)]
        out = [o for o, _ in stepped]
        new = {f: treedef.unflatten([getattr(m, f) for _, m in stepped]) for f in LeafMoments._fields}
        new_state = InnerAdamState(count_inc, **new)
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def torch_adam_direction(
    g: jax.Array, mu: jax.Array, nu: jax.Array, count_inc: jax.Array, b1: float, b2: float, eps: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Adam step in PyTorch ``AdamW``'s formula, ``(m / c1) / (sqrt(v / c2) + eps)``: returns
    ``(direction, new_mu, new_nu)`` with float32 math, moments in their dtypes and the direction
    in ``g``'s.

    Args:
      g: the value to step on (a gradient, or a projected low-rank value).
      mu, nu: its first and second moments before the step (``g``'s shape, any float dtype).
      count_inc: the step number ``t`` counting this step (1 on the first), an integer array; the
        bias corrections are ``c1 = 1 - b1**t`` and ``c2 = 1 - b2**t``.
      b1, b2, eps: Adam's decay rates and stabiliser (not checked here).

    Returns:
      ``(direction, new_mu, new_nu)``: the Adam direction (no learning rate) in ``g``'s dtype, and
      ``m = b1 mu + (1 - b1) g`` and ``v = b2 nu + (1 - b2) g^2`` in ``mu``'s and ``nu``'s dtypes.
    """
    g32 = g.astype(jnp.float32)
    mu32 = b1 * mu.astype(jnp.float32) + (1.0 - b1) * g32
    nu32 = b2 * nu.astype(jnp.float32) + (1.0 - b2) * jnp.square(g32)
    return torch_adam_from(mu32, nu32, count_inc, b1, b2, eps, g.dtype, mu.dtype, nu.dtype)


def torch_adam_from(mu32, nu32, count_inc, b1, b2, eps, dtype, mu_dtype, nu_dtype):
    t = count_inc.astype(jnp.float32)
    direction = (mu32 / (1.0 - b1**t)) / (jnp.sqrt(nu32 / (1.0 - b2**t)) + eps)
    return direction.astype(dtype), mu32.astype(mu_dtype), nu32.astype(nu_dtype)


def pytorch_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6, mu_dtype: Any = None
) -> optax.GradientTransformation:
    """Adam in PyTorch ``AdamW``'s formula (:func:`torch_adam_direction`) on every leaf, with no
    learning rate and no weight decay: the LDAdam host's non-target parameters, which its reference
    steps with that formula. The state is :class:`InnerAdamState` (moments in ``mu_dtype``, or the
    leaf's, float32 for float16; magnitudes' in float32).

    Args:
      b1, b2, eps: Adam's decay rates and stabiliser; a number out of range (``b1``, ``b2`` in
        ``[0, 1)``, ``eps >= 0``) is a ``ValueError``.
      mu_dtype: dtype of the moments of plain and low-rank values; ``None`` follows each value's
        dtype (float32 for float16). Not a floating dtype: ``ValueError``.

    Returns:
      An ``optax.GradientTransformation`` mapping each leaf to its Adam direction, and the chain's
      nodes as :func:`inner_adam` does (a ``LowRank``'s value and a ``Decomposed``'s magnitudes
      each stepped with their own moments), with :class:`InnerAdamState`.
    """
    check_adam(b1, b2, eps)
    mu_dtype = dtype_arg("mu_dtype", mu_dtype)

    def step(g, mu, nu, count_inc, kind):
        del kind
        return torch_adam_direction(g, mu, nu, count_inc, b1, b2, eps)

    return node_adam(zero_moments(mu_dtype, jnp.float32), step)


class DecayAfterStepState(NamedTuple):
    """State of :func:`decay_after_step`."""

    count: jax.Array  # shape=(), dtype=jnp.int32: steps taken (for a schedule).


def decay_after_step(
    learning_rate: optax.ScalarOrSchedule, weight_decay: float, mask: Any = None
) -> optax.GradientTransformation:
    """Decoupled weight decay on the parameters *after* the step, as galore-torch's ``GaLoreAdamW``
    (and HF's ``AdamW``): ``p <- (p + d) (1 - lr * wd)`` for a learning-rate-scaled step ``d``.

    Place it after ``optax.scale_by_learning_rate``: it maps ``d`` to ``d - lr * wd * (p + d)``.
    ``optax.add_decayed_weights`` before the learning rate decays the parameters before the step
    instead, which differs by ``lr**2 * wd * d``. A Python ``weight_decay`` of 0 gives
    ``optax.identity()``.

    ``mask`` (as ``optax.adamw``'s): a tree of booleans with the parameters' structure (or a
    prefix of it), or a function of the parameters returning one; only leaves marked ``True``
    are decayed, the others pass unchanged (``optax.masked``). ``None`` decays every leaf.

    Args:
      learning_rate: a float or an optax schedule, evaluated at this transform's step count (0 on
        the first update), as ``optax.scale_by_learning_rate`` evaluates it.
      weight_decay: the decay rate ``wd``. A negative or NaN number is a ``ValueError``; an array
        (an injected hyperparameter) is not checked.
      mask: which leaves are decayed, as above.

    Returns:
      An ``optax.GradientTransformation`` mapping each update ``d`` to ``d - lr * wd * (p + d)``
      (float32 math, ``d``'s dtype); its ``update`` needs ``params`` (``ValueError`` without
      them). The state is :class:`DecayAfterStepState` (inside ``optax.MaskedState`` when
      ``mask`` is given). For a Python ``weight_decay`` of 0, ``optax.identity()``.
    """
    if number(weight_decay):
        if not weight_decay >= 0:  # NaN too
            raise ValueError(f"weight_decay must be a non-negative number, got {weight_decay!r}")
        if weight_decay == 0:
            return optax.identity()

    def init_fn(params):
        del params
        return DecayAfterStepState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "decay_after_step needs the parameters: update(updates, state, params) (under "
                "optax.inject_hyperparams weight_decay is an array even at 0: name it in "
                "static_args for an update without them)"
            )
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        factor = jnp.asarray(lr, jnp.float32) * weight_decay

        def decay(d, p):
            d32 = d.astype(jnp.float32)
            return (d32 - factor * (p.astype(jnp.float32) + d32)).astype(d.dtype)

        out = jax.tree.map(decay, updates, params)
        return out, DecayAfterStepState(count=optax.safe_increment(state.count))

    tx = optax.GradientTransformation(init_fn, update_fn)
    return tx if mask is None else optax.masked(tx, mask)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    mu_dtype: Any = None,
    mask: Any = None,
) -> optax.GradientTransformation:
    """AdamW in galore-torch's formulation (weight decay on the parameters after the step, see
    :func:`decay_after_step`; ``mask``, as ``optax.adamw``'s, says which parameters it decays).

    Args:
      learning_rate: a float or an optax schedule.
      b1, b2, eps: Adam's decay rates and stabiliser (:func:`inner_adam`; ``eps`` is added to
        ``sqrt(nu)`` before the bias correction, and defaults to 1e-6, not optax's 1e-8).
      weight_decay: decoupled weight decay ``wd``: ``p <- (p + step) (1 - lr * wd)``. 0 (the
        default) decays nothing; a negative number is a ``ValueError``.
      mu_dtype: dtype of the moments; ``None`` follows each parameter's dtype (float32 for
        float16 parameters).
      mask: which parameters ``weight_decay`` applies to (:func:`decay_after_step`); ``None``
        decays all. Adam steps every parameter.

    Returns:
      An ``optax.GradientTransformation``, ``optax.chain(inner_adam(...),
      optax.scale_by_learning_rate(learning_rate), decay_after_step(...))``: its update is the step
      to add to the parameters (``optax.apply_updates``), and needs ``params`` unless
      ``weight_decay`` is a Python 0. Its state is the tuple of the three transforms' states
      (:class:`InnerAdamState` first).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = adamw(1e-3)
      >>> params = {"w": jnp.ones(3)}
      >>> updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    """
    return optax.chain(
        inner_adam(b1, b2, eps, mu_dtype=mu_dtype),
        optax.scale_by_learning_rate(learning_rate),
        decay_after_step(learning_rate, weight_decay, mask),
    )
