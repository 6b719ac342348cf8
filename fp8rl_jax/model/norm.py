"""The blocks' RMSNorm, in the form the next linear takes it.

``rms_norm`` is the model's arithmetic (f32, the output rounded to the compute dtype). ``normed`` is what a block
calls before its q|k|v and gate|up linears: the norm's output in the compute dtype, or, for block scaling's rollout
kernels on a GPU, that value already in the linear's 1 x 128 tiles from one kernel (``kernels.block_quantize.
norm_tiles``, with the residual add before it), which ``linear`` takes as it is (``block.Tiles``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8.block import Tiles
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.xla import QuantizedKernel
from fp8rl_jax.kernels import block_quantize
from fp8rl_jax.numerics import rounded


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype=None) -> jax.Array:
    """RMSNorm in f32 of ``x``'s own values, output in ``dtype`` (default ``x.dtype``).

    A narrower ``x`` (BF16) is read as it is held (``numerics.rounded``): where an add makes it in the same fusion
    (the residual stream), XLA may otherwise norm the add's f32 sum before its rounding to x's dtype (excess
    precision), and then whether a norm sees the stored residual or the unrounded sum would hang on XLA's fusion
    choices, which differ between a rollout's program, a trainer's and ``norm_tiles``' kernel (on the CPU that sum
    moved 2% of the FP8 tiles of a random input)."""
    x32 = rounded(x, x.dtype) if jnp.dtype(x.dtype).itemsize < 4 else x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(dtype or x.dtype)


def norm_tiles_apply(x: jax.Array, kernel, fp8_state, precision: Precision) -> bool:
    """Whether ``normed`` makes the next linear's tiles itself: block scaling in 1 x 128 tiles with its forward in
    FP8, the rollout's pre-quantized ``kernel`` with its FP8 state, and the kernel runs for ``x`` [..., D] here
    (``block_quantize.norm_fits``: a GPU, D 128 times a power of 2, no mesh)."""
    return (precision.fp8 and precision.recipe.tiles_forward and fp8_state is not None
            and isinstance(kernel, QuantizedKernel) and block_quantize.norm_fits(x.reshape(-1, x.shape[-1])))


def normed(x: jax.Array, add: jax.Array | None, weight: jax.Array, eps: float, kernel, fp8_state,
           precision: Precision) -> tuple[jax.Array, jax.Array | Tiles]:
    """``(s, h)``: the residual stream ``s = x + add`` (``x`` where ``add`` is None) and ``rms_norm(s)`` as the
    linear of ``kernel`` (its FP8 state ``fp8_state``) takes it: in the compute dtype, or where ``norm_tiles_apply`` in
    its 1 x 128 tiles, from one kernel that adds, norms and quantizes (``block_quantize.norm_tiles``: its sum of
    squares in another order than XLA's, see there)."""
    if not norm_tiles_apply(x, kernel, fp8_state, precision):
        s = x if add is None else x + add.astype(x.dtype)
        return s, rms_norm(s, weight, eps, precision.dtype)
    d = x.shape[-1]
    # [..., D] -> [M, D]
    s, q, inv_t = block_quantize.norm_tiles(x.reshape(-1, d), weight, eps, precision.recipe.fwd_dtype,
                                            add=None if add is None else add.astype(x.dtype).reshape(-1, d),
                                            h_dtype=precision.dtype)
    # [M, D] -> [..., D]; inverse scales [Db, M] -> [..., Db]
    return (x if s is None else s.reshape(x.shape)), Tiles(q.reshape(x.shape), inv_t.T.reshape(*x.shape[:-1], -1))
