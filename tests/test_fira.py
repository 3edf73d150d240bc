"""Fira as a host: ``scale_by_fira`` and ``moara_adamw(host='fira', ...)`` against the reference
package ``fira.FiraAdamW``, MoARa on Fira (decomposition, allocation) against the float64 NumPy
reference of tests/helpers.py, and the host's errors and accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ReferenceMoara, assert_matches_reference, assert_stacked_equals_loop, torch_history
from test_galore_oracle import _jax_run, _llama_torch_shapes, _to_flax, assert_llama_tree_run_matches

import moara_jax as mj

torch = pytest.importorskip("torch")
fira = pytest.importorskip("fira")

LR = 0.01
# Gradient scale per step: the jumps make the residual's norm grow by more than Fira's 1.01 a
# step, so the norm-growth limiter acts (test_the_oracle_runs_exercise_the_limiter).
SCALES = (1.0, 1.0, 3.0, 0.5, 4.0, 1.0, 6.0, 1.0)


def _grads(rng, shapes, steps, drift=0.3):
    """Gradients with a stable low-rank part (well separated subspaces) and jumps in scale."""
    base = {n: rng.standard_normal(s) for n, s in shapes.items()}
    return [
        {
            n: (SCALES[t % len(SCALES)] * (b + drift * rng.standard_normal(b.shape))).astype(np.float32)
            for n, b in base.items()
        }
        for t in range(steps)
    ]


def _canonical_fira_signs(monkeypatch):
    """Fira's projector with each basis vector's largest |entry| made positive, as
    ``canonical_signs=True`` does (the same device-independent convention on both sides)."""
    orig = fira.gradient_projection.GradientProjector.get_orthogonal_matrix

    def fixed(self, weights, rank, type):
        out = orig(self, weights, rank, type)
        axis = 1 if type == "right" else 0  # 'right': rows are the vectors
        idx = out.abs().argmax(dim=axis, keepdim=True)
        sign = torch.sign(torch.gather(out, axis, idx))
        return out * torch.where(sign == 0, torch.ones_like(sign), sign)

    monkeypatch.setattr(fira.gradient_projection.GradientProjector, "get_orthogonal_matrix", fixed)


def _fira_run(shapes_groups, grads_seq, rank, gap, alpha, weight_decay=0.0):
    """fira.FiraAdamW on PyTorch-orientation weights (name -> (shape, is_target)); the weights
    after each step."""
    weights = {
        n: torch.nn.Parameter(torch.zeros(s, dtype=torch.float32)) for n, (s, _) in shapes_groups.items()
    }
    targets = [weights[n] for n, (_, t) in shapes_groups.items() if t]
    others = [weights[n] for n, (_, t) in shapes_groups.items() if not t]
    groups = [{"params": others}] if others else []
    groups.append(
        {"params": targets, "rank": rank, "update_proj_gap": gap, "alpha": alpha, "proj_type": "std"}
    )
    opt = fira.FiraAdamW(
        groups, lr=LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=weight_decay, no_deprecation_warning=True
    )
    return torch_history(opt, weights, grads_seq)


def _run_single(tx, torch_shape, seq):
    params = {"w": jnp.zeros(torch_shape[::-1], jnp.float32)}
    got, _ = _jax_run(tx, params, [{"w": jnp.asarray(g["w"].T)} for g in seq])
    return [np.asarray(p["w"]).T for p in got]


@pytest.mark.parametrize("torch_shape", [(48, 48), (96, 40), (40, 96)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("canonical", [False, True], ids=["raw_svd", "canonical_signs"])
def test_scale_by_fira_matches_fira_adamw(torch_shape, canonical, monkeypatch):
    rank, gap, alpha, steps = 8, 3, 0.25, 8  # refreshes at steps 0, 3, 6
    seq = _grads(np.random.default_rng(0), {"w": torch_shape}, steps)
    if canonical:
        _canonical_fira_signs(monkeypatch)
    ref = _fira_run({"w": (torch_shape, True)}, seq, rank, gap, alpha)
    tx = optax.chain(
        mj.scale_by_fira(rank, update_proj_gap=gap, scale=alpha, canonical_signs=canonical),
        optax.scale(-LR),
    )
    got = _run_single(tx, torch_shape, seq)
    for t in range(steps):
        assert_matches_reference(got[t], ref[t]["w"], f"step {t}")


def test_the_oracle_runs_exercise_the_limiter(monkeypatch):
    """Without the norm-growth limiter (a limit no ratio reaches) the same run leaves the
    reference: the oracle comparison above checks the limiter, not only the scaling."""
    torch_shape, rank, gap, steps = (96, 40), 8, 3, 8
    seq = _grads(np.random.default_rng(0), {"w": torch_shape}, steps)
    _canonical_fira_signs(monkeypatch)
    ref = _fira_run({"w": (torch_shape, True)}, seq, rank, gap, 0.25)
    unlimited = optax.chain(
        mj.scale_by_fira(rank, update_proj_gap=gap, canonical_signs=True, growth_limit=1e30), optax.scale(-LR)
    )
    got = _run_single(unlimited, torch_shape, seq)
    assert_matches_reference(got[0], ref[0]["w"])  # the first step sets the norm, limits nothing
    errors = [np.linalg.norm(got[t] - ref[t]["w"]) / np.linalg.norm(ref[t]["w"]) for t in range(steps)]
    assert max(errors) > 0.05, errors


@pytest.mark.parametrize("weight_decay", [0.0, 0.5], ids=["no_decay", "decay"])
def test_moara_adamw_fira_vanilla_equals_fira_adamw_on_llama_tree(weight_decay, monkeypatch):
    """The paper's two parameter groups (attention/MLP matrices with Fira, the rest AdamW)."""
    _canonical_fira_signs(monkeypatch)
    torch_shapes = _llama_torch_shapes()
    steps, rank, gap = 5, 8, 2
    seq = _grads(np.random.default_rng(2), {n: s for n, (s, _) in torch_shapes.items()}, steps)
    ref = _fira_run(torch_shapes, seq, rank, gap, 0.25, weight_decay)
    tx = mj.moara_adamw(
        LR,
        r_base=rank,
        host="fira",
        decompose=False,
        rank_allocation=False,
        update_proj_gap=gap,
        canonical_signs=True,
        weight_decay=weight_decay,
    )
    assert_llama_tree_run_matches(tx, torch_shapes, seq, ref)


@pytest.mark.parametrize(
    "torch_shape,block",
    [((40, 40), 8), ((64, 24), 5), ((24, 64), 16)],
    ids=["square-B|n", "tall-B∤n", "wide"],
)
def test_moara_on_fira_matches_reference_algorithm(torch_shape, block):
    """Decomposition on the Fira host: Fira on the block direction, then the magnitudes' step."""
    rank, gap, steps = 6, 3, 7
    seq = _grads(np.random.default_rng(4), {"w": torch_shape}, steps)
    ref = ReferenceMoara(torch_shape, rank, block, gap=gap, lr=LR, fira=True)
    tx = optax.chain(
        mj.scale_by_moara(rank, block, update_proj_gap=gap, canonical_signs=True, host="fira"),
        optax.scale(-LR),
    )
    params = {"w": jnp.zeros(torch_shape[::-1], jnp.float32)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t, g in enumerate(seq):
        u, state = update({"w": jnp.asarray(g["w"].T)}, state, params)
        assert_matches_reference(np.asarray(u["w"]).T, ref.step(g["w"]), f"step {t}")


@pytest.mark.slow
def test_stacked_fira_leaf_equals_loop_over_matrices():
    """Scaling factors and the limiter are per matrix: a (L, fan_in, fan_out) leaf is L matrices."""
    rng = np.random.default_rng(5)
    L, shape = 3, (24, 40)
    grads = [SCALES[t] * rng.standard_normal((L,) + shape).astype(np.float32) for t in range(5)]
    grads = [g * np.array([1.0, 5.0, 0.2])[:, None, None] for g in grads]  # a different norm per layer
    assert_stacked_equals_loop(mj.scale_by_fira(5, update_proj_gap=2), grads)


def test_fira_rank_allocation_gives_the_allocated_ranks():
    params = _to_flax({n: np.zeros(s, np.float32) for n, (s, _) in _llama_torch_shapes(d=32, f=96).items()})
    tx = mj.moara_adamw(LR, r_base=8, host="fira", decompose=False)
    state = tx.init(params)
    (proj,) = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, mj.ProjectState))
        if isinstance(s, mj.ProjectState)
    ]
    layer = proj.basis["model"]["layers"]["0"]
    assert layer["self_attn"]["q_proj"]["kernel"].shape[-1] == 4  # donor: r/2
    assert layer["mlp"]["down_proj"]["kernel"].shape[-1] == 16  # receiver: 2r
    assert layer["mlp"]["up_proj"]["kernel"].shape[-1] == 8


def test_fira_state_accounting_adds_only_the_residual_norms():
    """Fira keeps GaLore's moments and bases; its extra state is one float32 norm per matrix."""
    params = {
        "layers": {"q_proj": {"kernel": jax.ShapeDtypeStruct((4, 64, 64), jnp.bfloat16)}},
        "mlp": {"down_proj": {"kernel": jax.ShapeDtypeStruct((160, 64), jnp.bfloat16)}},
    }
    kw = dict(r_base=16, block_size=32)
    for decompose in (False, True):
        galore = mj.state_bytes(jax.eval_shape(mj.moara_adamw(LR, decompose=decompose, **kw).init, params))
        fira_state = jax.eval_shape(mj.moara_adamw(LR, decompose=decompose, host="fira", **kw).init, params)
        got = mj.state_bytes(fira_state)
        for key in ("direction_moments", "magnitude_moments", "projection_bases", "adam_moments"):
            assert got[key] == galore[key], key
        assert got["other"] - galore["other"] == (4 + 1) * 4  # 5 matrices, one float32 each


def test_zero_gradients_give_finite_zero_updates():
    params = {"q_proj": {"kernel": jnp.ones((16, 16))}, "down_proj": {"kernel": jnp.ones((40, 16))}}
    for decompose in (False, True):
        tx = mj.moara_adamw(LR, r_base=4, block_size=8, decompose=decompose, host="fira")
        state = tx.init(params)
        zeros = jax.tree.map(jnp.zeros_like, params)
        for _ in range(3):
            updates, state = jax.jit(tx.update)(zeros, state, params)
            for u in jax.tree.leaves(updates):
                np.testing.assert_array_equal(np.asarray(u), 0.0)


def test_host_errors_name_the_argument():
    with pytest.raises(ValueError, match="host"):
        mj.moara_adamw(LR, r_base=4, block_size=8, host="apollo")
    with pytest.raises(ValueError, match="host"):
        mj.scale_by_moara(4, 8, host="fira-ish")
    with pytest.raises(ValueError, match="growth_limit"):
        mj.fira_adam(growth_limit=0.0)
    with pytest.raises(ValueError, match="growth_limit"):
        mj.moara_adamw(LR, r_base=4, block_size=8, host=mj.Fira(growth_limit=-1.0))
    without_source = mj.stage_chain(mj.project(4), mj.fira_adam(), mj.recompose())
    with pytest.raises(ValueError, match=r"keep_projected=True\)$"):
        without_source.init({"w": jnp.zeros((16, 16))})
