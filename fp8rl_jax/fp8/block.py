"""Block-scaled FP8 (DeepSeek-V3, arXiv 2412.19437, section 3.3): the tile quantizers and the GEMM, emulated exactly.

Design note
-----------
Tiles. An activation (or an output gradient) is scaled per 1 x 128 tile, one row by 128 consecutive columns of
its contraction axis; a weight per 128 x 128 block. Every tile and block has an f32 scale ``fp8_max / amax`` from
its own current amax (``recipe.scale_from_amax``: an all-zero tile gets scale 1). Scales are not rounded to powers
of 2, as in DeepSeek-V3; Transformer Engine's ``Float8BlockScaling`` rounds them by default. A massive activation
(SmolLM2's ~3000 at the input of ``w_down``) then coarsens its own tile only, where one scale per tensor pushes
the rest of the tensor into E4M3's subnormals.

The GEMM. Scales that change along the contraction axis do not factor out of the sum: the product is accumulated
per 128-wide slice of the contraction axis in f32, each partial sum is multiplied by its two scales and added to
the f32 result, slice after slice in order (DeepGEMM's promotion to f32 every 128 K-steps). The product of two
FP8 values is exact in f32, so f32's additions are the only roundings: inside a slice (in the dot's own order) and
across slices (in order). ``block_gemm`` takes operands in the GEMM form of ``xla.gemm_operand`` (float8, or
their exact f32 values on a CPU).

The three GEMMs of a linear (``xla.py``), E4M3 throughout (``fp8_format='e4m3'``, DeepSeek-V3's recipe: with scales
this fine E4M3 has the range a per-tensor gradient needs E5M2 for; ``hybrid`` keeps E5M2 gradients):
  fprop  y  = x . w      x [M, K] in 1 x 128 tiles along K; w in 128 x 128 blocks
  dgrad  dx = g . w^T    g [M, N] in 1 x 128 tiles along N; w's blocks, the same FP8 values as the forward's
  wgrad  dw = x^T . g    x and g quantized again from their high-precision values, never from the forward's FP8
                         values: x in 128 x 1 tiles (each channel's 128 consecutive tokens: the contraction axis
                         here), g in 128 x 128 blocks (``Fp8Recipe.block_wgrad``'s default, ``grad_blocks``: one
                         operand in blocks, as the weight is in the other two GEMMs, the form Hopper's block-scaled
                         GEMMs run fastest) or, as DeepSeek-V3 does, in 128 x 1 tiles too (``block_wgrad='tiles'``)

Sizes that are not multiples of 128 (SmolLM2's hidden size 576 = 4.5 x 128, any token count) are padded with zeros
to the next multiple inside these functions: a zero changes no amax and adds nothing to a sum, so the last tile is
exactly a tile of the values it has. Arrays leave at their own sizes; a weight's scales are [ceil(N/128),
ceil(K/128)].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8.recipe import scale_from_amax
from fp8rl_jax.numerics import fp8_max, quantize

BLOCK = 128
# ``block_gemm``'s slice products made by one batched dot (f32 bytes at most; 0: one slice a step): a loop of one
# 128-deep dot a slice is launch-bound on a GPU (a train step's wgrad alone loops over every 128 tokens)
GROUP_BYTES = 256 * 2**20


class Tiles(NamedTuple):
    """An activation already in its 1 x 128 tiles (``tile_quantize``'s form), as a kernel made it for the next
    linear's forward GEMM: FP8 values ``q`` [..., K] and inverse scales ``scale_inv`` [..., ceil(K / 128)].
    ``linear`` takes it with block scaling's pre-quantized kernel (``xla.tiles_matmul``)."""

    q: jax.Array
    scale_inv: jax.Array


def num_blocks(n: int) -> int:
    """Tiles of ``BLOCK`` that cover ``n`` (the last one partial)."""
    return -(-n // BLOCK)


def _padded(a: jax.Array, axis: int) -> jax.Array:
    """``a`` with zeros after its end along ``axis``, up to a multiple of ``BLOCK``."""
    axis = axis % a.ndim
    extra = num_blocks(a.shape[axis]) * BLOCK - a.shape[axis]
    if extra == 0:
        return a
    return jnp.pad(a, [(0, extra if i == axis else 0) for i in range(a.ndim)])


def scales_of(amax: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(scale, 1 / scale), f32, of each tile's current amax; scale 1 for an all-zero tile."""
    scale = scale_from_amax(amax, 1.0, fp8_max(dtype))
    return scale, 1.0 / scale


def tile_quantize(a: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``a`` [..., C] in 1 x 128 tiles along its last axis: (FP8 values [..., C] in ``dtype``, inverse scales
    [..., ceil(C / 128)] f32)."""
    c = a.shape[-1]
    # [..., C] -> [..., Cb, 128]
    t = _padded(a.astype(jnp.float32), -1).reshape(*a.shape[:-1], num_blocks(c), BLOCK)
    scale, scale_inv = scales_of(jnp.max(jnp.abs(t), axis=-1), dtype)
    q = quantize(t, scale[..., None], dtype)
    # [..., Cb, 128] -> [..., C]
    return q.reshape(*a.shape[:-1], -1)[..., :c], scale_inv


IMPLS = ("auto", "pallas", "pallas_interpret", "xla")


def tile_quantize_both(a: jax.Array, dtype, *, rows: bool = True, cols: bool = True, col_blocks: bool = False,
                       impl: str = "auto"):
    """``(tile_quantize(a) or None, tile_quantize(a.T) or None)`` for ``a`` [P, C]: the forward's form of an input
    (``cols=False``), the dgrad's and the wgrad's forms of an output gradient (both), or the wgrad's form of an
    input (``rows=False``). ``col_blocks``: the second form is ``block_quantize(a.T)`` instead (128 x 128 blocks,
    inverse scales [Cb, Pb]: ``Fp8Recipe.block_wgrad='grad_blocks'``'s gradient). ``impl``: ``pallas``
    (``kernels.block_quantize``: one read of ``a`` for the forms asked, GPU), ``pallas_interpret`` (the same
    through Pallas' interpreter, tests), ``xla`` (``tile_quantize``, ``block_quantize``), ``auto`` (pallas where
    ``block_quantize.fits``, else xla). The same bits every way."""
    from fp8rl_jax.kernels import block_quantize as kernels

    if impl not in IMPLS:
        raise ValueError(f"tile_quantize_both impl={impl!r}; allowed: {IMPLS}")
    if col_blocks and not cols:
        raise ValueError("tile_quantize_both: col_blocks is a form of cols")
    if impl == "auto":
        impl = "pallas" if kernels.fits(a) else "xla"
    if impl == "xla":
        second = block_quantize if col_blocks else tile_quantize
        return (tile_quantize(a, dtype) if rows else None), (second(jnp.swapaxes(a, 0, 1), dtype) if cols else None)
    out = list(kernels.quantize_tiles(a, dtype, rows=rows, cols=cols, col_blocks=col_blocks,
                                      interpret=impl == "pallas_interpret"))
    row_form = (out.pop(0), jnp.swapaxes(out.pop(0), 0, 1)) if rows else None  # inverse scales [P, Cb]
    col_form = (out.pop(0), jnp.swapaxes(out.pop(0), 0, 1)) if cols else None  # [C, Pb], or [Cb, Pb] in blocks
    return row_form, col_form


def block_quantize(w: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``w`` [..., R, C] in 128 x 128 blocks: (FP8 values [..., R, C] in ``dtype``, inverse scales [..., ceil(R / 128),
    ceil(C / 128)] f32). A block is the same block of ``w``'s transpose: ``block_quantize(w.T)`` is the transpose
    of this, values and scales."""
    *lead, r, c = w.shape
    rb, cb = num_blocks(r), num_blocks(c)
    # [..., R, C] -> [..., Rb, 128, Cb, 128]
    t = _padded(_padded(w.astype(jnp.float32), -2), -1).reshape(*lead, rb, BLOCK, cb, BLOCK)
    scale, scale_inv = scales_of(jnp.max(jnp.abs(t), axis=(-3, -1)), dtype)
    q = quantize(t, scale[..., :, None, :, None], dtype)
    # [..., Rb, 128, Cb, 128] -> [..., R, C]
    return q.reshape(*lead, rb * BLOCK, cb * BLOCK)[..., :r, :c], scale_inv


def block_rows(scale_inv: jax.Array, rows: int) -> jax.Array:
    """A weight's block scales [..., Rb, Cb] as one row of scales per weight row [..., R, Cb] (``block_gemm``'s
    form). Scales already in that form (``R`` rows: a rollout kernel whose rows were reordered for tensor
    parallelism, ``rollout.weights.interleave_fused``) come back as they are."""
    if scale_inv.shape[-2] == rows:
        return scale_inv
    return jnp.repeat(scale_inv, BLOCK, axis=-2)[..., :rows, :]


def block_gemm(qa: jax.Array, a_scale_inv: jax.Array, qb: jax.Array, b_scale_inv: jax.Array) -> jax.Array:
    """``sum_c (qa [P, C] . qb [Q, C]^T over slice c) * a_scale_inv[:, c] b_scale_inv[:, c]`` -> [P, Q] f32: both
    operands contracted over their last axis C, scaled per row and per 128-wide slice of C (``[P, Cb]``,
    ``[Q, Cb]``); each slice's product accumulated in f32, scaled, and added to the result in the order of C."""
    p, c = qa.shape
    q = qb.shape[0]
    cb = num_blocks(c)
    # g slices a step (their products [g, P, Q] f32 within GROUP_BYTES): one batched dot, then added in order
    groups = -(-cb // max(1, min(cb, GROUP_BYTES // (4 * p * q))))
    g = -(-cb // groups)
    width = groups * g * BLOCK  # zero slices past C (zero scales too): each adds +0
    # [P, C] -> [groups, g, P, 128] and [Q, C] -> [groups, g, Q, 128]: the slices of the contraction axis in order
    a = jnp.pad(qa, ((0, 0), (0, width - c))).reshape(p, groups, g, BLOCK).transpose(1, 2, 0, 3)
    b = jnp.pad(qb, ((0, 0), (0, width - c))).reshape(q, groups, g, BLOCK).transpose(1, 2, 0, 3)
    # scales [P, Cb] -> [groups, g, P]
    sa = jnp.pad(a_scale_inv.T.astype(jnp.float32), ((0, groups * g - cb), (0, 0))).reshape(groups, g, p)
    sb = jnp.pad(b_scale_inv.T.astype(jnp.float32), ((0, groups * g - cb), (0, 0))).reshape(groups, g, q)

    def step(acc, group):
        a_g, b_g, sa_g, sb_g = group
        parts = lax.dot_general(a_g, b_g, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        for i in range(g):  # [P, Q] each
            acc = acc + parts[i] * (sa_g[i][:, None] * sb_g[i][None, :])
        return acc, None

    y, _ = lax.scan(step, jnp.zeros((p, q), jnp.float32), (a, b, sa, sb))
    return y
