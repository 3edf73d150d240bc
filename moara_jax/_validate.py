"""Small argument validators shared by the stages, the Adams, the hosts' settings and the
allocation."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moara_jax._labels import find_param, path_key
from moara_jax._warnings import quiet


def is_int(value, minimum: int = 1) -> bool:
    """Whether ``value`` is an integer of any integer type (not bool) and at least ``minimum``."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= minimum


def number(value) -> bool:
    """A real number whose value is known now: a Python or NumPy scalar, not a bool and not an
    array (an injected or traced hyperparameter, whose value a check cannot see)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def real_number(value) -> bool:
    """A finite real number of any numeric type, NumPy's scalars included (not a bool)."""
    return number(value) and math.isfinite(value)


def static_hint(value: Any) -> str:
    """For a setting that must be a Python value but is an array (``optax.inject_hyperparams``
    makes every numeric argument one unless ``static_args`` names it), what to do about it."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return " (an array: under optax.inject_hyperparams, name it in static_args)"
    return ""


def check_block_size(block_size: int) -> int:
    """Validates ``block_size`` (any integer type, not bool) and returns it as a Python int."""
    if not is_int(block_size):
        hint = static_hint(block_size)
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}{hint}")
    return int(block_size)


# Step counters are int32, so a refresh interval stays below their largest value (Q-GaLore's
# schedule of intervals ends with it, as "never again").
MAX_PROJ_GAP = 2**31 - 2


def check_update_proj_gap(update_proj_gap: int) -> None:
    """Validates ``update_proj_gap``: an integer (of any integer type) from 1 to
    :data:`MAX_PROJ_GAP`."""
    if not (is_int(update_proj_gap) and update_proj_gap <= MAX_PROJ_GAP):
        raise ValueError(
            f"update_proj_gap must be a positive integer below 2^31 - 1 (the step counters are int32), "
            f"got {update_proj_gap!r}{static_hint(update_proj_gap)}"
        )


def check_adam(b1: float, b2: float, eps: float) -> None:
    """Validates Adam's ``b1``, ``b2``, ``eps`` when they are numbers (:func:`number`; NaN is
    out of range). Injected hyperparameters arrive as arrays (traced under ``jit``): their
    values are not checked, but a ``b1`` or ``b2`` of a floating dtype narrower than float32 is
    refused, as its dtype says at trace time: ``optax.inject_hyperparams`` makes them the
    parameters' dtype by default, and in bfloat16 ``b2 = 0.999`` is 1, which leaves every update
    zero."""
    for name, value, ok in (
        ("b1", b1, lambda v: 0.0 <= v < 1.0),
        ("b2", b2, lambda v: 0.0 <= v < 1.0),
        ("eps", eps, lambda v: v >= 0.0),
    ):
        if number(value) and not ok(value):
            raise ValueError(f"{name} out of range: {value!r}")
    for name, value in (("b1", b1), ("b2", b2)):
        dtype = getattr(value, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
            raise ValueError(
                f"{name} is a {dtype} array, in which Adam's decay rates round (b2 = 0.999 to 1, "
                "leaving every update zero): inject hyperparameters in float32, "
                "optax.inject_hyperparams(..., hyperparam_dtype=jnp.float32)"
            )


def dtype_arg(name: str, value: Any) -> jnp.dtype | None:
    """``jnp.dtype(value)`` of a floating dtype (``None`` stays ``None``; moments are real
    numbers), or a ``ValueError`` naming the argument."""
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError as err:
        raise ValueError(f"{name} must be a dtype, got {value!r}") from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype (moments), got {dtype}")
    return dtype


def _nnx_state_type() -> type | None:
    """Flax nnx's ``State``, when nnx is imported (a state can hold one only then)."""
    statelib = sys.modules.get("flax.nnx.statelib")
    return getattr(statelib, "State", None)


def _child(node: Any, key: Any) -> Any:
    """The child of ``node`` at one entry of a JAX key path, in the node as made or as the
    mapping Flax nnx turned it into (keyed by attribute name, dict key or flat index)."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        name = key.name
        return node[name] if isinstance(node, Mapping) else getattr(node, name)
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        if isinstance(node, Mapping):
            return node[key.key]
        return jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0][key.key]
    raise KeyError(key)


def in_made_form(state: Any, init: Callable[[Any], Any], like: Any) -> Any:
    """``state`` in the form ``init`` makes it for a tree ``like`` (the parameters, or what a
    stage is initialised on), where Flax nnx's ``Optimizer`` has turned its nodes into
    ``nnx.State`` mappings.

    ``nnx.Optimizer.update`` writes the new state back through ``nnx.update``, which replaces
    every node of it (a ``NamedTuple``, a quantized moment) by a mapping of its children: the
    arrays are kept, a node's static data (a quantized basis's shape and side) is lost. The form
    is taken from ``init`` on the shapes of ``like`` and filled with the state's arrays by path.
    A state with no nnx mapping in it is returned as it is at once (nnx not imported: always);
    under nnx, whose states hold mappings where the parameters are ``nnx.State``s, the form costs
    an ``eval_shape`` of ``init`` (at trace time under ``jit``: milliseconds). A state already in
    that form is returned as it is, and so is one whose arrays are not where the form has them
    (the update then says what is wrong)."""
    state_type = _nnx_state_type()
    if state_type is None:
        return state
    is_mapping = lambda x: isinstance(x, state_type)  # noqa: E731
    if not any(is_mapping(x) for x in jax.tree.leaves(state, is_leaf=is_mapping)):
        return state
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), like)
    try:
        with quiet():  # the init's warnings were given when the state was made
            made = jax.eval_shape(init, shapes)
        paths, treedef = jax.tree_util.tree_flatten_with_path(made)
        if treedef == jax.tree.structure(state):
            return state
        leaves = []
        for path, _ in paths:
            node = state
            for key in path:
                node = _child(node, key)
            leaves.append(node)
    except Exception:  # not this state's form: the update's own error says what is wrong
        return state
    return jax.tree.unflatten(treedef, leaves)


def in_made_form_on_update(tx: Any) -> Any:
    """``tx`` whose ``update`` takes its state also in the form Flax nnx's ``Optimizer`` hands
    back (:func:`in_made_form`; ``tx`` is initialised on what its updates look like: the
    parameters, or the nodes of the stage before it)."""

    def update_fn(updates, state, params=None, **extra):
        return tx.update(updates, in_made_form(state, tx.init, updates), params, **extra)

    return type(tx)(tx.init, update_fn)


def fit_errors(tx: Any, init: Callable[[Any], Any], name: str) -> Any:
    """``tx`` (an ``optax.GradientTransformationExtraArgs``) whose ``update``, failing on updates
    that do not fit its state (a gradient transposed, flattened, of another size; a parameter
    added or removed), raises a one-line ``ValueError`` naming the parameter rather than the
    error JAX raised deep inside. ``init`` makes the state for a tree (``tx``'s own, or the one it
    wraps), from which what the updates imply is compared with the state given. An update that
    fits costs nothing: the comparison runs only after a failure."""

    def update_fn(updates, state, params=None, **extra):
        state = in_made_form(state, init, params if params is not None else updates)
        try:
            return tx.update(updates, state, params, **extra)
        # AttributeError, KeyError: a state of another kind of transform (decompose, host) there
        except (TypeError, ValueError, IndexError, AttributeError, KeyError) as err:
            try:
                problem = misfit(init, updates, state, params)
            except Exception:  # a diagnosis that fails must not hide the update's own error
                problem = None
            if problem is None:
                raise
            raise ValueError(f"{name}: {problem}") from err

    return type(tx)(tx.init, update_fn)


def misfit(init: Callable[[Any], Any], updates: Any, state: Any, params: Any = None) -> str | None:
    """What makes ``updates`` unfit for ``state`` (made by ``init`` from the parameters) and,
    when given, ``params``, naming the parameter; ``None`` when their shapes all fit, or when
    ``init`` cannot say (then the error at hand is not this one's to name)."""
    flat = lambda tree: jax.tree_util.tree_flatten_with_path(tree)[0]  # noqa: E731
    fit_params = params is not None and jax.tree.structure(updates) == jax.tree.structure(params)
    if fit_params:
        for (path, u), (_, p) in zip(flat(updates), flat(params), strict=True):
            if jnp.shape(u) != jnp.shape(p):
                return (
                    f"the update of {_key(path)} has shape {jnp.shape(u)} and its parameter "
                    f"{jnp.shape(p)}: an update (a gradient) has its parameter's shape"
                )
    # The state these updates imply, from stand-ins of their shapes and dtypes alone (a
    # sharding in their type, on Explicit mesh axes, would take init outside its Auto region).
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), updates)
    with quiet():  # the init's warnings were given when the state was made
        try:
            implied = jax.eval_shape(init, shapes)
        except ValueError as err:  # a tree of these shapes has no state (a matrix flattened)
            refused = str(err)
        except Exception:  # no diagnosis: the update's own error is raised
            return None
        else:
            refused = None
    if refused is not None:  # init's one-line refusal names the parameter; a longer one is not ours
        if "\n" in refused:
            return None
        return (
            "the updates' shapes are not those of parameters this optimizer takes, so not those its "
            f"state was made for (init refuses them: {refused})"
        )
    owners = [tuple(path) for path, _ in flat(updates)]
    made, needed = _state_by_owner(state, owners), _state_by_owner(implied, owners)
    for (path, update), owner in zip(flat(updates), owners, strict=True):
        if made.get(owner) == needed.get(owner):
            continue
        there, here = made.get(owner, []), needed.get(owner, [])
        if not there:
            return f"{_key(path)} has no state made at init (a parameter added or renamed since)"
        if [p for p, _ in there] == [p for p, _ in here]:  # a leaf of the same state: name it
            (leaf, was), (_, need) = next((a, b) for a, b in zip(there, here, strict=True) if a != b)
            detail = f"{leaf} has shape {was}; this update needs {need}"
        elif [s for _, s in there] == [s for _, s in here]:  # the shapes fit: other kinds of state
            detail = f"its state holds {there[0][0]}; these settings make {here[0][0]}"
        else:
            detail = f"shapes {[s for _, s in there]}; this update needs {[s for _, s in here]}"
        if fit_params:  # every update has its parameter's shape: the state is not these settings'
            return (
                f"the state of {_key(path)} is not the one these settings make for its parameter "
                f"({detail}): a state made with other settings (block_size, ranks, decompose, host) or for "
                "other parameters"
            )
        return (
            f"the update of {_key(path)} has shape {jnp.shape(update)}, which does not fit the "
            f"state made for it at init ({detail}): a gradient of another shape than its "
            "parameter, or a state made with other settings (pass params to tell which)"
        )
    paths = lambda tree: [_key(path) for path, _ in flat(tree)]  # noqa: E731
    if paths(implied) != paths(state):
        return (
            "the updates' tree is not the one its state was made for: a parameter removed or "
            "renamed since init, or a state made with other settings (weight_decay zero or not, "
            "decompose, host) or by another optimizer"
        )
    return None


def _state_by_owner(state: Any, owners: list[tuple]) -> dict[tuple, list[tuple[str, tuple]]]:
    """The leaves of an Optax state (its path, its shape) under the parameter each belongs to,
    found as the state's placement finds it (:func:`find_param`); a leaf of no parameter (a step
    count) is left out. The parameter of a tree that is one bare array (its path ``()``) owns
    every leaf: the counts then compared are the same on both sides."""
    by_key = {path_key(owner): owner for owner in owners if owner}
    bare = owners == [()]
    out: dict[tuple, list[tuple[str, tuple]]] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        owner = () if bare else find_param(path_key(path), by_key)
        if owner is not None:
            out.setdefault(owner, []).append((_key(path), tuple(jnp.shape(x))))
    return out


def _key(path) -> str:
    return jax.tree_util.keystr(tuple(path)) if path else "<the root>"
