"""Shared test set-up: float32 matmuls at full precision, so oracle comparisons are meaningful;
token stores cached under the session's temporary directory, never the user's cache."""

import os

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests run only where JAX's default backend is a GPU (asked only when one was
    collected: the question starts JAX's backend)."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked or jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: JAX's default backend is {jax.default_backend()}")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _token_store_cache(tmp_path_factory):
    # The parent of the base temp dir is shared by the xdist workers of one session, so the
    # builtin corpus' store is built once (the store's lock serialises concurrent builders).
    root = tmp_path_factory.getbasetemp().parent / "moara-jax-cache"
    old = os.environ.get("MOARA_JAX_CACHE")
    os.environ["MOARA_JAX_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("MOARA_JAX_CACHE", None)
    else:
        os.environ["MOARA_JAX_CACHE"] = old
