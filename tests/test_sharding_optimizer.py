"""The optimizer on an 8-device CPU mesh: sharded params and state give the one-device result and
the state keeps its sharding across updates (run in a subprocess: XLA_FLAGS must precede jax)."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import moara_jax as mj
    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    rng = np.random.default_rng(0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    params = {"layers": {"self_attn": {"q_proj": {"kernel": normal(2, 32, 32)}},
                         "mlp": {"down_proj": {"kernel": normal(64, 32)}}},
              "norm": jnp.ones(32)}
    grads = [jax.tree.map(lambda p: normal(*p.shape), params) for _ in range(3)]
    spec = lambda p: P(*([None] * (p.ndim - 1) + ["fsdp"]))
    shard = lambda t: jax.tree.map(lambda p: jax.device_put(p, NamedSharding(mesh, spec(p))), t)
    host = {"q_galore": mj.QGaLore(basis_group_size=64)}.get(sys.argv[1], sys.argv[1])
    tx = mj.moara_adamw(0.01, r_base=8, block_size=8, update_proj_gap=2, canonical_signs=True, host=host)

    def state_sharding(x):  # last axis over fsdp where it divides, else replicated
        ok = x.ndim > 0 and x.shape[-1] % 4 == 0
        return NamedSharding(mesh, spec(x) if ok else P())

    def run(params, grads):
        shardings = jax.tree.map(state_sharding, jax.eval_shape(tx.init, params))
        state = jax.jit(tx.init, out_shardings=shardings)(params)
        # LDAdam makes its bases and moments anew each step, and XLA's propagation picks their
        # layout: pin the state's shardings (the trainer does for every host). For LDAdam this
        # run then checks the numbers only.
        pin = dict(out_shardings=(None, shardings)) if sys.argv[1] == "ldadam" else {}
        update = jax.jit(tx.update, **pin)
        out = []
        for g in grads:
            u, new = update(g, state, params)
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
                assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
            state = new
            out.append(u)
        return out, state

    single, _ = run(params, grads)
    sharded, state = run(shard(params), [shard(g) for g in grads])
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
    assert any(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(state))
    print("OK")
""")


@pytest.mark.parametrize("host", ["galore", "fira", "q_galore", "osd", "ldadam", "subtrack_pp"])
def test_sharded_optimizer_matches_single_device(host):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, host], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]
