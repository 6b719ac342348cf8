"""Block scaling's two quantizations of one activation or gradient: 1 x 128 tiles along its columns, and 1 x 128
tiles along its rows written transposed (the weight gradient's operand), from two reads of it: the kernels behind
``fp8.block.tile_quantize_both``.

Why. Under ``precision.scaling=block`` the backward of a linear needs the output gradient g [M, N] quantized in
1 x 128 tiles along N (the dgrad) and in 128 x 1 tiles along the tokens, transposed to [N, M] (the wgrad: Hopper's
FP8 MMA takes both operands K-major), and the input x [M, K] in the second form too. As XLA fusions
(``block.tile_quantize`` of ``a`` and of ``a.T``) those ran at about a quarter of the H100's memory bandwidth: a
transpose of the BF16 values, an amax pass and a quantizing pass for each form (benchmarks/RESULTS.md, "Block-scaled
FP8 on Hopper"). Here one kernel reads ``a`` once for both forms' tile amaxes (``tile_amaxes``), XLA turns the
amaxes into scales (``block.scales_of``: the same f32 division as block's quantizer, which Triton's fast division
would not round alike), and a second kernel reads ``a`` again and writes both FP8 forms, the second transposed
through shared memory (``quantize_tiles``).

What it computes: exactly ``block.tile_quantize(a)`` and ``block.tile_quantize(a.T)``, the same bits (the scales
are block's, the quantization ``numerics.quantize``: an f32 multiply, a clip, a cast that rounds to nearest even).

The kernels (Pallas, Triton backend, as ``kernels.transpose``). Grid ``(P / 128, C / 128)``: a program holds one
[128, 128] tile. The amax kernel writes its 128 row maxima (into [Cb, P]) and its 128 column maxima (into [Pb, C]);
the quantizing kernel multiplies the tile by its row scales and by its column scales and stores the two results,
the second transposed. ``fits`` says where they run: a GPU, sizes that 128 divides, no mesh of several devices (a
``pallas_call`` has no partitioning rule); elsewhere ``block.tile_quantize_both`` takes XLA's form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.numerics import quantize

TILE = 128  # block.BLOCK
NUM_WARPS = 8


def fits(a: jax.Array) -> bool:
    """Whether the kernels run for ``a`` here: a GPU, a 2-D array whose sizes 128 divides, no mesh of several
    devices."""
    if jax.default_backend() != "gpu" or not _tiled(a):
        return False
    from fp8rl_jax.parallel import rules

    return rules.active_mesh() is None


def _tiled(a: jax.Array) -> bool:
    """``a`` is [P, C] with 128 dividing both: whole tiles only."""
    return a.ndim == 2 and a.shape[0] % TILE == 0 and a.shape[1] % TILE == 0


def _check(a):
    if not _tiled(a):
        raise ValueError(f"block quantize kernels take [P, C] with 128 dividing both, not {list(a.shape)}")


def tile_amaxes(a: jax.Array, *, interpret: bool = False, num_warps: int = NUM_WARPS):
    """``a`` [P, C] -> (max |a| of each row over each 128-column tile, laid [C / 128, P]; of each column over each
    128-row tile, [P / 128, C]), f32, from one read of ``a``."""
    _check(a)
    p, c = a.shape

    def kernel(a_ref, row_ref, col_ref):
        t = jnp.abs(a_ref[...].astype(jnp.float32))  # [128, 128]
        row_ref[...] = jnp.max(t, axis=1)[None, :]
        col_ref[...] = jnp.max(t, axis=0)[None, :]

    return pl.pallas_call(
        kernel,
        grid=(p // TILE, c // TILE),
        in_specs=[pl.BlockSpec((TILE, TILE), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((1, TILE), lambda i, j: (j, i)), pl.BlockSpec((1, TILE), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((c // TILE, p), jnp.float32),
                   jax.ShapeDtypeStruct((p // TILE, c), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="block_tile_amaxes",
    )(a)


def quantize_tiles(a: jax.Array, row_scale_t: jax.Array | None, col_scale: jax.Array, dtype, *,
                   interpret: bool = False, num_warps: int = NUM_WARPS):
    """``a`` [P, C] times its 1 x 128 tiles' scales ``row_scale_t`` [C / 128, P] in ``dtype`` [P, C] (None where
    ``row_scale_t`` is None), and times its 128 x 1 tiles' scales ``col_scale`` [P / 128, C] in ``dtype``,
    transposed [C, P]: ``numerics.quantize`` of each, from one read of ``a``."""
    _check(a)
    p, c = a.shape
    dtype = jnp.dtype(dtype)
    rows = row_scale_t is not None
    tile = pl.BlockSpec((TILE, TILE), lambda i, j: (i, j))
    row_spec = pl.BlockSpec((1, TILE), lambda i, j: (j, i))
    col_spec = pl.BlockSpec((1, TILE), lambda i, j: (i, j))

    def kernel(*refs):
        a_ref, *row_ref, col_ref = refs[:3] if rows else refs[:2]
        *q_ref, qt_ref = refs[3:] if rows else refs[2:]
        t = a_ref[...].astype(jnp.float32)  # [128, 128]
        if rows:
            q_ref[0][...] = quantize(t, row_ref[0][...].T, dtype)  # [128, 1]: a scale a row
        qt_ref[...] = quantize(t, col_ref[...], dtype).T  # [1, 128]: a scale a column

    out_specs, out_shape = [pl.BlockSpec((TILE, TILE), lambda i, j: (j, i))], [jax.ShapeDtypeStruct((c, p), dtype)]
    if rows:
        out_specs, out_shape = [tile, *out_specs], [jax.ShapeDtypeStruct((p, c), dtype), *out_shape]
    out = pl.pallas_call(
        kernel,
        grid=(p // TILE, c // TILE),
        in_specs=[tile, row_spec, col_spec] if rows else [tile, col_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="block_tile_quantize",
    )(*([a, row_scale_t, col_scale] if rows else [a, col_scale]))
    return (out[0], out[1]) if rows else (None, out[0])
