"""The fused SwiGLU backward (``kernels.swiglu_grad``): the kernel against the XLA form, both against autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8.recipe import E4M3, E5M2, quantize
from fp8rl_jax.kernels.swiglu_grad import swiglu_grad_fp8

M, F = 128, 64


def _inputs(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    gate_up = (jax.random.normal(k[0], (M, 2 * F)) * 2).astype(jnp.bfloat16)
    g_h = (jax.random.normal(k[1], (M, F)) * 0.01).astype(jnp.bfloat16)
    return gate_up, g_h


def test_kernel_equals_the_xla_form_bit_for_bit():
    """Pallas' interpreter runs the kernel's tiles (64 x 32 blocks: 2 x 2 programs) with XLA's arithmetic: the same
    bits in every output, the transposes included, and the same amaxes."""
    gate_up, g_h = _inputs()
    scales = (jnp.float32(20.0), jnp.float32(3000.0))
    run = lambda impl: jax.jit(lambda a, b: swiglu_grad_fp8(a, b, *scales, E4M3, E5M2, impl=impl, block=(64, 32)))(
        gate_up, g_h)
    for a, b in zip(run("xla"), run("pallas_interpret"), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_outputs_are_the_quantized_swiglu_and_its_gradient():
    """Against ``jax.vjp`` of ``silu(gate) * up`` in f32, quantized by ``recipe.quantize``: the FP8 values equal (or
    a neighbouring FP8 value, where f32 sums in another order straddle a rounding boundary), the transposes are
    transposes, the amaxes those of the f32 values; a scale that saturates clips as ``quantize`` does."""
    gate_up, g_h = _inputs(1)
    gate, up = gate_up[:, :F].astype(jnp.float32), gate_up[:, F:].astype(jnp.float32)
    h, vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)
    g = jnp.concatenate(vjp(g_h.astype(jnp.float32)), axis=1)
    for scales in ((20.0, 3000.0), (200.0, 1e6)):  # the second saturates many values of both
        qh_t, qg, qg_t, amax_h, amax_g = swiglu_grad_fp8(gate_up, g_h, *map(jnp.float32, scales), E4M3, E5M2)
        assert (qh_t.dtype, qg.dtype, qh_t.shape, qg.shape) == (E4M3, E5M2, (F, M), (M, 2 * F))
        for got, want, scale in ((qh_t.T, h, scales[0]), (qg, g, scales[1])):
            ref = quantize(want, jnp.float32(scale), got.dtype).astype(jnp.float32)
            got = got.astype(jnp.float32)
            step = np.abs(np.asarray(ref)) * 2.0 ** -(2 if got.dtype == E5M2 else 3)  # one FP8 step, about
            assert np.all(np.abs(np.asarray(got - ref)) <= step + 1e-30)
            assert np.mean(np.asarray(got == ref)) > 0.99
        np.testing.assert_array_equal(np.asarray(qg_t.astype(jnp.float32)), np.asarray(qg.T.astype(jnp.float32)))
        np.testing.assert_allclose(float(amax_h), float(jnp.max(jnp.abs(h))), rtol=1e-6)
        np.testing.assert_allclose(float(amax_g), float(jnp.max(jnp.abs(g))), rtol=1e-6)


def test_bad_shapes_and_impl_are_refused():
    gate_up, g_h = _inputs()
    one = jnp.float32(1.0)
    with pytest.raises(ValueError, match="do not match"):
        swiglu_grad_fp8(gate_up[:, :-1], g_h, one, one, E4M3, E5M2)
    with pytest.raises(ValueError, match="impl='cuda'"):
        swiglu_grad_fp8(gate_up, g_h, one, one, E4M3, E5M2, impl="cuda")
    with pytest.raises(ValueError, match="do not divide"):
        swiglu_grad_fp8(gate_up, g_h, one, one, E4M3, E5M2, impl="pallas_interpret", block=(48, 32))
    # auto takes the XLA form off the GPU, whatever the shape
    assert swiglu_grad_fp8(gate_up[:100], g_h[:100], one, one, E4M3, E5M2)[0].shape == (F, 100)


@pytest.mark.gpu
def test_gpu_kernel_follows_the_xla_form():
    """The compiled kernel (default blocks) against its XLA form on the GPU: the same values but where Triton's
    exp and XLA's differ in a last f32 bit at an FP8 rounding boundary; transposes exact; amaxes to f32 rounding."""
    k = jax.random.split(jax.random.PRNGKey(2), 2)
    gate_up = (jax.random.normal(k[0], (512, 512)) * 2).astype(jnp.bfloat16)
    g_h = (jax.random.normal(k[1], (512, 256)) * 0.01).astype(jnp.bfloat16)
    scales = (jnp.float32(20.0), jnp.float32(3000.0))
    got = jax.jit(lambda a, b: swiglu_grad_fp8(a, b, *scales, E4M3, E5M2, impl="pallas"))(gate_up, g_h)
    want = jax.jit(lambda a, b: swiglu_grad_fp8(a, b, *scales, E4M3, E5M2, impl="xla"))(gate_up, g_h)
    for a, b in zip(got[:3], want[:3], strict=True):
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        assert np.mean(a == b) > 0.999
        assert np.all(np.abs(a - b) <= np.abs(b) * 0.25 + 1e-30)  # at most one FP8 step
    np.testing.assert_array_equal(np.asarray(got[2].astype(jnp.float32)), np.asarray(got[1].T.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(got[3:]), np.asarray(want[3:]), rtol=1e-5)
