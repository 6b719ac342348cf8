"""Rotary position embeddings (RoPE, the Hugging Face rotate-half layout, with Llama-3.1 frequency scaling):
``llama``'s blocks rotate q and k with ``apply_rope``; the decode kernel takes ``rope_cos_sin``'s tables.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.model.config import LlamaConfig


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [H/2], with Llama-3.1 scaling when the config has it (computed once, in numpy)."""
    h = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    s = config.rope_scaling
    if s is None:
        return inv.astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """RoPE's cos and sin at ``positions`` [...]: [..., H/2] f32 each (``apply_rope``'s, and the decode kernel's)."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout). x [B, T, heads, H], positions [B, T]."""
    # [B, T, H/2] -> [B, T, 1, H/2]
    cos, sin = (a[:, :, None, :] for a in rope_cos_sin(positions, inv_freq))
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
