"""Training/rollout mismatch metrics, the masked reductions the rest of ``rl/`` shares, and the metrics record of an
RL step (``step_record``).

The inputs are per-token logprobs of the *sampled* tokens: ``rollout_logp`` from the sampler (FP8 rollout),
``train_logp`` from the trainer's forward on the same tokens. With d = train_logp - rollout_logp on valid tokens:

- ``mismatch_kl_k1``  mean(-d): KL(rollout || train) estimated with samples from the rollout policy (k1).
- ``mismatch_kl_k3``  mean(exp(d) - d - 1): the same KL with Schulman's non-negative, lower-variance k3, with d
  clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] before the exp (``k3``).
- ``mean_abs_dprob``  mean |p_rollout - p_train| of the sampled token.
- ``token_mult_prob_error``  mean exp(|d|): NeMo RL's name; 1.0 when the two agree exactly.
- ``ppl_ratio``  train perplexity / rollout perplexity = exp(mean(-train) - mean(-rollout)) = exp(k1).
- ``chi2``  mean(exp(d)^2) - 1: the chi-square divergence chi2(train || rollout), which is the variance of the
  importance weights exp(d) under the rollout policy (how noisy IS correction will be); d clamped as k3's.

Clamps: exp(d) is inf in f32 beyond d = 88.7 (chi2's exp(2d) beyond d = 44.4), and one such token makes the mean
inf. ``mismatch_kl_k3`` and ``chi2`` therefore take d clamped to [-20, 20] (``LOG_RATIO_BOUND``: the log-ratio clamp
of veRL's and NeMo RL's k3, and veRL's ``SAFETY_BOUND`` of its token-level chi2): identical to the unclamped values
for |d| <= 20, which every realistic mismatch is (FP8 gives ~1e-3 nats per token), and beyond it a finite lower
bound (a token counts exp(20) - 21 = 4.9e8 in k3, exp(40) - 1 = 2.4e17 in chi2) that still says "far off". The
metric's k3 is not also clamped to 10 as the loss's KL term is (``losses.kl_penalty``): that clamp bounds a penalty
and its gradient, where a metric should show how far a token is; veRL's own k3 metric has no clamp at all (inf at
d > 88.7).

Every mean is over the tokens where ``mask`` is set. Values at masked positions may be anything (padding can hold
-inf or 1e9): they are replaced with ``jnp.where`` before any arithmetic, so neither they nor NaN gradients leak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# |log-ratio| bound before an exp in the k3 estimator (metric and loss) and chi2: veRL's low_var_kl clamp and
# SAFETY_BOUND (its chi2), NeMo RL's calculate_kl input clamp
LOG_RATIO_BOUND = 20.0


def k3(log_ratio: jax.Array, value_bound: float | None = None) -> jax.Array:
    """Schulman's k3, exp(x) - x - 1 (as ``expm1(x) - x``: no cancellation near 0), of the log-ratio ``x`` clamped to
    [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] before the exp; with ``value_bound`` the result is clamped to [-value_bound,
    value_bound] too. Both clamps are the identity inside their bounds (the same bits as the unclamped formula)
    and give a zero gradient where they apply."""
    x = jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    value = jnp.expm1(x) - x
    return value if value_bound is None else jnp.clip(value, -value_bound, value_bound)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``x`` over the positions where ``mask`` is set (f32); 0 for an empty mask."""
    m = mask.astype(bool)
    total = jnp.sum(jnp.where(m, x.astype(jnp.float32), 0.0))
    return total / jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Max of ``x`` over the positions where ``mask`` is set (f32); 0 for an empty mask (a metric, not -inf)."""
    m = mask.astype(bool)
    biggest = jnp.max(jnp.where(m, x.astype(jnp.float32), -jnp.inf))
    return jnp.where(jnp.any(m), biggest, 0.0)


def masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Min of ``x`` over the positions where ``mask`` is set (f32); 0 for an empty mask (a metric, not +inf)."""
    m = mask.astype(bool)
    smallest = jnp.min(jnp.where(m, x.astype(jnp.float32), jnp.inf))
    return jnp.where(jnp.any(m), smallest, 0.0)


def segment_sums(x: jax.Array, segments: jax.Array) -> jax.Array:
    """Sums of ``x`` [B, T] per segment, flat [B * T]: ``segments`` [B, T] int names each position's segment by a
    value in [0, B * T) (packed rows: ``fp8rl_jax.rl.packing.sequence_keys``); ``out[segments]`` gives each position
    its segment's sum. The per-sequence sums of a packed batch, where an unpacked one sums along axis 1."""
    return jax.ops.segment_sum(x.reshape(-1), segments.reshape(-1), num_segments=x.size)


def reduce_metric(name: str, values) -> jax.Array:
    """Combine one metric's values over microbatches or minibatches (``values``: a stacked array or a list of
    scalars): a ``*_max`` metric by max and a ``*_min`` metric by min (the mean of per-batch maxima is no
    maximum), anything else by mean. Used inside the jitted train step and on the host alike."""
    values = jnp.asarray(values)
    if name.endswith("_max"):
        return jnp.max(values, axis=0)
    if name.endswith("_min"):
        return jnp.min(values, axis=0)
    return jnp.mean(values, axis=0)


def mismatch_metrics(rollout_logp: jax.Array, train_logp: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """The mismatch metrics above as a dict of f32 scalars, over ``[B, T]`` logprobs and mask."""
    m = mask.astype(bool)
    rollout = jnp.where(m, rollout_logp.astype(jnp.float32), 0.0)
    train = jnp.where(m, train_logp.astype(jnp.float32), 0.0)
    d = train - rollout  # log(p_train / p_rollout) of the sampled token
    k1 = masked_mean(-d, m)
    return {
        "mismatch_kl_k1": k1,
        "mismatch_kl_k3": masked_mean(k3(d), m),
        "mean_abs_dprob": masked_mean(jnp.abs(jnp.exp(rollout) - jnp.exp(train)), m),
        "token_mult_prob_error": masked_mean(jnp.exp(jnp.abs(d)), m),
        # in log space: the two perplexities themselves overflow for long, unlikely completions
        "ppl_ratio": jnp.exp(k1),
        # = mean(exp(2d)) - 1 without the cancellation near 0; d clamped as above, so never inf
        "chi2": masked_mean(jnp.expm1(2.0 * jnp.clip(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)), m),
    }


def step_record(step: int, batch, per_row: list, rewards: np.ndarray, per_fn: dict[str, np.ndarray],
                train_metrics: list[dict], mismatch: dict, times: dict[str, float], *, backend: str,
                accuracy_fn: str, lr: float, packing: dict) -> dict:
    """The metrics record of RL step ``step`` (0-based): rollout and rewards, the train metrics of its
    minibatch updates (``train_metrics``, one dict of host values per update) reduced over the updates,
    the rollout/trainer mismatch, skipped updates, learning rate, throughput and phase times. ``batch``: the
    step's ``rollout.driver.RolloutBatch``, ``per_row`` the prompt record of each of its rows, ``accuracy_fn`` the
    reward fn whose mean is ``accuracy``, ``packing`` the step's ``packing/*`` metrics (``rl.packing``)."""
    lengths = batch.lengths
    train_tokens = int(lengths.sum()) + sum(len(r.prompt_ids) for r in per_row)
    return {
        "step": step + 1,
        "precision_backend": backend,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(per_fn[accuracy_fn].mean()),
        **{f"reward/{k}": float(v.mean()) for k, v in per_fn.items()},
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "stop_fraction": float(np.mean([r == "stop" for r in batch.finish_reasons])),
        **{k: float(reduce_metric(k, [m[k] for m in train_metrics])) for k in train_metrics[0] if k != "finite"},
        **{k: float(v) for k, v in mismatch.items()},
        "skipped_updates": float(sum(not bool(m["finite"]) for m in train_metrics)),
        "lr": lr,
        "rollout_tokens_per_s": batch.stats["tokens_per_second"],
        "train_tokens_per_s": float(train_tokens) / max(times["train"], 1e-9),
        **{f"time/{k}": v for k, v in times.items()},
        **packing,
    }
