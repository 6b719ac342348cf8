"""IS correction weights and their metrics, against hand arithmetic."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax import config
from fp8rl_jax.rl.importance import KINDS, is_weights

# Per-token ratios r = exp(old - rollout) on 8 valid tokens; (1, 2) is padding holding garbage logprobs.
#   row 0: [1, 3, .6]     product 1.8,  geometric mean 1.8^(1/3) = 1.216
#   row 1: [1.5, 10, pad] product 15,   geometric mean sqrt(15) = 3.873
#   row 2: [.2, .2, .2]   product .008, geometric mean .2
RATIOS = np.array([[1.0, 3.0, 0.6], [1.5, 10.0, 1.0], [0.2, 0.2, 0.2]])
MASK = jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
ROLLOUT = jnp.full((3, 3), -1.3).at[1, 2].set(-jnp.inf)
OLD = (ROLLOUT + jnp.log(jnp.asarray(RATIOS, jnp.float32))).at[1, 2].set(1e9)
KW = dict(cap=2.0, low=0.5, high=2.0)


def test_kinds_match_config():
    assert tuple(KINDS) == tuple(config.IS_CORRECTIONS)


@pytest.mark.parametrize("kind, want, mean, mx, clipped, masked", [
    ("none", [[1, 1, 1], [1, 1, 0], [1, 1, 1]], 1.0, 1.0, 0.0, 0.0),
    # min(r, 2): 3 -> 2 and 10 -> 2 truncated (2 of 8); sum 3.6 + 3.5 + .6 = 7.7
    ("tis", [[1, 2, 0.6], [1.5, 2, 0], [0.2, 0.2, 0.2]], 7.7 / 8, 2.0, 2 / 8, 0.0),
    # min(product, 2) on every token: 1.8 (kept), 15 -> 2 (2 tokens truncated), .008; sum 5.4 + 4 + .024
    ("seq_tis", [[1.8] * 3, [2, 2, 0], [0.008] * 3], 9.424 / 8, 2.0, 2 / 8, 0.0),
    # geometric means 1.216 (kept), 3.873 > 2 and .2 < .5 (rejected: 5 tokens); kept row gets min(r, 2),
    # 3 -> 2 truncated (1 token); sum 1 + 2 + .6 = 3.6
    ("mis", [[1, 2, 0.6], [0, 0, 0], [0, 0, 0]], 3.6 / 8, 2.0, 1 / 8, 5 / 8),
    # r kept where .5 <= r <= 2: 3, 10 and the three .2 are dropped (5 tokens); sum 1 + .6 + 1.5 = 3.1
    ("icepop", [[1, 0, 0.6], [1.5, 0, 0], [0, 0, 0]], 3.1 / 8, 1.5, 0.0, 5 / 8),
])
def test_weights_and_metrics_by_hand(kind, want, mean, mx, clipped, masked):
    w, m = is_weights(OLD, ROLLOUT, MASK, kind, **KW)
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["is_weight_mean"], mean, rtol=1e-5)
    np.testing.assert_allclose(m["is_weight_max"], mx, rtol=1e-5)
    np.testing.assert_allclose(m["is_clipped_fraction"], clipped, atol=1e-7)
    np.testing.assert_allclose(m["is_masked_fraction"], masked, atol=1e-7)


@pytest.mark.parametrize("per_token_log_ratio, want", [
    (0.01, 2.0),  # sum 20: e^20 = 4.9e8 > cap -> exactly cap
    (0.1, 2.0),  # sum 200: e^200 overflows float32 -> still exactly cap, no inf
    (-0.1, 0.0),  # sum -200: e^-200 = 1.4e-87 underflows float32 to 0, no NaN
])
def test_seq_tis_long_sequence_does_not_overflow(per_token_log_ratio, want):
    t = 2000
    rollout = jnp.full((1, t), -2.0)
    old = rollout + per_token_log_ratio
    w, m = is_weights(old, rollout, jnp.ones((1, t)), "seq_tis", cap=2.0)
    assert np.all(np.isfinite(np.asarray(w))) and all(np.isfinite(float(v)) for v in m.values())
    assert np.all(np.asarray(w) == want)


def test_mis_rejects_long_sequence_by_geometric_mean_only():
    # per-token ratio e^.05 = 1.05 over 2000 tokens: the product e^100 is huge, the geometric mean 1.05 is in
    # [.5, 2], so the sequence is kept with token weights 1.05
    t = 2000
    rollout = jnp.full((1, t), -2.0)
    w, m = is_weights(rollout + 0.05, rollout, jnp.ones((1, t)), "mis", **KW)
    np.testing.assert_allclose(w, math.exp(0.05), rtol=1e-5)
    assert float(m["is_masked_fraction"]) == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_weights_are_constants(kind):
    grad = jax.grad(lambda old: jnp.sum(is_weights(old, ROLLOUT, MASK, kind, **KW)[0]))(OLD)
    assert np.all(np.asarray(grad) == 0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_jits_with_static_kind(kind):
    fn = jax.jit(is_weights, static_argnames=("kind", "cap", "low", "high"))
    w, _ = fn(OLD, ROLLOUT, MASK, kind=kind, **KW)
    assert float(w[1, 2]) == 0.0 and np.all(np.isfinite(np.asarray(w)))


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"'ppo_is'.*none \| tis"):
        is_weights(OLD, ROLLOUT, MASK, "ppo_is")


# FP8-sized mismatch: per-token log-ratios around 1e-3 nats. Three sequences of 4 tokens whose mean log-ratios
# are +3e-3 (rho = e^.003 = 1.0030 > 1.002), -5e-4 (rho = 0.9995, inside) and -1.5e-3 (rho = 0.9985 < 0.999).
FP8_LOG_RATIOS = np.array([[0.004, 0.002, 0.001, 0.005], [0.001, -0.002, 0.0, -0.001],
                           [-0.003, 0.0, -0.002, -0.001]])


def test_default_mis_band_rejects_fp8_sized_sequence_mismatch():
    rollout = jnp.full((3, 4), -1.0)
    old = rollout + jnp.asarray(FP8_LOG_RATIOS, jnp.float32)
    mask = jnp.ones((3, 4))
    w, m = is_weights(old, rollout, mask, "mis")  # default band MIS_BAND = [0.999, 1.002]
    np.testing.assert_allclose(w[0], 0.0)
    np.testing.assert_allclose(w[1], np.exp(FP8_LOG_RATIOS[1]), rtol=1e-6)  # kept: token weights r_t (< cap)
    np.testing.assert_allclose(w[2], 0.0)
    np.testing.assert_allclose(m["is_masked_fraction"], 8 / 12, rtol=1e-6)
    # the former shared band [0.5, 2] keeps everything at this mismatch level
    _, wide = is_weights(old, rollout, mask, "mis", low=0.5, high=2.0)
    assert float(wide["is_masked_fraction"]) == 0.0


def test_default_icepop_band_is_half_to_five():
    # per-token ratios: 0.4 and 6 leave [0.5, 5]; 0.5, 4 and 5 stay (4 would be dropped by [0.5, 2])
    ratios = jnp.asarray([[0.4, 0.5, 4.0, 5.0, 6.0]])
    rollout = jnp.full((1, 5), -2.0)
    w, m = is_weights(rollout + jnp.log(ratios), rollout, jnp.ones((1, 5)), "icepop")
    np.testing.assert_allclose(w, [[0.0, 0.5, 4.0, 5.0, 0.0]], rtol=1e-5)
    np.testing.assert_allclose(m["is_masked_fraction"], 2 / 5, rtol=1e-6)


def test_config_bands_are_the_documented_defaults_and_reach_the_loss():
    from fp8rl_jax.plan import loss_config
    from fp8rl_jax.rl.importance import ICEPOP_BAND, MIS_BAND

    c = config.base_config()
    assert (c.rl.mis_low, c.rl.mis_high) == MIS_BAND == (0.999, 1.002)
    assert (c.rl.icepop_low, c.rl.icepop_high) == ICEPOP_BAND == (0.5, 5.0)
    with c.unlocked():
        c.rl.mis_low, c.rl.mis_high, c.rl.icepop_low, c.rl.icepop_high = 0.99, 1.01, 0.25, 8.0
        c.rl.is_correction = "mis"
        assert loss_config(c).is_band == (0.99, 1.01)
        c.rl.is_correction = "icepop"
        assert loss_config(c).is_band == (0.25, 8.0)


@pytest.mark.parametrize("key, value", [("top_p", 0.9), ("top_k", 50)])
def test_training_refuses_truncated_sampling(key, value):
    c = config.base_config()
    c.rollout[key] = value
    with pytest.raises(config.ConfigError, match=rf"config\.rollout\.{key}={value}.*untruncated.*importance weights"):
        config.validate(c)
    config.validate(c, training=False)  # serving / display sampling may truncate


@pytest.mark.parametrize("key, value", [("mis_low", 1.0), ("mis_high", 0.9995), ("icepop_low", -0.1),
                                        ("icepop_high", 1.0)])
def test_bad_bands_are_named(key, value):
    c = config.base_config()
    c.rl[key] = value
    band = key.split("_")[0]
    with pytest.raises(config.ConfigError, match=rf"config\.rl\.{band}_low/rl\.{band}_high"):
        config.validate(c)
