"""The clipped policy-gradient loss, its KL term and loss aggregation.

Per token, with ratio = exp(logp - old_logp) and the sequence's advantage A (PPO, arXiv 1707.06347; GRPO uses it
with group advantages):

    pg_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) * w_t      (w_t: IS weight, a constant)
    loss_t = pg_t + kl_coef * KL_t(pi || ref)                                          (KL only with ref_logp)

Departures from the papers:
- ``clip_low != clip_high`` is DAPO's clip-higher (arXiv 2503.14476); PPO and GRPO use one epsilon.
- ``clip_ratio_c`` > 1 turns on dual-clip PPO (Ye et al., arXiv 1912.09729): for A < 0 the clipped surrogate's
  loss is also bounded above by -A * c, ``pg_t = min(max(-A r, -A clip(r)), -A c)``, so one token whose ratio ran
  far above 1 cannot dominate the update (its gradient is 0 there). Off (0) by default here; veRL's vanilla loss
  applies c = 3 by default; TRL and NeMo RL have no dual clip.
- GRPO puts the KL in the loss with the k3 estimator, as here; PPO-RLHF puts k1 in the reward instead. The k3 term
  is clamped as veRL and NeMo RL clamp it (``kl_penalty``: log-ratio to +-20, value to +-10).
- The IS weight (``importance.py``) multiplies only the policy-gradient term, not the KL term: it corrects for
  the tokens having been sampled by the rollout engine rather than by the trainer's old policy.
- Aggregation is a choice (``aggregate``): GRPO's paper averages tokens within a sequence, then sequences
  (``seq_mean_token_mean``); DAPO averages over all tokens (``token_mean``); Dr. GRPO sums tokens and divides by a
  constant: ``seq_mean_token_sum_norm`` divides each sequence's token sum by the generation budget (the train step:
  ``rl.loss_agg_norm``, default ``rollout.max_new_tokens``), then averages over sequences; ``seq_mean_token_sum``
  is the same without the budget (which only rescales the learning rate).

Masked positions may hold anything (inf, NaN, 1e9): inputs are replaced with ``jnp.where`` before any arithmetic,
so neither the loss nor its gradient sees them (``x * 0`` would turn inf into NaN, forward or backward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.rl.metrics import k3, masked_max, masked_mean, masked_min, segment_sums
from fp8rl_jax.rl.names import KL_ESTIMATORS
from fp8rl_jax.rl.names import LOSS_AGGREGATIONS as AGGREGATIONS

KL_VALUE_BOUND = 10.0  # the k3 KL term per token is clamped to [-10, 10] (``kl_penalty``)


def aggregate(per_token: jax.Array, mask: jax.Array, kind: str, *, num_tokens: jax.Array | float | None = None,
              num_sequences: jax.Array | float | None = None, segments: jax.Array | None = None,
              norm: float | None = None) -> jax.Array:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    ``token_mean``: sum(l * m) / num_tokens. ``seq_mean_token_mean``: sum_b(sum_t l*m / max(1, sum_t m)) /
    num_sequences. ``seq_mean_token_sum``: sum_b sum_t l*m / num_sequences. ``seq_mean_token_sum_norm`` (Dr. GRPO,
    arXiv 2503.20783): sum_b (sum_t l*m / norm) / num_sequences, with ``norm`` a constant > 0, the generation budget
    (the train step passes ``rl.loss_agg_norm``, default ``rollout.max_new_tokens``); ``norm`` defaults to T, the
    row width, as veRL takes its response width, which is a constant only where every batch has one width. TRL's
    ``dr_grpo`` is this (sum / (sequences * max_completion_length)); veRL's ``seq-mean-token-sum-norm`` divides
    each microbatch's sum by the width but not by its sequence count (it then averages the microbatches), i.e.
    ``num_sequences`` times this, a learning-rate factor.

    ``num_tokens`` / ``num_sequences`` default to this batch's mask sum / B. Gradient accumulation passes the
    totals of the whole (mini)batch instead: every aggregation is then a sum over sequences divided by a global
    constant, so the sum of the microbatch losses (split along B) equals the full-batch loss exactly. The
    per-sequence token count of ``seq_mean_token_mean`` is local to each sequence and needs no global value.

    ``segments`` [B, T] (packed rows: several sequences per row, ``metrics.segment_sums``) names each token's
    sequence; the per-sequence sums are then taken per segment, and ``num_sequences`` must be given (a row is no
    longer a sequence).
    """
    if kind not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {kind!r}; allowed: {' | '.join(AGGREGATIONS)}")
    m = mask.astype(bool)
    masked = jnp.where(m, per_token.astype(jnp.float32), 0.0)
    if kind == "token_mean":
        if num_tokens is None:
            num_tokens = jnp.maximum(jnp.sum(m), 1)  # an all-padding batch gives 0, not NaN
        return jnp.sum(masked) / jnp.asarray(num_tokens, jnp.float32)
    if segments is None:
        if num_sequences is None:
            num_sequences = per_token.shape[0]
        per_sequence = jnp.sum(masked, axis=1)  # [B]
        count = jnp.sum(m, axis=1) if kind == "seq_mean_token_mean" else None
    else:
        if num_sequences is None:
            raise ValueError(f"loss aggregation {kind!r} over packed rows (segments) needs num_sequences")
        per_sequence = segment_sums(masked, segments)  # [B * T]: a padding segment's sum is 0
        count = segment_sums(m.astype(jnp.float32), segments) if kind == "seq_mean_token_mean" else None
    if kind == "seq_mean_token_mean":
        per_sequence = per_sequence / jnp.maximum(count, 1).astype(jnp.float32)
    total = jnp.sum(per_sequence) / jnp.asarray(num_sequences, jnp.float32)
    if kind == "seq_mean_token_sum_norm":
        norm = per_token.shape[-1] if norm is None else norm
        if not norm > 0:
            raise ValueError(f"loss aggregation {kind!r}: norm={norm!r}, the constant, must be > 0")
        total = total / jnp.float32(norm)
    return total


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(pi || ref) from tokens sampled by pi (Schulman, "Approximating KL divergence").

    ``k1`` = logp - ref_logp (unbiased, can be negative); ``k3`` = exp(x) - x - 1 with x = ref - logp (unbiased,
    never negative, lower variance when pi and ref are close).

    ``k3`` is clamped as veRL's ``low_var_kl`` and NeMo RL's ``calculate_kl`` (their defaults) clamp it: x to
    [-20, 20] before the exp (``metrics.LOG_RATIO_BOUND``), then the value to [-10, 10] (``KL_VALUE_BOUND``). Unclamped,
    one token at x = 25 adds exp(25) = 7.2e10 to the loss and x > 88.7 makes it inf (a skipped step). Inside the
    bounds the value and its gradient are the unclamped formula's, bit for bit. The cost: where a clamp applies the
    token's KL gradient is 0, and the value clamp applies first, at k3 = 10, i.e. x > 2.61 (pi gives the token less
    than 1/13.6 of ref's probability) or x < -11.0 (more than 6e4 times it): there the penalty stops pulling pi
    back towards ref, however far off the token is.
    ``k1`` is not clamped (linear in x: nothing overflows). TRL's k3 has no clamp.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {' | '.join(KL_ESTIMATORS)}")
    log_ratio = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
    if estimator == "k1":
        return -log_ratio
    return k3(log_ratio, value_bound=KL_VALUE_BOUND)


def policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, *, clip_low: float,
                clip_high: float, loss_agg: str, clip_ratio_c: float = 0.0, is_weights: jax.Array | None = None,
                ref_logp: jax.Array | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                loss_agg_norm: float | None = None, num_tokens: jax.Array | float | None = None,
                num_sequences: jax.Array | float | None = None,
                segments: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped surrogate loss (scalar) and its metrics; ``logp``/``old_logp``/``mask`` are ``[B, T]``,
    ``advantages`` is ``[B]``, or ``[B, T]`` per token (packed rows, with ``segments``: see ``aggregate``, which
    also says what ``loss_agg_norm``, its ``norm``, is).
    ``clip_*``, ``loss_agg``, ``kl_coef`` and ``kl_estimator`` are static Python values (``kl_coef`` decides at
    trace time whether the KL term exists, ``clip_ratio_c`` whether the dual clip does: 0 = off, else > 1).

    Metrics are masked means over the tokens of this batch (not the ``loss_agg`` aggregation), without gradient:
    ``pg_loss`` (the IS-weighted policy-gradient term), ``clip_fraction`` (tokens whose min picks the clipped term
    and it is strictly smaller, i.e. whose gradient the clip removes), ``ratio_mean``, ``ratio_max``,
    ``ratio_min``, ``dual_clip_fraction`` (only with the dual clip on: tokens with A < 0 whose loss the bound -A c
    lowered, veRL's ``pg_clipfrac_lower``) and ``kl`` (only when the KL term is on).
    """
    if kl_estimator not in KL_ESTIMATORS:  # checked even with KL off, so a bad config fails on the first step
        raise ValueError(f"unknown KL estimator {kl_estimator!r}; allowed: {' | '.join(KL_ESTIMATORS)}")
    m = mask.astype(bool)
    logp = jnp.where(m, logp.astype(jnp.float32), 0.0)
    old_logp = jnp.where(m, old_logp.astype(jnp.float32), 0.0)
    adv = advantages.astype(jnp.float32)
    adv = jnp.where(m, adv[:, None] if adv.ndim == 1 else adv, 0.0)  # [B] -> [B, T]

    ratio = jnp.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    pg = -jnp.minimum(unclipped, clipped)
    if clip_ratio_c:  # dual clip, before the IS weight (a constant factor, as veRL applies its rollout weights)
        if not clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c={clip_ratio_c!r}: 0 (off) or > 1 (dual-clip PPO)")
        bound = -adv * clip_ratio_c
        dual = (adv < 0) & (pg > bound)
        pg = jnp.where(dual, bound, pg)
    if is_weights is not None:
        pg = pg * jax.lax.stop_gradient(jnp.where(m, is_weights.astype(jnp.float32), 0.0))
    per_token = pg

    metrics = {
        "pg_loss": masked_mean(pg, m),
        "clip_fraction": masked_mean(clipped < unclipped, m),
        "ratio_mean": masked_mean(ratio, m),
        "ratio_max": masked_max(ratio, m),
        "ratio_min": masked_min(ratio, m),
    }
    if clip_ratio_c:
        metrics["dual_clip_fraction"] = masked_mean(dual, m)
    if ref_logp is not None and kl_coef > 0:
        kl = kl_penalty(logp, jnp.where(m, ref_logp.astype(jnp.float32), 0.0), kl_estimator)
        per_token = per_token + kl_coef * kl
        metrics["kl"] = masked_mean(kl, m)

    loss = aggregate(per_token, m, loss_agg, num_tokens=num_tokens, num_sequences=num_sequences, segments=segments,
                     norm=loss_agg_norm)
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
