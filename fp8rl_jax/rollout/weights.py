"""Rollout weights: every FP8 kernel quantized once per RL step, with the current delayed scales.

Decoding reads each weight once per generated token, so at decode sizes the GEMMs are bound by weight bytes.
Re-quantizing the BF16/F32 master weight inside every decode step (what an FP8 training layer does) reads the
weight in high precision and writes it again in FP8 before the GEMM even starts. Instead, ``rollout_params``
quantizes all FP8 kernels once after each update; the sampler streams one byte per weight.

The quantization is the training forward's own (``linear.quantize_kernel`` with the same scale), so rollout
and training see bit-identical FP8 kernels. Kernels outside FP8 (``bf16_first_layers`` / ``bf16_last_layers``,
the lm_head) and the embedding table are cast to the compute dtype, exactly the cast the training forward applies
on the fly; norm weights and biases keep their master dtype, since the forward reads them at full precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8.linear import quantize_kernel
from fp8rl_jax.fp8.policy import Precision
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
