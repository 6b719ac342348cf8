"""Block scaling's quantizations of one activation or gradient, from one read of it: 1 x 128 tiles along its
columns, and 1 x 128 tiles along its rows written transposed (the weight gradient's operand): the kernel behind
``fp8.block.tile_quantize_both``.

Why. Under ``precision.scaling=block`` a linear's forward needs its input x [M, K] in 1 x 128 tiles along K, and its
backward the output gradient g [M, N] in 1 x 128 tiles along N (the dgrad) and in 128 x 1 tiles along the tokens,
transposed to [N, M] (the wgrad: Hopper's FP8 MMA takes both operands K-major), and x in that second form too. As
XLA fusions (``block.tile_quantize`` of ``a`` and of ``a.T``) each form is an amax pass, a pass that turns the
amaxes into scales, and a quantizing pass (and a transpose of the values for the second form): at a decode step's
sizes three kernel launches a linear, at a training step's about a quarter of the GPU's memory bandwidth
(benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper"). A tile of either form lies inside one [128, 128] block of
``a``, so one program per block has every amax it needs: it reads the block once and writes both forms. So does
the second form in 128 x 128 blocks (``col_blocks``: the weight gradient's g under ``Fp8Recipe.block_wgrad``'s
default), one scale a program.

What it computes: exactly ``block.tile_quantize(a)`` and ``block.tile_quantize(a.T)``, the same bits. The scales
are ``block.scales_of``'s: ``recipe.scale_from_amax`` (``fp8_max / amax``, F32_MAX where that overflows, 1 for an
all-zero tile) and its inverse; the quantization ``numerics.quantize`` (an f32 multiply, a clip, a cast that rounds
to nearest even). The divisions are Triton's f32 division, which on a GPU gives XLA's quotients bit for bit (on an
H200, every tile of the GPU test): neither rounds as IEEE does. PTX's ``div.rn.f32`` in the kernel made scales 1-2
ulp away from XLA's (numpy's, correctly rounded, matched it instead), so it is not used: the kernel's tiles must
equal those XLA makes wherever the kernel does not run (sizes 128 does not divide, a mesh), since a rollout and a
trainer may quantize one tensor each way. Through Pallas' interpreter the division is XLA's on that platform.

The kernel (Pallas, Triton backend, as ``kernels.transpose``). Grid ``(P / 128, C / 128)``: a program holds one [128,
128] block, takes its 128 row maxima and its 128 column maxima, and stores the forms asked for (the second transposed)
with their inverse scales (laid [C / 128, P] and [P / 128, C]: a program writes one contiguous row of each). The
forward's form alone at a decode step's few rows takes programs of fewer rows (``SMALL_ROWS_BLOCK``), whose 1 x 128
tiles need no more. ``fits`` says where it runs: a GPU, sizes that 128 divides, no mesh of several devices (a
``pallas_call`` has no partitioning rule); elsewhere ``block.tile_quantize_both`` takes XLA's form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.numerics import fp8_max, quantize

TILE = 128  # block.BLOCK
NUM_WARPS = 8
# The rows form alone of at most SMALL_ROWS rows (a decode step's 256 slots) takes programs of SMALL_ROWS_BLOCK rows:
# on an H200 a [256, 2048] input's 1 x 128 tiles took 1 us of kernel time this way against 2 with [128, 128] programs,
# and [256, 8192]'s 2 us either way (benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper")
SMALL_ROWS, SMALL_ROWS_BLOCK = 256, 32


def _one_gpu() -> bool:
    """A GPU backend and no mesh of several devices (a ``pallas_call`` has no partitioning rule)."""
    if jax.default_backend() != "gpu":
        return False
    from fp8rl_jax.parallel import rules

    return rules.active_mesh() is None


def fits(a: jax.Array) -> bool:
    """Whether the kernels run for ``a`` here: a GPU, a 2-D array whose sizes 128 divides, no mesh of several
    devices."""
    return _tiled(a) and _one_gpu()


def _tiled(a: jax.Array) -> bool:
    """``a`` is [P, C] with 128 dividing both: whole tiles only."""
    return a.ndim == 2 and a.shape[0] % TILE == 0 and a.shape[1] % TILE == 0


def _check(a):
    if not _tiled(a):
        raise ValueError(f"block quantize kernels take [P, C] with 128 dividing both, not {list(a.shape)}")


def tile_scales(amax: jax.Array, limit: float) -> tuple[jax.Array, jax.Array]:
    """``block.scales_of(amax)`` inside a kernel (and in XLA where the decode attention's kernel leaves its output's
    tiles to XLA): ``recipe.scale_from_amax(amax, 1.0, limit)`` (margin 0) and its inverse. amax >= 0 here; ``< inf``
    is ``isfinite`` for it (False for NaN too)."""
    fresh = jnp.float32(limit) / amax
    fresh = jnp.where(fresh == jnp.inf, jnp.finfo(jnp.float32).max, fresh)  # recipe.F32_MAX
    scale = jnp.where((amax > 0) & (amax < jnp.inf), fresh, 1.0)
    return scale, 1.0 / scale


def row_tiles(t: jax.Array, limit: float, dtype) -> tuple[jax.Array, jax.Array]:
    """A [R, 128] f32 block inside a kernel in 1 x 128 tiles, a scale a row: (FP8 values [R, 128], inverse
    scales [R])."""
    scale, inv = tile_scales(jnp.max(jnp.abs(t), axis=1), limit)
    return quantize(t, scale[:, None], dtype), inv


def col_tiles(t: jax.Array, limit: float, dtype) -> tuple[jax.Array, jax.Array]:
    """The same block in 128 x 1 tiles, a scale a column, written transposed: (FP8 values [128, 128] of ``t.T``,
    inverse scales [128])."""
    scale, inv = tile_scales(jnp.max(jnp.abs(t), axis=0), limit)
    return quantize(t, scale[None, :], dtype).T, inv


def block_tile(t: jax.Array, limit: float, dtype) -> tuple[jax.Array, jax.Array]:
    """The same [128, 128] block under one scale, written transposed: (FP8 values [128, 128] of ``t.T``, its inverse
    scale [1])."""
    scale, inv = tile_scales(jnp.max(jnp.abs(t)), limit)
    return quantize(t, scale, dtype).T, inv.reshape(1)


def quantize_tiles(a: jax.Array, dtype, *, rows: bool = True, cols: bool = True, col_blocks: bool = False,
                   interpret: bool = False, num_warps: int = NUM_WARPS, block_rows: int | None = None):
    """``a`` [P, C] -> ``[q, row_inv_t]`` (with ``rows``: ``a`` in 1 x 128 tiles along C, ``dtype`` [P, C], and the
    tiles' inverse scales laid [C / 128, P]) followed by ``[qt, col_inv]`` (with ``cols``: ``a`` in 128 x 1 tiles
    along P, written transposed [C, P], and their inverse scales [P / 128, C]; with ``col_blocks`` too, ``a`` in
    128 x 128 blocks instead, written transposed, and their inverse scales [P / 128, C / 128]), from one read of ``a``.
    ``block_rows``: the rows a program holds (a power of 2 dividing P; below 128 for the rows form alone, whose tiles
    span one row: more programs for a decode step's few rows); None: SMALL_ROWS_BLOCK for the rows form alone of at
    most SMALL_ROWS rows, else 128."""
    _check(a)
    if not (rows or cols):
        raise ValueError("quantize_tiles: ask for rows, cols or both")
    if col_blocks and not cols:
        raise ValueError("quantize_tiles: col_blocks is a form of cols")
    p, c = a.shape
    if block_rows is None:
        block_rows = SMALL_ROWS_BLOCK if not cols and p <= SMALL_ROWS else TILE
    if block_rows != TILE and (cols or block_rows > TILE or block_rows & (block_rows - 1) or p % block_rows):
        raise ValueError(f"quantize_tiles block_rows={block_rows}: below 128 it takes the rows form alone, a power of "
                         f"2 dividing the {p} rows")
    dtype = jnp.dtype(dtype)
    limit = float(fp8_max(dtype))
    tile = pl.BlockSpec((block_rows, TILE), lambda i, j: (i, j))
    out_specs, out_shape = [], []
    if rows:
        out_specs += [tile, pl.BlockSpec((1, block_rows), lambda i, j: (j, i))]
        out_shape += [jax.ShapeDtypeStruct((p, c), dtype), jax.ShapeDtypeStruct((c // TILE, p), jnp.float32)]
    if cols:
        width = 1 if col_blocks else TILE  # inverse scales a block
        out_specs += [pl.BlockSpec((TILE, TILE), lambda i, j: (j, i)), pl.BlockSpec((1, width), lambda i, j: (i, j))]
        out_shape += [jax.ShapeDtypeStruct((c, p), dtype),
                      jax.ShapeDtypeStruct((p // TILE, c // TILE if col_blocks else c), jnp.float32)]

    def kernel(a_ref, *out):
        t = a_ref[...].astype(jnp.float32)  # [block_rows, 128]
        if rows:
            q_ref, inv_ref, *out = out
            q_ref[...], inv = row_tiles(t, limit, dtype)
            inv_ref[...] = inv[None, :]
        if cols:
            qt_ref, inv_ref = out
            qt_ref[...], inv = (block_tile if col_blocks else col_tiles)(t, limit, dtype)
            inv_ref[...] = inv[None, :]

    return pl.pallas_call(
        kernel,
        grid=(p // block_rows, c // TILE),
        in_specs=[tile],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="block_tile_quantize",
    )(a)


# norm_tiles' rows a program (with 4 warps): on an H200 at llama1b's width, 2 rows took 3 us at a decode step's 256 rows
# (as did 1 and 4, with 2 to 8 warps) and 0.069 ms at a prefill's 16,384 (1 to 4 rows, 2 to 8 warps: 0.066-0.073)
# (benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper")
NORM_ROWS = 2


def _norm_width(x: jax.Array) -> bool:
    """``x`` is [P, C] with C 128 times a power of 2."""
    tiles = x.shape[-1] // TILE if x.ndim == 2 and x.shape[-1] % TILE == 0 else 0
    return tiles > 0 and tiles & (tiles - 1) == 0


def norm_fits(x: jax.Array) -> bool:
    """Whether ``norm_tiles`` runs for ``x`` [P, C] here: a GPU, C 128 times a power of 2 (2048, 4096), no mesh of
    several devices."""
    return _norm_width(x) and _one_gpu()


def norm_rows(p: int) -> int:
    """``norm_tiles``' default rows a program for ``p`` rows: the largest power of 2 up to NORM_ROWS that divides
    ``p``."""
    rows = NORM_ROWS
    while p % rows:
        rows //= 2
    return rows


def norm_tiles(x: jax.Array, weight: jax.Array, eps: float, dtype, *, add: jax.Array | None = None, h_dtype=None,
               rows_per_program: int | None = None, num_warps: int = 4, interpret: bool = False):
    """RMSNorm of ``x`` [P, C] (plus ``add`` [P, C], the sum rounded to x's dtype first: the residual stream) in 1 x
    128 tiles, from one kernel: ``(s, q, inv_t)`` with ``s`` = x + add in x's dtype (None without ``add``), ``q`` the
    normed value's tiles in ``dtype`` [P, C] and their inverse scales laid [C / 128, P] (``quantize_tiles``' rows
    form).

    The normed value is ``model.norm.rms_norm``'s arithmetic: ``h = (w * (s * rsqrt(mean(s^2) + eps)))`` in f32,
    rounded to ``h_dtype`` (default x's dtype), then ``row_tiles``. One difference: the sum of squares is added in
    another order than XLA's reduction, so ``rsqrt`` may differ from XLA's in its last bit and then an element of h
    by one unit of ``h_dtype`` (rarely: 9-15 FP8 values of 33.5 million moved at a prefill's 16,384 rows on an H200,
    none at a decode step's 256: ``benchmarks/norm_tiles_speed.py``). Where XLA and this kernel each make a
    linear's input (a rollout against a trainer) their operands may differ there, as any two GEMM shapes' do.

    Why: at a decode step each kernel costs about its launch. The residual add and the RMSNorm as XLA fusions, then
    ``quantize_tiles`` of the norm's output, are a kernel or two more where per-tensor scaling's cast rides in the
    norm's fusion. A program holds ``rows_per_program`` whole rows (default ``norm_rows``) in registers, loaded at
    once: a walk over their tiles, loads and stores in turn, was latency-bound (benchmarks/RESULTS.md). C / 128 is a
    power of 2 (Triton's blocks are; ``norm_fits``)."""
    if not _norm_width(x):
        raise ValueError(f"norm_tiles takes x [P, C] with C 128 times a power of 2, not {list(x.shape)}")
    p, c = x.shape
    if weight.shape != (c,) or (add is not None and add.shape != x.shape):
        raise ValueError(f"norm_tiles: weight must be [{c}] and add [{p}, {c}], not "
                         f"{list(weight.shape)} and {None if add is None else list(add.shape)}")
    rows = rows_per_program or norm_rows(p)
    if rows & (rows - 1) or p % rows:
        raise ValueError(f"norm_tiles rows_per_program={rows}: a power of 2 dividing the {p} rows")
    dtype, h_dtype, n_tiles = jnp.dtype(dtype), jnp.dtype(h_dtype or x.dtype), c // TILE
    limit = float(fp8_max(dtype))

    def kernel(*refs):
        if add is None:
            x_ref, w_ref, q_ref, inv_ref = refs
            t = x_ref[...]  # [R, C]
        else:
            x_ref, a_ref, w_ref, s_ref, q_ref, inv_ref = refs
            t = (x_ref[...].astype(jnp.float32) + a_ref[...].astype(jnp.float32)).astype(x_ref.dtype)
            s_ref[...] = t
        t = t.astype(jnp.float32)
        r = jax.lax.rsqrt(jnp.sum(t * t, axis=1) / jnp.float32(c) + jnp.float32(eps))  # [R]
        h = (w_ref[...].astype(jnp.float32)[None, :] * (t * r[:, None])).astype(h_dtype).astype(jnp.float32)
        # [R, C] -> [R Cb, 128]: a tile a row
        q, inv = row_tiles(h.reshape(rows * n_tiles, TILE), limit, dtype)
        q_ref[...] = q.reshape(rows, c)
        inv_ref[...] = inv.reshape(rows, n_tiles).T

    whole = pl.BlockSpec((rows, c), lambda i: (i, 0))
    in_specs = [whole] + ([whole] if add is not None else []) + [pl.BlockSpec((c,), lambda i: (0,))]
    out_specs = ([whole] if add is not None else []) + [whole, pl.BlockSpec((n_tiles, rows), lambda i: (0, i))]
    out_shape = ([jax.ShapeDtypeStruct((p, c), x.dtype)] if add is not None else []) + [
        jax.ShapeDtypeStruct((p, c), dtype), jax.ShapeDtypeStruct((n_tiles, p), jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=(p // rows,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="norm_tiles",
    )(x, *([add] if add is not None else []), weight)
    return (out[0] if add is not None else None), out[-2], out[-1]
