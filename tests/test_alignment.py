"""The alignment diagnostic from gradients and optimizer state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moara_jax as mj


def paper_alignment(kernel: np.ndarray, rank: int, block: int | None = None) -> float:
    """S of one matrix by the paper's Eq. (module_alignment), in float64 from the kernel
    ``(fan_in, fan_out)``: P the top-``rank`` singular vectors of G on its smaller side (fan_in on
    a square matrix); without ``block`` the reconstruction is ``P P^T G``, with it
    ``Rep_B(M) * (P P^T V)``, M the norms of ``block`` rows of fan_in in each fan_out column."""
    g = np.asarray(kernel, np.float64)
    fan_in, fan_out = g.shape
    if block is None:
        v, rep = g, np.ones_like(g)
    else:
        pad = -fan_in % block
        blocks = np.pad(g, ((0, pad), (0, 0))).reshape(-1, block, fan_out)
        m = np.linalg.norm(blocks, axis=1)  # (ceil(fan_in / B), fan_out)
        rep = np.repeat(m, block, axis=0)[:fan_in]
        v = g / (rep + 1e-12)
    if fan_in <= fan_out:
        u = np.linalg.svd(g)[0][:, :rank]
        recon = rep * (u @ u.T @ v)
    else:
        w = np.linalg.svd(g)[2][:rank].T
        recon = rep * (v @ w @ w.T)
    return float((g * recon).sum() / np.linalg.norm(g) / np.linalg.norm(recon))


def test_module_alignment_matches_manual_cosines():
    rng = np.random.default_rng(0)
    params = {
        "layers": {
            "self_attn": {"q_proj": {"kernel": jnp.zeros((2, 16, 16))}},
            "mlp": {"down_proj": {"kernel": jnp.zeros((40, 16))}},
        },
        "norm": jnp.zeros(16),
    }
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    tx = mj.moara_adamw(0.01, r_base=4, decompose=False, rank_allocation=False)
    _, state = tx.update(grads, tx.init(params), params)
    got = mj.module_alignment(grads, state)
    assert set(got) == {"q", "down"}
    # Manual: P = top-4 vectors of the projected side; S = cos(G, P P^T G), averaged over layers.
    q = np.asarray(grads["layers"]["self_attn"]["q_proj"]["kernel"])
    cos = []
    for g in q:  # (16, 16): fan_in side
        u = np.linalg.svd(g)[0][:, :4]
        r = u @ u.T @ g
        cos.append((g * r).sum() / np.linalg.norm(g) / np.linalg.norm(r))
    np.testing.assert_allclose(got["q"], np.mean(cos), rtol=1e-4)
    d = np.asarray(grads["layers"]["mlp"]["down_proj"]["kernel"])  # (40, 16): fan_out side
    v = np.linalg.svd(d)[2][:4].T
    r = d @ v @ v.T
    np.testing.assert_allclose(got["down"], (d * r).sum() / np.linalg.norm(d) / np.linalg.norm(r), rtol=1e-4)
    np.testing.assert_allclose(got["q"], np.mean([paper_alignment(g, 4) for g in q]), rtol=1e-4)
    # With a block size, S uses Rep_B(M) * (P P^T V), V the blocks of G divided by their norms.
    with_blocks = mj.module_alignment(grads, state, block_size=8)
    want = {"q": np.mean([paper_alignment(g, 4, 8) for g in q]), "down": paper_alignment(d, 4, 8)}
    np.testing.assert_allclose([with_blocks[k] for k in want], list(want.values()), rtol=1e-4)
    assert with_blocks["down"] != pytest.approx(got["down"], rel=1e-3)  # the blocks change S


def test_the_state_of_a_decomposing_optimizer_needs_its_block_size():
    """Its bases are of the directions V: without ``block_size`` the reconstruction projected G on
    them and gave another S with no word, and another block size was taken too. Both are
    refused; vanilla GaLore's state (bases of G) takes either, as the paper's profile does."""
    rng = np.random.default_rng(1)
    params = {"q_proj": {"kernel": jnp.zeros((2, 32, 16))}, "down_proj": {"kernel": jnp.zeros((16, 32))}}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    tx = mj.moara_adamw(0.01, r_base=8, block_size=8)
    _, state = tx.update(grads, tx.init(params), params)
    with pytest.raises(
        ValueError,
        match=r"the state decomposes the updates of \['down_proj'\]\['kernel'\] "
        r"\(2 block magnitudes along its fan_in of 16\), so its basis is of the directions V: "
        r"pass block_size, the optimizer's",
    ):
        mj.module_alignment(grads, state)
    with pytest.raises(
        ValueError,
        match=r"block_size=4 splits the fan_in of \['down_proj'\]\['kernel'\] \(16\) "
        r"into 4 blocks, but the state holds 2 block magnitudes",
    ):
        mj.module_alignment(grads, state, block_size=4)
    got = mj.module_alignment(grads, state, block_size=8)
    # What it is: S of Rep_B(M) * (P P^T V) with the state's bases, by hand for down_proj.
    g = grads["down_proj"]["kernel"]
    basis = mj.projection_bases(state)["['down_proj']['kernel']"]
    np.testing.assert_allclose(got["down"], float(mj.alignment(g, mj.reconstruct(g, basis, 8))), rtol=1e-5)
    for side in ("fan_in", ""):  # was read as 'out', and as the default rule
        with pytest.raises(ValueError, match=f"side must be 'in', 'out' or None, got {side!r}"):
            mj.reconstruct(g, basis, 8, side=side)
    # Q-GaLore keeps the magnitudes' moments as 8-bit codes, whose shape does not tell the blocks:
    # block_size is still required.
    big = {"q_proj": {"kernel": jnp.zeros((2, 256, 256))}}
    g8 = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), big)
    q8 = mj.moara_adamw(0.01, r_base=16, block_size=16, host="q_galore", rank_allocation=False)
    _, state8 = q8.update(g8, q8.init(big), big)
    with pytest.raises(
        ValueError, match=r"decomposes the updates of \['q_proj'\]\['kernel'\] \(it holds block"
    ):
        mj.module_alignment(g8, state8)
    assert set(mj.module_alignment(g8, state8, block_size=16)) == {"q"}
    # Vanilla GaLore's state: without block_size S is of P P^T G, with one of Rep_B(M) * (P P^T V).
    plain = mj.moara_adamw(0.01, r_base=8, block_size=8, decompose=False, rank_allocation=False)
    _, state = plain.update(grads, plain.init(params), params)
    for block in (None, 4):
        got = mj.module_alignment(grads, state, block_size=block)
        want = {
            "q": np.mean([paper_alignment(k, 8, block) for k in grads["q_proj"]["kernel"]]),
            "down": paper_alignment(grads["down_proj"]["kernel"], 8, block),
        }
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-4)


@pytest.mark.slow
def test_alignment_grows_with_rank():
    rng = np.random.default_rng(1)
    params = {"mlp": {"up_proj": {"kernel": jnp.zeros((24, 64))}}}
    grads = {"mlp": {"up_proj": {"kernel": jnp.asarray(rng.standard_normal((24, 64)), jnp.float32)}}}
    scores = []
    for r in (2, 8, 24):
        tx = mj.moara_adamw(0.01, r_base=r, block_size=8, rank_allocation=False)
        _, state = tx.update(grads, tx.init(params), params)
        scores.append(mj.module_alignment(grads, state, block_size=8)["up"])
    assert scores[0] < scores[1] < scores[2]
    np.testing.assert_allclose(scores[2], 1.0, rtol=1e-5)  # full rank reconstructs exactly


def test_alignment_is_scale_free_in_float32():
    """Squared norms of tiny or huge matrices leave float32's range; the cosine must not."""
    g = jnp.asarray(np.random.default_rng(3).standard_normal((16, 24)), jnp.float32)
    for s in (1e-14, 1e-12, 1.0, 1e10, 1e18):
        np.testing.assert_allclose(mj.alignment(s * g, s * g), 1.0, rtol=1e-5)
        np.testing.assert_allclose(mj.alignment(s * g, -1e-3 * s * g), -1.0, rtol=1e-5)
    assert float(mj.alignment(jnp.zeros((4, 4)), g[:4, :4])) == 0.0


@pytest.mark.slow
def test_alignment_reads_every_host_with_its_projected_side():
    """The diagnostic (and ``mode=profile``) finds the bases of every host; LDAdam projects a
    square matrix on its fan_out side, and its alignment is taken on that side."""
    rng = np.random.default_rng(3)
    params = {"q_proj": {"kernel": jnp.zeros((16, 16))}, "down_proj": {"kernel": jnp.zeros((40, 16))}}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    for name in mj.HOSTS:
        host = mj.QGaLore(basis_group_size=16, weight_bits=None) if name == "q_galore" else name
        tx = mj.moara_adamw(0.01, r_base=4, decompose=False, rank_allocation=False, host=host)
        _, state = tx.update(grads, tx.init(params), params)
        got = mj.module_alignment(grads, state)
        assert set(got) == {"q", "down"}, name
        g = np.asarray(grads["q_proj"]["kernel"])
        basis = np.asarray(mj.projection_bases(state)["['q_proj']['kernel']"], np.float64)
        recon = g @ basis @ basis.T if name == "ldadam" else basis @ basis.T @ g
        cos = (g * recon).sum() / np.linalg.norm(g) / np.linalg.norm(recon)
        np.testing.assert_allclose(got["q"], cos, rtol=1e-3, err_msg=name)


def test_a_module_type_in_several_leaves_is_the_mean_over_its_matrices():
    """S of a type is the mean over its matrices (the paper's E over W in tau): a leaf of two
    stacked layers weighs twice a leaf of one, not a mean of the leaves' means."""
    rng = np.random.default_rng(2)
    params = {
        "encoder": {"q_proj": {"kernel": jnp.zeros((2, 16, 24))}},
        "decoder": {"q_proj": {"kernel": jnp.zeros((16, 24))}},
    }
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    tx = mj.moara_adamw(0.01, r_base=4, decompose=False, rank_allocation=False)
    _, state = tx.update(grads, tx.init(params), params)
    matrices = [*grads["encoder"]["q_proj"]["kernel"], grads["decoder"]["q_proj"]["kernel"]]
    scores = [paper_alignment(m, 4) for m in matrices]
    np.testing.assert_allclose(mj.module_alignment(grads, state)["q"], np.mean(scores), rtol=1e-4)
    assert np.mean(scores) != pytest.approx(np.mean([np.mean(scores[:2]), scores[2]]), rel=1e-4)
