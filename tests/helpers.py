"""Test helpers: a float64 NumPy reference of MoARa (Algorithm 1) in the paper's orientation and
the tolerance used against reference implementations; the environment of a subprocess on
several CPU devices."""

import os
import pathlib
import time

import numpy as np

from train.store.building import tokenize_piece as _TOKENIZE_PIECE  # (before any test patches it)
from train.xla_flags import merged


def assert_matches_reference(got, want, msg=""):
    """Float32 agreement with the reference up to SVD round-off.

    Two LAPACK builds give float32 singular vectors that differ around 1e-7. Adam's first steps
    act almost like ``sign(x)`` on the low-rank values, so the few entries of ``P^T G`` that sit
    near zero amplify that difference; hence a norm-wise bound plus an entrywise one scaled to the
    update's size, instead of a pure entrywise ``rtol``.
    """
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, msg
    scale = np.abs(want).max() + 1e-30
    assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want) + 1e-12, msg
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3 * scale, err_msg=msg)


def matrices(tree):
    """A weight-decay mask of ``tree``: True for its leaves of 2 or more dimensions (no norms or
    biases)."""
    import jax

    return jax.tree.map(lambda x: x.ndim >= 2, tree)


def canonical(basis, axis):
    """Flips each vector of ``basis`` (vectors along ``axis``) so its largest |entry| is positive."""
    idx = np.argmax(np.abs(basis), axis=axis)
    if axis == 0:
        s = np.sign(basis[idx, np.arange(basis.shape[1])])
        return basis * np.where(s == 0, 1, s)[None, :]
    s = np.sign(basis[np.arange(basis.shape[0]), idx])
    return basis * np.where(s == 0, 1, s)[:, None]


def decompose_rows(g, block):
    """Paper orientation: g (m, n) -> (M (m, k), V (m, n)), eps = 1e-12 in the denominator."""
    m, n = g.shape
    k = -(-n // block)
    pad = np.zeros((m, k * block))
    pad[:, :n] = g
    blocks = pad.reshape(m, k, block)
    mag = np.sqrt((blocks**2).sum(-1))
    v = (blocks / (mag[..., None] + 1e-12)).reshape(m, k * block)[:, :n]
    return mag, v


def rep(mag, block, n):
    return np.repeat(mag, block, axis=1)[:, :n]


class ReferenceMoara:
    """Algorithm 1 for one matrix W (m, n), PyTorch orientation, float64, galore-torch shape rules.

    ``block=None`` is plain GaLore (P from the SVD of G). ``fira=True`` adds Fira's norm-scaled,
    growth-limited residual of the projected matrix (G, or the direction V). Returns the update
    ``-lr * ...``.
    """

    def __init__(
        self,
        shape,
        rank,
        block,
        gap=200,
        scale=0.25,
        lr=0.01,
        b1=0.9,
        b2=0.999,
        eps=1e-6,
        fira=False,
        growth=1.01,
    ):
        self.m, self.n = shape
        self.rank, self.block, self.gap, self.scale, self.lr = rank, block, gap, scale, lr
        self.b1, self.b2, self.eps = b1, b2, eps
        self.fira, self.growth = fira, growth
        self.t = 0
        self.p = None
        self.mom = None
        self.mag_mom = None
        self.residual_norm = None

    def _adam(self, x, mom):
        if mom is None:
            mom = (np.zeros_like(x), np.zeros_like(x))
        mu = self.b1 * mom[0] + (1 - self.b1) * x
        nu = self.b2 * mom[1] + (1 - self.b2) * x * x
        t = self.t + 1
        step = np.sqrt(1 - self.b2**t) / (1 - self.b1**t)
        return step * mu / (np.sqrt(nu) + self.eps), (mu, nu)

    def step(self, g):
        g = np.asarray(g, np.float64)
        if self.block is not None:
            mag, v = decompose_rows(g, self.block)
        else:
            mag, v = None, g
        right = self.m >= self.n  # galore-torch 'std'
        if self.t % self.gap == 0:
            u, _, vh = np.linalg.svd(v, full_matrices=False)
            self.p = canonical(vh[: self.rank], axis=1) if right else canonical(u[:, : self.rank], axis=0)
        low = v @ self.p.T if right else self.p.T @ v
        d_low, self.mom = self._adam(low, self.mom)
        dv = self.scale * (d_low @ self.p if right else self.p @ d_low)
        if self.fira:
            t = self.t + 1
            step = np.sqrt(1 - self.b2**t) / (1 - self.b1**t)
            axis = 1 if right else 0  # the rank axis of the low-rank value
            norm = lambda x: np.linalg.norm(x, axis=axis, keepdims=True)  # noqa: E731
            phi = norm(d_low / step) / (norm(low) + 1e-8)
            s = (v - self.scale * (low @ self.p if right else self.p @ low)) * phi
            s_norm = np.linalg.norm(s)
            if self.residual_norm is not None:
                limiter = max(s_norm / (self.residual_norm + 1e-8), self.growth) / self.growth
                s, s_norm = s / limiter, s_norm / limiter
            self.residual_norm = s_norm
            dv = dv + step * s
        if mag is not None:
            d_mag, self.mag_mom = self._adam(mag, self.mag_mom)
            dv = rep(d_mag, self.block, self.n) * dv
        self.t += 1
        return -self.lr * dv


def torch_history(opt, weights, grads_seq):
    """Steps the PyTorch optimizer ``opt`` over ``grads_seq`` (name -> array, per step) for the
    parameters ``weights`` (name -> ``torch.nn.Parameter``); the weights after each step."""
    import torch

    history = []
    for grads in grads_seq:
        for name, w in weights.items():
            w.grad = torch.from_numpy(grads[name].copy())
        opt.step()
        history.append({n: w.detach().numpy().copy() for n, w in weights.items()})
    return history


def assert_stacked_equals_loop(tx, grads, update=None, rtol=1e-5, atol=1e-7, resync=False):
    """A stacked ``(L, ...)`` leaf behaves as ``L`` separate ones: ``tx`` on ``grads`` (arrays of
    shape ``(L, ...)``, one per step) against ``L`` states of its own. Returns the stacked state
    and the per-matrix states.

    ``resync``: each step from the same states, each matrix's the stacked state's slice, and the
    states after it compared too, so that by induction the stacked run is the ``L`` runs up to
    one step's float32 rounding. For a host whose basis update amplifies a rounding difference
    (SubTrack++'s tracking turns a 1-ulp difference of its basis into 1e-1 of the update two
    steps later), where the two programs round differently: batched and unbatched kernels need
    not round alike (XLA's legacy CPU emitters, for one)."""
    import jax
    import jax.numpy as jnp

    shape = grads[0].shape
    stacked, single = {"w": jnp.zeros(shape)}, {"w": jnp.zeros(shape[1:])}
    s_stacked, s_single = tx.init(stacked), [tx.init(single) for _ in range(shape[0])]
    update = update or tx.update

    def piece(tree, i, like):  # matrix i's part of a stacked state
        return jax.tree.map(lambda a, b: a[i] if np.ndim(a) == np.ndim(b) + 1 else a, tree, like)

    if resync:  # the stacked init is the matrices' inits
        for i in range(shape[0]):
            jax.tree.map(np.testing.assert_array_equal, piece(s_stacked, i, s_single[i]), s_single[i])
    for g in grads:
        before = s_stacked
        u_stacked, s_stacked = update({"w": jnp.asarray(g)}, s_stacked, stacked)
        for i in range(shape[0]):
            if resync:
                s_single[i] = piece(before, i, s_single[i])
            u_i, s_single[i] = update({"w": jnp.asarray(g[i])}, s_single[i], single)
            np.testing.assert_allclose(u_stacked["w"][i], u_i["w"], rtol=rtol, atol=atol)
            if resync:
                jax.tree.map(
                    lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol),
                    piece(s_stacked, i, s_single[i]),
                    s_single[i],
                )
    return s_stacked, s_single


def find_state(state, cls):
    """The one ``cls`` node (a transform's state) inside an optimizer state."""
    import jax

    (node,) = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, cls)) if isinstance(x, cls)]
    return node


def host_run(host, state_cls, steps=4, seed=0, **kwargs):
    """Full MoARa (``r_base=8``, ``block_size=8``) on ``host`` over a square q_proj and a tall
    down_proj for ``steps`` jitted steps of random gradients; asserts the parameters stay finite
    and returns the ``state_cls`` node after each step."""
    import jax
    import jax.numpy as jnp
    import optax

    import moara_jax as mj

    rng = np.random.default_rng(seed)
    params = {"q_proj": {"kernel": jnp.zeros((32, 32))}, "down_proj": {"kernel": jnp.zeros((64, 32))}}
    tx = mj.moara_adamw(0.01, r_base=8, block_size=8, host=host, **kwargs)
    state = tx.init(params)
    update = jax.jit(tx.update)
    nodes = []
    for _ in range(steps):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
        nodes.append(find_state(state, state_cls))
    return nodes


def cpu_devices(n: int, base: dict | None = None) -> dict:
    """``base`` (this process's environment) with JAX on ``n`` CPU devices: the device count added
    to the session's XLA_FLAGS (its compile settings, tests/conftest.py), not in their place."""
    base = dict(os.environ if base is None else base)
    flags = merged(base.get("XLA_FLAGS", ""), [f"--xla_force_host_platform_device_count={n}"])[0]
    return base | {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def tokenize_or_die(job):
    """``train.store``'s ``tokenize_piece``, except that a worker process given piece 2 is killed
    at once, as the system kills a process out of memory (the parent process never is)."""
    import multiprocessing
    import signal

    from train.store import building

    if job[0].index == 2 and multiprocessing.parent_process() is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    return building.tokenize_piece(job)


HELD_MARKER = "MOARA_JAX_TEST_COUNTER_HELD"


def tokenize_holding_a_counter(job):
    """``train.store``'s ``tokenize_piece``, except that a worker process given piece 2 or later
    waits until pieces 0 and 1 are done, then takes the documents counter's lock (as inside
    ``_Counters.add``), touches the file ``$MOARA_JAX_TEST_COUNTER_HELD`` and waits there, to be
    terminated holding it. Another worker blocks on that lock. (The parent, where a test put this
    in ``tokenize_piece``'s place, tokenizes with the original.)"""
    import multiprocessing

    from train.store import building

    piece, shards, _ = job
    if piece.index >= 2 and multiprocessing.parent_process() is not None:
        while not (shards / "00001.json").exists():
            time.sleep(0.01)
        building._worker["counters"].docs.get_lock().acquire()
        pathlib.Path(os.environ[HELD_MARKER]).touch()
        time.sleep(600)
    return _TOKENIZE_PIECE(job)


def alive(pid: int, wait_s: float = 5.0) -> bool:
    """Whether process ``pid`` still runs ``wait_s`` seconds from now (or ends before): a zombie,
    left to a container's init that does not reap it, has ended."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            status = pathlib.Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False
        state = next(line for line in status.splitlines() if line.startswith("State:"))
        if "Z" in state.split()[1]:
            return False
        time.sleep(0.05)
    return True
