"""Property tests of the block decomposition (paper Section 3.1, Appendix B.1, Proposition 1)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import decompose_rows
from hypothesis import example, given, settings
from hypothesis import strategies as st

import moara_jax as mj

shapes = st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 40))
blocks = st.integers(1, 48)


def _matrix(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


class DecomposeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_shapes_and_reconstruction(self):
        g = jnp.asarray(_matrix(0, (2, 5, 13)))
        fn = self.variant(lambda x: mj.block_decompose(x, 4))
        mag, d = fn(g)
        chex.assert_shape(mag, (2, 5, 4))
        chex.assert_shape(d, (2, 5, 13))
        chex.assert_trees_all_close(mj.block_recompose(mag, d, 4), g, rtol=1e-5, atol=1e-6)


@settings(max_examples=12, deadline=None)
@given(shape=shapes, block=blocks, seed=st.integers(0, 2**16))
def test_matches_numpy_reference_any_shape_and_block(shape, block, seed):
    g = _matrix(seed, shape)
    mag, d = mj.block_decompose(jnp.asarray(g), block)
    assert mag.shape == shape[:-1] + (math.ceil(shape[-1] / block),)
    assert d.shape == g.shape  # padding is cropped
    for i in range(shape[0]):
        ref_mag, ref_dir = decompose_rows(g[i].astype(np.float64), block)
        np.testing.assert_allclose(mag[i], ref_mag, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(d[i], ref_dir, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mj.block_recompose(mag, d, block), g, rtol=1e-5, atol=1e-6)
    # every non-zero block of the direction has unit norm
    blocks_norm = np.asarray(mj.block_decompose(d, block)[0])
    np.testing.assert_allclose(blocks_norm[np.asarray(mag) > 1e-3], 1.0, rtol=1e-5)


@settings(max_examples=8, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
@example(shape=(2, 6, 26), seed=387)  # an entry of 3.9e-7
def test_block_one_gives_signs_and_abs(shape, seed):
    """Blocks of one entry: ``|g|`` and ``g / (|g| + eps)``, the sign but for entries near ``eps``
    (a normal sample of 4e-7 has direction 1 - 2.6e-6)."""
    g = _matrix(seed, shape)
    mag, d = mj.block_decompose(jnp.asarray(g), 1)
    np.testing.assert_allclose(mag, np.abs(g), rtol=1e-6)
    want = g.astype(np.float64) / (np.abs(g.astype(np.float64)) + 1e-12)  # the default eps
    np.testing.assert_allclose(d, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.sign(d), np.sign(g))


@settings(max_examples=8, deadline=None)
@given(shape=shapes, extra=st.integers(0, 10), seed=st.integers(0, 2**16))
@pytest.mark.slow
def test_block_at_least_n_is_rowwise(shape, extra, seed):
    g = _matrix(seed, shape)
    mag, d = mj.block_decompose(jnp.asarray(g), shape[-1] + extra)
    np.testing.assert_allclose(mag[..., 0], np.linalg.norm(g, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(d, g / np.linalg.norm(g, axis=-1, keepdims=True), rtol=1e-4, atol=1e-6)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), block=st.integers(2, 12), rank=st.integers(1, 6))
def test_proposition_1_magnitude_cancels_from_blockwise_cosine(seed, block, rank):
    """cos(G_ib, G_recon_ib) = cos(v_ib, v~_ib) for G_recon = Rep_B(M) * (P P^T V)."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((16, 30))
    mag, v = decompose_rows(g, block)
    p = np.linalg.svd(v, full_matrices=False)[0][:, :rank]
    v_tilde = p @ p.T @ v
    g_recon = np.repeat(mag, block, axis=1)[:, :30] * v_tilde
    k = -(-30 // block)
    for i in range(16):
        for b in range(k):
            sl = slice(b * block, min((b + 1) * block, 30))
            x, y = g[i, sl], g_recon[i, sl]
            vx, vy = v[i, sl], v_tilde[i, sl]
            if np.linalg.norm(y) < 1e-9 or np.linalg.norm(vy) < 1e-9:
                continue
            cos_g = x @ y / (np.linalg.norm(x) * np.linalg.norm(y))
            cos_v = vx @ vy / (np.linalg.norm(vx) * np.linalg.norm(vy))
            assert abs(cos_g - cos_v) < 1e-9
    # The library's G_recon on the Flax kernel (fan_in=30 > fan_out=16: the fan_out side, with
    # the same basis P) is the transpose of this one.
    recon = mj.reconstruct(jnp.asarray(g.T, jnp.float32), jnp.asarray(p, jnp.float32), block)
    np.testing.assert_allclose(np.asarray(recon).T, g_recon, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("shape", [(4, 8), (3, 5, 7)])
def test_zero_gradient_zero_block_zero_row_are_finite(shape):
    g = np.asarray(_matrix(1, shape))
    g[..., 0, :] = 0.0  # a zero row
    g[..., 1, :3] = 0.0  # a zero block (B = 3)
    for x in (g, np.zeros(shape, np.float32)):
        mag, d = mj.block_decompose(jnp.asarray(x), 3)
        assert np.isfinite(np.asarray(mag)).all() and np.isfinite(np.asarray(d)).all()
        np.testing.assert_array_equal(np.asarray(d)[..., 0, :], 0.0)


def test_bad_block_size_raises_value_error_naming_it():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block_size"):
            mj.block_decompose(jnp.ones((2, 3)), bad)


def test_alignment_is_cosine_per_matrix_and_zero_safe():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    b = rng.standard_normal((3, 4, 5)).astype(np.float32)
    got = mj.alignment(jnp.asarray(a), jnp.asarray(b))
    want = [x.ravel() @ y.ravel() / np.linalg.norm(x) / np.linalg.norm(y) for x, y in zip(a, b, strict=True)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(mj.alignment(jnp.asarray(a), jnp.asarray(2 * a)), 1.0, rtol=1e-6)
    assert float(mj.alignment(jnp.zeros((2, 2)), jnp.zeros((2, 2)))) == 0.0


def test_jit_and_grad_of_decomposition_are_finite_at_zero():
    f = jax.jit(lambda x: jnp.sum(mj.block_recompose(*mj.block_decompose(x, 2), 2)))
    assert np.isfinite(float(f(jnp.zeros((2, 4)))))
    # Rep(M) * V = G * M / (M + eps): its gradient is 0 at a zero block (sqrt's derivative at 0
    # gave NaN) and about 1 elsewhere.
    x = jnp.zeros((2, 4)).at[0, :2].set(jnp.array([3.0, 4.0]))
    grad = jax.jit(jax.grad(f))(x)
    np.testing.assert_array_equal(grad[1], 0.0)
    np.testing.assert_array_equal(grad[0, 2:], 0.0)
    np.testing.assert_allclose(grad[0, :2], 1.0, atol=1e-6)
    mag_grad = jax.grad(lambda x: jnp.sum(mj.block_decompose(x, 2)[0]))(x)
    np.testing.assert_allclose(mag_grad[0, :2], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(mag_grad[1], 0.0)


def test_padded_direction_is_computed_at_the_gradient_size():
    """Where the blocks pad the fan_in axis, the direction is divided out at the gradient's own
    size, not computed padded and cropped (a crop XLA runs as one more copy of the direction)."""
    from moara_jax._decomposition import decompose_along

    jaxpr = jax.make_jaxpr(lambda g: decompose_along(g, 32, -2)[1])(jnp.ones((100, 8), jnp.bfloat16)).jaxpr
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    chain, var = [], jaxpr.outvars[0]
    while var in producer and len(chain) < 3:
        chain.append(producer[var].primitive.name)
        var = producer[var].invars[0]
    assert chain[:2] == ["convert_element_type", "div"], chain
