"""The head's fused FP8 logit gradient (``kernels.head_grad``): the kernel against the XLA form, both against the
autodiff of the log-softmax, and the FP8-recompute head through either."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import E5M2, quantize
from fp8rl_jax.kernels.head_grad import logit_grad_fp8
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.model.fp8_heads import fp8_grad_head_logprobs

M, V = 37, 1000  # neither a power of two: programs that do not divide the rows, a last block that overlaps


def _inputs(seed=0, m=M, v=V, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    z = (jax.random.normal(k[0], (m, v)) * 300).astype(dtype)  # unscaled: logits = z * 0.01, a few sharp rows
    inv_scale = jnp.float32(0.01)
    g = jax.random.normal(k[1], (m,))
    y = jax.random.randint(k[2], (m,), 0, v)
    return z, inv_scale, g, y


def _shift(z, inv_scale, temperature):
    return jnp.max(z.astype(jnp.float32) * inv_scale / temperature, axis=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("m", [M, 64])
def test_kernels_equal_the_xla_form(temperature, m):
    """Pallas' interpreter runs the kernels (16 x 256 tiles, a row's last one overlapping; 37 rows: tiles of one)
    with XLA's arithmetic: the same E5M2 bits, their exact transpose and the same amax as the XLA form."""
    z, inv_scale, g, y = _inputs(m=m)
    shift = _shift(z, inv_scale, temperature)
    run = lambda impl: logit_grad_fp8(z, shift, g, y, inv_scale, jnp.float32(3000.0), E5M2, temperature=temperature,
                                      transposed=True, impl=impl, block=(16, 256))
    (qa, none, amax_a), (qb, qb_t, amax_b) = run("xla"), run("pallas_interpret")
    assert none is None and qa.dtype == qb.dtype == qb_t.dtype == E5M2 and qa.shape == qb.shape == (m, V)
    np.testing.assert_array_equal(np.asarray(qa.astype(jnp.float32)), np.asarray(qb.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(qb_t.astype(jnp.float32)), np.asarray(qb.T.astype(jnp.float32)))
    assert float(amax_a) == float(amax_b) > 0


def test_the_gradient_is_the_log_softmax_gradient_quantized():
    """Against the autodiff of ``g * log_softmax(x / T)[y]`` in f32, quantized by ``recipe.quantize``: the E5M2 values
    equal (or the neighbouring one where the sums round apart), the amax that of the f32 gradient; a scale that
    saturates clips as ``quantize`` does; the shift is any value near the row max."""
    z, inv_scale, g, y = _inputs(1, dtype=jnp.float32)
    t = 0.7
    x = z * inv_scale

    def loss(x):
        return jnp.sum(g * jnp.take_along_axis(jax.nn.log_softmax(x / t), y[:, None], axis=1)[:, 0])

    want = jax.grad(loss)(x)
    for scale in (3000.0, 1e6):  # the second saturates the largest gradients
        shift = _shift(z, inv_scale, t) + 0.5
        q, _, got_amax = logit_grad_fp8(z, shift, g, y, inv_scale, jnp.float32(scale), E5M2, temperature=t,
                                        impl="pallas_interpret", block=(1, 128))
        ref = np.asarray(quantize(want, jnp.float32(scale), E5M2).astype(jnp.float32))
        got = np.asarray(q.astype(jnp.float32))
        assert np.all(np.abs(got - ref) <= np.abs(ref) * 0.25 + 1e-30)  # at most one E5M2 step
        assert np.mean(got == ref) > 0.99
        np.testing.assert_allclose(float(got_amax), float(jnp.max(jnp.abs(want))), rtol=1e-5)


def test_bad_shapes_and_impl_are_refused():
    z, inv_scale, g, y = _inputs()
    shift, one = _shift(z, inv_scale, 1.0), jnp.float32(1.0)
    with pytest.raises(ValueError, match="do not match"):
        logit_grad_fp8(z, shift[:-1], g, y, inv_scale, one, E5M2)
    with pytest.raises(ValueError, match="impl='cuda'"):
        logit_grad_fp8(z, shift, g, y, inv_scale, one, E5M2, impl="cuda")
    with pytest.raises(ValueError, match="powers of two"):
        logit_grad_fp8(z, shift, g, y, inv_scale, one, E5M2, impl="pallas_interpret", block=(16, 96))


def _recompute_head_grads(grad_impl):
    config = preset("tiny")
    precision = Precision(backend="xla", lm_head_grad_fp8=True, lm_head_recompute_fp8=True)
    st = llama.init_fp8_state(config, precision)["lm_head"]
    for role, scale in (("x", 448 / 4.0), ("kernel", 448 / 0.1), ("grad", 57344 / 0.05)):
        st[role] = dict(st[role], scale=jnp.float32(scale))
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    h = jax.random.normal(k[0], (2, 12, config.hidden_size), jnp.float32)
    kernel = 0.05 * jax.random.normal(k[1], (config.vocab_size, config.hidden_size), jnp.float32)
    targets = jax.random.randint(k[2], (2, 12), 0, config.vocab_size)
    w = jax.random.normal(k[3], (2, 12))

    def loss(h, kernel, st):
        logp, _ = fp8_grad_head_logprobs(h, kernel, targets, st, precision=precision, chunk=4, kernel_nk=True,
                                         grad_impl=grad_impl)
        return jnp.sum(w * logp)

    return jax.grad(loss, argnums=(0, 1, 2))(h, kernel, st)


def test_recompute_head_through_the_kernel_is_its_xla_form():
    """``lm_head_recompute_fp8``'s backward with the kernel (interpreted) and with the XLA form: the same hidden-state
    and kernel gradients and the same amax observations."""
    for a, b in zip(jax.tree.leaves(_recompute_head_grads("xla")),
                    jax.tree.leaves(_recompute_head_grads("pallas_interpret")), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernel_lowers_to_triton(triton_ir):
    """A llama1b head chunk (8,192 x 128,256 BF16 logits; the vocabulary ends in an overlapping tile): both kernels
    lower; the second stores E5M2 twice (q and its transpose) and the tile's amax."""
    s = jax.ShapeDtypeStruct
    args = (s((8192, 128256), jnp.bfloat16), s((8192,), jnp.float32), s((8192,), jnp.float32), s((8192,), jnp.int32))
    sums, grad = triton_ir(lambda z, shift, g, y: logit_grad_fp8(
        z, shift, g, y, jnp.float32(0.01), jnp.float32(3000.0), E5M2, transposed=True, impl="pallas"), *args)
    assert "exp2" in sums and "f8E5M2" not in sums
    assert grad.count("tt.store") == 3 and "f8E5M2" in grad


@pytest.mark.gpu
def test_gpu_kernel_follows_the_xla_form():
    """The compiled kernels (default tiles) against their XLA form on the GPU at llama's vocabulary: the same
    E5M2 values but where Triton's exp and XLA's differ in a last f32 bit at a rounding boundary; amax to f32
    rounding."""
    z, inv_scale, g, y = _inputs(2, m=300, v=128256)
    shift = _shift(z, inv_scale, 1.0)
    args = (z, shift, g, y, inv_scale, jnp.float32(3000.0), E5M2)
    got = jax.jit(lambda *a: logit_grad_fp8(*a[:6], E5M2, transposed=True, impl="pallas"))(*args[:6])
    want = jax.jit(lambda *a: logit_grad_fp8(*a[:6], E5M2, impl="xla"))(*args[:6])
    a, b = np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32))
    assert np.mean(a == b) > 0.999
    assert np.all(np.abs(a - b) <= np.abs(b) * 0.25 + 1e-30)  # at most one E5M2 step
    np.testing.assert_array_equal(np.asarray(got[1].astype(jnp.float32)), a.T)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-5)
