"""Decode attention: one query token per sequence against the filled part of that sequence's KV cache.

Design note
-----------
Why. The model's cached attention scores every position of the preallocated cache [B, K, S, H] and masks the
unfilled ones, so each decode step reads all S positions of every layer whatever the sequences' lengths. This
module reads positions ``0 .. length - 1`` of each sequence only, straight from the BF16 or FP8 cache.

The kernel (Pallas, Triton backend). Grid ``(B*K, k_splits)``: one program per (sequence, kv head) and split.
A program loads the G query heads that share its kv head once (rows padded to 16, the smallest dot Triton
emits; the padding rows are masked out of loads and stores), then walks blocks of ``block_k`` positions with an
online softmax in f32 (scale 1/sqrt(H)). The splits divide each sequence's *filled* length (its number of
blocks), not the cache length, so every split has work at any fill level; a split that gets no block (a short
sequence) runs no iteration. Each split writes its unnormalised partial row max, row sum and
accumulator (f32, the G real rows only); four XLA ops combine the splits. With one split (batch 256 at K=8) the
kernel normalises and writes the output itself, so no XLA op runs beside it: at decode sizes each such op is a
kernel launch of its own (~1.3 us), and the scalar ones (1/sqrt(H) / k_scale) ran once per layer and step.

Several kv heads per program (``heads_per_program`` P; P = 1 is the kernel above, unchanged). With G = 4 three
quarters of the [16, block_k] score tile are padding, and the softmax's elementwise work (scale, mask, max, exp,
sum) is spent on them too; per-element work, not bytes, appears to hold the FP8 kernel on the H100 (2.25 TB/s
against BF16's 2.7, benchmarks/RESULTS.md, "Decode attention kernel"). With P > 1 a program takes P consecutive kv
heads of one sequence (grid ``(B*K/P, k_splits)``, P divides K) and their P*G query rows as one tile (padded to a
power of two, at least 16). Head j's QK dot takes that tile with every row outside head j zeroed, so its scores are
exact zeros there and the P dots add up to one score tile in which every row is real; the online softmax runs once
on it, and each head keeps its own [rows, H] accumulator (``p`` times its own V), of which only its own rows are
stored. The dots do the same work as P programs of one head; the softmax's is divided by P (for P*G <= 16). The
cost: P accumulators live in registers, and P K and V tiles per iteration (the default ``block_k`` keeps 16 KiB of K
per iteration over the P heads, so the staged shared memory stays close to P = 1's). Compiled on CPU with Triton 3.9
for sm_90 at P = 4, G = 4 and the default block_k: 51 KiB of shared memory and 126 registers a thread at H=64 FP8
(block_k 64), 58 KiB and 144 at H=128 FP8 (32), 54 KiB and 114 at H=128 BF16 (16); no spills (block_k 128 at P = 4
and H=128 needs 184 KiB of shared memory in FP8, 315 in BF16). The default (``default_heads_per_program``): P = 2
over an FP8 cache when the grid keeps ``TARGET_PROGRAMS`` programs without splits (batch 256 at K=8) and 2G rows fit
the 16-row tile, else 1. Measured on the H100 with the lean loop (``results/decode_heads_warps_h100.json``; the
rollout's A/B in benchmarks/RESULTS.md, "Decode attention kernel"): FP8 batch 256, 1,088 positions 149.4 -> 141.2 us
a layer-step (P = 4 154.5, 8 warps slower at every P); the rollout 108.1k -> 110.5k tokens/s; BF16 slower at P = 2
(228.8 -> 239.9), FP8 at batch 64 (4 splits) level (46.4k / 46.3k).

FP8 K/V. E4M3 values convert to F16 exactly, so the kernel casts the stored E4M3 values to F16 for the dots (a
BF16 query is rounded to F16 once; F16 operands measured 10-22% faster than BF16 ones on the H100: Hopper
converts E4M3 pairs to F16 in one instruction) and applies the per-layer scales in f32 where they cost least:
``1/k_scale`` joins the softmax scale on the [G, block_k] scores and ``1/v_scale`` multiplies the combined [G, H]
output (the kernel takes the scales and inverts them itself). That is the dequantization ``q8 * (1/scale)`` in
exact arithmetic, with one rounding fewer than the XLA path (which rounds the dequantized K/V to BF16 before its
dots). No BF16 copy of the cache is made. Each scale is an operand of its own, as the step has it: a layer's
scalar (the unrolled decode step's per-layer buffers) or, with a stacked cache, all layers' [L], read at the layer
index. Gathering them into one array cost a one-thread XLA kernel per layer and step (16 a step at llama1b).

The loop (``LEAN_LOOP``). Per 64-position block over an FP8 cache, Triton 3.5's code for sm_90 had 513 instructions
(BF16's: 438) for half the bytes: 2.3x the instructions per byte, about 80% of an SM's issue slots at the copy rate.
Two changes, the same attention: the softmax takes exp2 of scores in log2 units (log2(e) joins the score scale; one
MUFU.EX2 each instead of ``__nv_expf``'s extra arithmetic; the split combine and the new position take the same
units), and V's rows past the length are loaded as zeros (the masked load's ``other``) instead of a select on the
converted tile; an FP8 V is multiplied by a runtime one (LLVM folds it away) so that Triton still converts it in its
blocked layout before the F16 shared-memory round trip (without it V is read as the dot's operand byte by byte):
344 instructions (BF16 252), static counts of the compiled loop. Measured on the H100: the rollout 1-2% faster in both
dtypes (benchmarks/RESULTS.md, "Decode attention kernel"), so the kernel's rate over FP8 is not its instruction
count alone.
Tried and left out: the QK dot in FP8 (the query quantized per row in the kernel): Triton upcasts both operands
to F16 for the 16-row mma anyway; 1.4% slower in the rollout (benchmarks/RESULTS.md, "Decode attention kernel").

The output. With ``out_dtype`` FP8 and ``out_scale`` (the rollout's pre-quantized ``wo``: its input scale) the
kernel rounds the output to the query's dtype and quantizes it as ``recipe.quantize`` would, so ``wo``'s GEMM
reads it as it is (``linear`` takes an FP8 input as quantized with its input scale): the same bits, and no XLA
quantize kernel per layer and step (16 a step, ~1.5-2 us each on the H100).

The new token's K and V (``new_kv``). The decode step's K and V of its one new position were written into the
cache by an XLA scatter per tensor and layer (with the FP8 quantize fused in: 4.3 and 3.9 us a layer at batch 256
on the H100, benchmarks/RESULTS.md, "Decode attention kernel"), and the kernel then read them back. Given them, the
kernel writes them itself: the caches are also its outputs, aliased to its inputs (the same buffers, written in
place), and the program of the last split of each (sequence, kv head) quantizes its K and V as ``recipe.quantize``
would, stores them at position ``length - 1`` and joins that position's score and value to its online softmax from
registers, while its blocks cover the positions before it (no read after the write, so no ordering between the
store and the loads is needed).

The projection (``decode_attention_qkv``). Three more XLA kernels per layer and step fed the kernel: the slice of V
and two RoPE fusions for q and k (1.5, 1.7 and 2.2 us at batch 256). Given the q|k|v GEMM's output [B, N+2K, H] as
it is and the step's cos / sin [B, H/2], a program reads its G query rows and its head's K and V rows itself and
rotates them with ``llama.apply_rope``'s arithmetic (f32, rounded to the projection's dtype); Pallas' Triton lowering
has no concatenation, so the rotated halves are joined by a two-way stack and a transpose.

The cache is read in place. The kernel takes the whole stacked cache [L, B, K, S, H] and the layer index (a
traced scalar inside the layer scan) and indexes the layer itself: slicing one layer out of the scan's carried
cache would make XLA copy that layer into a fresh buffer for the custom call, a full-cache read and write per
layer, more traffic than the einsum it replaces. A per-layer [B, K, S, H] cache is accepted too (as L = 1).

Pointer offsets. Pallas' Triton lowering computes element offsets in 32 bits for arrays of at most 4 GiB. For
1-byte dtypes (the FP8 cache) of 2 to 4 GiB the offsets pass 2**31 and would wrap negative (Triton adds them
sign-extended); Llama-3.2-1B at batch 256 with 1088 cache positions is such a cache (2.3 GB per K or V).
``_widen_byte_array_offsets`` makes the lowering use 64-bit offsets for 1-byte arrays of more than 2**31
elements (a wrapper around one private lowering function, applied when such a cache is seen); where that
function is missing the layer is sliced out instead (correct, at the cost of the copy above).

Defaults (H100; ``benchmarks/decode_attention.py`` sweeps them; ``MAX_BLOCK_K``, ``TARGET_PROGRAMS``,
``NUM_STAGES``):
- ``block_k``: 16 KiB of K (and of V) per iteration (over the P heads), at most 64 positions: 64 at H=64 and at
  H=128, in both dtypes. ``num_stages=3`` stages the next two blocks' K/V in shared memory while this one computes.
- ``k_splits``: enough programs for ~8 per SM (132 SMs): 1024 / (B*K/P) rounded up, between 1 and 16, and at
  least 2 for a cache of 32 blocks or more. Batch 256 at K=8 gives 2048 programs of one kv head over a BF16 cache
  and 1024 of two over an FP8 one (1 split, no combine traffic); batch 64 gives 512 (2 splits).
  A sweep of the kernel alone (benchmarks/RESULTS.md, "Decode attention kernel": block_k 32 / 64 / 128 x
  1 / 2 / 4 splits x 2 / 4 warps x 2 / 3 stages, llama1b heads, half of a 1,088-position cache) put 64-position
  blocks with three stages at or near the best in both dtypes; in the rollout (``bench rollout --decode_tuning
  128:2048:2,64:1024:3``) they took FP8 + FP8 KV at batch 256 from 91.8k to
  95.5k tokens/s and BF16 from 69.8k to 71.0k; at batch 64 both within 1%. The earlier defaults (128 positions,
  ~2048 programs, 2 stages) came from the first sweep (the same section), where 256-position
  blocks were always slower and 8 warps never won by more than the noise.
- ``num_warps=4``: 128 threads for a [16, block_k] score tile and one [block_k, H] load per tensor; the
  benchmark tries 8.

On a mesh. A ``pallas_call`` is opaque to XLA's partitioner, which would gather its operands (the whole KV cache)
onto every device. Under a mesh of several devices (``jax.set_mesh``; the rollout's, ``parallel.mesh.rollout_mesh``)
``decode_attention`` runs the kernel under ``jax.shard_map`` over the batch and the kv heads, with the specs the
sharding rules give the cache (``parallel.rules``: batch over data+fsdp, kv heads over tensor): every device runs
it on its own sequences and heads, and nothing crosses devices (attention is local to a (sequence, kv head)).

Left out: paged caches, sliding windows, soft-capping, query lengths above 1 (prefill keeps the einsum path),
and an FP8 x FP8 dot (tried, above).

Letters: B batch, K kv heads, G query heads per kv head, H head dim, S cache positions, L layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from fp8rl_jax.numerics import fp8_max, quantize, rounded

IMPLS = ("auto", "pallas", "pallas_interpret", "xla")
NEG_INF = -1e30  # the XLA path's mask value (as in ``llama.attention``)
MIN_DOT_ROWS = 16  # Triton's smallest dot tile: the query rows (G) are padded up to it


# ----------------------------------------------------------------------------------------------------------
# choices


def resolve_impl(impl: str) -> str:
    """``auto`` -> ``pallas`` on a GPU backend, ``xla`` elsewhere; the others pass through (validated)."""
    if impl not in IMPLS:
        raise ValueError(f"decode_attention={impl!r}; allowed: {IMPLS}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def _pow2_ceil(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


# The launch defaults (the module note's "Defaults"); ``bench rollout --decode_tuning`` runs the rollout under
# other values of the three (``tuned``).
MAX_BLOCK_K = 64  # positions per block at most (16 KiB of K per iteration below that)
TARGET_PROGRAMS = 1024  # splits are added until the grid has about this many programs
NUM_STAGES = 3
# The block loop's lean form (the module note's "The loop"): exp2 of scores in log2 units and V's masked rows
# loaded as zeros; False: exp and a select on the converted V tile (the earlier form; ``bench rollout --variants
# select_exp_loop``). Read when the kernel is traced.
LEAN_LOOP = True
# ``heads_per_program``'s default: None, ``default_heads_per_program``; an int, that (``bench rollout --variants
# one_head_per_program``: 1, the earlier default)
HEADS_PER_PROGRAM = None
LOG2_E = math.log2(math.e)


def default_block_k(head_dim: int, cache_itemsize: int, cache_len: int, heads_per_program: int = 1) -> int:
    """16 KiB of K per iteration (over the program's ``heads_per_program`` kv heads), a power of two in
    [16, ``MAX_BLOCK_K``], no larger than the cache (rounded up)."""
    block_k = min(max(_pow2_floor(16 * 1024 // (heads_per_program * head_dim * cache_itemsize)), 16), MAX_BLOCK_K)
    return min(block_k, max(_pow2_ceil(cache_len), 16))


def default_heads_per_program(rows: int, kv_heads: int, groups: int, cache_itemsize: int) -> int:
    """2 kv heads a program over an FP8 cache when ``rows`` (B*K) / 2 programs still make ``TARGET_PROGRAMS`` (no
    splits needed), K is even and the 2G query rows fit one 16-row tile; else 1 (the module note's "Several kv
    heads per program": measured faster only there)."""
    two = (cache_itemsize == 1 and kv_heads % 2 == 0 and 2 * groups <= MIN_DOT_ROWS
           and rows // 2 >= TARGET_PROGRAMS)
    return 2 if two else 1


def heads_per_program_for(heads_per_program: int | None, rows: int, kv_heads: int, groups: int,
                          cache_itemsize: int) -> int:
    """``heads_per_program`` where given (not None), else ``HEADS_PER_PROGRAM``, else ``default_heads_per_program``."""
    if heads_per_program is not None:
        return heads_per_program
    return HEADS_PER_PROGRAM or default_heads_per_program(rows, kv_heads, groups, cache_itemsize)


LONG_CACHE_BLOCKS = 32  # a cache of this many blocks or more gets at least two splits


def default_k_splits(rows: int, cache_len: int, block_k: int) -> int:
    """About ``TARGET_PROGRAMS`` programs in all, 1..16 splits, at least 2 for a long cache (``LONG_CACHE_BLOCKS``),
    no more splits than cache blocks."""
    blocks = -(-cache_len // block_k)
    splits = min(max(-(-TARGET_PROGRAMS // rows), 2 if blocks >= LONG_CACHE_BLOCKS else 1), 16)
    return max(min(splits, blocks), 1)


@contextlib.contextmanager
def tuned(max_block_k: int, target_programs: int, num_stages: int):
    """The launch defaults set to these values inside the block (benchmarks: the rollout under other defaults;
    they are read when a program is traced)."""
    global MAX_BLOCK_K, TARGET_PROGRAMS, NUM_STAGES
    saved = MAX_BLOCK_K, TARGET_PROGRAMS, NUM_STAGES
    MAX_BLOCK_K, TARGET_PROGRAMS, NUM_STAGES = max_block_k, target_programs, num_stages
    try:
        yield
    finally:
        MAX_BLOCK_K, TARGET_PROGRAMS, NUM_STAGES = saved


def default_dot_dtype(q_dtype, cache_dtype):
    """float16 for a BF16 query over an FP8 cache (measured 10-22% faster on the H100 than BF16 operands,
    benchmarks/RESULTS.md, "Decode attention kernel"); the query's dtype otherwise."""
    if jnp.dtype(cache_dtype).itemsize == 1 and jnp.dtype(q_dtype) == jnp.bfloat16:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(q_dtype)


def pallas_unsupported(head_dim: int) -> str | None:
    """Why the kernel cannot take this head dim (Triton tiles are powers of two, dots at least 16 wide), or None."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim} is not a power of two >= 16"
    return None


# ----------------------------------------------------------------------------------------------------------
# shared input handling


def _stacked(cache: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
    """[B, K, S, H] (layer 0 of a one-layer stack) or [L, B, K, S, H] with ``layer`` -> ([L, B, K, S, H], layer)."""
    if cache.ndim == 4:
        if layer is not None:
            raise ValueError("a per-layer [B, K, S, H] cache takes no layer index")
        return cache[None], jnp.int32(0)
    if cache.ndim == 5:
        if layer is None:
            raise ValueError("a stacked [L, B, K, S, H] cache needs the layer index")
        return cache, jnp.asarray(layer, jnp.int32)
    raise ValueError(f"K/V cache must be [B, K, S, H] or [L, B, K, S, H], got shape {cache.shape}")


def _check(q, k_cache, v_cache, lengths, k_scale, v_scale):
    b, kh, _, h = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"K cache {k_cache.shape} {k_cache.dtype} and V cache {v_cache.shape} {v_cache.dtype} differ")
    if k_cache.shape[1] != b or k_cache.shape[2] != kh or k_cache.shape[4] != h:
        raise ValueError(f"query [B, K, G, H] = {q.shape} does not match the cache [L, B, K, S, H] = {k_cache.shape}")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be int [B={b}], got {lengths.dtype} {lengths.shape}")
    if jnp.dtype(k_cache.dtype).itemsize == 1 and (k_scale is None or v_scale is None):
        raise ValueError(f"a {k_cache.dtype} K/V cache needs k_scale and v_scale")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and jnp.ndim(scale) not in (0, 1):
            raise ValueError(f"{name} must be a scalar or one per layer [L], got shape {jnp.shape(scale)}")
        if scale is not None and jnp.ndim(scale) == 1 and jnp.shape(scale)[0] != k_cache.shape[0]:
            raise ValueError(f"{name} has {jnp.shape(scale)[0]} per-layer entries; "
                             f"the cache has {k_cache.shape[0]} layers")


def _check_new(q, new_kv):
    """``new_kv``: None or this step's (K, V), each [B, K, H] as the query's [B, K, G, H] has them."""
    if new_kv is None:
        return
    b, kh, _, h = q.shape
    if not isinstance(new_kv, (tuple, list)) or len(new_kv) != 2:
        raise ValueError("new_kv must be a pair (k, v) of [B, K, H] arrays")
    for name, a in zip(("k", "v"), new_kv, strict=True):
        if a.shape != (b, kh, h):
            raise ValueError(f"new_kv {name} must be [B, K, H] = {(b, kh, h)}, got {a.shape}")


def _out_format(out_scale, out_dtype, q_dtype) -> tuple[jnp.dtype, bool]:
    """The output dtype and whether it is quantized (an FP8 ``out_dtype``, which needs ``out_scale``)."""
    out_dtype = jnp.dtype(out_dtype or q_dtype)
    quantized = out_dtype.itemsize == 1
    if quantized != (out_scale is not None):
        raise ValueError(f"out_scale goes with an FP8 out_dtype (got out_dtype={out_dtype}, out_scale "
                         f"{'set' if out_scale is not None else 'None'})")
    return out_dtype, quantized


def _layer_scale(scale, layer):
    """A scalar scale as it is; one per layer [L] indexed by ``layer``."""
    if scale is None or jnp.ndim(scale) == 0:
        return scale
    return jnp.asarray(scale)[layer]


def _inverse_scale(scale) -> jax.Array:
    return jnp.float32(1.0) if scale is None else 1.0 / jnp.asarray(scale, jnp.float32)


def _output(out: jax.Array, q_dtype, out_dtype, out_scale) -> jax.Array:
    """The attention output rounded to the query's dtype, then, for an FP8 ``out_dtype``, quantized with
    ``out_scale`` exactly as the next linear would quantize that BF16 value (``recipe.quantize``)."""
    if out_scale is None:
        return out.astype(q_dtype)
    # the rounding to q's dtype kept (XLA may fold an f32 -> bf16 -> f32 convert pair away)
    return quantize(rounded(out, q_dtype), jnp.asarray(out_scale, jnp.float32), out_dtype)


# ----------------------------------------------------------------------------------------------------------
# the XLA path


def decode_attention_xla(q, k_cache, v_cache, lengths, *, layer=None, k_scale=None, v_scale=None, out_scale=None,
                         out_dtype=None, new_kv=None):
    """The model's masked einsum over all S positions (FP8 K/V dequantized to the query dtype first).

    Positions at or past a sequence's length are masked out of the scores and zeroed in V, so whatever they
    hold (NaN included) cannot reach the output. Same signature as ``decode_attention``; ``new_kv`` is written by
    a scatter first (``write_new``).
    """
    cache_shape = k_cache.shape
    (k_cache, _), (v_cache, layer) = _stacked(k_cache, layer), _stacked(v_cache, layer)
    _check(q, k_cache, v_cache, lengths, k_scale, v_scale)
    _check_new(q, new_kv)
    out_dtype, _ = _out_format(out_scale, out_dtype, q.dtype)
    k_scale, v_scale = _layer_scale(k_scale, layer), _layer_scale(v_scale, layer)
    if new_kv is not None:
        k_cache, v_cache = (write_new(c, layer, lengths, new, scale)
                            for c, new, scale in zip((k_cache, v_cache), new_kv, (k_scale, v_scale), strict=True))
    s, h = k_cache.shape[3], q.shape[-1]
    # [L, B, K, S, H] -> [B, K, S, H]
    k, v = k_cache[layer], v_cache[layer]
    k = (k.astype(jnp.float32) * _inverse_scale(k_scale)).astype(q.dtype) if k_scale is not None else k.astype(q.dtype)
    v = (v.astype(jnp.float32) * _inverse_scale(v_scale)).astype(q.dtype) if v_scale is not None else v.astype(q.dtype)
    # [B, S]
    visible = jnp.arange(s)[None, :] < jnp.clip(lengths, 0, s)[:, None]
    # [B, K, G, H] x [B, K, S, H] -> [B, K, G, S]
    scores = jnp.einsum("bkgh,bksh->bkgs", q, k, preferred_element_type=jnp.float32) / math.sqrt(h)
    scores = jnp.where(visible[:, None, None, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    v = jnp.where(visible[:, None, :, None], v, 0)
    # [B, K, G, S] x [B, K, S, H] -> [B, K, G, H]
    out = jnp.einsum("bkgs,bksh->bkgh", probs, v, preferred_element_type=v.dtype)
    out = _output(out, q.dtype, out_dtype, out_scale)
    return out if new_kv is None else (out, k_cache.reshape(cache_shape), v_cache.reshape(cache_shape))


def write_new(cache: jax.Array, layer, lengths: jax.Array, new: jax.Array, scale=None) -> jax.Array:
    """``new`` [B, K, H] stored (an FP8 cache: ``recipe.quantize`` with ``scale``) at position ``lengths - 1`` of
    each sequence in layer ``layer`` of ``cache`` [L, B, K, S, H], by a scatter; a position outside the cache is
    not written. What the kernel's ``new_kv`` writes."""
    if jnp.dtype(cache.dtype).itemsize == 1:
        new = quantize(new, jnp.asarray(scale, jnp.float32), cache.dtype)
    s = cache.shape[3]
    at = lengths - 1
    at = jnp.where((at >= 0) & (at < s), at, s)  # s: dropped
    return cache.at[layer, jnp.arange(cache.shape[1]), :, at].set(new.astype(cache.dtype), mode="drop")


# ----------------------------------------------------------------------------------------------------------
# the Pallas kernel


def _kernel(layer_ref, lengths_ref, k_scale_ref, v_scale_ref, out_scale_ref, q_ref, k_ref, v_ref, *refs,
            kv_heads: int, groups: int, heads_per_program: int, rows_padded: int, rows_per_layer: int,
            cache_len: int, block_k: int, k_splits: int, compute_dtype, precision, softmax_scale: float,
            q_dtype, out_limit: float | None, tail_loop: bool, with_new: bool, kv_limit: float | None,
            fused_rows: int | None, lean: bool):
    """``heads_per_program`` (P) consecutive kv heads of one sequence and one split. Refs (whole arrays, indexed
    here):

    layer [1] i32; lengths [B] i32; k_scale, v_scale [1] or one per layer [L] (read at the layer index) f32, 1
    for a BF16 cache; out_scale [1] f32, the output's quantization scale (read with ``out_limit`` only); each
    scale is an operand of its own, so that the decode step hands over the buffers it has (no per-layer op
    gathers them); q [B*K*G, H]; k, v [L*B*K, S, H]; out: with several splits acc [k_splits,
    B*K*G, H] f32, row_max and row_sum [k_splits, B*K*G] f32 (combined by XLA); with one split the normalised
    output [B*K*G, H], rounded to ``q_dtype`` and, with ``out_limit``, quantized to FP8 (no combine: the scales
    are applied here, so no scalar XLA op runs beside the kernel in the decode step).

    P = 1: one kv head, its G query rows padded with zero rows. P > 1: the P*G query rows of the P heads are
    one tile; head j's dot takes a copy of it with every row outside head j zeroed, so the P score tiles add up
    to one tile whose rows are all real (each row gets its own head's scores, exact zeros from the others), the
    online softmax runs once on it, and each head keeps its own accumulator (only its own rows of it are used).

    ``with_new``: two more inputs, this step's K and V [B*K, H] (q's dtype), and two more outputs after the others,
    the K and V caches (the inputs' buffers, aliased). Position ``length - 1`` is the new token's: the last split
    quantizes its K and V (``kv_limit``: FP8, ``recipe.quantize`` with k_scale / v_scale), stores them there and
    takes that position's score and value from registers; the blocks cover positions ``0 .. length - 2``. A
    position outside the cache is not written and the blocks cover the whole cache, as a dropped scatter leaves it.

    ``fused_rows`` (the fused form, ``rope``): q_ref is the projection [B*(N+2K), H] before RoPE, ``fused_rows`` =
    N+2K rows a sequence (its N query heads, K keys, K values); two more inputs, cos and sin [B, H/2] f32 at each
    sequence's new position. The program takes its query rows and its heads' new K and V from it and rotates the
    queries and keys as ``llama.apply_rope`` does (f32, rounded to ``q_dtype``): no XLA kernel splits or rotates them.
    """
    if fused_rows is not None:
        cos_ref, sin_ref, *out_refs, k_out_ref, v_out_ref = refs
    elif with_new:
        k_new_ref, v_new_ref, *out_refs, k_out_ref, v_out_ref = refs
    else:
        out_refs = refs
    row, split = pl.program_id(0), pl.program_id(1)
    n_heads = heads_per_program
    sequence = lax.div(row, kv_heads // n_heads)
    length = lengths_ref[sequence]
    if with_new:  # the new token at length - 1, when inside the cache; the cache holds the positions before it
        new_at = length - 1
        has_new = (new_at >= 0) & (new_at < cache_len)
        length = jnp.where(has_new, new_at, jnp.clip(length, 0, cache_len))
    else:
        length = jnp.clip(length, 0, cache_len)
    num_blocks = pl.cdiv(length, block_k)
    blocks_per_split = pl.cdiv(num_blocks, k_splits)
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, num_blocks)
    # each of this program's kv heads as a (sequence, kv head) row, and its row in the layer's cache
    kv_rows = [row * n_heads + j if n_heads > 1 else row for j in range(n_heads)]
    cache_rows = [layer_ref[0] * rows_per_layer + r for r in kv_rows]

    # the P*G query rows of these kv heads (consecutive in q), padded with zero rows up to the dot's minimum
    real_rows = n_heads * groups
    row_index = jnp.arange(rows_padded)
    head_ok = row_index < real_rows
    heads = pl.ds(row * real_rows, rows_padded)  # in the output [B*K*G, H] (and in q [B*K*G, H])
    if fused_rows is None:
        q = plgpu.load(q_ref.at[heads, :], mask=head_ok[:, None])
    else:  # in the projection: sequence b's rows start at b * (N+2K); its kv head k's queries at k*G of them
        first_head = (row - sequence * (kv_heads // n_heads)) * n_heads  # this program's first kv head
        q_rows = pl.ds(sequence * fused_rows + first_head * groups, rows_padded)
        cos, sin = cos_ref[sequence, :], sin_ref[sequence, :]
        q = plgpu.load(q_ref.at[q_rows, :], mask=head_ok[:, None])
        q = _dot_operand(_rotate_half(q.astype(jnp.float32), cos, sin).astype(q_dtype), compute_dtype)
    k_scale, v_scale = (ref[layer_ref[0]] if ref.shape[0] > 1 else ref[0] for ref in (k_scale_ref, v_scale_ref))
    # 1/sqrt(H) and the K dequantization 1/k_scale, on the scores
    # (``lean``: and log2(e), so that the softmax takes exp2 of the scores, one MUFU.EX2 each; the row maxes and sums
    # are then those of log2 units)
    score_scale = softmax_scale * (1.0 / k_scale) * (LOG2_E if lean else 1.0)
    exp = _softmax_exp(lean)
    if n_heads == 1:
        head_rows = [head_ok]
        qs = [jnp.where(head_ok[:, None], q, 0).astype(compute_dtype)]
    else:  # head j's rows are j*G .. j*G+G-1; its dot operand has zeros everywhere else
        head_rows = [(row_index >= j * groups) & (row_index < (j + 1) * groups) for j in range(n_heads)]
        qs = [jnp.where(rows_j[:, None], q, 0).astype(compute_dtype) for rows_j in head_rows]
    block_offsets = jnp.arange(block_k)

    def body(block, carry, masked: bool = True):
        """One block of ``block_k`` positions; ``masked=False`` for a block wholly inside the sequence (no masks)."""
        accs, row_max, row_sum = carry
        start = block * block_k
        in_seq = start + block_offsets < length  # [block_k]
        positions = pl.ds(start, block_k)
        load_mask = in_seq[:, None] if masked else None
        # [Gp, H] x [block_k, H]^T -> [Gp, block_k], summed over the heads (each row has one head's scores);
        # masked loads never touch positions past the length (nor past the cache end)
        s = None
        for q_j, cache_row_j in zip(qs, cache_rows, strict=True):
            k = plgpu.load(k_ref.at[cache_row_j, positions, :], mask=load_mask).astype(compute_dtype)
            s_j = plgpu.dot(q_j, k, trans_b=True, precision=precision)
            s = s_j if s is None else s + s_j
        s = s * score_scale
        if masked:  # masked columns may hold anything: replaced by -inf
            s = jnp.where(in_seq[None, :], s, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=1))  # finite: a visited block has a position
        correction = exp(row_max - new_max)
        p = exp(s - new_max[:, None])
        row_sum = correction * row_sum + jnp.sum(p, axis=1)
        new_accs = []
        for acc, cache_row_j in zip(accs, cache_rows, strict=True):
            if lean:
                # masked rows loaded as zeros (0 * NaN would leak): no select on the converted tile. The * 1 (a
                # runtime one, folded away by LLVM) keeps Triton converting an FP8 V in its blocked layout before the
                # F16 shared-memory round trip (ldmatrix.trans); without it V is read as the dot's operand byte by
                # byte
                v = plgpu.load(v_ref.at[cache_row_j, positions, :], mask=load_mask,
                               other=jnp.zeros((), v_ref.dtype) if masked else None).astype(compute_dtype)
                if jnp.dtype(v_ref.dtype).itemsize == 1:
                    v = v * (length >= 0).astype(compute_dtype)  # (a where on the scalar fails to lower for f32)
            else:
                v = plgpu.load(v_ref.at[cache_row_j, positions, :], mask=load_mask).astype(compute_dtype)
                if masked:
                    v = jnp.where(in_seq[:, None], v, 0)  # 0 * NaN would leak: masked rows of V must be zeros
            # [Gp, block_k] x [block_k, H] -> [Gp, H]
            new_accs.append(correction[:, None] * acc + plgpu.dot(p.astype(compute_dtype), v, precision=precision))
        return tuple(new_accs), new_max, row_sum

    h = q_ref.shape[-1]
    init = (tuple(jnp.zeros((rows_padded, h), jnp.float32) for _ in range(n_heads)),
            jnp.full((rows_padded,), -jnp.inf, jnp.float32), jnp.zeros((rows_padded,), jnp.float32))
    if tail_loop:  # the split's whole blocks without masks, then the sequence's partial last block (if here) with
        full_end = jnp.clip(length // block_k, first, last)
        carry = lax.fori_loop(first, full_end, functools.partial(body, masked=False), init)
        accs, row_max, row_sum = lax.fori_loop(full_end, last, body, carry)
    else:
        accs, row_max, row_sum = lax.fori_loop(first, last, body, init)
    if with_new:
        if fused_rows is None:  # this step's K and V [B*K, H], one row per (sequence, kv head)
            news = [(k_new_ref[r, :], v_new_ref[r, :]) for r in kv_rows]
        else:  # from the projection: keys after the N query rows, values after the K key rows; keys rotated
            keys = sequence * fused_rows + (fused_rows - 2 * kv_heads) + first_head
            news = [(_rotate_half(q_ref[keys + j, :].astype(jnp.float32), cos, sin).astype(q_dtype),
                     q_ref[keys + kv_heads + j, :]) for j in range(n_heads)]
        owner = has_new & (split == k_splits - 1) if k_splits > 1 else has_new
        accs, row_max, row_sum = _new_position(
            (accs, row_max, row_sum), owner, jnp.where(has_new, new_at, 0), qs, news, cache_rows,
            (k_out_ref, v_out_ref), (k_scale, v_scale), score_scale, compute_dtype, kv_limit, exp)
    # each head's rows from its own accumulator
    acc = accs[0]
    for rows_j, acc_j in zip(head_rows[1:], accs[1:], strict=True):
        acc = jnp.where(rows_j[:, None], acc_j, acc)
    if k_splits == 1:  # normalised here; a length-0 sequence (row sum 0, accumulator 0) gets zeros
        (out_ref,) = out_refs
        norm = (1.0 / v_scale) / jnp.where(row_sum > 0, row_sum, 1.0)  # 1/v_scale dequantizes V
        out = (acc * norm[:, None]).astype(q_dtype)
        if out_limit is not None:  # recipe.quantize of that value: the next FP8 GEMM's operand
            out = jnp.clip(out.astype(jnp.float32) * out_scale_ref[0], -out_limit, out_limit)
        plgpu.store(out_ref.at[heads, :], out.astype(out_ref.dtype), mask=head_ok[:, None])
        return
    acc_ref, row_max_ref, row_sum_ref = out_refs
    plgpu.store(acc_ref.at[split, heads, :], acc, mask=head_ok[:, None])
    plgpu.store(row_max_ref.at[split, heads], row_max, mask=head_ok)
    plgpu.store(row_sum_ref.at[split, heads], row_sum, mask=head_ok)


def _softmax_exp(lean: bool):
    """The online softmax's exponential: exp2 of log2-unit scores in the lean loop, exp otherwise; the kernel, its new
    position and the split combine take the same one."""
    return jnp.exp2 if lean else jnp.exp


def _rotate_half(x, cos, sin):
    """``llama.apply_rope``'s arithmetic on [..., H] f32 values: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
    cos and sin broadcasting against [..., H/2]. Written with the equal split, the two-way stack and the transpose
    Pallas' Triton lowering has (no concatenation); ``split_qkv`` uses it too."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    # [..., H/2, 2] -> [..., 2, H/2] -> [..., H]
    pair = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.swapaxes(pair, -1, -2).reshape(x.shape)


def _dot_operand(q, compute_dtype):
    """The query as the dots take it: F16 operands for a BF16 query clip it to F16's range first."""
    if compute_dtype == jnp.float16 and q.dtype != jnp.float16:
        f16_max = float(jnp.finfo(jnp.float16).max)
        return jnp.clip(q.astype(jnp.float32), -f16_max, f16_max).astype(jnp.float16)
    return q.astype(compute_dtype)


def _new_position(carry, owner, at, qs, news, cache_rows, out_refs, scales, score_scale, compute_dtype, kv_limit,
                  exp):
    """``_kernel``'s new token (``with_new``), done by the ``owner`` program (the last split, where the position is
    inside the cache): each head's K and V (``news``, [H] each in the query's dtype) as stored (quantized for an FP8
    cache) written at position ``at``, and that position's column joined to the online softmax. The dots' operand
    rounding is kept: the stored K and V in ``compute_dtype``, the probability rounded to it before it weights V; the
    products are summed in f32 (in another order than the dots', the only difference)."""
    accs, row_max, row_sum = carry
    write = jnp.broadcast_to(owner, news[0][0].shape)
    score = None
    values = []
    for q_j, new, cache_row in zip(qs, news, cache_rows, strict=True):
        stored = []
        for x, out_ref, scale in zip(new, out_refs, scales, strict=True):
            if kv_limit is not None:  # recipe.quantize: the f32 product, clipped, rounded once
                x = jnp.clip(x.astype(jnp.float32) * scale, -kv_limit, kv_limit)
            x = x.astype(out_ref.dtype)
            plgpu.store(out_ref.at[cache_row, at, :], x, mask=write)
            stored.append(x.astype(compute_dtype).astype(jnp.float32))
        k, v = stored
        # [Gp, H] . [H] -> [Gp]: this head's rows' scores (exact zeros on the other rows: their q_j rows are zeros)
        s_j = jnp.sum(q_j.astype(jnp.float32) * k[None, :], axis=1)
        score = s_j if score is None else score + s_j
        values.append(v)
    score = score * score_scale
    new_max = jnp.maximum(row_max, score)
    correction = exp(row_max - new_max)  # row_max may be -inf (no block): 0
    p = exp(score - new_max)
    weight = p.astype(compute_dtype).astype(jnp.float32)  # as the P.V dot's operand
    new_accs = [correction[:, None] * acc + weight[:, None] * v[None, :] for acc, v in zip(accs, values, strict=True)]
    # not the owner (another split, or no new position): unchanged (the values above may be NaN there)
    keep = lambda new, old: jnp.where(owner, new, old)  # noqa: E731
    return (tuple(keep(n, o) for n, o in zip(new_accs, accs, strict=True)), keep(new_max, row_max),
            keep(correction * row_sum + p, row_sum))


def _widen_byte_array_offsets() -> bool:
    """Make Pallas' Triton lowering use 64-bit offsets for 1-byte arrays of more than 2**31 elements.

    The lowering picks 64-bit offsets only for arrays over 4 GiB; a 1-byte array of 2 to 4 GiB has element
    offsets past 2**31 that wrap in 32 bits. Presenting such an array as a 2-byte one to the width decision
    (offsets are computed from its shape, in elements, so nothing else changes) gives exactly the right rule:
    64-bit once the element count passes 2**31. Returns False where the private function is not there.
    """
    try:
        from jax._src.pallas.triton import lowering as triton_lowering
    except ImportError:
        return False
    original = getattr(triton_lowering, "_compute_offsets_from_indices", None)
    if original is None or not dataclasses.is_dataclass(getattr(triton_lowering, "BlockInfo", None)):
        return False
    if getattr(original, "widened_for_byte_arrays", False):
        return True

    @functools.wraps(original)
    def compute_offsets(block_info, nd_indexer):
        aval = block_info.full_shape_dtype
        if jnp.dtype(aval.dtype).itemsize == 1 and math.prod(aval.shape) > 2**31:
            wide = type(aval)(aval.shape, jnp.dtype(jnp.int16))
            block_info = dataclasses.replace(block_info, full_shape_dtype=wide)
        return original(block_info, nd_indexer)

    compute_offsets.widened_for_byte_arrays = True
    triton_lowering._compute_offsets_from_indices = compute_offsets
    return True


def decode_attention_pallas(q, k_cache, v_cache, lengths, *, layer=None, k_scale=None, v_scale=None,
                            out_scale=None, out_dtype=None, new_kv=None, rope=None, block_k: int | None = None,
                            k_splits: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                            dot_dtype=None, heads_per_program: int | None = None, tail_loop: bool = False,
                            lean: bool | None = None, interpret: bool = False) -> jax.Array:
    """The Pallas kernel (see the module note); ``interpret=True`` runs it on any backend through Pallas'
    interpreter (tests). ``block_k`` / ``k_splits`` default from the shapes (``default_block_k`` /
    ``default_k_splits``). ``dot_dtype``: the dots' operand dtype (default ``default_dot_dtype``); ``float16``
    with an FP8 cache (every E4M3 value is exact in f16, and the conversion is one instruction per two values on
    Hopper) takes the query rounded to f16 (clipped to its range) and the probabilities in f16.
    ``heads_per_program``: P consecutive kv heads of a sequence per program (must divide K), their P*G query
    rows sharing one score tile and one online softmax (the module note); default ``HEADS_PER_PROGRAM`` or else
    ``default_heads_per_program``.
    ``tail_loop``: walk a split's whole blocks without masks and the sequence's partial last block in a loop of its
    own (False, the default: one loop, every block masked). Measured on the H100 (``benchmarks/decode_attention.py
    --ab_tail_loop``; benchmarks/RESULTS.md, "Decode attention kernel"): alone, it made an FP8 cache at batch 256
    (1 split) faster, 100.6 / 153.6 us a layer-step against 113.1 / 164.4 (half / whole 1,088-position cache), and
    batch 64 (4 splits) slower, 52.3 / 67.2 against 49.1 / 62.9 us; but the batch-256 rollout with it on for one
    split made 89.5k tokens/s against 91.7k without.
    ``rope`` (cos, sin): q is the fused projection (``decode_attention_qkv``), see there.
    ``lean`` (default ``LEAN_LOOP``): the block loop's lean form
    (the module note's "The loop")."""
    cache_shape = k_cache.shape
    (k_cache, _), (v_cache, layer) = _stacked(k_cache, layer), _stacked(v_cache, layer)
    fused = q  # the projection [B, N+2K, H] with ``rope``
    if rope is not None:
        q = _fused_query(fused, k_cache.shape[2], new_kv, rope)
    _check(q, k_cache, v_cache, lengths, k_scale, v_scale)
    _check_new(q, new_kv)
    out_dtype, quantized = _out_format(out_scale, out_dtype, q.dtype)
    reason = pallas_unsupported(q.shape[-1])
    if reason:
        raise ValueError(f"decode attention kernel: {reason}; use decode_attention='xla'")
    b, kh, g, h = q.shape
    n_layers, s = k_cache.shape[0], k_cache.shape[3]
    rows = b * kh
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    n_heads = heads_per_program_for(heads_per_program, rows, kh, g, itemsize)
    if not isinstance(n_heads, int) or n_heads < 1 or kh % n_heads:
        raise ValueError(f"heads_per_program={n_heads!r} must be a positive integer dividing the kv heads K={kh}")
    programs = rows // n_heads
    block_k = block_k or default_block_k(h, itemsize, s, n_heads)
    k_splits = k_splits or default_k_splits(programs, s, block_k)
    num_stages = num_stages or NUM_STAGES
    lean = LEAN_LOOP if lean is None else lean
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two >= 16")
    if itemsize == 1 and k_cache.size > 2**31 and not interpret and not _widen_byte_array_offsets():
        warnings.warn("decode attention: Pallas offsets are 32-bit for this FP8 cache; slicing the layer (a copy)",
                      stacklevel=2)
        if (new_kv is not None or rope is not None) and n_layers > 1:  # the layer written alone, then put back
            return _in_layer(functools.partial(
                decode_attention_pallas, fused if rope is not None else q, lengths=lengths,
                k_scale=_layer_scale(k_scale, layer), v_scale=_layer_scale(v_scale, layer), out_scale=out_scale,
                out_dtype=out_dtype, new_kv=new_kv, rope=rope, block_k=block_k, k_splits=k_splits, num_warps=num_warps,
                num_stages=num_stages, dot_dtype=dot_dtype, heads_per_program=n_heads, tail_loop=tail_loop,
                lean=lean),
            k_cache, v_cache, layer, cache_shape)
        k_scale, v_scale = _layer_scale(k_scale, layer), _layer_scale(v_scale, layer)
        k_cache, v_cache, layer = k_cache[layer][None], v_cache[layer][None], jnp.int32(0)
        n_layers = 1
    compute_dtype = jnp.dtype(dot_dtype or default_dot_dtype(q.dtype, k_cache.dtype))
    with_new = new_kv is not None or rope is not None
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    # the scales themselves, not their inverses (computed in the kernel), each as it is ([1] or [L]: a free
    # reshape): no scalar XLA kernel per layer and step
    scales = [jnp.asarray(1.0 if a is None else a, jnp.float32).reshape(-1) for a in (k_scale, v_scale, out_scale)]

    kernel = functools.partial(
        _kernel, kv_heads=kh, groups=g, heads_per_program=n_heads,
        rows_padded=_pow2_ceil(max(n_heads * g, MIN_DOT_ROWS)), rows_per_layer=rows,
        cache_len=s, block_k=block_k, k_splits=k_splits, compute_dtype=compute_dtype, precision=precision,
        softmax_scale=1.0 / math.sqrt(h), q_dtype=jnp.dtype(q.dtype),
        out_limit=fp8_max(out_dtype) if quantized else None, tail_loop=tail_loop, with_new=with_new,
        kv_limit=fp8_max(k_cache.dtype) if itemsize == 1 else None,
        fused_rows=fused.shape[1] if rope is not None else None, lean=lean,
    )
    if k_splits == 1:  # the output itself
        out_shape = (jax.ShapeDtypeStruct((rows * g, h), out_dtype),)
    else:  # each split's partial results, combined below
        out_shape = (
            jax.ShapeDtypeStruct((k_splits, rows * g, h), jnp.float32),  # acc
            jax.ShapeDtypeStruct((k_splits, rows * g), jnp.float32),  # row_max
            jax.ShapeDtypeStruct((k_splits, rows * g), jnp.float32),  # row_sum
        )
    # [L, B, K, S, H] -> [L*B*K, S, H]: contiguous, a free reshape
    caches = [k_cache.reshape(n_layers * rows, s, h), v_cache.reshape(n_layers * rows, s, h)]
    if rope is None:  # [B, K, G, H] -> [B*K*G, H], the dots' operand
        operands = [_dot_operand(q, compute_dtype).reshape(rows * g, h), *caches]
    else:  # [B, N+2K, H] -> [B*(N+2K), H] as it is (rotated and converted in the kernel)
        operands = [fused.reshape(-1, h), *caches]
    operands = [jnp.reshape(layer, (1,)), lengths.astype(jnp.int32), *scales, *operands]
    aliases = {}
    if with_new:  # the caches come back written, in their own buffers
        cache_at = len(operands) - 2
        if rope is None:  # [B, K, H] -> [B*K, H] each
            operands += [a.reshape(rows, h) for a in new_kv]
        else:  # cos, sin [B, H/2]
            operands += [jnp.asarray(a, jnp.float32) for a in rope]
        aliases = {cache_at + i: len(out_shape) + i for i in range(2)}
        out_shape = (*out_shape, *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches))
    outs = pl.pallas_call(
        kernel,
        grid=(programs, k_splits),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention",
    )(*operands)
    if with_new:
        outs, written = outs[:-2], tuple(c.reshape(cache_shape) for c in outs[-2:])
    if k_splits == 1:
        # [B*K*G, H] -> [B, K, G, H]
        out = outs[0].reshape(b, kh, g, h)
        return out if not with_new else (out, *written)
    acc, row_max, row_sum = outs
    # combine the splits, each weighted by exp(its row max - the overall max); an empty split's max is -inf
    overall_max = jnp.max(row_max, axis=0)
    overall_max = jnp.where(jnp.isfinite(overall_max), overall_max, 0.0)
    weight = _softmax_exp(lean)(row_max - overall_max)  # [k_splits, B*K*G] (lean: log2 units)
    total = jnp.sum(weight * row_sum, axis=0)
    acc = jnp.sum(weight[..., None] * acc, axis=0)  # [B*K*G, H]
    # a length-0 sequence (total 0) gets zeros; 1/v_scale is the V dequantization
    out = acc * (_inverse_scale(_layer_scale(v_scale, layer)) / jnp.where(total > 0, total, 1.0))[:, None]
    # [B*K*G, H] -> [B, K, G, H]
    out = _output(out.reshape(b, kh, g, h), q.dtype, out_dtype, out_scale)
    return out if not with_new else (out, *written)


def _fused_query(qkv, kv_heads: int, new_kv, rope) -> jax.ShapeDtypeStruct:
    """The query [B, K, G, H] a fused projection [B, N+2K, H] holds (its shape, for the checks), ``rope`` checked."""
    if new_kv is not None:
        raise ValueError("rope takes the new K/V from the fused projection: no new_kv with it")
    if qkv.ndim != 3 or (qkv.shape[1] - 2 * kv_heads) <= 0 or (qkv.shape[1] - 2 * kv_heads) % kv_heads:
        raise ValueError(f"qkv must be the fused projection [B, N + 2K, H] with N a multiple of K={kv_heads}, "
                         f"got shape {qkv.shape}")
    b, _, h = qkv.shape
    if len(rope) != 2 or any(jnp.shape(a) != (b, h // 2) for a in rope):
        raise ValueError(f"rope must be (cos, sin), each [B, H/2] = {(b, h // 2)}, got "
                         f"{[jnp.shape(a) for a in rope]}")
    n = qkv.shape[1] - 2 * kv_heads
    return jax.ShapeDtypeStruct((b, kv_heads, n // kv_heads, h), qkv.dtype)


def split_qkv(qkv, kv_heads: int, rope):
    """The fused projection [B, N+2K, H] as (q [B, K, G, H], (k, v) [B, K, H]), q and k rotated as ``rope``
    (cos, sin) [B, H/2] says (``llama.apply_rope``'s arithmetic): what the kernel makes of it, in XLA ops."""
    q_view = _fused_query(qkv, kv_heads, None, rope)
    b, _, g, h = q_view.shape
    n = kv_heads * g
    # [B, H/2] -> [B, 1, H/2]: the same angles for every head of a sequence
    cos, sin = (jnp.asarray(a, jnp.float32)[:, None, :] for a in rope)
    rotate = lambda x: _rotate_half(x.astype(jnp.float32), cos, sin).astype(x.dtype)  # noqa: E731
    q, k, v = qkv[:, :n], qkv[:, n:n + kv_heads], qkv[:, n + kv_heads:]
    return rotate(q).reshape(b, kv_heads, g, h), (rotate(k), v)


def _in_layer(attend, k_cache, v_cache, layer, cache_shape):
    """``attend(k_layer, v_layer)`` -> (out, k_layer, v_layer) on layer ``layer`` of [L, B, K, S, H] caches sliced out
    (copies), the written layers put back: (out, k_cache, v_cache) in ``cache_shape``."""
    out, k_layer, v_layer = attend(k_cache[layer], v_cache[layer])
    put = lambda cache, new: lax.dynamic_update_index_in_dim(cache, new, layer, 0).reshape(cache_shape)  # noqa: E731
    return out, put(k_cache, k_layer), put(v_cache, v_layer)


# ----------------------------------------------------------------------------------------------------------
# dispatch


def _chosen_impl(impl: str, head_dim: int) -> str:
    """``resolve_impl``, with ``auto`` falling back to ``xla`` where the kernel cannot take the head dim, and a clear
    error for ``pallas`` off a GPU."""
    requested, impl = impl, resolve_impl(impl)
    if requested == "auto" and impl == "pallas" and pallas_unsupported(head_dim):
        impl = "xla"
    if impl == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"decode_attention='pallas' needs a GPU backend (this one is {jax.default_backend()!r}); "
                         "use 'pallas_interpret' or 'xla'")
    return impl


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *, layer=None,
                     k_scale=None, v_scale=None, out_scale=None, out_dtype=None, new_kv=None, impl: str = "auto",
                     **tuning):
    """Attention of one query token per sequence over cache positions ``0 .. lengths[b] - 1``.

    q [B, K, G, H] (bf16 or f32); k_cache, v_cache [B, K, S, H], or [L, B, K, S, H] with ``layer`` (an int or
    a traced scalar), in bf16 / f32, or float8_e4m3fn with that layer's scalar ``k_scale`` / ``v_scale``, or
    with a stacked cache the scales of every layer [L] (read at ``layer``: the decode step then makes no
    per-layer array of them) (stored value = value * scale); lengths [B] int (clipped to [0, S]; a length-0 row
    returns zeros from the kernel). Returns [B, K, G, H] in q's dtype, or with an FP8 ``out_dtype`` and its
    ``out_scale`` that value quantized for the next FP8 GEMM (``recipe.quantize``, bit for bit what that linear
    would make of the BF16 output; the kernel writes it, so no XLA kernel quantizes it in the decode step).

    ``new_kv``: this step's (K, V) [B, K, H] (q's dtype), the token at position ``lengths[b] - 1``: written into the
    caches (quantized with ``k_scale`` / ``v_scale`` for an FP8 cache; not written where that position is outside
    the cache) before it is attended to, and ``(out, k_cache, v_cache)`` returned. The kernel stores them itself,
    into the cache buffers it was given (aliased: in place where the caller's buffers can be reused), and takes
    that position from registers, so that no XLA scatter per layer and step writes them (two kernels a layer).

    impl: ``pallas`` (the Triton kernel, GPU), ``pallas_interpret`` (the same kernel through Pallas'
    interpreter: any backend, slow, for tests), ``xla`` (the masked einsum), ``auto`` (pallas on a GPU backend
    when the shapes allow it, else xla). ``tuning``: ``block_k``, ``k_splits``, ``num_warps``, ``num_stages``,
    ``dot_dtype``, ``heads_per_program`` for the kernel.
    """
    impl = _chosen_impl(impl, q.shape[-1])
    scales = {"k_scale": k_scale, "v_scale": v_scale, "out_scale": out_scale}
    if impl == "xla":
        return decode_attention_xla(q, k_cache, v_cache, lengths, layer=layer, out_dtype=out_dtype, new_kv=new_kv,
                                    **scales)
    kernel = functools.partial(decode_attention_pallas, interpret=impl == "pallas_interpret", out_dtype=out_dtype,
                               **tuning)
    from fp8rl_jax.parallel import rules

    mesh = rules.active_mesh()
    if mesh is None:
        return kernel(q, k_cache, v_cache, lengths, layer=layer, new_kv=new_kv, **scales)
    return _shard_mapped(kernel, mesh, q, k_cache, v_cache, lengths, layer, scales, new_kv)


def decode_attention_qkv(qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, rope, *,
                         layer=None, k_scale=None, v_scale=None, out_scale=None, out_dtype=None, impl: str = "auto",
                         **tuning):
    """``decode_attention`` of a decode step from its fused projection, before RoPE.

    qkv [B, N+2K, H]: each sequence's N query heads, then its K keys, then its K values (the fused q|k|v GEMM's
    output, a free reshape); rope = (cos, sin) [B, H/2] f32 at each sequence's new position ``lengths - 1``. The
    queries and keys are rotated as ``llama.apply_rope`` rotates them (f32, rounded to qkv's dtype), the new K/V
    written into the caches and attended to, as ``decode_attention`` with ``new_kv`` does; returns (out [B, K, G,
    H], k_cache, v_cache). The kernel does all of it: it reads its query rows and its new K/V from ``qkv`` itself, so
    no XLA kernel slices, rotates or converts them (three kernels a layer and step). ``split_qkv`` is the same in
    XLA ops; the ``xla`` impl uses it.
    """
    from fp8rl_jax.parallel import rules

    impl = _chosen_impl(impl, qkv.shape[-1])
    kv_heads = k_cache.shape[-3]
    mesh = rules.active_mesh() if impl != "xla" else None
    split_heads = mesh is not None and rules.cache_local_specs(mesh, k_cache.shape)[1][1] is not None
    scales = {"k_scale": k_scale, "v_scale": v_scale, "out_scale": out_scale}
    if impl == "xla" or split_heads:  # kv heads split over devices: the projection's heads do not split alike
        q, new_kv = split_qkv(qkv, kv_heads, rope)
        return decode_attention(q, k_cache, v_cache, lengths, layer=layer, out_dtype=out_dtype, new_kv=new_kv,
                                impl=impl, **scales, **tuning)
    kernel = functools.partial(decode_attention_pallas, interpret=impl == "pallas_interpret", out_dtype=out_dtype,
                               **tuning)
    if mesh is None:
        return kernel(qkv, k_cache, v_cache, lengths, layer=layer, rope=rope, **scales)
    return _shard_mapped(kernel, mesh, qkv, k_cache, v_cache, lengths, layer, scales, None, rope)


def _shard_mapped(kernel, mesh, q, k_cache, v_cache, lengths, layer, scales: dict, new_kv, rope=None):
    """``kernel`` under ``jax.shard_map`` over the batch and kv heads of the active ``mesh``, split as the sharding
    rules split the KV cache (what does not divide stays whole); layer index and scales replicated."""
    from fp8rl_jax.parallel import rules

    # q [B, K, G, H], the output and the new K/V [B, K, H] split as the cache's B and K
    cache_spec, head_spec, rows_spec = rules.cache_local_specs(mesh, k_cache.shape)
    given = {name: jnp.asarray(a) for name, a in {"layer": layer, **scales}.items() if a is not None}

    if rope is not None:  # the projection [B, N+2K, H] and cos, sin [B, H/2] by sequence (heads whole here)
        given["rope"] = rope
        q_spec, rope_spec = rows_spec, (rows_spec, rows_spec)
    else:
        q_spec, rope_spec = head_spec, None

    def local(q, k_cache, v_cache, lengths, given, new_kv):
        return kernel(q, k_cache, v_cache, lengths, new_kv=new_kv, **given)

    given_specs = {name: (rope_spec if name == "rope" else P()) for name in given}
    new_specs = P() if new_kv is None else (head_spec, head_spec)
    written = new_kv is not None or rope is not None
    out_specs = (head_spec, cache_spec, cache_spec) if written else head_spec
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, cache_spec, cache_spec, rows_spec, given_specs,
                                                       new_specs), out_specs=out_specs, check_vma=False)
    return mapped(q, k_cache, v_cache, lengths, given, new_kv)
