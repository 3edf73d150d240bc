"""Shared test set-up: float32 matmuls at full precision, so oracle comparisons are meaningful."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
