"""Loss aggregation, KL estimators, the clipped surrogate and entropy, against hand arithmetic."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax import config
from fp8rl_jax.model.heads import entropy_from_logits
from fp8rl_jax.rl.losses import AGGREGATIONS, KL_ESTIMATORS, aggregate, kl_penalty, policy_loss

LN2 = math.log(2.0)


def test_names_match_config():
    assert tuple(AGGREGATIONS) == tuple(config.LOSS_AGGS)
    assert tuple(KL_ESTIMATORS) == tuple(config.KL_ESTIMATORS)


# ----------------------------------------------------------------------------------------------------------
# aggregate

# valid tokens: row 0 -> 1, 2; row 1 -> 4; row 2 -> none. Masked slots hold garbage that must not leak.
PER_TOKEN = jnp.array([[1.0, 2.0, jnp.inf], [4.0, jnp.nan, -1e9], [7.0, 7.0, 7.0]])
MASK = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("kind, want", [
    ("token_mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
    ("seq_mean_token_mean", (1.5 + 4.0 + 0.0) / 3),  # row means 3/2, 4/1, empty row 0; 3 sequences
    ("seq_mean_token_sum", (3.0 + 4.0 + 0.0) / 3),  # row sums 3, 4, 0; 3 sequences
    ("seq_mean_token_sum_norm", (3.0 + 4.0 + 0.0) / (3 * 3)),  # the same, / the constant (default: T = 3)
])
def test_aggregate_ragged_mask(kind, want):
    np.testing.assert_allclose(aggregate(PER_TOKEN, MASK, kind), want, rtol=1e-6)


def test_seq_mean_token_sum_norm_by_hand():
    # Dr. GRPO: each sequence's token sum over a constant (rl.loss_agg_norm, default rollout.max_new_tokens), averaged
    # over sequences: row sums 3, 4, 0 -> (3 + 4 + 0) / (3 sequences * 8); and per token in policy_loss: ratio 1.5
    # clipped to 1.3 (A = 1) on 2 tokens of one sequence and 1 of another, over 2 sequences * 10
    np.testing.assert_allclose(aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", norm=8), 7 / 24, rtol=1e-6)
    np.testing.assert_allclose(aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", norm=8, num_sequences=5),
                               7 / 40, rtol=1e-6)
    loss, _ = policy_loss(jnp.log(jnp.full((2, 3), 1.5)), jnp.zeros((2, 3)), jnp.ones(2),
                          jnp.array([[1, 1, 0], [1, 0, 0]]), clip_low=0.2, clip_high=0.3,
                          loss_agg="seq_mean_token_sum_norm", loss_agg_norm=10)
    np.testing.assert_allclose(loss, -1.3 * 3 / 20, rtol=1e-6)
    # the constant does not depend on the lengths: a sequence twice as long counts twice as much (no length bias),
    # unlike seq_mean_token_mean, which gives both the same weight
    one = jnp.ones((2, 4))
    mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_allclose(aggregate(one, mask, "seq_mean_token_sum_norm", norm=4), (2 + 4) / 8, rtol=1e-6)
    np.testing.assert_allclose(aggregate(one, mask, "seq_mean_token_mean"), 1.0, rtol=1e-6)


def test_seq_mean_token_sum_norm_needs_a_positive_constant():
    with pytest.raises(ValueError, match="norm"):
        aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", norm=0)


def test_loss_agg_norm_reaches_the_loss_config():
    from fp8rl_jax.plan import loss_config

    c = config.base_config()
    c.rl.loss_agg = "seq_mean_token_sum_norm"
    config.validate(c)
    assert c.rl.loss_agg_norm == 0 and loss_config(c).loss_agg_norm == c.rollout.max_new_tokens
    c.rl.loss_agg_norm = 1024.0
    config.validate(c)
    assert loss_config(c).loss_agg_norm == 1024.0
    c.rl.loss_agg_norm = -1.0
    with pytest.raises(config.ConfigError, match=r"config\.rl\.loss_agg_norm=-1\.0"):
        config.validate(c)


def test_aggregate_all_masked_is_zero_not_nan():
    for kind in AGGREGATIONS:
        assert float(aggregate(jnp.ones((2, 3)), jnp.zeros((2, 3)), kind)) == 0.0


def test_aggregate_unknown_kind():
    with pytest.raises(ValueError, match=r"'mean'.*token_mean"):
        aggregate(PER_TOKEN, MASK, "mean")


@pytest.mark.parametrize("kind", AGGREGATIONS)
def test_microbatches_with_global_normalisers_sum_to_full_batch(kind):
    rng = np.random.default_rng(1)
    per_token = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    # ragged, and the halves hold different token counts (7 vs 3), so local normalisers would not do
    mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    full = aggregate(per_token, mask, kind)
    total_tokens, total_sequences = jnp.sum(mask), 4
    parts = [aggregate(per_token[s], mask[s], kind, num_tokens=total_tokens, num_sequences=total_sequences)
             for s in (slice(0, 2), slice(2, 4))]
    np.testing.assert_allclose(parts[0] + parts[1], full, rtol=1e-6)
    # and the property needs the global values: each half's own normalisers give a different sum
    local = aggregate(per_token[:2], mask[:2], kind) + aggregate(per_token[2:], mask[2:], kind)
    assert abs(float(local) - float(full)) > 1e-3


def test_policy_loss_microbatches_sum_to_full_batch_gradient():
    rng = np.random.default_rng(2)
    logp = jnp.asarray(rng.normal(scale=0.3, size=(4, 3)) - 1.0, jnp.float32)
    old = jnp.asarray(rng.normal(scale=0.3, size=(4, 3)) - 1.0, jnp.float32)
    adv = jnp.array([1.0, -0.5, 2.0, -1.0])
    mask = jnp.array([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])

    def loss(lp, sl, **kw):
        return policy_loss(lp, old[sl], adv[sl], mask[sl], clip_low=0.2, clip_high=0.28, loss_agg="token_mean",
                           **kw)[0]

    everything = slice(0, 4)
    g_full = jax.grad(lambda lp: loss(lp, everything))(logp)
    g_parts = [jax.grad(lambda lp, s=s: loss(lp, s, num_tokens=jnp.sum(mask), num_sequences=4))(logp[s])
               for s in (slice(0, 1), slice(1, 4))]
    np.testing.assert_allclose(jnp.concatenate(g_parts), g_full, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# KL


def test_kl_estimators_by_hand():
    logp = jnp.log(jnp.array([0.5, 0.25, 0.3]))
    ref = jnp.log(jnp.array([0.25, 0.5, 0.3]))
    # k1 = log(pi/ref): log 2, -log 2, 0
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), [LN2, -LN2, 0.0], atol=1e-6)
    # k3 = ref/pi - log(ref/pi) - 1: .5 + ln2 - 1 = ln2 - .5; 2 - ln2 - 1 = 1 - ln2; 1 - 0 - 1 = 0
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), [LN2 - 0.5, 1 - LN2, 0.0], atol=1e-6)


def test_kl_estimators_are_unbiased_over_the_whole_support():
    # pi = [.5, .5], ref = [.25, .75]: KL = .5 ln 2 + .5 ln(2/3); E_pi[k] summed exactly over both tokens
    pi, ref = np.array([0.5, 0.5]), np.array([0.25, 0.75])
    kl = 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)
    for est in KL_ESTIMATORS:
        k = kl_penalty(jnp.log(jnp.asarray(pi, jnp.float32)), jnp.log(jnp.asarray(ref, jnp.float32)), est)
        np.testing.assert_allclose(float(np.sum(pi * np.asarray(k))), kl, rtol=1e-5)


def test_k3_is_clamped_as_veRL_and_NeMo_RL_do():
    # the log-ratio x = ref - logp is clamped to [-20, 20] before the exp and the value to [-10, 10]: at x = 25 the
    # unclamped k3 is exp(25) - 26 = 7.2e10, clamped 10; at x = -25 it is 24, clamped 10; x = 2.6 stays (9.86)
    logp = jnp.array([0.0, 25.0, 0.0, 0.0])
    ref = jnp.array([25.0, 0.0, 2.6, 0.0])
    k3 = kl_penalty(logp, ref, "k3")
    assert np.all(np.isfinite(k3))
    np.testing.assert_array_equal(k3[:2], [10.0, 10.0])
    np.testing.assert_allclose(k3[2], math.exp(2.6) - 3.6, rtol=1e-6)
    assert float(k3[3]) == 0.0
    # and the clamp costs the gradient where it applies: d k3 / d logp = 1 - exp(x) inside, 0 where clamped
    grad = jax.grad(lambda lp: jnp.sum(kl_penalty(lp, ref, "k3")))(logp)
    np.testing.assert_allclose(grad, [0.0, 0.0, 1 - math.exp(2.6), 0.0], rtol=1e-6)


def test_k3_unchanged_at_small_differences():
    # inside the clamps the estimator is today's formula to the bit, value and gradient
    rng = np.random.default_rng(4)
    logp = jnp.asarray(rng.normal(size=(6, 7)) - 2.0, jnp.float32)
    ref = jnp.asarray(logp + rng.normal(scale=0.5, size=(6, 7)), jnp.float32)

    def unclamped(lp):
        x = ref - lp
        return jnp.expm1(x) - x

    np.testing.assert_array_equal(kl_penalty(logp, ref, "k3"), unclamped(logp))
    np.testing.assert_array_equal(jax.grad(lambda lp: jnp.sum(kl_penalty(lp, ref, "k3")))(logp),
                                  jax.grad(lambda lp: jnp.sum(unclamped(lp)))(logp))


def test_kl_term_of_the_loss_is_finite_far_from_the_reference():
    # ratio 1 and A = 0: the loss is the KL term alone; ref - logp = 25 gives kl_coef * 10, and no gradient
    def f(logp):
        return policy_loss(logp, jax.lax.stop_gradient(logp), jnp.zeros(1), jnp.ones((1, 1)), clip_low=0.2,
                           clip_high=0.2, loss_agg="token_mean", ref_logp=jnp.array([[0.0]]), kl_coef=0.1)

    loss, m = f(jnp.array([[-25.0]]))
    np.testing.assert_allclose(loss, 1.0, rtol=1e-6)
    np.testing.assert_allclose(m["kl"], 10.0, rtol=1e-6)
    assert float(jax.grad(lambda lp: f(lp)[0])(jnp.array([[-25.0]]))[0, 0]) == 0.0


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="k2"):
        kl_penalty(jnp.zeros(2), jnp.zeros(2), "k2")


# ----------------------------------------------------------------------------------------------------------
# policy loss


def _one_token(ratio, adv, clip_low=0.2, clip_high=0.3, **kw):
    return policy_loss(jnp.log(jnp.array([[ratio]])), jnp.zeros((1, 1)), jnp.array([adv]), jnp.ones((1, 1)),
                       clip_low=clip_low, clip_high=clip_high, loss_agg="token_mean", **kw)


# clip range [1 - 0.2, 1 + 0.3] = [0.8, 1.3]; loss = -min(ratio * A, clip(ratio) * A)
@pytest.mark.parametrize("ratio, adv, want, clipped", [
    (1.5, 1.0, -1.3, True),  # A > 0, ratio above: -min(1.5, 1.3)
    (0.5, 1.0, -0.5, False),  # A > 0, ratio below: -min(.5, .8), the pessimistic unclipped term
    (1.5, -1.0, 1.5, False),  # A < 0, ratio above: -min(-1.5, -1.3)
    (0.5, -1.0, 0.8, True),  # A < 0, ratio below: -min(-.5, -.8)
    (1.25, 1.0, -1.25, False),  # inside clip_high=.3, would be clipped to 1.2 with a symmetric .2
    (0.75, -1.0, 0.8, True),  # outside clip_low=.2, would be inside with a symmetric .3
    (1.5, 0.0, 0.0, False),  # A = 0: both terms 0, nothing counts as clipped
])
def test_clip_branches(ratio, adv, want, clipped):
    loss, metrics = _one_token(ratio, adv)
    np.testing.assert_allclose(loss, want, rtol=1e-6, atol=1e-7)
    assert float(metrics["clip_fraction"]) == float(clipped)


def test_metrics_over_a_batch():
    ratios = jnp.array([[1.5, 0.5, 1.5], [0.5, 1.25, 0.75]])
    adv = jnp.array([1.0, -1.0])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    loss, m = policy_loss(jnp.log(ratios), jnp.zeros((2, 3)), adv, mask, clip_low=0.2, clip_high=0.3,
                          loss_agg="token_mean")
    # row 0 (A=+1): -1.3 (clipped), -0.5, -1.3 (clipped); row 1 (A=-1): 0.8 (clipped), 1.25; third masked
    per_token = [-1.3, -0.5, -1.3, 0.8, 1.25]
    np.testing.assert_allclose(loss, sum(per_token) / 5, rtol=1e-5)
    np.testing.assert_allclose(m["pg_loss"], sum(per_token) / 5, rtol=1e-5)
    np.testing.assert_allclose(m["clip_fraction"], 3 / 5, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_mean"], (1.5 + 0.5 + 1.5 + 0.5 + 1.25) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_max"], 1.5, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_min"], 0.5, rtol=1e-6)
    assert "kl" not in m


def test_is_weights_scale_the_pg_term_and_get_no_gradient():
    # ratio .5, A=1 -> per-token -.5, times IS weight 2 -> -1
    def f(w):
        return policy_loss(jnp.log(jnp.array([[0.5]])), jnp.zeros((1, 1)), jnp.ones(1), jnp.ones((1, 1)),
                           clip_low=0.2, clip_high=0.2, loss_agg="token_mean", is_weights=w)[0]

    np.testing.assert_allclose(f(jnp.array([[2.0]])), -1.0, rtol=1e-6)
    assert float(jax.grad(f)(jnp.array([[2.0]]))[0, 0]) == 0.0


@pytest.mark.parametrize("est, kl_value", [("k3", LN2 - 0.5), ("k1", LN2)])
def test_kl_term(est, kl_value):
    # ratio 1 and A = 0: pg term 0; pi = .5, ref = .25 -> k1 = ln 2, k3 = ln 2 - .5 (see above); coef .1
    logp = jnp.log(jnp.array([[0.5]]))
    args = (logp, logp, jnp.zeros(1), jnp.ones((1, 1)))
    kw = dict(clip_low=0.2, clip_high=0.2, loss_agg="token_mean", ref_logp=jnp.log(jnp.array([[0.25]])),
              kl_estimator=est)
    loss, m = policy_loss(*args, kl_coef=0.1, **kw)
    np.testing.assert_allclose(loss, 0.1 * kl_value, rtol=1e-5)
    np.testing.assert_allclose(m["kl"], kl_value, rtol=1e-5)
    loss_off, m_off = policy_loss(*args, kl_coef=0.0, **kw)
    assert float(loss_off) == 0.0 and "kl" not in m_off


# ----------------------------------------------------------------------------------------------------------
# dual-clip (rl.clip_ratio_c)


def _dual_clip_reference(logp, old, adv, mask, w, clip_low, clip_high, c):
    """float64 numpy: per token l = max(-A r, -A clip(r)), then min(l, -A c) where A < 0, times the IS weight w;
    token_mean. Also d loss / d logp by hand: -A r w / N where the unclipped term -A r is the one chosen, else 0."""
    r = np.exp(logp - old)
    a = adv[:, None] * np.ones_like(r)
    l1, l2 = -a * r, -a * np.clip(r, 1 - clip_low, 1 + clip_high)
    per = np.maximum(l1, l2)
    dual = (a < 0) & (per > -a * c)
    per = np.where(dual, -a * c, per)
    n = mask.sum()
    unclipped_chosen = (l1 >= l2) & ~dual
    grad = np.where(mask & unclipped_chosen, -a * r * w, 0.0) / n
    return np.sum(np.where(mask, per * w, 0.0)) / n, grad, dual


def test_dual_clip_against_numpy_reference():
    rng = np.random.default_rng(5)
    shape = (6, 9)
    old = rng.normal(size=shape) - 2.0
    logp = old + rng.normal(scale=1.0, size=shape)  # ratios from ~0.05 to ~20
    adv = rng.normal(size=shape[0])
    adv[:3] = -np.abs(adv[:3])  # several negative advantages
    mask = rng.random(shape) < 0.8
    w = rng.uniform(0.5, 2.0, size=shape)
    ref_loss, ref_grad, dual = _dual_clip_reference(logp, old, adv, mask, w, 0.2, 0.28, 3.0)
    assert np.sum(dual & mask) >= 3  # the case under test: ratio > c with A < 0

    def f(lp):
        return policy_loss(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.asarray(mask),
                           clip_low=0.2, clip_high=0.28, loss_agg="token_mean", clip_ratio_c=3.0,
                           is_weights=jnp.asarray(w, jnp.float32))

    lp = jnp.asarray(logp, jnp.float32)
    loss, m = f(lp)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(m["dual_clip_fraction"], np.sum(dual & mask) / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: f(x)[0])(lp), ref_grad, rtol=1e-5, atol=1e-8)
    # without the dual clip the loss differs (the bound is what is tested)
    off, m_off = policy_loss(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.asarray(mask),
                             clip_low=0.2, clip_high=0.28, loss_agg="token_mean",
                             is_weights=jnp.asarray(w, jnp.float32))
    assert float(off) > float(loss) + 1e-3 and "dual_clip_fraction" not in m_off


@pytest.mark.parametrize("ratio, adv, want, dual", [
    (5.0, -1.0, 3.0, True),  # A < 0, ratio above c = 3: -A r = 5 bounded by -A c = 3 (no gradient)
    (2.0, -1.0, 2.0, False),  # A < 0, ratio below c: the clipped surrogate, -min(-2, -1.3) = 2
    (5.0, -2.0, 6.0, True),  # the bound scales with A: -A c = 6
    (5.0, 1.0, -1.3, False),  # A > 0: untouched (clip_high .3)
])
def test_dual_clip_one_token(ratio, adv, want, dual):
    loss, m = _one_token(ratio, adv, clip_ratio_c=3.0)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert float(m["dual_clip_fraction"]) == float(dual)


def test_dual_clip_off_by_default_is_todays_loss_bit_for_bit():
    rng = np.random.default_rng(6)
    old = jnp.asarray(rng.normal(size=(5, 8)) - 2.0, jnp.float32)
    logp = old + jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=5), jnp.float32)
    mask = jnp.asarray(rng.random((5, 8)) < 0.8)

    def today(lp):  # the surrogate as it was before rl.clip_ratio_c existed
        ratio = jnp.exp(jnp.where(mask, lp, 0.0) - jnp.where(mask, old, 0.0))
        a = jnp.where(mask, adv[:, None], 0.0)
        pg = -jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.28) * a)
        return jnp.sum(jnp.where(mask, pg, 0.0)) / jnp.sum(mask)

    for kw in ({}, {"clip_ratio_c": 0.0}):
        def f(lp, kw=kw):
            return policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, loss_agg="token_mean", **kw)[0]

        assert float(f(logp)) == float(today(logp))
        np.testing.assert_array_equal(jax.grad(f)(logp), jax.grad(today)(logp))


def test_clip_ratio_c_reaches_the_loss_config():
    from fp8rl_jax.plan import loss_config

    c = config.base_config()
    assert c.rl.clip_ratio_c == 0.0 and loss_config(c).clip_ratio_c == 0.0
    c.rl.clip_ratio_c = 3.0
    config.validate(c)
    assert loss_config(c).clip_ratio_c == 3.0


@pytest.mark.parametrize("value", [1.0, 0.5, -3.0])
def test_clip_ratio_c_is_zero_or_above_one(value):
    c = config.base_config()
    c.rl.clip_ratio_c = value
    with pytest.raises(config.ConfigError, match=r"config\.rl\.clip_ratio_c=.*0 \(off\) or > 1"):
        config.validate(c)


def test_policy_loss_rejects_bad_estimator_even_with_kl_off():
    with pytest.raises(ValueError, match="k2"):
        _one_token(1.0, 1.0, kl_estimator="k2")


def test_gradient_by_hand():
    # one sequence, A = 2, token_mean over 2 tokens, clip .2:
    # token 0: ratio 1, unclipped -> dL/dlogp = -A * ratio / 2 = -1
    # token 1: ratio e^.5 = 1.65 > 1.2, clipped branch is a constant -> 0
    # loss = (-2 * 1 - 2 * 1.2) / 2 = -2.2
    def f(logp):
        return policy_loss(logp, jnp.zeros((1, 2)), jnp.array([2.0]), jnp.ones((1, 2)), clip_low=0.2,
                           clip_high=0.2, loss_agg="token_mean")[0]

    logp = jnp.array([[0.0, 0.5]])
    np.testing.assert_allclose(f(logp), -2.2, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(logp), [[-1.0, 0.0]], atol=1e-7)


def test_masked_garbage_never_leaks_into_loss_or_gradient():
    # the gradient example above plus a padded third token full of garbage; KL on with ref = logp (k3 = 0, and
    # its gradient -exp(ref - logp) + 1 = 0 too), so the loss stays -2.2 and the gradient [-1, 0, 0]
    mask = jnp.array([[1, 1, 0]])
    old = jnp.array([[0.0, 0.0, -jnp.inf]])
    ref = jnp.array([[0.0, 0.5, jnp.nan]])
    isw = jnp.array([[1.0, 1.0, jnp.inf]])

    def f(logp):
        return policy_loss(logp, old, jnp.array([2.0]), mask, clip_low=0.2, clip_high=0.2, loss_agg="token_mean",
                           is_weights=isw, ref_logp=ref, kl_coef=0.1)

    logp = jnp.array([[0.0, 0.5, 1e9]])
    loss, m = f(logp)
    np.testing.assert_allclose(loss, -2.2, rtol=1e-6)
    assert all(np.isfinite(float(v)) for v in m.values())
    np.testing.assert_allclose(m["ratio_max"], math.exp(0.5), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda lp: f(lp)[0])(logp), [[-1.0, 0.0, 0.0]], atol=1e-7)


def test_policy_loss_jits_with_static_options():
    fn = jax.jit(policy_loss, static_argnames=("clip_low", "clip_high", "loss_agg"))
    loss, _ = fn(jnp.log(jnp.array([[1.5]])), jnp.zeros((1, 1)), jnp.ones(1), jnp.ones((1, 1)), clip_low=0.2,
                 clip_high=0.3, loss_agg="seq_mean_token_sum")
    np.testing.assert_allclose(loss, -1.3, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# entropy


def test_entropy_by_hand():
    logits = jnp.array([
        [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
        [0.0, -jnp.inf, -jnp.inf, 0.0],  # two banned tokens: uniform over 2, ln 2
        [1e4, 0.0, 0.0, 0.0],  # one token takes all the mass: 0 (and no overflow)
        [0.0, math.log(3.0), -jnp.inf, -jnp.inf],  # p = [.25, .75]: .25 ln 4 + .75 ln(4/3)
    ], jnp.bfloat16)
    h = entropy_from_logits(logits)
    assert h.dtype == jnp.float32
    want = [math.log(4), LN2, 0.0, 0.25 * math.log(4) + 0.75 * math.log(4 / 3)]
    np.testing.assert_allclose(h, want, atol=2e-3)  # ln 3 rounds to bfloat16


def test_entropy_gradient_finite_with_banned_tokens():
    g = jax.grad(lambda x: jnp.sum(entropy_from_logits(x)))(jnp.array([[0.0, -jnp.inf, 1.0]]))
    assert np.all(np.isfinite(g))
