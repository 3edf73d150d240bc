"""This package's own warnings, and a way to trace an ``init`` again without repeating them.

Sizing a state (``jax.eval_shape`` of an ``init`` that runs right after) and diagnosing an update
that does not fit its state trace ``init`` once more; the warnings it gives (a rank clipped, no
target, no rank moved) were given when the state was made. :func:`quiet` holds them back in the
current thread (a context variable), where ``warnings.catch_warnings`` would change the process's
warning filters for every thread."""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator

_QUIET = contextvars.ContextVar("moara_jax_quiet", default=False)


def warn(message: str, stacklevel: int) -> None:
    """``warnings.warn(message, UserWarning, stacklevel)`` as called by the caller, unless inside
    :func:`quiet`."""
    if not _QUIET.get():
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """This package's warnings held back in this thread (and context) while inside."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)
