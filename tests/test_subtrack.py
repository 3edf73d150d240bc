"""SubTrack++ as a host. No package of the reference implementation (criticalml-uw/SubTrack's
``LowRankAdamW``) is published, so the oracle is this file's PyTorch rendering of what that code
computes, built from ``torch.linalg.svd`` and ``torch.linalg.lstsq``, literal where the code is
peculiar: the fan_in-side tangent multiplied by ``I_r - Q Q^T``, the moments transported from
the initial basis one step before each basis step, with the ``(1 - b2)`` factor, and the
recovery residual ``G - scale P P^T G``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_reference, assert_stacked_equals_loop, find_state, host_run
from test_galore_oracle import _grads, _jax_run

import moara_jax as mj

torch = pytest.importorskip("torch")

B1, B2, EPS, SCALE, K, ETA, GAMMA = 0.9, 0.999, 1e-6, 0.25, 3, 10.0, 1.01


def _schedule(t):
    return 0.01 * jnp.minimum(1.0, (t + 1) / 3)


def _geodesic(q, tangent, eta):
    u, s, vh = torch.linalg.svd(tangent, full_matrices=False)
    u1, s1, v1 = u[:, :1], s[0], vh[:1].T
    eye = torch.eye(v1.shape[0])
    return (q @ v1 * torch.cos(eta * s1) - u1 * torch.sin(eta * s1)) @ v1.T + q @ (eye - v1 @ v1.T)


def _subtrack_reference(g_seq, rank, wd=0.0, track_all=False):
    """Weights (PyTorch orientation, from zero) after each step on one matrix."""
    m, n = g_seq[0].shape
    right = m >= n
    proj = (lambda g, q: g @ q.T) if right else (lambda g, q: q.T @ g)
    back = (lambda x, q: SCALE * (x @ q)) if right else (lambda x, q: SCALE * (q @ x))
    w = torch.zeros((m, n))
    q = q0 = mom = var = prev = None
    out = []
    for s, g_np in enumerate(g_seq):
        g = torch.from_numpy(g_np)
        if s == 0:
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            q = vh[:rank] if right else u[:, :rank]
            q0 = q.clone()
        elif s % K == 0:
            if right and not track_all:  # the reference's tangent: (I_r - Q Q^T) of a row basis
                coef = torch.linalg.lstsq(q.T, g.T).solution.T
                tangent = (torch.eye(rank) - q @ q.T) @ (-2.0 * coef.T @ (g - coef @ q))
                q = _geodesic(q, tangent, ETA)
            elif right:  # the same geodesic on the row space (the column math on G^T)
                coef = torch.linalg.lstsq(q.T, g.T).solution
                tangent = (torch.eye(n) - q.T @ q) @ (-2.0 * (g.T - q.T @ coef) @ coef.T)
                q = _geodesic(q.T, tangent, ETA).T
            else:
                coef = torch.linalg.lstsq(q, g).solution
                tangent = (torch.eye(m) - q @ q.T) @ (-2.0 * (g - q @ coef) @ coef.T)
                q = _geodesic(q, tangent, ETA)
        low = proj(g, q)
        if mom is None:
            mom, var = torch.zeros_like(low), torch.zeros_like(low)
        t = s + 1
        mom = B1 * mom + (1 - B1) * low
        var = B2 * var + (1 - B2) * low**2
        upd = mom / (torch.sqrt(var) + EPS)
        lr = float(_schedule(s))
        step = lr * np.sqrt(1 - B2**t) / (1 - B1**t)
        if t % K == 0:
            c = q0 @ q.T if right else q.T @ q0
            moved = mom @ c if right else c @ mom
            rotated = (var - mom**2) @ (c * c) if right else (c * c) @ (var - mom**2)
            var = torch.abs((1 - B2) * (rotated + moved**2))
            mom = moved
        resid = g - back(low, q)
        axis = 0 if upd.shape[0] < upd.shape[1] else 1
        phi = torch.linalg.norm(upd, dim=axis) / (torch.linalg.norm(low, dim=axis) + 1e-8)
        extra = resid * (phi[:, None] if axis == 1 else phi[None, :])
        norm = torch.linalg.norm(extra)
        if prev is None:
            prev = norm
        else:
            limit = torch.clamp(norm / (prev + 1e-8), min=GAMMA) / GAMMA
            extra, prev = extra / limit, norm / limit
        w = w - step * (back(upd, q) + extra)
        w = w - lr * wd * w
        out.append(w.numpy().astype(np.float64))
    return out


def _seq(seed, shape, steps):
    """Gradients of a realistic size (entries ~1e-2): the geodesic's angle ``eta * sigma`` grows
    with ``||G||^2``, and at unit-size gradients with ``eta = 10`` it is thousands of radians, where
    float32 round-off alone changes the basis."""
    return [0.01 * g["w"] for g in _grads(np.random.default_rng(seed), {"w": shape}, steps)]


def _subtrack_tx(rank, wd=0.0, **host):
    return mj.moara_adamw(
        _schedule,
        r_base=rank,
        decompose=False,
        rank_allocation=False,
        update_proj_gap=K,
        scale=SCALE,
        weight_decay=wd,
        host=mj.SubTrackPP(**host),
        label_fn=lambda path: "q",
    )


@pytest.mark.parametrize("torch_shape", [(40, 40), (96, 40), (40, 96)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_subtrack_host_matches_the_pytorch_rendering(torch_shape, wd):
    seq = _seq(0, torch_shape, 10)
    ref = _subtrack_reference(seq, 8, wd)
    params = {"w": jnp.zeros(torch_shape[::-1])}
    got, state = _jax_run(_subtrack_tx(8, wd), params, [{"w": jnp.asarray(g.T)} for g in seq])
    for t in range(len(seq)):
        assert_matches_reference(np.asarray(got[t]["w"]).T, ref[t], f"step {t}")
    st = find_state(state, mj.SubTrackProjectState)
    moved = not np.allclose(st.basis["w"], st.initial_basis["w"])
    # Only the PyTorch-'left' (wide, fan_out-side) basis moves, as in the reference.
    assert moved == (torch_shape == (40, 96))


@pytest.mark.parametrize("torch_shape", [(96, 40), (40, 40)], ids=["tall", "square"])
def test_subtrack_track_all_moves_the_fan_in_bases_too(torch_shape):
    seq = _seq(1, torch_shape, 8)
    ref = _subtrack_reference(seq, 6, track_all=True)
    tx = _subtrack_tx(6, track_all=True)
    got, state = _jax_run(tx, {"w": jnp.zeros(torch_shape[::-1])}, [{"w": jnp.asarray(g.T)} for g in seq])
    for t in range(len(seq)):
        assert_matches_reference(np.asarray(got[t]["w"]).T, ref[t], f"step {t}")
    st = find_state(state, mj.SubTrackProjectState)
    assert not np.allclose(st.basis["w"], st.initial_basis["w"])


def test_geodesic_step_keeps_the_basis_orthonormal_and_lowers_the_estimation_error():
    rng = np.random.default_rng(2)
    target = np.linalg.qr(rng.standard_normal((48, 4)))[0]
    a = jnp.asarray(target @ rng.standard_normal((4, 30)) + 0.01 * rng.standard_normal((48, 30)), jnp.float32)
    p = jnp.asarray(np.linalg.qr(rng.standard_normal((48, 4)))[0], jnp.float32)

    def error(b):
        return float(jnp.sum(jnp.square(a - b @ (b.T @ a))))

    errors = [error(p)]
    for _ in range(20):
        p = mj.geodesic_step(p, a, 0.01)
        errors.append(error(p))
        np.testing.assert_allclose(p.T @ p, np.eye(4), atol=1e-5)
    assert errors[-1] < 0.1 * errors[0] and all(
        b <= a_ + 1e-4 for a_, b in zip(errors[:-1], errors[1:], strict=True)
    )


@pytest.mark.slow
def test_stacked_subtrack_leaf_equals_loop_over_matrices():
    rng = np.random.default_rng(3)
    grads = [
        (rng.standard_normal((3, 40, 24)) * np.array([1.0, 15.0, 0.1])[:, None, None]).astype(np.float32)
        for _ in range(7)
    ]
    chain = mj.scale_by_galore(5, update_proj_gap=2, host="subtrack_pp")
    assert_stacked_equals_loop(chain, grads, rtol=1e-4, atol=1e-6, resync=True)


def test_subtrack_settings_and_accounting():
    for bad in (dict(step_size=-1.0), dict(growth_limit=0.0), dict(track_all=1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            mj.SubTrackPP(**bad)
    with pytest.raises(ValueError, match="proj_type"):
        mj.scale_by_galore(4, host="subtrack_pp", proj_type="reverse_std")
    params = {"q_proj": {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)}}
    state = jax.eval_shape(
        mj.moara_adamw(0.01, r_base=16, decompose=False, rank_allocation=False, host="subtrack_pp").init,
        params,
    )
    got = mj.state_bytes(state)
    assert got["projection_bases"] == 2 * 64 * 16 * 2  # the basis and the initial basis
    assert got["direction_moments"] == 2 * 16 * 64 * 2


def test_moara_on_subtrack_is_finite_and_tracks_down_proj():
    """Full MoARa on SubTrack++: the tall down_proj's basis (its fan_out side, PyTorch 'left')
    follows the geodesic, the square q_proj's stays at the step-0 SVD, as in the reference."""
    st = host_run("subtrack_pp", mj.SubTrackProjectState, steps=5, seed=4, update_proj_gap=2)[-1]
    down = st.basis["down_proj"]["kernel"]
    assert not np.allclose(down, st.initial_basis["down_proj"]["kernel"])
    np.testing.assert_array_equal(st.basis["q_proj"]["kernel"], st.initial_basis["q_proj"]["kernel"])
    tx = mj.moara_adamw(
        0.01, r_base=4, block_size=8, update_proj_gap=2, host="subtrack_pp", rank_allocation=False
    )
    params = {"down_proj": {"kernel": jnp.zeros((32, 16))}}
    state = tx.init(params)
    for _ in range(5):  # zero gradients through tracking and transport steps: finite
        updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((updates, state)))
