"""FP8 (E4M3) KV cache with per-layer scales, recalibrated after every policy update.

K and V of layer l are stored as ``q = saturate(k * k_scale[l])`` in E4M3 and read back as ``q / k_scale[l]``.
Scales come from a calibration pass, not from delayed amax histories: after each update one forward over a
batch of recent sequences returns every layer's amax of K and V (the forward reports them for free), and

    kv_scale = 448 / amax / 2**margin

guarded like the linears' scales (``recipe.scale_from_amax``): a layer whose amax is 0 or not finite keeps its
previous scale (1 when there is none), and a tiny amax gets the largest finite f32, never inf. Because the
full-sequence forward (scoring and training) rounds K and V through the same E4M3 values when the cache is FP8,
the trainer's logprobs see the same attention inputs as the sampler's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8.recipe import E4M3, fp8_max, quantize, scale_from_amax

KvScales = dict[str, jax.Array]  # {"k": f32[L], "v": f32[L]}


def init_kv_scales(num_layers: int) -> KvScales:
    return {"k": jnp.ones((num_layers,), jnp.float32), "v": jnp.ones((num_layers,), jnp.float32)}


def scales_from_amax(kv_amax: KvScales, margin: int = 0, old: KvScales | None = None) -> KvScales:
    """Per-layer ``448 / amax / 2**margin``; where an amax is 0 or not finite, the scale in ``old`` (or 1)."""
    if old is None:
        old = jax.tree.map(jnp.ones_like, kv_amax)
    return jax.tree.map(lambda a, o: scale_from_amax(a, o, fp8_max(E4M3), margin), kv_amax, old)


def quantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    return quantize(x, scale, E4M3)


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return (q.astype(jnp.float32) * (1.0 / scale)).astype(dtype)


def round_trip(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``dequantize(quantize(x))`` that XLA cannot fold away: the barrier pins the E4M3 value."""
    return dequantize_kv(lax.optimization_barrier(quantize_kv(x, scale)), scale, x.dtype)
