"""Decode attention: one query token per sequence against the filled part of that sequence's KV cache.

Why. The model's cached attention scores every position of the preallocated cache [B, K, S, H] and masks the
unfilled ones, so each decode step would read all S positions of every layer whatever the sequences' lengths. This
package reads positions ``0 .. length - 1`` of each sequence only, straight from the BF16 or FP8 cache, in place.

What. ``decode_attention`` (query [B, K, G, H]) and ``decode_attention_qkv`` (the decode step's fused q|k|v
projection before RoPE) run a Pallas kernel (Triton backend, ``kernel.py``) or the masked einsum (``xla.py``, the
reference and the path off a GPU). The kernel: a program per (sequence, group of kv heads) and split of the filled
length, an online softmax over blocks of positions (exp2 of log2-unit scores), FP8 K/V converted to F16 in the
kernel with the scales applied in f32, optionally the new token's K/V quantized and stored into the caches (aliased
outputs) and the queries and keys rotated from the projection, and the output quantized for ``wo``'s FP8 GEMM; under
a mesh it runs under ``jax.shard_map`` over batch and kv heads. How it is launched is a static value,
``DecodeTuning`` (``tuning.py``), that every entry point takes and the rollout engine carries
(``EngineConfig.decode_tuning``).

The design, each choice with its measurement, is in ``docs/decode_attention.md``; the numbers in
``benchmarks/RESULTS.md`` ("Decode attention kernel", "Rollout throughput").

Letters: B batch, K kv heads, G query heads per kv head, H head dim, S cache positions, L layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fp8rl_jax.kernels.decode_attention.kernel import decode_attention_pallas
from fp8rl_jax.kernels.decode_attention.tuning import (
    DEFAULT_TUNING,
    IMPLS,
    DecodeTuning,
    default_block_k,
    default_dot_dtype,
    default_heads_per_program,
    default_k_splits,
    pallas_unsupported,
    resolve_impl,
)
from fp8rl_jax.kernels.decode_attention.xla import decode_attention_xla, split_qkv, write_new

__all__ = [
    "DEFAULT_TUNING", "IMPLS", "DecodeTuning", "decode_attention", "decode_attention_pallas", "decode_attention_qkv",
    "decode_attention_xla", "default_block_k", "default_dot_dtype", "default_heads_per_program", "default_k_splits",
    "pallas_unsupported", "resolve_impl", "split_qkv", "write_new",
]


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
                     tuning: DecodeTuning = DEFAULT_TUNING, out_tiles=None):
    """Attention of one query token per sequence over cache positions ``0 .. lengths[b] - 1``.

    q [B, K, G, H] (bf16 or f32); k_cache, v_cache [B, K, S, H], or [L, B, K, S, H] with ``layer`` (an int or
    a traced scalar), in bf16 / f32, or float8_e4m3fn with that layer's scalar ``k_scale`` / ``v_scale``, or
    with a stacked cache the scales of every layer [L] (read at ``layer``: the decode step then makes no
    per-layer array of them) (stored value = value * scale); lengths [B] int (clipped to [0, S]; a length-0 row
    returns zeros from the kernel). Returns [B, K, G, H] in q's dtype, or with an FP8 ``out_dtype`` and its
    ``out_scale`` that value quantized for the next FP8 GEMM (``recipe.quantize``, bit for bit what that linear
    would make of the BF16 output; the kernel writes it, so no XLA kernel quantizes it in the decode step). With an
    FP8 ``out_tiles`` (block scaling's ``wo``) the output is ``(q, inv_t)``: each sequence's [N H] row in 1 x 128
    tiles (``xla.tiles``: FP8 [B, K, G, H], inverse scales [N H / 128, B]), which the kernel makes where a program's
    heads hold whole tiles and it runs one split (else XLA does, after it); not under a mesh.

    ``new_kv``: this step's (K, V) [B, K, H] (q's dtype), the token at position ``lengths[b] - 1``: written into the
    caches (quantized with ``k_scale`` / ``v_scale`` for an FP8 cache; not written where that position is outside
    the cache) before it is attended to, and ``(out, k_cache, v_cache)`` returned. The kernel stores them itself,
    into the cache buffers it was given (aliased: in place where the caller's buffers can be reused), and takes
    that position from registers, so that no XLA scatter per layer and step writes them (two kernels a layer).

    impl: ``pallas`` (the Triton kernel, GPU), ``pallas_interpret`` (the same kernel through Pallas'
    interpreter: any backend, slow, for tests), ``xla`` (the masked einsum), ``auto`` (pallas on a GPU backend
    when the shapes allow it, else xla). ``tuning``: the kernel's launch (``DecodeTuning``, a static value).
    """
    impl = _chosen_impl(impl, q.shape[-1])
    scales = {"k_scale": k_scale, "v_scale": v_scale, "out_scale": out_scale}
    if impl == "xla":
        return decode_attention_xla(q, k_cache, v_cache, lengths, layer=layer, out_dtype=out_dtype, new_kv=new_kv,
                                    out_tiles=out_tiles, **scales)
    kernel = functools.partial(decode_attention_pallas, interpret=impl == "pallas_interpret", out_dtype=out_dtype,
                               tuning=tuning, out_tiles=out_tiles)
    from fp8rl_jax.parallel import rules

    mesh = rules.active_mesh()
    if mesh is None:
        return kernel(q, k_cache, v_cache, lengths, layer=layer, new_kv=new_kv, **scales)
    _no_tiles_under_a_mesh(out_tiles)
    return _shard_mapped(kernel, mesh, q, k_cache, v_cache, lengths, layer, scales, new_kv)


def decode_attention_qkv(qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, rope, *,
                         layer=None, k_scale=None, v_scale=None, out_scale=None, out_dtype=None, impl: str = "auto",
                         tuning: DecodeTuning = DEFAULT_TUNING, out_tiles=None):
    """``decode_attention`` of a decode step from its fused projection, before RoPE.

    qkv [B, N+2K, H]: each sequence's N query heads, then its K keys, then its K values (the fused q|k|v GEMM's
    output, a free reshape); rope = (cos, sin) [B, H/2] f32 at each sequence's new position ``lengths - 1``. The
    queries and keys are rotated as ``model.rope.apply_rope`` rotates them (f32, rounded to qkv's dtype), the new K/V
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
                                impl=impl, tuning=tuning, out_tiles=out_tiles, **scales)
    kernel = functools.partial(decode_attention_pallas, interpret=impl == "pallas_interpret", out_dtype=out_dtype,
                               tuning=tuning, out_tiles=out_tiles)
    if mesh is None:
        return kernel(qkv, k_cache, v_cache, lengths, layer=layer, rope=rope, **scales)
    _no_tiles_under_a_mesh(out_tiles)
    return _shard_mapped(kernel, mesh, qkv, k_cache, v_cache, lengths, layer, scales, None, rope)


def _no_tiles_under_a_mesh(out_tiles):
    if out_tiles is not None:
        raise ValueError("decode attention: out_tiles (block scaling's tiles of the output) runs outside a mesh only")


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
