"""The FP8 logit gradient of the LM head's backward from its recomputed logits, in one kernel.

Why. With ``lm_head_recompute_fp8`` the head's backward recomputes each chunk's logits by the FP8 GEMM (BF16 out)
and normalises them on their own log-sum-exp (``rl/scoring.py``). As XLA ops that is two passes over the [M, V]
logits: a reduction for the sum of the exponentials, then the fusion that forms the gradient, quantizes it to E5M2
and takes its amax. Both ran at about 0.8 G logits a millisecond on the H100 (llama1b: 1.3 + 2.3 ms a chunk of
8,192 x 128,256, 36 ms of a train minibatch): held by XLA's exp, not by the bytes. Here one kernel reads each row
twice (the second time mostly from L2) and writes the E5M2 gradient once.

What it computes, per row r of ``z`` [M, V] (the GEMM's output, unscaled), in f32, with ``x = z * inv_scale / T``
(the scaled logits), ``shift`` the forward's row max, ``g`` the cotangent of the target's logprob, ``y`` the target:

    lse = log(sum_v exp(x - shift));  p = exp((x - shift) - lse)
    dlogits = (onehot(y) * g - p * g) / T;  q = quantize(dlogits, g_scale)

and returns ``(q [M, V], amax(dlogits))``: the operands the head's dx and dW GEMMs take and the gradient's amax
for its delayed scale. q is ``recipe.quantize`` (saturate, round to nearest even).

The kernel (Pallas, Triton backend). ``programs`` programs (by default a few per SM) each take rows r = pid,
pid + programs, ...; a row is walked in blocks of ``block_v`` logits, first forwards for the sum, then backwards for
the gradient, so the blocks read last in the first pass (still in L2: the programs' rows in flight are ~256 kB
each at llama's vocabulary) are the first read again. A vocabulary that ``block_v`` does not divide ends in a block
that overlaps the one before it, masked to the logits that one did not cover. ``impl="xla"``: the same arithmetic
as XLA ops (CPU, and the reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.fp8.recipe import amax, quantize

IMPLS = ("auto", "pallas", "pallas_interpret", "xla")
BLOCK_V = 2048  # logits per block of a row
PROGRAMS_PER_SM = 2  # the default grid: this many programs per streaming multiprocessor
PREFETCH = 0  # passes=1: blocks of a row loaded ahead of the one computing
PASSES = 1
BLOCK_M = 4  # passes=2: rows per tile
NUM_WARPS = 8
NUM_STAGES = 2
LOG2E = 1.4426950408889634


def _shifted2(z, scale2, shift2):
    """``(x - shift) * log2(e)``: base-2 exponents (one exp2 per exponential, a single MUFU instruction on the GPU
    where exp is several), from ``scale2 = inv_scale * log2(e) / T`` and ``shift2 = shift * log2(e)``."""
    return z.astype(jnp.float32) * scale2 - shift2


def _grad(shifted2, lse2, onehot, g, temperature: float):
    """``dlogits`` from the base-2 shifted logits, their base-2 log-sum-exp and the target's one-hot mask."""
    p = jnp.exp2(shifted2 - lse2)
    dz = jnp.where(onehot, g, 0.0) - p * g
    return dz if temperature == 1.0 else dz / temperature


def _scales2(inv_scale, temperature: float):
    return inv_scale * (LOG2E / temperature)


def logit_grad_fp8(z: jax.Array, shift: jax.Array, g: jax.Array, targets: jax.Array, inv_scale: jax.Array,
                   g_scale: jax.Array, g_dtype, *, temperature: float = 1.0, impl: str = "auto",
                   block_v: int = BLOCK_V, programs: int | None = None, prefetch: int = PREFETCH, passes: int = PASSES,
                   block_m: int = BLOCK_M, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES):
    """The quantized logit gradient of the head's FP8 recompute (module docstring): ``z`` [M, V] the recomputed
    logits before their scales (any float dtype), ``shift`` [M] the forward's max of the scaled logits, ``g`` [M]
    the cotangents of the targets' logprobs, ``targets`` [M] int, ``inv_scale`` the logits' inverse scale
    ``1 / (s_x s_w)``, ``g_scale`` the gradient's delayed scale (``g_dtype``, E5M2 in ``hybrid``). Returns ``(q [M, V]
    g_dtype, amax f32)``. ``impl``: ``pallas`` (GPU), ``pallas_interpret`` (tests), ``xla``, ``auto`` (pallas on a
    GPU, else xla)."""
    if impl not in IMPLS:
        raise ValueError(f"logit_grad impl={impl!r}; allowed: {IMPLS}")
    if z.ndim != 2 or any(a.shape != z.shape[:1] for a in (shift, g, targets)):
        raise ValueError(f"logits [M, V] = {list(z.shape)} and shift / g / targets "
                         f"{[list(a.shape) for a in (shift, g, targets)]} (each [M]) do not match")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v} must be a power of two >= 16")
    inv_scale, g_scale = (jnp.asarray(s, jnp.float32).reshape(()) for s in (inv_scale, g_scale))
    shift, g, targets = shift.astype(jnp.float32), g.astype(jnp.float32), targets.astype(jnp.int32)
    temperature = float(temperature)
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl == "xla":
        if z.dtype != jnp.float32:  # the GEMM's rounding kept: XLA may fold a dot's f32 -> bf16 -> f32 away
            f = jnp.finfo(z.dtype)
            z = lax.reduce_precision(z.astype(jnp.float32), exponent_bits=f.nexp, mantissa_bits=f.nmant)
        shifted2 = _shifted2(z, _scales2(inv_scale, temperature), (shift * LOG2E)[:, None])
        lse2 = jnp.log2(jnp.sum(jnp.exp2(shifted2), axis=-1))
        onehot = lax.broadcasted_iota(jnp.int32, z.shape, 1) == targets[:, None]
        dl = _grad(shifted2, lse2[:, None], onehot, g[:, None], temperature)
        return quantize(dl, g_scale, g_dtype), amax(dl)
    m, v = z.shape
    block_v = min(block_v, 1 << (v.bit_length() - 1))  # at most V: the last block may overlap the one before
    if programs is None:
        cores = getattr(jax.devices()[0], "core_count", None) if impl == "pallas" else None
        programs = PROGRAMS_PER_SM * (cores or 64)
    programs = max(1, min(programs, m))
    if passes not in (1, 2):
        raise ValueError(f"logit_grad passes={passes!r}: 1 (one kernel) or 2 (a sums kernel, then the gradient's)")
    while m % block_m:  # the two-pass tiles' rows divide M
        block_m //= 2
    return _pallas(z, shift, g, targets, inv_scale, g_scale, jnp.dtype(g_dtype), temperature=temperature,
                   block_v=block_v, programs=programs, prefetch=prefetch, passes=passes, block_m=block_m,
                   num_warps=num_warps, num_stages=num_stages, interpret=impl == "pallas_interpret")


def _kernel(scalars_ref, z_ref, shift_ref, g_ref, y_ref, q_ref, amax_ref, *, m, v, block_v, programs, prefetch,
            temperature, g_dtype):
    """One pass over each row's blocks for the sum, one backwards for the gradient (``passes=1``)."""
    pid = pl.program_id(0)
    scale2, g_scale = _scales2(scalars_ref[0], temperature), scalars_ref[1]
    n_full, tail = divmod(v, block_v)
    offsets = jnp.arange(block_v)

    def row_body(k, amax_acc):
        # rows past the end repeat the last one (the same values written twice): no row masks
        r = jnp.minimum(pid + k * programs, m - 1)
        shift2, g, y = shift_ref[r] * LOG2E, g_ref[r], y_ref[r]

        def walk(start_of, fn, carry):
            """``fn(start, z, carry)`` over the row's whole blocks in the order ``start_of(i)``, the logits of the
            next ``prefetch`` blocks loaded ahead (loads in flight while this block computes)."""
            def load(i):
                return z_ref[r, pl.ds(start_of(jnp.minimum(i, n_full - 1)), block_v)]

            def body(i, state):
                carry, ahead = state
                if not prefetch:
                    return fn(start_of(i), load(i), carry), ahead
                loaded = load(i + prefetch)
                return fn(start_of(i), ahead[0], carry), (*ahead[1:], loaded)

            ahead = tuple(load(jnp.int32(i)) for i in range(prefetch))
            return lax.fori_loop(0, n_full, body, (carry, ahead))[0]

        def sum_block(start, z, acc, masked=False):
            e = jnp.exp2(_shifted2(z, scale2, shift2))
            return acc + (jnp.where(start + offsets >= n_full * block_v, e, 0.0) if masked else e)

        acc = walk(lambda i: i * block_v, sum_block, jnp.zeros((block_v,), jnp.float32))
        if tail:
            acc = sum_block(v - block_v, z_ref[r, pl.ds(v - block_v, block_v)], acc, masked=True)
        lse2 = jnp.log2(jnp.sum(acc))

        def grad_block(start, z, amax_acc, masked=False):
            dl = _grad(_shifted2(z, scale2, shift2), lse2, start + offsets == y, g, temperature)
            q = quantize(dl, g_scale, g_dtype)
            cols = pl.ds(start, block_v)
            if masked:
                in_v = start + offsets >= n_full * block_v
                plgpu.store(q_ref.at[r, cols], q, mask=in_v)
                dl = jnp.where(in_v, dl, 0.0)
            else:
                q_ref[r, cols] = q
            return jnp.maximum(amax_acc, jnp.abs(dl))

        # backwards: the blocks the sum read last are the likeliest still in L2
        if tail:
            amax_acc = grad_block(v - block_v, z_ref[r, pl.ds(v - block_v, block_v)], amax_acc, masked=True)
        return walk(lambda i: (n_full - 1 - i) * block_v, grad_block, amax_acc)

    amax_acc = lax.fori_loop(0, pl.cdiv(m, programs), row_body, jnp.zeros((block_v,), jnp.float32))
    amax_ref[pid] = jnp.max(amax_acc)


def _tile(z_ref, shift_ref, block_m, block_v, v):
    """Program (i, j)'s [block_m, block_v] tile of base-2 shifted logits' inputs: its rows, its first column (the
    last block of a row overlaps the one before it), the columns no earlier block covers, the logits."""
    i, j = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_m, block_m)
    start = jnp.minimum(j * block_v, v - block_v)
    cols = start + jnp.arange(block_v)
    return rows, start, cols, cols >= j * block_v, z_ref[rows, pl.ds(start, block_v)]


def _sums_kernel(scalars_ref, z_ref, shift_ref, sums_ref, *, block_m, block_v, v, temperature):
    """``passes=2``, the first: each tile's row sums of the exponentials."""
    rows, _, _, new, z = _tile(z_ref, shift_ref, block_m, block_v, v)
    e = jnp.exp2(_shifted2(z, _scales2(scalars_ref[0], temperature), (shift_ref[rows] * LOG2E)[:, None]))
    sums_ref[pl.program_id(1), rows] = jnp.sum(jnp.where(new[None, :], e, 0.0), axis=1)


def _grad_kernel(scalars_ref, z_ref, shift_ref, lse2_ref, g_ref, y_ref, q_ref, amax_ref, *, block_m, block_v, v,
                 temperature, g_dtype):
    """``passes=2``, the second: each tile's gradient, quantized, and its amax (the overlap written twice, alike)."""
    rows, start, cols, _, z = _tile(z_ref, shift_ref, block_m, block_v, v)
    x = _shifted2(z, _scales2(scalars_ref[0], temperature), (shift_ref[rows] * LOG2E)[:, None])
    dl = _grad(x, lse2_ref[rows][:, None], cols[None, :] == y_ref[rows][:, None], g_ref[rows][:, None], temperature)
    q_ref[rows, pl.ds(start, block_v)] = quantize(dl, scalars_ref[1], g_dtype)
    amax_ref[pl.program_id(0), pl.program_id(1)] = jnp.max(jnp.abs(dl))


def _pallas(z, shift, g, targets, inv_scale, g_scale, g_dtype, *, temperature, block_v, programs, prefetch, passes,
            block_m, num_warps, num_stages, interpret):
    m, v = z.shape
    scalars = jnp.stack([inv_scale, g_scale])
    params = dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                  interpret=interpret)
    if passes == 1:
        kernel = functools.partial(_kernel, m=m, v=v, block_v=block_v, programs=programs, prefetch=prefetch,
                                   temperature=temperature, g_dtype=g_dtype)
        q, amaxes = pl.pallas_call(
            kernel, grid=(programs,), name="logit_grad_fp8",
            out_shape=(jax.ShapeDtypeStruct((m, v), g_dtype),
                       jax.ShapeDtypeStruct((programs,), jnp.float32)),  # each program's amax
            **params)(scalars, z, shift, g, targets)
        return q, jnp.max(amaxes)
    grid = (m // block_m, pl.cdiv(v, block_v))
    tiles = dict(block_m=block_m, block_v=block_v, v=v, temperature=temperature)
    sums = pl.pallas_call(functools.partial(_sums_kernel, **tiles), grid=grid, name="logit_grad_sums",
                          out_shape=jax.ShapeDtypeStruct((grid[1], m), jnp.float32), **params)(scalars, z, shift)
    lse2 = jnp.log2(jnp.sum(sums, axis=0))
    q, amaxes = pl.pallas_call(
        functools.partial(_grad_kernel, g_dtype=g_dtype, **tiles), grid=grid, name="logit_grad_fp8",
        out_shape=(jax.ShapeDtypeStruct((m, v), g_dtype), jax.ShapeDtypeStruct(grid, jnp.float32)),
        **params)(scalars, z, shift, lse2, g, targets)
    return q, jnp.max(amaxes)
