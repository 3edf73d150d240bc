"""``scale_by_moara`` on Flax kernels equals Algorithm 1 on the transposed (PyTorch-orientation)
matrix, computed by an independent float64 NumPy reference (tests/helpers.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ReferenceMoara, assert_matches_reference, assert_stacked_equals_loop

import moara_jax as mj


def _gradients(rng, shape, steps):
    base = rng.standard_normal(shape)
    return [base + 0.5 * rng.standard_normal(shape) for _ in range(steps)]


@pytest.mark.parametrize(
    "torch_shape,block",
    [((40, 40), 8), ((64, 24), 5), ((24, 64), 16), ((30, 50), 1), ((30, 50), 64)],
    ids=["square-B|n", "tall-B∤n", "wide", "B=1-signs", "B>=n-rowwise"],
)
def test_scale_by_moara_matches_reference_algorithm(torch_shape, block):
    rank, gap, steps, lr = 6, 3, 7, 0.01
    rng = np.random.default_rng(0)
    grads = _gradients(rng, torch_shape, steps)
    ref = ReferenceMoara(torch_shape, rank, block, gap=gap, lr=lr)
    tx = optax.chain(
        mj.scale_by_moara(rank, block, update_proj_gap=gap, canonical_signs=True),
        optax.scale(-lr),
    )
    params = {"w": jnp.zeros(torch_shape[::-1], jnp.float32)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t, g in enumerate(grads):
        u, state = update({"w": jnp.asarray(g.T, jnp.float32)}, state, params)
        assert_matches_reference(np.asarray(u["w"]).T, ref.step(g), f"step {t}")


def test_scale_by_galore_matches_reference_algorithm():
    rng = np.random.default_rng(1)
    grads = _gradients(rng, (36, 20), 5)
    ref = ReferenceMoara((36, 20), 4, None, gap=2)
    tx = optax.chain(mj.scale_by_galore(4, update_proj_gap=2, canonical_signs=True), optax.scale(-0.01))
    params = {"w": jnp.zeros((20, 36))}
    state = tx.init(params)
    for t, g in enumerate(grads):
        u, state = tx.update({"w": jnp.asarray(g.T, jnp.float32)}, state, params)
        assert_matches_reference(np.asarray(u["w"]).T, ref.step(g), f"step {t}")


def test_stacked_leaf_equals_loop_over_matrices():
    """A (L, fan_in, fan_out) leaf behaves as L independent matrices."""
    rng = np.random.default_rng(2)
    L, shape = 3, (24, 40)
    grads = [rng.standard_normal((L,) + shape).astype(np.float32) for _ in range(4)]
    assert_stacked_equals_loop(mj.scale_by_moara(5, 8, update_proj_gap=2), grads)


def test_flax_layout_equals_transposed_paper_math():
    """block_decompose works in the paper's orientation; the decompose stage on a Flax kernel is
    the same math on its transpose."""
    rng = np.random.default_rng(3)
    kernel_grad = jnp.asarray(rng.standard_normal((2, 37, 12)), jnp.float32)  # (L, fan_in, fan_out)
    (node,), _ = jax.tree.flatten(
        mj.decompose(8).update({"w": kernel_grad}, optax.EmptyState())[0]["w"],
        is_leaf=lambda x: isinstance(x, mj.Decomposed),
    )
    mag_paper, dir_paper = mj.block_decompose(jnp.swapaxes(kernel_grad, -1, -2), 8)
    np.testing.assert_allclose(node.mag, jnp.swapaxes(mag_paper, -1, -2), rtol=1e-6)
    np.testing.assert_allclose(node.direction, jnp.swapaxes(dir_paper, -1, -2), rtol=1e-6)
