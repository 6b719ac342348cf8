"""The SwiGLU's backward and the FP8 operands of the MLP's weight and data gradients, in one pass.

Why. In the te backend's training step the MLP's backward took three XLA fusions per layer and microbatch, each
reading the [M, 2F] gate/up GEMM output again (llama1b, the H100 profile in benchmarks/RESULTS.md, 2.5 ms of a
layer's backward): one wrote the gate's gradient in BF16 with q(h) and amax(h) beside it, one concatenated the
gate's and the up's gradients and quantized them, one took their amax; then byte transposes made the token-minor
copies of q(h) and q(dgate_up) that the weight gradients need. Here one kernel reads the gate/up output and the
gradient of h once and writes every FP8 operand the three backward GEMMs take, with both amaxes.

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
tile of the gate, of the up and of g_h, and stores the row-major q(dgate), q(dup) tiles, the transposed q(h),
q(dgate), q(dup) tiles and its column maxima of |h| and |dgate|, |dup| (XLA takes the maximum of those, a few MB).
The transposed tiles move through shared memory (Triton's layout change); ``transpose`` says what is moved:
``fp8`` the quantized tiles (one byte a value), ``f32`` the f32 values before they are quantized (four bytes a
value, the same bits after quantizing), ``inputs`` the BF16 input tiles, the arithmetic done again on them
(the same bits: each value's arithmetic is the same), ``packed`` 32-bit words of four tokens' FP8 values: the
program works on four [block_m / 4, block_f] tiles of rows ``r = k (mod 4)``, k = 0..3 (strided loads and
row-major stores), ORs the k-th tile's FP8 bytes into byte k of a word, and transposes the words, written to a
[F, M / 4] word view of the token-minor output (XLA reads it back as bytes, a bitcast). ``tiles_per_program``
row tiles per program, each tile's loads issued before the previous tile's arithmetic. Measured on the H100
(``benchmarks/swiglu_grad.py``): none of these beats the one-tile ``fp8`` form beyond the noise. ``impl="xla"``:
the same arithmetic as XLA ops (CPU, and shapes the blocks do not divide).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.fp8.recipe import amax, quantize

IMPLS = ("auto", "pallas", "pallas_interpret", "xla")
TRANSPOSES = ("fp8", "f32", "inputs", "packed")
BLOCK = (32, 64)  # tokens, intermediate columns per program (H100 sweep: benchmarks/swiglu_grad.py)
NUM_WARPS = 4
TRANSPOSE = "fp8"
TILES_PER_PROGRAM = 1


def _math(gate: jax.Array, up: jax.Array, g_h: jax.Array):
    """h, dgate, dup in f32 from the gate, the up and the gradient of h."""
    gate, up, g_h = (a.astype(jnp.float32) for a in (gate, up, g_h))
    s = 1.0 / (1.0 + jnp.exp(-gate))
    gs = gate * s
    return gs * up, g_h * up * (s + gs * (1.0 - s)), g_h * gs


def swiglu_grad_fp8(gate_up: jax.Array, g_h: jax.Array, h_scale: jax.Array, g_scale: jax.Array, h_dtype, g_dtype, *,
                    impl: str = "auto", block: tuple[int, int] = BLOCK, num_warps: int = NUM_WARPS,
                    transpose: str = TRANSPOSE, tiles_per_program: int = TILES_PER_PROGRAM,
                    num_stages: int = 1):
    """The FP8 operands of an MLP's backward GEMMs (module docstring): ``gate_up`` [M, 2F], ``g_h`` [M, F], the
    delayed scales of h (``h_dtype``, E4M3) and of the gate/up gradient (``g_dtype``). Returns ``(qh_t [F, M],
    qg [M, 2F], qg_t [2F, M], amax_h, amax_g)``. ``impl``: ``pallas`` (GPU), ``pallas_interpret`` (tests), ``xla``,
    ``auto`` (pallas on a GPU where the blocks divide the shapes, else xla). ``transpose``: what the kernel moves
    through shared memory for the transposed tiles (module docstring; the outputs are the same bits).
    ``tiles_per_program``: row tiles a program walks, each tile's loads issued before the previous tile's
    arithmetic; ``num_stages``: Triton's software pipelining depth for that loop."""
    if impl not in IMPLS:
        raise ValueError(f"swiglu_grad impl={impl!r}; allowed: {IMPLS}")
    if transpose not in TRANSPOSES:
        raise ValueError(f"swiglu_grad transpose={transpose!r}; allowed: {TRANSPOSES}")
    if transpose == "packed" and tiles_per_program != 1:
        raise ValueError("swiglu_grad transpose='packed' takes one tile per program")
    m, f2 = gate_up.shape
    f = f2 // 2
    if f2 % 2 or g_h.shape != (m, f):
        raise ValueError(f"gate_up [M, 2F] = {list(gate_up.shape)} and g_h [M, F] = {list(g_h.shape)} do not match")
    h_scale, g_scale = (jnp.asarray(s, jnp.float32).reshape(()) for s in (h_scale, g_scale))
    divides = (m % (block[0] * tiles_per_program) == 0 and f % block[1] == 0
               and (transpose != "packed" or block[0] % 4 == 0))
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" and divides else "xla"
    if impl == "xla":
        h, dgate, dup = _math(gate_up[:, :f], gate_up[:, f:], g_h)
        g = jnp.concatenate([dgate, dup], axis=1)
        qh, qg = quantize(h, h_scale, h_dtype), quantize(g, g_scale, g_dtype)
        return qh.T, qg, qg.T, amax(h), amax(g)
    if not divides:
        raise ValueError(f"swiglu_grad blocks {block} do not divide [M, F] = [{m}, {f}]")
    return _pallas(gate_up, g_h, h_scale, g_scale, jnp.dtype(h_dtype), jnp.dtype(g_dtype), block=block,
                   num_warps=num_warps, transpose=transpose, tiles_per_program=tiles_per_program,
                   num_stages=num_stages, interpret=impl == "pallas_interpret")


def _pallas(gate_up, g_h, h_scale, g_scale, h_dtype, g_dtype, *, block, num_warps, transpose, tiles_per_program,
            num_stages, interpret):
    if transpose == "packed":
        return _pallas_packed(gate_up, g_h, h_scale, g_scale, h_dtype, g_dtype, block=block, num_warps=num_warps,
                              interpret=interpret)
    m, f = g_h.shape
    bm, bf = block
    n = tiles_per_program
    grid = (m // (bm * n), f // bf)

    def kernel(scales_ref, gate_up_ref, g_h_ref, qh_t_ref, qg_ref, qg_t_ref, amax_h_ref, amax_g_ref):
        i, j = pl.program_id(0), pl.program_id(1)
        cols, up_cols = pl.ds(j * bf, bf), pl.ds(f + j * bf, bf)
        s_h, s_g = scales_ref[0], scales_ref[1]

        def load(t):  # the program's t-th row tile of the gate, the up and g_h
            rows = pl.ds((i * n + t) * bm, bm)
            return gate_up_ref[rows, cols], gate_up_ref[rows, up_cols], g_h_ref[rows, cols]

        def tile(t, gate, up, g):  # one tile's outputs; returns its column maxima of |h| and |dgate|, |dup|
            rows = pl.ds((i * n + t) * bm, bm)
            h, dgate, dup = _math(gate, up, g)
            qdgate, qdup = quantize(dgate, s_g, g_dtype), quantize(dup, s_g, g_dtype)
            qg_ref[rows, cols] = qdgate
            qg_ref[rows, up_cols] = qdup
            if transpose == "fp8":  # the quantized tiles
                qh_t, qdgate_t, qdup_t = quantize(h, s_h, h_dtype).T, qdgate.T, qdup.T
            elif transpose == "f32":  # the f32 values, quantized after
                qh_t, qdgate_t, qdup_t = (quantize(v.T, s, dt) for v, s, dt in
                                          ((h, s_h, h_dtype), (dgate, s_g, g_dtype), (dup, s_g, g_dtype)))
            else:  # the BF16 inputs, the arithmetic again
                h_t, dgate_t, dup_t = _math(gate.T, up.T, g.T)
                qh_t, qdgate_t, qdup_t = (quantize(h_t, s_h, h_dtype), quantize(dgate_t, s_g, g_dtype),
                                          quantize(dup_t, s_g, g_dtype))
            qh_t_ref[cols, rows] = qh_t
            qg_t_ref[cols, rows] = qdgate_t
            qg_t_ref[up_cols, rows] = qdup_t
            return (jnp.max(jnp.abs(h), axis=0),
                    jnp.maximum(jnp.max(jnp.abs(dgate), axis=0), jnp.max(jnp.abs(dup), axis=0)))

        if n == 1:
            max_h, max_g = tile(0, *load(0))
        else:  # the next tile's loads issued before this tile's arithmetic and stores (held in registers)

            def body(t, carry):
                tiles, max_h, max_g = carry
                ahead = load(jnp.minimum(t + 1, n - 1))
                m_h, m_g = tile(t, *tiles)
                return ahead, jnp.maximum(max_h, m_h), jnp.maximum(max_g, m_g)

            zeros = jnp.zeros((bf,), jnp.float32)
            _, max_h, max_g = lax.fori_loop(0, n, body, (load(0), zeros, zeros))
        amax_h_ref[i, cols] = max_h
        amax_g_ref[i, cols] = max_g

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
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="swiglu_grad_fp8",
    )(jnp.stack([h_scale, g_scale]), gate_up, g_h)
    return qh_t, qg, qg_t, jnp.max(amax_h), jnp.max(amax_g)


def _words(q: jax.Array, byte: int) -> jax.Array:
    """FP8 values as bits ``byte`` of 32-bit words (little-endian: byte k is the k-th of four consecutive tokens)."""
    bits = lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint32)
    return lax.shift_left(bits, jnp.uint32(8 * byte)) if byte else bits


def _bytes(words: jax.Array, dtype) -> jax.Array:
    """[R, C] 32-bit words -> [R, 4 C] of ``dtype`` (one byte each), byte k of word c at column 4 c + k."""
    r, c = words.shape
    return lax.bitcast_convert_type(lax.bitcast_convert_type(words, jnp.uint8).reshape(r, 4 * c), dtype)


def _pallas_packed(gate_up, g_h, h_scale, g_scale, h_dtype, g_dtype, *, block, num_warps, interpret):
    m, f = g_h.shape
    bm, bf = block
    sub = bm // 4  # rows per residue class
    grid = (m // bm, f // bf)

    def kernel(scales_ref, gate_up_ref, g_h_ref, qh_t_ref, qg_ref, qg_t_ref, amax_h_ref, amax_g_ref):
        i, j = pl.program_id(0), pl.program_id(1)
        cols, up_cols = pl.ds(j * bf, bf), pl.ds(f + j * bf, bf)
        s_h, s_g = scales_ref[0], scales_ref[1]
        words_h = words_dgate = words_dup = None
        max_h = max_g = None
        for k in range(4):  # rows i * bm + k, k + 4, ...: byte k of each word
            rows = pl.ds(i * bm + k, sub, stride=4)
            h, dgate, dup = _math(gate_up_ref[rows, cols], gate_up_ref[rows, up_cols], g_h_ref[rows, cols])
            qdgate, qdup = quantize(dgate, s_g, g_dtype), quantize(dup, s_g, g_dtype)
            qg_ref[rows, cols] = qdgate
            qg_ref[rows, up_cols] = qdup
            w_h, w_dgate, w_dup = (_words(q, k) for q in (quantize(h, s_h, h_dtype), qdgate, qdup))
            words_h = w_h if k == 0 else words_h | w_h
            words_dgate = w_dgate if k == 0 else words_dgate | w_dgate
            words_dup = w_dup if k == 0 else words_dup | w_dup
            m_h = jnp.max(jnp.abs(h), axis=0)
            m_g = jnp.maximum(jnp.max(jnp.abs(dgate), axis=0), jnp.max(jnp.abs(dup), axis=0))
            max_h = m_h if k == 0 else jnp.maximum(max_h, m_h)
            max_g = m_g if k == 0 else jnp.maximum(max_g, m_g)
        word_rows = pl.ds(i * sub, sub)
        qh_t_ref[cols, word_rows] = words_h.T
        qg_t_ref[cols, word_rows] = words_dgate.T
        qg_t_ref[up_cols, word_rows] = words_dup.T
        amax_h_ref[i, cols] = max_h
        amax_g_ref[i, cols] = max_g

    qh_t, qg, qg_t, amax_h, amax_g = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=(
            jax.ShapeDtypeStruct((f, m // 4), jnp.uint32),  # q(h)^T, four tokens a word
            jax.ShapeDtypeStruct((m, 2 * f), g_dtype),
            jax.ShapeDtypeStruct((2 * f, m // 4), jnp.uint32),  # q(dgate_up)^T
            jax.ShapeDtypeStruct((grid[0], f), jnp.float32),
            jax.ShapeDtypeStruct((grid[0], f), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="swiglu_grad_fp8",
    )(jnp.stack([h_scale, g_scale]), gate_up, g_h)
    return _bytes(qh_t, h_dtype), qg, _bytes(qg_t, g_dtype), jnp.max(amax_h), jnp.max(amax_g)
