"""``scale_by_galore`` / ``moara_adamw(decompose=False, rank_allocation=False)`` against the real
``galore_torch.GaLoreAdamW``, and how ``optax.contrib.galore`` differs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_matches_reference, matrices, torch_history

import moara_jax as mj

torch = pytest.importorskip("torch")
galore_torch = pytest.importorskip("galore_torch")

LR = 0.01


def _torch_run(shapes_groups, grads_seq, rank, gap, scale, weight_decay=0.0, undecayed=()):
    """Runs GaLoreAdamW on PyTorch-orientation weights (those named in ``undecayed``, plain ones,
    in a group of weight decay 0); returns the weights after each step."""
    weights, groups = {}, []
    for name, (shape, _) in shapes_groups.items():
        weights[name] = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64).float())
    targets = [weights[n] for n, (_, g) in shapes_groups.items() if g]
    others = [weights[n] for n, (_, g) in shapes_groups.items() if not g and n not in undecayed]
    if others:
        groups.append({"params": others})
    if undecayed:
        groups.append({"params": [weights[n] for n in undecayed], "weight_decay": 0.0})
    if targets:
        groups.append(
            {
                "params": targets,
                "rank": rank,
                "update_proj_gap": gap,
                "scale": scale,
                "proj_type": "std",
            }
        )
    opt = galore_torch.GaLoreAdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=weight_decay)
    return torch_history(opt, weights, grads_seq)


def _jax_run(tx, params, grads_seq):
    state = tx.init(params)
    update = jax.jit(tx.update)
    history = []
    for grads in grads_seq:
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return history, state


def _grads(rng, shapes, steps, drift=0.3):
    """Gradient sequences with a stable low-rank part (so subspaces are well separated)."""
    base = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    seq = []
    for _ in range(steps):
        seq.append(
            {n: (b + drift * rng.standard_normal(b.shape)).astype(np.float32) for n, b in base.items()}
        )
    return seq


def _sign_fix(monkeypatch):
    """Identical SVD sign conventions on both sides.

    Singular vectors are defined up to sign; LAPACK builds in torch and jaxlib may pick different
    signs, which changes GaLore's result only through moments carried across a refresh. Both sides
    get the same convention (largest-|entry| of each vector positive), so the comparison tests the
    algorithm, not the LAPACK build. The rest of galore-torch runs unchanged.
    """
    orig = galore_torch.galore_projector.GaLoreProjector.get_orthogonal_matrix

    def fixed(self, weights, rank, type):
        out = orig(self, weights, rank, type)
        if type == "right":  # rows are the vectors
            idx = out.abs().argmax(dim=1)
            s = torch.sign(out[torch.arange(out.shape[0]), idx])
            return out * s[:, None]
        idx = out.abs().argmax(dim=0)
        s = torch.sign(out[idx, torch.arange(out.shape[1])])
        return out * s[None, :]

    monkeypatch.setattr(galore_torch.galore_projector.GaLoreProjector, "get_orthogonal_matrix", fixed)


@pytest.mark.parametrize("torch_shape", [(48, 48), (96, 40), (40, 96)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("canonical", [False, True], ids=["raw_svd", "canonical_signs"])
def test_scale_by_galore_matches_galore_torch(torch_shape, canonical, monkeypatch):
    rank, gap, scale, steps = 8, 3, 0.25, 8  # refreshes at steps 0, 3, 6
    rng = np.random.default_rng(0)
    seq = _grads(rng, {"w": torch_shape}, steps)
    if canonical:
        _sign_fix(monkeypatch)
    ref = _torch_run({"w": (torch_shape, True)}, seq, rank, gap, scale)
    tx = optax.chain(
        mj.scale_by_galore(rank, update_proj_gap=gap, scale=scale, canonical_signs=canonical),
        optax.scale(-LR),
    )
    flax_params = {"w": jnp.zeros(torch_shape[::-1], jnp.float32)}
    flax_seq = [{"w": jnp.asarray(g["w"].T)} for g in seq]
    got, _ = _jax_run(tx, flax_params, flax_seq)
    for t in range(steps):
        assert_matches_reference(np.asarray(got[t]["w"]).T, ref[t]["w"], f"step {t}")


def test_refresh_basis_is_svd_basis_at_refresh_steps_only():
    rank, gap = 4, 5
    rng = np.random.default_rng(1)
    seq = _grads(rng, {"w": (24, 40)}, 11, drift=1.0)  # Flax (fan_in=24, fan_out=40)
    tx = mj.scale_by_galore(rank, update_proj_gap=gap)
    params = {"w": jnp.zeros((24, 40))}
    state = tx.init(params)
    update = jax.jit(tx.update)
    previous = None
    for t, g in enumerate(seq):
        _, state = update({"w": jnp.asarray(g["w"])}, state, params)
        basis = np.asarray(state[0].basis["w"])  # fan_in side (24 <= 40): (24, rank)
        if t % gap == 0:
            u = np.linalg.svd(g["w"].astype(np.float64), full_matrices=False)[0][:, :rank]
            # Equal up to the sign of each vector.
            np.testing.assert_allclose(np.abs(np.sum(u * basis, axis=0)), 1.0, atol=1e-5)
        else:
            np.testing.assert_array_equal(basis, previous)
        previous = basis


LLAMA_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def _llama_torch_shapes(d=32, f=88, layers=2, vocab=50):
    """A small Llama 2 tree in PyTorch naming/orientation: name -> (shape, is_galore_target)."""
    shapes = {
        "model.embed_tokens.weight": ((vocab, d), False),
        "model.norm.weight": ((d,), False),
        "lm_head.weight": ((vocab, d), False),
    }
    for i in range(layers):
        for mod, group in LLAMA_MODULES.items():
            fi, fo = {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}.get(mod, (d, d))
            shapes[f"model.layers.{i}.{group}.{mod}.weight"] = ((fo, fi), True)
        shapes[f"model.layers.{i}.input_layernorm.weight"] = ((d,), False)
    return shapes


def _to_flax(values):
    """PyTorch-named arrays -> a nested Flax-layout dict (linear weights transposed)."""
    out = {}
    for name, arr in values.items():
        keys = name.split(".")[:-1]
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        is_linear = keys[-1].endswith("_proj") or keys[-1] == "lm_head"
        leaf = "kernel" if is_linear else ("embedding" if keys[-1] == "embed_tokens" else "scale")
        node[keys[-1]] = {leaf: jnp.asarray(arr.T if is_linear else arr)}
    return out


@pytest.mark.parametrize("weight_decay", [0.0, 0.5], ids=["no_decay", "decay"])
def test_moara_adamw_vanilla_equals_galore_adamw_on_llama_tree(weight_decay, monkeypatch):
    """The paper's two parameter groups: attention/MLP matrices with rank, the rest plain; weight
    decay applied, as galore-torch does, to the parameters after the Adam step."""
    _sign_fix(monkeypatch)
    rng = np.random.default_rng(2)
    torch_shapes = _llama_torch_shapes()
    steps, rank, gap = 5, 8, 2
    seq = _grads(rng, {n: s for n, (s, _) in torch_shapes.items()}, steps)
    ref = _torch_run(torch_shapes, seq, rank, gap, 0.25, weight_decay)
    assert_llama_tree_run_matches(vanilla_galore(rank, gap, weight_decay), torch_shapes, seq, ref)


@pytest.mark.parametrize("form", ["tree", "function"])
def test_weight_decay_mask_equals_galore_adamw_with_undecayed_norms(form, monkeypatch):
    """The usual pretraining groups: the norms (1-D) in a group of weight decay 0, every other
    parameter decayed; ``weight_decay_mask`` marking the matrices gives GaLoreAdamW's weights
    over steps that cross basis refreshes."""
    _sign_fix(monkeypatch)
    rng = np.random.default_rng(4)
    torch_shapes = _llama_torch_shapes()
    norms = [n for n, (s, _) in torch_shapes.items() if len(s) == 1]
    steps, rank, gap, weight_decay = 5, 8, 2, 0.5  # refreshes at steps 0, 2, 4
    seq = _grads(rng, {n: s for n, (s, _) in torch_shapes.items()}, steps)
    ref = _torch_run(torch_shapes, seq, rank, gap, 0.25, weight_decay, undecayed=norms)
    shapes = _to_flax({n: np.zeros(s, np.float32) for n, (s, _) in torch_shapes.items()})
    mask = matrices if form == "function" else matrices(shapes)
    tx = vanilla_galore(rank, gap, weight_decay, weight_decay_mask=mask)
    assert_llama_tree_run_matches(tx, torch_shapes, seq, ref)


def vanilla_galore(rank: int, gap: int, weight_decay: float, **options) -> optax.GradientTransformation:
    """``moara_adamw`` as vanilla GaLore (no decomposition, uniform ranks), signs made canonical as
    ``_sign_fix`` makes the reference's."""
    return mj.moara_adamw(
        LR,
        r_base=rank,
        decompose=False,
        rank_allocation=False,
        update_proj_gap=gap,
        canonical_signs=True,
        weight_decay=weight_decay,
        **options,
    )


def assert_llama_tree_run_matches(tx, torch_shapes, seq, ref):
    """``tx`` from zero Flax parameters over the PyTorch-named gradients ``seq`` gives the
    reference's weights ``ref`` (PyTorch-named, per step)."""
    params = _to_flax({n: np.zeros(s, np.float32) for n, (s, _) in torch_shapes.items()})
    got, _ = _jax_run(tx, params, [_to_flax(g) for g in seq])
    for t in range(len(seq)):
        want = _to_flax(ref[t])
        assert jax.tree.structure(got[t]) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got[t]), jax.tree.leaves(want), strict=True):
            assert_matches_reference(a, b, f"step {t}")


def test_differs_from_optax_contrib_galore_as_documented():
    """optax.contrib.galore keeps the *smaller* state (it projects the larger side of the Flax
    kernel: (fan_in, fan_out) with fan_in >= fan_out gets a (fan_in, r) projector), uses optax's
    Adam (eps added to sqrt(v_hat)) and scale 1.0 by default. With a square matrix, matched scale
    and eps -> 0 the two agree; on a tall kernel the state shapes differ."""
    rng = np.random.default_rng(3)
    g = [jnp.asarray(rng.standard_normal((32, 32)), jnp.float32) for _ in range(3)]
    params = {"w": jnp.zeros((32, 32))}
    ours = optax.chain(mj.scale_by_galore(8, scale=1.0, eps=0.0, canonical_signs=True), optax.scale(-LR))
    theirs = optax.contrib.galore(LR, rank=8, scale=1.0, base_optimizer=optax.scale_by_adam(eps=0.0))
    s1, s2 = ours.init(params), theirs.init(params)
    p1 = p2 = params
    for gi in g:
        u1, s1 = ours.update({"w": gi}, s1, p1)
        u2, s2 = theirs.update({"w": gi}, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    # Up to basis signs, the same algorithm on a square matrix (both project fan_in).
    np.testing.assert_allclose(p1["w"], p2["w"], rtol=1e-4, atol=1e-6)

    tall = {"w": jnp.zeros((64, 16))}  # Flax (fan_in=64, fan_out=16): torch (16, 64), wide
    ours_state = mj.scale_by_galore(8).init(tall)
    theirs_state = optax.contrib.galore(LR, rank=8).init(tall)
    our_basis = ours_state[0].basis["w"].shape
    their_shapes = {tuple(x.shape) for x in jax.tree.leaves(theirs_state) if x.ndim == 2}
    assert our_basis == (16, 8)  # galore-torch: project the smaller side (fan_out=16)
    assert (64, 8) in their_shapes  # optax: project the larger side (fan_in=64)
