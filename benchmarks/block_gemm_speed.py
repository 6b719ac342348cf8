"""The block-scaled FP8 GEMM on its own: the Mosaic GPU kernel against block_gemm's XLA emulation, a per-tensor FP8
dot and BF16.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false JAX_PLATFORMS=cuda python benchmarks/block_gemm_speed.py \\
        --out block_gemm_h100.json [--sweep]
    python benchmarks/block_gemm_speed.py --check --out /tmp/block_gemm_cpu.json   # CPU: the paths, tiny shapes

Shapes M x N x K (``x [M, K] . w [N, K]^T``, both K-major as the FP8 linear stores them): 4096 x 4096 x 4096, a
llama1b-ish 8192 x 2048 x 2048, a SmolLM2-ish 16384 x 576 x 1536, and a llama1b decode step's q|k|v and down
projections at 256 slots (256 x 3072 x 2048, 256 x 2048 x 8192: memory-bound, where ``--tile-n 64`` doubles the
tiles; ``decode_o`` and ``decode_gate_up`` for its other two on request, and ``--splits 1,2,4`` times each tuning
with the contraction split in that many runs where they divide its slices: split-K, for shapes whose tiles are
fewer than the multiprocessors). Paths, each with an f32 output (``--out-dtype
bfloat16`` for BF16 outputs; the emulation then casts its f32 sum):

  mosaic       ``kernels.block_gemm.block_gemm_mgpu``, the weight's scales as 128 x 128 blocks (fprop, dgrad)
  mosaic_rows  the same kernel with one scale per weight row (the form the wgrad's second operand has)
  cublaslt     ``kernels.cublaslt.block_gemm_cublaslt``: cuBLASLt's block-scaled FP8 GEMM (an XLA FFI call; its
               library from ``--cublaslt-lib``, ``$FP8RL_CUBLASLT_LIB`` or a build into ``$FP8RL_CACHE/kernels``),
               the weight's scales as 128 x 128 blocks
  cublaslt_rows  the same with one scale per weight row
  emulated     ``fp8.block.block_gemm`` (the ``xla`` backend's block-scaled GEMM today: batched 128-deep dots)
  fp8_tensor   one scale per tensor (each activation's and the weight's current amax): ``lax.dot_general`` of the
               FP8 operands to f32, times the two inverse scales (XLA's cuBLASLt FP8 GEMM)
  bf16         ``lax.dot_general`` of BF16 operands

One timed call is one jit holding an unrolled ``lax.scan`` over ``--repeats`` GEMMs, each on its own activation
(the weight shared, as a layer's is over a step's microbatches, or with ``--distinct-weights`` one a GEMM, as a decode
step's layers read theirs from HBM), every output kept; the median of ``--timed`` calls after a warm-up, divided by the
repeats. Rows report milliseconds a GEMM (wall clock, launches included; ``--trace`` adds the
GPU's kernel time a GEMM from a profiler trace of one call), TFLOP/s (2 M N K a GEMM), the speedup over the
emulation, and each path's largest difference from the emulation's output relative to its largest value (the Mosaic
paths: the same sums, apart from the order and precision of the MMAs' inside a slice; the others: their own
quantization error against block scaling's). XLA's Triton GEMMs are turned off (cuBLAS for the XLA
paths) unless ``XLA_FLAGS`` already names the flag. ``--check`` runs tiny shapes, the kernel through Pallas'
Mosaic GPU interpreter, on any backend: the paths and the agreement, no timing worth reading.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time

if "--xla_gpu_enable_triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from fp8rl_jax.bench import emit, error_text, script_header, timeit, trace, write_json  # noqa: E402
from fp8rl_jax.fp8 import block  # noqa: E402
from fp8rl_jax.kernels import cublaslt  # noqa: E402
from fp8rl_jax.kernels.block_gemm import Tuning, block_gemm_mgpu, default_tuning  # noqa: E402

SHAPES = {"square4k": (4096, 4096, 4096), "llama1b": (8192, 2048, 2048), "smollm2": (16384, 576, 1536),
          "decode_qkv": (256, 3072, 2048), "decode_down": (256, 2048, 8192)}  # a llama1b decode step's (256 slots)
MORE_SHAPES = {"decode_o": (256, 2048, 2048), "decode_gate_up": (256, 16384, 2048)}  # by name only
CHECK_SHAPES = {"tiny": (256, 256, 384), "odd": (200, 300, 300)}
PATHS = ("mosaic", "mosaic_rows", "cublaslt", "cublaslt_rows", "emulated", "fp8_tensor", "bf16")
DEFAULT_PATHS = ("mosaic", "mosaic_rows", "emulated", "fp8_tensor", "bf16")
SWEEP = {"stages": (3, 4), "grid_width": (8,), "cluster": (1, 2), "tile_n": (128, 64)}  # --sweep: the Mosaic paths'
CONTRACT = (((1,), (1,)), ((), ()))  # [M, K] . [N, K] over K
E4M3_MAX = 448.0


def _per_tensor(a):
    """E4M3 values of ``a`` [..., R, C] with one scale per [R, C] (current amax): (q, 1 / scale [...])."""
    scale = E4M3_MAX / jnp.maximum(jnp.max(jnp.abs(a.astype(jnp.float32)), axis=(-2, -1)), 1e-30)
    q = jnp.clip(a.astype(jnp.float32) * scale[..., None, None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, 1.0 / scale


def _inputs(m, n, k, repeats, distinct_weights=False, seed=0):
    """``repeats`` activations [R, M, K] and one weight [N, K] (``distinct_weights``: one a GEMM, [R, N, K]): BF16
    values, their 1 x 128 tile and 128 x 128 block quantizations, and their per-tensor quantizations (E4M3)."""
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (repeats, m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (repeats if distinct_weights else 1, n, k), jnp.float32) * 0.05).astype(jnp.bfloat16)
    qx, sx = jax.jit(lambda a: block.tile_quantize(a, jnp.float8_e4m3fn))(x)  # [R, M, K], [R, M, Kb]
    qw, sw = jax.jit(jax.vmap(lambda a: block.block_quantize(a, jnp.float8_e4m3fn)))(w)  # [., N, K], [., Nb, Kb]
    tx, tx_inv = jax.jit(_per_tensor)(x)  # [R, M, K], [R]
    tw, tw_inv = jax.jit(_per_tensor)(w)
    sw_rows = jax.vmap(lambda s: block.block_rows(s, n))(sw)
    weights = {"w": w, "qw": qw, "sw": sw, "sw_rows": sw_rows, "tw": tw, "tw_inv": tw_inv}
    if not distinct_weights:
        weights = {key: v[0] for key, v in weights.items()}
    return {"x": x, "qx": qx, "sx": sx, "tx": tx, "tx_inv": tx_inv, **weights}


def _one(path, out_dtype, tuning, interpret):
    """path -> f(inputs of one GEMM) -> [M, N] in ``out_dtype``. ``tuning``: the Mosaic paths' ``Tuning``, or the
    cuBLASLt paths' algorithm rank (``block_gemm_cublaslt``'s ``algo``)."""
    if path == "mosaic":
        return lambda d: block_gemm_mgpu(d["qx"], d["sx"], d["qw"], d["sw"], out_dtype, tuning=tuning,
                                         interpret=interpret)
    if path == "mosaic_rows":
        return lambda d: block_gemm_mgpu(d["qx"], d["sx"], d["qw"], d["sw_rows"], out_dtype, tuning=tuning,
                                         interpret=interpret)
    if path == "cublaslt":
        return lambda d: cublaslt.block_gemm_cublaslt(d["qx"], d["sx"], d["qw"], d["sw"], out_dtype, tuning)
    if path == "cublaslt_rows":
        return lambda d: cublaslt.block_gemm_cublaslt(d["qx"], d["sx"], d["qw"], d["sw_rows"], out_dtype, tuning)
    if path == "emulated":
        return lambda d: block.block_gemm(d["qx"], d["sx"], d["qw"], d["sw_rows"]).astype(out_dtype)
    if path == "fp8_tensor":
        return lambda d: (lax.dot_general(d["tx"], d["tw"], CONTRACT, preferred_element_type=jnp.float32)
                          * (d["tx_inv"] * d["tw_inv"])).astype(out_dtype)
    if path == "bf16":
        return lambda d: lax.dot_general(d["x"], d["w"], CONTRACT, preferred_element_type=out_dtype)
    raise ValueError(f"unknown path {path!r}; known: {PATHS}")


def _scanned(path, out_dtype, tuning, interpret):
    """One jit: an unrolled scan over the activations (and weights, where each GEMM has its own), every GEMM's
    output kept ([R, M, N]); unrolled, so that no loop's per-iteration cost enters a GEMM's time."""
    one = _one(path, out_dtype, tuning, interpret)

    def run(data):
        per_gemm = {k for k, v in data.items() if v.ndim == 3 or k in ("tx_inv", "tw_inv") and v.ndim == 1}
        shared = {k: v for k, v in data.items() if k not in per_gemm}

        def step(carry, xs):
            return carry, one({**shared, **xs})

        _, ys = lax.scan(step, 0, {k: data[k] for k in per_gemm}, unroll=True)
        return ys

    return jax.jit(run)


def _kernel_ms(fn, data, repeats) -> dict:
    """The GPU's own time a GEMM in one call of ``fn``, from a profiler trace: every kernel (``kernel_ms``: the
    per-tensor path's scaling fusion included) and the GEMM kernels alone (``gemm_kernel_ms``); no launch gaps."""
    summary = trace.trace_one_call(fn, data)
    if "error" in summary:
        return {"kernel_ms_error": summary["error"]}
    gemm = summary["families"].get("gemm", {}).get("ms", 0.0)
    return {"kernel_ms": round(summary["total_kernel_ms"] / repeats, 4), "gemm_kernel_ms": round(gemm / repeats, 4)}


def bench_shape(name, m, n, k, paths, out_dtype, repeats, timed, tunings, interpret, distinct_weights=False,
                trace=False, algos=1):
    data = _inputs(m, n, k, repeats, distinct_weights)
    reference = np.asarray(_scanned("emulated", jnp.float32, None, False)(data)[0])
    scale = max(float(np.max(np.abs(reference))), 1e-30)
    flop = 2.0 * m * n * k
    rows, emulated_ms = [], None
    for path in sorted(paths, key=lambda p: p != "emulated"):  # the emulation first: the speedups' base
        for tuning in (tunings if path.startswith("mosaic") else range(algos) if path.startswith("cublaslt")
                       else [None]):
            row = {"shape": name, "m": m, "n": n, "k": k, "path": path, "out_dtype": jnp.dtype(out_dtype).name}
            if isinstance(tuning, int):
                row["algo"] = tuning
            elif tuning is not None:
                row.update(stages=tuning.stages, grid_width=tuning.grid_width, grid_minor=tuning.grid_minor,
                           cluster=tuning.cluster, tile_n=tuning.tile_n, splits=tuning.splits, chain=tuning.chain,
                           pair=tuning.pair)
                if -(-k // 128) % tuning.splits:
                    continue  # the split does not divide this shape's slices
            try:
                fn = _scanned(path, out_dtype, tuning, interpret)
                out = np.asarray(fn(data)[0], np.float32)
                row["max_rel_diff"] = float(np.max(np.abs(out - reference)) / scale)
                seconds = timeit(fn, data, repeats=timed)
            except Exception as e:  # a Mosaic GPU compile error, a tiling that does not fit: recorded, the rest runs
                row["error"] = error_text(e)
                emit(rows, row)
                continue
            ms = seconds / repeats * 1e3
            row.update(ms=round(ms, 4), tflops=round(flop / (ms * 1e-3) / 1e12, 1))
            if trace:
                row.update(_kernel_ms(fn, data, repeats))
            if path == "emulated":
                emulated_ms = ms
            if emulated_ms:
                row["speedup_vs_emulated"] = round(emulated_ms / ms, 2)
            emit(rows, row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)}, or MxNxK")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"of {PATHS}")
    p.add_argument("--cublaslt-lib", default="", help="the cuBLASLt paths' built library (else $FP8RL_CUBLASLT_LIB, "
                   "else built into $FP8RL_CACHE/kernels)")
    p.add_argument("--cublaslt-algos", type=int, default=1,
                   help="the cuBLASLt paths with each of the heuristic's first N algorithms (0: its pick)")
    p.add_argument("--default-tuning", action="store_true",
                   help="the Mosaic paths with default_tuning's choice for each shape (not --stages etc.)")
    p.add_argument("--out-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=10, help="GEMMs in one timed call (a scan)")
    p.add_argument("--timed", type=int, default=5, help="timed calls (median)")
    p.add_argument("--stages", type=int, default=Tuning.stages)
    p.add_argument("--grid-width", type=int, default=Tuning.grid_width)
    p.add_argument("--cluster", type=int, default=Tuning.cluster, help="CTAs a cluster (1 or 2)")
    p.add_argument("--tile-n", type=int, default=Tuning.tile_n, help="output columns a tile (128 or 64)")
    p.add_argument("--sweep", action="store_true", help=f"the Mosaic paths over {SWEEP}")
    p.add_argument("--splits", default="1", help="split-K counts each tuning runs with (comma-separated)")
    p.add_argument("--variants", default="plain",
                   help="kernel variants each tuning runs as (comma-separated): plain, chain (Tuning.chain), pair "
                        "(Tuning.pair, at 2 stages: a stage holds two slices), pair+chain")
    p.add_argument("--tile-ns", default="", help=f"--sweep's tile widths (comma-separated; default {SWEEP['tile_n']})")
    p.add_argument("--trace", action="store_true",
                   help="also each row's GPU kernel time from a profiler trace (decode-sized GEMMs: launches dominate)")
    p.add_argument("--distinct-weights", action="store_true",
                   help="a weight for each GEMM, as a step's layers have (no weight read from L2 after the first)")
    p.add_argument("--check", action="store_true", help="tiny shapes, the kernel through the interpreter (CPU)")
    p.add_argument("--commit", default="",
                   help="the commit that runs (a device's copy of the tree may report an older one)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    paths = args.paths.split(",")
    for path in paths:
        if path not in PATHS:
            p.error(f"unknown path {path!r}; known: {PATHS}")
    if args.check:
        shapes = CHECK_SHAPES
        repeats, timed = 2, 1
        tunings = [Tuning(num_sms=2, stages=2)]
    else:
        shapes, named = {}, {**SHAPES, **MORE_SHAPES}
        for s in args.shapes.split(","):
            shapes[s] = named[s] if s in named else tuple(int(v) for v in s.split("x"))
        repeats, timed = args.repeats, args.timed
        if args.sweep:
            sweep = {**SWEEP, **({"tile_n": tuple(map(int, args.tile_ns.split(",")))} if args.tile_ns else {})}
            tunings = [Tuning(stages=s, grid_width=g, cluster=k, tile_n=t)
                       for s, g, k, t in itertools.product(*sweep.values())]
        else:
            tunings = [Tuning(stages=args.stages, grid_width=args.grid_width, cluster=args.cluster,
                              tile_n=args.tile_n)]
        variants = [dict(chain="chain" in v, pair="pair" in v, **({"stages": 2} if "pair" in v else {}))
                    for v in args.variants.split(",")]
        tunings = list(dict.fromkeys(dataclasses.replace(t, splits=int(s), **v) for t in tunings
                                     for s in args.splits.split(",") for v in variants))
    if not args.check and jax.default_backend() != "gpu":
        sys.exit("block_gemm_speed times a GPU; on this backend run --check")
    if any(path.startswith("cublaslt") for path in paths):
        if args.cublaslt_lib:
            os.environ[cublaslt.ENV_LIB] = args.cublaslt_lib
        from fp8rl_jax.model.assets import cache_dir

        cublaslt.register(cache_dir() / "kernels")
    t0 = time.time()
    rows = []
    for name, (m, n, k) in shapes.items():
        if args.default_tuning and not args.check:
            tunings = [default_tuning(m, cols=n, slices=-(-k // 128))]
        rows += bench_shape(name, m, n, k, paths, jnp.dtype(args.out_dtype), repeats, timed, tunings,
                            interpret=args.check, distinct_weights=args.distinct_weights, trace=args.trace,
                            algos=args.cublaslt_algos)
    write_json(args.out, {**script_header("block_gemm_speed", argv, t0, args.commit), "xla_flags":
                          os.environ.get("XLA_FLAGS", ""), "repeats": repeats, "timed": timed, "rows": rows})
    print(f"wrote {args.out}: {len(rows)} rows", flush=True)
    failed = [r for r in rows if "error" in r and "cuBLASLt offers" not in r["error"]]  # not: a rank beyond them
    bound = 1e-3 if args.out_dtype == "float32" else 2.0**-8  # a BF16 output adds its rounding (2^-9 relative)
    wrong = [r for r in rows if r["path"].startswith("mosaic") and r.get("max_rel_diff", 0.0) > bound]
    if failed or wrong:
        sys.exit(f"{len(failed)} rows failed, {len(wrong)} Mosaic rows differ from the emulation by more than {bound}")


if __name__ == "__main__":
    main()
