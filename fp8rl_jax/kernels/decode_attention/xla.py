"""Decode attention's XLA path (the masked einsum over the whole cache: the reference, and the path off a GPU) and the
input handling and arithmetic the kernel (``kernel.py``) shares with it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8rl_jax.kernels.block_quantize import TILE, tile_scales
from fp8rl_jax.numerics import fp8_max, quantize, rounded

NEG_INF = -1e30  # the XLA path's mask value (as in ``model.attention.attention``)


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


def _output(out: jax.Array, q_dtype, out_dtype, out_scale, out_tiles=None):
    """The attention output rounded to the query's dtype, then, for an FP8 ``out_dtype``, quantized with
    ``out_scale`` exactly as the next linear would quantize that BF16 value (``recipe.quantize``); with an FP8
    ``out_tiles`` in its 1 x 128 tiles instead (``tiles``)."""
    if out_tiles is not None:
        return tiles(rounded(out, q_dtype), out_tiles)
    if out_scale is None:
        return out.astype(q_dtype)
    # the rounding to q's dtype kept (XLA may fold an f32 -> bf16 -> f32 convert pair away)
    return quantize(rounded(out, q_dtype), jnp.asarray(out_scale, jnp.float32), out_dtype)


def tiles(out: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """The output [B, K, G, H] as block scaling's ``wo`` takes it: each sequence's row [N H] in 1 x 128 tiles,
    ``block.tile_quantize``'s arithmetic (``block_quantize.tile_scales``, ``quantize``): (FP8 [B, K, G, H],
    inverse scales laid [N H / 128, B], as ``block_quantize.quantize_tiles`` lays them)."""
    b = out.shape[0]
    # [B, K, G, H] -> [B, N H / 128, 128]
    t = out.astype(jnp.float32).reshape(b, -1, TILE)
    scale, inv = tile_scales(jnp.max(jnp.abs(t), axis=-1), fp8_max(dtype))
    return quantize(t, scale[..., None], dtype).reshape(out.shape), inv.T


def _check_tiles(q, out_tiles, out_dtype, out_scale):
    """``out_tiles`` (an FP8 dtype) goes without ``out_scale`` / ``out_dtype`` and needs 128 dividing N H."""
    if out_tiles is None:
        return
    if jnp.dtype(out_tiles).itemsize != 1 or out_scale is not None or out_dtype is not None:
        raise ValueError(f"out_tiles is an FP8 dtype, given without out_scale and out_dtype (got {out_tiles}, "
                         f"{out_scale is not None}, {out_dtype})")
    if (q.shape[-3] * q.shape[-2] * q.shape[-1]) % TILE:
        raise ValueError(f"out_tiles: 1 x 128 tiles of a row of N H = {q.shape[-3] * q.shape[-2] * q.shape[-1]}")


def _rotate_half(x, cos, sin):
    """``model.rope.apply_rope``'s arithmetic on [..., H] f32 values: halves (x1, x2) -> (x1 cos - x2 sin,
    x2 cos + x1 sin), cos and sin broadcasting against [..., H/2]. Written with the equal split, the two-way stack
    and the transpose Pallas' Triton lowering has (no concatenation); ``split_qkv`` uses it too."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    # [..., H/2, 2] -> [..., 2, H/2] -> [..., H]
    pair = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.swapaxes(pair, -1, -2).reshape(x.shape)


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


# ----------------------------------------------------------------------------------------------------------
# the XLA path


def decode_attention_xla(q, k_cache, v_cache, lengths, *, layer=None, k_scale=None, v_scale=None, out_scale=None,
                         out_dtype=None, new_kv=None, out_tiles=None):
    """The model's masked einsum over all S positions (FP8 K/V dequantized to the query dtype first).

    Positions at or past a sequence's length are masked out of the scores and zeroed in V, so whatever they
    hold (NaN included) cannot reach the output. Same signature as ``decode_attention``; ``new_kv`` is written by
    a scatter first (``write_new``).
    """
    cache_shape = k_cache.shape
    (k_cache, _), (v_cache, layer) = _stacked(k_cache, layer), _stacked(v_cache, layer)
    _check(q, k_cache, v_cache, lengths, k_scale, v_scale)
    _check_new(q, new_kv)
    _check_tiles(q, out_tiles, out_dtype, out_scale)
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
    out = _output(out, q.dtype, out_dtype, out_scale, out_tiles)
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


def split_qkv(qkv, kv_heads: int, rope):
    """The fused projection [B, N+2K, H] as (q [B, K, G, H], (k, v) [B, K, H]), q and k rotated as ``rope``
    (cos, sin) [B, H/2] says (``model.rope.apply_rope``'s arithmetic): what the kernel makes of it, in XLA ops."""
    q_view = _fused_query(qkv, kv_heads, None, rope)
    b, _, g, h = q_view.shape
    n = kv_heads * g
    # [B, H/2] -> [B, 1, H/2]: the same angles for every head of a sequence
    cos, sin = (jnp.asarray(a, jnp.float32)[:, None, :] for a in rope)
    rotate = lambda x: _rotate_half(x.astype(jnp.float32), cos, sin).astype(x.dtype)  # noqa: E731
    q, k, v = qkv[:, :n], qkv[:, n:n + kv_heads], qkv[:, n + kv_heads:]
    return rotate(q).reshape(b, kv_heads, g, h), (rotate(k), v)
