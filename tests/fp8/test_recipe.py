"""Delayed scaling by hand: how histories roll and scales follow fp8_max / amax / 2**margin."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.recipe import (
    E4M3,
    E5M2,
    Fp8Recipe,
    combine_observations,
    init_linear_state,
    quantize,
    update_meta,
    update_state,
    with_input_scale_inv,
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


F32_MAX = np.finfo(np.float32).max


@pytest.mark.parametrize("amax, dtype, margin", [
    (1e-37, E4M3, 0),  # a normal f32: 448 / 1e-37 = 4.5e39 overflows f32
    (1e-35, E5M2, 0),  # 57344 / 1e-35 = 5.7e39
    (2e-38, E4M3, 2),  # 448 / 2e-38 overflows before the margin divides it
    (1e-45, E4M3, 0),  # the smallest subnormal (platforms that flush it to 0 keep the old scale instead)
])
def test_tiny_amax_gives_the_largest_finite_scale_and_zeros_stay_zero(amax, dtype, margin):
    r = Fp8Recipe(amax_history_len=2, margin=margin)
    m = _observe({"scale": jnp.float32(5.0), "amax_history": jnp.zeros(2)}, amax, dtype, r)
    scale = float(m["scale"])
    flushed = float(jnp.float32(amax) > 0) == 0.0  # a subnormal amax the platform treats as 0
    assert scale == (5.0 if flushed else F32_MAX)
    q = np.asarray(quantize(jnp.asarray([0.0, -0.0, amax, 1.0, -3.0]), m["scale"], dtype).astype(jnp.float32))
    assert np.all(np.isfinite(q)), q  # 0 * inf was NaN
    limit = float(ml_dtypes.finfo(dtype).max)
    np.testing.assert_array_equal(q[[0, 1, 3, 4]], [0.0, 0.0, limit if not flushed else 5.0,
                                                    -limit if not flushed else -15.0])


def test_kv_scales_are_guarded_like_the_linears():
    # layers: tiny (overflowing quotient), 0, inf, NaN, 2 (ordinary: 448 / 2 / 2**1)
    amax = jnp.asarray([1e-37, 0.0, np.inf, np.nan, 2.0], jnp.float32)
    old = jnp.asarray([3.0, 4.0, 5.0, 6.0, 7.0], jnp.float32)
    no_old = kvq.scales_from_amax({"k": amax, "v": amax})  # no previous scales: 1
    np.testing.assert_array_equal(no_old["k"], [F32_MAX, 1.0, 1.0, 1.0, 224.0])
    got = kvq.scales_from_amax({"k": amax, "v": amax}, margin=1, old={"k": old, "v": old})
    np.testing.assert_array_equal(got["k"], [F32_MAX, 4.0, 5.0, 6.0, 112.0])
    np.testing.assert_array_equal(got["v"], got["k"])
    assert np.all(np.asarray(kvq.quantize_kv(jnp.zeros(3), got["k"][0]).astype(jnp.float32)) == 0.0)


def test_input_scale_inverses_sit_beside_the_input_scales():
    """``with_input_scale_inv``: ``1/scale`` beside every linear's input scale, in stacked and per-layer trees;
    the kernel and gradient metas, the scales themselves and anything else unchanged."""
    recipe = Fp8Recipe()
    stacked = init_linear_state(recipe, stack=(3,))
    stacked["x"]["scale"] = jnp.array([2.0, 0.5, 3.0], jnp.float32)
    per_layer = tuple({r: {k: v[i] for k, v in m.items()} for r, m in stacked.items()} for i in range(3))
    tree = {"blocks": {"wqkv": stacked, "wo": per_layer}, "lm_head": init_linear_state(recipe), "step": jnp.int32(1)}
    out = with_input_scale_inv(tree)
    np.testing.assert_array_equal(out["blocks"]["wqkv"]["x"]["scale_inv"], 1.0 / np.array([2.0, 0.5, 3.0], np.float32))
    assert isinstance(out["blocks"]["wo"], tuple)
    assert [float(m["x"]["scale_inv"]) for m in out["blocks"]["wo"]] == [0.5, 2.0, float(np.float32(1) / np.float32(3))]
    assert float(out["lm_head"]["x"]["scale_inv"]) == 1.0
    for meta in (out["blocks"]["wqkv"], out["lm_head"]):
        assert set(meta["kernel"]) == set(meta["grad"]) == {"scale", "amax_history"}
    np.testing.assert_array_equal(out["blocks"]["wqkv"]["x"]["scale"], stacked["x"]["scale"])
    assert out["step"] is tree["step"]
