"""Operands for the block-scaled FP8 GEMM's kernel tests (``test_block_gemm.py``: the Mosaic kernel;
``test_cublaslt.py``: cuBLASLt's call), and the magnitude that bounds their rounding.

Forms of b's scales: ``blocks`` (a weight's 128 x 128 blocks), ``rows_of_blocks`` (the same, one row a weight row)
and ``rows`` (1 x 128 tiles of its own: the wgrad's second operand). Each helper returns (qa, sa, qb, sb in the form,
sb as rows).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8rl_jax.fp8 import block

U = 2.0**-24


def _b_scales(sw_or_rows, q, form):
    rows = sw_or_rows if form == "rows" else block.block_rows(sw_or_rows, q)
    return (rows if form != "blocks" else sw_or_rows), rows


def quantized(p, q, c, form, *, b_dtype=jnp.float8_e4m3fn, seed=0):
    """Block-scaled random data with a few massive values."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(p, c)).astype(np.float32)
    x.flat[rng.choice(x.size, 3, replace=False)] = [3000.0, -1200.0, 800.0]
    w = (rng.normal(size=(q, c)) * 0.05).astype(np.float32)
    qa, sa = block.tile_quantize(jnp.asarray(x), jnp.float8_e4m3fn)
    quantize = block.tile_quantize if form == "rows" else block.block_quantize
    qb, sb = quantize(jnp.asarray(w), b_dtype)
    return qa, sa, qb, *_b_scales(sb, q, form)


def integers(p, q, c, form, *, b_dtype=jnp.float8_e4m3fn, seed=0):
    """Values in {-4, ..., 4} (every slice's sum of 128 products is an integer below 2**11: exact in any
    accumulator) with random positive scales."""
    rng = np.random.default_rng(seed)
    cb = block.num_blocks(c)
    qa = jnp.asarray(rng.integers(-4, 5, (p, c)), jnp.float32).astype(jnp.float8_e4m3fn)
    qb = jnp.asarray(rng.integers(-4, 5, (q, c)), jnp.float32).astype(b_dtype)
    sa = jnp.asarray(rng.uniform(0.5, 2.0, (p, cb)) * 2.0 ** rng.integers(-8, 8, (p, cb)), jnp.float32)
    shape = (q, cb) if form == "rows" else (block.num_blocks(q), cb)
    sb = jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32)
    return qa, sa, qb, *_b_scales(sb, q, form)


def fp8_abs(q):
    """|q| of FP8 values, exactly (the sign bit cleared)."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(q, jnp.uint8) & jnp.uint8(0x7F), q.dtype)


def magnitude(qa, sa, qb, sb_rows) -> np.ndarray:
    """sum over slices of |qa| . |qb|^T * |sa sb| (the scale of f32's rounding errors), in f32."""
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(block.block_gemm)(fp8_abs(qa).astype(jnp.float32), sa,
                                                    fp8_abs(qb).astype(jnp.float32), sb_rows))


def f32_bound(c, mag):
    """f32 summation's bound on |y - y_exact| (tests/fp8/test_block_scaling.py), per element."""
    return (block.BLOCK + block.num_blocks(c) + 3) * U * np.asarray(mag)
