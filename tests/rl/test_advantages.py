"""Group advantages against hand arithmetic and a leave-one-out loop in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax import config
from fp8rl_jax.rl.advantages import KINDS, group_advantages


def test_kinds_match_config():
    assert tuple(KINDS) == tuple(config.ADVANTAGES)


def test_grpo_binary_group():
    # rewards [1,0,0,1]: mean .5, population std .5 -> [1,-1,-1,1] (eps=1e-6 moves it by ~2e-6)
    adv = group_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0]]), "grpo")
    np.testing.assert_allclose(adv, [[1, -1, -1, 1]], atol=1e-5)


def test_grpo_uses_population_std():
    # rewards [1,2,3,6]: mean 3, deviations [-2,-1,0,3], squares sum 14, ddof=0 var 14/4 = 3.5
    # (ddof=1 would be 14/3 and give values ~7% smaller, so this pins the convention)
    adv = group_advantages(jnp.array([[1.0, 2.0, 3.0, 6.0]]), "grpo", eps=0.0)
    np.testing.assert_allclose(adv, [[-2 / 3.5**0.5, -1 / 3.5**0.5, 0.0, 3 / 3.5**0.5]], rtol=1e-6)


def test_drgrpo_centres_each_group_without_scaling():
    # row 0: mean .5 -> [.5,-.5,-.5,.5]; row 1 [3,1,2,2]: mean 2 -> [1,-1,0,0]
    adv = group_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]]), "drgrpo")
    np.testing.assert_allclose(adv, [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]], atol=1e-7)


def test_rloo_leave_one_out():
    # r0=1: others [0,0,1] mean 1/3 -> 2/3; r1=0: others [1,0,1] mean 2/3 -> -2/3 (same for r2, r3 mirrors r0)
    # row 1 [3,1]: 3 - 1 = 2, 1 - 3 = -2
    adv = group_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0]]), "rloo")
    np.testing.assert_allclose(adv, [[2 / 3, -2 / 3, -2 / 3, 2 / 3]], rtol=1e-6)
    np.testing.assert_allclose(group_advantages(jnp.array([[3.0, 1.0]]), "rloo"), [[2.0, -2.0]], rtol=1e-6)


def test_against_numpy_loops():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(5, 6)).astype(np.float32)
    r = rewards.astype(np.float64)
    want_rloo = np.empty_like(r)
    want_grpo = np.empty_like(r)
    for p in range(r.shape[0]):
        mu = r[p].sum() / r.shape[1]
        sigma = np.sqrt(((r[p] - mu) ** 2).sum() / r.shape[1])
        for i in range(r.shape[1]):
            others = [r[p, j] for j in range(r.shape[1]) if j != i]
            want_rloo[p, i] = r[p, i] - sum(others) / len(others)
            want_grpo[p, i] = (r[p, i] - mu) / (sigma + 1e-6)
    np.testing.assert_allclose(group_advantages(jnp.asarray(rewards), "rloo"), want_rloo, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(group_advantages(jnp.asarray(rewards), "grpo"), want_grpo, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_all_equal_group_gives_exact_zero(kind):
    # 0.1 is not exact in float32: a plain r - mean(r) leaves ~7e-9, which grpo divides by eps=1e-6 -> ~0.007
    rewards = jnp.array([[0.1] * 7, [1.0] * 7])
    adv = group_advantages(rewards, kind)
    assert np.all(np.asarray(adv) == 0.0)


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="n=1"):
        group_advantages(jnp.ones((3, 1)), "rloo")


def test_unknown_kind_names_kind_and_allowed():
    with pytest.raises(ValueError, match=r"'ppo'.*grpo \| drgrpo \| rloo"):
        group_advantages(jnp.ones((2, 4)), "ppo")


def test_rejects_flat_rewards():
    with pytest.raises(ValueError, match="shape"):
        group_advantages(jnp.ones(8), "grpo")


def test_jit_with_static_kind():
    fn = jax.jit(group_advantages, static_argnames="kind")
    np.testing.assert_allclose(fn(jnp.array([[3.0, 1.0]]), kind="drgrpo"), [[1.0, -1.0]])
