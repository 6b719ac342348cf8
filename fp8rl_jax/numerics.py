"""The FP8 numerics below every FP8 layer: an FP8 dtype's max, the saturating cast, the rounding to a dtype's
precision, the amax.

One definition that the delayed-scaling recipe (``fp8.recipe``, which re-exports them: ``recipe.quantize`` is this
``quantize``), the FP8 backends, the LM heads and the Pallas kernels (``kernels``) all use, so a kernel's bits and
the XLA path's come from the same arithmetic. Pure JAX and ``ml_dtypes``; nothing of the package's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes


def fp8_max(dtype: Any) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(ml_dtypes.finfo(dtype).max)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Saturating cast of ``x * scale`` to FP8. The multiply is in f32, so the cast rounds once."""
    limit = fp8_max(dtype)
    y = x.astype(jnp.float32) * scale.astype(jnp.float32)
    return jnp.clip(y, -limit, limit).astype(dtype)


def rounded(x: jax.Array, dtype, hold=jnp.float32) -> jax.Array:
    """``x`` rounded to ``dtype``'s precision, held in ``hold`` (f32 by default): ``reduce_precision``, which XLA
    keeps, where it may fold an f32 -> BF16 -> f32 convert pair (or a GEMM's narrower output) away."""
    f = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x.astype(hold), exponent_bits=f.nexp, mantissa_bits=f.nmant)


def amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)
