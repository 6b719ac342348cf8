"""The decode step's residual add, RMSNorm and FP8 quantize in one kernel that writes both the residual and the GEMM
input.

Why. In the FP8 decode step each block adds a GEMM's f32 output into the residual stream and normalizes the sum for
the next FP8 GEMM. BF16's cuBLAS GEMMs take the residual add into their epilogue (``badd``); TE's FP8 GEMM has no C
operand, so XLA runs the add as a kernel of its own (the sum must be written: the stream goes on) and the RMSNorm +
quantize as another, which reads the sum back: 3.6 + 2.6 us a layer at batch 256 on the H100, against one kernel that
reads x and y once and writes the sum and the FP8 input (``benchmarks/RESULTS.md``, session 27).

``add_rms_norm_quantize(x, y, weight, eps, scale)``: ``s = x + y`` (f32) and ``quantize(rms_norm(s, weight, eps,
compute dtype), scale)``, the same arithmetic as ``llama.rms_norm`` followed by ``recipe.quantize`` (the norm's mean
is summed in another order, so the FP8 value can differ by one rounding step, rarely).

The kernel (Pallas, Triton backend): one program per ``ROWS`` rows of ``[M, D]`` (D a power of two), f32 in
registers. ``xla`` is the same in XLA ops (CPU, tests, shapes the kernel does not take).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.fp8.recipe import fp8_max, quantize

IMPLS = ("auto", "pallas", "pallas_interpret", "xla")
ROWS = 1  # rows per program (256 programs at batch 256: every SM streams)
NUM_WARPS = 4


def supported(d: int) -> bool:
    """Whether the kernel takes rows of ``d`` (a power of two, at least 16)."""
    return d >= 16 and not d & (d - 1)


def add_rms_norm_quantize(x: jax.Array, y: jax.Array, weight: jax.Array, eps: float, scale: jax.Array, *,
                          compute_dtype=jnp.bfloat16, fp8_dtype=jnp.float8_e4m3fn, impl: str = "auto"):
    """x, y [..., D] f32 (the residual stream and a GEMM's output), weight [D] -> (x + y [..., D] f32, the RMSNorm of
    it in ``compute_dtype`` quantized with ``scale`` to ``fp8_dtype`` [..., D]). ``impl``: ``pallas`` (GPU),
    ``pallas_interpret`` (the kernel through Pallas' interpreter), ``xla``, ``auto`` (pallas on a GPU where ``D``
    allows it)."""
    if impl not in IMPLS:
        raise ValueError(f"add_rms_norm_quantize impl={impl!r}; allowed: {IMPLS}")
    if x.shape != y.shape or x.dtype != jnp.float32 or y.dtype != jnp.float32:
        raise ValueError(f"x and y must be f32 of one shape, got {x.dtype}{x.shape} and {y.dtype}{y.shape}")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must be [D={d}], got {weight.shape}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" and supported(d) else "xla"
    scale = jnp.asarray(scale, jnp.float32)
    if impl == "xla":
        s = x + y
        s32 = s.astype(jnp.float32)
        h = (weight.astype(jnp.float32) * (s32 * lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps)))
        return s, quantize(h.astype(compute_dtype), scale, fp8_dtype)
    if not supported(d):
        raise ValueError(f"add_rms_norm_quantize kernel: D={d} is not a power of two >= 16; use impl='xla'")
    lead = x.shape[:-1]
    m = math.prod(lead)
    rows = ROWS
    kernel = functools.partial(_kernel, eps=float(eps), rows=rows, m=m, compute_dtype=jnp.dtype(compute_dtype),
                               limit=fp8_max(fp8_dtype))
    s, q = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, rows),),
        out_shape=(jax.ShapeDtypeStruct((m, d), jnp.float32), jax.ShapeDtypeStruct((m, d), jnp.dtype(fp8_dtype))),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=impl == "pallas_interpret",
        name="add_rms_norm_quantize",
    )(x.reshape(m, d), y.reshape(m, d), weight.astype(jnp.float32), scale.reshape(1))
    return s.reshape(x.shape), q.reshape(x.shape)


def _kernel(x_ref, y_ref, w_ref, scale_ref, s_ref, q_ref, *, eps: float, rows: int, m: int, compute_dtype,
            limit: float):
    """``rows`` rows: s = x + y stored, then each row's RMSNorm (f32, ``llama.rms_norm``'s order of operations),
    rounded to ``compute_dtype``, times the scale, clipped and stored as FP8."""
    start = pl.program_id(0) * rows
    block = pl.ds(start, rows)
    ok = (start + jnp.arange(rows)) < m  # the last program's rows past M
    x = plgpu.load(x_ref.at[block, :], mask=ok[:, None], other=0.0)
    y = plgpu.load(y_ref.at[block, :], mask=ok[:, None], other=0.0)
    s = x + y
    plgpu.store(s_ref.at[block, :], s, mask=ok[:, None])
    d = s.shape[-1]
    inv = lax.rsqrt(jnp.sum(s * s, axis=-1) / d + eps)
    h = (w_ref[...][None, :] * (s * inv[:, None])).astype(compute_dtype)
    q = jnp.clip(h.astype(jnp.float32) * scale_ref[0], -limit, limit)
    plgpu.store(q_ref.at[block, :], q.astype(q_ref.dtype), mask=ok[:, None])
