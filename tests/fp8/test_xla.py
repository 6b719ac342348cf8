"""The ``xla`` FP8 backend against an independent numpy / ml_dtypes emulation of the same recipe."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state, quantize

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def np_quantize(x, scale, dtype):
    """Reference: f32 multiply, saturate, round-to-nearest-even cast (ml_dtypes)."""
    y = np.asarray(x, np.float32) * np.float32(scale)
    return np.clip(y, -MAX[dtype], MAX[dtype]).astype(dtype)


def bits(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_is_bit_exact(dtype):
    rng = np.random.RandomState(0)
    x = np.concatenate([
        rng.randn(4096).astype(np.float32) * 3,
        np.float32([0.0, -0.0, 1e-9, -1e-9, 1e6, -1e6]),  # underflow to zero, saturation
        np.float32([1.0625, 1.1875, 17.0, 304.0]),  # ties between E4M3 neighbours (round to even)
    ])
    scale = np.float32(37.5)
    ours = quantize(jnp.asarray(x), jnp.float32(scale), jnp.dtype(dtype))
    np.testing.assert_array_equal(bits(ours), bits(np_quantize(x, scale, dtype)))
    assert float(np.max(np.abs(np.asarray(ours, np.float32)))) == MAX[dtype]  # saturated, not inf/NaN


def _state(x, w, g, recipe, margin=0):
    """Delayed scales as a previous step would have left them: fp8_max / amax / 2**margin."""
    st = init_linear_state(recipe)
    for role, t, dt in (("x", x, recipe.fwd_dtype), ("kernel", w, recipe.fwd_dtype), ("grad", g, recipe.bwd_dtype)):
        # stale amax (as if from an earlier step): 0.8 of the current one, so some values saturate
        st[role]["scale"] = jnp.float32(MAX[np.dtype(dt).type] / (0.8 * np.abs(t).max()) / 2**margin)
    return st


@pytest.mark.parametrize("form", xla.GEMM_FORMS)
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_forward_and_gradients_match_emulation(fmt, form):
    recipe = Fp8Recipe(fp8_format=fmt)
    g_dtype = E5M2 if fmt == "hybrid" else E4M3
    rng = np.random.RandomState(1)
    x = rng.randn(48, 64).astype(np.float32)
    w = (rng.randn(64, 80) * 0.05).astype(np.float32)
    g = (rng.randn(48, 80) * 1e-3).astype(np.float32)
    st = _state(x, w, g, recipe)
    sx, sw, sg = (float(st[r]["scale"]) for r in ("x", "kernel", "grad"))

    y, vjp = jax.vjp(lambda a, b: xla.fp8_matmul(a, b, st, recipe, form=form), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))

    qx, qw, qg = np_quantize(x, sx, E4M3), np_quantize(w, sw, E4M3), np_quantize(g, sg, g_dtype)
    f64 = lambda a: np.asarray(a, np.float64)
    y_ref = f64(qx) @ f64(qw) / (sx * sw)
    dx_ref = f64(qg) @ f64(qw).T / (sg * sw)
    dw_ref = f64(qx).T @ f64(qg) / (sx * sg)
    # same FP8 operands: only f32 accumulation order separates us from the f64 reference
    for ours, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(np.asarray(ours, np.float64), ref, rtol=2e-5, atol=1e-6 * np.abs(ref).max())


def test_fp8_error_is_quantization_sized():
    """FP8 differs from exact by E4M3's rounding (~2-4% relative), BF16 by far less: not zero, not garbage."""
    recipe = Fp8Recipe()
    rng = np.random.RandomState(2)
    x = rng.randn(128, 256).astype(np.float32)
    w = (rng.randn(256, 128) * 0.05).astype(np.float32)
    g = rng.randn(128, 128).astype(np.float32)
    st = _state(x, w, g, recipe, margin=0)
    st["x"]["scale"] = jnp.float32(448 / np.abs(x).max())
    st["kernel"]["scale"] = jnp.float32(448 / np.abs(w).max())
    exact = x.astype(np.float64) @ w.astype(np.float64)
    fp8 = np.asarray(xla.fp8_matmul(jnp.asarray(x), jnp.asarray(w), st, recipe), np.float64)
    bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16) @ jnp.asarray(w, jnp.bfloat16), np.float64)
    rel = lambda a: np.linalg.norm(a - exact) / np.linalg.norm(exact)
    print(f"relative error: fp8 {rel(fp8):.4f}, bf16 {rel(bf16):.5f}")
    # E4M3 keeps 3 mantissa bits: uniform rounding error ~2^-4/sqrt(3) per operand, ~0.03 after the dot
    assert 0.01 < rel(fp8) < 0.06
    assert rel(bf16) < 0.006


def _lowered_dots(form):
    recipe = Fp8Recipe()
    x = jnp.ones((32, 64), jnp.bfloat16)
    w = jnp.ones((64, 48), jnp.float32)
    st = init_linear_state(recipe)

    def loss(x, w, st):
        return xla.fp8_matmul(x, w, st, recipe, form=form).astype(jnp.float32).sum()

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w, st).as_text()
    return hlo, [line for line in hlo.splitlines() if "dot_general" in line]


def test_lowered_dots_take_fp8_operands():
    """The ``f8`` form (the GPU's): dot_generals on f8 operands, not a quantize-dequantize pattern XLA could fold
    into BF16."""
    _, dots = _lowered_dots("f8")
    assert len(dots) == 3, dots  # forward, dgrad, wgrad
    assert sum("f8E4M3FN" in d and "f8E5M2" not in d for d in dots) == 1  # forward: E4M3 x E4M3
    assert sum("f8E5M2" in d and "f8E4M3FN" in d for d in dots) == 2  # backward: E5M2 grad with an E4M3 operand
    assert all("-> tensor<" in d and "xf32>" in d.split("->")[-1] for d in dots)  # f32 accumulation


def test_cpu_form_upcasts_pinned_fp8_values():
    """The ``f32`` form (the CPU's): f32 dots whose operands are FP8 values pinned by a barrier (3 quantized
    tensors: x and the kernel forward, the gradient backward), so no pass can fold the round trip away."""
    assert xla.gemm_form() == ("f32" if jax.default_backend() == "cpu" else "f8")
    hlo, dots = _lowered_dots("f32")
    assert len(dots) == 3, dots
    assert all("f8E" not in d and d.count("xf32>") == 3 for d in dots), dots  # f32 x f32 -> f32
    assert hlo.count("optimization_barrier") >= 3
    assert "f8E4M3FN" in hlo and "f8E5M2" in hlo  # the values are quantized before the upcast
    with pytest.raises(ValueError, match="form='bf16'"):
        xla.gemm_form("bf16")


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_cpu_form_equals_fp8_dot_bit_for_bit(fmt):
    """On CPU the two forms give the same bits: XLA:CPU computes an f8 dot as the f32 GEMM of the upcast
    operands, which the ``f32`` form spells out (forward, both gradients, and the pre-quantized rollout path)."""
    recipe = Fp8Recipe(fp8_format=fmt)
    rng = np.random.RandomState(4)
    x = jnp.asarray(rng.randn(40, 96), jnp.bfloat16)
    w = jnp.asarray(rng.randn(96, 72) * 0.05, jnp.float32)
    g = jnp.asarray(rng.randn(40, 72) * 1e-3, jnp.bfloat16)
    st = _state(np.asarray(x, np.float32), np.asarray(w), np.asarray(g, np.float32), recipe)

    def run(form):  # each its own program, as the trainer and the sampler run them
        def train(x, w):
            y, vjp = jax.vjp(lambda a, b: xla.fp8_matmul(a, b, st, recipe, form=form), x, w)
            return (y, *vjp(g))

        qk = jax.jit(lambda w: xla.quantize_kernel(w, st["kernel"], recipe, form))(w)
        roll = jax.jit(lambda x, qk: xla.prequantized_matmul(x, qk, st["x"]["scale"], recipe, form))(x, qk)
        # an input quantized beforehand with the same scale (the decode kernel's output): the same GEMM
        x8 = quantize(x, st["x"]["scale"], recipe.fwd_dtype)
        pre = jax.jit(lambda x8, qk: xla.prequantized_matmul(x8, qk, st["x"]["scale"], recipe, form))(x8, qk)
        np.testing.assert_array_equal(np.asarray(pre), np.asarray(roll))
        return (*jax.jit(train)(x, w), roll, qk.data.astype(jnp.float32))

    for f8_out, f32_out in zip(run("f8"), run("f32"), strict=True):
        np.testing.assert_array_equal(np.asarray(f32_out), np.asarray(f8_out))


def test_matmul_into_is_the_residual_plus_the_gemm():
    """``prequantized_matmul_into`` (the rollout's residual add inside its FP8 GEMM on the GPU) is ``residual +
    prequantized_matmul`` on the same FP8 operands: on CPU its dequantized operands round each product once more
    (~1e-7 of the output). The quantized input is pinned by a barrier and the dot takes the dequantized operands,
    the pattern XLA's GPU rewriter folds into the FP8 GEMM's scales and C operand."""
    recipe = Fp8Recipe()
    rng = np.random.RandomState(7)
    x = jnp.asarray(rng.randn(24, 96), jnp.bfloat16)
    w = jnp.asarray(rng.randn(96, 64) * 0.05, jnp.float32)
    r = jnp.asarray(rng.randn(24, 64) * 3, jnp.float32)
    st = _state(np.asarray(x, np.float32), np.asarray(w), np.ones((1,), np.float32), recipe)
    qk = xla.quantize_kernel(w, st["kernel"], recipe, "f8")
    s = st["x"]["scale"]
    want = r + xla.prequantized_matmul(x, qk, s, recipe, "f8")
    into = jax.jit(lambda r, x, qk: xla.prequantized_matmul_into(r, x, qk, s, recipe))
    got = into(r, x, qk)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    x8 = quantize(x, s, recipe.fwd_dtype)  # pre-quantized (the decode kernel's output for wo): the same GEMM
    np.testing.assert_array_equal(np.asarray(into(r, x8, qk)), np.asarray(got))
    hlo = into.lower(r, x, qk).as_text()
    assert hlo.count("optimization_barrier") == 1
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and dots[0].count("xf32>") == 3, dots
    with pytest.raises(ValueError, match="per-tensor"):
        xla.prequantized_matmul_into(r, x, qk, s, Fp8Recipe(scaling="rowwise"))


def test_cpu_form_kernel_holds_exact_e4m3_values():
    """A pre-quantized kernel in the ``f32`` form is the E4M3 kernel's values, transposed, bit for bit."""
    recipe = Fp8Recipe()
    w = np.random.RandomState(5).randn(64, 24).astype(np.float32) * 0.1
    meta = {"scale": jnp.float32(448 / (0.8 * np.abs(w).max())), "amax_history": jnp.zeros(16)}
    qk = xla.quantize_kernel(jnp.asarray(w), meta, recipe, "f32")
    assert qk.data.dtype == jnp.float32 and qk.shape == (64, 24)
    ref = np_quantize(w, float(meta["scale"]), E4M3).astype(np.float32).T
    np.testing.assert_array_equal(np.asarray(qk.data).view(np.uint32), ref.view(np.uint32))


def test_state_cotangent_carries_observed_amaxes():
    recipe = Fp8Recipe()
    rng = np.random.RandomState(3)
    x, w, g = rng.randn(16, 32), rng.randn(32, 16) * 0.1, rng.randn(16, 16) * 0.01
    x, w, g = (jnp.asarray(a, jnp.float32) for a in (x, w, g))
    st = init_linear_state(recipe)
    _, vjp = jax.vjp(lambda s: xla.fp8_matmul(x, w, s, recipe), st)
    (obs,) = vjp(g)
    for role, t in (("x", x), ("kernel", w), ("grad", g)):
        hist = np.asarray(obs[role]["amax_history"])
        assert hist[0] == np.abs(np.asarray(t)).max()
        assert not hist[1:].any() and float(obs[role]["scale"]) == 0.0


@pytest.mark.parametrize("form", xla.GEMM_FORMS)
def test_rowwise_forward_scales_each_token_and_channel_and_keeps_the_per_tensor_backward(form):
    rowwise, tensor = Fp8Recipe(scaling="rowwise"), Fp8Recipe()
    rng = np.random.RandomState(2)
    # rows and channels whose sizes span more than E4M3's range: what one scale per tensor handles worst
    x = (rng.randn(16, 64) * np.logspace(-4, 2, 16)[:, None]).astype(np.float32)
    x[3] = 0.0  # an all-zero token: scale 1, output 0
    w = (rng.randn(64, 24) * np.logspace(-5, 0, 24)[None, :]).astype(np.float32)
    g = (rng.randn(16, 24) * 1e-3).astype(np.float32)
    st = _state(x, w, g, tensor)
    y, vjp = jax.vjp(lambda a, b: xla.fp8_matmul(a, b, st, rowwise, form=form), jnp.asarray(x), jnp.asarray(w))
    # reference: each row of x and each column of w quantized with fp8_max / its own amax (ml_dtypes), f64 GEMM
    sx = np.where(np.abs(x).max(1) > 0, 448.0 / np.maximum(np.abs(x).max(1), 1e-30), 1.0).astype(np.float32)
    sw = (448.0 / np.abs(w).max(0)).astype(np.float32)
    qx = np.stack([np_quantize(r, s, E4M3) for r, s in zip(x, sx, strict=True)]).astype(np.float64)
    qw = np.stack([np_quantize(c, s, E4M3) for c, s in zip(w.T, sw, strict=True)]).T.astype(np.float64)
    y_ref = (qx / sx[:, None].astype(np.float64)) @ (qw / sw[None, :].astype(np.float64))
    np.testing.assert_allclose(np.asarray(y, np.float64), y_ref, rtol=2e-5, atol=1e-6 * np.abs(y_ref).max())
    assert np.all(np.asarray(y)[3] == 0.0)
    # closer to f32 than one delayed scale per tensor
    exact = x.astype(np.float64) @ w.astype(np.float64)
    per_tensor = np.asarray(xla.fp8_matmul(jnp.asarray(x), jnp.asarray(w), st, tensor, form=form), np.float64)
    rel = lambda a: np.abs(a - exact).sum(1) / np.abs(exact).sum(1).clip(1e-30)  # noqa: E731
    assert np.nanmean(rel(np.asarray(y, np.float64))) < 0.5 * np.nanmean(rel(per_tensor))
    # the backward is the per-tensor recipe's, bit for bit
    _, vjp_tensor = jax.vjp(lambda a, b: xla.fp8_matmul(a, b, st, tensor, form=form), jnp.asarray(x), jnp.asarray(w))
    for ours, theirs in zip(vjp(jnp.asarray(g)), vjp_tensor(jnp.asarray(g)), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_rowwise_scaling_is_refused_on_te():
    from fp8rl_jax.fp8.policy import Precision

    with pytest.raises(ValueError, match="xla backend only"):
        Precision(backend="te", recipe=Fp8Recipe(scaling="rowwise"))
    with pytest.raises(ValueError, match="scaling"):
        Fp8Recipe(scaling="blockwise")
