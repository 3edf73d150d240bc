"""Kernels whose matrix spans several axes (``MatrixAxes``, ``as_matrices``): head-split attention."""

import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import cpu_devices

import moara_jax as mj

E, H, D, L = 16, 4, 8, 2  # embed, heads, head_dim, stacked layers
QKV = mj.MatrixAxes(fan_in=-3, fan_out=(-2, -1))  # (..., embed, heads, head_dim)
OUT = mj.MatrixAxes(fan_in=(-3, -2), fan_out=-1)  # (..., heads, head_dim, embed)
ATTENTION = {"query": "q", "key": "k", "value": "v", "out": "o"}
QGALORE = mj.QGaLore(basis_group_size=32, min_8bit_size=128, weight_group_size=32)  # groups that fit E


def attention_label(path):
    """Flax's attention kernels as module types (``query`` -> ``q``, ...); the rest ``other``."""
    names = mj.path_names(path)
    return ATTENTION.get(names[-2], "other") if names[-1:] == ("kernel",) else "other"


def attention_axes(params):
    """``QKV``/``OUT`` for Flax's attention kernels, ``None`` (the default rule) elsewhere."""

    def spec(path, x):
        names = mj.path_names(path)
        if names[-1:] != ("kernel",) or x.ndim < 3:
            return None
        return OUT if names[-2] == "out" else QKV

    return jax.tree_util.tree_map_with_path(spec, params)


def _multi_axis_params(rng):
    """q (embed, heads, head_dim), o (heads, head_dim, embed), both stacked over L layers, a
    head-major k kernel (heads, embed, head_dim) that needs a transpose, and a plain 2-D down."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    params = {
        "layers": {
            "q_proj": {"kernel": normal(L, E, H, D)},
            "o_proj": {"kernel": normal(L, H, D, E)},
        },
        "k_proj": {"kernel": normal(H, E, D)},
        "down_proj": {"kernel": normal(2 * E, E)},
        "norm": normal(E),
    }
    axes = {
        "layers": {"q_proj": {"kernel": QKV}, "o_proj": {"kernel": OUT}},
        "k_proj": {"kernel": mj.MatrixAxes(fan_in=1, fan_out=(0, 2))},
        "down_proj": None,
        "norm": None,
    }
    return params, axes


def _as_2d(tree):
    """What the matrix view of ``_multi_axis_params`` must be, written out by hand."""
    layers = tree["layers"]
    return {
        "layers": {
            "q_proj": {"kernel": layers["q_proj"]["kernel"].reshape(L, E, H * D)},
            "o_proj": {"kernel": layers["o_proj"]["kernel"].reshape(L, H * D, E)},
        },
        "k_proj": {"kernel": tree["k_proj"]["kernel"].transpose(1, 0, 2).reshape(E, H * D)},
        "down_proj": tree["down_proj"],
        "norm": tree["norm"],
    }


def _from_2d(tree):
    layers = tree["layers"]
    return {
        "layers": {
            "q_proj": {"kernel": layers["q_proj"]["kernel"].reshape(L, E, H, D)},
            "o_proj": {"kernel": layers["o_proj"]["kernel"].reshape(L, H, D, E)},
        },
        "k_proj": {"kernel": tree["k_proj"]["kernel"].reshape(E, H, D).transpose(1, 0, 2)},
        "down_proj": tree["down_proj"],
        "norm": tree["norm"],
    }


@pytest.mark.parametrize(
    "host",  # the fast lane: GaLore, Fira and Q-GaLore (quantized bases, 8-bit moments, INT8 weights)
    ["galore", "fira", pytest.param(QGALORE, id="q_galore")]
    + [pytest.param(h, marks=pytest.mark.slow) for h in ("osd", "ldadam", "subtrack_pp")],
)
@pytest.mark.parametrize("decompose", [True, False])
def test_multi_axis_kernels_train_exactly_as_their_matrices(decompose, host):
    """``moara_adamw(matrix_axes=...)`` on (embed, heads, head_dim) kernels, stacked or not, and on
    one that needs a transpose, is step for step the same optimizer on the 2-D matrices, through
    two basis refreshes and weight decay."""
    rng = np.random.default_rng(0)
    params, axes = _multi_axis_params(rng)
    kwargs = dict(r_base=8, block_size=D, decompose=decompose, update_proj_gap=2, weight_decay=0.1, host=host)
    # Updates are about 1e-3. The two sides are different XLA programs (the views' reshapes fuse
    # into them), so float32 rounding differs; LDAdam's basis, made anew from the last one every
    # step, carries it forward, to 3e-7 here, and Q-GaLore's 8-bit moments and INT8 weights round
    # it on, to 2.4e-7 with XLA's legacy CPU emitters (the suite's, tests/conftest.py).
    atol = 1e-6 if host == "ldadam" or isinstance(host, mj.QGaLore) else 1e-7
    tx = mj.moara_adamw(0.01, matrix_axes=axes, **kwargs)
    ref = mj.moara_adamw(0.01, **kwargs)
    state, ref_state = jax.jit(tx.init)(params), ref.init(_as_2d(params))
    # The state is the matrices' state.
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    assert [x.shape for x in jax.tree.leaves(state)] == [x.shape for x in jax.tree.leaves(ref_state)]
    for _ in range(5):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
        updates, state = jax.jit(tx.update)(grads, state, params)
        ref_updates, ref_state = jax.jit(ref.update)(_as_2d(grads), ref_state, _as_2d(params))
        want = _from_2d(ref_updates)
        assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol), updates, want)
        params = optax.apply_updates(params, updates)


@pytest.mark.slow
def test_flax_linen_attention_gets_whole_matrix_bases_and_low_rank_steps():
    """``nn.MultiHeadDotProductAttention``'s kernels: without ``matrix_axes`` the query kernel is
    read as 16 separate (heads, head_dim) matrices; with it, as one (embed, heads * head_dim)
    matrix whose step has rank ``r``."""
    model = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, E))
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(params)
    kwargs = dict(r_base=4, decompose=False, rank_allocation=False, label_fn=attention_label)

    by_default = mj.projection_bases(mj.moara_adamw(0.01, **kwargs).init(params))
    assert by_default["['query']['kernel']"].shape == (E, H, 4)  # 16 stacked (4, 8) matrices
    tx = mj.moara_adamw(0.01, matrix_axes=attention_axes, **kwargs)
    state = tx.init(params)
    got = {k: b.shape for k, b in mj.projection_bases(state).items()}
    assert got == {f"['{m}']['kernel']": (E, 4) for m in ATTENTION}  # the embed side of each
    updates, state = jax.jit(tx.update)(grads, state, params)
    for m in ATTENTION:
        u = updates[m]["kernel"]
        assert u.shape == params[m]["kernel"].shape
        matrix = u.reshape(E, H * D) if m != "out" else u.reshape(H * D, E)
        s = np.linalg.svd(np.asarray(matrix, np.float64), compute_uv=False)
        assert s[0] > 0 and s[4] < 1e-5 * s[0], (m, s)  # GaLore's rank-4 step of the whole matrix
    # The diagnostic reads the gradients in the same view; a full-rank basis reconstructs them.
    full = mj.moara_adamw(0.01, matrix_axes=attention_axes, **{**kwargs, "r_base": E})
    _, full_state = full.update(grads, full.init(params), params)
    s_tau = mj.module_alignment(grads, full_state, label_fn=attention_label, matrix_axes=attention_axes)
    assert set(s_tau) == set(ATTENTION.values())
    np.testing.assert_allclose(list(s_tau.values()), 1.0, rtol=1e-5)


def test_alignment_in_the_matrix_view_is_that_of_the_matrices():
    rng = np.random.default_rng(2)
    params, axes = _multi_axis_params(rng)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    kwargs = dict(r_base=4, block_size=D, rank_allocation=False)
    tx = mj.moara_adamw(0.01, matrix_axes=axes, **kwargs)
    _, state = tx.update(grads, tx.init(params), params)
    ref = mj.moara_adamw(0.01, **kwargs)
    _, ref_state = ref.update(_as_2d(grads), ref.init(_as_2d(params)), _as_2d(params))
    got = mj.matrix_alignment(grads, state, block_size=D, matrix_axes=axes)
    want = mj.matrix_alignment(_as_2d(grads), ref_state, block_size=D)
    assert (
        set(got)
        == set(want)
        == {
            "['layers']['q_proj']['kernel']",
            "['layers']['o_proj']['kernel']",
            "['k_proj']['kernel']",
            "['down_proj']['kernel']",
        }
    )
    for k in want:
        assert got[k].shape == want[k].shape  # one cosine per stacked layer
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5)


def test_flax_nnx_attention_under_nnx_optimizer():
    """``nnx.MultiHeadAttention`` under ``nnx.Optimizer``: ``init`` sees boxed variables,
    ``update`` plain arrays; the same ``matrix_axes`` function serves both."""
    model = nnx.MultiHeadAttention(
        num_heads=H, in_features=E, qkv_features=H * D, decode=False, rngs=nnx.Rngs(0)
    )
    tx = mj.moara_adamw(
        0.01,
        r_base=4,
        decompose=False,
        rank_allocation=False,
        label_fn=attention_label,
        matrix_axes=attention_axes,
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    assert {b.shape for b in mj.projection_bases(optimizer.opt_state).values()} == {(E, 4)}
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, E))
    before = nnx.state(model, nnx.Param)
    before = jax.tree.map(jnp.copy, before)
    for _ in range(2):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)
    after = nnx.state(model, nnx.Param)
    # Two steps in one basis (no refresh yet): their sum is a rank-4 change of the whole matrix.
    step = np.asarray(after["query"]["kernel"][...] - before["query"]["kernel"][...], np.float64)
    s = np.linalg.svd(step.reshape(E, H * D), compute_uv=False)
    assert s[0] > 0 and s[4] < 1e-4 * s[0], s
    s_tau = mj.module_alignment(
        grads, optimizer.opt_state, label_fn=attention_label, matrix_axes=attention_axes
    )
    assert set(s_tau) == set(ATTENTION.values()), s_tau


def test_matrix_view_round_trips_and_leaves_other_leaves_alone():
    rng = np.random.default_rng(3)
    params, axes = _multi_axis_params(rng)
    view = mj.matrix_view(params, axes)
    jax.tree.map(np.testing.assert_array_equal, view, _as_2d(params))
    # jax.eval_shape's output (as rank_table takes it): the views' shapes and dtypes, no arrays.
    abstract = mj.matrix_view(jax.eval_shape(lambda: params), axes)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), abstract) == jax.tree.map(
        lambda v: (v.shape, v.dtype), view
    )
    assert mj.matrix_view(params, None) is params
    # A spec on a subtree applies to each of its leaves.
    both = {
        "a": {"kernel": params["layers"]["q_proj"]["kernel"], "more": params["layers"]["q_proj"]["kernel"]}
    }
    assert {k: v.shape for k, v in mj.matrix_view(both, {"a": QKV})["a"].items()} == {
        "kernel": (L, E, H * D),
        "more": (L, E, H * D),
    }
    # as_matrices hands the inner transformation the view and gives back the leaf's layout.
    seen = []

    def record(updates, state, params=None):
        seen.append(jax.tree.map(jnp.shape, updates))
        return updates, state

    tx = mj.as_matrices(optax.GradientTransformation(lambda p: optax.EmptyState(), record), axes)
    out, _ = tx.update(params, tx.init(params))
    assert seen == [jax.tree.map(jnp.shape, _as_2d(params))]
    jax.tree.map(np.testing.assert_array_equal, out, params)


def test_as_matrices_gives_back_the_leafs_layout_under_an_axis_order_that_is_not_its_own_inverse():
    """fan_in the last axis, fan_out the first two: the view's axis order (2, 0, 1) is a 3-cycle,
    whose inverse is another order (a swap, the other tests' case, is its own inverse)."""
    x = {"w": jax.random.normal(jax.random.PRNGKey(0), (2, 3, 5))}
    axes = {"w": mj.MatrixAxes(fan_in=2, fan_out=(0, 1))}
    want = np.moveaxis(np.asarray(x["w"]), 2, 0).reshape(5, 6)  # (fan_in, fan_out)
    np.testing.assert_array_equal(mj.matrix_view(x, axes)["w"], want)
    tx = mj.as_matrices(optax.identity(), axes)
    out, _ = tx.update(x, tx.init(x))
    np.testing.assert_array_equal(out["w"], x["w"])


def test_inject_hyperparams_takes_matrix_axes_as_static():
    rng = np.random.default_rng(4)
    params, axes = _multi_axis_params(rng)
    tx = optax.inject_hyperparams(mj.moara_adamw, static_args=mj.MOARA_ADAMW_STATIC_ARGS)(
        0.01, r_base=4, block_size=D, rank_allocation=False, matrix_axes=lambda tree: axes
    )
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(params, state, params)
    assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            mj.MatrixAxes(fan_in=0, fan_out=0),
            r"\['q'\]: fan_in=0 and fan_out=0 must be distinct axes of its shape \(16, 4, 8\)",
        ),
        (mj.MatrixAxes(fan_in=3, fan_out=-1), r"\['q'\]: fan_in=3 must name one or more of its 3 axes"),
        (mj.MatrixAxes(fan_in=(), fan_out=-1), r"fan_in=\(\) must name one or more"),
    ],
)
def test_bad_matrix_axes_name_the_leaf_and_the_problem(spec, message):
    params = {"q": jnp.ones((E, H, D)), "b": jnp.ones(E)}
    with pytest.raises(ValueError, match=message):
        mj.matrix_view(params, {"q": spec, "b": None})


def test_a_module_spec_that_reaches_its_bias_points_to_the_kernel():
    """Flax's attention (``query``: a ``kernel`` (E, H, D) and a ``bias`` (H, D)): a spec given for
    the module reaches its bias, whose 2 axes it cannot name; the error says where to put it."""
    params = {"query": {"kernel": jnp.ones((E, H, D)), "bias": jnp.ones((H, D))}}
    with pytest.raises(
        ValueError,
        match=r"\['query'\]\['bias'\]: fan_in=-3 must name one or more of its 2 axes \(integers\); to give "
        r"it to the kernel alone, put it under the 'kernel' key",
    ):
        mj.matrix_view(params, {"query": QKV})
    assert mj.matrix_view(params, {"query": {"kernel": QKV}})["query"]["kernel"].shape == (E, H * D)


def test_matrix_axes_on_a_vector_a_misspelt_path_or_a_bad_entry_is_refused():
    params = {"q": jnp.ones((E, H, D)), "b": jnp.ones(E)}
    with pytest.raises(
        ValueError, match=r"\['b'\]: a matrix needs 2 or more axes, the leaf has shape \(16,\)"
    ):
        mj.matrix_view(params, {"q": QKV, "b": QKV})
    with pytest.raises(ValueError, match="matrix_axes names qq, not the path of a parameter or of a subtree"):
        mj.moara_adamw(0.01, r_base=4, block_size=D, matrix_axes={"qq": QKV}).init(params)
    entries = [
        ((-3, (-2, -1)), r"matrix_axes\['q'\]\[0\] is -3: each entry must be a MatrixAxes or None"),
        (
            optax.contrib.MuonDimensionNumbers(0, (1, 2)),
            r"matrix_axes\['q'\].reduction_axis is 0: each entry",
        ),
        (0, r"matrix_axes\['q'\] is 0: each entry"),
        (False, r"matrix_axes\['q'\] is False: each entry"),
        ("qkv", r"matrix_axes\['q'\] is 'qkv': each entry"),
        (mj.MatrixAxes(False, (True, 2)), r"fan_in=False must name one or more of its 3 axes \(integers\)"),
        (mj.MatrixAxes(0.0, (1, 2)), r"fan_in=0.0 must name one or more"),
    ]
    for entry, message in entries:
        with pytest.raises(ValueError, match=message):
            mj.matrix_view(params, {"q": entry})
    # Integers of any kind name axes; a spec missing for a leaf leaves it as it is.
    for axis in (np.int64(0), jnp.int32(0), -3):
        view = mj.matrix_view(params, {"q": mj.MatrixAxes(axis, (np.int32(1), 2))})
        assert view["q"].shape == (E, H * D) and view["b"] is params["b"]


def _boxed_attention_params():
    """Flax linen attention's parameters, its kernels boxed with sharding names
    (``nn.with_partitioning``): q/k/v/out kernels 3-D, their biases 2-D (q/k/v) and 1-D (out)."""

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.MultiHeadDotProductAttention(
                num_heads=H,
                qkv_features=H * D,
                name="attn",
                kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "heads", "kv")),
                out_kernel_init=nn.with_partitioning(
                    nn.initializers.lecun_normal(), ("heads", "kv", "embed")
                ),
            )(x)

    return Attention().init(jax.random.PRNGKey(0), jnp.ones((2, 5, E)))["params"]["attn"]


@pytest.mark.slow
def test_a_dict_spec_fits_an_nnx_state_and_boxed_kernels_keep_their_sharding_names():
    """One dict of specs serves ``nnx.Optimizer`` (its ``init`` sees an ``nnx.State``), and
    kernels boxed with sharding names (linen's ``nn.with_partitioning``, nnx's) still build
    sharded states: the viewed leaves' state is unboxed, the kernels' updates keep their boxes."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("embed", "heads", "kv"))
    spec = {m: {"kernel": OUT if m == "out" else QKV} for m in ATTENTION}
    tx = mj.moara_adamw(
        0.01, r_base=4, block_size=D, rank_allocation=False, label_fn=attention_label, matrix_axes=spec
    )

    # nnx, sharding names on the kernels, under a mesh: nnx.Optimizer shards the state it makes.
    with jax.set_mesh(mesh):
        model = nnx.MultiHeadAttention(
            num_heads=H,
            in_features=E,
            qkv_features=H * D,
            decode=False,
            rngs=nnx.Rngs(0),
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "heads", "kv")),
            out_kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("heads", "kv", "embed")),
        )
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        assert {b.shape for b in mj.projection_bases(optimizer.opt_state).values()} == {(E, 4)}
        x = jnp.ones((2, 5, E))
        optimizer.update(model, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model))

    # linen, boxed: the state's partition specs (from the boxes) fit the state's arrays.
    params = _boxed_attention_params()
    assert isinstance(params["query"]["kernel"], nn.Partitioned)
    shardings = nn.get_sharding(jax.eval_shape(tx.init, params), mesh)
    state = jax.jit(tx.init, out_shardings=shardings)(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    assert isinstance(updates["query"]["kernel"], nn.Partitioned)
    assert updates["query"]["kernel"].names == ("embed", "heads", "kv")
    assert updates["query"]["kernel"].value.shape == (E, H, D)


def test_a_weight_decay_mask_built_over_boxed_kernels_fits_their_matrix_views():
    """A tree mask made by mapping over boxed parameters (``Partitioned`` booleans) decays what it
    marks under ``matrix_axes``, as a function of the matrix views does, where the viewed kernels
    have lost their boxes: the kernels decayed, the biases stepped as with ``weight_decay=0``."""
    params = _boxed_attention_params()

    def kernels(tree):
        return jax.tree_util.tree_map_with_path(lambda path, x: mj.path_names(path)[-1:] == ("kernel",), tree)

    mask = kernels(params)
    assert isinstance(mask["query"]["kernel"], nn.Partitioned)
    kw = dict(r_base=4, block_size=D, update_proj_gap=2, rank_allocation=False, label_fn=attention_label)
    kw |= dict(matrix_axes=attention_axes)
    rng = np.random.default_rng(7)
    grads = [
        jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params) for _ in range(3)
    ]

    def run(**decay):
        tx = mj.moara_adamw(0.1, **kw, **decay)
        state, p, out = tx.init(params), params, []
        for g in grads:
            u, state = jax.jit(tx.update)(g, state, p)
            p = optax.apply_updates(p, u)
            out.append(nn.unbox(u))
        return out

    plain, decayed = run(weight_decay=0.0), run(weight_decay=0.5)
    by_tree, by_fn = (
        run(weight_decay=0.5, weight_decay_mask=mask),
        run(weight_decay=0.5, weight_decay_mask=kernels),
    )
    for got, other, want, undecayed in zip(by_tree, by_fn, decayed, plain, strict=True):
        jax.tree.map(np.testing.assert_array_equal, got, other)
        for module in ATTENTION:
            np.testing.assert_allclose(got[module]["kernel"], want[module]["kernel"], rtol=1e-6, atol=1e-8)
            np.testing.assert_allclose(got[module]["bias"], undecayed[module]["bias"], rtol=1e-6, atol=1e-8)
    assert not np.allclose(decayed[-1]["query"]["bias"], plain[-1]["query"]["bias"])  # the decay shows


@pytest.mark.slow
def test_extra_arguments_reach_the_inner_transformation():
    """``value=`` for ``optax.contrib.reduce_on_plateau`` chained after ``moara_adamw``."""
    rng = np.random.default_rng(5)
    params, axes = _multi_axis_params(rng)
    inner = optax.chain(
        mj.moara_adamw(0.01, r_base=4, block_size=D, rank_allocation=False),
        optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0),
    )
    tx = mj.as_matrices(inner, axes)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    for loss in (1.0, 2.0, 3.0):
        _, state = tx.update(grads, state, params, value=jnp.asarray(loss))
    assert float(state[1].scale) < 1.0  # the plateau was seen: the losses reached it
    with_value = mj.moara_adamw(0.01, r_base=4, block_size=D, rank_allocation=False, matrix_axes=axes)
    with_value.update(grads, with_value.init(params), params, value=jnp.asarray(1.0))


def test_one_model_wide_spec_serves_each_group_of_a_partition_and_a_mask():
    """Under ``optax.partition`` and ``optax.masked`` the leaves another transformation steps are
    hidden (``optax.MaskedNode``); a spec naming one of them is no misspelt path, and each group
    steps its own leaves as on the hand-reshaped matrices."""
    rng = np.random.default_rng(6)
    params, axes = _multi_axis_params(rng)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    layers = {"layers": {"q_proj": {"kernel": "a"}, "o_proj": {"kernel": "b"}}}
    labels = layers | {"k_proj": {"kernel": "b"}, "down_proj": {"kernel": "b"}, "norm": "b"}
    kwargs = dict(r_base=4, block_size=D, rank_allocation=False)
    tx = optax.partition(
        {
            "a": mj.moara_adamw(0.01, matrix_axes=axes, **kwargs),
            "b": mj.moara_adamw(0.02, matrix_axes=axes, **kwargs),
        },
        labels,
    )
    ref = optax.partition({"a": mj.moara_adamw(0.01, **kwargs), "b": mj.moara_adamw(0.02, **kwargs)}, labels)
    updates, _ = tx.update(grads, tx.init(params), params)
    ref_updates, _ = ref.update(_as_2d(grads), ref.init(_as_2d(params)), _as_2d(params))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), updates, _from_2d(ref_updates)
    )

    mask = jax.tree.map(lambda label: label == "b", labels)
    masked = optax.masked(mj.moara_adamw(0.02, matrix_axes=axes, **kwargs), mask)
    updates, _ = masked.update(grads, masked.init(params), params)
    np.testing.assert_array_equal(updates["layers"]["q_proj"]["kernel"], grads["layers"]["q_proj"]["kernel"])
    want = _from_2d(ref_updates)
    for path in (("layers", "o_proj", "kernel"), ("k_proj", "kernel"), ("down_proj", "kernel")):
        got, expected = updates, want
        for key in path:
            got, expected = got[key], expected[key]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7, err_msg=str(path))
    with pytest.raises(ValueError, match="matrix_axes names k_prj"):  # a misspelt path is still refused
        optax.masked(mj.as_matrices(optax.sgd(0.1), {"k_prj": QKV}), mask).init(params)


SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import moara_jax as mj
    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    rng = np.random.default_rng(0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    params = {"query": {"kernel": normal(2, 32, 8, 16)}, "out": {"kernel": normal(2, 8, 16, 32)}}
    specs = {"query": {"kernel": P(None, "fsdp", "tensor", None)},
             "out": {"kernel": P(None, "tensor", None, "fsdp")}}
    axes = {"query": {"kernel": mj.MatrixAxes(-3, (-2, -1))}, "out": {"kernel": mj.MatrixAxes((-3, -2), -1)}}
    label = lambda path: {"query": "q", "out": "o"}[mj.path_names(path)[0]]
    # eps 1e-2: Adam's first step divides each projected entry by its own size, so entries near a
    # small eps would turn the sharded reductions' rounding into visible differences.
    tx = mj.moara_adamw(0.01, r_base=8, block_size=16, update_proj_gap=2, canonical_signs=True, eps=1e-2,
                        rank_allocation=False, label_fn=label, matrix_axes=axes)
    grads = [jax.tree.map(lambda p: normal(*p.shape), params) for _ in range(3)]
    shard = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)

    def run(params, grads):
        state, update, out = jax.jit(tx.init)(params), jax.jit(tx.update), []
        for g in grads:
            u, state = update(g, state, params)
            out.append(u)
        return out

    single = run(params, grads)
    sharded = run(shard(params), [shard(g) for g in grads])
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    for u, s in zip(jax.tree.leaves(sharded[-1]), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        assert u.sharding.is_equivalent_to(NamedSharding(mesh, s), u.ndim), (u.sharding, s)
    print("OK")
""")


@pytest.mark.slow
def test_sharded_head_split_kernels_match_one_device_and_keep_their_sharding():
    """Kernels sharded over heads (tensor) and embed (fsdp) on an 8-device mesh: the matrix view
    gives the one-device updates, laid out as the parameters are."""
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED], env=cpu_devices(8), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


def test_a_clipped_rank_on_a_kernel_of_more_axes_points_to_matrix_axes():
    """Flax attention kernels (16, 4, 8) without ``matrix_axes`` are 16 matrices of (4, 8): the
    rank clipped to 4 says so and names ``matrix_axes``; with it, nothing is clipped."""
    model = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)
    params = model.init(jax.random.PRNGKey(0), jnp.ones((2, 5, E)))["params"]
    kwargs = dict(r_base=12, rank_allocation=False, label_fn=attention_label, block_size=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mj.moara_adamw(0.01, **kwargs).init(params)
    query = [str(w.message) for w in seen if "['query']['kernel']" in str(w.message)]
    assert len(query) == 1 and query[0].endswith(
        f"clipped to 4; its leading axes ({E},) are taken as stacked layers, each index a matrix of "
        f"({H}, {D}): where the matrix spans more of its axes (an nn.DenseGeneral kernel such as "
        "(embed, heads, head_dim)), pass matrix_axes (moara_jax.MatrixAxes)"
    ), query
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mj.moara_adamw(0.01, matrix_axes=attention_axes, **kwargs).init(params)
    assert not [w for w in seen if "clipped" in str(w.message)]


def test_rank_table_reports_the_matrix_view_the_rank_applies_to():
    """r_base 24 on (16, 4, 8) query kernels: read as (4, 8) matrices it would be clipped to 4;
    as the (16, 32) matrix the optimizer sees with ``matrix_axes``, to 16. On eval_shape output."""
    model = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)
    x = jnp.ones((2, 5, E))
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)["params"]
    kwargs = dict(r_base=24, rank_allocation=False, label_fn=attention_label)
    plain = {row["path"]: (row["shape"], row["used"]) for row in mj.rank_table(params, **kwargs)}
    assert plain["['query']['kernel']"] == ((E, H, D), 4)
    viewed = mj.rank_table(params, matrix_axes=attention_axes, **kwargs)
    assert {row["path"]: (row["shape"], row["used"]) for row in viewed} == {
        "['query']['kernel']": ((E, H * D), E),
        "['key']['kernel']": ((E, H * D), E),
        "['value']['kernel']": ((E, H * D), E),
        "['out']['kernel']": ((H * D, E), E),
    }
