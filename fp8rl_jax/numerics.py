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


def mantissa_rounded(x: jax.Array, dtype) -> jax.Array:
    """``x`` rounded to ``dtype``'s significand, ``1 + nmant`` bits (E4M3: 4, E5M2: 3), round to nearest even, with
    f32's exponent range instead of ``dtype``'s: no saturation at ``fp8_max``, no subnormals, nothing flushed to zero
    (down to f32's own limits, ~1e-38 and ~3e38). Held in f32. Inside the format's normal range (E4M3: 2**-6 to 448;
    E5M2: 2**-14 to 57344) this is the cast to it, ``float32(dtype(x))``, bit for bit; outside, the same relative
    rounding goes on. So it is what a scaling by powers of 2, of any granularity, makes of ``x`` at best (such a scale
    moves no significand). It is no bound for scales that are not powers of 2: those move the rounding grid, and a
    scale ``fp8_max / amax`` puts each group's amax on ``fp8_max`` exactly, where this rounds it (3000 -> 3072 in
    E4M3). The probe's ``scaling='mantissa'`` (``fp8.xla``); no kernel or checkpoint holds such values."""
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8,
                                    mantissa_bits=int(ml_dtypes.finfo(dtype).nmant))


def amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)
