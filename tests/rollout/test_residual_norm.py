"""The decode step's residual add + RMSNorm + FP8 quantize kernel (``kernels.residual_norm``) against the model's own
ops (``x + y``, ``llama.rms_norm``, ``recipe.quantize``), its Triton lowering, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8.recipe import quantize
from fp8rl_jax.kernels import residual_norm as rn
from fp8rl_jax.model.llama import rms_norm


def _inputs(m: int, d: int, seed: int = 0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k[0], (m, 1, d)) * 3.0
    y = jax.random.normal(k[1], (m, 1, d))
    w = 1.0 + 0.1 * jax.random.normal(k[2], (d,))
    return x, y, w


@pytest.mark.parametrize("m,compute", [(6, jnp.bfloat16), (4, jnp.float32), (1, jnp.bfloat16)])
def test_kernel_is_the_models_add_norm_and_quantize(m, compute):
    """The sum bit for bit; the FP8 value the model's ops give (rms_norm in the compute dtype, then the next linear's
    quantize) in all but a rounding step of rare elements; rows past a multiple of ROWS handled (M = 6, 1)."""
    x, y, w = _inputs(m, 64)
    scale = jnp.float32(40.0)
    want_s = x + y
    want_q = quantize(rms_norm(want_s, w, 1e-5, compute), scale, jnp.float8_e4m3fn)
    for impl in ("xla", "pallas_interpret"):
        s, q = rn.add_rms_norm_quantize(x, y, w, 1e-5, scale, compute_dtype=compute, impl=impl)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
        assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape
        got, want = np.asarray(q, np.float32), np.asarray(want_q, np.float32)
        assert np.mean(got != want) <= 0.01
        np.testing.assert_allclose(got, want, rtol=0.13, atol=0)  # one E4M3 step at most


def test_bad_inputs_name_the_argument():
    x, y, w = _inputs(2, 64)
    with pytest.raises(ValueError, match="x and y must be f32"):
        rn.add_rms_norm_quantize(x, y.astype(jnp.bfloat16), w, 1e-5, 1.0)
    with pytest.raises(ValueError, match="weight must be"):
        rn.add_rms_norm_quantize(x, y, w[:32], 1e-5, 1.0)
    with pytest.raises(ValueError, match="impl="):
        rn.add_rms_norm_quantize(x, y, w, 1e-5, 1.0, impl="cuda")
    x, y, _ = _inputs(2, 48)
    with pytest.raises(ValueError, match="not a power of two"):
        rn.add_rms_norm_quantize(x, y, jnp.ones(48), 1e-5, 1.0, impl="pallas_interpret")


def test_lowers_to_triton(triton_ir):
    """Llama-3.2-1B's decode residual [256, 1, 2048]: one kernel that stores the f32 sum and the E4M3 input."""
    f32 = jax.ShapeDtypeStruct((256, 1, 2048), jnp.float32)
    fn = lambda x, y, w, s: rn.add_rms_norm_quantize(x, y, w, 1e-5, s, impl="pallas")  # noqa: E731
    [ttir] = triton_ir(fn, f32, f32, jax.ShapeDtypeStruct((2048,), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
    stores = [line for line in ttir.splitlines() if "tt.store" in line]
    assert len(stores) == 2 and any("f8E4M3FN" in line for line in stores), stores


@pytest.mark.gpu
def test_gpu_kernel_is_the_models_add_norm_and_quantize():
    """Compiled, Llama-3.2-1B's decode shape: the sum bit for bit, the FP8 input as the model's ops make it in all but
    rare elements (a rounding step: the norm's sum in another order)."""
    x, y, w = _inputs(256, 2048)
    scale = jnp.float32(40.0)
    s, q = jax.jit(lambda x, y, w: rn.add_rms_norm_quantize(x, y, w, 1e-5, scale, impl="pallas"))(x, y, w)
    want_s = x + y
    want_q = quantize(rms_norm(want_s, w, 1e-5, jnp.bfloat16), scale, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    got, want = np.asarray(q, np.float32), np.asarray(want_q, np.float32)
    assert np.mean(got != want) <= 0.01
    np.testing.assert_allclose(got, want, rtol=0.13, atol=0)
