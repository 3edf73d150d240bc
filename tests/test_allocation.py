"""Module labels, the budget-preserving allocation rule, and the rank table."""

import jax
import jax.numpy as jnp
import pytest
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
        ("model.layers.3.self_attn.o_proj.weight", "o"),
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
    mj.moara_adamw(0.01, r_base=16, block_size=8, donors=("attn",), receivers=("mlp",), label_fn=labels)
