"""Mismatch metrics and masked reductions, against hand arithmetic and a float64 numpy re-derivation."""

import math

import jax.numpy as jnp
import numpy as np

from fp8rl_jax.rl.metrics import masked_max, masked_mean, masked_min, mismatch_metrics, reduce_metric

LN2 = math.log(2.0)


def test_masked_reductions_ignore_garbage_and_handle_empty_masks():
    x = jnp.array([[1.0, 5.0, jnp.inf], [-2.0, jnp.nan, 1e9]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_allclose(masked_mean(x, mask), (1 + 5 - 2) / 3, rtol=1e-6)
    assert float(masked_max(x, mask)) == 5.0
    assert float(masked_max(jnp.array([-3.0, -1.0]), jnp.array([1, 1]))) == -1.0  # negative values still work
    assert float(masked_mean(x, jnp.zeros_like(mask))) == 0.0
    assert float(masked_max(x, jnp.zeros_like(mask))) == 0.0


def test_identical_logprobs():
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.exponential(size=(3, 5)), jnp.float32)
    mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    # different garbage in each input at the padding must not matter
    rollout = jnp.where(mask == 1, logp, -jnp.inf)
    train = jnp.where(mask == 1, logp, 1e9)
    m = mismatch_metrics(rollout, train, mask)
    assert float(m["mismatch_kl_k1"]) == 0.0
    assert float(m["mismatch_kl_k3"]) == 0.0
    assert float(m["mean_abs_dprob"]) == 0.0
    assert float(m["token_mult_prob_error"]) == 1.0
    assert float(m["ppl_ratio"]) == 1.0
    assert float(m["chi2"]) == 0.0


def test_hand_computed_pair():
    # token 0: rollout .5, train .25 -> d = train - rollout = -ln 2; token 1: both .5 -> d = 0; token 2 padding
    rollout = jnp.log(jnp.array([[0.5, 0.5, 0.0]]))  # log 0 = -inf at the padding
    train = jnp.array([[math.log(0.25), math.log(0.5), 1e9]])
    m = mismatch_metrics(rollout, train, jnp.array([[1, 1, 0]]))
    want = {
        "mismatch_kl_k1": (LN2 + 0) / 2,  # mean(rollout - train)
        "mismatch_kl_k3": ((0.5 + LN2 - 1) + 0) / 2,  # exp(-ln2) - (-ln2) - 1 = ln2 - .5
        "mean_abs_dprob": (0.25 + 0) / 2,  # |.5 - .25|
        "token_mult_prob_error": (2 + 1) / 2,  # exp(|d|) = 2, 1
        # train ppl exp(-(ln .25 + ln .5)/2) = exp(ln 8 / 2) = sqrt 8; rollout ppl exp(ln 2) = 2
        "ppl_ratio": math.sqrt(8) / 2,
        "chi2": (0.25 + 1) / 2 - 1,  # exp(d)^2 = 1/4, 1
    }
    assert set(m) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(m[key], value, rtol=1e-6, err_msg=key)


def test_against_float64_numpy():
    rng = np.random.default_rng(3)
    rollout = -rng.exponential(size=(4, 6))
    train = rollout + rng.normal(scale=0.2, size=(4, 6))
    mask = rng.random((4, 6)) < 0.7
    m = mismatch_metrics(jnp.asarray(rollout, jnp.float32), jnp.asarray(train, jnp.float32), jnp.asarray(mask))
    r, t = rollout[mask], train[mask]
    p_r, p_t = np.exp(r), np.exp(t)
    want = {
        "mismatch_kl_k1": np.mean(np.log(p_r / p_t)),
        "mismatch_kl_k3": np.mean(p_t / p_r - np.log(p_t / p_r) - 1),
        "mean_abs_dprob": np.mean(np.abs(p_r - p_t)),
        "token_mult_prob_error": np.mean(np.maximum(p_r / p_t, p_t / p_r)),
        "ppl_ratio": np.prod(p_t) ** (-1 / t.size) / np.prod(p_r) ** (-1 / r.size),
        "chi2": np.mean((p_t / p_r) ** 2) - 1,
    }
    for key, value in want.items():
        np.testing.assert_allclose(m[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


def test_masked_min_and_metric_reduction_by_name():
    x = jnp.array([[1.0, -5.0, -jnp.inf], [2.0, jnp.nan, -1e9]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    assert float(masked_min(x, mask)) == -5.0
    assert float(masked_min(x, jnp.zeros_like(mask))) == 0.0
    per_batch = [1.5, 1.25, 1.375]  # exact in f32
    assert float(reduce_metric("ratio_max", per_batch)) == 1.5
    assert float(reduce_metric("ratio_min", per_batch)) == 1.25
    np.testing.assert_allclose(reduce_metric("ratio_mean", per_batch), 4.125 / 3, rtol=1e-6)
    np.testing.assert_allclose(reduce_metric("is_weight_max", jnp.asarray([[1.0, 3.0], [2.0, 0.5]])), [2.0, 3.0])


def test_k3_metric_is_finite_far_from_agreement():
    # d = train - rollout = 25 and 100: exp(d) is 7.2e10 and inf in f32. The metric clamps d to [-20, 20] before the
    # exp (veRL's bound for its chi2), so each token counts expm1(20) - 20 = 4.85e8, finite; no value clamp (a metric)
    rollout = jnp.array([[-30.0, -101.0, -1.0]])
    train = jnp.array([[-5.0, -1.0, -1.0]])
    m = mismatch_metrics(rollout, train, jnp.ones((1, 3)))
    want = 2 * (math.expm1(20.0) - 20.0) / 3
    np.testing.assert_allclose(m["mismatch_kl_k3"], want, rtol=1e-6)



def test_chi2_is_finite_beyond_the_f32_range_of_exp_2d():
    # d = 50 (and -50, 0.1): exp(2d) = exp(100) is inf in f32 (from |d| > 44.4); as veRL does, d is clamped to
    # [-20, 20] before the exp, so that token counts exp(40) - 1 = 2.4e17; small d are unchanged
    rollout = jnp.array([[-51.0, -1.0, -1.1]])
    train = jnp.array([[-1.0, -51.0, -1.0]])
    m = mismatch_metrics(rollout, train, jnp.ones((1, 3)))
    want = (math.expm1(40.0) + math.expm1(-40.0) + math.expm1(2 * (-1.0 + 1.1))) / 3
    np.testing.assert_allclose(m["chi2"], want, rtol=1e-6)
