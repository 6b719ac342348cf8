"""The block-scaled FP8 GEMM on Hopper: one Mosaic GPU kernel for ``fp8.block.block_gemm``; ``fp8.xla`` runs block
scaling's GEMMs through it where ``runs_here`` says it can.

What it computes. ``block.block_gemm``'s sum over the 128-wide slices c of the contraction axis C:

    y [P, Q] = sum_c (qa[:, c] . qb[:, c]^T) * (a_scale_inv[:, c][:, None] * b_scale_inv[:, c][None, :])

qa [P, C] and qb [Q, C] FP8 (both E4M3 or both E5M2: JAX 0.10's ``plgpu.wgmma`` takes one type), both contracted
over their last axis (K-major, as Hopper's FP8 MMA wants both operands); each slice's product summed by the tensor
cores into a fresh f32 accumulator, multiplied by its two scales and added to the f32 result in slice order
(DeepGEMM's promotion every 128 K). ``b_scale_inv`` comes in one of two forms: one row per row of qb ``[Q, Cb]``
(block_gemm's form; any values), or a weight's 128 x 128 blocks ``[ceil(Q / 128), Cb]`` (``block.block_quantize``'s
form, which ``block.block_rows`` repeats into the first). The second is what a linear's fprop and dgrad have and
what the kernel runs fastest: one scale per 128 output columns and slice, a scalar. The wgrad's operands are both
scaled per row (128 x 1 tiles along the tokens) and take the first form. Both give block_gemm's numbers up to the
sums inside a slice and the contraction of ``acc + part * scale`` into one FMA (the scales are multiplied first, as
block_gemm does). Inside a slice Hopper's FP8 MMA keeps about 14 bits while it sums (DeepSeek-V3 section 3.3.2):
the kernel's slice sums are that close to f32's (tests/kernels/test_block_gemm.py bounds them), where XLA's dot in
block_gemm sums in f32 for some shapes on a GPU and as the kernel does for others.

The kernel (Pallas, Mosaic GPU backend: ``jax.experimental.pallas.mosaic_gpu``; sm_90a). A persistent kernel: one CTA
per streaming multiprocessor walks the 128 x 128 output tiles (128 x 64 with ``Tuning.tile_n=64``; ``plgpu.nd_loop``, in
a planar snake order for L2 reuse). A CTA is three warpgroups: a memory warpgroup that runs the TMA pipeline over the K
slices (``plgpu.emit_pipeline_warp_specialized``, ``stages`` slices in flight; a slice is qa's [128, 128] and qb's [128,
128] FP8 blocks, 128-byte swizzled, and the slice's 128 row scales of qa, and in the row form qb's 128 column scales),
and two compute warpgroups, each owning 64 rows of the tile. Per slice a compute warpgroup issues one 64 x 128 x 128
``plgpu.wgmma`` (E4M3 x E4M3 -> f32, four 32-deep instructions) into a zeroed register accumulator, waits for it, and
adds ``part * (sa[:, None] * sb)`` into its running f32 tile (64 registers each a thread); the other warpgroup's wgmma
runs on the tensor cores meanwhile. The epilogue writes the tile (f32 or BF16) to shared memory and stores it with TMA
while the next tile's loads already stream in. Sizes that the 128 tiles do not divide are padded with zeros in the
wrapper (a zero adds nothing, as in block_gemm; the padding is a copy of the operands, only where needed); scales are
transposed there ([Cb, P]: one TMA row a slice). Two variants (``Tuning.chain``: a CTA's tiles as one pipeline, no
fill and drain between them; ``Tuning.pair``: two slices a pipeline step, the second's MMA running while the first's
product is added) are the default above a decode step's rows (``default_tuning``), where the kernel trails
cuBLASLt's per-tensor GEMM.

What it assumes. A Hopper GPU (sm_90a: wgmma; Blackwell's MMA is tcgen05, another kernel), one device (a
``pallas_call`` is opaque to XLA's partitioner: under a mesh it would need a ``shard_map``), f32 scales, and 194
KiB of shared memory at the default 4 stages with an f32 output (``Tuning``; lowering checks the 227 KiB budget).

Measured: ``benchmarks/block_gemm_speed.py`` against block_gemm's XLA emulation, a per-tensor FP8 dot and BF16
(``gpu_session.sh bgemm``; the figures: benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper").
``tests/kernels/test_block_gemm.py`` checks it against block_gemm on a GPU. On a CPU it
runs through Pallas' Mosaic GPU interpreter (``interpret=True``, tests only: slow; the interpreter's wgmma takes no
transposed operand, so there qb goes in as [C, Q], the one difference) and lowers for CUDA without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 128  # the scaling slice of the contraction axis (block.BLOCK), one wgmma K step
TILE_M = 128  # output rows per tile: two compute warpgroups of 64
TILE_N = 128  # output columns per tile by default: one weight block (Tuning.tile_n)
WG_M = TILE_M // 2
FP8_TYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """``stages``: K slices in flight (shared memory: 32.5 KiB each, plus 32 or 64 KiB for the output tile);
    ``grid_minor``/``grid_width``: the tile order (``plgpu.planar_snake``: bands of ``grid_width`` tiles along
    dimension ``grid_minor``, 0 = M, 1 = N); ``num_sms``: CTAs (default: the device's multiprocessors);
    ``cluster``: 1, or 2 CTAs a cluster on neighbouring row tiles of one column tile, qb's slice loaded once for
    both (a TMA multicast: the L2 traffic of each K slice falls from 32 to 24 KiB a CTA); ``tile_n``: output
    columns a tile, 128 (one weight block) or 64 (half of one: twice the tiles, for a small M, where 128 x 128 tiles
    leave most multiprocessors idle); ``splits``: 1, or the contraction's slices cut into that many runs, each
    output tile made by ``splits`` programs that write f32 partial tiles [splits, P, Q], summed afterwards by XLA
    (split-K: for a small M whose tiles are fewer than the multiprocessors, e.g. a decode step's w_down: 64 tiles of
    64 slices each; the partials change the order of the f32 sum over slices: split s's run, then those added);
    ``chain``: a CTA's tiles run as one pipeline (``plgpu.PipelinePipeline`` states: the memory warpgroup loads the
    next tile's first slices while the compute warpgroups finish a tile, where each tile's pipeline otherwise fills
    and drains), where every CTA has at least two tiles (elsewhere off); ``stages`` must divide a tile's steps;
    ``pair``: two slices a pipeline step, their two MMAs issued at once, so that the second runs on the tensor cores
    while the first's product is scaled and added (the contraction padded with a zero slice where its runs are odd;
    a stage then holds two slices, 65 KiB at 128 columns: 2 stages fit, 3 exceed shared memory by a few bytes even
    with a BF16 output)."""

    stages: int = 4
    grid_minor: int = 1
    grid_width: int = 8
    num_sms: int | None = None
    cluster: int = 1
    tile_n: int = TILE_N
    splits: int = 1
    chain: bool = False
    pair: bool = False


# Up to this many rows (a decode step's 256 slots) the default tuning is SMALL_M_TUNING: on an H200 at 256 rows,
# llama1b's decode q|k|v and down GEMMs took 0.024 and 0.051 ms with it, 0.038 and 0.072 with Tuning()
# (benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper"); at 8192 rows Tuning() was the fastest of the eight timed
SMALL_M = 256
SMALL_M_TUNING = Tuning(cluster=2, tile_n=64)
# More rows: two slices a pipeline step, a CTA's tiles chained where the stages divide a tile's steps. At llama1b's
# training shapes on an H200 (40960 rows; q|k|v, gate|up, w_down) the GEMM took 0.447, 2.48 and 1.12 ms so against
# 0.488, 2.77 and 1.22 with Tuning(); without the chain 0.474, 2.62, 1.18
LARGE_M_TUNING = Tuning(stages=2, pair=True)
# Up to SMALL_M rows a contraction of at least this many 128-deep slices may be split (llama1b's w_down: 64 slices,
# 0.033 ms split in two against 0.052 whole on an H200). o's 16 gained nothing measurable split (0.0205-0.0348 ms
# against 0.0204-0.0314 whole in three sweeps), and its f32 partials' sum is a kernel of its own where the block's
# norm kernel (``block_quantize.norm_tiles``) takes o's output: 2 us a layer and decode step (benchmarks/RESULTS.md,
# "Block-scaled FP8 on Hopper")
SPLIT_MIN_SLICES = 32


def default_tuning(rows: int, interpret=False, *, cols: int = 0, slices: int = 1) -> Tuning:
    """The tuning ``block_gemm_mgpu`` takes for ``rows`` x ``cols`` outputs over ``slices`` 128-deep slices unless
    told (the interpreter has no clusters). Up to SMALL_M rows: SMALL_M_TUNING, whose 64-column tiles double the
    tiles where 128-column ones would be fewer than the multiprocessors (a llama1b decode step's q|k|v, o and w_down;
    its gate|up has 256 tiles of 128 columns and keeps them); where even so the tiles are at most half the
    multiprocessors and the contraction has at least SPLIT_MIN_SLICES slices (w_down: 64 tiles, 64 slices), the slices
    are split in two (split-K: ``Tuning.splits``) so that twice the programs run. More rows: LARGE_M_TUNING, chained
    where its 2 stages divide a tile's steps. Measured on an H200: benchmarks/RESULTS.md, "Block-scaled FP8 on
    Hopper"."""
    if interpret:
        return Tuning()
    if rows > SMALL_M:
        steps = -(-slices // 2)  # a tile's pipeline steps: its slices in pairs (an odd run padded with a zero slice)
        return dataclasses.replace(LARGE_M_TUNING, chain=steps % LARGE_M_TUNING.stages == 0)
    row_tiles, sms = -(-rows // TILE_M), _default_num_sms()
    tuning = SMALL_M_TUNING
    if cols and row_tiles * -(-cols // TILE_N) >= sms:
        tuning = dataclasses.replace(tuning, tile_n=TILE_N)
    if cols and 2 * row_tiles * -(-cols // tuning.tile_n) <= sms and slices % 2 == 0 and slices >= SPLIT_MIN_SLICES:
        tuning = dataclasses.replace(tuning, splits=2)
    return tuning


def prefers_cublaslt(rows: int, cols: int) -> bool:
    """Whether ``precision.block_gemm=auto`` gives a ``rows`` x ``cols`` GEMM to cuBLASLt's block-scaled FP8 GEMM
    rather than this kernel: above SMALL_M rows, and at fewer rows where 128 x 128 tiles already fill the
    multiprocessors, so that the small-row tuning's narrower tiles and split slices have nothing to add. On an H200 a
    decode step's gate|up (256 x 16384 x 2048, 256 tiles) took 0.0177 ms in cuBLASLt and 0.0215 here; its q|k|v, o
    and w_down (32 to 48 tiles) were faster here (benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper")."""
    return rows > SMALL_M or -(-rows // TILE_M) * -(-cols // TILE_N) >= _default_num_sms()


def _num_blocks(n: int) -> int:
    return -(-n // BLOCK)


def _pad_to(a: jax.Array, axis: int, size: int) -> jax.Array:
    extra = size - a.shape[axis]
    if extra == 0:
        return a
    return jnp.pad(a, [(0, extra if i == axis else 0) for i in range(a.ndim)])


def _default_num_sms() -> int:
    if jax.default_backend() == "gpu":
        return int(jax.devices()[0].core_count)
    return 132  # an H100 SXM or H200 (lowering for CUDA on a host without one)


def _one_fp8_type(qa: jax.Array, qb: jax.Array) -> bool:
    """qa and qb are FP8 of one type (the kernel's one wgmma type)."""
    return qa.dtype == qb.dtype and jnp.dtype(qa.dtype) in [jnp.dtype(t) for t in FP8_TYPES]


def one_hopper() -> bool:
    """Whether this trace is on a Hopper GPU (sm_90) outside a mesh of several devices: where a hand-written GEMM
    (a ``pallas_call``, an FFI call: neither has a partitioning rule, so under a mesh XLA would gather its operands)
    may run."""
    if jax.default_backend() != "gpu" or getattr(jax.devices()[0], "compute_capability", None) != "9.0":
        return False
    from fp8rl_jax.parallel import rules

    return rules.active_mesh() is None


def runs_here(qa: jax.Array, qb: jax.Array) -> bool:
    """Whether ``block_gemm_mgpu`` runs for operands like these in this trace: ``one_hopper``, and two 2-D FP8
    operands of one type (the kernel's one wgmma type)."""
    return qa.ndim == 2 and qb.ndim == 2 and _one_fp8_type(qa, qb) and one_hopper()


# a jitted function: a program that calls it many times (a rollout's unrolled layers) lowers each kernel signature
# once, into one function that every call site calls (64 calls lowered one by one cost the llama1b rollout's programs
# about 25 s each to lower and 40 s each to compile on the H100)
@functools.partial(jax.jit, static_argnames=("out_dtype", "tuning", "interpret"))
def block_gemm_mgpu(qa: jax.Array, a_scale_inv: jax.Array, qb: jax.Array, b_scale_inv: jax.Array,
                    out_dtype=jnp.float32, *, tuning: Tuning | None = None, interpret=False) -> jax.Array:
    """``block.block_gemm(qa, a_scale_inv, qb, b_scale_inv)`` -> [P, Q] in ``out_dtype`` (f32 or BF16; the sum is
    f32 either way), by the Mosaic GPU kernel. qa [P, C], qb [Q, C]: the same FP8 type; a_scale_inv [P, Cb] f32;
    b_scale_inv [Q, Cb] (any per-row scales) or [ceil(Q / 128), Cb] (a weight's block scales, the faster form),
    Cb = ceil(C / 128). ``interpret``: True, or the ``InterpretGPUParams`` of Pallas' Mosaic GPU interpreter (any
    backend; tests; its allocations must start zeroed: ``uninitialized_memory='zero'``). ``tuning``: default
    ``default_tuning(P, cols=Q, slices=Cb)``."""
    p, c = qa.shape
    q = qb.shape[0]
    cb = _num_blocks(c)
    if not _one_fp8_type(qa, qb):
        raise ValueError(f"block_gemm_mgpu takes two FP8 operands of one type, not {qa.dtype} and {qb.dtype}")
    if qb.shape[1] != c:
        raise ValueError(f"block_gemm_mgpu: qa {qa.shape} and qb {qb.shape} differ in their contraction axis")
    if a_scale_inv.shape != (p, cb):
        raise ValueError(f"a_scale_inv must be [P, ceil(C/128)] = {(p, cb)}, not {a_scale_inv.shape}")
    if b_scale_inv.shape == (_num_blocks(q), cb):
        block_scales = True  # (also Q == 1, where the two forms are one)
    elif b_scale_inv.shape == (q, cb):
        block_scales = False
    else:
        raise ValueError(f"b_scale_inv must be [Q, Cb] = {(q, cb)} or [ceil(Q/128), Cb] = {(_num_blocks(q), cb)}, "
                         f"not {b_scale_inv.shape}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"block_gemm_mgpu writes float32 or bfloat16, not {out_dtype}")
    tuning = tuning or default_tuning(p, interpret, cols=q, slices=cb)
    if tuning.cluster not in (1, 2):
        raise ValueError(f"block_gemm_mgpu: Tuning.cluster={tuning.cluster}; allowed: 1, 2")
    if tuning.tile_n not in (64, 128):
        raise ValueError(f"block_gemm_mgpu: Tuning.tile_n={tuning.tile_n}; allowed: 64, 128")
    if tuning.splits < 1 or cb % tuning.splits:
        raise ValueError(f"block_gemm_mgpu: Tuning.splits={tuning.splits} must divide the contraction's {cb} slices "
                         "of 128")
    tn = tuning.tile_n
    rows_step = TILE_M * tuning.cluster  # a cluster's row tiles
    if tuning.pair and (cb // tuning.splits) % 2:
        cb += tuning.splits  # a zero slice more a run, so that each run's slices pair up (zeros add nothing)
    pp, qp, cp = -(-p // rows_step) * rows_step, -(-q // tn) * tn, cb * BLOCK
    a = _pad_to(_pad_to(qa, 0, pp), 1, cp)
    b = _pad_to(_pad_to(qb, 0, qp), 1, cp)
    if interpret:  # the interpreter's wgmma takes no transposed operand: qb as [C, Q] there (the MMA wants [Q, C])
        b = b.T
    # [P, Cb] -> [Cb, Pp / 64, 64]: a slice's scales of one warpgroup's 64 rows are one contiguous row
    sa = _pad_to(_pad_to(a_scale_inv.astype(jnp.float32).T, 0, cb), 1, pp).reshape(cb, pp // WG_M, WG_M)
    if block_scales:
        sb = _pad_to(_pad_to(b_scale_inv.astype(jnp.float32), 0, _num_blocks(qp)), 1, cb)  # [ceil(Qp / 128), Cb]
    else:
        sb = _pad_to(_pad_to(b_scale_inv.astype(jnp.float32).T, 0, cb), 1, qp)  # [Cb, Qp]
    kernel_dtype = out_dtype if tuning.splits == 1 else jnp.dtype(jnp.float32)  # partials stay f32
    y = _call(a, b, sa, sb, out_dtype=kernel_dtype, block_scales=block_scales, tuning=tuning, interpret=interpret)
    if tuning.splits > 1:
        y = jnp.sum(y, axis=0).astype(out_dtype)  # [splits, Pp, Qp] -> [Pp, Qp]
    return y[:p, :q] if (pp, qp) != (p, q) else y


def _call(a, b, sa, sb, *, out_dtype, block_scales: bool, tuning: Tuning, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    pp, cp = a.shape
    qp = b.shape[1] if interpret else b.shape[0]
    cluster, tn, splits = tuning.cluster, tuning.tile_n, tuning.splits
    step = 2 if tuning.pair else 1  # slices a pipeline step
    # k_iters: the pipeline steps of one split (its slices / step)
    m_iters, n_iters, k_iters = pp // TILE_M, qp // tn, cp // BLOCK // splits // step
    num_tiles = m_iters // cluster * n_iters * splits  # a cluster's tiles (`cluster` row tiles of one column tile)
    num_ctas = min((tuning.num_sms or _default_num_sms()) // cluster, num_tiles)
    if tuning.chain and k_iters % tuning.stages:
        raise ValueError(f"block_gemm_mgpu: Tuning.chain needs stages={tuning.stages} to divide a tile's {k_iters} "
                         "pipeline steps")
    chained = tuning.chain and num_tiles >= 2 * num_ctas  # a CTA with one tile has nothing to chain
    multicast = ("cluster",) if cluster > 1 else ()
    in_bits = jnp.dtype(a.dtype).itemsize * 8
    in_swizzle = plgpu.find_swizzle(BLOCK * in_bits, "fp8 operand")  # 128 bytes: one K slice a swizzle row
    in_transforms = (plgpu.TilingTransform((8, in_swizzle * 8 // in_bits)), plgpu.SwizzleTransform(in_swizzle))
    out_bits = out_dtype.itemsize * 8
    out_swizzle = plgpu.find_swizzle(tn * out_bits, "output")
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // out_bits)), plgpu.SwizzleTransform(out_swizzle))

    def cast(x, layout):  # the interpreter ignores layouts (and has no rule for the cast)
        return x if interpret else plgpu.layout_cast(x, layout)

    # qb's slice: [128 columns, 128 K] in shared memory, K-major as the FP8 MMA takes it (transposed into the MMA's
    # [K, N] view); the interpreter gets qb as [C, Q] and its [128 K, 128 columns] slices (see block_gemm_mgpu)
    if interpret:
        b_swizzle = plgpu.find_swizzle(tn * in_bits, "fp8 operand")  # its minor axis: tn columns
        b_spec = plgpu.BlockSpec((step * BLOCK, tn), lambda k: (k, 0), transforms=(
            plgpu.TilingTransform((8, b_swizzle * 8 // in_bits)), plgpu.SwizzleTransform(b_swizzle)),
                                 collective_axes=multicast)
        b_cols = lambda b_gmem, cols, depth: b_gmem.at[depth, cols]
        b_operand = lambda b_smem, j: b_smem.at[pl.ds(j * BLOCK, BLOCK)] if step > 1 else b_smem
    else:
        b_spec = plgpu.BlockSpec((tn, step * BLOCK), lambda k: (0, k), transforms=in_transforms,
                                 collective_axes=multicast)
        b_cols = lambda b_gmem, cols, depth: b_gmem.at[cols, depth]
        b_operand = lambda b_smem, j: (b_smem.at[:, pl.ds(j * BLOCK, BLOCK)] if step > 1 else b_smem).transpose((1, 0))

    def kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, out_smem):
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cluster") if cluster > 1 else 0

        def get_pipeline(body, compute_context, state=None):
            specs = [
                plgpu.BlockSpec((TILE_M, step * BLOCK), lambda k: (0, k), transforms=in_transforms),  # qa's slices
                b_spec,  # qb's slices
                plgpu.BlockSpec((step, 2, WG_M), lambda k: (k, 0, 0)),  # qa's row scales
            ]
            if not block_scales:
                specs.append(plgpu.BlockSpec((step, tn), lambda k: (k, 0)))  # qb's row scales
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(k_iters,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=tuning.stages, compute_context=compute_context, pipeline_state=state)

        def tile_refs(m_idx, n_idx, split):
            cols = pl.ds(n_idx * tn, tn)
            run = k_iters * step  # a split's slices
            depth, slices = pl.ds(split * run * BLOCK, run * BLOCK), pl.ds(split * run, run)
            refs = [a_gmem.at[pl.ds(m_idx * TILE_M, TILE_M), depth], b_cols(b_gmem, cols, depth),
                    sa_gmem.at[slices, pl.ds(m_idx * 2, 2), :]]
            if not block_scales:
                refs.append(sb_gmem.at[slices, cols])
            return refs

        ignore = lambda *_, **__: None  # the allocations do not depend on the bodies

        @functools.partial(pl.run_scoped,
                           allocs=get_pipeline(ignore, ignore).get_allocations(*tile_refs(0, 0, 0)),
                           collective_axes="wg")
        def _scope(allocs):
            @plgpu.nd_loop((num_tiles,), collective_axes="sm")
            def _tile(info):
                (lin,) = info.index
                split = lin % splits  # a tile's splits on neighbouring programs
                m_cl, n_idx = plgpu.planar_snake(lin // splits, (m_iters // cluster, n_iters), tuning.grid_minor,
                                                 tuning.grid_width)
                m_idx = m_cl * cluster + cta
                rows = pl.ds(wg * WG_M, WG_M)

                def compute_context(run_pipeline):
                    acc = run_pipeline(cast(jnp.zeros((WG_M, tn), jnp.float32), plgpu.Layout.WGMMA))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read out_smem
                    out_smem[wg] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    out_tile = out_gmem if splits == 1 else out_gmem.at[split]  # [splits, Pp, Qp]: this split's
                    plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                            out_tile.at[pl.ds(m_idx * TILE_M + wg * WG_M, WG_M),
                                                        pl.ds(n_idx * tn, tn)])

                def body(idx, a_smem, b_smem, sa_smem, *sb_smem_and_acc):
                    (k,) = idx
                    *sb_smem, acc = sb_smem_and_acc

                    if block_scales:  # one scale a slice for the tile's columns, loaded before the MMAs wait
                        col = n_idx * tn // BLOCK
                        first = (split * k_iters + k) * step  # this step's first slice
                        sbs = [sb_gmem[col, first + j] for j in range(step)]

                    def scale_of(j):  # slice j of this step: [WG_M, tn] products of row and column scales
                        sa = cast(sa_smem[j, wg], plgpu.Layout.WGMMA.reduce(1))  # [64] this warpgroup's rows
                        if block_scales:
                            return lax.broadcast_in_dim(sa * sbs[j], (WG_M, tn), (0,))
                        (sb_ref,) = sb_smem
                        sb = cast(sb_ref[j], plgpu.Layout.WGMMA.reduce(0))  # [tn] the tile's columns
                        return lax.broadcast_in_dim(sa, (WG_M, tn), (0,)) * lax.broadcast_in_dim(sb, (WG_M, tn), (1,))

                    def mma(*part_refs):  # every slice's MMA issued, then each product added as it completes
                        for j, part_ref in enumerate(part_refs):
                            a_part = a_smem.at[rows, pl.ds(j * BLOCK, BLOCK)] if step > 1 else a_smem.at[rows]
                            plgpu.wgmma(part_ref, a_part, b_operand(b_smem, j))
                        out = acc
                        for j, part_ref in enumerate(part_refs):
                            part = plgpu.wgmma_accumulator_load(part_ref, wait_n=step - 1 - j)
                            out = out + part * scale_of(j)
                        return out

                    return pl.run_scoped(mma, *[plgpu.ACC((WG_M, tn), jnp.float32)] * step)

                state = None
                if chained:  # this CTA's first tile fills the pipeline, its last drains it
                    states = plgpu.PipelinePipeline
                    last = info.local_index == info.num_local_steps - 1
                    state = jnp.where(info.local_index == 0, int(states.START),
                                      jnp.where(last, int(states.STOP), int(states.STEADY)))
                get_pipeline(body, compute_context, state)(*tile_refs(m_idx, n_idx, split), allocations=allocs)

        plgpu.wait_smem_to_gmem(0)

    interpret_params = None
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        # zeroed allocations, as the hardware's WGMMA accumulators start (the interpreter's default fills them with NaN)
        interpret_params = InterpretGPUParams(uninitialized_memory="zero")
    elif interpret:
        interpret_params = interpret  # the caller's InterpretGPUParams (e.g. with detect_races)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((pp, qp) if splits == 1 else (splits, pp, qp), out_dtype),
        scratch_types=[plgpu.SMEM((2, WG_M, tn), out_dtype, transforms=out_transforms)],
        grid=(num_ctas,),
        grid_names=("sm",),
        **(dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}),
        num_threads=3,
        thread_name="wg",
        interpret=interpret_params,
        # its shape and tuning in the name, so that a profile of a step tells its GEMMs apart
        kernel_name=(f"block_gemm_fp8_{pp}x{qp}x{cp}_n{tn}_c{cluster}_k{splits}"
                     f"{'_pair' * tuning.pair}{'_chain' * chained}"),
    )(a, b, sa, sb)
