"""OSD (Online Subspace Descent) as a host. No package of the reference implementation is
published, so the oracle is this file's PyTorch rendering of its default ``continuous``
projection, built from PyTorch's own parts: ``torch.linalg.svd`` for the step-0 basis, autograd
for the online-PCA loss, ``torch.optim.AdamW`` (its defaults) for the basis, galore-torch's Adam
for the low-rank step; the basis steps after each step's back-projection, at
``lr_t / (peak_lr * T)``. It checks the JAX transforms against PyTorch's numerics, not the
reading of the algorithm."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_matches_reference, assert_stacked_equals_loop, canonical, find_state, host_run
from test_galore_oracle import _jax_run

import moara_jax as mj

torch = pytest.importorskip("torch")

PEAK, T, SCALE = 0.01, 4, 0.25


def _schedule(t):
    return PEAK * jnp.minimum(1.0, (t + 1) / 3)  # warmup over three steps, then constant


def _osd_reference(g_seq, rank):
    """Weights (PyTorch orientation, from zero) after each step of OSD on one matrix."""
    m, n = g_seq[0].shape
    right = m >= n  # galore-torch's 'std': project the smaller side
    w = np.zeros((m, n), np.float64)
    p = opt = None
    mu = nu = None
    out = []
    for t, g_np in enumerate(g_seq):
        g = torch.from_numpy(g_np.astype(np.float32))
        if t == 0:
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            basis = vh[:rank].numpy() if right else u[:, :rank].numpy()
            basis = canonical(basis, axis=1 if right else 0).astype(np.float32)
            p = torch.nn.Parameter(torch.from_numpy(basis))
            opt = torch.optim.AdamW([p], lr=1.0 / T)
        else:
            gn = g / torch.linalg.norm(g)
            proj = p.t() @ p if right else p @ p.t()
            loss = torch.sum((gn @ proj - gn) ** 2) if right else torch.sum((proj @ gn - gn) ** 2)
            p.grad = torch.autograd.grad(loss, p)[0]
            for group in opt.param_groups:
                group["lr"] = float(_schedule(t)) / (PEAK * T)
        with torch.no_grad():
            low = g @ p.t() if right else p.t() @ g
            if mu is None:
                mu, nu = torch.zeros_like(low), torch.zeros_like(low)
            mu = 0.9 * mu + 0.1 * low
            nu = 0.999 * nu + 0.001 * low * low
            step = np.sqrt(1 - 0.999 ** (t + 1)) / (1 - 0.9 ** (t + 1))
            direction = step * mu / (torch.sqrt(nu) + 1e-6)
            back = direction @ p if right else p @ direction
        w = w - float(_schedule(t)) * SCALE * back.numpy().astype(np.float64)
        if t > 0:
            opt.step()
        out.append(w.copy())
    return out


@pytest.mark.parametrize("torch_shape", [(48, 48), (96, 40), (40, 96)], ids=["square", "tall", "wide"])
def test_osd_host_matches_the_pytorch_rendering(torch_shape):
    rng = np.random.default_rng(0)
    base = rng.standard_normal(torch_shape)
    seq = [(base + 0.5 * rng.standard_normal(torch_shape)).astype(np.float32) for _ in range(7)]
    rank = 8
    ref = _osd_reference(seq, rank)
    tx = mj.moara_adamw(
        _schedule,
        r_base=rank,
        decompose=False,
        rank_allocation=False,
        update_proj_gap=T,
        canonical_signs=True,
        host=mj.OSD(peak_lr=PEAK),
        label_fn=lambda path: "q",
    )
    got, state = _jax_run(tx, {"w": jnp.zeros(torch_shape[::-1])}, [{"w": jnp.asarray(g.T)} for g in seq])
    for t in range(len(seq)):
        assert_matches_reference(np.asarray(got[t]["w"]).T, ref[t], f"step {t}")
    basis = np.asarray(find_state(state, mj.OSDProjectState).basis["w"])
    assert not np.allclose(basis.T @ basis, np.eye(rank), atol=1e-6)  # it moved off the SVD basis


def test_an_injected_schedule_steps_the_basis_as_the_schedule_itself():
    """Under ``optax.inject_hyperparams`` the optimizer sees each update's learning rate only at
    that update; the basis's step on update ``t``'s loss, taken at update ``t + 1``, still takes
    ``lr_t`` (it took ``lr_{t+1}``: here 1.5 times the step at update 2)."""
    rng = np.random.default_rng(0)
    params, *grads = (
        {"q_proj": {"kernel": jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)}} for _ in range(7)
    )
    kw = dict(r_base=8, decompose=False, host=mj.OSD(peak_lr=PEAK))
    injected = optax.inject_hyperparams(mj.moara_adamw, static_args=mj.MOARA_ADAMW_STATIC_ARGS)

    def bases(tx):
        state, out = tx.init(params), []
        for g in grads:
            _, state = jax.jit(tx.update)(g, state, params)
            out.append(np.asarray(find_state(state, mj.OSDProjectState).basis["q_proj"]["kernel"]))
        return out

    direct, via = bases(mj.moara_adamw(_schedule, **kw)), bases(injected(learning_rate=_schedule, **kw))
    assert not np.allclose(direct[2], direct[1], atol=1e-4)  # the basis moves
    for t, (a, b) in enumerate(zip(direct, via, strict=True)):
        np.testing.assert_allclose(b, a, atol=1e-6, err_msg=f"update {t}")


def test_osd_basis_descends_the_online_pca_loss():
    """With a fixed gradient the basis steps lower the online-PCA loss toward the SVD optimum."""
    rng = np.random.default_rng(1)
    u = np.linalg.qr(rng.standard_normal((64, 64)))[0]
    g_fixed = jnp.asarray(
        (u * 0.7 ** np.arange(64)) @ np.linalg.qr(rng.standard_normal((64, 64)))[0].T, jnp.float32
    )
    noisy = [g_fixed + 0.3 * jnp.asarray(rng.standard_normal((64, 64)), jnp.float32) for _ in range(1)]
    tx = mj.osd_project(4, 0.05)
    params = {"w": jnp.zeros((64, 64))}
    state = tx.init(params)
    _, state = tx.update({"w": noisy[0]}, state)  # step 0: SVD of a noisy gradient
    losses = []
    for _ in range(60):
        losses.append(float(mj.pca_loss(state.basis["w"], g_fixed, "in")))
        _, state = tx.update({"w": g_fixed}, state)
    optimum = float(np.sum((0.7 ** np.arange(64))[4:] ** 2) / np.sum(0.7 ** (2 * np.arange(64))))
    assert losses[-1] < losses[0] and losses[-1] < optimum + 0.5 * (losses[0] - optimum), (
        losses[0],
        losses[-1],
        optimum,
    )


@pytest.mark.slow
def test_stacked_osd_leaf_equals_loop_over_matrices():
    """Normalisation and basis steps are per matrix (layers with gradients of different norms)."""
    rng = np.random.default_rng(3)
    grads = [
        (rng.standard_normal((3, 24, 40)) * np.array([1.0, 15.0, 0.1])[:, None, None]).astype(np.float32)
        for _ in range(5)
    ]
    tx = mj.osd_project(5, 0.1)
    chain = mj.stage_chain(tx, mj.inner_adam(), mj.recompose())
    assert_stacked_equals_loop(chain, grads, atol=1e-6)


def test_osd_needs_a_peak_with_a_schedule_and_accounts_its_basis_moments():
    with pytest.raises(ValueError, match="peak_lr"):
        mj.moara_adamw(_schedule, r_base=4, block_size=8, host="osd")
    injected = optax.inject_hyperparams(mj.moara_adamw, static_args=mj.MOARA_ADAMW_STATIC_ARGS)
    with pytest.raises(ValueError, match="peak_lr"):  # an injected rate is not its own peak
        injected(learning_rate=0.01, r_base=4, block_size=8, host="osd").init(
            {"q_proj": {"kernel": jnp.zeros((8, 8))}}
        )
    with pytest.raises(ValueError, match="basis_lr"):
        mj.scale_by_galore(4, host="osd")
    with pytest.raises(ValueError, match="weight_decay"):
        mj.OSD(weight_decay=-1.0)
    params = {"q_proj": {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)}}
    state = jax.eval_shape(
        mj.moara_adamw(0.01, r_base=16, decompose=False, rank_allocation=False, host="osd").init, params
    )
    got = mj.state_bytes(state)
    assert got["projection_bases"] == 64 * 16 * 2 and got["basis_moments"] == 2 * 64 * 16 * 2
    assert got["total"] == got["moments"] + got["projection_bases"] + got["basis_moments"] + got["other"]


def test_a_float16_basis_keeps_float32_moments_and_stays_finite():
    """float16's range flushes the basis's second moment ``(1 - b2) g^2`` to zero, and a step
    that divides by eps alone blows the basis up (NaN by the third update when the moments were
    float16); bf16 bases keep bf16 moments, as the reference's (accounting test above)."""
    rng = np.random.default_rng(0)
    params = {"q_proj": {"kernel": jnp.asarray(rng.standard_normal((32, 64)), jnp.float16)}}
    tx = mj.moara_adamw(0.01, r_base=8, block_size=8, rank_allocation=False, host=mj.OSD(peak_lr=0.01))
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(10):
        grads = {"q_proj": {"kernel": jnp.asarray(rng.standard_normal((32, 64)), jnp.float16)}}
        updates, state = update(grads, state, params)
        assert bool(jnp.all(jnp.isfinite(updates["q_proj"]["kernel"])))
    osd = find_state(state, mj.OSDProjectState)
    assert osd.basis["q_proj"]["kernel"].dtype == jnp.float16
    assert osd.basis_mu["q_proj"]["kernel"].dtype == osd.basis_nu["q_proj"]["kernel"].dtype == jnp.float32
    assert float(jnp.max(jnp.abs(osd.basis["q_proj"]["kernel"]))) <= 1.0  # still near orthonormal


def test_moara_on_osd_runs_decomposition_on_the_moving_basis():
    """Full MoARa on OSD: finite, and the basis moves after step 0 (the magnitudes' Adam and
    the direction's projection are the chain's, checked for GaLore)."""
    bases = [np.asarray(n.basis["q_proj"]["kernel"]) for n in host_run("osd", mj.OSDProjectState, seed=2)]
    assert not np.allclose(bases[1], bases[2]) and not np.allclose(bases[2], bases[3])


def test_the_state_holds_the_basis_each_update_used():
    """The basis steps on update t's loss at the start of update t + 1, so the state after an
    update holds the basis that projected its gradient: the update lies in that basis's span, and
    the alignment diagnostic (the paper's ``S(W, t)``, with the ``P`` that projected ``G_t``) reads it."""
    rng = np.random.default_rng(5)
    params = {"q_proj": {"kernel": jnp.zeros((40, 24))}}
    tx = mj.moara_adamw(0.01, r_base=4, decompose=False, rank_allocation=False, update_proj_gap=2, host="osd")
    state, update = tx.init(params), jax.jit(tx.update)
    bases = []
    for t in range(5):
        grads = {"q_proj": {"kernel": jnp.asarray(rng.standard_normal((40, 24)), jnp.float32)}}
        updates, state = update(grads, state, params)
        basis = np.asarray(find_state(state, mj.OSDProjectState).basis["q_proj"]["kernel"], np.float64)
        u = np.asarray(updates["q_proj"]["kernel"], np.float64)
        assert basis.shape == (24, 4)  # the smaller side, fan_out, is projected
        outside = u - u @ basis @ np.linalg.pinv(basis)
        assert np.linalg.norm(outside) < 1e-5 * np.linalg.norm(u), t
        g = np.asarray(grads["q_proj"]["kernel"], np.float64)
        recon = g @ basis @ basis.T
        cos = (g * recon).sum() / np.linalg.norm(g) / np.linalg.norm(recon)
        np.testing.assert_allclose(mj.module_alignment(grads, state)["q"], cos, rtol=1e-4, err_msg=str(t))
        bases.append(basis)
    assert not np.allclose(bases[-1], bases[-2], atol=1e-6)  # the basis moves every step
