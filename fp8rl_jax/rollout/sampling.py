"""Token sampling and the logprobs the trainer will score.

The policy. The RL objective is defined on pi_T(a | s) = softmax(logits / T): the temperature-scaled
distribution with no truncation. The sampler reports ``log pi_T`` of each token it emits, and the trainer
scores tokens with the same ``logits / T`` (``rl.scoring``), so the two logprobs differ only by numerics.

Truncation. ``top_k`` / ``top_p`` change which tokens *can be drawn* (the proposal), not the reported logprob.
With truncation on, the sampled distribution is not pi_T and the importance ratio would need the proposal's
logprob instead; RL configs keep top_k=0 and top_p=1 (the defaults), where the two coincide. Greedy decoding
takes the argmax and reports its logprob under pi_T.

Randomness. Every sequence carries its own key, split once per token, so what a sequence samples depends only
on its key and its prompt, not on which slot or batch it ran in: continuous and static batching agree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling options (hashable: part of the compiled step)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    greedy: bool = False

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use greedy=True for argmax)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")


def policy_logprobs(logits: jax.Array, temperature: float) -> jax.Array:
    """log pi_T over the vocabulary: ``log_softmax(logits / T)`` in f32 (the trainer uses this too)."""
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def _truncate(scaled: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Set logits outside the top-k / top-p nucleus to -inf (the most likely token always survives)."""
    if top_k:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    if top_p < 1.0:
        # keep the smallest prefix of tokens (by probability) whose mass reaches top_p
        order = jnp.sort(scaled, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(order, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        cutoff = jnp.min(jnp.where(before < top_p, order, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    return scaled


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax`` over the last axis: the first index of the maximum, a NaN counting as the maximum.

    On CPU as plain reductions (the max, then the first index holding it): XLA:CPU runs argmax's fused (value, index)
    reduction as scalar code, several times slower over a vocabulary. Same result, element for element."""
    if jax.default_backend() != "cpu":
        return jnp.argmax(x, axis=-1)
    nan = jnp.isnan(x)
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == top)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """``jax.random.categorical(key, logits)`` for one row [V]. On CPU spelled out as JAX computes it, the argmax of
    Gumbel noise plus the logits, with the argmax as ``argmax`` computes it (the same draw)."""
    if jax.default_backend() != "cpu":
        return jax.random.categorical(key, logits)
    return argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def sample(logits: jax.Array, keys: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. logits [B, V], keys [B] -> (tokens [B] int32, logprobs [B] f32 under pi_T)."""
    logp = policy_logprobs(logits, params.temperature)
    if params.greedy:
        tokens = argmax(logits)
    else:
        proposal = _truncate(logp, params.top_k, params.top_p)
        tokens = jax.vmap(categorical)(keys, proposal)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
