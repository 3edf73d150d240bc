"""Contract battery run over every optimizer variant (in the spirit of optax.contrib's
``_common_test.py``): jit, no recompilation, convergence, dtypes, MultiSteps, inject_hyperparams,
zero gradients, checkpoint round trip, and argument errors."""

import functools
import inspect
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import matrices

import moara_jax as mj

Q_GALORE = mj.QGaLore(basis_group_size=8, weight_group_size=8, min_8bit_size=256)

VARIANTS = {
    "full": lambda lr: mj.moara_adamw(lr, r_base=4, block_size=8, update_proj_gap=5),
    "decomp": lambda lr: mj.moara_adamw(lr, r_base=4, block_size=8, rank_allocation=False, update_proj_gap=5),
    "rank": lambda lr: mj.moara_adamw(lr, r_base=4, decompose=False, update_proj_gap=5),
    "galore": lambda lr: mj.moara_adamw(
        lr, r_base=4, decompose=False, rank_allocation=False, update_proj_gap=5
    ),
    "randomized": lambda lr: mj.moara_adamw(lr, r_base=4, block_size=8, update_proj_gap=5, svd="randomized"),
    "eigh": lambda lr: mj.moara_adamw(lr, r_base=4, block_size=8, update_proj_gap=5, svd="eigh"),
    "fira": lambda lr: mj.moara_adamw(
        lr, r_base=4, decompose=False, rank_allocation=False, update_proj_gap=5, host="fira"
    ),
    "fira_full": lambda lr: mj.moara_adamw(lr, r_base=4, block_size=8, update_proj_gap=5, host="fira"),
    # Q-GaLore with groups that fit the tiny matrices (its defaults are groups of 256).
    "q_galore": lambda lr: mj.moara_adamw(
        lr, r_base=4, decompose=False, rank_allocation=False, update_proj_gap=5, host=Q_GALORE
    ),
    "q_galore_full": lambda lr: mj.moara_adamw(lr, r_base=4, block_size=8, update_proj_gap=5, host=Q_GALORE),
    "osd": lambda lr: mj.moara_adamw(
        lr, r_base=4, decompose=False, rank_allocation=False, update_proj_gap=5, host="osd"
    ),
    "osd_full": lambda lr: mj.moara_adamw(lr, r_base=4, block_size=8, update_proj_gap=5, host="osd"),
    "adamw": lambda lr: mj.adamw(lr),
    # The stages composed by hand, partitioned by ndim as in optax's Muon.
    "chain": lambda lr: optax.partition(
        {
            "matrix": optax.chain(mj.scale_by_moara(4, 8, update_proj_gap=5), optax.scale(-lr)),
            "vector": mj.adamw(lr),
        },
        lambda p: jax.tree.map(lambda x: "matrix" if x.ndim >= 2 else "vector", p),
    ),
}


def variants(names):
    """``names`` as parameters; Q-GaLore with decomposition (the slowest to compile) runs outside the
    fast lane (its stages are checked against the reference in tests/test_q_galore.py)."""
    return [pytest.param(n, marks=pytest.mark.slow) if n == "q_galore_full" else n for n in names]


def _params(dtype=jnp.float32, seed=0):
    """A tiny Llama-style tree: stacked attention, unscanned MLP, a norm and an embedding."""
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    n = lambda key, s: (0.1 * jax.random.normal(key, s)).astype(dtype)  # noqa: E731
    return {
        "embed_tokens": {"embedding": n(k[0], (10, 16))},
        "layers": {
            "self_attn": {
                "q_proj": {"kernel": n(k[1], (2, 16, 16))},
                "k_proj": {"kernel": n(k[2], (2, 16, 8))},
            },
            "mlp": {
                "down_proj": {"kernel": n(k[3], (40, 16))},
                "up_proj": {"kernel": n(k[4], (16, 40))},
            },
            "norm": {"scale": jnp.ones((16,), dtype)},
        },
    }


def _loss(params, target):
    return sum(
        jnp.sum(jnp.square(p.astype(jnp.float32) - t))
        for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target), strict=True)
    )


@pytest.mark.parametrize("name", variants(VARIANTS))
def test_converges_on_matrix_targets_under_jit_without_retracing(name):
    chex.clear_trace_counter()
    tx = VARIANTS[name](0.1)
    params = _params()
    rng = np.random.default_rng(1)

    def low_rank_target(p):  # rank-2 matrices (reachable by rank-2..8 projections), any vector
        if p.ndim < 2:
            return jnp.asarray(rng.standard_normal(p.shape), jnp.float32)
        a = rng.standard_normal(p.shape[:-1] + (2,))
        b = rng.standard_normal(p.shape[:-2] + (2, p.shape[-1]))
        return jnp.asarray(a @ b / 2, jnp.float32)

    target = jax.tree.map(low_rank_target, params)
    state = tx.init(params)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state):
        grads = jax.grad(_loss)(params, target)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    first = float(_loss(params, target))
    for _ in range(80):
        params, state = step(params, state)
    last = float(_loss(params, target))
    assert np.isfinite(last) and last < 0.5 * first, (first, last)


@pytest.mark.parametrize(
    "name", variants(["full", "galore", "fira_full", "q_galore_full", "osd_full", "adamw"])
)
def test_bf16_params_keep_dtypes(name):
    tx = VARIANTS[name](0.01)
    params = _params(jnp.bfloat16)
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    chex.assert_trees_all_equal_dtypes(updates, params)
    q_galore = name.startswith("q_galore")
    for node in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, mj.InnerAdamState)):
        if isinstance(node, mj.InnerAdamState):
            for leaf in jax.tree.leaves((node.mu, node.dir_mu, node.nu, node.dir_nu)):
                # Moments follow the parameter dtype; Q-GaLore's are 8-bit codes with float32
                # block scales, or float32 for small units.
                assert leaf.dtype in ((jnp.uint8, jnp.float32) if q_galore else (jnp.bfloat16,))
            for leaf in jax.tree.leaves((node.mag_mu, node.mag_nu)):
                assert leaf.dtype in ((jnp.uint8, jnp.float32) if q_galore else (jnp.float32,))
    if q_galore:
        codes = [x for x in jax.tree.leaves(state) if x.dtype == jnp.uint8]
        assert codes  # some moments (and the INT4 bases) are stored in 8-bit codes


def test_mu_dtype_overrides_moment_dtype():
    tx = mj.moara_adamw(0.01, r_base=4, block_size=8, mu_dtype=jnp.float32)
    state = tx.init(_params(jnp.bfloat16))
    dtypes = {x.dtype for x in jax.tree.leaves(state) if x.ndim > 0}
    assert jnp.dtype(jnp.bfloat16) in dtypes  # bases stay in the parameter dtype
    sizes = mj.state_bytes(state)
    fp32 = mj.state_bytes(tx.init(_params(jnp.float32)))
    assert sizes["direction_moments"] == fp32["direction_moments"]


@pytest.mark.parametrize("name", ["full", "galore"])
def test_zero_gradients_give_finite_zero_updates(name):
    tx = VARIANTS[name](0.01)
    params = _params()
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    update = jax.jit(tx.update)
    for _ in range(3):
        updates, state = update(zeros, state, params)
        for u in jax.tree.leaves(updates):
            assert np.isfinite(np.asarray(u)).all()
            np.testing.assert_array_equal(np.asarray(u), 0.0)


def test_multisteps_and_inject_hyperparams():
    params = _params()
    grads = _params(seed=1)
    tx = optax.MultiSteps(VARIANTS["full"](0.01), every_k_schedule=2)
    state = tx.init(params)
    u1, state = jax.jit(tx.update)(grads, state, params)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(u1))  # accumulating
    u2, state = jax.jit(tx.update)(grads, state, params)
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(u2))

    static = ("r_base", "block_size", "update_proj_gap", "decompose", "rank_allocation", "label_fn")
    injected = optax.inject_hyperparams(mj.moara_adamw, static_args=static)(
        learning_rate=0.01, r_base=4, block_size=8
    )
    plain = mj.moara_adamw(0.01, r_base=4, block_size=8)
    s_inj, s_plain = injected.init(params), plain.init(params)
    u_inj, s_inj = jax.jit(injected.update)(grads, s_inj, params)
    u_plain, _ = jax.jit(plain.update)(grads, s_plain, params)
    chex.assert_trees_all_close(u_inj, u_plain, rtol=1e-4, atol=1e-7)
    s_inj.hyperparams["learning_rate"] = jnp.asarray(0.02)
    u_inj2, _ = jax.jit(injected.update)(grads, s_inj, params)
    assert jax.tree.leaves(u_inj2)[0].shape == jax.tree.leaves(u_plain)[0].shape
    # The dtypes are static: injected, a dtype (a callable) would be taken for a schedule.
    with_dtype = optax.inject_hyperparams(mj.moara_adamw, static_args=mj.MOARA_ADAMW_STATIC_ARGS)(
        learning_rate=0.01, r_base=4, block_size=8, mu_dtype=jnp.bfloat16
    )
    state = with_dtype.init(params)
    assert not {"mu_dtype", "mag_dtype"} & set(state.hyperparams), sorted(state.hyperparams)
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, mj.InnerAdamState))
    adams = [x for x in nodes if isinstance(x, mj.InnerAdamState)]
    moments = [m for x in adams for m in jax.tree.leaves((x.mu, x.dir_mu))]
    assert moments and {m.dtype for m in moments} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("name", variants(["full", "fira_full", "q_galore_full", "osd_full"]))
def test_state_is_arrays_and_survives_orbax_round_trip(name, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = VARIANTS[name](0.01)
    params = _params()
    grads = [jax.tree.map(lambda p, i=i: jnp.full_like(p, 0.1 * (i + 1)) + p, params) for i in range(8)]
    update = jax.jit(tx.update)  # op-by-op dispatch of eight steps twice is slow
    state = tx.init(params)
    for g in grads[:4]:
        _, state = update(g, state, params)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "state", jax.eval_shape(lambda: state))
    a, b = state, restored
    for g in grads[4:]:  # crosses a refresh at step 5
        ua, a = update(g, a, params)
        ub, b = update(g, b, params)
        chex.assert_trees_all_equal(ua, ub)


def test_svd_runs_only_inside_the_refresh_cond():
    tx = mj.scale_by_galore(4, update_proj_gap=10)
    params = {"w": jnp.ones((8, 12))}
    state = tx.init(params)
    jaxpr = jax.make_jaxpr(tx.update)(params, state, params)
    top = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert "cond" in top and "svd" not in top
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    branches = conds[0].params["branches"]
    assert any("svd" in str(b) for b in branches)


def test_moara_refresh_cond_takes_the_gradient_not_a_direction():
    """The refresh branch recomputes the block direction from the gradient, so no full-size
    direction is an operand of the cond (all of them live at once, before any projection)."""
    tx = mj.scale_by_moara(4, 4, update_proj_gap=10)
    params = {"a": jnp.ones((8, 12)), "b": jnp.ones((12, 8))}
    state = tx.init(params)
    jaxpr = jax.make_jaxpr(tx.update)(params, state, params).jaxpr
    grad_vars = set(jaxpr.invars[:2])  # the two gradient leaves come first
    (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    full = [
        v for v in cond.invars if getattr(v, "aval", None) is not None and v.aval.shape in ((8, 12), (12, 8))
    ]
    assert full and set(full) <= grad_vars


@pytest.mark.parametrize("side", ["in", "out"])
def test_back_projection_multiplies_bf16_operands_into_float32(side):
    """bf16 low-rank values and bases enter the matrix product as bf16 (the matrix units' input
    type; no float32 product) with float32 results, equal to the upcast product."""
    from moara_jax._projection import project_back

    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    basis = jax.random.normal(k1, (48, 8)).astype(jnp.bfloat16)
    low = jax.random.normal(k2, (8, 40) if side == "in" else (40, 8)).astype(jnp.bfloat16)
    out = jax.jit(project_back, static_argnums=2)(low, basis, side)
    assert out.dtype == jnp.float32
    b64, l64 = np.asarray(basis, np.float64), np.asarray(low, np.float64)
    ref = b64 @ l64 if side == "in" else l64 @ b64.T
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    hlo = jax.jit(project_back, static_argnums=2).lower(low, basis, side).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert dots and all("bf16" in line and "f32" in line for line in dots), dots


def test_bf16_moara_update_is_within_bf16_rounding_of_float32():
    """With bf16 parameters the back-projected direction is rounded to bf16 before the magnitude
    product: the update stays within bf16 rounding of the same step computed in float32."""
    params = {"w": (0.1 * jax.random.normal(jax.random.PRNGKey(0), (64, 48)))}
    grads = {"w": jax.random.normal(jax.random.PRNGKey(1), (64, 48))}
    p16, g16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), (params, grads))
    tx = mj.scale_by_moara(8, 16, update_proj_gap=10)
    u32, _ = jax.jit(tx.update)(jax.tree.map(lambda x: x.astype(jnp.float32), g16), tx.init(params), params)
    u16, _ = jax.jit(tx.update)(g16, tx.init(p16), p16)
    assert u16["w"].dtype == jnp.bfloat16
    # Two bf16 roundings (2**-9 each) plus bf16 moments and projections: about 2**-7 measured.
    err = np.linalg.norm(np.asarray(u16["w"], np.float32) - np.asarray(u32["w"])) / np.linalg.norm(u32["w"])
    assert err < 2**-6, err


def test_a_changed_direction_drops_its_gradient():
    """A stage that rewrites the direction must not have the refresh recompute the old one."""
    g = jnp.ones((8, 4))
    node = mj.Decomposed(jnp.ones((2, 4)), g, 4, gradient=g)
    assert node.replace(mag=jnp.zeros((2, 4))).gradient is g
    assert node.replace(direction=2 * g).gradient is None
    with pytest.raises(TypeError, match="unknown fields"):
        node.replace(dirction=g)


def test_decomposed_static_data_stays_python_with_an_injected_eps():
    """An injected (array) decompose eps must not become pytree aux data."""
    g = {"w": jnp.asarray(np.random.default_rng(5).standard_normal((8, 4)), jnp.float32)}
    static, _ = mj.decompose(4, eps=1e-9, keep_gradient=True).update(g, optax.EmptyState())
    injected, _ = mj.decompose(4, eps=jnp.asarray(1e-9), keep_gradient=True).update(g, optax.EmptyState())
    assert static["w"].eps == 1e-9 and static["w"].gradient is g["w"]
    assert injected["w"].eps is None and injected["w"].gradient is None
    # Only when asked (scale_by_moara, where project follows at once) is the gradient carried.
    assert mj.decompose(4).update(g, optax.EmptyState())[0]["w"].gradient is None
    kept, _ = mj.decompose(4, keep_gradient=True).update(g, optax.EmptyState())
    assert kept["w"].gradient is g["w"]
    # A setting that must be static, injected as an array, is named with what to do about it.
    for make, kwargs, static_args, name in (
        (mj.scale_by_moara, dict(rank=2, block_size=4), (), "block_size"),
        (mj.scale_by_galore, dict(rank=2), (), "rank"),
        (
            mj.scale_by_moara,
            dict(rank=2, block_size=4, update_proj_gap=3),
            ("rank", "block_size"),
            "update_proj_gap",
        ),
    ):
        message = rf"{name} must be a positive integer.*, got Array\(.*name it in static_args\)"
        with pytest.raises(ValueError, match=message):
            optax.inject_hyperparams(make, static_args=static_args)(**kwargs).init(g)
    tx = optax.inject_hyperparams(mj.scale_by_moara, static_args=("rank", "block_size", "update_proj_gap"))(
        rank=2, block_size=4, update_proj_gap=3
    )
    plain = mj.scale_by_moara(2, 4, update_proj_gap=3)
    update, reference = jax.jit(tx.update), jax.jit(plain.update)
    s1, s2 = tx.init(g), plain.init(g)
    for _ in range(4):  # across a refresh (hyperparameters as float32 arrays: rounding only)
        (u1, s1), (u2, s2) = update(g, s1, g), reference(g, s2, g)
        np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-4, atol=1e-6)


def test_stage_chain_initialises_shape_preserving_stages_on_the_parameters():
    """schedule_free's init reads parameter values; optax.chain gives it the parameters."""
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    ours = mj.stage_chain(optax.identity(), optax.contrib.schedule_free_sgd(0.1)).init(params)
    theirs = optax.chain(optax.identity(), optax.contrib.schedule_free_sgd(0.1)).init(params)
    chex.assert_trees_all_equal(ours, theirs)


def test_decay_after_step_decays_the_stepped_parameters_on_schedule():
    schedule = optax.linear_schedule(0.1, 0.0, 4)
    tx = mj.decay_after_step(schedule, 0.5)
    p = {"w": jnp.arange(1.0, 5.0)}
    d = {"w": jnp.full(4, -0.25)}
    state = tx.init(p)
    for t in range(3):
        out, state = tx.update(d, state, p)
        lr = float(schedule(t))
        np.testing.assert_allclose(p["w"] + out["w"], (p["w"] + d["w"]) * (1 - lr * 0.5), rtol=1e-6)
    assert isinstance(mj.decay_after_step(0.1, 0.0).init(p), optax.EmptyState)
    with pytest.raises(ValueError, match="weight_decay"):
        mj.decay_after_step(0.1, -1.0)


def test_decay_after_step_and_adamw_decay_only_the_leaves_their_mask_marks():
    """``mask`` as ``optax.adamw``'s: a prefix tree or a function; masked-out leaves get the update
    of ``weight_decay=0``, masked-in ones that of no mask."""
    p = {"w": jnp.arange(1.0, 7.0).reshape(2, 3), "norm": {"scale": jnp.ones(3), "bias": jnp.ones(3)}}
    d = jax.tree.map(lambda x: jnp.full(x.shape, -0.25), p)
    for mask in ({"w": True, "norm": False}, matrices):
        tx = mj.decay_after_step(0.1, 0.5, mask)
        out, _ = tx.update(d, tx.init(p), p)
        np.testing.assert_allclose(p["w"] + out["w"], (p["w"] + d["w"]) * (1 - 0.1 * 0.5), rtol=1e-6)
        chex.assert_trees_all_equal(out["norm"], d["norm"])
        steps = {}
        for key, kwargs in (("masked", dict(weight_decay=0.5, mask=mask)), ("all", dict(weight_decay=0.5))):
            tx = mj.adamw(0.1, **kwargs)
            steps[key], _ = tx.update(d, tx.init(p), p)
        tx = mj.adamw(0.1)
        plain, _ = tx.update(d, tx.init(p), p)
        chex.assert_trees_all_close(steps["masked"]["w"], steps["all"]["w"])
        chex.assert_trees_all_close(steps["masked"]["norm"], plain["norm"])
        assert not np.allclose(steps["all"]["norm"]["scale"], plain["norm"]["scale"])


def test_weight_decay_mask_under_inject_hyperparams_and_matrix_axes():
    """The mask is a static argument (a function or a tree is no hyperparameter); under
    ``matrix_axes`` a function sees the matrix views and a tree matches the parameters."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    params = {"q_proj": {"kernel": normal(16, 2, 8)}, "norm": {"scale": jnp.ones(16)}}  # (embed, heads, dim)
    grads = [jax.tree.map(lambda x: normal(*x.shape), params) for _ in range(3)]
    axes = {"q_proj": {"kernel": mj.MatrixAxes(fan_in=-3, fan_out=(-2, -1))}}
    kw = dict(r_base=4, block_size=4, update_proj_gap=2, rank_allocation=False, matrix_axes=axes)
    injected = optax.inject_hyperparams(mj.moara_adamw, static_args=mj.MOARA_ADAMW_STATIC_ARGS)

    def run(tx):
        state, p, out = tx.init(params), params, []
        for g in grads:
            u, state = jax.jit(tx.update)(g, state, p)
            p = optax.apply_updates(p, u)
            out.append(u)
        return out

    no_decay = run(injected(learning_rate=0.1, weight_decay=0.0, **kw))
    decay = run(injected(learning_rate=0.1, weight_decay=0.5, **kw))
    for mask in (matrices, {"q_proj": True, "norm": False}):
        tx = injected(learning_rate=0.1, weight_decay=0.5, weight_decay_mask=mask, **kw)
        assert "weight_decay_mask" not in tx.init(params).hyperparams
        for got, want, plain in zip(run(tx), decay, no_decay, strict=True):
            chex.assert_trees_all_close(got["q_proj"], want["q_proj"], rtol=1e-5, atol=1e-7)
            chex.assert_trees_all_close(got["norm"], plain["norm"], rtol=1e-5, atol=1e-7)
    assert not np.allclose(decay[-1]["norm"]["scale"], no_decay[-1]["norm"]["scale"])


def test_moara_adamw_under_inject_hyperparams_with_bf16_parameters():
    params = {"q_proj": {"kernel": jnp.ones((16, 16), jnp.bfloat16)}, "norm": jnp.ones(16, jnp.bfloat16)}
    grads = jax.tree.map(lambda p: (0.1 * jnp.arange(p.size).reshape(p.shape) % 1.0).astype(p.dtype), params)
    kwargs = dict(r_base=4, block_size=4, update_proj_gap=3, rank_allocation=False)  # one module type
    injected = optax.inject_hyperparams(
        mj.moara_adamw, static_args=mj.MOARA_ADAMW_STATIC_ARGS, hyperparam_dtype=jnp.float32
    )(learning_rate=1e-2, **kwargs)
    plain = mj.moara_adamw(1e-2, **kwargs)
    s1, s2 = injected.init(params), plain.init(params)
    assert s1.hyperparams["b2"] == jnp.float32(0.999)
    step1, step2 = jax.jit(injected.update), jax.jit(plain.update)
    for _ in range(4):  # across a refresh
        (u1, s1), (u2, s2) = step1(grads, s1, params), step2(grads, s2, params)
        chex.assert_trees_all_close(u1, u2, rtol=2e-2, atol=1e-5)
    s1.hyperparams["learning_rate"] = jnp.asarray(2e-2, jnp.float32)  # twice the rate, twice the step
    (u1, _), (u2, _) = step1(grads, s1, params), step2(grads, s2, params)
    chex.assert_trees_all_close(u1, jax.tree.map(lambda x: 2 * x, u2), rtol=2e-2, atol=1e-5)


def test_recompose_uses_the_blocks_of_its_decompose():
    """n = 10 in blocks of 6 gives 2 blocks, as blocks of 5 would; the node's block size decides."""
    g = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((10, 3)), jnp.float32)}
    tx = mj.stage_chain(mj.decompose(6), mj.recompose(scale=1.0))
    out, _ = tx.update(g, tx.init(g))
    np.testing.assert_allclose(out["w"], g["w"], rtol=1e-5, atol=1e-6)
    wrong = mj.stage_chain(mj.decompose(6), mj.recompose(scale=1.0, block_size=5))
    with pytest.raises(ValueError, match="block_size=5 but the update was decomposed with block_size=6"):
        wrong.update(g, wrong.init(g))


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match="rank"):
        mj.scale_by_galore(0)
    with pytest.raises(ValueError, match="block_size"):
        mj.scale_by_moara(4, 0)
    with pytest.raises(ValueError, match="block_size"):
        mj.moara_adamw(0.1, r_base=4, block_size=None)
    with pytest.raises(ValueError, match="r_base"):
        mj.moara_adamw(0.1, r_base=0, block_size=8)
    with pytest.raises(ValueError, match="donors"):
        mj.moara_adamw(0.1, r_base=8, block_size=8, donors=("qq",))
    with pytest.raises(ValueError, match="update_proj_gap"):
        mj.scale_by_galore(4, update_proj_gap=0)
    with pytest.raises(ValueError, match="svd"):
        mj.scale_by_galore(4, svd="lanczos")
    with pytest.raises(ValueError, match="only matrices"):
        mj.scale_by_galore(4).init({"bias": jnp.ones(3)})
    with pytest.raises(ValueError, match="oversample"):
        mj.project(4, svd="randomized", oversample=-1)
    with pytest.raises(ValueError, match="power_iters"):
        mj.project(4, svd="randomized", power_iters=-1)
    with pytest.raises(ValueError, match="ranks: unknown module types"):
        mj.moara_adamw(0.1, r_base=8, block_size=8, ranks={"dwon": 16})
    with pytest.raises(ValueError, match="mag_dtype"):
        mj.moara_adamw(0.1, r_base=8, block_size=8, mag_dtype="floot32")
    with pytest.raises(ValueError, match="mu_dtype"):
        mj.moara_adamw(0.1, r_base=8, block_size=8, mu_dtype="bf61")
    # Accepted before, and run: moments of an integer dtype, a fractional seed, a string read as
    # its characters (receivers="o" was the type 'o'), allocation settings that moved nothing.
    with pytest.raises(ValueError, match="mu_dtype must be a floating dtype"):
        mj.moara_adamw(0.1, r_base=8, block_size=8, mu_dtype=jnp.int32)
    with pytest.raises(ValueError, match="mag_dtype must be a floating dtype"):
        mj.moara_adamw(0.1, r_base=8, block_size=8, mag_dtype=jnp.bool_)
    with pytest.raises(ValueError, match="seed must be an integer, got 1.5"):
        mj.moara_adamw(0.1, r_base=8, block_size=8, seed=1.5)
    for name in ("donors", "receivers"):
        with pytest.raises(
            ValueError, match=rf"{name} must be module type names, e.g. \('o',\), not the string"
        ):
            mj.moara_adamw(0.1, r_base=8, block_size=8, **{name: "o"})
    with pytest.raises(ValueError, match="module_types must be module type names"):
        mj.allocate_ranks(8, "qkvo")
    with pytest.raises(ValueError, match="delta set, but rank_allocation=False moves no rank"):
        mj.moara_adamw(0.1, r_base=8, block_size=8, rank_allocation=False, delta=2)
    with pytest.raises(ValueError, match="donors, receivers set, but ranks= gives every rank"):
        mj.moara_adamw(0.1, r_base=8, block_size=8, ranks={"q": 4}, donors=("q",), receivers=("down",))


def test_numpy_scalars_and_nan_settings_are_checked_like_python_numbers():
    """NumPy scalars passed the checks unseen (a b2 of np.float32(1.0) made every update zero), a
    NaN weight decay made every parameter NaN, and a refresh interval beyond the int32 step
    counter failed at the first update with JAX's overflow; each is now refused at once."""
    make = lambda **kw: mj.moara_adamw(1e-3, r_base=8, block_size=8, **kw)  # noqa: E731
    for name, value in (("b1", np.float32(1.5)), ("b2", np.float32(1.0)), ("eps", np.float64(-1e-8))):
        with pytest.raises(ValueError, match=rf"{name} out of range"):
            make(**{name: value})
    for name in ("b1", "b2", "eps"):
        with pytest.raises(ValueError, match=rf"{name} out of range: nan"):
            make(**{name: float("nan")})
    for value in (float("nan"), np.float32(-0.1)):
        with pytest.raises(ValueError, match="weight_decay must be a non-negative number"):
            make(weight_decay=value)
    with pytest.raises(ValueError, match="growth_limit must be positive"):
        mj.fira_adam(growth_limit=np.float32(-1.0))
    mj.fira_adam(growth_limit=float("inf"))  # no limit
    for host in ("galore", "q_galore", "subtrack_pp"):
        with pytest.raises(ValueError, match=r"update_proj_gap must be a positive integer below 2\^31 - 1"):
            make(host=host, update_proj_gap=2**31 - 1)
    # NumPy scalars in range are taken, and step as Python numbers do.
    params = {"self_attn": {"q_proj": {"kernel": jnp.ones((16, 16))}}, "norm": jnp.ones(16)}
    grads = jax.tree.map(lambda x: jnp.cos(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape)), params)
    as_numpy = make(b1=np.float32(0.5), b2=np.float32(0.75), weight_decay=np.float32(0.0))
    as_python = make(b1=0.5, b2=0.75, weight_decay=0.0)
    steps = [tx.update(grads, tx.init(params), params)[0] for tx in (as_numpy, as_python)]
    chex.assert_trees_all_close(*steps, rtol=1e-6)


def test_api_misuse_found_by_a_probe_is_named_in_one_line():
    """Each of these ran into an AttributeError, a TypeError deep in the labels, JAX's many-line
    structure error, a ZeroDivisionError, a silently real update of a complex parameter, an
    empty alignment, or (bf16 injected decay rates) updates that were all zero."""
    params = {
        "self_attn": {"q_proj": {"kernel": jnp.ones((16, 16))}},
        "mlp": {"down_proj": {"kernel": jnp.ones((32, 16))}},
        "norm": jnp.ones(16),
    }
    make = lambda **kw: mj.moara_adamw(1e-3, r_base=8, block_size=8, **kw)  # noqa: E731
    # A state of another kind of transform: decomposition or host changed since init.
    for made, stepped in (({}, {"decompose": False}), ({"decompose": False}, {}), ({}, {"host": "fira"})):
        with pytest.raises(ValueError, match=r"^moara_adamw: the state of \['mlp'\]\['down_proj'\]"):
            make(**stepped).update(params, make(**made).init(params), params)
    with pytest.raises(ValueError, match=r"a state made with other settings \(weight_decay zero or not"):
        jax.jit(make(weight_decay=0.1).update)(params, make().init(params), params)
    # No static_args: optax calls label_fn with the step count.
    with pytest.raises(TypeError, match="pass static_args=moara_jax.MOARA_ADAMW_STATIC_ARGS"):
        optax.inject_hyperparams(mj.moara_adamw)(learning_rate=1e-3, r_base=8, block_size=8).init(params)
    # Injected in the parameters' bf16, b2 = 0.999 was 1: every update zero.
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    injected = functools.partial(optax.inject_hyperparams, static_args=mj.MOARA_ADAMW_STATIC_ARGS)
    with pytest.raises(ValueError, match=r"b1 is a bfloat16 array.*hyperparam_dtype=jnp.float32"):
        injected(mj.moara_adamw)(learning_rate=1e-3, r_base=8, block_size=8).init(bf16)
    tx = injected(mj.moara_adamw, hyperparam_dtype=jnp.float32)(learning_rate=1e-3, r_base=8, block_size=8)
    updates, _ = tx.update(bf16, tx.init(bf16), bf16)
    assert all(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))
    with pytest.raises(
        ValueError, match=r"weight_decay_mask: not the parameters' tree nor a prefix of it \(its top"
    ):
        make(weight_decay=0.1, weight_decay_mask={"norm": False}).init(params)
    with pytest.raises(ValueError, match=r"\['c'\] is complex64: complex parameters are not supported"):
        make().init({**params, "c": jnp.ones(4, jnp.complex64)})
    with pytest.raises(ValueError, match="module_alignment: opt_state holds no projection basis"):
        mj.module_alignment(params, optax.adam(1e-3).init(params))
    # A target with no entries is left to AdamW, as a non-matrix is.
    empty = {**params, "x": {"q_proj": {"kernel": jnp.ones((0, 16))}}}
    updates, _ = jax.jit(make().update)(empty, make().init(empty), empty)
    assert updates["x"]["q_proj"]["kernel"].shape == (0, 16)
    # ... and a projection handed one names it (a ZeroDivisionError in a reshape).
    with pytest.raises(ValueError, match=r"project: parameter \['w'\] has shape \(0, 8\): an empty"):
        mj.scale_by_galore(4).init({"w": jnp.ones((0, 8))})
    # A scale that is not a number failed at the first update; an unused block_size passed unchecked.
    for scale in ("a", -0.25, float("nan")):
        message = f"scale must be a non-negative number, got {scale!r}"
        with pytest.raises(ValueError, match=re.escape(message)):
            make(scale=scale)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got -5"):
        mj.moara_adamw(1e-3, r_base=8, decompose=False, block_size=-5)


def test_numpy_integers_are_accepted_where_integers_are():
    params = {"q_proj": {"kernel": jnp.ones((16, 16))}, "down_proj": {"kernel": jnp.ones((32, 16))}}
    a = mj.moara_adamw(0.1, r_base=np.int64(8), block_size=np.int32(4), ranks={"down": np.int64(12)})
    b = mj.moara_adamw(0.1, r_base=8, block_size=4, ranks={"down": 12})
    for scale in (np.float32(0.25), np.int64(1)):  # and NumPy numbers where numbers are
        mj.moara_adamw(0.1, r_base=8, block_size=4, scale=scale)
    chex.assert_trees_all_equal_shapes_and_dtypes(a.init(params), b.init(params))


def test_rank_clipping_is_reported_with_module_and_both_numbers():
    params = {
        "mlp": {"down_proj": {"kernel": jnp.ones((40, 6))}},
        "self_attn": {
            "q_proj": {"kernel": jnp.ones((6, 6))},
            "k_proj": {"kernel": jnp.ones((6, 6))},
        },
    }
    tx = mj.moara_adamw(0.1, r_base=4, block_size=4)  # down gets 8 > min(40, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = tx.init(params)
    messages = [str(w.message) for w in caught]
    assert any("'down'" in m and "8" in m and "clipped to 6" in m for m in messages), messages
    rows = {r["module"]: r for r in mj.rank_table(params, r_base=4)}
    assert rows["down"]["requested"] == 8 and rows["down"]["used"] == 6
    assert mj.state_bytes(state)["projection_bases"] > 0


@pytest.mark.parametrize("host", ["galore", "q_galore", "ldadam", "osd", "subtrack_pp"])
def test_rank_clipping_warns_once_for_the_matrices_clipped_alike(host):
    """An unrolled model's layers clipped alike give one warning naming how many and the first
    and last (one per layer buried the other warnings); another shape or module is another line."""
    layers = {
        f"layers_{i}": {
            "mlp": {"down_proj": {"kernel": jnp.ones((40, 6))}},
            "self_attn": {"q_proj": {"kernel": jnp.ones((6, 6))}, "k_proj": {"kernel": jnp.ones((6, 6))}},
        }
        for i in range(12)
    }
    layers["layers_11"]["mlp"]["down_proj"]["kernel"] = jnp.ones((40, 7))
    hosts = {"q_galore": mj.QGaLore(basis_bits=None, weight_bits=None)}
    tx = mj.moara_adamw(0.1, r_base=4, block_size=2, host=hosts.get(host, host))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx.init(layers)
    clipped = sorted(str(w.message) for w in caught if "clipped" in str(w.message))
    # First and last by number: layers_10 comes after layers_9 (the tree's order is the text's).
    first, last = (f"['layers_{i}']['mlp']['down_proj']['kernel']" for i in (0, 10))
    assert clipped == [
        f"projection rank 8 for module 'down' at 11 matrices ({first}, ..., {last}) (Flax shape "
        "(40, 6)) exceeds min(fan_in, fan_out) = 6; clipped to 6",
        "projection rank 8 for module 'down' at ['layers_11']['mlp']['down_proj']['kernel'] (Flax "
        "shape (40, 7)) exceeds min(fan_in, fan_out) = 7; clipped to 7",
    ], clipped


@pytest.mark.parametrize("method", ["eigh", "randomized"])
def test_fast_refresh_agrees_with_exact_basis(method):
    """Principal angles between the eigh / randomized and the exact top-r subspaces are small when
    the spectrum has a gap."""
    rng = np.random.default_rng(0)
    u = np.linalg.qr(rng.standard_normal((96, 96)))[0]
    v = np.linalg.qr(rng.standard_normal((160, 160)))[0]
    s = np.concatenate([np.linspace(10, 5, 8), 0.2 * np.ones(88)])
    g = jnp.asarray((u[:, :96] * s) @ v[:96], jnp.float32)  # Flax (fan_in=96, fan_out=160)
    exact = mj.project(8).update({"w": g}, mj.project(8).init({"w": g}))[1].basis["w"]
    rand_tx = mj.project(8, svd=method)
    rand = rand_tx.update({"w": g}, rand_tx.init({"w": g}))[1].basis["w"]
    cosines = np.linalg.svd(np.asarray(exact).T @ np.asarray(rand), compute_uv=False)
    angles = np.degrees(np.arccos(np.clip(cosines, -1, 1)))
    assert angles.max() < 1.0, angles
    # Orthonormal, like the SVD's.
    np.testing.assert_allclose(np.asarray(rand).T @ np.asarray(rand), np.eye(8), atol=1e-5)


def test_randomized_refresh_with_rank_and_oversampling_covering_the_side_is_exact():
    """With r + oversample at least the projected side's size the range finder's sketch spans
    that whole side, so even without power iterations the basis is the exact top-r one (on a
    Gaussian matrix, whose spectrum has no gap for the iterations to exploit)."""
    g = jax.random.normal(jax.random.PRNGKey(0), (16, 24))  # Flax (fan_in=16, fan_out=24): side 16
    exact_tx, rand_tx = mj.project(4), mj.project(4, svd="randomized", oversample=12, power_iters=0)
    exact = exact_tx.update({"w": g}, exact_tx.init({"w": g}))[1].basis["w"]
    rand = rand_tx.update({"w": g}, rand_tx.init({"w": g}))[1].basis["w"]
    cosines = np.linalg.svd(np.asarray(exact).T @ np.asarray(rand), compute_uv=False)
    np.testing.assert_allclose(cosines, 1.0, atol=1e-4)


def test_inner_adams_default_eps_is_galore_torchs():
    """``inner_adam()``'s eps is galore-torch's 1e-6 (not optax's 1e-8): on gradients near eps the
    update is that of ``eps=1e-6``."""
    g = {"w": jnp.full((3,), 1e-7)}

    def update(tx):
        return tx.update(g, tx.init(g))[0]["w"]

    np.testing.assert_array_equal(update(mj.inner_adam()), update(mj.inner_adam(eps=1e-6)))
    assert not np.allclose(update(mj.inner_adam()), update(mj.inner_adam(eps=1e-8)))


def test_cholesky_qr2_orthonormalises_like_householder():
    """The accelerator path of the range finder (CholeskyQR2, run here directly) gives an
    orthonormal basis of the same column space as Householder QR, and stays finite on zeros."""
    from moara_jax import _bases

    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (3, 300, 40)) * jnp.exp(-jnp.arange(40) / 5.0)
    q = np.asarray(_bases._cholesky_qr(_bases._cholesky_qr(a)))
    np.testing.assert_allclose(
        np.einsum("bji,bjk->bik", q, q), np.broadcast_to(np.eye(40), (3, 40, 40)), atol=1e-4
    )
    qh = np.asarray(_bases._householder(a))
    cosines = np.linalg.svd(np.einsum("bji,bjk->bik", qh, q), compute_uv=False)
    assert cosines.min() > 0.999, cosines.min()
    z = _bases._cholesky_qr(_bases._cholesky_qr(jnp.zeros((2, 50, 8))))
    assert np.isfinite(np.asarray(z)).all()


def test_stages_under_optax_chain_are_told_to_use_stage_chain():
    """optax.chain initialises every stage on the parameters, so the Adam stage has no moments
    for the projected values: a ValueError naming stage_chain, where an AttributeError on None
    came from inside the Adam step."""
    params = {"q_proj": {"kernel": jnp.ones((16, 8))}}
    for stages in [
        (mj.project(4), mj.inner_adam(), mj.recompose()),
        (mj.decompose(4), mj.project(4), mj.inner_adam(), mj.recompose(block_size=4)),
    ]:
        tx = optax.chain(*stages)
        with pytest.raises(ValueError, match="moara_jax.stage_chain"):
            tx.update(params, tx.init(params), params)
        chained = mj.stage_chain(*stages)
        updates, _ = chained.update(params, chained.init(params), params)
        assert jax.tree.leaves(updates)[0].shape == (16, 8)


def test_an_update_without_params_under_inject_hyperparams_says_how():
    """weight_decay injected is an array even at 0, so the decay needs the parameters; the
    error says so, and naming it static makes an update without them work."""
    params = {"q_proj": {"kernel": jnp.ones((16, 8))}}
    kwargs = dict(learning_rate=0.01, r_base=4, block_size=4)
    injected = optax.inject_hyperparams(mj.moara_adamw, static_args=mj.MOARA_ADAMW_STATIC_ARGS)(**kwargs)
    with pytest.raises(ValueError, match="name it in static_args"):
        injected.update(params, injected.init(params))
    static = (*mj.MOARA_ADAMW_STATIC_ARGS, "weight_decay")
    injected = optax.inject_hyperparams(mj.moara_adamw, static_args=static)(**kwargs)
    updates, _ = injected.update(params, injected.init(params))
    assert updates["q_proj"]["kernel"].shape == (16, 8)


@pytest.mark.parametrize("name", ["full", "galore", "fira_full", "osd_full", "q_galore"])
@pytest.mark.slow
def test_an_update_that_does_not_fit_its_parameter_is_named_in_one_line(name):
    """A gradient transposed, flattened or of another size, for a target and for a non-target,
    with and without the parameters, eager and jitted: a one-line ``ValueError`` names the
    optimizer, the parameter and the shape, where JAX's own error came from deep inside."""
    params = _params()
    tx = VARIANTS[name](0.01)
    state = tx.init(params)
    down, norm = "['layers']['mlp']['down_proj']['kernel']", "['layers']['norm']['scale']"

    def changed(key, value):
        grads = jax.tree.map(jnp.ones_like, params)
        where = grads["layers"]["mlp"]["down_proj"] if key == "down" else grads["layers"]["norm"]
        where["kernel" if key == "down" else "scale"] = value
        return grads

    cases = [
        (changed("down", jnp.ones((16, 40))), down, "(16, 40)"),  # transposed
        (changed("down", jnp.ones(640)), down, "(640,)"),  # flattened
        (changed("down", jnp.ones((40, 8))), down, "(40, 8)"),
        (changed("norm", jnp.ones(8)), norm, "(8,)"),
    ]
    for grads, path, shape in cases:
        for update in (tx.update, jax.jit(tx.update)):
            for given in (params, None):
                with pytest.raises(ValueError) as error:
                    update(grads, state, given)
                message = str(error.value)
                assert "\n" not in message, message
                assert message.startswith("moara_adamw: the update of " + path), message
                assert f"has shape {shape}" in message, message
                why = "its parameter's shape" if given is not None else "another shape than its parameter"
                assert why in message, message


def test_a_misfit_under_the_composable_stages_names_the_stage_and_parameter():
    params = {"q_proj": {"kernel": jnp.ones((16, 8))}}
    tx = mj.scale_by_moara(4, 8)
    state = tx.init(params)
    with pytest.raises(
        ValueError, match=r"^scale_by_moara: the update of \['q_proj'\]\['kernel'\] has shape \(8, 16\)"
    ):
        tx.update({"q_proj": {"kernel": jnp.ones((8, 16))}}, state)
    # A parameter added since init, and one removed.
    grown = {**params, "k_proj": {"kernel": jnp.ones((16, 8))}}
    with pytest.raises(
        ValueError, match=r"^scale_by_moara: \['k_proj'\]\['kernel'\] has no state made at init"
    ):
        tx.update(grown, state)
    with pytest.raises(
        ValueError, match=r"^scale_by_moara: the updates' tree is not the one its state was made for"
    ):
        tx.update({"k_proj": {"kernel": jnp.ones((16, 8))}}, tx.init(grown))


def test_a_misfit_of_one_bare_matrix_or_of_a_flattened_one_is_named():
    """An optimizer of one bare matrix (no tree) names its misfit as a tree's, and a matrix
    flattened, whose shape no state of these settings fits, is named with init's own refusal,
    with or without a tree around it (no parameters given to tell)."""
    tx = mj.scale_by_galore(4)
    state = tx.init(jnp.ones((64, 32)))
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(ValueError) as error:
            update(jnp.ones((32, 64)), state)
        assert str(error.value).startswith(
            "scale_by_galore: the update of <the root> has shape (32, 64), which does not fit the state"
        ), error.value
    for wrap, name in ((lambda x: x, "<leaf>"), (lambda x: {"a": {"kernel": x}}, "['a']['kernel']")):
        state = tx.init(wrap(jnp.ones((64, 32))))
        with pytest.raises(ValueError) as error:
            tx.update(wrap(jnp.ones(64 * 32)), state)
        message = str(error.value)
        assert "\n" not in message and message.startswith(
            "scale_by_galore: the updates' shapes are not those of parameters this optimizer takes"
        ), message
        assert f"parameter {name} has shape (2048,)" in message, message


@pytest.mark.parametrize(
    "stage",
    [
        lambda rank: mj.project(rank),
        lambda rank: mj.osd_project(rank, basis_lr=1e-3),
        lambda rank: mj.subtrack_project(rank),
        lambda rank: mj.ldadam(rank),
        lambda rank: mj.q_galore_project(rank, group_size=16),
    ],
    ids=["project", "osd_project", "subtrack_project", "ldadam", "q_galore_project"],
)
@pytest.mark.slow
def test_a_state_made_under_other_ranks_is_refused_by_each_projection(stage):
    """A stage takes its rank from the basis in the state; one made under another rank (another
    r_base or allocation) is refused in one line naming the parameter and both ranks, eagerly and
    under jit, not run at the state's rank. Under the settings' own rank the step runs, and a
    rank clipped at init (64 asked of a 32-wide matrix) is the one expected."""
    params = {"mlp": {"down_proj": {"kernel": jnp.ones((64, 32))}}}
    for update in (stage(8).update, jax.jit(stage(8).update)):
        with pytest.raises(ValueError) as error:
            update(params, stage(4).init(params))
        message = str(error.value)
        assert "\n" not in message and message.endswith(
            "the state's basis of ['mlp']['down_proj']['kernel'] has rank 4, and these settings give "
            "its matrix (64, 32) rank 8: a state made with other ranks (r_base, ranks, the allocation) "
            "than this optimizer's"
        ), message
        low, _ = update(params, stage(8).init(params))
        assert jax.tree.leaves(low)[0].shape[-2:] in ((8, 32), (64, 8))
    with pytest.warns(UserWarning, match="clipped to 32"):
        clipped = stage(64).init(params)
    low, _ = stage(64).update(params, clipped)
    assert 32 in jax.tree.leaves(low)[0].shape[-2:]


def test_moara_adamw_refuses_a_state_of_another_r_base():
    """Through moara_adamw the misfit is named as the state's when the parameters are given (its
    rank after allocation: mlp.down receives, 4 -> 6 and 8 -> 12)."""
    params = {
        "self_attn": {"q_proj": {"kernel": jnp.ones((32, 32))}},
        "mlp": {"down_proj": {"kernel": jnp.ones((64, 32))}},
        "norm": jnp.ones(32),
    }
    state = mj.moara_adamw(0.01, r_base=4, block_size=8).init(params)
    with pytest.raises(ValueError) as error:
        mj.moara_adamw(0.01, r_base=8, block_size=8).update(params, state, params)
    message = str(error.value)
    assert message.startswith("moara_adamw: the state of ['mlp']['down_proj']['kernel'] is not the one"), (
        message
    )
    assert "has shape (32, 6); this update needs (32, 12)" in message, message


@pytest.mark.slow
def test_a_state_of_other_settings_is_named_and_other_errors_pass_unchanged():
    """With the parameters given and every update of its parameter's shape, a misfit is the
    state's (made with another block size); an error that is no misfit (a schedule's, here; under
    Q-GaLore with bf16 gradients, whose state's tree holds a dtype) is raised as it was."""
    params = {"q_proj": {"kernel": jnp.ones((32, 16))}, "norm": jnp.ones(32)}
    state = mj.moara_adamw(0.01, r_base=4, block_size=8, rank_allocation=False).init(params)
    other = mj.moara_adamw(0.01, r_base=4, block_size=4, rank_allocation=False)
    with pytest.raises(ValueError) as error:
        other.update(params, state, params)
    message = str(error.value)
    assert message.startswith(
        "moara_adamw: the state of ['q_proj']['kernel'] is not the one these settings"
    ), message
    assert "a state made with other settings" in message and "\n" not in message, message

    def schedule(count):
        raise ValueError("a bug in the schedule")

    params = {"self_attn": {"q_proj": {"kernel": jnp.ones((64, 32))}}, "norm": jnp.ones(64)}
    for host in ("galore", Q_GALORE):
        tx = mj.moara_adamw(schedule, r_base=8, block_size=8, host=host, weight_decay=0.1)
        state = tx.init(params)
        grads = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        for given in (params, None):
            with pytest.raises(ValueError) as error:
                tx.update(grads, state, given)
            # Q-GaLore decays the non-targets before the step: without params, optax says so.
            raised = str(error.value)
            assert raised == "a bug in the schedule" or raised.startswith("You are using a transformation"), (
                raised
            )


def test_init_traced_again_repeats_no_warning_and_leaves_other_threads_warnings_alone():
    """Diagnosing an update that does not fit its state traces init again: the rank warning it
    gives is not repeated, and holding it back touches neither the process's warning filters nor
    the warnings another thread gives meanwhile (``warnings.catch_warnings`` would do both)."""
    import threading

    from moara_jax import _warnings

    params = {"mlp": {"down_proj": {"kernel": jnp.ones((40, 6))}}}
    tx = mj.moara_adamw(0.1, r_base=8, block_size=2, rank_allocation=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = tx.init(params)
        with pytest.raises(ValueError, match="down_proj"):
            tx.update({"mlp": {"down_proj": {"kernel": jnp.ones((40, 4))}}}, state)
    assert [str(w.message).count("clipped to 6") for w in caught] == [1], [str(w.message) for w in caught]

    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _warnings.quiet():
            _warnings.warn("held back")
            other = threading.Thread(target=_warnings.warn, args=("from another thread",))
            other.start()
            other.join()
            inside = list(warnings.filters)
        _warnings.warn("given")
    assert inside == [("always", None, Warning, None, 0), *filters]
    assert [str(w.message) for w in caught] == ["from another thread", "given"]


def test_warnings_point_at_the_callers_line_however_the_optimizer_is_wrapped():
    """The clipped-rank and no-target warnings name the line of the user's code that made the
    state, directly, in an optax chain, under jit and through optax.MultiSteps (not a line of
    JAX's tree maps or of this package)."""
    params = {"mlp": {"down_proj": {"kernel": jnp.ones((40, 6))}}, "norm": {"scale": jnp.ones(4)}}
    tx = mj.moara_adamw(0.1, r_base=8, block_size=2, rank_allocation=False)
    for made in (tx, optax.chain(optax.clip_by_global_norm(1.0), tx), optax.MultiSteps(tx, 2)):
        for init in (made.init, jax.jit(made.init)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                line = inspect.currentframe().f_lineno + 1
                init(params)
            clipped = [w for w in caught if "clipped to 6" in str(w.message)]
            assert clipped and all((w.filename, w.lineno) == (__file__, line) for w in clipped), [
                (w.filename, w.lineno, str(w.message)[:40]) for w in caught
            ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        mj.moara_adamw(0.1, r_base=8, block_size=2).init({"dense": {"kernel": jnp.ones((8, 8))}})
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)], [str(w.message) for w in caught]


@pytest.mark.parametrize("host", ["galore", "fira", "osd", "ldadam", "subtrack_pp", "q_galore"])
@pytest.mark.slow
def test_a_python_number_parameter_steps_as_the_same_zero_d_array(host):
    """optax's transforms take a Python number as a parameter (and its gradient); so do these,
    eagerly and under jit, as they take the same value as a 0-d array."""
    host = mj.QGaLore(basis_group_size=32, weight_group_size=64) if host == "q_galore" else host
    kernel = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)
    tx = mj.moara_adamw(0.1, r_base=4, block_size=4, weight_decay=0.1, host=host)

    def steps(temperature, grad):
        params = {"self_attn": {"q_proj": {"kernel": kernel}}, "temperature": temperature}
        grads = {"self_attn": {"q_proj": {"kernel": kernel * 0.5}}, "temperature": grad}
        state = tx.init(params)
        first, state = tx.update(grads, state, params)
        second, _ = jax.jit(tx.update)(grads, state, params)
        return [np.asarray(u["temperature"]) for u in (first, second)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no rank moves: the model has no mlp.down
        got, want = steps(2.0, 0.25), steps(jnp.asarray(2.0), jnp.asarray(0.25))
    np.testing.assert_array_equal(got, want)
    assert got[0] != 0
