"""Rollout weights: every FP8 kernel quantized once per RL step, with the current delayed scales.

Decoding reads each weight once per generated token, so at decode sizes the GEMMs are bound by weight bytes.
Re-quantizing the BF16/F32 master weight inside every decode step (what an FP8 training layer does) reads the
weight in high precision and writes it again in FP8 before the GEMM even starts. Instead, ``rollout_params``
quantizes all FP8 kernels once after each update; the sampler streams one byte per weight.

The quantization is the training forward's own (``linear.quantize_kernel`` with the same scale), so rollout
and training see bit-identical FP8 kernels. Kernels outside FP8 (``bf16_first_layers`` / ``bf16_last_layers``,
the lm_head) and the embedding table are cast to the compute dtype, exactly the cast the training forward applies
on the fly; norm weights and biases keep their master dtype, since the forward reads them at full precision.

On a mesh (``Engine``) the weights are quantized where the masters lie (the trainer's layout, a local operation)
and then resharded to the rollout's layout (``parallel.mesh.rollout_mesh``), once per RL step: ``as_bits`` /
``from_bits`` carry every FP8 kernel through the reshard as the bits of its FP8 values (one byte per weight, also
where the CPU stores the kernels as f32, ``fp8.xla.gemm_form``; XLA:CPU would widen an FP8 or BF16 all-gather),
and ``interleave_fused`` lays out the fused column axes per tensor shard for a rollout ``tensor`` axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fp8 import block
from fp8rl_jax.fp8.linear import quantize_kernel
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.xla import QuantizedKernel, gemm_operand
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.model.llama import LINEARS, block_segments, lm_head_kernel, slice_layers, split_layers


def rollout_params(params: dict, fp8_state: dict | None, precision: Precision, num_layers: int) -> dict:
    """Params for the sampler: ``blocks`` split into precision segments, FP8 kernels pre-quantized.

    Jit this (it is a pure function of its inputs); ``num_layers`` is static.
    """
    dtype = precision.dtype
    segs, seg_blocks = block_segments(params, precision, num_layers)
    out_segments = []
    for (start, end, is_fp8), blocks in zip(segs, seg_blocks, strict=True):
        seg = {}
        for name, value in blocks.items():
            if is_fp8 and name in LINEARS and name not in precision.bf16_linears:
                meta = slice_layers(fp8_state["blocks"][name], start, end, num_layers)
                # one layer's [K, N] kernel and scalar scale, mapped over the segment's layers
                seg[name] = jax.vmap(lambda k, m: quantize_kernel(k, m, precision))(value, meta)
            elif name in LINEARS:
                seg[name] = value.astype(dtype)
            else:
                seg[name] = value
        out_segments.append(seg)
    out = dict(params)
    out["embed"] = params["embed"].astype(dtype)
    out["blocks"] = tuple(out_segments)
    if "lm_head" in params:
        out["lm_head"] = params["lm_head"].astype(dtype)
    if precision.lm_head_fp8 and fp8_state is not None:
        out["lm_head"] = quantize_kernel(lm_head_kernel(params), fp8_state["lm_head"], precision)
    return out


def per_layer(weights: dict) -> dict:
    """``rollout_params``' output in the CPU's form: every segment of ``blocks`` as a tuple of per-layer trees
    (``llama.split_layers``), which the decode step reads in place (see ``llama.forward_hidden``), and a BF16
    embedding table also as its bits (``embed_bits``), whose rows XLA:CPU gathers as they are (from a BF16 table
    it first converts the whole table to f32, at every call)."""
    out = {**weights, "blocks": tuple(split_layers(seg) for seg in weights["blocks"])}
    embed = weights["embed"]
    if embed.dtype.itemsize < 4:
        out["embed_bits"] = jax.lax.bitcast_convert_type(embed, jnp.dtype(f"uint{8 * embed.dtype.itemsize}"))
    return out


def is_kernel(x) -> bool:
    """A pre-quantized FP8 kernel (a tree leaf of the rollout weights)."""
    return isinstance(x, QuantizedKernel)


def _bits(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))


def as_bits(weights: dict, precision: Precision) -> dict:
    """``rollout_params``' output as the bits it moves in a reshard: a ``QuantizedKernel``'s data as the uint8 bits
    of its FP8 values (exact: an f32 form holds FP8 values), every other float narrower than f32 (BF16 tables and
    kernels) as its uint bits; the rest as it is. ``from_bits`` inverts it."""
    fp8 = precision.recipe.fwd_dtype

    def one(x):
        if is_kernel(x):
            return QuantizedKernel(_bits(x.data.astype(fp8)), x.scale_inv)
        return _bits(x) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4 else x

    return jax.tree.map(one, weights, is_leaf=is_kernel)


def from_bits(bits: dict, like: dict, precision: Precision) -> dict:
    """``as_bits``' inverse: the arrays of ``like`` (a tree of arrays or ``jax.ShapeDtypeStruct``, ``rollout_params``'
    output) from their bits, bit for bit (an f32-form kernel through ``gemm_operand``, as ``quantize_kernel``
    made it)."""
    fp8 = precision.recipe.fwd_dtype

    def one(b, x):
        if is_kernel(x):
            q = jax.lax.bitcast_convert_type(b.data, fp8)
            return QuantizedKernel(gemm_operand(q, fp8, "f8" if x.data.dtype == fp8 else "f32"), b.scale_inv)
        return b if b.dtype == x.dtype else jax.lax.bitcast_convert_type(b, x.dtype)

    return jax.tree.map(one, bits, like, is_leaf=is_kernel)


def fused_sizes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The parts of each fused column axis, in order: [q | k | v] and [gate | up]."""
    return {"wqkv": (config.q_size, config.kv_size, config.kv_size), "bqkv": (config.q_size, config.kv_size,
            config.kv_size), "w_gate_up": (config.intermediate_size,) * 2}


def interleave(a: jax.Array, axis: int, sizes: tuple[int, ...], shards: int) -> jax.Array:
    """The parts (``sizes``, in order) of ``a``'s ``axis`` reordered as ``shards`` contiguous blocks, block s holding
    part 0's s-th slice, then part 1's s-th slice, ...: each shard of a contiguous split over ``shards`` devices then
    holds matching slices of every part ([q_s | k_s | v_s]). ``shards=1`` is the identity."""
    if shards == 1:
        return a
    axis = axis % a.ndim
    parts = jnp.split(a, np.cumsum(sizes)[:-1].tolist(), axis=axis)
    # each part [..., size, ...] -> [..., shards, size / shards, ...]; joined along the slice axis
    parts = [p.reshape(*p.shape[:axis], shards, p.shape[axis] // shards, *p.shape[axis + 1:]) for p in parts]
    joined = jnp.concatenate(parts, axis=axis + 1)
    return joined.reshape(a.shape)


def interleave_fused(weights: dict, config: LlamaConfig, shards: int) -> dict:
    """The fused column axes of every block segment (``wqkv``, ``bqkv``, ``w_gate_up``: a kernel's N axis, a
    row-wise ``scale_inv``'s too) ``interleave``d for a rollout ``tensor`` axis of ``shards`` devices, which
    ``llama.forward_hidden(fused_shards=shards)`` splits locally. Works on ``as_bits``' output as well."""
    if shards == 1:
        return weights
    sizes = fused_sizes(config)

    def one(name, x):
        if name not in sizes:
            return x
        if is_kernel(x):  # data [..., N, K]; scale_inv [..., N] (row-wise), [..., Nb, Kb] (blocks) or per tensor
            n = x.data.shape[-2]
            if x.scale_inv.ndim == x.data.ndim:  # 128 x 128 blocks: a shard's rows cut across them, so each row
                # takes its block's scales ([..., N, Kb], which the block GEMM reads as they are) and moves with them
                return QuantizedKernel(interleave(x.data, -2, sizes[name], shards),
                                       interleave(block.block_rows(x.scale_inv, n), -2, sizes[name], shards))
            rowwise = x.scale_inv.ndim == x.data.ndim - 1
            return QuantizedKernel(interleave(x.data, -2, sizes[name], shards),
                                   interleave(x.scale_inv, -1, sizes[name], shards) if rowwise else x.scale_inv)
        return interleave(x, -1, sizes[name], shards)  # a kernel [..., K, N] or a bias [..., N]

    blocks = tuple({n: one(n, x) for n, x in seg.items()} for seg in weights["blocks"])
    return {**weights, "blocks": blocks}
