"""The optimizer state placed as the parameters are, and the update under Explicit mesh axes.

``init`` of the public transforms (:func:`placing`, :func:`follow_params`) makes its state where
the parameters are, as ``optax.adamw``'s ``zeros_like`` moments are: an optimizer of an
FSDP-sharded model must not hold its state on one device (:func:`state_shardings` says where
each leaf goes). Under a mesh of Explicit axes (``jax.make_mesh``'s default, with
``jax.set_mesh``, or with no mesh in context the one the inputs carry), when an input is
sharded over one of them, ``init`` and ``update`` run with those axes Auto
(``jax.sharding.auto_axes``): a block reshape, the SVD or QR of a basis and a projection of a
sharded matrix have no sharding rule of their own there, so XLA places them as under Auto axes;
the state leaves as it came in, the updates as the gradients."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from moara_jax._labels import find_param, path_key
from moara_jax._validate import fit_errors
from moara_jax._warnings import quiet


def kept_spec(shape: tuple, param_shape: tuple, param_spec: tuple) -> tuple:
    """Mesh axes for a low-rank leaf of a parameter: leading (stacked) dimensions as the
    parameter's, then each of the last two dimensions as the parameter's matrix dimension of the
    same size (the same place first: bases are stored in the paper's orientation), a mesh axis
    used once. Each dimension kept has the size of the parameter's it takes the axis from, so the
    axis divides it. A leaf not of the parameter's layout (another number of dimensions: a
    quantized basis's groups; the state of a multi-axis kernel's matrix view, ``as_matrices``)
    keeps none."""
    lead = len(param_shape) - 2
    if len(shape) != len(param_shape) or lead < 0:
        return (None,) * len(shape)
    spec = list(param_spec[:lead]) + [None, None]
    used = {a for a in spec if a is not None}
    for k in (lead, lead + 1):  # the leaf's matrix dimensions
        place = k - lead
        for candidate in (place, 1 - place):
            axis = param_spec[lead + candidate]
            if shape[k] == param_shape[lead + candidate] and axis is not None and axis not in used:
                spec[k] = axis
                used.add(axis)
                break
            if shape[k] == param_shape[lead + candidate]:
                break
    return tuple(spec)


def spread_spec(spec, shape: tuple, param_spec: tuple, sizes, axes=None) -> tuple:
    """``spec`` of a leaf of a parameter, with each mesh axis that shards the parameter but none
    of the leaf's dimensions (among ``axes``; None: every one) put on the leaf's largest free
    dimension its size divides: a low-rank moment ``r x fan_out`` of a kernel sharded on
    ``fan_in`` would otherwise be held whole by every device of that axis. ``sizes``: the mesh's
    axis sizes.

    The library spreads every axis (a mesh's axis names say nothing of their roles here: memory
    first); the trainer, whose mesh names its FSDP axis, spreads that one only (a tensor-parallel
    axis on a rank dimension meets the gradient's in ``P^T G``: 21% more bytes through
    collectives per update on its 2 x 2 x 2 mesh, ``train.sharding``)."""
    names = lambda entry: () if entry is None else entry if isinstance(entry, tuple) else (entry,)  # noqa: E731
    out = list(spec)
    used = {a for entry in out for a in names(entry)}
    for a in (a for entry in param_spec for a in names(entry)):
        if a in used or (axes is not None and a not in axes) or sizes[a] <= 1:
            continue
        free = [k for k in range(len(shape)) if out[k] is None and shape[k] % sizes[a] == 0]
        if free:
            out[max(free, key=lambda k: shape[k])] = a
            used.add(a)
    return tuple(out)


def _leaf_spec(path, x, params: dict, sizes) -> P:
    """The spec of state leaf ``x``: its parameter's for the parameter's shape; for a low-rank
    leaf, the dimensions it keeps from the parameter sharded as the parameter's, and the axes
    left over spread (:func:`spread_spec`); replicated when it has no parameter."""
    match = find_param(path_key(path), params) if getattr(x, "ndim", 0) else None
    if match is None:
        return P()
    param_shape, spec = match
    if tuple(x.shape) == param_shape:
        return P(*spec)
    kept = kept_spec(tuple(x.shape), param_shape, spec)
    spread = spread_spec(kept, tuple(x.shape), spec, sizes)
    return P(*spread) if any(spread) else P()  # P() for a leaf left whole, as jit gives one back


def params_by_path(params, specs) -> dict:
    """``{path_key: (shape, spec)}`` of the parameters, each spec as long as its shape (the
    table :func:`find_param` looks a state leaf's parameter up in)."""
    return {
        path_key(path): (tuple(x.shape), tuple(spec) + (None,) * (len(x.shape) - len(spec)))
        for (path, x), spec in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(specs), strict=True
        )
    }


def _specs(state, params, param_specs, sizes):
    by_path = params_by_path(params, param_specs)
    return jax.tree_util.tree_map_with_path(lambda path, x: _leaf_spec(path, x, by_path, sizes), state)


def state_shardings(state: Any, params: Any, param_shardings: Any = None) -> Any:
    """Where each leaf of an optimizer state goes when it follows the parameters.

    A leaf is matched to its parameter by key path. A leaf of the parameter's shape (Adam
    moments of non-target parameters, error buffers) takes the parameter's sharding; a low-rank
    leaf (moments ``r x n``, bases ``m x r``, block magnitudes, stacked or not) shards each
    dimension it keeps from the parameter as the parameter shards it, and a mesh axis that shards
    the parameter but none of those dimensions its largest dimension the axis divides (often the
    rank: no device holds a whole low-rank moment of a sharded parameter); scalars and leaves
    matched to no parameter are replicated. ``tx.init`` of :func:`moara_jax.moara_adamw` places its state
    this way; under ``jax.jit(tx.init)`` on Auto axes, where no placement is known while tracing,
    pass ``out_shardings=state_shardings(jax.eval_shape(tx.init, params), params)``.

    Args:
      state: the state, or ``jax.eval_shape(tx.init, params)``.
      params: the parameters (arrays, or ``jax.ShapeDtypeStruct`` with ``sharding``).
      param_shardings: a ``NamedSharding`` per parameter (default: each parameter's
        ``.sharding``, where concrete parameters have no place of their own, NumPy arrays,
        Python numbers or arrays not committed to a device, replicated); all on one mesh.

    Returns:
      A ``NamedSharding`` per leaf of ``state``.
    """
    params = _numbers_as_arrays(params)
    if param_shardings is None:
        placed = _placed_on(params)
        shardings = (
            placed if placed is not None else jax.tree.map(lambda x: getattr(x, "sharding", None), params)
        )
    else:
        shardings = param_shardings
    named = jax.tree.leaves(shardings, is_leaf=lambda s: s is None or isinstance(s, NamedSharding))
    if len(named) != len(jax.tree.leaves(params)) or not all(isinstance(s, NamedSharding) for s in named):
        raise ValueError(
            "state_shardings: every parameter needs a NamedSharding (arrays placed with one, or "
            "param_shardings=)"
        )
    mesh = named[0].mesh
    if any(s.mesh != mesh for s in named):
        raise ValueError("state_shardings: the parameters' NamedShardings are on different meshes")
    specs = jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), _specs(state, params, specs, mesh.shape))


def _explicit_axes(mesh=None) -> tuple[str, ...]:
    """The Explicit axes of ``mesh``, by default the context's."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty:
        return ()
    return tuple(
        a for a, kind in zip(mesh.axis_names, mesh.axis_types, strict=True) if kind == AxisType.Explicit
    )


def _inputs_mesh(*trees) -> contextlib.AbstractContextManager:
    """With no mesh in context, the mesh of an input sharded over one of its Explicit axes, as
    the context (``jax.set_mesh``; its abstract mesh while tracing, where ``set_mesh`` is
    refused): such arrays carry their mesh in their type, and what follows reads it from the
    context as under ``jax.set_mesh``. Inputs on no mesh, or sharded over none of its Explicit
    axes, run as they are."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    for x in jax.tree.leaves(trees):
        if not isinstance(x, jax.Array):
            continue
        mesh = jax.typeof(x).sharding.mesh
        if _sharded_over(_explicit_axes(mesh), x):
            if isinstance(x, jax.core.Tracer):
                return jax.sharding.use_abstract_mesh(mesh)
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(jax.set_mesh(x.sharding.mesh))
            except ValueError:  # a concrete array captured by a traced function: refused there
                stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
            return stack
    return contextlib.nullcontext()


def _concrete(*trees) -> bool:
    """Whether every array among ``trees``' leaves is concrete (eager, not traced)."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


def _placed_on(params) -> Any:
    """Where the parameters are, when those that are JAX arrays (one at least) are concrete, all
    placed with a NamedSharding on one mesh: a sharding per parameter, the mesh replicating those
    that have no place as it does a replicated array (NumPy arrays, Python numbers and arrays not
    committed to a device, as ``jnp.zeros`` makes them: ``jit`` puts such arrays where they are
    needed). Else ``None``."""
    if not _concrete(params):
        return None
    placed = lambda x: isinstance(x, jax.Array) and x.committed  # noqa: E731
    shardings = [x.sharding for x in jax.tree.leaves(params) if placed(x)]
    if not shardings or not all(
        isinstance(s, NamedSharding) and s.mesh == shardings[0].mesh for s in shardings
    ):
        return None
    whole = NamedSharding(shardings[0].mesh, P())
    return jax.tree.map(lambda x: x.sharding if placed(x) else whole, params)


def _spec_of(x) -> P:
    return jax.typeof(x).sharding.spec


def _on_axes(spec: P, axes: tuple[str, ...]) -> P:
    """``spec`` with only the mesh axes ``axes`` (the Explicit ones, which a type's spec holds)."""

    def keep(entry):
        names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in axes)
        return None if not names else names[0] if len(names) == 1 else names

    return P(*(keep(entry) for entry in spec))


def _moved(tree, shardings):
    """``jax.device_put(tree, shardings)`` of eager results, once they are computed: a reshard
    is a collective of its own, which on a host's devices waits for threads the computation
    still running holds (an XLA CPU rendezvous timed out so, under load)."""
    return jax.device_put(jax.block_until_ready(tree), shardings)


def _whole_placement(mesh, axes) -> bool:
    """Whether arrays on ``mesh`` have a placement their types do not hold: Auto axes beside the
    Explicit ``axes``, which the type of a result of an Auto region leaves to the compiler."""
    return any(a not in axes for a in mesh.axis_names)


def _sharded_over(axes: tuple[str, ...], *trees) -> bool:
    """Whether a leaf of ``trees`` is sharded over one of ``axes``."""
    for x in jax.tree.leaves(trees):
        if isinstance(x, jax.Array):
            for entry in _spec_of(x):
                if any(a in axes for a in (entry if isinstance(entry, tuple) else (entry,))):
                    return True
    return False


def _split_arrays(tree) -> tuple[list, Callable[[list], Any]]:
    """The arrays among ``tree``'s leaves, and how to put ``tree`` back from (new) arrays: what
    enters ``auto_axes`` as an argument must be arrays (an extra argument may be a function)."""
    leaves, treedef = jax.tree.flatten(tree)
    is_array = [isinstance(x, jax.Array) for x in leaves]

    def rebuild(arrays: list) -> Any:
        it = iter(arrays)
        return treedef.unflatten([next(it) if a else x for x, a in zip(leaves, is_array, strict=True)])

    return [x for x, a in zip(leaves, is_array, strict=True) if a], rebuild


def _numbers_as_arrays(tree):
    """Python numbers among ``tree``'s leaves as 0-d arrays: a parameter, an update or a state
    leaf may be one, as ``optax``'s transforms take them."""
    return jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, (int, float, complex)) else x, tree)


def _refuse_complex(params) -> None:
    """A complex parameter refused, named: the moments, block norms and bases here are of real
    numbers (a complex gradient would lose its imaginary part)."""
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if jnp.issubdtype(jnp.result_type(x), jnp.complexfloating):
            raise ValueError(
                f"{jax.tree_util.keystr(path)} is {jnp.result_type(x)}: complex parameters are not "
                "supported (optax.adamw takes them)"
            )


def follow_params(
    tx: optax.GradientTransformation,
    remake: Callable[[dict], optax.GradientTransformation] | None = None,
    arrays: dict | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``init`` places the state as the parameters are (:func:`state_shardings`),
    and whose ``init`` and ``update`` run a context mesh's Explicit axes Auto when an input is
    sharded over one (see the module).

    ``remake(arrays)`` makes ``tx`` again from its array-valued settings ``arrays`` (a learning
    rate from ``optax.inject_hyperparams``), which then enter the Auto region as arguments: an
    array ``tx`` captured keeps the Explicit mesh in its type, which no operation there accepts.
    """
    arrays = arrays or {}
    base = optax.with_extra_args_support(tx)

    def inner(hyper: dict) -> optax.GradientTransformationExtraArgs:
        """``tx`` inside the Auto region, made from the settings it was handed there."""
        return base if remake is None or not hyper else optax.with_extra_args_support(remake(hyper))

    def init_fn(params):
        params = _numbers_as_arrays(params)
        _refuse_complex(params)
        with _inputs_mesh(params):
            return placed_init(params)

    def placed_init(params):
        axes = _explicit_axes()
        if axes and _sharded_over(axes, params):
            plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, arrays))
            mesh = jax.sharding.get_abstract_mesh()
            run = lambda params, hyper: inner(hyper).init(params)  # noqa: E731
            auto = mesh.update_axis_types({a: AxisType.Auto for a in axes})
            # Sizing the state traces init once more: its warnings are those of the run below.
            with jax.sharding.use_abstract_mesh(auto), quiet():
                abstract = jax.eval_shape(run, *plain)
            # Concrete parameters on a mesh with Auto axes too: the state is derived from their
            # whole placement (their types hold the Explicit axes only), and put there.
            placed = _placed_on(params) if _whole_placement(mesh, axes) else None
            is_spec = lambda s: isinstance(s, P)  # noqa: E731
            is_named = lambda s: isinstance(s, NamedSharding)  # noqa: E731
            if placed is None:
                given = jax.tree.map(_spec_of, params)
            else:
                given = jax.tree.map(lambda s: s.spec, placed, is_leaf=is_named)
            specs = _specs(abstract, params, given, mesh.shape)
            typed = jax.tree.map(lambda s: _on_axes(s, axes), specs, is_leaf=is_spec)
            state = jax.sharding.auto_axes(run, axes=axes, out_sharding=typed)(params, arrays)
            if placed is None or not _concrete(state):  # (under a trace: the compiler places it)
                return state
            whole = jax.tree.leaves(placed, is_leaf=is_named)[0].mesh
            return _moved(state, jax.tree.map(lambda s: NamedSharding(whole, s), specs, is_leaf=is_spec))
        placed = _placed_on(params)
        if placed is not None:  # made where it belongs, never whole on one device first
            shardings = state_shardings(jax.eval_shape(base.init, params), params, placed)
            return jax.jit(base.init, out_shardings=shardings)(params)
        return base.init(params)

    def update_fn(updates, state, params=None, **extra):
        updates, params = _numbers_as_arrays((updates, params))
        with _inputs_mesh(updates, state, params):
            return explicit_update(updates, state, params, **extra)

    def explicit_update(updates, state, params=None, **extra):
        axes = _explicit_axes()
        if not axes or not _sharded_over(axes, updates, state, params):
            return base.update(updates, state, params, **extra)
        out = (jax.tree.map(_spec_of, updates), jax.tree.map(_spec_of, state))
        extra_arrays, extra_back = _split_arrays(extra)

        def run(updates, state, params, extra_arrays, hyper):
            return inner(hyper).update(updates, state, params, **extra_back(extra_arrays))

        result = jax.sharding.auto_axes(run, axes=axes, out_sharding=out)(
            updates, state, params, extra_arrays, arrays
        )
        if _whole_placement(jax.sharding.get_abstract_mesh(), axes) and _concrete(result):
            # Eager, with Auto axes too: the results go where the updates and the state were
            # (their types keep only the Explicit axes; what had no place, replicated).
            where = _placed_on((updates, state))
            if where is not None:
                result = _moved(result, where)
        return result

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def as_before(new_state, state, keep):
    """Under a trace, each leaf of ``new_state`` sharded as the same leaf of ``state``, the state
    that came in, for a transform that makes its state anew each step (LDAdam's bases and
    moments): on Auto axes nothing else says where such a leaf goes, and XLA's propagation chose
    another layout (LDAdam on a ``fsdp x tensor`` mesh: half again the state's bytes per device,
    and ``jax.jit(tx.update)`` compiled twice). The tie is an elementwise
    ``select(keep, new, old)``, whose operands and result propagation places alike; ``keep`` is
    a traced scalar true at every step (XLA cannot fold it away), so the values are ``new``'s.
    (``jax.experimental.shard_alike``, which says the same, is gone from JAX 0.11.) State
    updated from its old value keeps its layout without it (a tie there cost the trainer's
    sharded step 2% more bytes through collectives). Eager: as computed."""
    if _concrete(new_state):
        return new_state

    def tie(new, old):
        same = getattr(new, "shape", None) == getattr(old, "shape", None) and getattr(new, "ndim", 0)
        if not (same and isinstance(new, jax.core.Tracer)):
            return new
        return jax.lax.select(keep, new, old.astype(new.dtype))

    return jax.tree.map(tie, new_state, state)


def placing(constructor: Callable[..., optax.GradientTransformation]):
    """``constructor`` whose transform is :func:`follow_params`'s, with its array-valued
    arguments handed to the Auto region as arguments, and whose ``update`` names the parameter
    whose update does not fit the state (:func:`fit_errors`)."""

    signature = inspect.signature(constructor)

    @functools.wraps(constructor)
    def wrapped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        arrays = {k: v for k, v in bound.arguments.items() if isinstance(v, jax.Array)}

        def remake(values: dict) -> optax.GradientTransformation:
            return constructor(**{**bound.arguments, **values})

        tx = constructor(*args, **kwargs)
        return fit_errors(follow_params(tx, remake, arrays), tx.init, constructor.__name__)

    return wrapped
