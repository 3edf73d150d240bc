"""``state_bytes`` reproduces the paper's optimizer-state memory (Table 2 and Appendix G, MiB)
for Llama 2 350M / 1B / 7B in the four conditions, from ``jax.eval_shape`` (nothing allocated)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import moara_jax as mj

# Paper, appendix memory table (b), "Opt. state" rows: Baseline, Decomp., Rank Alloc., Ours.
PAPER_MIB = {
    "350m": (538.57, 610.75, 578.69, 650.88),
    "1b": (1652.34, 1796.58, 1812.32, 1956.57),
    "7b": (7177.02, 7563.02, 8041.02, 8427.02),
}
# hidden, intermediate, layers, r_base, block size (paper Appendix D; vocab 32000, T5 tokenizer)
DIMS = {
    "350m": (1024, 2736, 24, 256, 32),
    "1b": (2048, 5461, 24, 512, 64),
    "7b": (4096, 11008, 32, 1024, 128),
}
CONDITIONS = [(False, False), (True, False), (False, True), (True, True)]


def llama2_shapes(hidden, inter, layers, vocab=32000, dtype=jnp.bfloat16):
    """Llama 2 parameter shapes (Flax layout, layers stacked), as ShapeDtypeStructs."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    return {
        "embed_tokens": {"embedding": s(vocab, hidden)},
        "layers": {
            "input_layernorm": {"scale": s(layers, hidden)},
            "post_attention_layernorm": {"scale": s(layers, hidden)},
            "self_attn": {
                n: {"kernel": s(layers, hidden, hidden)} for n in ("q_proj", "k_proj", "v_proj", "o_proj")
            },
            "mlp": {
                "gate_proj": {"kernel": s(layers, hidden, inter)},
                "up_proj": {"kernel": s(layers, hidden, inter)},
                "down_proj": {"kernel": s(layers, inter, hidden)},
            },
        },
        "norm": {"scale": s(hidden)},
        "lm_head": {"kernel": s(hidden, vocab)},
    }


@pytest.mark.parametrize("size", list(PAPER_MIB))
def test_state_bytes_reproduce_paper_table(size):
    hidden, inter, layers, r_base, block = DIMS[size]
    params = llama2_shapes(hidden, inter, layers)
    for (decompose, allocate), want in zip(CONDITIONS, PAPER_MIB[size], strict=True):
        tx = mj.moara_adamw(
            0.01, r_base=r_base, block_size=block, decompose=decompose, rank_allocation=allocate
        )
        state = jax.eval_shape(tx.init, params)
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
        got = mj.state_bytes(state)
        assert round(got["moments"] / 2**20, 2) == want, (size, decompose, allocate, got)
        assert got["magnitude_moments"] > 0 if decompose else got["magnitude_moments"] == 0
        assert got["projection_bases"] > 0  # reported, not counted in the paper's figure
        # Every array of the state counted once: the total is their bytes, and its parts add up to it.
        arrays = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        assert got["total"] == arrays == got["moments"] + got["projection_bases"] + got["other"]


def test_components_at_7b_match_appendix_g_increments():
    """Appendix G: +864 MiB from rank allocation and +386 MiB from decomposition at 7B."""
    params = llama2_shapes(4096, 11008, 32)

    def get(decompose, allocate):
        tx = mj.moara_adamw(0.005, r_base=1024, block_size=128, decompose=decompose, rank_allocation=allocate)
        return mj.state_bytes(jax.eval_shape(tx.init, params))

    base, full = get(False, False), get(True, True)
    assert (full["direction_moments"] - base["direction_moments"]) / 2**20 == 864
    assert round(full["magnitude_moments"] / 2**20) == 386
    assert full["adam_moments"] == base["adam_moments"]


def test_concrete_state_matches_abstract_accounting():
    params = {
        "q_proj": {"kernel": jnp.zeros((32, 32), jnp.bfloat16)},
        "down_proj": {"kernel": jnp.zeros((48, 32), jnp.bfloat16)},
        "norm": jnp.zeros(32, jnp.bfloat16),
    }
    tx = mj.moara_adamw(0.01, r_base=8, block_size=16)
    assert mj.state_bytes(tx.init(params)) == mj.state_bytes(jax.eval_shape(tx.init, params))


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(32, 32, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(48, 32, use_bias=False, rngs=rngs)
        self.norm = nnx.RMSNorm(32, rngs=rngs)


def test_flax_nnx_optimizer_state_is_sorted_by_component():
    """``nnx.Optimizer``'s ``opt_state``, and ``nnx.state(optimizer)`` (where each state
    NamedTuple has become a mapping of its field names), account as ``jax.eval_shape`` does."""
    model = _NnxBlock(nnx.Rngs(0))
    tx = mj.moara_adamw(0.01, r_base=8, block_size=16)
    want = mj.state_bytes(jax.eval_shape(tx.init, nnx.as_pure(nnx.state(model, nnx.Param))))
    assert want["direction_moments"] and want["magnitude_moments"] and want["projection_bases"]
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    assert mj.state_bytes(optimizer.opt_state) == want
    graph_state = nnx.state(optimizer)
    assert mj.state_bytes(graph_state["opt_state"]) == want
    whole = mj.state_bytes(graph_state)  # with the optimizer's uint32 step counter
    assert whole == {**want, "other": want["other"] + 4, "total": want["total"] + 4}
