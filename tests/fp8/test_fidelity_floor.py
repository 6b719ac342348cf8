"""``benchmarks/fidelity_floor.py``'s INT8 variants: block's quantizers patched to round each group to INT8 (against a
numpy reference written here), and the jaxpr check that an INT8 program holds no FP8 conversion."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import block, xla

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


@pytest.fixture
def floor(benchmark_script):
    """The script loaded (its import patches ``block`` and ``xla``), the patches undone afterwards."""
    saved = (block.scales_of, block.quantize, block.tile_quantize_both, xla.quantize, xla.mantissa_rounded,
             xla._general_matmul_fn, xla.dgrad, xla.wgrad)
    module = benchmark_script("fidelity_floor")
    yield module
    (block.scales_of, block.quantize, block.tile_quantize_both, xla.quantize, xla.mantissa_rounded,
     xla._general_matmul_fn, xla.dgrad, xla.wgrad) = saved
    block.BLOCK = module.WIDTH


def test_int8_tiles_are_each_groups_integers(floor):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 300)).astype(np.float32)
    x[1, 5] = 3000.0  # a massive value: its tile's grid step is 3000 / 127
    x[2, 128:256] = 0.0  # an all-zero tile: scale 1
    floor.MODE.update(patch="int8", int8_dtypes=None)
    q, inv = jax.jit(lambda a: block.tile_quantize(a, E4M3))(x)
    q, inv = np.asarray(q), np.asarray(inv)
    assert q.dtype == np.float32 and inv.shape == (3, 3)
    padded = np.pad(x, [(0, 0), (0, 84)]).reshape(3, 3, 128)
    amax = np.abs(padded).max(-1)
    scale = np.divide(np.float32(127.0), amax, out=np.ones_like(amax), where=amax > 0)
    want = np.clip(np.round(padded * scale[..., None]), -127, 127).reshape(3, -1)[:, :300]
    np.testing.assert_array_equal(q, want)
    np.testing.assert_array_equal(inv, (np.float32(1.0) / scale).astype(np.float32))
    assert np.abs(q[1, :128]).max() == 127 and (np.abs(q[1, :128]) < 1).sum() > 100  # the massive tile's rest ~ 0
    # under a hybrid form only E4M3 operands are INT8: an E5M2 gradient stays FP8
    floor.MODE.update(int8_dtypes={jnp.dtype(E4M3)})
    assert block.tile_quantize(x, E5M2)[0].dtype == E5M2
    assert block.tile_quantize(x, E4M3)[0].dtype == np.float32
    floor.MODE.update(patch=None, int8_dtypes=None)
    assert block.tile_quantize(x, E4M3)[0].dtype == E4M3


def test_fp8_casts_finds_conversions_in_nested_programs(floor):
    def loss(x):
        def body(carry, row):
            return carry + jnp.sum(row.astype(E4M3).astype(jnp.float32) ** 2), None
        return jax.lax.scan(body, 0.0, x)[0]

    x = jnp.ones((2, 4))
    assert floor.fp8_casts(jax.jit(loss), x) == {"float8_e4m3fn": 1}
    assert floor.fp8_casts(jax.jit(jax.grad(loss)), x).get("float8_e4m3fn", 0) >= 1
    assert floor.fp8_casts(jax.jit(lambda a: jnp.sum(a ** 2)), x) == {}


def matmul_and_grads(x, w, cot):
    """``xla.fp8_matmul(x, w)`` under the floor's recipe (the script's MODE decides its rounding) and the gradients
    of ``sum(y * cot)``: [y, dx, dw] as numpy."""
    from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state

    recipe = Fp8Recipe(scaling="mantissa", fp8_format="e4m3")
    state = init_linear_state(recipe)

    def loss(a, b):
        y = xla.fp8_matmul(a, b, state, recipe, jnp.float32)
        return jnp.sum(y * cot), y
    (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
    return [np.asarray(v) for v in (y, *grads)]


@pytest.mark.parametrize("change", [{"smooth": 0.5}, {"rotate": True}], ids=["smooth", "hadamard"])
def test_smoothing_and_rotation_change_no_product_before_rounding(floor, change):
    """The ``_smooth`` variants' x / s and s * w, and the ``_hadamard`` variants' x H and H^T w: with the probe's floor
    at f32's 23 mantissa bits (no rounding), the matmul and both its gradients equal the plain ones to f32 rounding,
    for a massive input channel too."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 256)).astype(np.float32)
    x[:, 7] *= 3000.0  # a massive channel: s_7 large
    w = (rng.normal(size=(256, 64)) * 0.05).astype(np.float32)
    cot = rng.normal(size=(16, 64)).astype(np.float32)
    run = lambda: matmul_and_grads(x, w, cot)  # noqa: E731

    plain_mode = dict(smooth=None, rotate=False)
    floor.MODE.update(patch=None, c=1.0, bits=23, **plain_mode)
    plain = run()
    floor.MODE.update(change)
    changed = run()
    floor.MODE.update(bits=None, **plain_mode)
    for a, b in zip(plain, changed, strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-5 * float(np.abs(a).max()))
    floor.MODE.update(bits=3, **plain_mode)  # with rounding the change moves the result: the test can tell
    rounded = run()
    floor.MODE.update(change)
    assert not np.allclose(run()[0], rounded[0])
    floor.MODE.update(bits=None, **plain_mode)


def test_forward_rotation_has_the_rotated_value_and_the_plain_gradient(floor):
    """``rotate="fwd"`` (``int8_fwd_*_hadamard``): with the floor's rounding on (3 mantissa bits), the matmul's value
    is the rotated one's (to f32 rounding) and both its gradients are the plain matmul's."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 256)).astype(np.float32)
    w = (rng.normal(size=(256, 64)) * 0.05).astype(np.float32)
    cot = rng.normal(size=(16, 64)).astype(np.float32)

    def run(rotate):
        floor.MODE.update(patch=None, c=1.0, bits=3, smooth=None, rotate=rotate)
        return matmul_and_grads(x, w, cot)

    plain, rotated, forward = run(False), run(True), run("fwd")
    floor.MODE.update(bits=None, rotate=False)
    np.testing.assert_allclose(forward[0], rotated[0], rtol=1e-6, atol=1e-6 * float(np.abs(rotated[0]).max()))
    assert not np.allclose(rotated[0], plain[0])  # the rotation moves the rounded value: the test can tell
    for a, b, c in zip(forward[1:], plain[1:], rotated[1:], strict=True):
        np.testing.assert_array_equal(a, b)
        assert not np.allclose(b, c)


def test_hadamard_is_block_diagonal_and_orthonormal(floor):
    """``hadamard(k)``: orthonormal, symmetric, in blocks of the largest power of 2 up to 128 dividing k (64 for
    SmolLM2's 576, 128 for 1536), each block +-1 / sqrt(block)."""
    for k, b in ((576, 64), (1536, 128), (96, 32)):
        h = floor.hadamard(k)
        np.testing.assert_allclose(h @ h.T, np.eye(k), atol=1e-6)
        np.testing.assert_array_equal(h, h.T)
        np.testing.assert_allclose(np.abs(h[:b, :b]), 1 / np.sqrt(b), rtol=1e-6)
        assert not h[:b, b:].any() and not h[b:, :b].any()


def test_forward_only_variants_leave_the_backward_as_shipped(floor):
    """``int8_fwd_*``: the forward's input tiles (``cols=False``) in INT8 groups of 32; the gradient's tiles (the
    backward's calls, cols kept) in E4M3 groups of 128, and the patch back on after them."""
    x = np.random.default_rng(2).normal(size=(128, 256)).astype(np.float32)
    floor.MODE.update(patch="int8", int8_dtypes=None, fwd_only=True)
    block.BLOCK = 32
    (q, inv), _ = block.tile_quantize_both(x, E4M3, cols=False, impl="xla")
    assert q.dtype == np.float32 and inv.shape == (128, 8)
    (gq, ginv), (tq, tinv) = block.tile_quantize_both(x, E4M3, impl="xla")
    assert gq.dtype == E4M3 and ginv.shape == (128, 2) and tq.dtype == E4M3 and tinv.shape == (256, 1)
    assert floor.MODE["patch"] == "int8" and block.BLOCK == 32
    floor.MODE.update(fwd_only=False)
    assert block.tile_quantize_both(x, E4M3, impl="xla")[0][0].dtype == np.float32
