"""Block scaling's one-read quantizer (``block.tile_quantize_both``, its kernel in ``kernels.block_quantize``): the
kernel through Pallas' interpreter against ``block.tile_quantize`` of the array and of its transpose, bit for bit."""

import functools

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


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_column_blocks_equal_block_quantize_of_the_transpose(dtype):
    """``col_blocks``: the second form in 128 x 128 blocks (the wgrad's gradient under ``block_wgrad='grad_blocks'``),
    from the kernel and from XLA, is ``block.block_quantize(a.T)``, bit for bit; the rows form unchanged."""
    a = _data(256, 384)
    run = lambda impl: jax.jit(lambda a: block.tile_quantize_both(a, dtype, col_blocks=True, impl=impl))(a)
    (q, s), (qt, st) = run("pallas_interpret")
    (rq, rs), (rqt, rst) = run("xla")
    bq, bs = block.block_quantize(a.T, dtype)
    assert qt.shape == (384, 256) and st.shape == (3, 2)
    for got, want in ((qt, bq), (rqt, bq), (q, block.tile_quantize(a, dtype)[0])):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    for got, want in ((st, bs), (rst, bs), (s, rs)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(bs[0, 0]) == pytest.approx(float(a[3, 5]) / float(block.fp8_max(dtype)), rel=1e-6)  # the massive one
    with pytest.raises(ValueError, match="col_blocks is a form of cols"):
        block.tile_quantize_both(a, dtype, cols=False, col_blocks=True)
    with pytest.raises(ValueError, match="col_blocks is a form of cols"):
        block_quantize.quantize_tiles(a, dtype, cols=False, col_blocks=True, interpret=True)


def test_rows_alone_and_the_scales_edges():
    """The forward's form alone; a tile whose amax is a subnormal (where the device keeps subnormals fp8_max / amax
    overflows: F32_MAX; XLA:CPU treats it as 0: scale 1, as the kernel does here), one of a single tiny value."""
    a = np.array(_data(256, 256, jnp.float32))
    a[0, :128] = 0.0
    a[0, 7] = 1e-40  # subnormal: 448 / 1e-40 overflows f32
    a[1, :128] = 0.0
    a[1, 9] = -3e-38
    (q, s), cols = block.tile_quantize_both(jnp.asarray(a), jnp.float8_e4m3fn, cols=False, impl="pallas_interpret")
    assert cols is None
    rq, rs = block.tile_quantize(jnp.asarray(a), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(_bits(q), _bits(rq))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))
    with pytest.raises(ValueError, match="rows, cols or both"):
        block_quantize.quantize_tiles(jnp.asarray(a), jnp.float8_e4m3fn, rows=False, cols=False, interpret=True)


@pytest.mark.parametrize("block_rows", [16, 64])
def test_rows_alone_in_fewer_rows_a_program(block_rows):
    """The forward's form from programs of ``block_rows`` rows: the same bits; other forms and sizes refused."""
    a = _data(256, 384)
    got = block_quantize.quantize_tiles(a, jnp.float8_e4m3fn, cols=False, interpret=True, block_rows=block_rows)
    want = block_quantize.quantize_tiles(a, jnp.float8_e4m3fn, cols=False, interpret=True, block_rows=128)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    by_default = block_quantize.quantize_tiles(a, jnp.float8_e4m3fn, cols=False, interpret=True)  # 256 rows: 32
    for g, w in zip(by_default, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    for kwargs in ({"block_rows": block_rows}, {"block_rows": 48, "cols": False}, {"block_rows": 512, "cols": False}):
        with pytest.raises(ValueError, match="block_rows"):
            block_quantize.quantize_tiles(a, jnp.float8_e4m3fn, interpret=True, **kwargs)


def test_auto_takes_xla_off_the_gpu_and_for_sizes_128_does_not_divide():
    assert not block_quantize.fits(_data(200, 256))
    assert block_quantize.fits(_data(256, 256)) == (jax.default_backend() == "gpu")
    (q, _), _ = block.tile_quantize_both(_data(200, 300), jnp.float8_e4m3fn)  # auto: xla, any size
    assert q.shape == (200, 300)
    with pytest.raises(ValueError, match="128 dividing both"):
        block.tile_quantize_both(_data(200, 256), jnp.float8_e4m3fn, impl="pallas_interpret")
    with pytest.raises(ValueError, match="impl='cuda'"):
        block.tile_quantize_both(_data(256, 256), jnp.float8_e4m3fn, impl="cuda")


@pytest.mark.parametrize("rows, cols, col_blocks", [(True, True, False), (False, True, False), (True, False, False),
                                                    (True, True, True)])
def test_the_kernel_lowers_for_cuda(triton_ir, rows, cols, col_blocks):
    """Pallas' Triton lowering of the kernel on this host (a shape or op Triton's lowering refuses fails here): one
    kernel for the forms asked, two scale divisions a form (fp8_max / amax, then 1 / scale)."""
    a = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16)
    (ir,) = triton_ir(lambda a: block.tile_quantize_both(a, jnp.float8_e4m3fn, rows=rows, cols=cols,
                                                         col_blocks=col_blocks, impl="pallas"), a)
    assert ir.count("arith.divf") == 2 * (rows + cols)


def test_block_linear_backward_quantizes_through_the_kernels(monkeypatch, triton_ir):
    """Where the kernel fits, a block-scaled linear quantizes x in its forward, g's two forms and x's wgrad form in
    its backward, each with one kernel call (three in all)."""
    monkeypatch.setattr(block_quantize, "fits", lambda a: a.ndim == 2 and a.shape[0] % 128 == a.shape[1] % 128 == 0)
    recipe = Fp8Recipe(scaling="block", fp8_format="e4m3", block_gemm="mosaic")
    state = init_linear_state(recipe)

    def grads(x, w, g):
        y, vjp = jax.vjp(lambda x, w: xla.fp8_matmul(x, w, state, recipe, jnp.bfloat16, "f8"), x, w)
        return (y, *vjp(g))

    args = [jax.ShapeDtypeStruct(s, d) for s, d in (((256, 384), jnp.bfloat16), ((384, 512), jnp.float32),
                                                     ((256, 512), jnp.bfloat16))]
    assert len(triton_ir(grads, *args)) == 3
    assert len(triton_ir(lambda x, w, g: xla.fp8_matmul(x, w, state, recipe, jnp.bfloat16, "f8"), *args)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_gpu_kernels_equal_xla_bit_for_bit(dtype):
    """The compiled kernel against XLA's form on the GPU, every form (the blocks form too): Triton's division gives
    XLA's quotients (PTX's div.rn.f32 did not), the multiply and the rounding cast are the same, so every bit is equal
    (amaxes over 7 decades, a subnormal one among them)."""
    a = np.array(_data(1024, 2048, jnp.float32))
    rng = np.random.default_rng(1)
    a *= np.exp(rng.uniform(-8, 8, size=(1024, 1))).astype(np.float32)  # tile amaxes spread over e^16
    a[5, :128] = 0.0
    a[5, 3] = 1e-40
    a = jnp.asarray(a, jnp.bfloat16)
    for rows, cols, col_blocks in ((True, True, False), (False, True, False), (True, False, False),
                                   (True, True, True)):
        got, want = (jax.jit(functools.partial(block.tile_quantize_both, dtype=dtype, rows=rows, cols=cols,
                                               col_blocks=col_blocks, impl=impl))(a) for impl in ("pallas", "xla"))
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None)
            if g is not None:
                np.testing.assert_array_equal(_bits(g[0]), _bits(w[0]))
                np.testing.assert_array_equal(np.asarray(g[1]), np.asarray(w[1]))
    (rq, rs), _ = jax.jit(functools.partial(block.tile_quantize_both, dtype=dtype, cols=False, impl="xla"))(a)
    for block_rows in (16, 32, 64):  # the rows form from programs of fewer rows
        q, s_t = jax.jit(functools.partial(block_quantize.quantize_tiles, dtype=dtype, cols=False,
                                           block_rows=block_rows))(a)
        np.testing.assert_array_equal(_bits(q), _bits(rq))
        np.testing.assert_array_equal(np.asarray(s_t).T, np.asarray(rs))


def test_speed_script_runs_interpreted(tmp_path, benchmark_script):
    """benchmarks/block_quantize_speed.py end to end on its tiny tensors (kernel interpreted): every form and
    num_warps asked has a row with a time, and the bytes a form must move."""
    import json

    bench = benchmark_script("block_quantize_speed")
    out = tmp_path / "bench.json"
    bench.main(["--check", "--num-warps", "4,8", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * (3 + 1) and all(r["ms"] > 0 for r in rows)
    both = next(r for r in rows if r["tensor"] == "x" and r["form"] == "both")
    assert both["bytes"] == 256 * 256 * 2 + 2 * (256 * 256 + 256 * 2 * 4)  # BF16 read, two FP8 forms and scales
