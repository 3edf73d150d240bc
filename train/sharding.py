"""Mesh ``(data, fsdp, tensor)`` and the shardings of parameters, optimizer state and batches.

Parameters are sharded by their logical axis names (``models.logical_axes``) through
``LOGICAL_RULES``; a dimension a mesh axis does not divide stays replicated. Optimizer-state leaves
(moments, low-rank moments, projection bases, magnitudes: shapes that differ from the
parameters') shard their largest axis that ``fsdp`` divides. Batches shard over
``(data, fsdp)``.

Multi-host: ``jax.distributed.initialize()`` runs first (``python -m train`` calls it when
``JAX_COORDINATOR_ADDRESS`` (with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``) or SLURM is set); the
mesh then spans every process's devices. Every process reads the same seeded data stream and
transfers only the shards of the global batch its devices hold.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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
    data = cfg.data if cfg.data != -1 else n // max(fsdp * tensor, 1)
    if min(data, fsdp, tensor) < 1 or data * fsdp * tensor != n:
        raise UserError(
            f"mesh data x fsdp x tensor = {data} x {fsdp} x {tensor} does not match the {n} available devices"
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), ("data", "fsdp", "tensor"))


def _fit(spec: tuple, shape: tuple, mesh: Mesh) -> P:
    axes = []
    for name, dim in zip(spec, shape, strict=True):
        axes.append(name if name is not None and dim % mesh.shape[name] == 0 else None)
    return P(*axes)


def param_shardings(logical, abstract_params, mesh: Mesh):
    def one(spec, x):
        names = tuple(LOGICAL_RULES.get(a) if a is not None else None for a in tuple(spec))
        names = names + (None,) * (x.ndim - len(names))
        return NamedSharding(mesh, _fit(names, x.shape, mesh))

    return jax.tree.map(one, logical, abstract_params, is_leaf=lambda s: isinstance(s, P))


def state_shardings(abstract_state, mesh: Mesh):
    fsdp = mesh.shape["fsdp"]

    def one(x):
        spec = [None] * x.ndim
        if fsdp > 1 and x.ndim >= 1:
            for axis in sorted(range(x.ndim), key=lambda a: -x.shape[a]):
                if x.shape[axis] % fsdp == 0:
                    spec[axis] = "fsdp"
                    break
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(one, abstract_state)


def batch_sharding(mesh: Mesh, global_batch: int) -> NamedSharding:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if global_batch % shards:
        raise UserError(
            f"train.batch_size ({global_batch}) is not divisible by the mesh's data x fsdp = {shards}"
        )
    return NamedSharding(mesh, P(("data", "fsdp"), None))
