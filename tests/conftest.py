"""Shared test set-up: float32 matmuls at full precision, so oracle comparisons are meaningful;
token stores and compiled programs cached under the session's temporary directory, never the
user's caches."""

import importlib.util
import os
import signal

import jax
import pytest

from train.errors import UserError
from train.xla_flags import check_known, merged

jax.config.update("jax_default_matmul_precision", "highest")


LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _quick_cpu_flags() -> list[str]:
    """The CPU flags that compile the tests quickly, less the legacy emitters' where this jaxlib
    lacks them (XLA would abort every process on an unknown flag). Asked in a child process once,
    by the session's first process: the xdist workers and the tests' processes inherit the answer
    in ``XLA_FLAGS``."""
    flags = ["--xla_backend_optimization_level=0"]
    if not merged(os.environ.get("XLA_FLAGS", ""), [LEGACY_EMITTERS])[1]:
        # XLA_FLAGS names it already: the user's value (theirs wins) or the controller's answer
        return [*flags, LEGACY_EMITTERS]
    if "PYTEST_XDIST_WORKER" in os.environ:  # the controller found this jaxlib lacks them
        return flags
    try:
        check_known([LEGACY_EMITTERS])
    except UserError:
        return flags
    return [*flags, LEGACY_EMITTERS]


def _cuda_plugin() -> bool:
    """Whether JAX's CUDA plugin is installed (then JAX may run on a GPU)."""
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's
def pytest_configure(config):
    """The session's token stores (the builtin corpus' store is built once; the store's lock
    serialises concurrent builders) and JAX's persistent compilation cache: the many tiny runs of
    the trainer's tests (subprocesses inherit the environment) compile the same programs, which
    XLA then compiles once per session instead of once per run. The programs run as before; only
    their compilation is reused. Set before any test module is imported (and compiles); the
    parent of the base temp dir is shared by the xdist workers of one session."""
    root = config._tmp_path_factory.getbasetemp().parent
    # Ctrl-C as a terminal delivers it, for the tests of what it does to a run and a sweep: a
    # shell that starts the suite in the background (``pytest ... &``, nohup) leaves SIGINT
    # ignored, which every process the tests start would inherit.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # On the CPU, compiled quickly: the tests' programs are tiny, so XLA compiling them, not
    # running them, is most of the suite's time. LLVM's optimisation off (`python -m pytest -q
    # tests/test_transforms.py -k converges`: 37.6 CPU seconds at XLA's default level, 22.1 with
    # it), and where this jaxlib has them (0.10; 0.11 has only the newer ones) XLA's legacy CPU
    # emitters, not its MLIR fusion emitters: `python -m pytest -n0 -m "not slow"
    # tests/test_transforms.py tests/test_hosts.py` on a fresh compilation cache, 61.0 s (38.4 s of
    # compiling) with the fusion emitters, 38.5 s (16.7 s) with the legacy ones. XLA's own passes
    # (fusion, layout) still run and both keep IEEE semantics (XLA's CPU fast-math is off). Two
    # programs of the same arithmetic may round differently under either emitter; the four tests
    # that compare such programs were checked under both, and their tolerances say why.
    # MOARA_JAX_TEST_OPTIMIZE=1 runs it at XLA's defaults; with a GPU plugin it always does.
    if os.environ.get("MOARA_JAX_TEST_OPTIMIZE") != "1" and not _cuda_plugin():
        os.environ["XLA_FLAGS"] = merged(os.environ.get("XLA_FLAGS", ""), _quick_cpu_flags())[0]
    # One process of its own: not a process of a scheduler's or an outer run's job (the trainer's
    # CLI runs in the test process), and offline (Hugging Face hubs are never reached).
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        os.environ.pop(name)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        os.environ.pop(name, None)
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    os.environ.update(
        {
            "MOARA_JAX_CACHE": str(root / "moara-jax-cache"),
            "JAX_COMPILATION_CACHE_DIR": str(root / "jax-compilation-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        }
    )
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_collection_modifyitems(config, items):
    """The ``slow`` tests (end-to-end runs, in processes of their own or in this one, up to a
    minute each, and the tests of 2.5 s or more that are neither oracles nor core contracts) first,
    in their order, so that pytest-xdist's workers end on short tests, not one on a long test
    while the other idles. ``gpu``-marked tests run only where JAX's default backend is a GPU
    (asked only when one was collected: the question starts JAX's backend)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked or jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: JAX's default backend is {jax.default_backend()}")
    for item in marked:
        item.add_marker(skip)
