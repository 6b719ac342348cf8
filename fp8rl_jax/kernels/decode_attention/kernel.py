"""The decode attention kernel (Pallas, Triton backend): see the package note, and ``docs/decode_attention.md`` for
the design and its measurements."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.kernels.block_quantize import TILE, tile_scales
from fp8rl_jax.kernels.decode_attention.tuning import (
    DEFAULT_TUNING,
    MIN_DOT_ROWS,
    DecodeTuning,
    _pow2_ceil,
    default_dot_dtype,
    pallas_unsupported,
)
from fp8rl_jax.kernels.decode_attention.xla import (
    _check,
    _check_new,
    _check_tiles,
    _fused_query,
    _inverse_scale,
    _layer_scale,
    _out_format,
    _output,
    _rotate_half,
    _stacked,
    tiles,
)
from fp8rl_jax.numerics import fp8_max, quantize

LOG2_E = math.log2(math.e)


def _kernel(layer_ref, lengths_ref, k_scale_ref, v_scale_ref, out_scale_ref, q_ref, k_ref, v_ref, *refs,
            kv_heads: int, groups: int, heads_per_program: int, rows_padded: int, rows_per_layer: int,
            cache_len: int, block_k: int, k_splits: int, compute_dtype, precision, softmax_scale: float,
            q_dtype, out_limit: float | None, tail_loop: bool, with_new: bool, kv_limit: float | None,
            fused_rows: int | None, tiles_dtype=None):
    """``heads_per_program`` (P) consecutive kv heads of one sequence and one split. Refs (whole arrays, indexed
    here):

    layer [1] i32; lengths [B] i32; k_scale, v_scale [1] or one per layer [L] (read at the layer index) f32, 1
    for a BF16 cache; out_scale [1] f32, the output's quantization scale (read with ``out_limit`` only); each
    scale is an operand of its own, so that the decode step hands over the buffers it has (no per-layer op
    gathers them); q [B*K*G, H]; k, v [L*B*K, S, H]; out: with several splits acc [k_splits,
    B*K*G, H] f32, row_max and row_sum [k_splits, B*K*G] f32 (combined by XLA); with one split the normalised
    output [B*K*G, H], rounded to ``q_dtype`` and, with ``out_limit``, quantized to FP8 (no combine: the scales
    are applied here, so no scalar XLA op runs beside the kernel in the decode step); with ``tiles_dtype`` (one split)
    the output in 1 x 128 tiles of the sequence's [N H] row (``_head_tiles``: this program's heads hold whole tiles)
    and one more output after it, their inverse scales [N H / 128, B].

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
    queries and keys as ``model.rope.apply_rope`` does (f32, rounded to ``q_dtype``): no XLA kernel splits or rotates
    them.
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
    # 1/sqrt(H), the K dequantization 1/k_scale and log2(e), on the scores: the softmax takes exp2 of the scores (one
    # MUFU.EX2 each); the row maxes and sums are those of log2 units
    score_scale = softmax_scale * (1.0 / k_scale) * LOG2_E
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
        correction = jnp.exp2(row_max - new_max)
        p = jnp.exp2(s - new_max[:, None])
        row_sum = correction * row_sum + jnp.sum(p, axis=1)
        new_accs = []
        for acc, cache_row_j in zip(accs, cache_rows, strict=True):
            # masked rows loaded as zeros (0 * NaN would leak): no select on the converted tile. The * 1 (a runtime
            # one, folded away by LLVM) keeps Triton converting an FP8 V in its blocked layout before the F16
            # shared-memory round trip (ldmatrix.trans); without it V is read as the dot's operand byte by byte
            v = plgpu.load(v_ref.at[cache_row_j, positions, :], mask=load_mask,
                           other=jnp.zeros((), v_ref.dtype) if masked else None).astype(compute_dtype)
            if jnp.dtype(v_ref.dtype).itemsize == 1:
                v = v * (length >= 0).astype(compute_dtype)  # (a where on the scalar fails to lower for f32)
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
            (k_out_ref, v_out_ref), (k_scale, v_scale), score_scale, compute_dtype, kv_limit)
    # each head's rows from its own accumulator
    acc = accs[0]
    for rows_j, acc_j in zip(head_rows[1:], accs[1:], strict=True):
        acc = jnp.where(rows_j[:, None], acc_j, acc)
    if k_splits == 1:  # normalised here; a length-0 sequence (row sum 0, accumulator 0) gets zeros
        out_ref = out_refs[0]
        norm = (1.0 / v_scale) / jnp.where(row_sum > 0, row_sum, 1.0)  # 1/v_scale dequantizes V
        out = (acc * norm[:, None]).astype(q_dtype)
        if out_limit is not None:  # recipe.quantize of that value: the next FP8 GEMM's operand
            out = jnp.clip(out.astype(jnp.float32) * out_scale_ref[0], -out_limit, out_limit)
        elif tiles_dtype is not None:  # its 1 x 128 tiles: the next block-scaled GEMM's operand
            per_tile = TILE // h
            out, inv = _head_tiles(out.astype(jnp.float32), row_index, real_rows, per_tile, tiles_dtype)
            first_tile = (row - sequence * (kv_heads // n_heads)) * (real_rows // per_tile)
            held = jnp.arange(inv.shape[0]) < real_rows // per_tile
            plgpu.store(out_refs[1].at[pl.ds(first_tile, inv.shape[0]), sequence], inv, mask=held)
        plgpu.store(out_ref.at[heads, :], out.astype(out_ref.dtype), mask=head_ok[:, None])
        return
    acc_ref, row_max_ref, row_sum_ref = out_refs
    plgpu.store(acc_ref.at[split, heads, :], acc, mask=head_ok[:, None])
    plgpu.store(row_max_ref.at[split, heads], row_max, mask=head_ok)
    plgpu.store(row_sum_ref.at[split, heads], row_sum, mask=head_ok)


def _head_tiles(out, row_index, real_rows: int, per_tile: int, dtype):
    """A program's output [R, H] f32 (a row a query head, each ``per_tile`` consecutive heads one 1 x 128 tile of the
    sequence's [N H] row, the first ``real_rows`` rows real) in its tiles: ``xla.tiles``' arithmetic, (FP8 [R, H],
    inverse scales [T] for its real_rows / per_tile tiles, padded to a power of 2). Each tile's amax is a masked max
    over the rows (Triton has no reshape that groups them)."""
    row_amax = jnp.max(jnp.abs(out), axis=1)  # [R]
    tile_of_row = row_index // per_tile
    n_tiles = real_rows // per_tile
    slots = jnp.arange(_pow2_ceil(n_tiles))
    amax_rows, amax_tiles = jnp.zeros_like(row_amax), jnp.zeros(slots.shape, jnp.float32)
    for j in range(n_tiles):
        amax = jnp.max(jnp.where(tile_of_row == j, row_amax, 0.0))
        amax_rows = jnp.where(tile_of_row == j, amax, amax_rows)
        amax_tiles = jnp.where(slots == j, amax, amax_tiles)
    limit = fp8_max(dtype)
    scale, _ = tile_scales(amax_rows, limit)
    return quantize(out, scale[:, None], dtype), tile_scales(amax_tiles, limit)[1]


def _dot_operand(q, compute_dtype):
    """The query as the dots take it: F16 operands for a BF16 query clip it to F16's range first."""
    if compute_dtype == jnp.float16 and q.dtype != jnp.float16:
        f16_max = float(jnp.finfo(jnp.float16).max)
        return jnp.clip(q.astype(jnp.float32), -f16_max, f16_max).astype(jnp.float16)
    return q.astype(compute_dtype)


def _new_position(carry, owner, at, qs, news, cache_rows, out_refs, scales, score_scale, compute_dtype, kv_limit):
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
    correction = jnp.exp2(row_max - new_max)  # row_max may be -inf (no block): 0
    p = jnp.exp2(score - new_max)
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
                            out_scale=None, out_dtype=None, new_kv=None, rope=None,
                            tuning: DecodeTuning = DEFAULT_TUNING, interpret: bool = False, out_tiles=None):
    """The Pallas kernel (see the package note); ``interpret=True`` runs it on any backend through Pallas'
    interpreter (tests). ``tuning``: its launch (``DecodeTuning``; what it leaves open comes from the shapes,
    ``DecodeTuning.resolved``). A ``float16`` ``dot_dtype`` (the default over an FP8 cache with a BF16 query: every
    E4M3 value is exact in f16, and the conversion is one instruction per two values on Hopper) takes the query
    rounded to f16 (clipped to its range) and the probabilities in f16. P = ``heads_per_program`` consecutive kv
    heads of a sequence per program share one score tile and one online softmax over their P*G query rows.
    ``rope`` (cos, sin): q is the fused projection (``decode_attention_qkv``), see there. ``out_tiles``: see
    ``decode_attention``; the kernel makes the tiles where it runs one split and its P*G heads of H span whole tiles
    (``tiles_in_kernel``), else XLA after it."""
    if not isinstance(tuning, DecodeTuning):
        raise TypeError(f"tuning must be a DecodeTuning, got {type(tuning).__name__}")
    cache_shape = k_cache.shape
    (k_cache, _), (v_cache, layer) = _stacked(k_cache, layer), _stacked(v_cache, layer)
    fused = q  # the projection [B, N+2K, H] with ``rope``
    if rope is not None:
        q = _fused_query(fused, k_cache.shape[2], new_kv, rope)
    _check(q, k_cache, v_cache, lengths, k_scale, v_scale)
    _check_new(q, new_kv)
    _check_tiles(q, out_tiles, out_dtype, out_scale)
    out_dtype, quantized = _out_format(out_scale, out_dtype, q.dtype)
    reason = pallas_unsupported(q.shape[-1])
    if reason:
        raise ValueError(f"decode attention kernel: {reason}; use decode_attention='xla'")
    b, kh, g, h = q.shape
    n_layers, s = k_cache.shape[0], k_cache.shape[3]
    rows = b * kh
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    tuning = tuning.resolved(rows, kh, g, h, itemsize, s)
    n_heads, block_k, k_splits = tuning.heads_per_program, tuning.block_k, tuning.k_splits
    programs = rows // n_heads
    if itemsize == 1 and k_cache.size > 2**31 and not interpret and not _widen_byte_array_offsets():
        warnings.warn("decode attention: Pallas offsets are 32-bit for this FP8 cache; slicing the layer (a copy)",
                      stacklevel=2)
        if (new_kv is not None or rope is not None) and n_layers > 1:  # the layer written alone, then put back
            return _in_layer(functools.partial(
                decode_attention_pallas, fused if rope is not None else q, lengths=lengths,
                k_scale=_layer_scale(k_scale, layer), v_scale=_layer_scale(v_scale, layer), out_scale=out_scale,
                out_dtype=None if out_tiles is not None else out_dtype, new_kv=new_kv, rope=rope, tuning=tuning,
                out_tiles=out_tiles),
            k_cache, v_cache, layer, cache_shape)
        k_scale, v_scale = _layer_scale(k_scale, layer), _layer_scale(v_scale, layer)
        k_cache, v_cache, layer = k_cache[layer][None], v_cache[layer][None], jnp.int32(0)
        n_layers = 1
    in_kernel = out_tiles is not None and tiles_in_kernel(n_heads, g, h, k_splits)
    compute_dtype = jnp.dtype(tuning.dot_dtype or default_dot_dtype(q.dtype, k_cache.dtype))
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
        out_limit=fp8_max(out_dtype) if quantized else None, tail_loop=tuning.tail_loop, with_new=with_new,
        kv_limit=fp8_max(k_cache.dtype) if itemsize == 1 else None,
        fused_rows=fused.shape[1] if rope is not None else None,
        tiles_dtype=jnp.dtype(out_tiles) if in_kernel else None,
    )
    if in_kernel:  # the output's tiles and their inverse scales [N H / 128, B]
        out_shape = (jax.ShapeDtypeStruct((rows * g, h), out_tiles),
                     jax.ShapeDtypeStruct((kh * g * h // TILE, b), jnp.float32))
    elif k_splits == 1:  # the output itself
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
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(*operands)
    if with_new:
        outs, written = outs[:-2], tuple(c.reshape(cache_shape) for c in outs[-2:])
    if k_splits == 1:
        # [B*K*G, H] -> [B, K, G, H]
        out = outs[0].reshape(b, kh, g, h)
        if in_kernel:
            out = (out, outs[1])
        elif out_tiles is not None:
            out = tiles(out, out_tiles)
        return out if not with_new else (out, *written)
    acc, row_max, row_sum = outs
    # combine the splits, each weighted by exp2(its row max - the overall max) (log2 units, as the kernel's); an empty
    # split's max is -inf
    overall_max = jnp.max(row_max, axis=0)
    overall_max = jnp.where(jnp.isfinite(overall_max), overall_max, 0.0)
    weight = jnp.exp2(row_max - overall_max)  # [k_splits, B*K*G]
    total = jnp.sum(weight * row_sum, axis=0)
    acc = jnp.sum(weight[..., None] * acc, axis=0)  # [B*K*G, H]
    # a length-0 sequence (total 0) gets zeros; 1/v_scale is the V dequantization
    out = acc * (_inverse_scale(_layer_scale(v_scale, layer)) / jnp.where(total > 0, total, 1.0))[:, None]
    # [B*K*G, H] -> [B, K, G, H]
    out = _output(out.reshape(b, kh, g, h), q.dtype, out_dtype, out_scale, out_tiles)
    return out if not with_new else (out, *written)


def tiles_in_kernel(heads_per_program: int, groups: int, head_dim: int, k_splits: int) -> bool:
    """Whether the kernel writes ``out_tiles`` itself: one split, H dividing 128 and a program's P*G heads of H a
    whole number of 1 x 128 tiles."""
    return k_splits == 1 and TILE % head_dim == 0 and (heads_per_program * groups * head_dim) % TILE == 0


def _in_layer(attend, k_cache, v_cache, layer, cache_shape):
    """``attend(k_layer, v_layer)`` -> (out, k_layer, v_layer) on layer ``layer`` of [L, B, K, S, H] caches sliced out
    (copies), the written layers put back: (out, k_cache, v_cache) in ``cache_shape``."""
    out, k_layer, v_layer = attend(k_cache[layer], v_cache[layer])
    put = lambda cache, new: lax.dynamic_update_index_in_dim(cache, new, layer, 0).reshape(cache_shape)  # noqa: E731
    return out, put(k_cache, k_layer), put(v_cache, v_layer)
