"""The MLP ``down(silu(gate) * up)`` under block scaling as one differentiable function (``block_swiglu_mlp``).

Why. Through two ``xla.fp8_matmul`` calls the backward of a block-scaled MLP writes the SwiGLU's gradient
[dgate | dup] (an [M, 2F] BF16 array, XLA's autodiff of ``silu(gate) * up``) and reads it again to quantize it in
its two tile forms, and writes h (recomputed) to quantize it for the down projection's weight gradient: about 7.7 GB
a layer and microbatch at llama1b's training shapes, where the operands themselves are 3.7. Here one kernel
(``kernels.swiglu_grad.swiglu_grad_tiles``) reads the gate/up output and the gradient of h once and writes those
three FP8 operands, as ``te.fp8_swiglu_mlp`` does for per-tensor scaling.

What it computes. The forward is the gate/up linear's forward, then ``swiglu_down``: h = silu(gate) * up
(``swiglu_h``: f32, rounded to BF16) in 1 x 128 tiles from one kernel that reads the gate/up output
(``kernels.swiglu_grad.swiglu_tiles``: h is never written), then the down projection's GEMM. The rollout's MLP runs
the same two functions on the same pre-quantized kernels, so the two forwards agree bit for bit; where the kernel does
not run, ``swiglu_h`` and ``block.tile_quantize`` make the same tiles (on an H200 for every BF16 gate value). The
backward is the two linears' block backward (``xla.BACKWARD_KINDS``: 1 x 128 gradient tiles with the weight's blocks
for the data gradients, 128 x 1 tiles of both operands for the weight gradients, or the gradient in 128 x 128 blocks
under ``Fp8Recipe.block_wgrad='grad_blocks'``), except that h, dgate and dup are ``swiglu_math``'s f32 values of the
same inputs, where autodiff rounds each op to BF16: a value near an FP8 rounding boundary may land on its neighbour
(as in the te backend's MLP).
Where the kernel does not run (off a GPU, a mesh of several devices, sizes 128 does not divide) the same values go
through ``block.tile_quantize_both``'s XLA form: the same tiles, bit for bit, as the kernel's on the values each has.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8 import block, xla
from fp8rl_jax.fp8.recipe import GEMMS, Fp8LinearState, Fp8Recipe, observations
from fp8rl_jax.fp8.train_kernel import TrainKernel, block_forms
from fp8rl_jax.kernels import block_quantize
from fp8rl_jax.kernels.swiglu_grad import swiglu_grad_tiles, swiglu_h_f32, swiglu_math, swiglu_tiles


def swiglu_grad_tiles_any(gate_up: jax.Array, g_h: jax.Array, h_dtype, g_dtype, impl: str = "auto",
                          g_blocks: bool = False):
    """h's weight-gradient form and [dgate | dup]'s two forms in ``block.tile_quantize_both``'s layout: ``((qh_t [F,
    M], sh [F, Mb]), ((qg [M, 2F], sg [M, 2Fb]), (qg_t [2F, M], sg_t [2F, Mb])))``; with ``g_blocks`` the last in
    128 x 128 blocks (``sg_t`` [2Fb, Mb], ``tile_quantize_both``'s ``col_blocks``). ``impl``: ``pallas`` (the
    kernel, GPU), ``pallas_interpret`` (tests), ``xla``, ``auto`` (pallas where ``block_quantize.fits`` g_h: then
    gate_up too)."""
    if impl not in block.IMPLS:
        raise ValueError(f"swiglu_grad_tiles impl={impl!r}; allowed: {block.IMPLS}")
    if impl == "auto":
        impl = "pallas" if block_quantize.fits(g_h) else "xla"
    if impl == "xla":
        f = g_h.shape[1]
        h, dgate, dup = swiglu_math(gate_up[:, :f], gate_up[:, f:], g_h)
        _, h_cols = block.tile_quantize_both(h, h_dtype, rows=False, impl="xla")
        return h_cols, block.tile_quantize_both(jnp.concatenate([dgate, dup], axis=1), g_dtype, col_blocks=g_blocks,
                                                impl="xla")
    qh_t, sh, qg, sg, qg_t, sg_t = swiglu_grad_tiles(gate_up, g_h, h_dtype, g_dtype, g_blocks=g_blocks,
                                                     interpret=impl == "pallas_interpret")
    return (qh_t, sh.T), ((qg, sg.T), (qg_t, sg_t.T))


def swiglu_h(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    """h = silu(gate) * up as block scaling's MLPs hand it to the down projection:
    ``kernels.swiglu_grad.swiglu_h_f32``'s f32 value rounded to ``dtype``, the arithmetic of ``swiglu_tiles_any``'s
    kernel. The barrier keeps that rounding: without it XLA may fold it into the quantizer's upcast (its excess
    precision) where the kernel rounds."""
    return jax.lax.optimization_barrier(swiglu_h_f32(gate, up).astype(dtype))


def swiglu_tiles_any(gate_up: jax.Array, h_dtype, dtype, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """h of ``gate_up`` [M, 2F] (``swiglu_h`` in ``h_dtype``) in 1 x 128 tiles of ``dtype``, ``block.tile_quantize``'s
    form ``(q [M, F], inverse scales [M, F / 128])``. ``impl``: ``pallas`` (``kernels.swiglu_grad.swiglu_tiles``: one
    read of gate_up, no h in memory; GPU), ``pallas_interpret`` (tests), ``xla`` (``swiglu_h``, then
    ``block.tile_quantize``), ``auto`` (pallas where ``block_quantize.fits`` gate_up)."""
    if impl not in block.IMPLS:
        raise ValueError(f"swiglu_tiles impl={impl!r}; allowed: {block.IMPLS}")
    if impl == "auto":
        impl = "pallas" if block_quantize.fits(gate_up) and gate_up.shape[1] % (2 * block.BLOCK) == 0 else "xla"
    if impl == "xla":
        f = gate_up.shape[1] // 2
        return block.tile_quantize(swiglu_h(gate_up[:, :f], gate_up[:, f:], h_dtype), dtype)
    q, inv = swiglu_tiles(gate_up, dtype, h_dtype, interpret=impl == "pallas_interpret")
    return q, inv.T


def swiglu_down(gate_up: jax.Array, w_down: xla.QuantizedKernel, x_scale: jax.Array, recipe: Fp8Recipe,
                form: str | None = None, out_dtype=None, impl: str = "auto") -> jax.Array:
    """The down projection's forward of h = silu(gate) * up under block scaling, from the gate/up GEMM's output
    ``gate_up`` [M, 2F] (gate | up) and its quantized kernel: [M, D] in ``out_dtype``. h is ``swiglu_h`` in gate_up's
    dtype; in 1 x 128 tiles (``block_forward`` tiles_*) ``swiglu_tiles_any`` makes them from one read of gate_up,
    else ``xla.prequantized_matmul`` quantizes h as its form says. The rollout's MLP and the training MLP's forward
    both take this: the same operands, bit for bit."""
    if recipe.block_forward == "tokens_blocks":
        f = gate_up.shape[1] // 2
        h = swiglu_h(gate_up[:, :f], gate_up[:, f:], gate_up.dtype)
        return xla.prequantized_matmul(h, w_down, x_scale, recipe, form, out_dtype=out_dtype)
    qh, sh = swiglu_tiles_any(gate_up, gate_up.dtype, recipe.fwd_dtype, impl)
    return xla.tiles_matmul(qh, sh, w_down, recipe, form, out_dtype)


def fused(recipe: Fp8Recipe) -> bool:
    """Whether a recipe's MLP takes ``block_swiglu_mlp``: block scaling with all three GEMMs in FP8."""
    return recipe.scaling == "block" and recipe.fp8_gemms == GEMMS


@functools.cache
def _block_swiglu_mlp_fn(x_dtype, out_dtype, recipe: Fp8Recipe, form: str, impl: str):
    fwd_dtype, bwd_dtype = recipe.fwd_dtype, recipe.bwd_dtype
    kinds = xla.BACKWARD_KINDS["block"]

    def forward(x, w_gate_up, w_down, st_gu, st_down, hoisted):
        # the two linears' forwards exactly (``_general_matmul_fn``'s: the rollout's arithmetic on its operands)
        q_gu, q_down = (xla.hoisted_nk(h, recipe, form) or xla.quantize_kernel(w, st["kernel"], recipe, form)
                        for h, w, st in zip(hoisted, (w_gate_up, w_down), (st_gu, st_down), strict=True))
        gate_up = xla.prequantized_matmul(x, q_gu, st_gu["x"]["scale"], recipe, form, out_dtype=x_dtype)
        y = swiglu_down(gate_up, q_down, st_down["x"]["scale"], recipe, form, out_dtype, impl)
        return y.astype(out_dtype), gate_up

    @jax.custom_vjp
    def mlp(x, w_gate_up, w_down, st_gu, st_down, hoisted):
        return forward(x, w_gate_up, w_down, st_gu, st_down, hoisted)[0]

    def fwd(x, w_gate_up, w_down, st_gu, st_down, hoisted):
        y, gate_up = forward(x, w_gate_up, w_down, st_gu, st_down, hoisted)
        return y, (x, gate_up, w_gate_up, w_down, st_gu, st_down, hoisted)

    def bwd(residuals, g):
        x, gate_up, w_gate_up, w_down, st_gu, st_down, hoisted = residuals
        gu_blocks, down_blocks = (xla.hoisted_kn(h) for h in hoisted)
        none = jnp.zeros((), jnp.float32)  # block scaling observes nothing into the states (``Fp8Recipe.delayed``)
        g_tiles = block.tile_quantize_both(g, bwd_dtype, col_blocks=recipe.grad_blocks)
        # g_h [M, F] = g [M, D] . w_down [F, D]^T
        g_h = xla.dgrad(g, w_down, kinds["dgrad"], recipe, form, none, none, g_tiles, x_dtype, down_blocks)
        (qh_t, sh), gu_tiles = swiglu_grad_tiles_any(gate_up, g_h, fwd_dtype, bwd_dtype, impl,
                                                        recipe.grad_blocks)
        # dw_down [F, D] = h^T [F, M] . g^T [D, M]^T
        qg_t, sg_t = g_tiles[1]
        d_down = xla.block_gemm(xla.gemm_operand(qh_t, fwd_dtype, form), sh, xla.gemm_operand(qg_t, bwd_dtype, form),
                                sg_t, form, impl=recipe.block_gemm)
        # dx [M, D] = g_gu [M, 2F] . w_gate_up [D, 2F]^T;  dw_gate_up [D, 2F] = x^T g_gu
        dx = xla.dgrad(None, w_gate_up, kinds["dgrad"], recipe, form, none, none, gu_tiles, x_dtype, gu_blocks)
        d_gu = xla.wgrad(x, None, kinds["wgrad"], recipe, form, none, none, gu_tiles)
        return (dx.astype(x_dtype), d_gu.astype(w_gate_up.dtype), d_down.astype(w_down.dtype),
                observations(st_gu, none, none, none), observations(st_down, none, none, none), None)

    mlp.defvjp(fwd, bwd)
    return mlp


def block_swiglu_mlp(x: jax.Array, w_gate_up: jax.Array | TrainKernel, w_down: jax.Array | TrainKernel,
                     st_gu: Fp8LinearState, st_down: Fp8LinearState, recipe: Fp8Recipe, out_dtype=None,
                     form: str | None = None, impl: str = "auto") -> jax.Array:
    """``down(silu(gate) * up)`` of ``x`` [M, D] with block-scaled FP8 linears (``fused(recipe)``): ``w_gate_up`` [D,
    2F] (gate | up) and ``w_down`` [F, D], whole masters on one device, or ``TrainKernel``s whose FP8 blocks were
    made once for the update (``train_kernel.block_kernel_for_update``; a te backend's is taken for its master). Returns
    [M, D] in ``out_dtype`` (default ``x.dtype``); the gradients go to ``x`` and the masters. ``impl``: the SwiGLU
    backward's kernel (``swiglu_grad_tiles_any``)."""
    hoisted = (block_forms(w_gate_up), block_forms(w_down))
    w_gate_up, w_down = (w.master if isinstance(w, TrainKernel) else w for w in (w_gate_up, w_down))
    if not fused(recipe):
        raise ValueError(f"block_swiglu_mlp takes block scaling with all three GEMMs in FP8, not {recipe}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    fn = _block_swiglu_mlp_fn(jnp.dtype(x.dtype), out_dtype, recipe, xla.gemm_form(form), impl)
    return fn(x, w_gate_up, w_down, st_gu, st_down, hoisted)
