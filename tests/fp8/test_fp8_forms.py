"""The FP8 linear's other forms (``Fp8Recipe.scaling='current'``, ``Fp8Recipe.fp8_gemms``) against numpy references,
and the general path against the standard one where both apply.

References: ml_dtypes casts (round to nearest even), f32 scales, products summed in float64, where they are exact
(FP8 x FP8 and BF16 x BF16 products have at most 16 significant bits). The GEMM's f32 sums are held to the
summation bound |y - y_exact| <= (C + 3) * 2**-24 * |a| . |b|^T (C the contraction size).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.model import kv_cache, llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.rollout.weights import rollout_params

U = 2.0**-24
M, K, N = 48, 96, 80


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(M, K)).astype(np.float32)
    x[2, 3] = 300.0
    w = (0.05 * rng.normal(size=(K, N))).astype(np.float32)
    g = (1e-3 * rng.normal(size=(M, N))).astype(np.float32)
    return x, w, g


def _state(recipe):
    """Delayed scales that are not 1 (as after a calibration): the standard path and the general one read them."""
    s = init_linear_state(recipe)
    for role, value in (("x", 1.5), ("kernel", 4000.0), ("grad", 2.0e5)):
        s[role]["scale"] = jnp.float32(value)
    return s


def _call(fn, x, w, g, state):
    y, vjp = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w), state)
    return (y, *vjp(jnp.asarray(g)))


def _product(a, b):
    """a [P, C] . b [Q, C]^T in float64 (exact here) and the f32 summation bound around it."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a @ b.T, (a.shape[1] + 3) * U * (np.abs(a) @ np.abs(b).T)


def _close(got, ref_bound):
    ref, bound = ref_bound
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert (err <= bound).all(), float(err.max())


@pytest.mark.parametrize("recipe", [Fp8Recipe(), Fp8Recipe(fp8_format="e4m3"), Fp8Recipe(scaling="rowwise")],
                         ids=["tensor", "tensor_e4m3", "rowwise"])
def test_general_path_equals_the_standard_one(operands, recipe):
    """The general custom VJP (every other form's) with a standard recipe: the standard path's values, bit for bit."""
    x, w, g = operands
    state = _state(recipe)
    dt = jnp.dtype(jnp.float32)
    general = xla._general_matmul_fn(dt, dt, dt, recipe, xla.gemm_form())
    run = jax.jit(lambda x, w, g: (_call(lambda a, b, s: xla.fp8_matmul(a, b, s, recipe), x, w, g, state),
                                   _call(lambda a, b, s: general(a, b, s, None, None), x, w, g, state)))
    standard, other = run(x, w, g)
    for a, b in zip(jax.tree.leaves(standard), jax.tree.leaves(other), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _q(a, dtype):
    """Per-tensor current scaling: (FP8 values as f32, 1 / scale)."""
    limit = np.float32(float(ml_dtypes.finfo(dtype).max))
    scale = limit / np.float32(np.abs(a).max())
    q = np.clip(a.astype(np.float32) * scale, -limit, limit).astype(dtype).astype(np.float32)
    return q, np.float32(1.0) / scale


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_current_scaling_matches_reference(operands, fmt):
    x, w, g = operands
    recipe = Fp8Recipe(scaling="current", fp8_format=fmt)
    gdt = ml_dtypes.float8_e5m2 if fmt == "hybrid" else ml_dtypes.float8_e4m3fn
    state = init_linear_state(recipe)  # scales 1: current scaling reads none of them
    y, dx, dw, obs = jax.jit(lambda x, w, g: _call(lambda a, b, s: xla.fp8_matmul(a, b, s, recipe), x, w, g,
                                                   state))(x, w, g)
    (qx, sx), (qw, sw), (qg, sg) = _q(x, ml_dtypes.float8_e4m3fn), _q(w, ml_dtypes.float8_e4m3fn), _q(g, gdt)
    scaled = lambda ref_bound, s: (ref_bound[0] * s, ref_bound[1] * s * (1 + 4 * U))  # two more f32 roundings
    _close(y, scaled(_product(qx, qw.T), np.float64(sx) * np.float64(sw)))
    _close(dx, scaled(_product(qg, qw), np.float64(sg) * np.float64(sw)))
    _close(dw, scaled(_product(qx.T, qg.T), np.float64(sx) * np.float64(sg)))
    assert float(obs["grad"]["amax_history"][0]) == 0.0  # reads no delayed scale: observes nothing


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("gemms", [("fprop",), ("dgrad",), ("wgrad",), ("fprop", "wgrad")])
def test_fp8_gemms_run_the_others_on_bf16_operands(operands, gemms):
    """An FP8 GEMM gives the standard path's values bit for bit; one left out is the GEMM of the BF16-rounded
    operands with f32 accumulation (x in BF16, as ``linear`` hands it over)."""
    x, w, g = operands
    x = _bf16(x)
    recipe = Fp8Recipe(fp8_gemms=gemms)
    state = _state(recipe)
    bf16 = jnp.dtype(jnp.bfloat16)
    run = jax.jit(lambda x, w, g: (
        _call(lambda a, b, s: xla.fp8_matmul(a, b, s, recipe, jnp.float32), x.astype(bf16), w, g, state),
        _call(lambda a, b, s: xla.fp8_matmul(a, b, s, Fp8Recipe(), jnp.float32), x.astype(bf16), w, g, state)))
    (y, dx, dw, _), (y8, dx8, dw8, _) = run(x, w, g)
    refs = {"fprop": (y, y8, _product(x, _bf16(w).T)), "dgrad": (dx, dx8, _product(_bf16(g), _bf16(w))),
            "wgrad": (dw, dw8, _product(x.T, _bf16(g).T))}
    for name, (got, fp8, ref) in refs.items():
        if name in gemms:
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(fp8, np.float32))
        else:
            _close(np.asarray(got, np.float32), (ref[0], ref[1] + np.abs(ref[0]) * 2.0**-8))  # dx leaves as BF16


def test_recipe_forms_are_validated():
    assert Fp8Recipe(fp8_gemms=("wgrad", "fprop")).fp8_gemms == ("fprop", "wgrad")  # one spelling, one hash
    assert Fp8Recipe(fp8_gemms=("wgrad", "fprop")) == Fp8Recipe(fp8_gemms=("fprop", "wgrad"))
    assert Fp8Recipe().standard and Fp8Recipe(scaling="rowwise").standard
    assert not Fp8Recipe(scaling="current").standard and not Fp8Recipe(fp8_gemms=("fprop",)).standard
    for bad in ((), ("fwd",), ("fprop", "fprop")):
        with pytest.raises(ValueError, match="fp8_gemms"):
            Fp8Recipe(fp8_gemms=bad)
    with pytest.raises(ValueError, match="xla backend only"):
        Precision(backend="te", recipe=Fp8Recipe(fp8_gemms=("fprop",)))
    with pytest.raises(ValueError, match="xla backend only"):
        Precision(backend="te", recipe=Fp8Recipe(scaling="current"))
    with pytest.raises(ValueError, match="no FP8 kernel"):
        xla.quantize_kernel(jnp.ones((4, 4)), init_linear_state(Fp8Recipe())["kernel"],
                            Fp8Recipe(fp8_gemms=("dgrad",)))


def test_current_scaling_rollout_weights_reproduce_the_training_forward():
    config = preset("tiny").replace(num_layers=2)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (2, 12)))
    params = llama.init_params(config, jax.random.PRNGKey(0), std=0.05)
    precision = Precision(backend="xla", recipe=Fp8Recipe(scaling="current"))
    state = llama.init_fp8_state(config, precision)
    fwd = lambda p, s, cache=None: llama.forward(p, tokens, config=config, precision=precision, fp8_state=s,
                                                 cache=cache)[0]
    train = jax.jit(fwd)(params, state)
    rp = jax.jit(lambda p, s: rollout_params(p, s, precision, config.num_layers))(params, state)
    cache = kv_cache.init_cache(config, 2, 16, kv_cache.cache_dtype(precision))
    np.testing.assert_array_equal(np.asarray(jax.jit(fwd)(rp, state, cache)), np.asarray(train))
