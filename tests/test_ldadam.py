"""LDAdam as a host. No package of the reference implementation (IST-DASLab/LDAdam's
``LDAdamW``) is published, so the oracle is this file's PyTorch rendering of its step, built from
PyTorch's ``torch.linalg.svd`` and ``torch.linalg.qr``: the first step's SVD basis, then one
warm-started block power-iteration step a step, the moments transported into each new basis,
the generalized error feedback, and PyTorch ``AdamW``'s formula with the decay before the step.
The non-target parameters' path is checked against ``torch.optim.AdamW`` itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_reference, assert_stacked_equals_loop, find_state, host_run, torch_history
from test_galore_oracle import _grads, _jax_run

import moara_jax as mj

torch = pytest.importorskip("torch")

B1, B2, EPS, RHO = 0.908, 0.99, 1e-8, 0.908  # LDAdamW's defaults


def _schedule(t):
    return 0.01 * jnp.minimum(1.0, (t + 1) / 3)


def _ldadam_reference(g_seq, rank, wd=0.0, error_feedback=True, eps=EPS, w0=None):
    """Weights (PyTorch orientation, from ``w0`` or zero) after each LDAdam step on one matrix."""
    m, n = g_seq[0].shape
    left = m <= n  # 'std': compress the smaller side; a square matrix its rows (fan_out)
    proj = (lambda q, x: q.T @ x) if left else (lambda q, x: x @ q.T)
    back = (lambda q, y: q @ y) if left else (lambda q, y: y @ q)
    w = torch.zeros((m, n)) if w0 is None else torch.from_numpy(w0.copy())
    err = torch.zeros((m, n))
    q_prev = mom = var = None
    out = []
    for i, g_np in enumerate(g_seq):
        t = i + 1
        g = torch.from_numpy(g_np) + (err if error_feedback else 0.0)
        if t == 1:
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            q = u[:, :rank] if left else vh[:rank]
            q_prev = torch.zeros_like(q)
            mom = torch.zeros(proj(q, g).shape)
            var = torch.zeros_like(mom)
        else:
            a = RHO * back(q_prev, mom) / (1 - B1 ** (t - 1)) + (1 - RHO) * g
            q = torch.linalg.qr(a @ (a.T @ q_prev))[0] if left else torch.linalg.qr(a.T @ (a @ q_prev.T))[0].T
        low = proj(q, g)
        c = q.T @ q_prev if left else q_prev @ q.T
        moved = c @ mom if left else mom @ c
        if error_feedback:
            k = B1 / (1 - B1)
            err = g - back(q, low) + k * (back(q_prev, mom) - back(q, moved))
        if t > 1:
            c1, c2 = 1 - B1 ** (t - 1), 1 - B2 ** (t - 1)
            centred = var / c2 - mom**2 / c1**2
            rotated = (c * c) @ centred if left else centred @ (c * c)
            var = c2 * torch.abs(rotated + moved**2 / c1**2)
        mom = B1 * moved + (1 - B1) * low
        var = B2 * var + (1 - B2) * low**2
        d = (mom / (1 - B1**t)) / (torch.sqrt(var / (1 - B2**t)) + eps)
        lr = float(_schedule(i))
        w = w * (1 - lr * wd) - lr * back(q, d)
        q_prev = q
        out.append(w.numpy().astype(np.float64))
    return out


def _ldadam_tx(rank, wd=0.0, eps=EPS, **host):
    return mj.moara_adamw(
        _schedule,
        r_base=rank,
        decompose=False,
        rank_allocation=False,
        scale=1.0,  # the reference has no scale
        b1=B1,
        b2=B2,
        eps=eps,
        weight_decay=wd,
        host=mj.LDAdam(**host),
        label_fn=lambda path: "other" if path[-1].key == "norm" else "q",
    )


@pytest.mark.parametrize("torch_shape", [(40, 40), (96, 40), (40, 96)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("wd", [0.0, 0.5])
def test_ldadam_host_matches_the_pytorch_rendering(torch_shape, wd):
    """From random weights, with ``eps`` near ``sqrt(v)`` (so where it enters Adam shows) and a
    weight decay large enough that decaying before the step or after it differs."""
    rng = np.random.default_rng(0)
    seq = [0.01 * g["w"] for g in _grads(rng, {"w": torch_shape}, 8)]
    w0 = rng.standard_normal(torch_shape).astype(np.float32)
    ref = _ldadam_reference(seq, 8, wd, eps=1e-3, w0=w0)
    params = {"w": jnp.asarray(w0.T)}
    got, state = _jax_run(_ldadam_tx(8, wd, eps=1e-3), params, [{"w": jnp.asarray(g.T)} for g in seq])
    for t in range(len(seq)):  # the change from w0 (the weights themselves would hide it)
        assert_matches_reference(np.asarray(got[t]["w"]).T - w0, ref[t] - w0, f"step {t}")
    error = find_state(state, mj.LDAdamState).error["w"]
    assert float(jnp.linalg.norm(error)) > 1e-3  # error feedback is carried


def test_ldadam_without_error_feedback_matches_and_keeps_no_buffer():
    seq = [g["w"] for g in _grads(np.random.default_rng(1), {"w": (48, 64)}, 6)]
    ref = _ldadam_reference(seq, 6, error_feedback=False)
    tx = _ldadam_tx(6, error_feedback=False)
    got, state = _jax_run(tx, {"w": jnp.zeros((64, 48))}, [{"w": jnp.asarray(g.T)} for g in seq])
    for t in range(len(seq)):
        assert_matches_reference(np.asarray(got[t]["w"]).T, ref[t], f"step {t}")
    assert mj.state_bytes(state)["error_feedback"] == 0


def test_ldadam_non_targets_are_torch_adamw():
    """The full-rank path is ``torch.optim.AdamW`` (decay before the step, eps outside the root)."""
    rng = np.random.default_rng(2)
    seq = [{"norm": 0.01 * rng.standard_normal(16).astype(np.float32)} for _ in range(6)]
    init = rng.standard_normal(16).astype(np.float32)
    w = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = torch.optim.AdamW([w], lr=0.01, betas=(B1, B2), eps=1e-3, weight_decay=0.5)
    ref = torch_history(opt, {"norm": w}, seq)
    tx = mj.moara_adamw(
        0.01, r_base=4, decompose=False, rank_allocation=False, b1=B1, b2=B2, eps=1e-3,
        weight_decay=0.5, host="ldadam",
    )  # fmt: skip
    got, _ = _jax_run(tx, {"norm": jnp.asarray(init)}, [{"norm": jnp.asarray(g["norm"])} for g in seq])
    for t in range(len(seq)):
        np.testing.assert_allclose(got[t]["norm"], ref[t]["norm"], rtol=2e-6, atol=1e-7)


def test_ldadam_update_does_not_depend_on_basis_signs():
    """Singular vectors and QR factors are defined up to sign; the moments' transport picks the
    signs up, so flipping them (canonical_signs) changes nothing in the update."""
    seq = _grads(np.random.default_rng(3), {"w": (40, 56)}, 5)
    runs = []
    for canonical in (False, True):
        tx = mj.stage_chain(mj.ldadam(6, canonical_signs=canonical), mj.recompose(1.0))
        runs.append(_jax_run(tx, {"w": jnp.zeros((40, 56))}, [{"w": jnp.asarray(g["w"])} for g in seq])[0])
    # The smaller side is projected; a square one on its fan_out side (GaLore: fan_in).
    assert mj.ldadam_side((40, 56)) == "in" and mj.ldadam_side((56, 40)) == "out"
    assert mj.ldadam_side((40, 40)) == "out" and mj.projection_side((40, 40)) == "in"
    for a, b in zip(*runs, strict=True):
        np.testing.assert_allclose(a["w"], b["w"], rtol=1e-4, atol=1e-6)


def test_ldadam_full_rank_drops_nothing():
    """With the rank at the projected side's size the projection is a rotation: the error
    feedback stays at round-off."""
    seq = _grads(np.random.default_rng(4), {"w": (24, 32)}, 4)
    tx = mj.ldadam(24)
    state = tx.init({"w": jnp.zeros((24, 32))})
    for g in seq:
        _, state = tx.update({"w": jnp.asarray(g["w"])}, state)
        assert float(jnp.abs(state.error["w"]).max()) < 1e-4


def test_stacked_ldadam_leaf_equals_loop_over_matrices():
    rng = np.random.default_rng(5)
    grads = [
        (rng.standard_normal((3, 24, 40)) * np.array([1.0, 15.0, 0.1])[:, None, None]).astype(np.float32)
        for _ in range(5)
    ]
    chain = mj.stage_chain(mj.ldadam(5), mj.recompose(1.0))
    assert_stacked_equals_loop(chain, grads, rtol=1e-4, atol=1e-6)


def test_ldadam_zero_gradients_stay_finite():
    tx = mj.moara_adamw(0.01, r_base=4, block_size=8, host="ldadam", rank_allocation=False)
    params = {"q_proj": {"kernel": jnp.zeros((16, 16))}, "up_proj": {"kernel": jnp.zeros((16, 32))}}
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((updates, state)))


def test_ldadam_settings_and_accounting():
    with pytest.raises(ValueError, match="rho"):
        mj.LDAdam(rho=1.0)
    with pytest.raises(ValueError, match="error_feedback"):
        mj.LDAdam(error_feedback=1)
    with pytest.raises(ValueError, match="proj_type"):
        mj.scale_by_galore(4, host="ldadam", proj_type="reverse_std")
    params = {
        "q_proj": {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)},
        "up_proj": {"kernel": jax.ShapeDtypeStruct((64, 160), jnp.bfloat16)},
    }
    tx = mj.moara_adamw(0.01, r_base=16, block_size=32, rank_allocation=False, host="ldadam")
    got = mj.state_bytes(jax.eval_shape(tx.init, params))
    # bf16 error buffers of the matrices' shapes; bases (d, r); moments of (r, fan_out) for the
    # square q (fan_out side projected: (64, 16)) and (r, 160) for up
    assert got["error_feedback"] == (64 * 64 + 64 * 160) * 2
    assert got["projection_bases"] == (64 * 16 + 64 * 16) * 2
    assert got["direction_moments"] == 2 * (64 * 16 + 16 * 160) * 2
    assert got["magnitude_moments"] == 2 * (2 * 64 + 2 * 160) * 4
    parts = ("moments", "projection_bases", "basis_moments", "error_feedback", "other")
    assert got["total"] == sum(got[k] for k in parts)


def test_moara_on_ldadam_is_finite_and_its_basis_moves():
    nodes = host_run("ldadam", mj.LDAdamState, seed=6, weight_decay=0.1)
    bases = [np.asarray(n.basis["q_proj"]["kernel"]) for n in nodes]
    assert not np.allclose(bases[1], bases[2]) and not np.allclose(bases[2], bases[3])
    assert nodes[-1].mag_mu["q_proj"]["kernel"].shape == (4, 32)
