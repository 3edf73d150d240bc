"""The optimizer on an 8-device CPU mesh: sharded params and state give the one-device result and
the state keeps its sharding across updates; under the mesh each device factors its share of a
refresh's matrices (run in a subprocess: XLA_FLAGS must precede jax)."""

import subprocess
import sys
import textwrap

import pytest
from helpers import cpu_devices

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
        # No out_shardings: the update gives each leaf back sharded as it came in (LDAdam, which
        # makes its bases and moments anew each step, gave them the layout XLA's propagation chose).
        update = jax.jit(tx.update)
        out = []
        for g in grads:
            u, new = update(g, state, params)
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
                assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
            state = new
            out.append(u)
        return out, state

    single, _ = run(params, grads)
    with jax.set_mesh(mesh):  # the refresh spread over the devices, as the trainer traces it
        sharded, state = run(shard(params), [shard(g) for g in grads])
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
    assert any(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(state))
    print("OK")
""")


@pytest.mark.parametrize(
    "host",  # the fast lane: GaLore and Q-GaLore (the state of other types: quantized bases, 8-bit moments)
    ["galore", "q_galore"]
    + [pytest.param(h, marks=pytest.mark.slow) for h in ("fira", "osd", "ldadam", "subtrack_pp")],
)
def test_sharded_optimizer_matches_single_device(host):
    env = cpu_devices(8)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, host], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


STATE_SHARDINGS = textwrap.dedent("""
    import math, re
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import models, moara_jax as mj
    from train.config import MeshSection
    from train.sharding import make_mesh, param_shardings, state_shardings
    mesh = make_mesh(MeshSection(data=2, fsdp=2, tensor=2))
    cfg = models.get_config("llama2-tiny")
    params = models.abstract_params(cfg)
    p_shard = param_shardings(models.logical_axes(cfg), params, mesh)
    tx = mj.moara_adamw(0.01, r_base=8, block_size=8)
    state = jax.eval_shape(tx.init, params)
    shard = state_shardings(state, mesh, params, p_shard)
    spec = {jax.tree_util.keystr(p): s.spec for (p, _), s in
            zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(shard))}
    pspec = {jax.tree_util.keystr(p): s.spec for (p, _), s in
             zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(p_shard))}
    def of(field, param):
        (k,) = [k for k in spec if f".{field}" in k and k.endswith(param)]
        return spec[k]
    # AdamW moments of the embedding and LM head: exactly their parameters' (tensor and fsdp)
    for name in ("['embed_tokens']['embedding']", "['lm_head']['kernel']"):
        assert pspec[name] in (P("tensor", "fsdp"), P("fsdp", "tensor")), pspec[name]
        assert of("mu", name) == of("nu", name) == pspec[name], (name, of("mu", name))
    # low-rank leaves: the kept dimension as the parameter shards it; fsdp, where the leaf keeps
    # no dimension it shards, on the largest free dimension it divides (the ranks 16 of down and
    # 4 of q); tensor not on a rank dimension (it would meet the gradient's in P^T G)
    down = "['layers_0']['mlp']['down_proj']['kernel']"   # (fan_in 176: tensor, fan_out 64: fsdp)
    assert pspec[down] == P("tensor", "fsdp")
    assert of("basis", down) == P("fsdp", None)           # (fan_out, r)
    assert of("dir_mu", down) == P("tensor", "fsdp")      # (fan_in, r)
    assert of("mag_mu", down) == P(None, "fsdp")          # (ceil(fan_in / B), fan_out)
    q = "['layers_0']['self_attn']['q_proj']['kernel']"  # (fan_in: fsdp, fan_out: tensor)
    assert of("basis", q) == P("fsdp", None) and of("dir_mu", q) == P("fsdp", "tensor")
    assert all(s == P() for k, s in spec.items() if k.endswith(".count"))

    # Pure FSDP (tensor 1): the moments r x fan_out of a kernel whose fan_in FSDP shards keep no
    # sharded dimension of it; they are split over FSDP all the same. Per device: the state's
    # bytes over the 4 FSDP devices, up to the leaves no axis divides.
    def per_device(mesh):
        p_shard = param_shardings(models.logical_axes(cfg), params, mesh)
        shard = state_shardings(state, mesh, params, p_shard)
        held = whole = 0
        for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shard)):
            whole += x.size * x.dtype.itemsize
            held += math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
        return held, whole
    held, whole = per_device(make_mesh(MeshSection(data=2, fsdp=4, tensor=1)))
    assert held < 1.01 * whole / 4, (held, whole)

    # The compiled update of the embedding's and LM head's AdamW state moves none of it.
    small = {k: params[k] for k in ("embed_tokens", "lm_head")}
    small_shard = {k: p_shard[k] for k in small}
    adamw = mj.adamw(0.01)
    small_state = jax.eval_shape(adamw.init, small)
    def collectives(state_shard):
        step = jax.jit(adamw.update, in_shardings=(small_shard, state_shard, small_shard),
                       out_shardings=(small_shard, state_shard))
        text = step.lower(small, small_state, small).compile().as_text()
        return len(re.findall(r"all-gather|all-to-all|collective-permute", text))
    new = collectives(state_shardings(small_state, mesh, small, small_shard))
    old = collectives(state_shardings(small_state, mesh))  # the largest axis fsdp divides
    assert new == 0 and old > 0, (new, old)
    print("OK", old)
""")


def test_optimizer_state_is_sharded_like_its_parameter():
    env = cpu_devices(8)
    proc = subprocess.run(
        [sys.executable, "-c", STATE_SHARDINGS], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


SPREAD = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from moara_jax import _bases, _projection
    from train import loop
    from train import setup as setting
    from train.config import load_config

    factored = []  # the leading size of each batch handed to the SVD, as traced
    svd = _bases.thin_svd
    _bases.thin_svd = lambda w: (factored.append(w.shape[0]), svd(w))[1]
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    rng = np.random.default_rng(0)
    mats = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(11, 24, 40), (8, 40, 24), (40, 40)]]
    ranks = [6, 4, 5]

    key = jax.random.PRNGKey(1)

    def refresh(svd, under=None):
        factored.clear()
        fn = lambda ms: _projection.refresh_bases(ms, ranks, svd, key, canonical_signs=True)
        if under is None:
            return jax.jit(fn)(mats), list(factored)
        with jax.set_mesh(under):
            return jax.jit(fn)(mats), list(factored)

    exact, _ = refresh("exact")
    for method in ("exact", "eigh", "randomized"):
        alone, counts = refresh(method)
        spread, spread_counts = refresh(method, mesh)
        for a, b in zip(alone, spread):
            assert a.shape == b.shape
            # the same bases, up to float32 rounding (the Gram products of other batch sizes)
            np.testing.assert_allclose(b, a, atol=1e-5)
        if method == "exact":
            assert counts == [11, 8, 1] and spread_counts == [2, 1, 1], (counts, spread_counts)
        # randomized is not spread: it runs on the gradients' shards as they are
        with jax.set_mesh(mesh):
            program = str(jax.make_jaxpr(lambda ms: _projection.refresh_bases(ms, ranks, method, key))(mats))
        assert ("shard_map" in program) == (method != "randomized"), method

    # Outside jit, and on a mesh of Explicit axes (jax.make_mesh's default), the whole optimizer too.
    import moara_jax as mj
    from jax.sharding import AxisType
    explicit = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    for under in (mesh, explicit):
        with jax.set_mesh(under):
            eager = _projection.refresh_bases(mats, ranks, "exact", canonical_signs=True)
        for a, b in zip(exact, eager):
            np.testing.assert_allclose(b, a, atol=1e-5)
    params = {"layers": {"self_attn": {"q_proj": {"kernel": mats[0][:2, :, :24]}}}, "norm": jnp.ones(24)}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    tx = mj.moara_adamw(0.01, r_base=8, block_size=8, canonical_signs=True)
    alone = jax.jit(tx.update)(grads, tx.init(params), params)[0]
    with jax.set_mesh(explicit):
        under = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)[0]
    for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(under)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)

    # Within a shard_map (the mesh's axes manual) the refresh is not spread again.
    inner = lambda *ms: tuple(_projection.refresh_bases(list(ms), ranks, canonical_signs=True))
    with jax.set_mesh(mesh):
        inner = jax.jit(jax.shard_map(inner, in_specs=P(), out_specs=P()))(*mats)
    for a, b in zip(exact, inner):
        np.testing.assert_allclose(b, a, atol=1e-6)

    # The trainer's step traces its refresh under the run's mesh: tiny's 8 q/k/v/o, 4 gate/up
    # and 2 down matrices, one of each per device on 8 devices.
    for sets in (["mesh.data=2", "mesh.fsdp=4"], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]):
        cfg = load_config("configs/tiny.yaml", sets)
        setup = setting.make_setup(cfg, True, setting.Clock())
        state = jax.eval_shape(setup.init, jax.random.PRNGKey(0))  # (sizing the state traces a refresh)
        batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32)
        factored.clear()
        loop.jit_train_step(setup).lower(state, batch).compile()
        assert factored == [1, 1, 1], factored
    print("OK")
""")


@pytest.mark.slow
def test_refresh_is_spread_over_the_mesh():
    """Also: the trainer's step compiles on these meshes with no activation or gradient that
    XLA can only move by replicating it first (its warning, "Involuntary full
    rematerialization", came with the embedding lookup before the activation constraints)."""
    env = cpu_devices(8)
    proc = subprocess.run(
        [sys.executable, "-c", SPREAD], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-4000:]


PLACEMENT = textwrap.dedent("""
    import contextlib
    import warnings
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import moara_jax as mj
    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(0)
    normal = lambda *s: np.asarray(rng.standard_normal(s), np.float32)
    leaves = lambda t: jax.tree_util.tree_leaves_with_path(t)

    # 1. Eager init on concrete sharded parameters, Auto axes, no context mesh: the state is
    # placed as the parameters are, as optax.adamw's is, not on one device.
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    params = {"embed": {"embedding": put(normal(64, 16), P("fsdp", None))},
              "q_proj": {"kernel": put(normal(64, 32), P("fsdp", None))}}
    tx = mj.moara_adamw(0.01, r_base=8, block_size=8, rank_allocation=False, canonical_signs=True)
    state = tx.init(params)
    adamw = optax.adamw(0.01).init(params)
    mu = state[0].inner_states["other"].inner_state.mu
    assert mu["embed"]["embedding"].sharding == adamw[0].mu["embed"]["embedding"].sharding
    want = mj.state_shardings(state, params)
    got = {jax.tree_util.keystr(p): x.sharding for p, x in leaves(state)}
    for p, s in leaves(want):
        assert got[jax.tree_util.keystr(p)] == s, (jax.tree_util.keystr(p), got[jax.tree_util.keystr(p)], s)
    specs = {jax.tree_util.keystr(p)[-40:]: tuple(s.spec) for p, s in leaves(want)}
    # q_proj projects its fan_out side: the low-rank moments (64 x r) keep the sharded fan_in
    moments = [v for k, v in specs.items() if k.endswith(".dir_mu['q_proj']['kernel']")]
    assert moments == [("fsdp", None)], specs
    assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(state))
    # jit's out_shardings from the same rule, for an init traced where no placement is known
    abstract = jax.eval_shape(tx.init, params)
    jitted = jax.jit(tx.init, out_shardings=mj.state_shardings(abstract, params))(params)
    assert [x.sharding for x in jax.tree.leaves(jitted)] == [x.sharding for x in jax.tree.leaves(state)]
    # A NumPy array among them (no place of its own): its state replicated on the mesh, the
    # others' placed as before, not the whole state on one device.
    mixed = {**params, "norm": np.ones(16, np.float32)}
    state = tx.init(mixed)
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(state))
    got = {jax.tree_util.keystr(p)[-40:]: tuple(x.sharding.spec) for p, x in leaves(state)}
    assert [v for k, v in got.items() if k.endswith(".dir_mu['q_proj']['kernel']")] == [("fsdp", None)]
    assert [v for k, v in got.items() if k.endswith(".mu['norm']")] == [(None,)], got

    # 2. Explicit axes (jax.make_mesh's default) under jax.set_mesh, with the layouts that had no
    # sharding rule there (a block reshape of a sharded fan_in, a sharded stacked-layer axis, QR
    # and SVD of a sharded basis): init and jitted updates run, keep the state's shardings, give
    # the updates the gradients' and match one device.
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    cases = [
        ("q_proj", (32, 64), P("fsdp", None), {}),
        ("down_proj", (8, 64, 32), P("fsdp", None, None), {}),
        ("down_proj", (64, 32), P(None, "fsdp"), {"host": "ldadam"}),
        ("down_proj", (64, 32), P(None, "fsdp"), {"svd": "randomized"}),
    ]
    for name, shape, spec, kw in cases:
        tx = mj.moara_adamw(0.01, r_base=4, block_size=8, rank_allocation=False, canonical_signs=True, **kw)
        values = {name: {"kernel": normal(*shape)}}
        grads = [{name: {"kernel": normal(*shape)}} for _ in range(2)]
        put = lambda t: jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec)), t)
        with jax.set_mesh(mesh):
            params = put(values)
            state = tx.init(params)
            assert any(x.sharding.spec != P() for x in jax.tree.leaves(state)), (name, kw)
            update = jax.jit(tx.update)
            sharded = []
            for g in grads:
                u, new = update(put(g), state, params)
                kept = [x.sharding for x in jax.tree.leaves(state)]
                assert [x.sharding for x in jax.tree.leaves(new)] == kept
                assert jax.tree.leaves(u)[0].sharding.spec == spec, (jax.tree.leaves(u)[0].sharding, spec)
                sharded.append(u)
                state = new
        local = jax.tree.map(jnp.asarray, values)
        one, reference = tx.init(local), jax.jit(tx.update)
        for g, u in zip(grads, sharded):
            ref, one = reference(jax.tree.map(jnp.asarray, g), one, local)
            # updates ~1e-3; a layer's close singular values move its basis by float32 rounding
            np.testing.assert_allclose(np.asarray(jax.tree.leaves(u)[0]), np.asarray(jax.tree.leaves(ref)[0]),
                                       rtol=2e-4, atol=1e-5, err_msg=f"{name} {shape} {spec} {kw}")

    # 3. Settings that are arrays (inject_hyperparams, an array learning rate), a weight-decay
    # mask (a function, a tree) and an extra argument that is a function, with sharded parameters
    # on Explicit axes; parameters in a list, whose state leaves each follow their own (not the
    # first: every state path begins with a chain index); a mesh of Explicit and Auto axes.
    kw = dict(r_base=4, block_size=8, rank_allocation=False)
    with jax.set_mesh(mesh):
        fsdp = NamedSharding(mesh, P("fsdp", None))
        params = {"q_proj": {"kernel": jax.device_put(jnp.asarray(normal(64, 32)), fsdp)}}
        injected = optax.inject_hyperparams(mj.moara_adamw, static_args=mj.MOARA_ADAMW_STATIC_ARGS)
        matrices = lambda t: jax.tree.map(lambda x: x.ndim >= 2, t)
        for tx in [
            injected(learning_rate=0.01, weight_decay=0.1, weight_decay_mask=matrices, **kw),
            optax.chain(
                mj.moara_adamw(jnp.asarray(0.01), weight_decay=0.1, weight_decay_mask={"q_proj": True}, **kw),
                optax.scale(1.0),
            ),
        ]:
            state = tx.init(params)
            u, state = jax.jit(tx.update)(params, state, params)
            u, state = tx.update(params, state, params, value=jnp.asarray(1.0), value_fn=lambda p: 0.0)
            assert u["q_proj"]["kernel"].sharding.spec == P("fsdp", None)
        # The mask reaches the transform remade in the Auto region: masked out, no decay.
        lr = jnp.asarray(0.01)
        masked = mj.moara_adamw(lr, weight_decay=0.1, weight_decay_mask={"q_proj": False}, **kw)
        plain = mj.moara_adamw(lr, **kw)
        steps = [jax.jit(t.update)(params, t.init(params), params)[0] for t in (masked, plain)]
        np.testing.assert_array_equal(*(np.asarray(u["q_proj"]["kernel"]) for u in steps))
        # init's warnings (a rank clipped) come once, though sizing the state traces it twice.
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mj.moara_adamw(0.01, r_base=64, block_size=8, rank_allocation=False).init(params)
        clipped = [str(w.message) for w in seen if "clipped to 32" in str(w.message)]
        assert len(clipped) == 1, clipped
    # Without jax.set_mesh: the mesh the arrays carry in their type is the context, eager and jitted.
    fsdp = NamedSharding(mesh, P("fsdp", None))
    params = {"q_proj": {"kernel": jax.device_put(jnp.asarray(normal(64, 32)), fsdp)}}
    tx = mj.moara_adamw(0.01, **kw)
    state = tx.init(params)
    assert any(x.sharding.spec != P() for x in jax.tree.leaves(state))
    with jax.set_mesh(mesh):
        want = jax.jit(tx.update)(params, tx.init(params), params)[0]["q_proj"]["kernel"]
    for update in (jax.jit(tx.update), tx.update):
        got = update(params, state, params)[0]["q_proj"]["kernel"]
        assert got.sharding.spec == P("fsdp", None), got.sharding
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9)
    # There a gradient of another shape is named, and an error that is no misfit (a schedule's)
    # passes unchanged; parameters on the mesh but sharded over none of its axes run as they
    # are, under vmap and in a jitted function that captures them.
    transposed = {"q_proj": {"kernel": jax.device_put(jnp.ones((32, 64)), fsdp)}}
    for given in (params, None):
        try:
            tx.update(transposed, state, given)
            raise AssertionError("a transposed gradient stepped")
        except ValueError as error:
            named = "moara_adamw: the update of ['q_proj']['kernel'] has shape (32, 64)"
            assert str(error).startswith(named), error

    def schedule(count):
        raise ValueError("a bug in the schedule")
    for context in (contextlib.nullcontext(), jax.set_mesh(mesh)):
        with context:
            failing = mj.moara_adamw(schedule, **kw)
            try:
                failing.update(params, failing.init(params), params)
                raise AssertionError("the schedule ran")
            except ValueError as error:
                assert str(error) == "a bug in the schedule", error
    replicated = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), replicated)
    state = tx.init(replicated)
    jax.vmap(lambda g: tx.update(g, state, replicated)[0])(stacked)
    jax.jit(lambda: tx.init(replicated))()
    auto = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    listed = [jax.device_put(jnp.ones((32, 64)), NamedSharding(auto, P(None, "fsdp"))),
              jax.device_put(jnp.ones((64, 16)), NamedSharding(auto, P("fsdp", None)))]
    ours = mj.moara_adamw(0.01, **kw).init(listed)[0].inner_states["other"].inner_state.mu
    assert [x.sharding.spec for x in ours] == [x.sharding.spec for x in optax.adamw(0.01).init(listed)[0].mu]
    mixed = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit, AxisType.Auto))
    with jax.set_mesh(mixed):
        params = {"q_proj": {"kernel": jnp.asarray(normal(64, 32), device=NamedSharding(mixed, P()))}}
        tx = mj.moara_adamw(0.01, **kw)
        jax.jit(tx.update)(params, tx.init(params), params)

    def placed_as(state, params):  # every state leaf where state_shardings puts it
        want = mj.state_shardings(jax.eval_shape(tx.init, params), params)
        for (path, x), s in zip(leaves(state), jax.tree.leaves(want)):
            assert x.sharding.is_equivalent_to(s, x.ndim), (jax.tree_util.keystr(path), x.sharding, s)

    # A Python number or an array committed to no device beside sharded parameters: the state is
    # still placed (it was all on device 0, with no word) and state_shardings takes the tree.
    auto = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    kernel = jax.device_put(jnp.asarray(normal(64, 32)), NamedSharding(auto, P("fsdp", None)))
    for other in (1.0, jnp.zeros((32,))):
        params = {"q_proj": {"kernel": kernel}, "temp": other}
        tx = mj.moara_adamw(0.01, **kw)
        state = tx.init(params)
        placed_as(state, params)
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state))
    # A mesh of Explicit and Auto axes: the state follows the parameters' whole placement (their
    # types hold the Explicit axes only: it lost the Auto one, and moved at the first update, which
    # compiled again); eager updates land where the gradients are.
    for types in ((AxisType.Explicit, AxisType.Auto), (AxisType.Auto, AxisType.Explicit)):
        both = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=types)
        tiled = NamedSharding(both, P("fsdp", "tensor"))
        params = {"q_proj": {"kernel": jax.device_put(jnp.asarray(normal(32, 32)), tiled)},
                  "embed": jax.device_put(jnp.asarray(normal(64, 32)), tiled),
                  "bias": jnp.zeros((32,)), "a_scale": normal(32)}  # committed to no device, NumPy
        with jax.set_mesh(both):
            tx = mj.moara_adamw(0.01, **kw)
            state = tx.init(params)
            placed_as(state, params)
            step = jax.jit(tx.update)
            for _ in range(2):
                update, state = step(params, state, params)
            assert step._cache_size() == 1, types
            placed_as(state, params)
            update, state = tx.update(params, state, params)
            tiles = (update["q_proj"]["kernel"], update["embed"])
            assert all(x.sharding.spec == P("fsdp", "tensor") for x in tiles), update
            bias = update["bias"].sharding
            assert bias.is_fully_replicated and len(bias.device_set) == 8, bias
            placed_as(state, params)
    print("OK")
""")


@pytest.mark.slow
def test_the_state_is_placed_as_the_parameters_and_explicit_axes_step():
    """``tx.init`` places the state as the parameters (``mj.state_shardings``), where it put it
    on one device; on Explicit mesh axes sharded parameters step (they raised sharding errors
    in init: a reshape, a matmul of mismatched shardings, QR and SVD of a sharded basis)."""
    env = cpu_devices(8)
    proc = subprocess.run(
        [sys.executable, "-c", PLACEMENT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


EIGHT_BIT = textwrap.dedent("""
    import math, re, warnings
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import moara_jax as mj
    from train.config import MeshSection
    from train.sharding import make_mesh, state_shardings

    mesh = make_mesh(MeshSection(data=1, fsdp=8, tensor=1))
    # (vocab, embed), FSDP on the columns; a square Dense kernel (stored transposed by PyTorch),
    # FSDP on its fan_in
    shapes = {"embed_tokens": {"embedding": (1024, 512)}, "lm_head": {"kernel": (512, 512)}}
    tuples = lambda s: isinstance(s, tuple)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=tuples)
    placed = {"embed_tokens": {"embedding": NamedSharding(mesh, P(None, "fsdp"))},
              "lm_head": {"kernel": NamedSharding(mesh, P("fsdp", None))}}
    tx = mj.moara_adamw(0.01, r_base=8, block_size=16, host="q_galore")
    with warnings.catch_warnings():  # (no target matrix: both get the 8-bit AdamW)
        warnings.simplefilter("ignore")
        state = jax.eval_shape(tx.init, params)
    shardings = state_shardings(state, mesh, params, placed)
    moments = [
        (jax.tree_util.keystr(path), x, s)
        for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(shardings))
        if x.dtype == jnp.uint8
    ]
    assert len(moments) == 4, moments
    for path, x, s in moments:
        name = "embed_tokens" if "embed_tokens" in path else "lm_head"
        leaf = "embedding" if name == "embed_tokens" else "kernel"
        assert x.shape == shapes[name][leaf] and s.spec == placed[name][leaf].spec, (path, x, s)
    step = jax.jit(tx.update, in_shardings=(placed, shardings, placed), out_shardings=(placed, shardings))
    program = step.lower(params, state, params).compile().as_text()
    moved = []  # every array an all-gather or all-to-all gives (tuples too)
    for line in program.splitlines():
        op = re.search(r"= (.*?) (all-gather|all-to-all)(-start)?\\(", line)
        if op:
            given = re.findall(r"\\w+\\[([\\d,]*)\\]", op.group(1))
            moved += [math.prod(int(d) for d in dims.split(",") if d) for dims in given]
    # Block scales and the like: a moment holds 262,144 entries or more (the flat layout moved
    # 2,955,264 entries through 28 all-gathers and all-to-alls, whole moments among them; PyTorch's
    # row order, the square kernel's codes on the wrong axis, 406,272)
    assert sum(moved) <= (1024 * 512 + 512 * 512) // 32, moved
    print("OK", moved)
""")


def test_8bit_moments_are_sharded_as_their_parameter_and_never_gathered():
    """Q-GaLore's 8-bit Adam moments under FSDP: stored in the parameter's shape (a square Dense
    kernel's too, whose PyTorch rows are its columns), they shard as the parameter does, and the
    compiled update moves none (a flat code array's shards did not line up with the gradient's:
    each step gathered both moments whole, as float32, to every device)."""
    proc = subprocess.run(
        [sys.executable, "-c", EIGHT_BIT], env=cpu_devices(8), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


LIBRARY_SPREAD = textwrap.dedent("""
    import math
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import moara_jax as mj

    mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "fsdp"))
    fan_in = NamedSharding(mesh, P(None, "fsdp", None))  # FSDP on the kernels' fan_in
    ones = lambda *s: jax.device_put(jnp.ones(s), fan_in)
    mlp = {"up_proj": {"kernel": ones(2, 64, 256)}, "down_proj": {"kernel": ones(2, 256, 64)}}
    params = {"layers": {"mlp": mlp}}
    grads = jax.tree.map(lambda p: p * 0.5, params)
    for host in ("galore", "q_galore"):
        tx = mj.moara_adamw(0.01, r_base=8, block_size=16, host=host)
        state = tx.init(params)
        whole = sum(x.nbytes for x in jax.tree.leaves(state))
        leaves = jax.tree.leaves(state)
        held = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
        assert held <= 1.1 * whole / 8, (host, held, whole)  # no low-rank moment whole on every device
        _, after = jax.jit(tx.update)(grads, state, params)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(after)):  # equal: the next call reuses it
            assert a.sharding == b.sharding, (host, a.shape, a.sharding, b.sharding)
    print("OK")
""")


@pytest.mark.slow
def test_the_librarys_state_of_an_fsdp_model_is_spread_over_its_devices_and_stays_put():
    """``moara_adamw`` in plain Optax on an FSDP mesh: an axis that shards a kernel but none of a
    low-rank leaf's dimensions (the moments ``r x fan_out`` of a kernel sharded on ``fan_in``,
    block magnitudes, quantized bases) shards the leaf's largest dimension it divides, so each
    device holds its eighth of the state (it held up to 5.6 times that), and ``jax.jit(update)``
    returns the state as init placed it (a second call compiled again)."""
    proc = subprocess.run(
        [sys.executable, "-c", LIBRARY_SPREAD],
        env=cpu_devices(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]
