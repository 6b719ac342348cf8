"""The ``xla`` FP8 backend: pure JAX, runs on CPU and GPU, and is the reference the tests check.

The GEMMs are ``lax.dot_general`` on float8 operands with ``preferred_element_type=float32``, followed by one
multiply with the product of the two inverse scales. Never write FP8 as quantize -> dequantize -> bf16 dot: XLA
on GPU treats the f8 round trip as excess precision and removes it, and the "FP8" run silently becomes BF16.

Forward:  y  = (q(x) . q(w))            / (s_x s_w)      q() = E4M3 with the role's delayed scale
Backward: dx = (q(g) . q(w)^T)          / (s_g s_w)      q(g) = E5M2 (hybrid) or E4M3
          dw = (q(x)^T . q(g))          / (s_x s_g)
The quantized x and w of the forward are the residuals, so the backward re-uses them (and keeps activations in
one byte each).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8.recipe import Fp8LinearState, Fp8Recipe, amax, observations, quantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedKernel:
    """A kernel quantized once with its delayed scale: FP8 ``data`` [..., N, K] and ``scale_inv`` (f32).

    Stored transposed (K-major): Hopper's FP8 GEMMs read both operands K-major ("TN"), so a kernel kept in this
    layout is streamed as is, with no transpose per call.
    """

    data: jax.Array
    scale_inv: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., K, N] shape of the kernel this stands for."""
        *lead, n, k = self.data.shape
        return (*lead, k, n)


def quantize_kernel(kernel: jax.Array, kernel_meta, recipe: Fp8Recipe) -> QuantizedKernel:
    """[K, N] kernel -> FP8 [N, K] with its delayed scale."""
    scale = kernel_meta["scale"]
    data = jnp.swapaxes(quantize(kernel, scale, recipe.fwd_dtype), -1, -2)
    return QuantizedKernel(data, 1.0 / scale.astype(jnp.float32))


def _mm(a: jax.Array, b: jax.Array, a_contract: int, b_contract: int) -> jax.Array:
    """2-D product contracting one axis of each operand, accumulated in f32."""
    return lax.dot_general(
        a, b, (((a_contract,), (b_contract,)), ((), ())), preferred_element_type=jnp.float32
    )


def prequantized_matmul(x: jax.Array, kernel: QuantizedKernel, x_scale: jax.Array, recipe: Fp8Recipe):
    """``x [M, K] @ kernel`` with only ``x`` quantized here; returns f32 [M, N].

    The training forward calls this too, after ``quantize_kernel``: rollout with pre-quantized weights and the
    training forward run the same arithmetic on the same FP8 operands.
    """
    qx = quantize(x, x_scale, recipe.fwd_dtype)
    # [M, K] . [N, K] -> [M, N]
    return _mm(qx, kernel.data, 1, 1) * ((1.0 / x_scale.astype(jnp.float32)) * kernel.scale_inv)


@functools.cache
def _fp8_matmul_fn(x_dtype, w_dtype, out_dtype, recipe: Fp8Recipe):
    @jax.custom_vjp
    def f(x, kernel, state):
        y, _ = fwd(x, kernel, state)
        return y

    def fwd(x, kernel, state):
        qk = quantize_kernel(kernel, state["kernel"], recipe)
        x_scale = state["x"]["scale"]
        y = prequantized_matmul(x, qk, x_scale, recipe).astype(out_dtype)
        qx = quantize(x, x_scale, recipe.fwd_dtype)  # CSE'd with the one inside prequantized_matmul
        residuals = (qx, qk.data, state, amax(x), amax(kernel))
        return y, residuals

    def bwd(residuals, g):
        qx, qw, state, amax_x, amax_w = residuals
        s_x, s_w, s_g = (state[r]["scale"].astype(jnp.float32) for r in ("x", "kernel", "grad"))
        qg = quantize(g, s_g, recipe.bwd_dtype)
        # dx [M, K] = g [M, N] . w^T [N, K]
        dx = _mm(qg, qw, 1, 0) * ((1.0 / s_g) * (1.0 / s_w))
        # dw [K, N] = x [M, K]^T . g [M, N]
        dw = _mm(qx, qg, 0, 0) * ((1.0 / s_x) * (1.0 / s_g))
        return dx.astype(x_dtype), dw.astype(w_dtype), observations(state, amax_x, amax_w, amax(g))

    f.defvjp(fwd, bwd)
    return f


def fp8_matmul(
    x: jax.Array, kernel: jax.Array, state: Fp8LinearState, recipe: Fp8Recipe, out_dtype=None
) -> jax.Array:
    """Differentiable FP8 ``x [M, K] @ kernel [K, N]`` -> [M, N] in ``out_dtype`` (default ``x.dtype``).

    The cotangent for ``state`` carries the amaxes observed in this call (see ``recipe``'s design note).
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    return _fp8_matmul_fn(jnp.dtype(x.dtype), jnp.dtype(kernel.dtype), out_dtype, recipe)(x, kernel, state)
