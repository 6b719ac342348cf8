"""Group-relative advantages: one scalar per completion from the rewards of its prompt's group.

``rewards`` is ``[P, n]``: P prompts, n sampled completions each (the GRPO group). Every variant centres on the
group so that a prompt whose completions all score alike teaches nothing (all-equal rewards give 0 advantages).

- ``grpo`` (DeepSeekMath, arXiv 2402.03300): ``(r - mean) / (std + eps)``. Departure: the std is the *population*
  std (ddof=0); several public implementations use the unbiased sample std (ddof=1), which for n=4 is ~15%
  larger. With the std normalisation a group with a tiny spread gets advantages of size ~1 (Dr. GRPO's
  "question-level difficulty bias"); ``eps`` only guards the all-equal group.
- ``drgrpo`` (Dr. GRPO, arXiv 2503.20783): ``r - mean``, no std. Dr. GRPO's other change, dropping the per-sequence
  length normalisation of the loss, is not here: choose it with ``loss_agg`` (``losses.aggregate``).
- ``rloo`` (REINFORCE leave-one-out, Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean)``,
  an unbiased baseline that excludes the sample itself. Departure: the paper uses it in plain REINFORCE on whole
  sequences; here it feeds the same clipped per-token surrogate as the other two. Needs n >= 2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.rl.names import ADVANTAGE_KINDS as KINDS


def group_advantages(rewards: jax.Array, kind: str, eps: float = 1e-6) -> jax.Array:
    """Advantages ``[P, n]`` (float32) for rewards ``[P, n]``, centred within each row (group)."""
    if kind not in KINDS:
        raise ValueError(f"unknown advantage kind {kind!r}; allowed: {' | '.join(KINDS)}")
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [prompts, samples_per_prompt], got shape {rewards.shape}")
    n = rewards.shape[1]
    # Shift by the group's first reward first: the result is the same, but an all-equal group becomes exactly 0
    # (float32 mean of [0.7] * 3 is not exactly 0.7, and grpo would blow that rounding up by 1/eps).
    r = rewards.astype(jnp.float32)
    r = r - r[:, :1]
    centred = r - jnp.mean(r, axis=1, keepdims=True)
    if kind == "grpo":
        return centred / (jnp.std(r, axis=1, keepdims=True) + eps)  # jnp.std is ddof=0
    if kind == "drgrpo":
        return centred
    if n < 2:
        raise ValueError(f"rloo needs at least 2 samples per prompt (the leave-one-out baseline), got n={n}")
    return centred * (n / (n - 1))
