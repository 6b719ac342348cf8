"""The ``xla`` FP8 backend: pure JAX, runs on CPU and GPU, and is the reference the tests check.

The GEMMs are ``lax.dot_general`` on float8 operands with ``preferred_element_type=float32``, followed by one
multiply with the product of the two inverse scales. Never write FP8 as quantize -> dequantize -> bf16 dot: XLA
on GPU treats the f8 round trip as excess precision and removes it, and the "FP8" run silently becomes BF16.

Two forms of the same GEMM, chosen at trace time (``gemm_form``):
  ``f8``   dot_general on the float8 operands (GPU: XLA lowers it to cuBLASLt's FP8 GEMM).
  ``f32``  dot_general on the f32 values of the float8 operands (the CPU default). Every E4M3 / E5M2 value is
           exact in f32 and so is the product of two of them (at most 4 x 4 significant bits), so this is the
           FP8 GEMM with f32 accumulation, as the ``f8`` form is. XLA:CPU runs an f8 dot exactly like this
           (it converts both operands to f32 first), but converts again at every call; in the ``f32`` form a
           pre-quantized rollout kernel is stored as f32 once per RL step and the decode step streams it as is.
           The quantized values pass an ``optimization_barrier`` before the upcast, so no pass can fold the
           f32 -> f8 -> f32 round trip away.

Forward:  y  = (q(x) . q(w))            / (s_x s_w)      q() = E4M3 with the role's delayed scale
          (``rowwise`` scaling: s_x per token row and s_w per output channel, each from its current amax)
Backward: dx = (q(g) . q(w)^T)          / (s_g s_w)      q(g) = E5M2 (hybrid) or E4M3
          dw = (q(x)^T . q(g))          / (s_x s_g)
The quantized x and w of the forward are the residuals, so the backward re-uses them (and keeps activations in
one byte each).

The other forms of an ``Fp8Recipe`` (``current`` and ``block`` scaling, or fewer GEMMs in FP8: ``fp8_gemms``) take
``_general_matmul_fn``: every GEMM quantizes its two operands from their high-precision values as its form says
(``BACKWARD_KINDS``), and a GEMM outside ``fp8_gemms`` runs on compute-dtype operands with f32 accumulation. It
keeps x and the master kernel as residuals (an emulation: the bytes are not the point). Under ``block`` scaling a
GEMM is ``block.block_gemm``, f32 accumulation per 128-wide slice of its contraction axis, run on a Hopper GPU
outside a mesh of several devices by cuBLASLt or the Mosaic GPU kernel ``kernels.block_gemm``, as
``Fp8Recipe.block_gemm`` says (``block_gemm``); a pre-quantized kernel then carries [ceil(N/128), ceil(K/128)]
scales ([N, ceil(K/128)] under ``block_forward='tiles_channels'``). ``tensor`` and ``rowwise`` with all three GEMMs
in FP8 keep the path above, unchanged.

``mantissa`` scaling (the fidelity probe's only; no config accepts it) takes that path too, as ``current`` does, with
no scale: each operand is ``numerics.mantissa_rounded`` (the format's 3 or 2 mantissa bits, f32's exponent range),
held in f32 with inverse scale 1. Such values are not FP8 values, so its GEMMs always run in the ``f32`` form (exact
products, f32 accumulation, on any platform).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fp8 import block
from fp8rl_jax.fp8.recipe import (
    Fp8LinearState,
    Fp8Recipe,
    amax,
    fp8_max,
    observations,
    quantize,
    quantize_input,
    rounded,
    scale_from_amax,
)
from fp8rl_jax.fp8.train_kernel import TrainKernel, block_forms, hoists_block_kernels
from fp8rl_jax.kernels import block_gemm as block_kernel
from fp8rl_jax.kernels import cublaslt
from fp8rl_jax.numerics import mantissa_rounded
from fp8rl_jax.parallel import fsdp

GEMM_FORMS = ("f8", "f32")


def gemm_form(form: str | None = None) -> str:
    """``form`` checked, or, for None, this platform's form: ``f32`` where JAX's default backend is the CPU."""
    if form is None:
        return "f32" if jax.default_backend() == "cpu" else "f8"
    if form not in GEMM_FORMS:
        raise ValueError(f"FP8 GEMM form={form!r}; allowed: {GEMM_FORMS}")
    return form


def _recipe_form(recipe: Fp8Recipe, form: str | None) -> str:
    """``gemm_form(form)``, or ``f32`` under ``mantissa`` scaling: its operands are f32 values no FP8 dtype holds."""
    return "f32" if recipe.scaling == "mantissa" else gemm_form(form)


def gemm_operand(q: jax.Array, fp8_dtype, form: str) -> jax.Array:
    """An FP8 operand (float8, or its exact f32 value) in ``form``'s dtype; the value never changes."""
    if form == "f8":
        return q.astype(fp8_dtype)  # exact: an f32 operand here holds FP8 values
    if q.dtype == jnp.float32:
        return q
    return lax.optimization_barrier(q).astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedKernel:
    """A kernel quantized once with its delayed scale: ``data`` [..., N, K] and ``scale_inv`` (f32).

    ``data`` holds FP8 (E4M3) values, as float8 in the ``f8`` GEMM form and as their exact f32 values in the
    ``f32`` form (CPU), so that the decode step reads them with no conversion. Stored transposed (K-major):
    Hopper's FP8 GEMMs read both operands K-major ("TN"), so a kernel kept in this layout is streamed as is,
    with no transpose per call.
    """

    data: jax.Array
    scale_inv: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., K, N] shape of the kernel this stands for."""
        *lead, n, k = self.data.shape
        return (*lead, k, n)


def quantize_kernel(kernel: jax.Array, kernel_meta, recipe: Fp8Recipe, form: str | None = None,
                    gather: P | None = None) -> QuantizedKernel:
    """[K, N] kernel -> FP8 [N, K] with its delayed scale (``scale_inv`` a scalar), stored in ``form``'s dtype (see
    ``gemm_form``). With ``rowwise`` scaling each output channel n gets its own current scale
    ``fp8_max / amax(kernel[:, n])`` (``scale_inv`` [N]); with ``current`` one scale from the kernel's own amax
    (a scalar); with ``block`` one per 128 x 128 block (``scale_inv`` [ceil(N/128), ceil(K/128)]; with
    ``block_forward='tiles_channels'`` one per output channel, laid [N, ceil(K/128)]); with ``mantissa``
    no scale (``scale_inv`` 1), the values ``numerics.mantissa_rounded``, always in the ``f32`` form.

    ``gather``: ``kernel`` is one layer's FSDP-sharded master with this ``PartitionSpec`` (``parallel.fsdp``): each
    shard is quantized where it is and the FP8 bits are all-gathered, the same bits as quantizing the whole kernel.
    Under ``current``, ``block`` and ``mantissa`` scaling the f32 master is gathered first (an amax spans the shards;
    ``mantissa`` simply rounds the whole master).
    """
    if "fprop" not in recipe.fp8_gemms:
        raise ValueError(f"fp8_gemms={recipe.fp8_gemms}: the forward is not FP8, so there is no FP8 kernel to make")
    if recipe.scaling in ("current", "block", "mantissa"):
        nk = jnp.swapaxes(kernel if gather is None else fsdp.gather_bits(kernel, gather), -1, -2)  # [N, K]
        if recipe.block_forward == "tiles_channels":  # one scale an output channel, laid [N, Kb] as a block GEMM reads
            data, scale_inv = _per_row_of_slices(nk, recipe.fwd_dtype)
        else:
            data, scale_inv = _quantized(nk, recipe.fwd_dtype, recipe.scaling)
        return QuantizedKernel(gemm_operand(data, recipe.fwd_dtype, _recipe_form(recipe, form)), scale_inv)
    if recipe.scaling == "rowwise":
        # [N, K], [N]: the per-channel amaxes of a sharded kernel are reduced over its shards (an all-reduce of [N])
        data, scale_inv = _rowwise_quantize(jnp.swapaxes(kernel, -1, -2), recipe.fwd_dtype)
        if gather is not None:
            data = fsdp.gather_transposed(jnp.swapaxes(data, -1, -2), gather)
        return QuantizedKernel(gemm_operand(data, recipe.fwd_dtype, gemm_form(form)), scale_inv)
    scale = kernel_meta["scale"]
    q = quantize(kernel, scale, recipe.fwd_dtype)  # [K, N]
    data = jnp.swapaxes(q, -1, -2) if gather is None else fsdp.gather_transposed(q, gather)
    return QuantizedKernel(gemm_operand(data, recipe.fwd_dtype, gemm_form(form)), 1.0 / scale.astype(jnp.float32))


def _rowwise_quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Each row of ``x`` [..., R, C] with its own current scale ``fp8_max / amax(row)`` (1 for an all-zero row):
    (FP8 values [..., R, C], inverse scales [..., R]). A row's amax is a max, which no reduction order changes, so
    a token quantizes the same in a decode step (M=1) and in a full-sequence forward (M=T)."""
    row_amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = scale_from_amax(row_amax, 1.0, fp8_max(dtype))
    return quantize(x, scale[..., None], dtype), 1.0 / scale


def _per_row_of_slices(a: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``a`` [..., R, C] with one current scale a row (``_rowwise_quantize``), its inverse repeated for each 128-wide
    slice of C: (FP8 values, [..., R, ceil(C / 128)]), the form in which block scaling's GEMMs take per-row scales.
    ``Fp8Recipe.block_forward``'s per-channel weights and per-token inputs."""
    data, scale_inv = _rowwise_quantize(a, dtype)
    return data, jnp.broadcast_to(scale_inv[..., None], (*scale_inv.shape, block.num_blocks(a.shape[-1])))


def block_gemm(qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array, form: str, out_dtype=None,
               impl: str = "auto") -> jax.Array:
    """``block.block_gemm`` -> [P, Q] in ``out_dtype`` (default f32): on a Hopper GPU outside a mesh of several
    devices by ``impl`` (``Fp8Recipe.block_gemm``) where it runs: ``cublaslt`` (and ``auto`` where
    ``block_kernel.prefers_cublaslt``), cuBLASLt's block-scaled FP8 GEMM (its FFI target registered, not two E5M2
    operands: ``cublaslt.runs_here``), else ``kernels.block_gemm``'s Mosaic GPU kernel (float8 operands of one type:
    ``block_kernel.runs_here``); elsewhere block_gemm's XLA emulation.
    ``sb``: one row of scales per row of qb [Q, Cb], or a weight's 128 x 128 block scales [ceil(Q / 128), Cb].
    Both GPU paths sum each 128-deep slice in the tensor cores' accumulator (DeepGEMM's
    precision: fewer bits than the emulation's f32 sums, section "Block-scaled FP8" of docs/accuracy.md) and add the
    scaled slices in f32."""
    kernel_dtype = out_dtype if jnp.dtype(out_dtype or jnp.float32) == jnp.bfloat16 else jnp.float32
    cublas = impl == "cublaslt" or (impl == "auto" and block_kernel.prefers_cublaslt(qa.shape[0], qb.shape[0]))
    if form == "f8" and cublas and cublaslt.runs_here(qa, qb, kernel_dtype):
        y = cublaslt.block_gemm_cublaslt(qa, sa, qb, sb, kernel_dtype)
    elif form == "f8" and block_kernel.runs_here(qa, qb):
        y = block_kernel.block_gemm_mgpu(qa, sa, qb, sb, kernel_dtype)
    else:
        y = block.block_gemm(qa, sa, qb, block.block_rows(sb, qb.shape[0]))
    return y if out_dtype is None else y.astype(out_dtype)


def _mm(a: jax.Array, b: jax.Array, a_contract: int, b_contract: int) -> jax.Array:
    """2-D product contracting one axis of each operand, accumulated in f32."""
    return lax.dot_general(
        a, b, (((a_contract,), (b_contract,)), ((), ())), preferred_element_type=jnp.float32
    )


def prequantized_matmul(
    x: jax.Array, kernel: QuantizedKernel, x_scale: jax.Array, recipe: Fp8Recipe, form: str | None = None, *,
    out_dtype=None, x_scale_inv: jax.Array | None = None,
):
    """``x [M, K] @ kernel`` with only ``x`` quantized here; returns [M, N] in ``out_dtype`` (default f32).

    The training forward calls this too, after ``quantize_kernel``: rollout with pre-quantized weights and the
    training forward run the same arithmetic on the same FP8 operands. ``x_scale_inv``: ``1 / x_scale`` made
    beforehand (``recipe.with_input_scale_inv``), the same value. An FP8 ``x`` is already quantized with
    ``x_scale`` (per-tensor scaling only).
    """
    form = _recipe_form(recipe, form)
    qw = gemm_operand(kernel.data, recipe.fwd_dtype, form)
    if jnp.dtype(x.dtype).itemsize == 1 and recipe.scaling != "tensor":
        raise ValueError(f"a pre-quantized FP8 input has its delayed scale; {recipe.scaling} scaling quantizes the "
                         "input itself")
    if recipe.scaling == "block":  # x_scale unused: each 1 x 128 tile of x (or its row) has its own current scale
        if recipe.block_forward == "tokens_blocks":
            qx, sx = _per_row_of_slices(x, recipe.fwd_dtype)
        else:
            (qx, sx), _ = block.tile_quantize_both(x, recipe.fwd_dtype, cols=False)
        return tiles_matmul(qx, sx, kernel, recipe, form, out_dtype)
    elif recipe.scaling in ("current", "mantissa"):  # x_scale unused: x's own amax, or no scale (sx 1)
        qx, sx = _quantized(x, recipe.fwd_dtype, recipe.scaling)
        # [M, K] . [N, K] -> [M, N]
        y = _mm(gemm_operand(qx, recipe.fwd_dtype, form), qw, 1, 1) * (sx * kernel.scale_inv)
    elif recipe.scaling == "rowwise":  # x_scale unused: each token's row has its own current scale
        qx, x_scale_inv = _rowwise_quantize(x, recipe.fwd_dtype)
        # [M, K] . [N, K] -> [M, N], scaled back per token and per output channel
        y = _mm(gemm_operand(qx, recipe.fwd_dtype, form), qw, 1, 1) * (x_scale_inv[:, None] * kernel.scale_inv)
    else:
        qx = gemm_operand(quantize_input(x, x_scale, recipe.fwd_dtype), recipe.fwd_dtype, form)
        # [M, K] . [N, K] -> [M, N]
        if x_scale_inv is None:
            x_scale_inv = 1.0 / x_scale.astype(jnp.float32)
        y = _mm(qx, qw, 1, 1) * (x_scale_inv * kernel.scale_inv)
    return y if out_dtype is None else y.astype(out_dtype)


def tiles_matmul(qx: jax.Array, sx: jax.Array, kernel: QuantizedKernel, recipe: Fp8Recipe, form: str | None = None,
                 out_dtype=None) -> jax.Array:
    """Block scaling's forward GEMM of an input already in its tiles, ``qx`` [M, K] (FP8) with inverse scales ``sx``
    [M, ceil(K / 128)], and a pre-quantized kernel: [M, N] in ``out_dtype`` (default f32). ``prequantized_matmul``
    quantizes x and calls this; ``block_mlp.swiglu_down`` hands it the SwiGLU's tiles from one kernel."""
    form = _recipe_form(recipe, form)
    qw = gemm_operand(kernel.data, recipe.fwd_dtype, form)
    return block_gemm(gemm_operand(qx, recipe.fwd_dtype, form), sx, qw, kernel.scale_inv, form, out_dtype,
                      recipe.block_gemm)


def gemm_into(residual: jax.Array, qx: jax.Array, x_scale_inv: jax.Array, w_nk: jax.Array,
              w_scale_inv: jax.Array) -> jax.Array:
    """``residual + (qx [M, K] . w_nk [N, K]^T) * x_scale_inv * w_scale_inv`` in ``residual``'s dtype, from FP8
    operands and their inverse scales, written so that XLA makes it one cuBLASLt FP8 GEMM on the GPU with the
    residual as its C operand (beta = 1), as it does for a BF16 GEMM: no elementwise kernel for the add (TE's GEMM
    takes no C operand).

    The operands are written dequantized, ``f32(q) * scale_inv``, the pattern XLA's GEMM rewriter folds into the
    FP8 GEMM's A/B scales (a scaled product after the dot would be an elementwise kernel of its own, between the
    GEMM and the add). ``qx`` passes an ``optimization_barrier`` first: where it is quantized in the same program,
    XLA may otherwise fold the f32 -> FP8 -> f32 round trip away as excess precision. Two such GEMMs must not share
    an operand: XLA would merge them into one dot on the concatenated dequantized kernels, which it no longer
    recognizes as FP8. With XLA's Triton GEMMs enabled XLA may split K into a batched FP8 GEMM plus a reduction,
    and the add is a kernel again: the decode programs that run it compile with ``xla_gpu_enable_triton_gemm=False``
    (``rollout.engine.DECODE_GPU_OPTIONS``). On a CPU this is the f32 product of the dequantized
    operands (each product rounded once more than the GPU's, ~1e-7 relative)."""
    a = lax.optimization_barrier(qx).astype(jnp.float32) * x_scale_inv
    b = w_nk.astype(jnp.float32) * w_scale_inv
    return residual + _mm(a, b, 1, 1).astype(residual.dtype)


def prequantized_matmul_into(
    residual: jax.Array, x: jax.Array, kernel: QuantizedKernel, x_scale: jax.Array, recipe: Fp8Recipe, *,
    x_scale_inv: jax.Array | None = None,
) -> jax.Array:
    """``residual + x [M, K] @ kernel`` (``gemm_into``): the rollout's ``prequantized_matmul`` with the residual
    add as the FP8 GEMM's C operand. Per-tensor scaling; the same FP8 operands and scales."""
    if recipe.scaling != "tensor":
        raise ValueError("prequantized_matmul_into takes per-tensor scaling (one scale for the input)")
    if x_scale_inv is None:
        x_scale_inv = 1.0 / x_scale.astype(jnp.float32)
    return gemm_into(residual, quantize_input(x, x_scale, recipe.fwd_dtype), x_scale_inv, kernel.data,
                     kernel.scale_inv)


def _cotangents(dx, dw, gather, kernel_amax, observed):
    """An FP8 matmul's backward outputs: under FSDP the devices' partial wgrads summed onto the master's shards (a
    reduce-scatter); the kernel amax input gets a zero cotangent (not differentiated)."""
    if gather is not None:
        dw = fsdp.reduce_to(dw, gather)
    return dx, dw, observed, None if kernel_amax is None else jnp.zeros_like(kernel_amax)


@functools.cache
def _fp8_matmul_fn(x_dtype, w_dtype, out_dtype, recipe: Fp8Recipe, form: str, gather: P | None = None):
    fwd_dtype, bwd_dtype = recipe.fwd_dtype, recipe.bwd_dtype

    @jax.custom_vjp
    def f(x, kernel, state, kernel_amax):
        y, _ = fwd(x, kernel, state, kernel_amax)
        return y

    def fwd(x, kernel, state, kernel_amax):
        qk = quantize_kernel(kernel, state["kernel"], recipe, "f8", gather)
        x_scale = state["x"]["scale"]
        operand = QuantizedKernel(gemm_operand(qk.data, fwd_dtype, form), qk.scale_inv)
        y = prequantized_matmul(x, operand, x_scale, recipe, form).astype(out_dtype)
        if recipe.scaling == "rowwise":  # the backward's operands: per tensor, with the delayed scales
            qk = quantize_kernel(kernel, state["kernel"], dataclasses.replace(recipe, scaling="tensor"), "f8",
                                 gather)
        qx = quantize(x, x_scale, fwd_dtype)  # CSE'd with the one inside prequantized_matmul (per-tensor)
        # the residuals stay float8 (one byte per value) in either form; under FSDP the kernel's is the gathered one
        amax_w = amax(kernel) if kernel_amax is None else kernel_amax
        residuals = (qx, qk.data, state, amax(x), amax_w, kernel_amax)
        return y, residuals

    def bwd(residuals, g):
        qx, qw, state, amax_x, amax_w, kernel_amax = residuals
        s_x, s_w, s_g = (state[r]["scale"].astype(jnp.float32) for r in ("x", "kernel", "grad"))
        qg = gemm_operand(quantize(g, s_g, bwd_dtype), bwd_dtype, form)
        qx, qw = gemm_operand(qx, fwd_dtype, form), gemm_operand(qw, fwd_dtype, form)
        # dx [M, K] = g [M, N] . w^T [N, K]
        dx = _mm(qg, qw, 1, 0) * ((1.0 / s_g) * (1.0 / s_w))
        # dw [K, N] = x [M, K]^T . g [M, N]
        dw = (_mm(qx, qg, 0, 0) * ((1.0 / s_x) * (1.0 / s_g))).astype(w_dtype)
        return _cotangents(dx.astype(x_dtype), dw, gather, kernel_amax, observations(state, amax_x, amax_w, amax(g)))

    f.defvjp(fwd, bwd)
    return f


# how the backward GEMMs of a non-standard recipe quantize their operands, dgrad (g [M, N], w [K, N]) and wgrad
# (x [M, K], g [M, N]); the forward is ``prequantized_matmul``'s. "delayed": the role's state scale; "current":
# the tensor's own amax; "tile": 1 x 128 tiles along the contraction axis (N for dgrad, the tokens for wgrad);
# "block": 128 x 128; "mantissa": no scale, the value rounded to the format's mantissa (the probe's floor). rowwise
# scales the forward only, as the standard path does. Block's wgrad takes g in blocks under block_wgrad=grad_blocks
# (``Fp8Recipe.grad_blocks``, the default), in tiles under block_wgrad=tiles.
BACKWARD_KINDS = {
    "tensor": {"dgrad": ("delayed", "delayed"), "wgrad": ("delayed", "delayed")},
    "rowwise": {"dgrad": ("delayed", "delayed"), "wgrad": ("delayed", "delayed")},
    "current": {"dgrad": ("current", "current"), "wgrad": ("current", "current")},
    "block": {"dgrad": ("tile", "block"), "wgrad": ("tile", "tile")},
    "mantissa": {"dgrad": ("mantissa", "mantissa"), "wgrad": ("mantissa", "mantissa")},
}


def _quantized(t: jax.Array, dtype, kind: str, delayed_scale: jax.Array | None = None):
    """``t`` [..., P, C] quantized as ``kind`` says (``BACKWARD_KINDS``): (FP8 values, inverse scales) with the
    scales [..., 1, 1] (per tensor), [..., P, Cb] (tiles) or [..., Pb, Cb] (blocks). ``mantissa``: the values
    ``mantissa_rounded`` (f32, not FP8) and inverse scales 1 [..., 1, 1]."""
    if kind == "mantissa":
        return mantissa_rounded(t, dtype), jnp.ones((*t.shape[:-2], 1, 1), jnp.float32)
    if kind == "tile":
        return block.tile_quantize(t, dtype)
    if kind == "block":
        return block.block_quantize(t, dtype)
    if kind == "current":
        a = jnp.max(jnp.abs(t.astype(jnp.float32)), axis=(-2, -1), keepdims=True)
        scale = scale_from_amax(a, 1.0, fp8_max(dtype))
    else:
        scale = jnp.reshape(delayed_scale.astype(jnp.float32), (1, 1))
    return quantize(t, scale, dtype), 1.0 / scale


def dgrad(g: jax.Array, w: jax.Array, kinds, recipe: Fp8Recipe, form: str, s_g, s_w, g_tiles=None,
          x_dtype=None, w_blocks=None) -> jax.Array:
    """dx [M, K] = g [M, N] . w [K, N]^T in FP8, the operands quantized as ``kinds`` says (``BACKWARD_KINDS``).
    ``g_tiles``: g's two tile forms already made (``block.tile_quantize_both``). ``x_dtype``: dx's dtype, which the
    block GEMM writes itself (the f32 sum rounded once, as ``astype`` would). ``w_blocks``: w's 128 x 128 blocks
    already made, (FP8 [K, N], inverse scales [Kb, Nb]) (``block_kernel_for_update``)."""
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
    if kinds[0] == "tile":  # g in 1 x 128 tiles along N, w in 128 x 128 blocks
        qg, sg = g_tiles[0] if g_tiles else block.tile_quantize(g, bwd)
        qw, sw = w_blocks or block.block_quantize(w, fwd)
        return block_gemm(gemm_operand(qg, bwd, form), sg, gemm_operand(qw, fwd, form), sw, form, x_dtype,
                          recipe.block_gemm)
    qg, sg = _quantized(g, bwd, kinds[0], s_g)
    qw, sw = _quantized(w, fwd, kinds[1], s_w)
    # [M, N] . [N, K] -> [M, K], laid out as the standard path's (the same sums in the same order)
    return _mm(gemm_operand(qg, bwd, form), gemm_operand(jnp.swapaxes(qw, 0, 1), fwd, form), 1, 0) * (sg * sw)


def wgrad(x: jax.Array, g: jax.Array, kinds, recipe: Fp8Recipe, form: str, s_x, s_g, g_tiles=None) -> jax.Array:
    """dw [K, N] = x [M, K]^T . g [M, N] in FP8, the operands quantized as ``kinds`` says. ``g_tiles``: as
    ``dgrad``'s (its second form in blocks under ``Fp8Recipe.grad_blocks``)."""
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
    if kinds[0] == "tile":  # x and g in 128 x 1 tiles: 1 x 128 tiles of their transposes, along the tokens
        _, (qx, sx) = block.tile_quantize_both(x, fwd, rows=False)
        qg, sg = (g_tiles or block.tile_quantize_both(g, bwd, rows=False, col_blocks=recipe.grad_blocks))[1]
        return block_gemm(gemm_operand(qx, fwd, form), sx, gemm_operand(qg, bwd, form), sg, form,
                          impl=recipe.block_gemm)
    qx, sx = _quantized(x, fwd, kinds[0], s_x)
    qg, sg = _quantized(g, bwd, kinds[1], s_g)
    # [M, K]^T . [M, N] -> [K, N]
    return _mm(gemm_operand(qx, fwd, form), gemm_operand(qg, bwd, form), 0, 0) * (sx * sg)


def _wide_gemm(a: jax.Array, b: jax.Array, dtype, form: str) -> jax.Array:
    """a [P, C] . b [Q, C]^T -> [P, Q] f32 on operands rounded to ``dtype`` (a GEMM left out of ``fp8_gemms``). In
    the ``f32`` form the rounded values go through an f32 GEMM: a product of two BF16 values is exact in f32."""
    if form == "f32":
        return _mm(rounded(a, dtype), rounded(b, dtype), 1, 1)
    return _mm(a.astype(dtype), b.astype(dtype), 1, 1)


def _unobserved(t: jax.Array) -> jax.Array:
    """The amax a linear reports where its recipe reads no delayed scale (``Fp8Recipe.delayed``): 0, which
    ``recipe.update_meta`` records as nothing observed (the scale stays)."""
    return jnp.zeros((), jnp.float32)


@functools.cache
def _general_matmul_fn(x_dtype, w_dtype, out_dtype, recipe: Fp8Recipe, form: str, gather: P | None = None):
    """``fp8_matmul`` for the recipes outside the standard path (``Fp8Recipe.standard``): the same contract (the
    cotangent of the state carries the call's three amaxes), the forward ``prequantized_matmul``'s, the backward
    GEMMs' operands quantized as ``BACKWARD_KINDS`` says; a GEMM left out of ``fp8_gemms`` is ``_wide_gemm``."""
    kinds = BACKWARD_KINDS[recipe.scaling]
    observe = amax if recipe.delayed else _unobserved

    @jax.custom_vjp
    def f(x, kernel, state, kernel_amax, hoisted):
        y, _ = fwd(x, kernel, state, kernel_amax, hoisted)
        return y

    def fwd(x, kernel, state, kernel_amax, hoisted):
        w = kernel if gather is None else fsdp.gather_bits(kernel, gather)  # [K, N]: the whole master
        if "fprop" in recipe.fp8_gemms:  # the rollout's arithmetic on the rollout's operands
            qw = hoisted_nk(hoisted, recipe, form) or quantize_kernel(w, state["kernel"], recipe, form)
            y = prequantized_matmul(x, qw, state["x"]["scale"], recipe, form, out_dtype=out_dtype)
        else:
            y = _wide_gemm(x, jnp.swapaxes(w, 0, 1), x_dtype, form)  # [M, K] . [N, K] -> [M, N]
        amax_w = kernel_amax if kernel_amax is not None and recipe.delayed else observe(kernel)
        return y.astype(out_dtype), (x, w, state, observe(x), amax_w, kernel_amax, hoisted)

    def bwd(residuals, g):
        x, w, state, amax_x, amax_w, kernel_amax, hoisted = residuals
        s_x, s_w, s_g = (state[r]["scale"] for r in ("x", "kernel", "grad"))
        g_tiles = None  # block scaling, both backward GEMMs in FP8: g's two tile forms from one read
        if recipe.scaling == "block" and {"dgrad", "wgrad"} <= set(recipe.fp8_gemms):
            g_tiles = block.tile_quantize_both(g, recipe.bwd_dtype, col_blocks=recipe.grad_blocks)
        if "dgrad" in recipe.fp8_gemms:
            dx = dgrad(g, w, kinds["dgrad"], recipe, form, s_g, s_w, g_tiles, x_dtype, hoisted_kn(hoisted))
        else:  # dx [M, K] = g [M, N] . w [K, N]^T
            dx = _wide_gemm(g, w, x_dtype, form)
        if "wgrad" in recipe.fp8_gemms:
            dw = wgrad(x, g, kinds["wgrad"], recipe, form, s_x, s_g, g_tiles)
        else:  # dw [K, N] = x^T [K, M] . g^T [N, M]^T
            dw = _wide_gemm(jnp.swapaxes(x, 0, 1), jnp.swapaxes(g, 0, 1), x_dtype, form)
        return (*_cotangents(dx.astype(x_dtype), dw.astype(w_dtype), gather, kernel_amax,
                             observations(state, amax_x, amax_w, observe(g))), None)

    f.defvjp(fwd, bwd)
    return f


def hoisted_nk(hoisted, recipe: Fp8Recipe, form: str) -> QuantizedKernel | None:
    """``hoisted`` (``train_kernel.block_forms``: ``(kn, nk, scale_inv)``, or None): the forward's operand as
    ``quantize_kernel`` returns it."""
    if hoisted is None:
        return None
    _, nk, scale_inv = hoisted
    return QuantizedKernel(gemm_operand(nk, recipe.fwd_dtype, form), scale_inv)


def hoisted_kn(hoisted):
    """The dgrad's operand as ``block.block_quantize`` returns it (``dgrad``'s ``w_blocks``), or None."""
    if hoisted is None:
        return None
    kn, _, scale_inv = hoisted
    return kn, jnp.swapaxes(scale_inv, -1, -2)


def fp8_matmul(
    x: jax.Array, kernel: jax.Array | TrainKernel, state: Fp8LinearState, recipe: Fp8Recipe, out_dtype=None,
    form: str | None = None, *, gather: P | None = None, kernel_amax: jax.Array | None = None,
) -> jax.Array:
    """Differentiable FP8 ``x [M, K] @ kernel [K, N]`` -> [M, N] in ``out_dtype`` (default ``x.dtype``).

    The cotangent for ``state`` carries the amaxes observed in this call (see ``recipe``'s design note).
    ``form``: the GEMM form (``gemm_form``; None = this platform's). ``gather``: ``kernel`` is FSDP-sharded with
    this ``PartitionSpec``; its shards are quantized where they are and gathered as FP8 bits, and its gradient is
    reduce-scattered back (``parallel.fsdp``). ``kernel_amax``: the kernel's global amax where the caller has it
    already (observed as is; otherwise reduced here). A ``TrainKernel`` (``block_kernel_for_update``) brings block
    scaling's FP8 operands made once for the update; the gradient goes to its master.
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    hoisted = None
    if isinstance(kernel, TrainKernel):
        hoisted = block_forms(kernel)
        if gather is not None or hoisted is None or not hoists_block_kernels(recipe):
            raise ValueError(f"a TrainKernel here is block scaling's whole kernel (block_kernel_for_update), for "
                             f"{recipe} with gather={gather}")
        kernel = kernel.master
    make = _fp8_matmul_fn if recipe.standard else _general_matmul_fn
    fn = make(jnp.dtype(x.dtype), jnp.dtype(kernel.dtype), out_dtype, recipe, _recipe_form(recipe, form), gather)
    if make is _fp8_matmul_fn:
        return fn(x, kernel, state, kernel_amax)
    return fn(x, kernel, state, kernel_amax, hoisted)
