"""The FP8 logit gradient of the LM head's backward from its recomputed logits: two Triton kernels.

Why. With ``lm_head_recompute_fp8`` the head's backward recomputes each chunk's logits by the FP8 GEMM (BF16 out)
and normalises them on their own log-sum-exp (``model/fp8_heads.py``). As XLA ops that was a reduction for the sum of
the exponentials, then the fusion that forms the gradient, quantizes it to E5M2 and takes its amax, then a byte
transpose of the E5M2 gradient for the weight gradient's GEMM: in a llama1b train minibatch's profile on the H100
1.3 + 2.3 + 0.7 ms a chunk of 8,192 x 128,256 logits (43 ms a minibatch); the two passes ran at about 0.8 G
logits a millisecond, held by XLA's exp (several instructions each), not by the bytes.

What it computes, per row r of ``z`` [M, V] (the GEMM's output, unscaled), in f32, with ``x = z * inv_scale / T``
(the scaled logits), ``shift`` the forward's row max, ``g`` the cotangent of the target's logprob, ``y`` the target:

    lse = log(sum_v exp(x - shift));  p = exp((x - shift) - lse)
    dlogits = (onehot(y) * g - p * g) / T;  q = quantize(dlogits, g_scale)

and returns ``(q [M, V], q^T [V, M] if asked, amax(dlogits))``: the operands the head's dx and dW GEMMs take and the
gradient's amax for its delayed scale. q is ``recipe.quantize`` (saturate, round to nearest even). The exponentials
are base 2 (``exp2(x * log2(e))``: one MUFU instruction each on the GPU).

The kernels (Pallas, Triton backend), both over a grid of [block_m, block_v] tiles: the first writes each tile's
row sums of the exponentials ([V / block_v, M], summed and logged by XLA: a few hundred kB), the second reads the
tile again and writes q, its transpose (Triton moves the tile through shared memory; 32 rows make each transposed
row a full 32-byte sector) and the tile's amax. A vocabulary that ``block_v`` does not divide ends in a tile that
overlaps the one before it (masked out of the sums; its gradient is written twice, the same values).
``impl="xla"``: the same arithmetic as XLA ops (CPU, meshes of several devices, and the reference).

Tried on the H100 and left out (benchmarks/RESULTS.md, "The LM head's backward in FP8"): one kernel walking each row
twice, the second time backwards so that its blocks might still be in L2, over 1-4 programs a streaming
multiprocessor, 1k-8k logits a block and 0-8 blocks loaded ahead: 2.08 ms at best for a llama1b chunk, the two
kernels 1.98 ms without the transposed store; neither held the rows in L2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.numerics import amax, quantize, rounded

IMPLS = ("auto", "pallas", "pallas_interpret", "xla")
BLOCK = (32, 256)  # rows, logits per tile
NUM_WARPS = 4
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
                   g_scale: jax.Array, g_dtype, *, temperature: float = 1.0, transposed: bool = False,
                   impl: str = "auto", block: tuple[int, int] = BLOCK, num_warps: int = NUM_WARPS):
    """The quantized logit gradient of the head's FP8 recompute (module docstring): ``z`` [M, V] the recomputed
    logits before their scales (any float dtype), ``shift`` [M] the forward's max of the scaled logits, ``g`` [M]
    the cotangents of the targets' logprobs, ``targets`` [M] int, ``inv_scale`` the logits' inverse scale
    ``1 / (s_x s_w)``, ``g_scale`` the gradient's delayed scale (``g_dtype``, E5M2 in ``hybrid``). Returns ``(q [M, V],
    q_t [V, M] or None, amax f32)``: ``q_t`` is q transposed (the weight gradient's token-minor operand), written
    by the kernels with ``transposed`` (the XLA form leaves it to the caller: None). ``impl``: ``pallas`` (GPU),
    ``pallas_interpret`` (tests), ``xla``, ``auto`` (pallas on a GPU without a mesh of several devices, else xla: a
    pallas_call is opaque to XLA's partitioner)."""
    if impl not in IMPLS:
        raise ValueError(f"logit_grad impl={impl!r}; allowed: {IMPLS}")
    if z.ndim != 2 or any(a.shape != z.shape[:1] for a in (shift, g, targets)):
        raise ValueError(f"logits [M, V] = {list(z.shape)} and shift / g / targets "
                         f"{[list(a.shape) for a in (shift, g, targets)]} (each [M]) do not match")
    block_m, block_v = block
    if any(b < 1 or b & (b - 1) for b in block) or block_v < 16:
        raise ValueError(f"block={block}: powers of two, at least 16 logits")
    inv_scale, g_scale = (jnp.asarray(s, jnp.float32).reshape(()) for s in (inv_scale, g_scale))
    shift, g, targets = shift.astype(jnp.float32), g.astype(jnp.float32), targets.astype(jnp.int32)
    temperature = float(temperature)
    if impl == "auto":
        from fp8rl_jax.parallel import rules

        mesh = rules.active_mesh()
        one_device = mesh is None or mesh.size == 1
        impl = "pallas" if jax.default_backend() == "gpu" and one_device and z.shape[1] >= 16 else "xla"
    if impl == "xla":
        if z.dtype != jnp.float32:  # the GEMM's rounding kept: XLA may fold a dot's f32 -> bf16 -> f32 away
            z = rounded(z, z.dtype)
        shifted2 = _shifted2(z, _scales2(inv_scale, temperature), (shift * LOG2E)[:, None])
        lse2 = jnp.log2(jnp.sum(jnp.exp2(shifted2), axis=-1))
        onehot = lax.broadcasted_iota(jnp.int32, z.shape, 1) == targets[:, None]
        dl = _grad(shifted2, lse2[:, None], onehot, g[:, None], temperature)
        return quantize(dl, g_scale, g_dtype), None, amax(dl)
    m, v = z.shape
    block_v = min(block_v, 1 << (v.bit_length() - 1))  # at most V: a row's last block may overlap the one before
    while m % block_m:  # the tiles' rows divide M
        block_m //= 2
    return _pallas(z, shift, g, targets, inv_scale, g_scale, jnp.dtype(g_dtype), temperature=temperature,
                   block=(block_m, block_v), transposed=transposed, num_warps=num_warps,
                   interpret=impl == "pallas_interpret")


def _tile(scalars_ref, z_ref, shift_ref, block_m, block_v, v, temperature):
    """Program (i, j)'s [block_m, block_v] tile: its rows, its first column (a row's last tile may overlap the one
    before it), its columns, which of them no earlier tile covers, and its base-2 shifted logits."""
    i, j = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_m, block_m)
    start = jnp.minimum(j * block_v, v - block_v)
    cols = start + jnp.arange(block_v)
    x = _shifted2(z_ref[rows, pl.ds(start, block_v)], _scales2(scalars_ref[0], temperature),
                  (shift_ref[rows] * LOG2E)[:, None])
    return rows, start, cols, cols >= j * block_v, x


def _sums_kernel(scalars_ref, z_ref, shift_ref, sums_ref, *, block_m, block_v, v, temperature):
    """The first kernel: each tile's row sums of the exponentials."""
    rows, _, _, new, x = _tile(scalars_ref, z_ref, shift_ref, block_m, block_v, v, temperature)
    sums_ref[pl.program_id(1), rows] = jnp.sum(jnp.where(new[None, :], jnp.exp2(x), 0.0), axis=1)


def _grad_kernel(scalars_ref, z_ref, shift_ref, lse2_ref, g_ref, y_ref, *out_refs, block_m, block_v, v, temperature,
                 g_dtype, transposed):
    """The second kernel: each tile's gradient, quantized (and transposed), and its amax (the overlap of a row's
    last block is written twice, with the same values)."""
    rows, start, cols, _, x = _tile(scalars_ref, z_ref, shift_ref, block_m, block_v, v, temperature)
    dl = _grad(x, lse2_ref[rows][:, None], cols[None, :] == y_ref[rows][:, None], g_ref[rows][:, None], temperature)
    q = quantize(dl, scalars_ref[1], g_dtype)
    out_refs[0][rows, pl.ds(start, block_v)] = q
    if transposed:
        out_refs[1][pl.ds(start, block_v), rows] = q.T
    out_refs[-1][pl.program_id(0), pl.program_id(1)] = jnp.max(jnp.abs(dl))


def _pallas(z, shift, g, targets, inv_scale, g_scale, g_dtype, *, temperature, block, transposed, num_warps,
            interpret):
    m, v = z.shape
    block_m, block_v = block
    scalars = jnp.stack([inv_scale, g_scale])
    grid = (m // block_m, pl.cdiv(v, block_v))
    params = dict(grid=grid, compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
                  interpret=interpret)
    tiles = dict(block_m=block_m, block_v=block_v, v=v, temperature=temperature)
    sums = pl.pallas_call(functools.partial(_sums_kernel, **tiles), name="logit_grad_sums",
                          out_shape=jax.ShapeDtypeStruct((grid[1], m), jnp.float32), **params)(scalars, z, shift)
    lse2 = jnp.log2(jnp.sum(sums, axis=0))
    out_shape = [jax.ShapeDtypeStruct((m, v), g_dtype), jax.ShapeDtypeStruct(grid, jnp.float32)]
    if transposed:
        out_shape.insert(1, jax.ShapeDtypeStruct((v, m), g_dtype))
    outs = pl.pallas_call(functools.partial(_grad_kernel, g_dtype=g_dtype, transposed=transposed, **tiles),
                          name="logit_grad_fp8", out_shape=tuple(out_shape), **params)(
        scalars, z, shift, lse2, g, targets)
    q, q_t, amaxes = outs if transposed else (outs[0], None, outs[1])
    return q, q_t, jnp.max(amaxes)
