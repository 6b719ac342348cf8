"""Delayed scaling by hand: how histories roll and scales follow fp8_max / amax / 2**margin."""

import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8.recipe import (
    E4M3,
    E5M2,
    Fp8Recipe,
    combine_observations,
    init_linear_state,
    update_meta,
    update_state,
)


def _observe(meta, value, dtype, recipe):
    return update_meta(meta, jnp.float32(value), dtype, recipe)


def test_history_rolls_newest_first_and_scale_uses_window_max():
    r = Fp8Recipe(amax_history_len=3)
    m = {"scale": jnp.float32(1.0), "amax_history": jnp.zeros(3)}
    m = _observe(m, 2.0, E4M3, r)
    np.testing.assert_array_equal(m["amax_history"], [2, 0, 0])
    assert float(m["scale"]) == 224.0  # 448 / 2
    m = _observe(m, 4.0, E4M3, r)
    np.testing.assert_array_equal(m["amax_history"], [4, 2, 0])
    assert float(m["scale"]) == 112.0  # 448 / max(4, 2)
    m = _observe(m, 1.0, E4M3, r)
    np.testing.assert_array_equal(m["amax_history"], [1, 4, 2])
    assert float(m["scale"]) == 112.0  # 4 still in the window
    m = _observe(_observe(m, 1.0, E4M3, r), 1.0, E4M3, r)
    np.testing.assert_array_equal(m["amax_history"], [1, 1, 1])
    assert float(m["scale"]) == 448.0  # 4 has left the window


def test_most_recent_margin_and_e5m2():
    r = Fp8Recipe(amax_history_len=4, amax_compute_algo="most_recent", margin=2)
    m = {"scale": jnp.float32(1.0), "amax_history": jnp.asarray([8.0, 0, 0, 0])}
    m = _observe(m, 0.5, E4M3, r)
    assert float(m["scale"]) == 224.0  # 448 / 0.5 / 2**2, ignoring the older 8
    g = _observe({"scale": jnp.float32(1.0), "amax_history": jnp.zeros(4)}, 7.0, E5M2, r)
    assert float(g["scale"]) == 2048.0  # 57344 / 7 / 4


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")])
def test_zero_or_non_finite_amax_keeps_the_scale(bad):
    r = Fp8Recipe(amax_history_len=2, amax_compute_algo="most_recent")
    m = {"scale": jnp.float32(5.0), "amax_history": jnp.asarray([3.0, 1.0])}
    m = _observe(m, bad, E4M3, r)
    np.testing.assert_array_equal(m["amax_history"], [0.0, 3.0])  # a NaN/inf step is recorded as 0
    assert float(m["scale"]) == 5.0


def test_update_state_on_stacked_layers_and_microbatch_max():
    r = Fp8Recipe(amax_history_len=2)
    state = {"blocks": {"wo": init_linear_state(r, (3,))}}
    obs_a = {"blocks": {"wo": init_linear_state(r, (3,))}}
    obs_b = {"blocks": {"wo": init_linear_state(r, (3,))}}
    obs_a["blocks"]["wo"]["x"]["amax_history"] = jnp.asarray([[1.0, 0], [7.0, 0], [2.0, 0]])
    obs_b["blocks"]["wo"]["x"]["amax_history"] = jnp.asarray([[4.0, 0], [3.0, 0], [2.0, 0]])
    obs = combine_observations(obs_a, obs_b)  # two microbatches: max, not sum
    new = update_state(state, obs, r)
    np.testing.assert_array_equal(new["blocks"]["wo"]["x"]["amax_history"][:, 0], [4, 7, 2])
    np.testing.assert_allclose(new["blocks"]["wo"]["x"]["scale"], [112.0, 64.0, 224.0])
    np.testing.assert_array_equal(new["blocks"]["wo"]["grad"]["scale"], [1, 1, 1])  # nothing observed: unchanged


def test_recipe_rejects_bad_values():
    with pytest.raises(ValueError, match="fp8_format"):
        Fp8Recipe(fp8_format="e5m2")
    with pytest.raises(ValueError, match="amax_compute_algo"):
        Fp8Recipe(amax_compute_algo="mean")
