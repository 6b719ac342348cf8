"""Block scaling's two-form quantizer (``block.tile_quantize_both``, kernels in ``kernels.block_quantize``): the
kernels through Pallas' interpreter against ``block.tile_quantize`` of the array and of its transpose, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import block, xla
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.kernels import block_quantize


def _data(p, c, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(p, c)).astype(np.float32) * np.exp(rng.normal(size=(1, c))).astype(np.float32)
    a[3, 5] = 3000.0  # a massive value: its row tile and its column tile only
    a[130:, 128:256] = 0.0  # all-zero tiles: scale 1
    return jnp.asarray(a, dtype)


def _bits(q):
    return np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_equal_tile_quantize_of_the_array_and_its_transpose(dtype, in_dtype):
    a = _data(256, 384, in_dtype)
    (q, s), (qt, st) = jax.jit(lambda a: block.tile_quantize_both(a, dtype, impl="pallas_interpret"))(a)
    (rq, rs), (rqt, rst) = jax.jit(lambda a: block.tile_quantize_both(a, dtype, impl="xla"))(a)
    assert q.dtype == qt.dtype == jnp.dtype(dtype) and q.shape == (256, 384) and qt.shape == (384, 256)
    assert s.shape == (256, 3) and st.shape == (384, 2)
    for got, want in ((q, rq), (qt, rqt)):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    for got, want in ((s, rs), (st, rst)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # and xla's form is tile_quantize itself
    np.testing.assert_array_equal(_bits(rqt), _bits(block.tile_quantize(a.T, dtype)[0]))


def test_columns_alone():
    a = _data(128, 256)
    rows, (qt, st) = block.tile_quantize_both(a, jnp.float8_e4m3fn, rows=False, impl="pallas_interpret")
    assert rows is None
    rqt, rst = block.tile_quantize(a.T, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(_bits(qt), _bits(rqt))
    np.testing.assert_array_equal(np.asarray(st), np.asarray(rst))


def test_auto_takes_xla_off_the_gpu_and_for_sizes_128_does_not_divide():
    assert not block_quantize.fits(_data(200, 256))
    assert block_quantize.fits(_data(256, 256)) == (jax.default_backend() == "gpu")
    (q, _), _ = block.tile_quantize_both(_data(200, 300), jnp.float8_e4m3fn)  # auto: xla, any size
    assert q.shape == (200, 300)
    with pytest.raises(ValueError, match="128 dividing both"):
        block.tile_quantize_both(_data(200, 256), jnp.float8_e4m3fn, impl="pallas_interpret")
    with pytest.raises(ValueError, match="impl='cuda'"):
        block.tile_quantize_both(_data(256, 256), jnp.float8_e4m3fn, impl="cuda")


def test_both_kernels_lower_for_cuda(triton_ir):
    """Pallas' Triton lowering of both kernels on this host (a shape or op Triton's lowering refuses fails here)."""
    a = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16)
    assert len(triton_ir(lambda a: block.tile_quantize_both(a, jnp.float8_e4m3fn, impl="pallas"), a)) == 2
    assert len(triton_ir(lambda a: block.tile_quantize_both(a, jnp.float8_e5m2, rows=False, impl="pallas"), a)) == 2


def test_block_linear_backward_quantizes_through_the_kernels(monkeypatch, triton_ir):
    """Where the kernels fit, a block-scaled linear's backward makes g's two forms with one pair of kernels and x's
    wgrad form with another (four Triton calls); its forward quantizes x with XLA's fusions."""
    monkeypatch.setattr(block_quantize, "fits", lambda a: a.ndim == 2 and a.shape[0] % 128 == a.shape[1] % 128 == 0)
    recipe = Fp8Recipe(scaling="block", fp8_format="e4m3")
    state = init_linear_state(recipe)

    def grads(x, w, g):
        y, vjp = jax.vjp(lambda x, w: xla.fp8_matmul(x, w, state, recipe, jnp.bfloat16, "f8"), x, w)
        return (y, *vjp(g))

    args = [jax.ShapeDtypeStruct(s, d) for s, d in (((256, 384), jnp.bfloat16), ((384, 512), jnp.float32),
                                                     ((256, 512), jnp.bfloat16))]
    assert len(triton_ir(grads, *args)) == 4
    assert len(triton_ir(lambda x, w, g: xla.fp8_matmul(x, w, state, recipe, jnp.bfloat16, "f8"), *args)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_gpu_kernels_equal_xla_bit_for_bit(dtype):
    """The compiled kernels against XLA's form on the GPU: the scales are XLA's in both (the division outside the
    kernel), the multiply and the rounding cast the same, so every bit equal."""
    a = _data(1024, 2048)
    got = jax.jit(lambda a: block.tile_quantize_both(a, dtype, impl="pallas"))(a)
    want = jax.jit(lambda a: block.tile_quantize_both(a, dtype, impl="xla"))(a)
    for (gq, gs), (wq, ws) in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(gq), _bits(wq))
        np.testing.assert_array_equal(np.asarray(gs), np.asarray(ws))
