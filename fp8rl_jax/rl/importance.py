"""Importance-sampling correction between the rollout engine and the trainer's old policy.

The completions were sampled by the rollout engine (FP8 linears, FP8 KV cache, its own kernels), not by the
trainer's forward with the same weights; the two disagree a little per token. With the per-token ratio
r_t = exp(old_logp - rollout_logp), the clipped surrogate is reweighted by a constant w_t (stop_gradient):

- ``none``: w_t = 1.
- ``tis``: token-level truncated IS, w_t = min(r_t, cap) (Yao et al., "Your efficient RL framework secretly
  brings you off-policy RL training", 2025; the recipe NeMo RL's FP8 results use with cap 2).
- ``seq_tis``: sequence-level truncated IS, w = min(prod_t r_t, cap) on every token of the sequence. The product
  is formed as exp(sum of log-ratios), clamped before the exp, so long sequences cannot overflow.
- ``mis``: sequence-level masked IS. rho = exp(mean_t log r_t), the geometric mean of the ratios; a sequence with
  rho outside [low, high] is rejected (all its weights 0), a kept one gets the token-level TIS weight
  min(r_t, cap). Departure: sequence-level masking is often stated with the product of the ratios; the geometric
  mean is used so that one band fits every completion length (as NeMo RL's ``seq-mask-tis`` and veRL's
  geometric rejection sampling do).
- ``icepop``: token-level masking (IcePop, inclusionAI's Ring-1T report): w_t = r_t when low <= r_t <= high,
  else 0.

The two masks measure different things, so they have their own bands (``rl.mis_low/mis_high`` and
``rl.icepop_low/icepop_high``; ``MIS_BAND`` and ``ICEPOP_BAND`` below are the defaults):

- MIS bounds a per-token *average*, so its band is tight: [0.999, 1.002], NeMo RL's ``seq-mask-tis`` band
  (veRL's geometric rejection sampling defaults to 1.001 and its reciprocal). A sequence is rejected when its mean
  log-ratio leaves [-1.0e-3, +2.0e-3] nats per token, which is the size of the FP8 rollout/trainer mismatch
  (~1e-3 nats/token): a [0.5, 2] band (|mean log r| up to 0.69 nats/token) would never reject anything.
- IcePop bounds single tokens, whose ratios scatter widely even when the average agrees: [0.5, 5], the band of
  the IcePop report and of NeMo RL's ICE-POP examples: a token is dropped only when the trainer gives it less
  than half, or more than five times, the sampler's probability.

Truncation bounds the variance that a few large ratios would add; masking drops tokens or sequences whose
mismatch is too large to correct at all. Weights are 0 on masked (padding) tokens whatever their logprobs hold.

Metrics (over the mask): ``is_weight_mean``, ``is_weight_max``, ``is_clipped_fraction`` (tokens whose weight the
cap lowered) and ``is_masked_fraction`` (tokens zeroed by ``mis`` / ``icepop``). Over microbatches and minibatches
``is_weight_max`` combines by max, the others by mean (``metrics.reduce_metric``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.rl.metrics import masked_max, masked_mean, segment_sums
from fp8rl_jax.rl.names import IS_CORRECTIONS as KINDS

MIS_BAND = (0.999, 1.002)  # geometric-mean ratio kept by ``mis`` (see above)
ICEPOP_BAND = (0.5, 5.0)  # per-token ratio kept by ``icepop``


def _truncate(log_r: jax.Array, cap: float) -> tuple[jax.Array, jax.Array]:
    """(min(exp(log_r), cap), whether the cap applied); exactly ``cap`` when it applies, never inf."""
    log_cap = jnp.log(jnp.float32(cap))
    clipped = log_r > log_cap
    # clamp before the exp so that exp never sees e.g. 2000 * 0.05; the min then gives exactly `cap`
    return jnp.minimum(jnp.exp(jnp.minimum(log_r, log_cap + 1.0)), cap), clipped


def is_weights(old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, kind: str, *, cap: float = 2.0,
               low: float | None = None, high: float | None = None,
               segments: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Constant IS weights ``[B, T]`` (0 on masked tokens) and their metrics, for ``[B, T]`` logprobs and mask.

    ``low`` / ``high``: the masking band of ``mis`` or ``icepop``; default ``MIS_BAND`` / ``ICEPOP_BAND``.
    ``segments`` [B, T] (packed rows, ``metrics.segment_sums``): the sequence of each token, for the sequence-level
    kinds; default: one sequence per row.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown IS correction {kind!r}; allowed: {' | '.join(KINDS)}")
    default_low, default_high = MIS_BAND if kind == "mis" else ICEPOP_BAND
    low = default_low if low is None else low
    high = default_high if high is None else high
    m = mask.astype(bool)
    old = jnp.where(m, old_logp.astype(jnp.float32), 0.0)
    rollout = jnp.where(m, rollout_logp.astype(jnp.float32), 0.0)
    log_r = old - rollout  # [B, T], 0 on masked tokens
    no = jnp.zeros(m.shape, bool)

    if kind == "none":
        w, clipped, dropped = jnp.ones(m.shape, jnp.float32), no, no
    elif kind == "tis":
        w, clipped = _truncate(log_r, cap)
        dropped = no
    elif kind == "seq_tis":
        if segments is None:
            w_seq, clipped_seq = _truncate(jnp.sum(log_r, axis=1), cap)  # [B]
            w_seq, clipped_seq = w_seq[:, None], clipped_seq[:, None]
        else:  # [B, T]: each token its sequence's sum
            w_seq, clipped_seq = _truncate(segment_sums(log_r, segments)[segments], cap)
        w = jnp.broadcast_to(w_seq, m.shape)
        clipped, dropped = jnp.broadcast_to(clipped_seq, m.shape), no
    elif kind == "mis":
        if segments is None:
            n_tok = jnp.maximum(jnp.sum(m, axis=1), 1).astype(jnp.float32)
            rho = jnp.exp(jnp.sum(log_r, axis=1) / n_tok)[:, None]  # [B, 1]; inf/0 on overflow/underflow: rejected
        else:  # [B, T]: each token its sequence's geometric-mean ratio
            n_tok = jnp.maximum(segment_sums(m.astype(jnp.float32), segments), 1.0)
            rho = jnp.exp(segment_sums(log_r, segments) / n_tok)[segments]
        keep = (rho >= low) & (rho <= high)
        w_tok, clipped_tok = _truncate(log_r, cap)
        w = jnp.where(keep, w_tok, 0.0)
        clipped = clipped_tok & keep
        dropped = jnp.broadcast_to(~keep, m.shape)
    else:  # icepop
        r = jnp.exp(log_r)
        inside = (r >= low) & (r <= high)
        w, clipped, dropped = jnp.where(inside, r, 0.0), no, ~inside

    w = jax.lax.stop_gradient(jnp.where(m, w, 0.0))
    metrics = {
        "is_weight_mean": masked_mean(w, m),
        "is_weight_max": masked_max(w, m),
        "is_clipped_fraction": masked_mean(clipped, m),
        "is_masked_fraction": masked_mean(dropped, m),
    }
    return w, metrics
