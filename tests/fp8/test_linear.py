"""``linear`` outside FP8: a BF16 GEMM with an f32 output keeps BF16 operands in its backward GEMMs."""

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.fp8.linear import linear
from fp8rl_jax.fp8.policy import Precision

BF16 = Precision()


def _dots(fn, *args):
    """(operand dtypes, output dtype) of every dot_general in ``fn``'s jaxpr, nested jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _inputs():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 64), jnp.float32)
    w = 0.1 * jax.random.normal(jax.random.PRNGKey(1), (64, 48), jnp.float32)
    t = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 48), jnp.float32)
    return x, w, t


def _loss(x, w, t, kernel_nk=False):
    y = linear(x, w.T if kernel_nk else w, None, BF16, out_dtype=jnp.float32, kernel_nk=kernel_nk)
    assert y.dtype == jnp.float32
    return jnp.sum(jnp.sin(y) * t)


def test_backward_gemms_of_an_f32_output_are_bf16():
    assert BF16.dtype == jnp.bfloat16 and not BF16.fp8
    x, w, t = _inputs()
    dots = _dots(jax.grad(_loss, argnums=(0, 1)), x, w, t)
    assert len(dots) >= 3  # the forward and both backward GEMMs
    assert all(operands == ("bfloat16", "bfloat16") for operands, _ in dots), dots
    # with the output in the compute dtype the GEMM is the plain one, as before
    plain = _dots(jax.grad(lambda x, w: jnp.sum(linear(x, w, None, BF16).astype(jnp.float32)), argnums=(0, 1)), x, w)
    assert all(operands == ("bfloat16", "bfloat16") for operands, _ in plain), plain


@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_forward_is_the_plain_gemm_and_gradients_match_float64(kernel_nk):
    x, w, t = _inputs()
    xb, wb = (np.asarray(a, ml_dtypes.bfloat16).astype(np.float64) for a in (x, w))
    # forward: the BF16 operands' exact products, summed in f32 or wider: close to float64 on the rounded operands
    y = np.asarray(linear(x, w.T if kernel_nk else w, None, BF16, out_dtype=jnp.float32, kernel_nk=kernel_nk))
    y64 = xb @ wb
    np.testing.assert_allclose(y, y64, rtol=1e-5, atol=1e-5)
    # gradients: d/dy = cos(y) t, rounded to BF16 before the backward GEMMs (relative 2^-8), each output BF16
    dx, dw = jax.grad(_loss, argnums=(0, 1))(x, w, t, kernel_nk)
    gy = np.cos(y64) * np.asarray(t, np.float64)
    dx64, dw64 = gy @ wb.T, np.einsum("btk,btn->kn", xb, gy)
    for ours, ref in ((dx, dx64), (dw, dw64)):
        err = np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref))
        assert err < 2e-2, err
    # and the two kernel layouts give the same gradients: GEMMs of other operand layouts, whose f32 sums XLA:CPU may
    # order apart, so up to one BF16 step of the outputs (a layout mixed up would be off by far more)
    dx_other, dw_other = jax.grad(_loss, argnums=(0, 1))(x, w, t, not kernel_nk)
    for ours, other in ((dx, dx_other), (dw, dw_other)):
        ours, other = np.asarray(ours, np.float32), np.asarray(other, np.float32)
        np.testing.assert_allclose(other, ours, rtol=2**-7, atol=1e-5 * np.abs(ours).max())


@pytest.mark.parametrize("form", ["f8", "f32"])
def test_residual_goes_into_an_fp8_gemm_only_over_float8_operands(form, monkeypatch):
    """``linear(..., residual=r)`` is ``r + linear(...)``; over a float8 pre-quantized kernel (the GPU's form) the
    add is the GEMM's (``xla.prequantized_matmul_into``: one barrier-pinned input, one f32 dot of dequantized
    operands); over the CPU's f32 form, and with ``precision.residual_in_gemm`` off, a separate add."""
    from fp8rl_jax.fp8 import xla
    from fp8rl_jax.fp8.recipe import init_linear_state, with_input_scale_inv

    precision = Precision(backend="xla")
    x, w, t = _inputs()
    r = 3 * t
    st = init_linear_state(precision.recipe)
    st["x"]["scale"], st["kernel"]["scale"] = jnp.float32(448 / 4), jnp.float32(448 / 0.4)
    st = with_input_scale_inv(st)
    qk = xla.quantize_kernel(w, st["kernel"], precision.recipe, form)

    calls = []
    into = xla.prequantized_matmul_into
    monkeypatch.setattr(xla, "prequantized_matmul_into", lambda *a, **k: calls.append(1) or into(*a, **k))

    def run(r, x, precision=precision):
        return linear(x, qk, st, precision, residual=r)

    want = r + linear(x, qk, st, precision, out_dtype=jnp.float32)
    got = run(r, x)
    assert got.shape == r.shape and got.dtype == jnp.float32
    assert len(calls) == (1 if form == "f8" else 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(np.asarray(run(r, x, precision.replace(residual_in_gemm=False))), np.asarray(want))
    assert len(calls) == (1 if form == "f8" else 0)
