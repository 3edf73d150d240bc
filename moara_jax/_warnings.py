"""This package's own warnings, and a way to trace an ``init`` again without repeating them.

Sizing a state (``jax.eval_shape`` of an ``init`` that runs right after) and diagnosing an update
that does not fit its state trace ``init`` once more; the warnings it gives (a rank clipped, no
target, no rank moved) were given when the state was made. :func:`quiet` holds them back in the
current thread (a context variable), where ``warnings.catch_warnings`` would change the process's
warning filters for every thread."""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import warnings
from collections.abc import Iterator

_QUIET = contextvars.ContextVar("moara_jax_quiet", default=False)


def warn(message: str) -> None:
    """``warnings.warn(message, UserWarning)``, unless inside :func:`quiet`, attributed to the
    first frame outside this package and the libraries that call into it (JAX's tracing and tree
    maps, optax's and flax's wrappers): the user's line that made or stepped the optimizer,
    however deep the wrapping."""
    if _QUIET.get():
        return
    internal = _internal_dirs()
    depth = 1
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, depth = frame.f_back, depth + 1
    warnings.warn(message, UserWarning, stacklevel=depth + 1 if frame is not None else 1)


def _internal_dirs() -> tuple[str, ...]:
    """The directories of this package and of the libraries between it and the user's code."""
    dirs = [os.path.dirname(__file__) + os.sep]
    for name in ("jax", "jaxlib", "optax", "flax", "chex", "equinox"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(module.__file__) + os.sep)
    return tuple(dirs)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """This package's warnings held back in this thread (and context) while inside."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)
