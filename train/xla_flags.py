"""XLA compiler flags the trainer sets before JAX starts its backend (the ``xla`` config section).

XLA reads ``XLA_FLAGS`` once, when JAX initialises its first backend, and aborts the process on a
flag it does not know. ``python -m train`` therefore merges the configured flags into
``XLA_FLAGS`` right after reading the config, before any JAX computation, after checking in a
child process that this jaxlib knows them. A flag the user's ``XLA_FLAGS`` already sets keeps the
user's value.

``GPU_FLAG_SETS`` holds named sets from JAX-Toolbox's GPU performance guide and MaxText's GPU
recipes that matter on one GPU (the collective-communication flags of those recipes do nothing
without several devices). They are added on a CUDA GPU only. ``DEFAULT_GPU_FLAG_SETS`` names the
sets on by default: only sets a GPU measurement showed to help (``benchmarks/gpu_session.py``
times each); none has been measured yet, so none is on.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from train.errors import UserError

GPU_FLAG_SETS: dict[str, tuple[str, ...]] = {
    # Schedules independent work (async copies, collectives) to overlap; JAX-Toolbox's images set it.
    "latency_hiding": ("--xla_gpu_enable_latency_hiding_scheduler=true",),
    # cuBLAS for every GEMM instead of Triton's GEMM emitter (MaxText's and JAX-Toolbox's recipes).
    "cublas_gemm": ("--xla_gpu_enable_triton_gemm=false",),
    # CUDA graphs also around while loops and conditionals (XLA's default graphs hold fusions,
    # library calls and custom calls only): the scanned layers and micro-batches launch as one graph
    # instead of one host round trip per iteration.
    "command_buffers_control_flow": ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",),
    # No CUDA graphs at all: the reference the command-buffer sets are measured against.
    "no_command_buffers": ("--xla_gpu_enable_command_buffer=",),
    # Unrolls while loops by two and double-buffers their state (JAX-Toolbox, for scanned layers).
    "loop_double_buffering": ("--xla_gpu_enable_while_loop_double_buffering=true",),
}
DEFAULT_GPU_FLAG_SETS: tuple[str, ...] = ()


def flag_name(flag: str) -> str:
    """``--xla_foo=1`` -> ``xla_foo``."""
    return flag.lstrip("-").split("=", 1)[0]


def gpu_platform_expected() -> bool:
    """Whether JAX will start on a CUDA GPU, judged without starting a backend: JAX's CUDA plugin is
    installed and ``JAX_PLATFORMS``, when set, allows it."""
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    for version in ("12", "13"):
        try:
            if importlib.util.find_spec(f"jax_plugins.xla_cuda{version}") is not None:
                return True
        except ImportError:  # no jax_plugins package at all
            return False
    return False


def configured_flags(gpu_flag_sets: list[str] | None, flags: list[str], gpu: bool) -> list[str]:
    """The flags a run asks for: its GPU sets (``None``: ``DEFAULT_GPU_FLAG_SETS``) when ``gpu``,
    then its raw ``flags``."""
    sets = DEFAULT_GPU_FLAG_SETS if gpu_flag_sets is None else tuple(gpu_flag_sets)
    unknown = [s for s in sets if s not in GPU_FLAG_SETS]
    if unknown:
        raise UserError(f"xla.gpu_flag_sets: unknown set(s) {unknown} (known: {', '.join(GPU_FLAG_SETS)})")
    out = [f for s in sets for f in GPU_FLAG_SETS[s]] if gpu else []
    for f in flags:
        if not isinstance(f, str) or not f.startswith("--xla_") or "=" not in f:
            raise UserError(f"xla.flags: {f!r} is not an XLA flag of the form --xla_NAME=VALUE")
    return out + list(flags)


def merged(user_flags: str, flags: list[str]) -> tuple[str, list[str]]:
    """``(XLA_FLAGS value, flags added)``: ``user_flags`` with ``flags`` appended, less those whose
    name the user already sets (theirs win) or an earlier one of ``flags`` set (the first wins)."""
    names = {flag_name(f) for f in shlex.split(user_flags)}
    added = []
    for f in flags:
        if flag_name(f) not in names:
            names.add(flag_name(f))
            added.append(f)
    return " ".join(([user_flags.strip()] if user_flags.strip() else []) + added), added


def check_known(flags: list[str]) -> None:
    """A ``UserError`` naming the first flag this jaxlib does not know (XLA would abort the process
    on it): a child process starts JAX's CPU backend with the flags."""
    if not flags:
        return
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    code = "import jax; jax.devices()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode == 0:
        return
    for line in done.stderr.splitlines():
        if "Unknown flag" in line or "Flag parsing failed" in line or "Illegal value" in line:
            raise UserError(f"xla flags: XLA refused them ({line.split('] ', 1)[-1].strip()})")
    raise UserError(f"xla flags: JAX did not start with XLA_FLAGS={' '.join(flags)!r}")


def apply(flags: list[str], environ=os.environ) -> list[str]:
    """Merges ``flags`` into ``environ['XLA_FLAGS']`` (the user's flags win) and returns those added.
    Refuses, with a ``UserError``, once a JAX backend has started: XLA would ignore them."""
    value, added = merged(environ.get("XLA_FLAGS", ""), flags)
    if not added:
        return []
    try:  # a private helper of JAX: without it, the check is skipped
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:
        backends_are_initialized = bool
    if backends_are_initialized():
        raise UserError("xla flags: a JAX backend is already running, so XLA would ignore them")
    check_known(added)
    environ["XLA_FLAGS"] = value
    return added
