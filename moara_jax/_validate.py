"""Small argument validators shared by the stages, the Adams, the hosts' settings and the
allocation."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax.numpy as jnp


def is_int(value, minimum: int = 1) -> bool:
    """Whether ``value`` is an integer of any integer type (not bool) and at least ``minimum``."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= minimum


def real(value) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_block_size(block_size: int) -> int:
    """Validates ``block_size`` (any integer type, not bool) and returns it as a Python int."""
    if not is_int(block_size):
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    return int(block_size)


def check_adam(b1: float, b2: float, eps: float) -> None:
    """Validates Adam's ``b1``, ``b2``, ``eps`` when they are Python numbers (injected
    hyperparameters arrive as arrays and are not checked)."""
    for name, value, ok in (
        ("b1", b1, lambda v: 0.0 <= v < 1.0),
        ("b2", b2, lambda v: 0.0 <= v < 1.0),
        ("eps", eps, lambda v: v >= 0.0),
    ):
        if isinstance(value, (int, float)) and not ok(value):
            raise ValueError(f"{name} out of range: {value!r}")


def dtype_arg(name: str, value: Any) -> jnp.dtype | None:
    """``jnp.dtype(value)`` (``None`` stays ``None``), or a ``ValueError`` naming the argument."""
    if value is None:
        return None
    try:
        return jnp.dtype(value)
    except TypeError as err:
        raise ValueError(f"{name} must be a dtype, got {value!r}") from err
