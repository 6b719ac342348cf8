"""The K/V cache of prefill and decode: its layout, dtype and writes (stacked [L, B, K, S, H] or one array per
layer, held as its bits on CPU; see ``llama.forward_hidden``).

Letters as in ``fp8rl_jax.model.llama``: L layers, B batch, T new tokens, K kv heads, S cache length, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.parallel import rules

Cache = dict  # {"k": [L, B, K, S, H], "v": [L, B, K, S, H]}: (B, K) lead, as the attention dots batch them


def init_cache(config: LlamaConfig, batch: int, max_len: int, dtype) -> Cache:
    """Zeroed K/V cache [L, B, K, S, H]: per (sequence, kv head) a contiguous [S, H] matrix, so the decode
    step's attention dots read it in place (no transpose of the cache inside the loop)."""
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def cache_dtype(precision: Precision):
    return jnp.dtype(precision.kv_cache_dtype if precision.kv_fp8 else precision.compute_dtype)


def _as_bits(a: jax.Array) -> jax.Array:
    """The same bits as unsigned integers of the same width (bf16 -> uint16, f8 -> uint8)."""
    return lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))


def _cache_write(cache_bits: jax.Array, idx, rows: jax.Array, positions: jax.Array, update: jax.Array):
    """``update`` [B, T, K, H] written into layer ``idx`` of the cache [L, B, K, S, H] (held as its bits, see
    ``forward_hidden``) at (row, :, position); positions outside the cache are dropped. Returns the cache bits and
    its layer ``idx`` [B, K, S, H] in ``update``'s dtype. A cache of one array per layer (a tuple, ``cache_layers``;
    ``idx`` static) is written by ``_layer_write``.

    On CPU a decode step (T = 1) writes with a select over the layer's slice; otherwise a scatter.
    """
    if isinstance(cache_bits, tuple):
        layers = list(cache_bits)
        layers[idx], layer = _row_local(lambda c, i, r, p, u: _layer_write(c, r, p, u), layers[idx], 0, rows,
                                        positions, update)
        return tuple(layers), layer
    as_bits = cache_bits.dtype != update.dtype  # the CPU form (see forward_hidden)
    update_bits = _as_bits(update) if as_bits else update
    if update.shape[1] == 1 and as_bits:
        # CPU: a select over the layer's slice beats XLA:CPU's scatter; on GPU it would read and write the whole
        # layer every step, so the GPU keeps the scatter below (one [K, H] row per sequence)
        # [B, S]: the one position each row writes
        hit = jnp.arange(cache_bits.shape[3], dtype=positions.dtype)[None, :] == positions
        # [B, 1, K, H] -> [B, K, 1, H], broadcast along S
        layer = jnp.where(hit[:, None, :, None], update_bits.transpose(0, 2, 1, 3), cache_bits[idx])
        cache_bits = lax.dynamic_update_index_in_dim(cache_bits, layer, idx, 0)
        # read back from the updated cache: nothing reads the old cache after the in-place update (XLA would
        # otherwise copy the whole cache to keep the old value for the attention's reads)
        layer = cache_bits[idx]
    else:
        def scatter(cache_bits, idx, rows, positions, update_bits):
            # the index arrays are split by a slice, so (numpy rules) the indexed view is [B, T, K, H], update's layout
            cache_bits = cache_bits.at[idx, rows, :, positions].set(update_bits, mode="drop")
            return cache_bits, cache_bits[idx]

        cache_bits, layer = _row_local(scatter, cache_bits, idx, rows, positions, update_bits)
    return cache_bits, layer if layer.dtype == update.dtype else lax.bitcast_convert_type(layer, update.dtype)


def _row_local(write, cache, idx, rows, positions, update):
    """``write(cache, idx, rows, positions, update) -> (cache, layer)``, a scatter of each sequence's rows into its
    own part of the cache. Under a mesh of several devices (``rules.active_mesh``) it runs under ``jax.shard_map``
    over the sequences and kv heads, split as the cache is (``rules.cache_local_specs``), each device writing its
    own sequences with local row indices: XLA's partitioner cannot tell that a scatter by row stays in its row, and
    would gather the indices and updates onto every device (in every layer of every decode step)."""
    mesh = rules.active_mesh()
    if mesh is None:
        return write(cache, idx, rows, positions, update)
    cache_spec, heads_spec, rows_spec = rules.cache_local_specs(mesh, cache.shape)

    def local(cache, idx, positions, update):
        rows = jnp.broadcast_to(jnp.arange(cache.shape[-4])[:, None], positions.shape)  # [B_local, T]
        return write(cache, idx, rows, positions, update)

    # update [B, T, K, H] split as the cache's B and K; the layer returned [B, K, S, H] as well
    update_spec = P(heads_spec[0], None, heads_spec[1])
    return jax.shard_map(local, mesh=mesh, in_specs=(cache_spec, P(), rows_spec, update_spec),
                         out_specs=(cache_spec, heads_spec), check_vma=False)(
        cache, jnp.asarray(idx, jnp.int32), positions, update)


def _layer_write(layer_bits: jax.Array, rows, positions, update: jax.Array):
    """``_cache_write`` into one layer's own array [B, K, S, H] (held as its bits where its dtype differs from
    ``update``'s): a scatter, in place. Returns the new layer and the layer in ``update``'s dtype."""
    as_bits = layer_bits.dtype != update.dtype
    # the index arrays are split by a slice, so (numpy rules) the indexed view is [B, T, K, H], update's layout
    layer_bits = layer_bits.at[rows, :, positions].set(_as_bits(update) if as_bits else update, mode="drop")
    return layer_bits, lax.bitcast_convert_type(layer_bits, update.dtype) if as_bits else layer_bits


def cache_layers(cache: Cache, as_bits: bool) -> Cache:
    """[L, B, K, S, H] -> one [B, K, S, H] array per layer (a tuple), as its bits with ``as_bits`` (see
    ``forward_hidden``). Convert once around a loop of decode steps, not in every step."""
    # the bits of the whole stack, then its layers: XLA:CPU slices a bf16 array through f32, element by element
    cache = {name: _as_bits(a) if as_bits else a for name, a in cache.items()}
    return {name: tuple(a[i] for i in range(a.shape[0])) for name, a in cache.items()}


def cache_stack(layers: Cache, dtype) -> Cache:
    """``cache_layers``' inverse: the per-layer arrays (or their bits) stacked into [L, B, K, S, H] ``dtype``."""
    def stack(arrays):
        a = jnp.stack(arrays)
        return a if a.dtype == dtype else lax.bitcast_convert_type(a, dtype)
    return {name: stack(arrays) for name, arrays in layers.items()}


def _kv_stored(k, v, k_scale, v_scale, precision: Precision):
    """K and V as the cache stores them: quantized with their layer's scales for an FP8 cache, else as they are."""
    if precision.kv_fp8:
        return kvq.quantize_kv(k, k_scale), kvq.quantize_kv(v, v_scale)
    return k, v
