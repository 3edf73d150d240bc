"""The host protocol: the README's worked example registers a toy host (GaLore with bases made
once), which then runs through ``moara_adamw``, ``state_bytes``, the alignment diagnostic and the
trainer's config, like the built-in hosts; registration errors are named."""

import dataclasses
import pathlib
import re
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moara_jax as mj

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
ROOT = README.parent


@pytest.fixture
def frozen_galore():
    """The README's example, executed as written; unregistered afterwards."""
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S) if "register_host" in b
    )
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    yield namespace["FrozenGaLore"]
    mj.HOSTS.pop("frozen_galore", None)


def _params():
    rng = np.random.default_rng(0)
    return {
        "self_attn": {"q_proj": {"kernel": jnp.asarray(rng.standard_normal((16, 24)), jnp.float32)}},
        "mlp": {"down_proj": {"kernel": jnp.asarray(rng.standard_normal((24, 16)), jnp.float32)}},
        "norm": {"scale": jnp.ones(16)},
    }


def test_a_registered_host_runs_through_moara_adamw_and_keeps_its_first_bases(frozen_galore):
    assert mj.HOSTS["frozen_galore"] is frozen_galore
    params = _params()
    grads = [jax.tree.map(lambda p, i=i: p * (i + 1.0) + i, params) for i in range(3)]
    options = dict(r_base=4, block_size=8, update_proj_gap=1, rank_allocation=False)
    frozen = mj.moara_adamw(1e-2, host="frozen_galore", **options)
    refreshed = mj.moara_adamw(1e-2, host="galore", **options)  # new bases every step
    s_frozen, s_refreshed = frozen.init(params), refreshed.init(params)
    first = None
    for g in grads:
        u_frozen, s_frozen = jax.jit(frozen.update)(g, s_frozen, params)
        u_refreshed, s_refreshed = jax.jit(refreshed.update)(g, s_refreshed, params)
        bases = mj.projection_bases(s_frozen)
        first = first or bases
        for key in first:  # the basis of the first step stays
            np.testing.assert_array_equal(np.asarray(bases[key]), np.asarray(first[key]))
    # GaLore refreshed its bases and moved elsewhere; the non-targets' Adam is the same.
    q = ("self_attn", "q_proj", "kernel")
    pick = lambda t, path: t[path[0]][path[1]][path[2]]  # noqa: E731
    assert not np.allclose(pick(u_frozen, q), pick(u_refreshed, q))
    np.testing.assert_allclose(u_frozen["norm"]["scale"], u_refreshed["norm"]["scale"], rtol=1e-6)
    # state_bytes and the alignment diagnostic read its state as GaLore's.
    sizes = mj.state_bytes(jax.eval_shape(frozen.init, params))
    assert sizes == mj.state_bytes(jax.eval_shape(refreshed.init, params))
    assert set(mj.module_alignment(grads[-1], s_frozen, block_size=8)) == {"q", "down"}


def test_the_trainer_takes_a_registered_host_and_an_import_path(frozen_galore, monkeypatch):
    from train.config import load_config
    from train.step import make_optimizer, schedule

    config = str(ROOT / "configs" / "tiny.yaml")
    for host in ("frozen_galore", f"{__name__}:ToyHost"):  # ToyHost: imported and registered
        cfg = load_config(config, [f"optimizer.host={host}"])
        tx = make_optimizer(cfg.optimizer, schedule(cfg), 0.0, peak_lr=cfg.train.lr)
        assert mj.state_bytes(jax.eval_shape(tx.init, _params()))["projection_bases"] > 0
    assert mj.HOSTS["toy"] is ToyHost
    monkeypatch.delitem(mj.HOSTS, "toy")


@dataclasses.dataclass(frozen=True)
class ToyHost(mj.Host):
    name: ClassVar[str] = "toy"

    def stages(self, o):
        return mj.HOSTS["galore"]().stages(o)


def test_registration_and_resolution_errors_name_the_problem():
    with pytest.raises(TypeError, match="takes a Host subclass"):
        mj.register_host(dict)

    @dataclasses.dataclass(frozen=True)
    class Impostor(mj.Host):
        name: ClassVar[str] = "galore"

    with pytest.raises(ValueError, match="a host named 'galore' is already registered"):
        mj.register_host(Impostor)
    with pytest.raises(ValueError, match="host must be one of"):
        mj.moara_adamw(1e-3, r_base=4, block_size=8, host="apollo")
    with pytest.raises(ValueError, match="cannot be imported"):
        mj.resolve_host("no_such_module:Host")
    with pytest.raises(ValueError, match="is not a moara_jax.Host subclass"):
        mj.resolve_host("dataclasses:dataclass")
