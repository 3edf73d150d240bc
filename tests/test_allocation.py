"""Module labels, the budget-preserving allocation rule, and the rank table."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import moara_jax as mj


@pytest.mark.parametrize(
    "path,label",
    [
        ("model/layers/0/self_attn/q_proj/kernel", "q"),
        ("['layers'][0].q_proj['kernel']", "q"),  # keystr with an attribute key
        ("layers.self_attn.k_proj.kernel", "k"),
        (("layers", "self_attn", "v_proj", "kernel"), "v"),
        # PyTorch's layout (fan_out, fan_in) is not read as a Flax kernel: not a target.
        ("model.layers.3.self_attn.o_proj.weight", "other"),
        ("['layers']['q_proj']['kernel'].value", "q"),  # keystr of a boxed (nnx, linen) kernel
        ("layers/mlp/gate_proj/kernel", "gate"),
        ("layers/mlp/up_proj/kernel", "up"),
        ("layers/mlp/down_proj/kernel", "down"),
        ("layers/self_attn/q_a_proj/kernel", "q_a"),
        ("layers/self_attn/q_b_proj/kernel", "q_b"),
        ("layers/self_attn/kv_a_proj_with_mqa/kernel", "kv_a"),
        ("layers/self_attn/kv_b_proj/kernel", "kv_b"),
        ("layers/self_attn/q_proj/bias", "other"),
        ("layers/self_attn/q_a_layernorm/scale", "other"),
        ("embed_tokens/embedding", "other"),
        ("lm_head/kernel", "other"),
        # A kernel under two HF names (a module wrapped in another): the nearest one's type.
        ("layers/mlp/up_proj/inner/down_proj/kernel", "down"),
        ("norm/scale", "other"),
    ],
)
def test_module_label(path, label):
    assert mj.module_label(path) == label


def test_module_label_on_jax_key_paths():
    params = {
        "layers": {"mlp": {"down_proj": {"kernel": jnp.ones((4, 2))}}},
        "layers_0": [{"q_proj": {"kernel": jnp.ones((2, 2))}}],
    }
    labels = jax.tree.leaves(mj.label_tree(params))
    assert sorted(labels) == ["down", "q"]


def test_paper_allocation():
    ranks = mj.allocate_ranks(256, mj.LLAMA_MODULE_TYPES)
    assert ranks == {"q": 128, "k": 128, "v": 256, "o": 256, "up": 256, "gate": 256, "down": 512}
    mla = mj.allocate_ranks(256, mj.MLA_MODULE_TYPES, donors=mj.MLA_DONORS)
    assert mla["q_b"] == mla["kv_b"] == 128 and mla["down"] == 512 and mla["q_a"] == 256


@given(
    r_base=st.integers(2, 2048),
    n_donors=st.integers(1, 3),
    n_receivers=st.integers(1, 3),
    data=st.data(),
)
def test_budget_is_preserved(r_base, n_donors, n_receivers, data):
    types = mj.LLAMA_MODULE_TYPES
    donors = types[:n_donors]
    receivers = types[-n_receivers:]
    delta = data.draw(st.integers(0, r_base - 1).filter(lambda d: d * n_donors % n_receivers == 0))
    ranks = mj.allocate_ranks(r_base, types, donors, receivers, delta)
    assert sum(ranks.values()) == len(types) * r_base
    assert all(ranks[d] == r_base - delta for d in donors)
    # each receiver gains an equal share, delta |D| / |R|; the other types keep r_base
    assert all(ranks[r] * n_receivers == r_base * n_receivers + delta * n_donors for r in receivers)
    assert all(ranks[t] == r_base for t in types if t not in donors + receivers)


def test_allocation_errors_name_the_problem():
    types = mj.LLAMA_MODULE_TYPES
    with pytest.raises(ValueError, match="donors: unknown"):
        mj.allocate_ranks(256, types, donors=("x",))
    with pytest.raises(ValueError, match="receivers: unknown"):
        mj.allocate_ranks(256, types, receivers=("mlp",))
    with pytest.raises(ValueError, match="not divisible"):
        mj.allocate_ranks(256, types, donors=("q",), receivers=("up", "down"), delta=3)
    with pytest.raises(ValueError, match="overlap"):
        mj.allocate_ranks(256, types, donors=("q",), receivers=("q",))
    with pytest.raises(ValueError, match="r_base"):
        mj.allocate_ranks(0, types)
    with pytest.raises(ValueError, match="delta"):
        mj.allocate_ranks(8, types, delta=8)


def test_r_base_1_says_that_no_rank_moves():
    """The default delta (r_base // 2) is 0 at r_base 1: the allocation is uniform, and says so."""
    with pytest.warns(UserWarning, match="r_base 1 leaves no rank to move") as said:
        ranks = mj.allocate_ranks(1, mj.LLAMA_MODULE_TYPES)
    assert set(ranks.values()) == {1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a delta of 0 asked for, or no donors: nothing to say
        assert set(mj.allocate_ranks(1, mj.LLAMA_MODULE_TYPES, delta=0).values()) == {1}
        assert set(mj.allocate_ranks(1, mj.LLAMA_MODULE_TYPES, (), ()).values()) == {1}
        assert mj.allocate_ranks(2, mj.LLAMA_MODULE_TYPES)["down"] == 4
        assert set(mj.allocate_ranks(1, mj.LLAMA_MODULE_TYPES, warn=False).values()) == {1}
    # The optimizer says it once, when its state is made (not when built, nor at each update).
    kernel = {"kernel": jnp.ones((8, 8))}
    params = {"self_attn": {"q_proj": kernel, "k_proj": kernel}, "mlp": {"down_proj": kernel}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx = mj.moara_adamw(0.01, r_base=1, block_size=4)
        state = tx.init(params)
        for _ in range(2):
            _, state = tx.update(params, state, params)
    assert [str(w.message) for w in caught].count(str(said[0].message)) == 1


def _mla_tree():
    """Abstract DeepSeek-V2 MLA attention and a down projection, Flax layout."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return {
        "self_attn": {
            "q_a_proj": {"kernel": s(64, 48)},
            "q_b_proj": {"kernel": s(48, 64)},
            "kv_a_proj_with_mqa": {"kernel": s(64, 40)},
            "kv_b_proj": {"kernel": s(32, 64)},
            "o_proj": {"kernel": s(64, 64)},
        },
        "mlp": {"down_proj": {"kernel": s(96, 64)}},
    }


def test_explicit_ranks_and_mla_default_donors_in_rank_table():
    mla = _mla_tree()
    rows = {r["module"]: r for r in mj.rank_table(mla, r_base=16)}
    assert rows["q_b"]["requested"] == rows["kv_b"]["requested"] == 8
    assert rows["down"]["requested"] == 32 and rows["o"]["requested"] == 16
    explicit = {
        r["module"]: r["requested"] for r in mj.rank_table(mla, r_base=16, ranks={"down": 24, "o": 4})
    }
    assert explicit["down"] == 24 and explicit["o"] == 4 and explicit["q_a"] == 16
    tx = mj.moara_adamw(0.01, r_base=16, block_size=8, ranks={"down": 24})
    basis = jax.eval_shape(tx.init, mla)
    shapes = [x.shape for x in jax.tree.leaves(basis) if x.shape[-2:] == (64, 24)]
    assert shapes, "down_proj's basis should have the explicit rank 24"


def test_mla_without_query_factors_donates_from_q_and_kv_b():
    """DeepSeek-V2-Lite's attention (no ``q_lora_rank``: a plain ``q_proj`` beside MLA's
    ``kv_b_proj``): the default donors are q and kv_b, the paper's two (Appendix C.5: down gets
    ``2 r_base``), and the trainer's mapping of a profile's q/k names gives the same two."""
    from train.step import on_model

    lite = {"self_attn": {k: v for k, v in _mla_tree()["self_attn"].items() if not k.startswith("q_")}}
    lite["self_attn"]["q_proj"] = {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    lite["mlp"] = _mla_tree()["mlp"]
    types = ("q", "kv_a", "kv_b", "o", "down")
    assert mj.default_donors(types) == ("q", "kv_b") == tuple(on_model("donors", ["q", "k"], types))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both default donors are there: nothing to say
        rows = {r["module"]: r["requested"] for r in mj.rank_table(lite, r_base=16)}
    assert rows == {"q": 8, "kv_a": 16, "kv_b": 8, "o": 16, "down": 32}
    assert mj.default_donors(mj.MLA_MODULE_TYPES) == mj.MLA_DONORS
    assert mj.default_donors(mj.LLAMA_MODULE_TYPES) == mj.DEFAULT_DONORS
    assert mj.default_donors(("v", "o", "down")) == ()
    with pytest.raises(ValueError, match="module_types must be module type names"):
        mj.default_donors("qk")  # was read as ('q', 'k')


def test_a_model_with_every_default_donor_allocates_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ranks = mj.resolve_module_ranks(("q", "k", "v", "o", "up", "gate", "down"), r_base=16, warn=True)
    assert ranks == {"q": 8, "k": 8, "v": 16, "o": 16, "up": 16, "gate": 16, "down": 32}


def test_one_default_donor_alone_donates_and_is_said():
    """A tree with q but no k (nor kv_b): q alone gives ``r_base / 2``, down receives it, and
    ``warn=True`` says that only part of the default donors is there."""
    with pytest.warns(UserWarning, match=r"the parameters have \['q'\] alone: they donate"):
        ranks = mj.resolve_module_ranks(("q", "v", "down"), r_base=16, warn=True)
    assert ranks == {"q": 8, "v": 16, "down": 24}


def test_moara_adamw_takes_explicit_mla_donors_and_custom_labels():
    mla = _mla_tree()
    tx = mj.moara_adamw(0.01, r_base=16, block_size=8, donors=mj.MLA_DONORS)
    shapes = {x.shape for x in jax.tree.leaves(jax.eval_shape(tx.init, mla))}
    # Bases (projected side, rank): q_b and kv_b donate 8 each, down receives 16.
    assert {(48, 8), (32, 8), (64, 32)} <= shapes
    # A typo is still refused when the optimizer is built, naming the argument.
    with pytest.raises(ValueError, match="donors: unknown"):
        mj.moara_adamw(0.01, r_base=16, block_size=8, donors=("q_bb",))
    # With its own label function, the types it names are the ones allocation sees.
    labels = lambda path: "attn" if "attn" in jax.tree_util.keystr(path) else "mlp"  # noqa: E731
    tx = mj.moara_adamw(0.01, r_base=16, block_size=8, donors=("attn",), receivers=("mlp",), label_fn=labels)
    # the five attention matrices donate 8 each; the one mlp matrix receives 8 (rank 24)
    assert sorted(shape[-1] for shape in _basis_shapes(jax.eval_shape(tx.init, mla))) == [8] * 5 + [24]


def _labels_by_path(tree):
    return {jax.tree_util.keystr(p): lab for p, lab in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _basis_shapes(state):
    """The shapes of the projection bases in a ``moara_adamw`` state (sorted)."""
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, mj.ProjectState))
    return sorted(x.shape for n in nodes if isinstance(n, mj.ProjectState) for x in jax.tree.leaves(n.basis))


def _singular_values(x):
    return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


class _LinenBlock(nn.Module):
    """q_proj (16 -> 32) and down_proj (32 -> 16), kernels boxed by ``nn.with_partitioning``."""

    @nn.compact
    def __call__(self, x):
        init = lambda *names: nn.with_partitioning(nn.initializers.lecun_normal(), names)  # noqa: E731
        h = nn.Dense(32, name="q_proj", kernel_init=init(None, "model"))(x)
        return nn.Dense(16, name="down_proj", kernel_init=init("model", None))(h)


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(16, 32, rngs=rngs)
        self.down_proj = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(self.q_proj(x))


# r_base 8 with the default allocation: q (donor) gets 4, down (receiver) 12; both project their
# 16-wide side.
BOXED_BASES = [(16, 4), (16, 12)]


def test_boxed_flax_linen_params_get_low_rank_state():
    """``nn.with_partitioning`` kernels kept boxed (paths end in ``.value``) are targets."""
    model = _LinenBlock()
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    assert isinstance(params["q_proj"]["kernel"], nn.Partitioned)
    assert _labels_by_path(mj.label_tree(params)) == {
        "['down_proj']['bias']": "other",
        "['down_proj']['kernel'].value": "down",
        "['q_proj']['bias']": "other",
        "['q_proj']['kernel'].value": "q",
    }
    tx = mj.moara_adamw(0.01, r_base=8, decompose=False)
    state = tx.init(params)
    assert _basis_shapes(state) == BOXED_BASES
    grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    s = _singular_values(updates["q_proj"]["kernel"].value)
    assert s[0] > 0 and s[4] < 1e-5 * s[0], s  # GaLore's rank-4 step, not AdamW's full rank


def test_flax_nnx_state_and_optimizer_get_low_rank_state():
    """``nnx.state(model, nnx.Param)`` (paths end in ``.value``) and ``nnx.Optimizer``, which
    inits on that state and updates on plain arrays, give the same targets."""
    model = _NnxBlock(nnx.Rngs(0))
    labels = _labels_by_path(mj.label_tree(nnx.state(model, nnx.Param)))
    assert labels["['q_proj']['kernel'].value"] == "q" and labels["['down_proj']['kernel'].value"] == "down"
    assert labels["['q_proj']['bias'].value"] == "other"
    rows = mj.rank_table(nnx.state(model, nnx.Param), r_base=8)  # paths as the arrays' own
    assert sorted(r["path"] for r in rows) == ["['down_proj']['kernel']", "['q_proj']['kernel']"], rows
    tx = mj.moara_adamw(0.01, r_base=8, decompose=False)
    assert _basis_shapes(tx.init(nnx.state(model, nnx.Param))) == BOXED_BASES
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    assert _basis_shapes(optimizer.opt_state) == BOXED_BASES
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
    for _ in range(2):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        updates = optimizer.update(model, grads)
        s = _singular_values(updates["q_proj"]["kernel"])
        assert s[0] > 0 and s[4] < 1e-5 * s[0], s
    # The diagnostic matches the boxed state's bases to the plain gradients' paths.
    with_nnx = mj.module_alignment(grads, optimizer.opt_state)
    assert set(with_nnx) == {"q", "down"} and all(0 < v <= 1 + 1e-6 for v in with_nnx.values()), with_nnx


def test_a_custom_label_fn_sees_the_same_paths_boxed_and_not():
    """A ``label_fn`` reading the last key gets the array's own path under a Flax box too."""
    model = _NnxBlock(nnx.Rngs(0))
    seen = set()

    def by_last_key(path):
        seen.add(type(path[-1]).__name__)
        return (
            {"q_proj": "q", "down_proj": "down"}.get(path[-2].key, "other")
            if path[-1].key == "kernel"
            else "other"
        )

    tx = mj.moara_adamw(0.01, r_base=8, decompose=False, label_fn=by_last_key)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    assert _basis_shapes(optimizer.opt_state) == BOXED_BASES
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
    optimizer.update(model, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model))
    assert seen == {"DictKey"}


def _moara_warnings(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("moara_adamw:")]


def test_a_tree_without_targets_warns_once_naming_its_matrices():
    params = {
        "attn": {"wq": {"kernel": jnp.ones((8, 8))}, "wk": {"kernel": jnp.ones((8, 8))}},
        "mlp": {"w1": {"kernel": jnp.ones((8, 16))}, "w2": {"kernel": jnp.ones((16, 8))}},
        "norm": {"scale": jnp.ones(8)},
    }
    tx = mj.moara_adamw(0.01, r_base=4, block_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = tx.init(params)
        tx.update(params, state, params)  # warns at init only
    (message,) = _moara_warnings(caught)
    assert "no parameter is a target matrix" in message
    assert "['attn']['wk']['kernel'] (8, 8)" in message and "and 1 more" in message
    assert "q_proj" in message and "label_fn=" in message and "'weight'" not in message
    assert mj.state_bytes(state)["projection_bases"] == 0


def test_pytorch_layout_weight_leaves_are_not_targets_and_the_warning_says_so():
    params = {"model": {"layers": {"self_attn": {"q_proj": {"weight": jnp.ones((12, 8))}}}}}
    assert jax.tree.leaves(mj.label_tree(params)) == ["other"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mj.moara_adamw(0.01, r_base=4, block_size=4).init(params)
    (message,) = _moara_warnings(caught)
    assert "['q_proj']['weight'] (12, 8)" in message
    assert "(fan_out, fan_in)" in message and "transpose" in message


@pytest.mark.parametrize(
    "params,kwargs",
    [
        ({"norm": {"scale": jnp.ones(8)}}, {}),  # nothing a target could be
        ({"w": jnp.ones((8, 8))}, {"label_fn": lambda path: "q", "rank_allocation": False}),
        ({"q_proj": {"kernel": jnp.ones((8, 8))}}, {"rank_allocation": False}),
        ({"q_proj": {"kernel": jnp.ones((8, 8))}}, {"ranks": {"q": 2}}),
        (
            {"q_proj": {"kernel": jnp.ones((8, 8))}, "v_proj": {"kernel": jnp.ones((8, 8))}},
            {"donors": ("q",), "receivers": ("v",)},
        ),
    ],
    ids=["vectors_only", "custom_labels", "no_allocation", "explicit_ranks", "explicit_sets"],
)
def test_trees_with_targets_or_nothing_to_target_do_not_warn(params, kwargs):
    tx = mj.moara_adamw(0.01, r_base=4, block_size=4, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx.init(params)
    assert _moara_warnings(caught) == []


def test_default_allocation_that_moves_no_rank_warns():
    """A tree with donors but no receivers (here q/k, no down_proj) keeps r_base everywhere."""
    params = {
        "self_attn": {"q_proj": {"kernel": jnp.ones((16, 16))}, "k_proj": {"kernel": jnp.ones((16, 16))}}
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = mj.moara_adamw(0.01, r_base=8, block_size=4).init(params)
    (message,) = _moara_warnings(caught)
    assert "none of the default receivers ('down',)" in message and "['k', 'q']" in message
    assert "r_base = 8" in message and "rank_allocation=False" in message
    assert _basis_shapes(state) == [(16, 8), (16, 8)]
    only_down = {"mlp": {"down_proj": {"kernel": jnp.ones((32, 16))}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mj.moara_adamw(0.01, r_base=8, block_size=4).init(only_down)
    (message,) = _moara_warnings(caught)
    assert "none of the default donors ('q', 'k')" in message and "default receivers" not in message


def test_receivers_named_by_the_caller_are_checked_like_donors():
    """Named receivers are not filtered to the tree as the defaults are: a misspelt one raises
    (at construction for a name no module type has, at init for a type the tree lacks) instead
    of turning the allocation off, and a present one moves rank with the default donors."""
    params = {
        "q_proj": {"kernel": jnp.ones((16, 16))},
        "k_proj": {"kernel": jnp.ones((16, 16))},
        "up_proj": {"kernel": jnp.ones((16, 32))},
        "down_proj": {"kernel": jnp.ones((32, 16))},
    }
    for receivers in [("dwn",), ("down", "dwn")]:
        with pytest.raises(ValueError, match=r"receivers: unknown module types \['dwn'\]"):
            mj.moara_adamw(0.01, r_base=8, block_size=4, receivers=receivers)
    absent = r"receivers: module types \['gate'\] are not in the parameters, whose module types are"
    with pytest.raises(ValueError, match=absent):
        mj.moara_adamw(0.01, r_base=8, block_size=4, receivers=("gate",)).init(params)
    with pytest.raises(ValueError, match=absent):
        mj.rank_table(params, r_base=8, receivers=("gate",))
    ranks = {row["module"]: row["requested"] for row in mj.rank_table(params, r_base=8, receivers=("up",))}
    assert ranks == {"q": 4, "k": 4, "up": 16, "down": 8}


def test_allocation_settings_the_parameters_cannot_use_are_named():
    """ranks= naming a type the model lacks changed no rank and said nothing (a typo under a
    custom label_fn, or another model's profiled allocation); a list for ranks raised an
    AttributeError; named donors whose default receiver is absent were called unknown receivers."""
    params = {
        "self_attn": {"q_proj": {"kernel": jnp.ones((16, 16))}, "v_proj": {"kernel": jnp.ones((16, 16))}},
        "mlp": {"up_proj": {"kernel": jnp.ones((16, 32))}},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = mj.moara_adamw(0.01, r_base=8, block_size=4, ranks={"q": 4, "down": 16}).init(params)
    (message,) = _moara_warnings(caught)
    assert "ranks names module types the parameters do not have, ['down']: they set no rank" in message
    assert jax.tree.leaves(state)  # the init went on
    table = {r["module"]: r["requested"] for r in mj.rank_table(params, r_base=8, ranks={"q": 4, "down": 16})}
    assert table == {"q": 4, "v": 8, "up": 8}
    with pytest.raises(ValueError, match=r"ranks must map module types to ranks, e\.g\. \{'down': 256\}"):
        mj.moara_adamw(0.01, r_base=8, block_size=4, ranks=[("q", 4)])
    with pytest.raises(
        ValueError,
        match=r"receivers: the default receivers \['down'\] are not in the parameters, whose module "
        r"types are \['up', 'q', 'v'\]; pass receivers= naming types present",
    ):
        mj.moara_adamw(0.01, r_base=8, block_size=4, donors=("q",)).init(params)
    with pytest.raises(ValueError, match=r"donors: module types \['k'\] are not in the parameters"):
        mj.moara_adamw(0.01, r_base=8, block_size=4, donors=("q", "k"), receivers=("up",)).init(params)
    ranks = {
        r["module"]: r["requested"] for r in mj.rank_table(params, r_base=8, donors=("v",), receivers=("up",))
    }
    assert ranks == {"q": 8, "v": 4, "up": 12}


def test_a_label_fn_that_returns_no_string_is_named():
    params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
    tx = mj.moara_adamw(0.01, r_base=4, block_size=4, label_fn=lambda path: None)
    with pytest.raises(ValueError, match=r"label_fn returned None for \['b'\]: a module type"):
        tx.init(params)
