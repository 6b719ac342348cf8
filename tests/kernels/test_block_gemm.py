"""``kernels.block_gemm``: the Mosaic GPU block-scaled FP8 GEMM against ``fp8.block.block_gemm``.

On the CPU: the kernel lowered for CUDA on this host (the Mosaic GPU module, whose MMAs must be Hopper's E4M3 x
E4M3 -> f32 wgmma), and run through Pallas' Mosaic GPU interpreter (the same kernel body, qb given as [C, Q]: the
interpreter's wgmma takes no transposed operand; its MMA sums in f32 as numpy does). On the GPU (``gpu`` marker):
the compiled kernel. Its wgmma sums a 128-deep slice with fewer bits than f32 (DeepSeek-V3, section 3.3.2: about
14); XLA's FP8 dot in the emulation sums in f32 for some shapes and as the kernel does for others (on the H100:
within 4e-7 of f32's sums, or the kernel's own error, 1.3e-3 of the magnitude at most), so random data bounds the
kernel by the MMA's precision; operands
whose slice sums are exact in any accumulator (small integers) make the two sum the same values, and the kernel
must then equal block_gemm to f32 rounding of the scaled partial sums. The FP8 linear (``fp8.xla``) under block
scaling runs its three GEMMs through the kernel where ``runs_here`` says so: checked lowered on the CPU, and run
on the GPU against the emulation.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_operands import U, f32_bound, integers, magnitude, quantized

from fp8rl_jax.fp8 import block, xla
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.kernels import block_gemm as block_kernel
from fp8rl_jax.kernels.block_gemm import Tuning, block_gemm_mgpu

WGMMA_E4M3 = b"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"
FORMS = ("blocks", "rows_of_blocks", "rows")  # b's scales: a weight's blocks, the same as rows, any per-row scales


# ----------------------------------------------------------------------------------------------------------
# CPU: lowering for CUDA, and Pallas' Mosaic GPU interpreter


@pytest.mark.parametrize("p,q,c,form,out_dtype", [
    (200, 576, 1536, "blocks", jnp.float32),  # SmolLM2's hidden size: padded rows, columns
    (200, 576, 1536, "rows", jnp.bfloat16),
    (4096, 4096, 4096, "blocks", jnp.float32),
])
def test_lowers_for_cuda_to_fp8_wgmma(p, q, c, form, out_dtype, mosaic_modules):
    """On this CPU host: one Mosaic GPU kernel whose MMAs are Hopper's E4M3 x E4M3 -> f32 wgmma, 64 x 128 x 32 (a
    layout, shape or shared-memory budget that Mosaic GPU rejects fails here, at lowering); ``Tuning()`` at any P."""
    cb = block.num_blocks(c)
    sb_rows = q if form == "rows" else block.num_blocks(q)
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((p, c), jnp.float8_e4m3fn), ((p, cb), jnp.float32),
                                                       ((q, c), jnp.float8_e4m3fn), ((sb_rows, cb), jnp.float32)]]
    [module] = mosaic_modules(lambda *a: block_gemm_mgpu(*a, out_dtype=out_dtype, tuning=Tuning()), *args)
    assert WGMMA_E4M3 in module


def test_cluster_of_two_lowers_for_cuda(mosaic_modules):
    """Two CTAs a cluster, qb's slice multicast to both (``Tuning.cluster=2``; Pallas' Mosaic GPU interpreter has no
    clusters: the GPU tests run it)."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((300, 1100), jnp.float8_e4m3fn), ((300, 9), jnp.float32),
                                                       ((260, 1100), jnp.float8_e4m3fn), ((3, 9), jnp.float32)]]
    [module] = mosaic_modules(lambda *a: block_gemm_mgpu(*a, tuning=Tuning(cluster=2)), *args)
    assert WGMMA_E4M3 in module
    with pytest.raises(ValueError, match="cluster"):
        block_gemm_mgpu(*[jnp.zeros(a.shape, a.dtype) for a in args], tuning=Tuning(cluster=3))


def test_tiles_of_64_columns_lower_to_n64_wgmma(mosaic_modules):
    """``Tuning.tile_n=64`` (a decode step's small M: twice the tiles): 64 x 64 x 32 MMAs; other widths refused."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((256, 2048), jnp.float8_e4m3fn), ((256, 16), jnp.float32),
                                                       ((3072, 2048), jnp.float8_e4m3fn), ((24, 16), jnp.float32)]]
    [module] = mosaic_modules(lambda *a: block_gemm_mgpu(*a, tuning=Tuning(tile_n=64)), *args)
    assert WGMMA_E4M3.replace(b"n128", b"n64") in module
    with pytest.raises(ValueError, match="tile_n"):
        block_gemm_mgpu(*[jnp.zeros(a.shape, a.dtype) for a in args], tuning=Tuning(tile_n=32))


def test_split_contraction_lowers_for_cuda(mosaic_modules):
    """``Tuning.splits`` (split-K) with a decode step's tuning, w_down's shape: one kernel writing f32 partials,
    named by its shape and tuning (so a step's profile tells its GEMMs apart), and a split count that does not
    divide the slices refused."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((256, 8192), jnp.float8_e4m3fn), ((256, 64), jnp.float32),
                                                       ((2048, 8192), jnp.float8_e4m3fn), ((16, 64), jnp.float32)]]
    tuning = Tuning(cluster=2, tile_n=64, splits=4)
    [module] = mosaic_modules(lambda *a: block_gemm_mgpu(*a, out_dtype=jnp.bfloat16, tuning=tuning), *args)
    assert WGMMA_E4M3.replace(b"n128", b"n64") in module
    assert b"block_gemm_fp8_256x2048x8192_n64_c2_k4" in module
    out = jax.eval_shape(lambda *a: block_gemm_mgpu(*a, out_dtype=jnp.bfloat16, tuning=tuning), *args)
    assert out.shape == (256, 2048) and out.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="splits=3 must divide"):
        block_gemm_mgpu(*[jnp.zeros(a.shape, a.dtype) for a in args], tuning=Tuning(splits=3))


def test_shared_memory_budget_is_checked_at_lowering(mosaic_modules):
    """Six stages and an f32 tile need 259 KiB of shared memory, past the 227 KiB a Hopper block gets: lowering
    says so (the default of four fits: the test above)."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((256, 1024), jnp.float8_e4m3fn), ((256, 8), jnp.float32),
                                                       ((256, 1024), jnp.float8_e4m3fn), ((2, 8), jnp.float32)]]
    with pytest.raises(Exception, match="shared memory"):
        mosaic_modules(lambda *a: block_gemm_mgpu(*a, tuning=Tuning(stages=6)), *args)


# the interpreter's tests against block_gemm on the CPU (on a GPU block_gemm's FP8 dots sum with the MMA's precision)
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter's tests run on the CPU")


@cpu_only
@pytest.mark.parametrize("tile_n", [128, 64])
@pytest.mark.parametrize("form", FORMS)
def test_interpreter_matches_block_gemm(form, tile_n):
    """The kernel through the Mosaic GPU interpreter (2 CTAs walking 3 x 3 tiles, or 3 x 5 of 64 columns, 9 slices
    through 2 stages, sizes padded on every axis) against block_gemm on this CPU: both sum in f32, so within twice
    f32's bound."""
    p, q, c = 300, 260, 1100
    qa, sa, qb, sb, rows = quantized(p, q, c, form)
    got = block_gemm_mgpu(qa, sa, qb, sb, interpret=True, tuning=Tuning(num_sms=2, stages=2, tile_n=tile_n))
    want = jax.jit(block.block_gemm)(qa, sa, qb, rows)
    assert got.shape == (p, q) and got.dtype == jnp.float32
    err = np.abs(np.asarray(got) - np.asarray(want))
    assert (err <= 2 * f32_bound(c, magnitude(qa, sa, qb, rows))).all(), err.max()


@cpu_only
@pytest.mark.parametrize("form", FORMS)
def test_interpreter_split_contraction_matches_block_gemm(form):
    """Split-K through the interpreter: 9 slices in 3 runs of 3, each tile's partials summed after the kernel;
    against block_gemm within twice f32's bound (the sum's order differs)."""
    p, q, c = 300, 260, 1100
    qa, sa, qb, sb, rows = quantized(p, q, c, form)
    got = block_gemm_mgpu(qa, sa, qb, sb, jnp.bfloat16, interpret=True, tuning=Tuning(num_sms=2, stages=2, splits=3))
    want = jax.jit(block.block_gemm)(qa, sa, qb, rows)
    assert got.shape == (p, q) and got.dtype == jnp.bfloat16
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want.astype(jnp.bfloat16), np.float32))
    bf16_ulp = 2.0**-7 * np.abs(np.asarray(want))
    assert (err <= bf16_ulp + 2 * f32_bound(c, magnitude(qa, sa, qb, rows))).all(), err.max()


@cpu_only
@pytest.mark.parametrize("stages", [2, 4])
def test_interpreter_chained_tiles_match_block_gemm(stages):
    """``Tuning.chain``: each of 2 CTAs runs its 4 or 5 tiles (3 x 3) as one pipeline of 8 slices each, through the
    interpreter with its race detector on; against block_gemm within twice f32's bound, and no race."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    p, q, c = 300, 260, 1024
    qa, sa, qb, sb, rows = quantized(p, q, c, "blocks")
    params = InterpretGPUParams(uninitialized_memory="zero", detect_races=True)
    got = block_gemm_mgpu(qa, sa, qb, sb, interpret=params, tuning=Tuning(num_sms=2, stages=stages, chain=True))
    assert not gpu_callbacks.get_races().races_found
    want = jax.jit(block.block_gemm)(qa, sa, qb, rows)
    err = np.abs(np.asarray(got) - np.asarray(want))
    assert (err <= 2 * f32_bound(c, magnitude(qa, sa, qb, rows))).all(), err.max()


@cpu_only
@pytest.mark.parametrize("c,tuning,form", [
    (1100, Tuning(num_sms=2, stages=2, pair=True, splits=3), "blocks"),  # runs of 3 slices, each padded to 4
    (1024, Tuning(num_sms=2, stages=2, pair=True, chain=True, tile_n=64), "rows"),
], ids=["split_odd_runs", "chained_64_columns"])
def test_interpreter_paired_slices_match_block_gemm(c, tuning, form):
    """``Tuning.pair`` (two slices a pipeline step, the second's MMA running while the first's product is added)
    through the interpreter with its race detector on: against block_gemm within twice f32's bound, and no race."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    qa, sa, qb, sb, rows = quantized(300, 260, c, form)
    params = InterpretGPUParams(uninitialized_memory="zero", detect_races=True)
    got = block_gemm_mgpu(qa, sa, qb, sb, interpret=params, tuning=tuning)
    assert not gpu_callbacks.get_races().races_found
    want = jax.jit(block.block_gemm)(qa, sa, qb, rows)
    err = np.abs(np.asarray(got) - np.asarray(want))
    assert (err <= 2 * f32_bound(c, magnitude(qa, sa, qb, rows))).all(), err.max()


def test_paired_slices_lower_to_two_mma_groups(mosaic_modules):
    """``Tuning.pair`` lowers to two wgmma groups a step, the first waited for while the second runs (a wait for
    one group in flight, then for none); a third stage of two slices no longer fits in shared memory."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir

    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((4096, 2048), jnp.float8_e4m3fn), ((4096, 16), jnp.float32),
                                                       ((3072, 2048), jnp.float8_e4m3fn), ((24, 16), jnp.float32)]]
    [module] = mosaic_modules(lambda *a: block_gemm_mgpu(*a, tuning=Tuning(cluster=2, pair=True, stages=2)), *args)
    context = jax_mlir.make_ir_context()
    context.allow_unregistered_dialects = True
    with context:
        text = ir.Module.parse(module).operation.get_asm(enable_debug_info=False)
    waits = [line for line in text.splitlines() if "nvvm.wgmma.wait.group.sync.aligned" in line]
    assert len(waits) == 2 and "group = 1" in waits[0] and "group = 0" in waits[1], waits
    with pytest.raises(Exception, match="shared memory"):
        mosaic_modules(lambda *a: block_gemm_mgpu(*a, jnp.bfloat16, tuning=Tuning(pair=True, stages=3)), *args)


def test_chained_tiles_lower_for_cuda(mosaic_modules):
    """``Tuning.chain`` with 2-CTA clusters at a training step's q|k|v shape lowers to one kernel, and so does the
    default there (pair and chain, named so); stages that do not divide a tile's steps are refused."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((4096, 2048), jnp.float8_e4m3fn), ((4096, 16), jnp.float32),
                                                       ((3072, 2048), jnp.float8_e4m3fn), ((24, 16), jnp.float32)]]
    tuning = Tuning(cluster=2, chain=True)
    [module] = mosaic_modules(lambda *a: block_gemm_mgpu(*a, out_dtype=jnp.bfloat16, tuning=tuning), *args)
    assert WGMMA_E4M3 in module
    # the default at these rows (LARGE_M_TUNING): slices in pairs, tiles chained, both in the kernel's name
    [module] = mosaic_modules(lambda *a: block_gemm_mgpu(*a, out_dtype=jnp.bfloat16), *args)
    assert b"block_gemm_fp8_4096x3072x2048_n128_c1_k1_pair_chain" in module
    with pytest.raises(ValueError, match="chain needs stages=3 to divide a tile's 16"):
        mosaic_modules(lambda *a: block_gemm_mgpu(*a, tuning=Tuning(chain=True, stages=3)), *args)


@cpu_only
def test_interpreter_bf16_output_is_the_f32_result_rounded():
    qa, sa, qb, sb, _ = quantized(130, 200, 256, "blocks", seed=1)
    run = lambda dtype: block_gemm_mgpu(qa, sa, qb, sb, dtype, interpret=True, tuning=Tuning(num_sms=2))
    got = run(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16 and got.shape == (130, 200)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(run(jnp.float32).astype(jnp.bfloat16),
                                                                          np.float32))


def test_bad_input_is_named():
    qa, sa, qb, sb, rows = quantized(64, 64, 256, "blocks")
    with pytest.raises(ValueError, match="FP8"):
        block_gemm_mgpu(qa.astype(jnp.bfloat16), sa, qb, sb)
    with pytest.raises(ValueError, match="FP8"):
        block_gemm_mgpu(qa, sa, qb.astype(jnp.float8_e5m2), sb)
    with pytest.raises(ValueError, match="b_scale_inv"):
        block_gemm_mgpu(qa, sa, qb, sb[:, :1])
    with pytest.raises(ValueError, match="a_scale_inv"):
        block_gemm_mgpu(qa, sa.T, qb, sb)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        block_gemm_mgpu(qa, sa, qb, sb, jnp.float16)


# ----------------------------------------------------------------------------------------------------------
# GPU: the compiled kernel

GPU_CASES = [  # p, q, c, form
    (128, 128, 128, "blocks"),  # one tile, one slice
    (200, 576, 1536, "blocks"),  # SmolLM2-ish: padded rows and columns
    (200, 576, 1536, "rows_of_blocks"),
    (200, 576, 1536, "rows"),
    (576, 1536, 2000, "rows"),  # a wgrad's shape (K = tokens, not a multiple of 128)
    (4096, 4096, 4096, "blocks"),  # LLM-ish: 1024 tiles over the multiprocessors, 32 slices
]


@pytest.mark.gpu
@pytest.mark.parametrize("cluster,tile_n", [(1, 128), (2, 128), (1, 64), (2, 64)])
@pytest.mark.parametrize("p,q,c,form", GPU_CASES)
def test_gpu_exact_slice_sums_equal_block_gemm(p, q, c, form, cluster, tile_n):
    """Small-integer operands: every slice's MMA sum is exact in the kernel as in the emulation, so the two add the
    same scaled partial sums in the same order and differ only where one contracts ``acc + part * scale`` into an
    FMA (at most one f32 rounding of each product); then BF16 output is that f32 result rounded."""
    qa, sa, qb, sb, rows = integers(p, q, c, form)
    tuning = Tuning(cluster=cluster, tile_n=tile_n)
    got = jax.jit(lambda *a: block_gemm_mgpu(*a, tuning=tuning))(qa, sa, qb, sb)
    want = jax.jit(block.block_gemm)(qa, sa, qb, rows)
    assert got.shape == (p, q) and got.dtype == jnp.float32
    mag = np.asarray(magnitude(qa, sa, qb, rows))
    err = np.abs(np.asarray(got) - np.asarray(want))
    tol = (3 * block.num_blocks(c) + 4) * U * mag  # an FMA's one rounding a slice against two
    assert (err <= tol).all(), f"max err {err.max()}, max err / magnitude {(err / np.maximum(mag, 1e-30)).max()}"
    got16 = jax.jit(lambda *a: block_gemm_mgpu(*a, jnp.bfloat16, tuning=tuning))(qa, sa, qb, sb)
    np.testing.assert_array_equal(np.asarray(got16, np.float32), np.asarray(got.astype(jnp.bfloat16), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(chain=True), dict(pair=True, stages=2),
                                     dict(pair=True, stages=2, chain=True)], ids=["chain", "pair", "pair_chain"])
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("p,q,c,form", [(4096, 4096, 4096, "blocks"), (2048, 3072, 2048, "rows"),
                                        (200, 576, 1536 + 128, "blocks")])
def test_gpu_kernel_variants_equal_block_gemm(p, q, c, form, cluster, variant):
    """``Tuning.chain`` (a CTA's tiles as one pipeline) and ``Tuning.pair`` (two slices a step; 13 slices: one zero
    slice added) on small-integer operands: the same bound as the plain kernel's exact test."""
    qa, sa, qb, sb, rows = integers(p, q, c, form)
    tuning = Tuning(cluster=cluster, **variant)
    if tuning.chain and -(-block.num_blocks(c) // (1 + tuning.pair)) % tuning.stages:  # 13 slices: 13 or 7 steps
        with pytest.raises(ValueError, match="Tuning.chain needs stages"):
            block_gemm_mgpu(qa, sa, qb, sb, tuning=tuning)
        return
    got = jax.jit(lambda *a: block_gemm_mgpu(*a, tuning=tuning))(qa, sa, qb, sb)
    want = jax.jit(block.block_gemm)(qa, sa, qb, rows)
    mag = np.asarray(magnitude(qa, sa, qb, rows))
    err = np.abs(np.asarray(got) - np.asarray(want))
    assert (err <= (3 * block.num_blocks(c) + 4) * U * mag).all(), err.max()


@pytest.mark.gpu
@pytest.mark.parametrize("p,q,c,form,tuning", [
    (256, 2048, 8192, "blocks", Tuning(cluster=2, tile_n=64, splits=4)),  # a decode step's w_down
    (256, 3072, 2048, "blocks", Tuning(cluster=2, tile_n=64, splits=2)),  # its q|k|v
    (200, 576, 1536, "rows", Tuning(splits=3)),
])
def test_gpu_split_contraction_equals_block_gemm(p, q, c, form, tuning):
    """Split-K on small-integer operands (exact slice sums): the partials' sum in another order, within the same
    bound as one run; the BF16 output is the partials' f32 sum rounded. XLA sums the partials in its own order, which
    may differ between the f32 and the BF16 program (an H200 did at 256 x 2048 x 8192 in 4 splits: 11 of 524,288
    values a BF16 unit apart, f32 sums on either side of a BF16 midpoint), so the BF16 value is the rounding of the
    f32 result moved by up to the f32 errors of summing ``splits`` partials."""
    qa, sa, qb, sb, rows = integers(p, q, c, form)
    got = jax.jit(lambda *a: block_gemm_mgpu(*a, tuning=tuning))(qa, sa, qb, sb)
    want = jax.jit(block.block_gemm)(qa, sa, qb, rows)
    mag = np.asarray(magnitude(qa, sa, qb, rows))
    err = np.abs(np.asarray(got) - np.asarray(want))
    assert (err <= (3 * block.num_blocks(c) + 4) * U * mag).all(), err.max()
    got16 = np.asarray(jax.jit(lambda *a: block_gemm_mgpu(*a, jnp.bfloat16, tuning=tuning))(qa, sa, qb, sb),
                       np.float32)
    order = tuning.splits * 2 * U * mag  # two f32 sums of the partials in any orders: this far apart at most
    rounded = [np.asarray(jnp.asarray(np.asarray(got) + d).astype(jnp.bfloat16), np.float32)
               for d in (-order, 0, order)]
    assert ((got16 == rounded[0]) | (got16 == rounded[1]) | (got16 == rounded[2])).all()
    assert (got16 != rounded[1]).mean() < 1e-3  # only values at a midpoint


@pytest.mark.gpu
@pytest.mark.parametrize("p,q,c,form", GPU_CASES)
def test_gpu_quantized_data_within_fp8_accumulation_of_block_gemm(p, q, c, form):
    """Block-quantized random data with massive values: the kernel against the same sum with f32 products and sums
    (block_gemm of the FP8 values as f32, at 'highest' precision). Hopper's FP8 MMA keeps about 14 bits while it
    sums a slice: within 2**-8 of the magnitude (a loose bound on 13-bit sums of 32 aligned products a step; the
    H100 gave 0.9e-3 to 1.3e-3 here). The emulation's precision on the GPU is that of the GEMM XLA picks: f32's
    on the H100 for some of these shapes (4e-7), the kernel's for others (equal errors): only reported."""
    qa, sa, qb, sb, rows = quantized(p, q, c, form)
    got = np.asarray(jax.jit(block_gemm_mgpu)(qa, sa, qb, sb))
    emulated = np.asarray(jax.jit(block.block_gemm)(qa, sa, qb, rows))
    with jax.default_matmul_precision("highest"):
        exact = np.asarray(jax.jit(block.block_gemm)(qa.astype(jnp.float32), sa, qb.astype(jnp.float32), rows))
    mag = np.asarray(magnitude(qa, sa, qb, rows))
    err, err_emulated = np.abs(got - exact), np.abs(emulated - exact)
    relative = lambda e: (e / np.maximum(mag, 1e-30)).max()
    note = (f"max err / magnitude: kernel {relative(err):.3g}, emulation {relative(err_emulated):.3g}; max err "
            f"{err.max():.3g} against {err_emulated.max():.3g}")
    assert (err <= 2.0**-8 * mag + f32_bound(c, mag)).all(), note


# ----------------------------------------------------------------------------------------------------------
# the FP8 linear under block scaling: its fprop, dgrad and wgrad through the kernel

E4M3_BLOCK = Fp8Recipe(scaling="block", fp8_format="e4m3", block_gemm="mosaic")  # the kernel under test


def _linear_operands(m=300, k=576, n=1536, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[3, 4] = 3000.0
    w = (0.05 * rng.normal(size=(k, n))).astype(np.float32)
    g = (1e-3 * rng.normal(size=(m, n))).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)


def _linear_grads(recipe, form=None, out_dtype=jnp.float32):
    """(y, dx, dw) of ``xla.fp8_matmul`` under ``recipe``, as one function of (x, w, g)."""
    state = init_linear_state(recipe)

    def run(x, w, g):
        y, vjp = jax.vjp(lambda x, w: xla.fp8_matmul(x, w, state, recipe, out_dtype, form), x, w)
        return (y, *vjp(g))

    return run


@pytest.mark.parametrize("recipe,kernels", [(E4M3_BLOCK, 3), (Fp8Recipe(scaling="block", block_gemm="mosaic"), 1)],
                         ids=["e4m3", "hybrid"])
def test_block_linear_lowers_its_gemms_to_the_kernel(monkeypatch, recipe, kernels, mosaic_modules):
    """Where ``runs_here`` holds (a Hopper GPU, no mesh of several devices), the linear's fprop, dgrad and wgrad are
    the kernel, lowered for CUDA on this host; E5M2 gradients (``hybrid``) meet E4M3 operands in the dgrad and the
    wgrad, which the kernel's one wgmma type does not take: those stay the emulation's."""
    monkeypatch.setattr(block_kernel, "runs_here", lambda qa, qb: qa.dtype == qb.dtype)
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((300, 576), (576, 1536), (300, 1536))]
    assert len(mosaic_modules(_linear_grads(recipe, "f8"), *args)) == kernels


def test_block_linear_writes_a_bf16_input_gradient_from_the_kernel(monkeypatch):
    """A BF16 input's gradient leaves the dgrad kernel in BF16 (its f32 sum rounded once, as a cast of an f32 output
    would be, without the f32 array): the forward's and the dgrad's kernels write BF16, the wgrad's f32 (the f32
    master weight's gradient)."""
    import re

    monkeypatch.setattr(block_kernel, "runs_here", lambda qa, qb: qa.dtype == qb.dtype)
    args = [jax.ShapeDtypeStruct(s, d) for s, d in (((384, 512), jnp.bfloat16), ((512, 384), jnp.float32),
                                                     ((384, 384), jnp.bfloat16))]
    grads = _linear_grads(E4M3_BLOCK, "f8", jnp.bfloat16)
    text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    outs = re.findall(r'stablehlo\.custom_call @mosaic_gpu_v2\(.*?\) \{.*?\} : \(.*?\) -> tensor<(\d+)x(\d+)x(\w+)>',
                      text)
    assert sorted(outs) == sorted([("384", "384", "bf16"), ("384", "512", "bf16"), ("512", "384", "f32")])


def test_runs_here_is_false_off_a_hopper_gpu():
    qa = jnp.zeros((128, 128), jnp.float8_e4m3fn)
    assert block_kernel.runs_here(qa, qa) == (jax.default_backend() == "gpu"
                                              and jax.devices()[0].compute_capability == "9.0")
    assert not block_kernel.runs_here(qa, qa.astype(jnp.float8_e5m2))


@pytest.mark.gpu
def test_gpu_block_linear_runs_the_kernel_and_matches_the_emulation(monkeypatch, mosaic_modules):
    """On the GPU the linear's three GEMMs are the kernel (in the compiled program), and y, dx and dw come within
    the MMA's slice precision of the same linear on block_gemm's emulation."""
    x, w, g = _linear_operands()
    assert len(mosaic_modules(_linear_grads(E4M3_BLOCK), x, w, g)) == 3
    got = jax.jit(_linear_grads(E4M3_BLOCK))(x, w, g)
    monkeypatch.setattr(block_kernel, "runs_here", lambda qa, qb: False)
    want = jax.jit(_linear_grads(E4M3_BLOCK))(x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 2.0**-9 * np.linalg.norm(b), (name, np.linalg.norm(a - b) / np.linalg.norm(b))


def test_a_decode_steps_rows_take_the_small_m_tuning():
    """Up to SMALL_M rows: 2-CTA clusters of 64-column tiles; more rows: slices in pairs, tiles chained where the 2
    stages divide a tile's steps; the interpreter (no clusters): Tuning()."""
    assert block_kernel.default_tuning(block_kernel.SMALL_M) == block_kernel.Tuning(cluster=2, tile_n=64)
    large = block_kernel.Tuning(stages=2, pair=True)
    for slices, chain in ((16, True), (64, True), (320, True), (15, True), (13, False), (14, False), (1, False)):
        assert block_kernel.default_tuning(block_kernel.SMALL_M + 1, slices=slices) == dataclasses.replace(
            large, chain=chain), slices
    # a llama1b decode step (132 multiprocessors off a GPU): q|k|v's 48 tiles of 128 columns become 96 of 64; w_down's
    # 64 also split its 64 slices in two (o's 16 slices stay whole); gate|up's 256 tiles of 128 columns stay so
    small = block_kernel.Tuning(cluster=2, tile_n=64)
    for cols, slices, tuning in ((3072, 16, small), (2048, 16, small), (2048, 32, dataclasses.replace(small, splits=2)),
                                 (2048, 64, dataclasses.replace(small, splits=2)), (2048, 15, small),
                                 (16384, 16, dataclasses.replace(small, tile_n=128))):
        assert block_kernel.default_tuning(256, cols=cols, slices=slices) == tuning, (cols, slices)
    assert block_kernel.default_tuning(64, interpret=True) == block_kernel.Tuning()
