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

The draw in two levels (no truncation, not greedy). ``jax.random.categorical`` adds Gumbel noise to every logit:
threefry bits for each of the V entries of each row, compute-bound (at Llama-3's V = 128,256 and 256 rows, 0.17 ms
of a 2.7 ms FP8 decode step on the H100, more than either of the two passes of the log-softmax beside it). A
token is drawn here as a block of the vocabulary and a token within it: blocks of ``vocab_block(V)`` consecutive
tokens (a divisor of V near sqrt(V)), block j with probability S_j / S where S_j = sum over the block of
exp(z - max z) (each block's max m_j and sum of exp(z - m_j) in one read of the logits, S_j = that sum times
exp(m_j - max z); the logprob's normaliser is S = sum_j S_j), then token i of that block with probability exp(z_i)
/ sum over the block (Gumbel-max over its entries alone). P(j) P(i | j) = exp(z_i - max z) / S: the same
distribution pi_T, exactly (up to the f32 rounding of the block sums), with Gumbel noise for about 2 sqrt(V)
entries a row. Not the same draws as a one-level Gumbel-max from the same key. Each block's max and exp-sum come
from one read of the logits (``block_stats``). Both measured against the earlier forms (``jax.random.categorical``
over the row; a max, then a sum of exps over the block again), which were then removed: ``benchmarks/RESULTS.md``,
"Rollout throughput".
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax


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


def vocab_block(vocab: int) -> int:
    """The block length of the two-level draw: the smallest divisor of ``vocab`` at least sqrt(vocab) (``vocab``
    itself, one block, for a prime: then the draw is one Gumbel-max over the row, as ``categorical``'s)."""
    for block in range(max(math.isqrt(vocab - 1) + 1, 1), vocab + 1):
        if vocab % block == 0:
            return block
    return vocab


def _online(a, b):
    """Two (max, sum of exp(z - max)) pairs as one: the reducer of ``block_stats``' single pass."""
    (max_a, sum_a), (max_b, sum_b) = a, b
    top = jnp.maximum(max_a, max_b)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)  # both -inf: the sums are 0 and stay 0 (exp(-inf) = 0, no NaN)
    return top, sum_a * jnp.exp(max_a - shift) + sum_b * jnp.exp(max_b - shift)


def block_stats(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's max m and sum of exp(z - m) over the last axis of ``blocks`` [..., n], in one read: one variadic
    reduction carrying (max, sum), each merge rescaling the smaller max's sum (a max and then a sum of exps would be
    two reductions, two reads of every logit). A row of -inf only gives (-inf, 0)."""
    ones = jnp.ones_like(blocks)  # each entry as the pair (z, exp(z - z) = 1)
    init = (jnp.array(-jnp.inf, blocks.dtype), jnp.array(0, blocks.dtype))
    return lax.reduce((blocks, ones), init, _online, (blocks.ndim - 1,))


def two_level(key: jax.Array, scaled: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One row's token drawn from softmax(``scaled``) [V] in two levels (the module note), with its log-probability
    as ``jax.nn.log_softmax`` forms it, ``(z - max) - log S``: (token [] int32, logprob [] f32)."""
    v = scaled.shape[-1]
    block = vocab_block(v)
    # [V] -> [V / block, block]: a free reshape
    blocks = scaled.reshape(v // block, block)
    block_max, block_sum = block_stats(blocks)
    shift = jnp.where(jnp.isfinite(block_max), block_max, 0.0)  # a block of -inf only: its sum is 0
    # XLA folds a reduction of a reduction into one over the whole row: that would read the logits again
    block_max, shift, block_sum = lax.optimization_barrier((block_max, shift, block_sum))
    top = jnp.max(block_max)
    # log S_j up to the row's constant; log(0) = -inf: a block of no mass is never drawn
    mass = jnp.log(block_sum) + shift
    block_key, token_key = jax.random.split(key)
    j = categorical(block_key, mass)
    i = categorical(token_key, lax.dynamic_index_in_dim(blocks, j, axis=0, keepdims=False))
    token = (j * block + i).astype(jnp.int32)
    total = jnp.sum(block_sum * jnp.exp(shift - top))  # S = sum over the row of exp(z - max z)
    return token, (scaled[token] - top) - jnp.log(total)


def sample(logits: jax.Array, keys: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. logits [B, V], keys [B] -> (tokens [B] int32, logprobs [B] f32 under pi_T): untruncated
    in two levels (``two_level``), greedy as the argmax, truncated (top-k / top-p) by ``categorical`` over the
    proposal."""
    if not params.greedy and not params.top_k and params.top_p == 1.0:
        scaled = logits.astype(jnp.float32) / params.temperature
        return jax.vmap(two_level)(keys, scaled)
    logp = policy_logprobs(logits, params.temperature)
    if params.greedy:
        tokens = argmax(logits)
    else:
        proposal = _truncate(logp, params.top_k, params.top_p)
        tokens = jax.vmap(categorical)(keys, proposal)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
