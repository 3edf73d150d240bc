"""Mesh ``(data, fsdp, tensor)`` and the shardings of parameters, optimizer state and batches.

Parameters are sharded by their logical axis names (``models.logical_axes``) through
``LOGICAL_RULES``; a dimension a mesh axis does not divide stays replicated. Optimizer-state leaves
follow their parameter (``state_shardings``): the parameter's sharding for its shape, the kept
dimensions sharded as the parameter shards them for low-rank moments, bases and magnitudes.
Batches shard over ``(data, fsdp)``.

Multi-host: ``jax.distributed.initialize()`` runs first (``python -m train`` calls it when
``JAX_COORDINATOR_ADDRESS`` (with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``) is set, or in a
SLURM job step of several tasks); the mesh then spans every process's devices. Every process
reads the same seeded data stream and transfers only the shards of the global batch its devices
hold.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moara_jax as mj
from moara_jax._labels import OTHER, find_param, path_key
from moara_jax._sharding import kept_spec, params_by_path, spread_spec
from train.config import MeshSection
from train.errors import UserError

LOGICAL_RULES = {
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "q_lora": None,
    "kv_lora": None,
    "layers": None,
    "norm": None,
    "head_dim": None,
}


def make_mesh(cfg: MeshSection, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    fsdp, tensor = cfg.fsdp, cfg.tensor
    if min(fsdp, tensor) < 1:
        raise UserError(f"mesh fsdp and tensor must be >= 1, got fsdp {fsdp}, tensor {tensor}")
    data = cfg.data if cfg.data != -1 else n // (fsdp * tensor)
    if data < 1 or data * fsdp * tensor != n:
        if cfg.data == -1:  # the data axis takes what fsdp x tensor leave: name what was set
            raise UserError(
                f"mesh fsdp x tensor = {fsdp} x {tensor} does not divide the {n} available devices "
                "(the data axis takes the rest)"
            )
        raise UserError(
            f"mesh data x fsdp x tensor = {data} x {fsdp} x {tensor} does not match the {n} available devices"
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), ("data", "fsdp", "tensor"))


def _fit(spec: tuple, shape: tuple, mesh: Mesh) -> P:
    axes = []
    for name, dim in zip(spec, shape, strict=True):
        axes.append(name if name is not None and dim % mesh.shape[name] == 0 else None)
    return P(*axes)


def _mesh_axes(spec: P, x) -> tuple:
    """The mesh axis the rules give each dimension of parameter ``x`` (None: none)."""
    names = tuple(LOGICAL_RULES.get(a) if a is not None else None for a in tuple(spec))
    return names + (None,) * (x.ndim - len(names))


def whole_dims(logical, abstract_params, mesh) -> list[str]:
    """The parameter dimensions the rules put on a mesh axis that does not divide them, which
    ``_fit`` leaves whole on every device (memory the axis was meant to split). One
    ``'PATH (SHAPE) dim D over AXIS=N'`` each."""
    found = []

    def one(path, spec, x):
        wanted = _mesh_axes(spec, x)
        for d, (axis, placed) in enumerate(zip(wanted, _fit(wanted, x.shape, mesh), strict=True)):
            if axis is not None and placed is None:
                found.append(
                    f"{jax.tree_util.keystr(path)} {tuple(x.shape)} dim {d} over {axis}={mesh.shape[axis]}"
                )

    jax.tree_util.tree_map_with_path(one, logical, abstract_params, is_leaf=lambda s: isinstance(s, P))
    return found


def split_heads(model_cfg, mesh) -> str | None:
    """What a ``tensor`` axis that does not divide the attention head counts does (its dimensions
    divided, so nothing stays whole): each device holds parts of heads, whose attention then
    gathers them; ``None`` when every head stays on one device."""
    tensor = mesh.shape["tensor"]
    heads = model_cfg.num_attention_heads
    kv = model_cfg.kv_heads
    if model_cfg.model_type == "deepseek_v2":  # MLA: a query head's width, and each head's value
        widths = (model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim, model_cfg.v_head_dim)
    else:
        widths = (model_cfg.head_size,) * 2
    # Heads split: a count the axis does not divide, in a dimension it does (else left whole).
    if not any(n % tensor and (n * w) % tensor == 0 for n, w in zip((heads, kv), widths, strict=True)):
        return None
    return (
        f"mesh tensor={tensor} does not divide the {heads} query and {kv} key/value heads, so heads are "
        "split across devices and their attention gathers them (the numbers are the same); a tensor "
        "axis that divides the head counts keeps each head on one device"
    )


def straddling_blocks(shardings, abstract_params, block_size: int) -> str | None:
    """What MoARa's magnitude blocks do where ``block_size`` does not divide a target matrix's
    fan_in shard (``shardings``: the parameters' ``NamedSharding``s): a block spans two devices,
    so XLA gathers the whole matrix for the decomposition (its "Involuntary full
    rematerialization" warning), the memory and traffic the sharding was meant to save; ``None``
    when every block lies on one device."""
    found = []

    def one(path, sharding, x):
        if x.ndim < 2 or mj.module_label(path) == OTHER:
            return
        axes = sharding.spec[x.ndim - 2] if len(sharding.spec) > x.ndim - 2 else None
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        devices = int(np.prod([sharding.mesh.shape[a] for a in names]))
        if devices > 1 and (x.shape[-2] // devices) % block_size:
            found.append(
                f"{jax.tree_util.keystr(path)}: fan_in {x.shape[-2]} over {'x'.join(names)}={devices}"
            )

    jax.tree_util.tree_map_with_path(one, shardings, abstract_params)
    if not found:
        return None
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return (
        f"optimizer.block_size {block_size} does not divide the device shard of {len(found)} target "
        f"matrices' fan_in ({found[0]}{more}): their magnitude blocks span two devices, and XLA "
        "gathers each such matrix whole for the decomposition; a block size that divides the shard, "
        "or fewer devices on that mesh axis, keeps each block on one device"
    )


def param_shardings(logical, abstract_params, mesh: Mesh):
    def one(spec, x):
        return NamedSharding(mesh, _fit(_mesh_axes(spec, x), x.shape, mesh))

    return jax.tree.map(one, logical, abstract_params, is_leaf=lambda s: isinstance(s, P))


def state_shardings(abstract_state, mesh: Mesh, abstract_params=None, param_shardings_tree=None):
    """Optimizer-state shardings that follow the parameters.

    A state leaf is matched to its parameter by path (optax states hold per-parameter trees whose
    key paths end with the parameter's). A leaf of the parameter's shape (AdamW moments, error
    buffers, initial bases of a full-rank shape) takes the parameter's sharding, so the update
    needs no resharding. A low-rank leaf (moments ``r x n``, bases ``m x r``, magnitudes
    ``m x ceil(n/B)``, stacked or not) shards each dimension it keeps from the parameter as the
    parameter shards it (the same size at the same place in the matrix, else at the other place:
    bases are stored in the paper's orientation); leading (stacked-layer) dimensions follow the
    parameter's; where ``fsdp`` shards the parameter and none of those dimensions, it then shards
    the leaf's largest dimension it divides (often the rank dimension), so no FSDP device holds a
    whole low-rank moment. Scalars are replicated. Leaves matched to
    no parameter shard their largest axis that ``fsdp`` divides, as does every leaf when no
    parameter shardings are given."""
    fsdp = mesh.shape["fsdp"]

    def largest_fsdp_axis(x):
        spec = [None] * x.ndim
        if fsdp > 1 and x.ndim >= 1:
            for axis in sorted(range(x.ndim), key=lambda a: -x.shape[a]):
                if x.shape[axis] % fsdp == 0:
                    spec[axis] = "fsdp"
                    break
        return NamedSharding(mesh, P(*spec))

    if abstract_params is None:
        return jax.tree.map(largest_fsdp_axis, abstract_state)
    specs = jax.tree.map(
        lambda s: s.spec, param_shardings_tree, is_leaf=lambda s: isinstance(s, NamedSharding)
    )
    params = params_by_path(abstract_params, specs)

    def one(path, x):
        if x.ndim == 0:
            return NamedSharding(mesh, P())
        match = find_param(path_key(path), params)
        if match is None:
            return largest_fsdp_axis(x)
        param_shape, spec = match
        if x.shape == param_shape:
            return NamedSharding(mesh, P(*spec))
        derived = _fit(kept_spec(x.shape, param_shape, spec), x.shape, mesh)
        return NamedSharding(mesh, _spread(tuple(derived), x.shape, spec, mesh))

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def _spread(spec: tuple, shape: tuple, param_spec: tuple, mesh: Mesh) -> P:
    """``spec`` with ``fsdp``, where it shards the parameter but not the leaf, placed on the
    leaf's largest dimension it divides and no axis shards: a low-rank leaf that keeps only the
    parameter's dimension ``tensor`` shards (the moments ``r x fan_out`` of a kernel whose
    ``fan_in`` FSDP shards) would otherwise be held whole by every FSDP device. Only ``fsdp``:
    ``tensor`` on a rank dimension would meet the gradient's ``tensor``-sharded dimension in
    ``P^T G`` (on a 2 x 2 x 2 mesh, 21% more bytes through collectives per update)."""
    spec = [a if a is not None and mesh.shape[a] > 1 else None for a in spec]
    return P(*spread_spec(spec, shape, param_spec, mesh.shape, axes=("fsdp",)))


# The model's activation axes (``models.model.ACTIVATION_AXES``, ``LOOKUP_AXES``): the residual
# stream sharded by batch over (data, fsdp) and whole over its hidden axis (replicated over
# tensor, as tensor-parallel layers take it), the embedding table gathered over fsdp for the lookup.
ACTIVATION_RULES = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_vocab", "tensor"),
)


def on_mesh(fn, mesh: Mesh, rules=ACTIVATION_RULES):
    """``fn`` traced with ``mesh`` as the context mesh and the model's activation axes mapped to
    it by ``rules``: the optimizer's basis refresh spreads its factorisations over the devices
    (``moara_jax._bases.spread``) and the activations keep the layout FSDP wants (the parameters
    gathered, the activations left in place)."""

    @functools.wraps(fn)
    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
            return fn(*args)

    return traced


def batch_sharding(mesh: Mesh, global_batch: int) -> NamedSharding:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if global_batch % shards:
        raise UserError(
            f"train.batch_size ({global_batch}) is not divisible by the mesh's data x fsdp = {shards}"
        )
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def process_rows(sharding, shape: tuple[int, int]) -> np.ndarray | None:
    """The rows of a global batch that this process's devices hold (None: all of them)."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])))
    return None if len(rows) == shape[0] else np.asarray(sorted(rows))


def global_batch(local: np.ndarray, sharding, rows: np.ndarray | None, shape: tuple[int, ...]) -> jax.Array:
    """The global batch as a sharded array, from this process's ``rows`` of it (``local``: those
    rows in order; all rows when ``rows`` is None). Every process draws the same seeded index
    stream, so the processes' rows fit together into one global batch."""
    if rows is None:
        return jax.make_array_from_callback(shape, sharding, lambda idx: local[idx])
    position = {int(r): i for i, r in enumerate(rows)}

    def shard(idx):
        wanted = [position[r] for r in range(*idx[0].indices(shape[0]))]
        return local[wanted][:, idx[1]]

    return jax.make_array_from_callback(shape, sharding, shard)
