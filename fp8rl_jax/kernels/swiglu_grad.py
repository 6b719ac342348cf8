"""The SwiGLU's backward and the FP8 operands of the MLP's weight and data gradients, in one pass.

Why. In the te backend's training step the MLP's backward took three XLA fusions per layer and microbatch, each reading
the [M, 2F] gate/up GEMM output again (llama1b, the H100 profile in benchmarks/RESULTS.md, "Train-step kernels": 2.5 ms
of a layer's backward): one wrote the gate's gradient in BF16 with q(h) and amax(h) beside it, one concatenated the
gate's and the up's gradients and quantized them, one took their amax; then byte transposes made the token-minor copies
of q(h) and q(dgate_up) that the weight gradients need. Here one kernel reads the gate/up output and the gradient of h
once and writes every FP8 operand the three backward GEMMs take, with both amaxes.

What it computes, from ``gate_up`` [M, 2F] (gate | up) and ``g_h`` [M, F] (the gradient of h = silu(gate) * up),
in f32:

    s = sigmoid(gate);  h = gate * s * up
    dgate = g_h * up * s * (1 + gate * (1 - s));  dup = g_h * gate * s

and returns q(h)'s transpose [F, M] (the down projection's weight gradient: the backward needs no row-major q(h)),
q([dgate | dup]) [M, 2F] and its transpose [2F, M] (the gate/up projection's data and weight gradients), amax(h)
and amax([dgate | dup]). q is ``recipe.quantize`` (``saturate(v * scale)``, round to nearest even) with the scales
given. The forward's q(h) is XLA's (``jax.nn.silu(gate) * up`` in BF16, then quantized); this one is from the same
inputs in f32, so a value near a rounding boundary may land on the neighbouring FP8 value: the weight gradient of
the down projection sees the more exact h. The amaxes are those of the values quantized here.

The kernel (Pallas, Triton backend). Grid ``(M / block_m, F / block_f)``: a program loads one [block_m, block_f]
tile of the gate, of the up and of g_h, and stores q(dgate), q(dup) row-major, q(h), q(dgate), q(dup) transposed
(Triton moves those tiles through shared memory) and its column maxima of |h| and |dgate|, |dup| (XLA takes the
maximum of those, a few MB). ``impl="xla"``: the same arithmetic as XLA ops (CPU, and shapes the blocks do not
divide).

Block scaling (``swiglu_grad_tiles``, for ``fp8.block_mlp``): the same arithmetic, each operand quantized in its
tiles instead of with a delayed scale (``kernels.block_quantize``'s ``row_tiles``, ``col_tiles`` and
``block_tile``): h in 128 x 1 tiles along the tokens, transposed, and [dgate | dup] in 1 x 128 tiles and in 128 x
128 blocks (``Fp8Recipe.block_wgrad``'s default, ``grad_blocks``) or 128 x 1 tiles (``block_wgrad='tiles'``),
transposed. With the blocks one program holds a whole [128, 128] block of the gate, the up and g_h: it has every
amax. With the 128 x 1 tiles each block takes four programs (``CHUNK`` = 64): two of 64 rows for the 1 x 128 tiles,
two of 64 columns for the 128 x 1 tiles, each holding whole tiles of its form. On an H200 (a llama1b microbatch)
each way took 2.5-2.6 ms, where the other took 3.1-3.2 (benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper", with
what its time is spent on).

The forward under block scaling (``swiglu_tiles``, for ``fp8.block_mlp.swiglu_down``): h of the gate/up GEMM's output,
rounded to BF16 as the two linears hand it over, in 1 x 128 tiles (the down projection's input), from one read of
gate/up in programs of 32 rows, where XLA wrote h and the quantizer kernel read it again. Its sigmoid,
``1 / (1 + exp(-gate))``, gives XLA's f32 bits through Triton on every BF16 gate value (an H200; ``exp2`` and
``tanh`` forms do not: ``benchmarks/swiglu_tiles_speed.py --bits``), so its tiles are the XLA form's.

Measured on the H100 (``benchmarks/swiglu_grad.py``): it moves its bytes at 1.6-1.7 TB/s. Neither what
is transposed (the FP8 tiles, the f32 values before quantizing, the BF16 inputs with the arithmetic done again, or
32-bit words of four tokens' FP8 values), nor several row tiles per program with the next tile's loads issued
early, nor the block shape moved it beyond the noise (commit 5549d64 has those forms; benchmarks/RESULTS.md, "Train-step
kernels").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.kernels.block_quantize import SMALL_ROWS, TILE, block_tile, col_tiles, row_tiles
from fp8rl_jax.numerics import amax, fp8_max, quantize

IMPLS = ("auto", "pallas", "pallas_interpret", "xla")
BLOCK = (32, 64)  # tokens, intermediate columns per program (H100 sweep: benchmarks/swiglu_grad.py)
NUM_WARPS = 4
CHUNKS = (16, 32, 64, 128)  # swiglu_grad_tiles(chunk=): the rows or the columns a program takes of a [128, 128] block
CHUNK = 64
# swiglu_tiles: programs of 32 rows, 4 warps at a decode step's rows, 8 above; on an H200 0.49 ms for a llama1b
# microbatch's [40960, 16384] gate/up output (128 rows, 4 warps: 0.80), 4 us at a decode step's 256 rows
# (benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper")
SWIGLU_TILES_ROWS, SWIGLU_TILES_WARPS = 32, (4, 8)


def sigmoid(gate: jax.Array) -> jax.Array:
    """The SwiGLU's sigmoid of an f32 ``gate``, in every path that computes h: XLA's ops and a kernel's."""
    return 1.0 / (1.0 + jnp.exp(-gate))


def swiglu_h_f32(gate: jax.Array, up: jax.Array) -> jax.Array:
    """h = silu(gate) * up in f32 (``swiglu_math``'s h)."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return gate * sigmoid(gate) * up


def swiglu_math(gate: jax.Array, up: jax.Array, g_h: jax.Array):
    """h, dgate, dup in f32 from the gate, the up and the gradient of h."""
    gate, up, g_h = (a.astype(jnp.float32) for a in (gate, up, g_h))
    s = sigmoid(gate)
    gs = gate * s
    return gs * up, g_h * up * (s + gs * (1.0 - s)), g_h * gs


def swiglu_grad_fp8(gate_up: jax.Array, g_h: jax.Array, h_scale: jax.Array, g_scale: jax.Array, h_dtype, g_dtype, *,
                    impl: str = "auto", block: tuple[int, int] = BLOCK, num_warps: int = NUM_WARPS):
    """The FP8 operands of an MLP's backward GEMMs (module docstring): ``gate_up`` [M, 2F], ``g_h`` [M, F], the
    delayed scales of h (``h_dtype``, E4M3) and of the gate/up gradient (``g_dtype``). Returns ``(qh_t [F, M],
    qg [M, 2F], qg_t [2F, M], amax_h, amax_g)``. ``impl``: ``pallas`` (GPU), ``pallas_interpret`` (tests), ``xla``,
    ``auto`` (pallas on a GPU where the blocks divide the shapes, else xla)."""
    if impl not in IMPLS:
        raise ValueError(f"swiglu_grad impl={impl!r}; allowed: {IMPLS}")
    m, f2 = gate_up.shape
    f = f2 // 2
    if f2 % 2 or g_h.shape != (m, f):
        raise ValueError(f"gate_up [M, 2F] = {list(gate_up.shape)} and g_h [M, F] = {list(g_h.shape)} do not match")
    h_scale, g_scale = (jnp.asarray(s, jnp.float32).reshape(()) for s in (h_scale, g_scale))
    divides = m % block[0] == 0 and f % block[1] == 0
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" and divides else "xla"
    if impl == "xla":
        h, dgate, dup = swiglu_math(gate_up[:, :f], gate_up[:, f:], g_h)
        g = jnp.concatenate([dgate, dup], axis=1)
        qh, qg = quantize(h, h_scale, h_dtype), quantize(g, g_scale, g_dtype)
        return qh.T, qg, qg.T, amax(h), amax(g)
    if not divides:
        raise ValueError(f"swiglu_grad blocks {block} do not divide [M, F] = [{m}, {f}]")
    return _pallas(gate_up, g_h, h_scale, g_scale, jnp.dtype(h_dtype), jnp.dtype(g_dtype), block=block,
                   num_warps=num_warps, interpret=impl == "pallas_interpret")


def _pallas(gate_up, g_h, h_scale, g_scale, h_dtype, g_dtype, *, block, num_warps, interpret):
    m, f = g_h.shape
    bm, bf = block
    grid = (m // bm, f // bf)

    def kernel(scales_ref, gate_up_ref, g_h_ref, qh_t_ref, qg_ref, qg_t_ref, amax_h_ref, amax_g_ref):
        i, j = pl.program_id(0), pl.program_id(1)
        rows, cols = pl.ds(i * bm, bm), pl.ds(j * bf, bf)
        up_cols = pl.ds(f + j * bf, bf)
        h, dgate, dup = swiglu_math(gate_up_ref[rows, cols], gate_up_ref[rows, up_cols], g_h_ref[rows, cols])
        s_h, s_g = scales_ref[0], scales_ref[1]
        qh, qdgate, qdup = quantize(h, s_h, h_dtype), quantize(dgate, s_g, g_dtype), quantize(dup, s_g, g_dtype)
        qh_t_ref[cols, rows] = qh.T
        qg_ref[rows, cols] = qdgate
        qg_ref[rows, up_cols] = qdup
        qg_t_ref[cols, rows] = qdgate.T
        qg_t_ref[up_cols, rows] = qdup.T
        amax_h_ref[i, cols] = jnp.max(jnp.abs(h), axis=0)
        amax_g_ref[i, cols] = jnp.maximum(jnp.max(jnp.abs(dgate), axis=0), jnp.max(jnp.abs(dup), axis=0))

    qh_t, qg, qg_t, amax_h, amax_g = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=(
            jax.ShapeDtypeStruct((f, m), h_dtype),
            jax.ShapeDtypeStruct((m, 2 * f), g_dtype),
            jax.ShapeDtypeStruct((2 * f, m), g_dtype),
            jax.ShapeDtypeStruct((grid[0], f), jnp.float32),  # column maxima of |h| per row block
            jax.ShapeDtypeStruct((grid[0], f), jnp.float32),  # of max(|dgate|, |dup|)
        ),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="swiglu_grad_fp8",
    )(jnp.stack([h_scale, g_scale]), gate_up, g_h)
    return qh_t, qg, qg_t, jnp.max(amax_h), jnp.max(amax_g)


def swiglu_grad_tiles(gate_up: jax.Array, g_h: jax.Array, h_dtype, g_dtype, *, interpret: bool = False,
                      num_warps: int = 8, chunk: int | None | str = "auto", g_blocks: bool = False):
    """Block scaling's FP8 operands of an MLP's backward GEMMs from one read of ``gate_up`` [M, 2F] and ``g_h`` [M, F]
    (128 dividing M and F): h in 128 x 1 tiles along the tokens, written transposed (the down projection's weight
    gradient), and [dgate | dup] in 1 x 128 tiles along its columns (the gate/up linear's data gradient) and in 128 x 1
    tiles, written transposed (its weight gradient), each tile scaled by its own amax as
    ``block_quantize.quantize_tiles`` scales it. Returns ``(qh_t [F, M], sh [M / 128, F], qg [M, 2F], sg [2F / 128, M],
    qg_t [2F, M], sg_t [M / 128, 2F])``: values and inverse scales laid as ``quantize_tiles`` lays them
    (``fp8.block_mlp`` turns them into ``block.tile_quantize_both``'s forms). ``g_blocks``: [dgate | dup]'s second form
    in 128 x 128 blocks instead (``quantize_tiles``' ``col_blocks``; ``sg_t`` [M / 128, 2F / 128]), from one program a
    whole block (a block's scale needs all of it). ``chunk``: None, one program a block, holding all of it (grid ``(M /
    128, F / 128)``); or, for the 128 x 1 tiles, one of ``CHUNKS``: each [128, 128] block of the gate, the up and g_h
    takes 2 * 128 / ``chunk`` programs, launched next to one another (grid ``(2 * 128 / chunk, M / 128, F / 128)``):
    ``chunk`` rows each for the 1 x 128 tiles, ``chunk`` columns each for the 128 x 1 tiles (whole tiles of its form),
    so a program holds fewer f32 values and the block's later programs read what the first left in L2. The same bits
    either way. ``auto``: ``CHUNK`` for the tiles, None for the blocks."""
    m, f = g_h.shape
    if gate_up.shape != (m, 2 * f) or m % TILE or f % TILE:
        raise ValueError(f"swiglu_grad_tiles takes gate_up [M, 2F] and g_h [M, F] with 128 dividing M and F, not "
                         f"{list(gate_up.shape)} and {list(g_h.shape)}")
    # a llama1b microbatch on an H200: g's tiles 2.52 ms in programs of 64, 3.06 whole; g's blocks 2.56 whole (3.19 in
    # programs of 64 with two more whole-block programs for the blocks, a form since removed; benchmarks/RESULTS.md)
    if chunk == "auto":
        chunk = None if g_blocks else CHUNK
    if chunk is not None and (chunk not in CHUNKS or g_blocks):
        raise ValueError(f"swiglu_grad_tiles chunk={chunk!r}; allowed: None, or {CHUNKS} without g_blocks")
    h_dtype, g_dtype = jnp.dtype(h_dtype), jnp.dtype(g_dtype)
    h_limit, g_limit = float(fp8_max(h_dtype)), float(fp8_max(g_dtype))
    nf = f // TILE
    per = TILE // (chunk or TILE)  # programs a block of each form

    def kernel(gate_up_ref, g_h_ref, qh_t_ref, sh_ref, qg_ref, sg_ref, qg_t_ref, sg_t_ref):
        first = 0 if chunk is None else 1  # with a chunk, axis 0 says which of the block's programs
        i, j = pl.program_id(first), pl.program_id(first + 1)
        block_rows, block_cols = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)

        def values(rows, cols):  # h, dgate, dup of the block's part [rows, cols]
            return swiglu_math(gate_up_ref[rows, cols], gate_up_ref[rows, pl.ds(f + cols.start, cols.size)],
                               g_h_ref[rows, cols])

        def row_form(rows, dgate, dup):  # [dgate | dup] in 1 x 128 tiles: whole rows of the block
            for value, col0, column_block in ((dgate, j * TILE, j), (dup, f + j * TILE, nf + j)):
                qg_ref[rows, pl.ds(col0, TILE)], inv = row_tiles(value, g_limit, g_dtype)
                sg_ref[pl.ds(column_block, 1), rows] = inv[None, :]

        def h_cols(cols, h):  # h in 128 x 1 tiles, transposed: whole columns of the block
            qh_t_ref[cols, block_rows], inv = col_tiles(h, h_limit, h_dtype)
            sh_ref[pl.ds(i, 1), cols] = inv[None, :]

        def g_cols(cols, dgate, dup):  # dgate, dup in 128 x 1 tiles, transposed
            for value, at in ((dgate, cols), (dup, pl.ds(f + cols.start, cols.size))):
                qg_t_ref[at, block_rows], inv = col_tiles(value, g_limit, g_dtype)
                sg_t_ref[pl.ds(i, 1), at] = inv[None, :]

        def g_block(value, column_block):  # dgate's or dup's whole block under one scale, transposed
            qg_t_ref[pl.ds(column_block * TILE, TILE), block_rows], inv = block_tile(value, g_limit, g_dtype)
            sg_t_ref[pl.ds(i, 1), pl.ds(column_block, 1)] = inv[None, :]

        if chunk is None:
            h, dgate, dup = values(block_rows, block_cols)
            h_cols(block_cols, h)
            if g_blocks:
                g_block(dgate, j)
                g_block(dup, nf + j)
            else:
                g_cols(block_cols, dgate, dup)
            row_form(block_rows, dgate, dup)
            return
        part = pl.program_id(0)

        @pl.when(part < per)
        def _():
            rows = pl.ds(i * TILE + part * chunk, chunk)
            row_form(rows, *values(rows, block_cols)[1:])

        @pl.when(part >= per)
        def _():
            cols = pl.ds(j * TILE + (part - per) * chunk, chunk)
            h, dgate, dup = values(block_rows, cols)
            h_cols(cols, h)
            g_cols(cols, dgate, dup)

    grid = (m // TILE, nf) if chunk is None else (2 * per, m // TILE, nf)
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=(
            jax.ShapeDtypeStruct((f, m), h_dtype), jax.ShapeDtypeStruct((m // TILE, f), jnp.float32),
            jax.ShapeDtypeStruct((m, 2 * f), g_dtype), jax.ShapeDtypeStruct((2 * nf, m), jnp.float32),
            jax.ShapeDtypeStruct((2 * f, m), g_dtype),
            jax.ShapeDtypeStruct((m // TILE, 2 * nf if g_blocks else 2 * f), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="swiglu_grad_tiles",
    )(gate_up, g_h)


def swiglu_tiles(gate_up: jax.Array, dtype, h_dtype, *, interpret: bool = False, num_warps: int | None = None,
                 block_rows: int = SWIGLU_TILES_ROWS):
    """Block scaling's forward operand of the down projection from ``gate_up`` [M, 2F] (gate | up; 128 dividing M and
    F) in one read: h = silu(gate) * up (``swiglu_h_f32``), rounded to ``h_dtype`` as the two linears hand it over, in
    1 x 128 tiles along F, scaled as ``block_quantize.quantize_tiles`` scales them. Returns ``(q [M, F], inv
    [F / 128, M])``, laid as ``quantize_tiles``' rows form: h itself is never written. ``block_rows``: the rows a
    program holds (a power of 2 up to 128 dividing M); ``num_warps`` None: ``SWIGLU_TILES_WARPS``' first up to a
    decode step's ``SMALL_ROWS`` rows, its second above."""
    if gate_up.ndim != 2 or gate_up.shape[0] % TILE or gate_up.shape[1] % (2 * TILE):
        raise ValueError(f"swiglu_tiles takes gate_up [M, 2F] with 128 dividing M and F, not {list(gate_up.shape)}")
    m, f = gate_up.shape[0], gate_up.shape[1] // 2
    if num_warps is None:
        num_warps = SWIGLU_TILES_WARPS[m > SMALL_ROWS]
    if block_rows > TILE or block_rows & (block_rows - 1) or m % block_rows:
        raise ValueError(f"swiglu_tiles block_rows={block_rows}: a power of 2 up to 128 dividing the {m} rows")
    dtype, h_dtype = jnp.dtype(dtype), jnp.dtype(h_dtype)
    limit = float(fp8_max(dtype))
    nf = f // TILE

    def kernel(gate_ref, up_ref, q_ref, inv_ref):
        h = swiglu_h_f32(gate_ref[...], up_ref[...]).astype(h_dtype).astype(jnp.float32)
        q_ref[...], inv = row_tiles(h, limit, dtype)
        inv_ref[...] = inv[None, :]

    tile = pl.BlockSpec((block_rows, TILE), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel,
        grid=(m // block_rows, nf),
        in_specs=[tile, pl.BlockSpec((block_rows, TILE), lambda i, j: (i, nf + j))],
        out_specs=[tile, pl.BlockSpec((1, block_rows), lambda i, j: (j, i))],
        out_shape=[jax.ShapeDtypeStruct((m, f), dtype), jax.ShapeDtypeStruct((nf, m), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="swiglu_tiles",
    )(gate_up, gate_up)
