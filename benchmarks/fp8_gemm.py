"""The decode step's FP8 GEMMs alone: a weight-streaming Pallas FP8 GEMM (defined here) against TE's and XLA's.

    JAX_PLATFORMS=cuda python benchmarks/fp8_gemm.py --out fp8_gemm_h100.json [--sweep]
    python benchmarks/fp8_gemm.py --interpret --out /tmp/fp8_gemm_cpu.json   # CPU: the path, tiny shapes

Shapes: the four linears of a Llama-3.2-1B block (``wqkv`` 3072 x 2048, ``wo`` 2048 x 2048, ``w_gate_up`` 16384 x
2048, ``w_down`` 2048 x 8192) at M = 64 and 256 rows (the decode batch), with the output dtypes the decode step
writes (BF16 into the attention and the SwiGLU, f32 into the residual stream). One timed call is one jit of
``--layers`` GEMMs, one weight per layer (as the unrolled decode step reads them, each from its own buffer), each
with an FP8 input of its own (since b191b1d; before, all shared one), every output kept. Rows report the GPU kernel
microseconds per GEMM (from a profiler trace of one call: every kernel, a split-K GEMM's reduction included), the
weight bytes moved per second at that rate, the top kernels' names, and the wall time per GEMM (median of
``--repeats``: it includes the host's launches, which the decode step hides and this harness does not). Each
impl's output is checked against the first impl's (TE's by default): the largest difference relative to the largest
output.

``--impls te_add,xla_into --shapes wo,w_down``: the two GEMMs that feed the residual stream, as the rollout ran
them (TE's GEMM, then XLA's add: ``te_add``) and as it runs them now (``xla.prequantized_matmul_into``: the add as
the FP8 GEMM's C operand, one cuBLASLt call); each layer adds into the previous layer's output.

The candidate kernel (``fp8_gemm`` below; measured, it lost to TE's cuBLASLt GEMMs at every shape,
benchmarks/RESULTS.md, "FP8 GEMMs", so it is not part of the package). In the batch-64 decode step TE's FP8 GEMMs move
the weights at about half the copy rate, the small ones least well (``wo`` 4.9 us a call for 4 MiB). At M <= 256 a
GEMM is a weight stream: each weight byte meets every row of ``x``. Grid ``(cdiv(N, block_n),)``: a program owns
``block_n`` output columns and walks K in ``block_k`` steps, the [M, block_k] slice of ``x`` (rows padded to a power
of two, at least 64: the Hopper FP8 dot's smallest tile) against the weight's [block_n, block_k] slice, both K-major
as a ``QuantizedKernel`` stores them, an FP8 x FP8 dot accumulating in f32; the output is ``acc * x_scale_inv *
w_scale_inv``. No split of K, so no reduction kernel after it.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from fp8rl_jax.fp8 import te as te_backend  # noqa: E402

te_backend.preload()  # Transformer Engine before JAX's GPU backend starts (fp8rl_jax.fp8.te)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from fp8rl_jax.bench import emit, error_text, script_header, timeit, write_json  # noqa: E402
from fp8rl_jax.bench.trace import summarize_trace  # noqa: E402
from fp8rl_jax.fp8 import xla  # noqa: E402
from fp8rl_jax.fp8.recipe import Fp8Recipe  # noqa: E402

MIN_DOT_ROWS = 64  # Hopper's FP8 dot (wgmma) takes 64-row tiles: fewer rows are padded


def _pow2_ceil(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def default_block_n(n: int) -> int:
    """About 128 programs: ``n / 128`` rounded down to a power of two, in [16, 128]."""
    return min(max(1 << (max(n // 128, 1).bit_length() - 1), 16), 128)


def _kernel(x_scale_inv_ref, w_scale_inv_ref, x_ref, w_ref, out_ref, *, rows: int, rows_padded: int, n: int,
            block_n: int, block_k: int, k_blocks: int):
    col = pl.program_id(0) * block_n
    row_ok = jnp.arange(rows_padded) < rows
    col_ok = col + jnp.arange(block_n) < n
    cols = pl.ds(col, block_n)

    def body(i, acc):
        ks = pl.ds(i * block_k, block_k)
        # masked-off rows and columns are left undefined: each meets only the output rows or columns that are not
        # stored (a dot's output element reads one row of each operand)
        a = plgpu.load(x_ref.at[pl.ds(0, rows_padded), ks], mask=row_ok[:, None])
        b = plgpu.load(w_ref.at[cols, ks], mask=col_ok[:, None])
        return acc + plgpu.dot(a, b, trans_b=True)  # [Mp, bk] . [bn, bk]^T, f32 accumulation

    acc = jax.lax.fori_loop(0, k_blocks, body, jnp.zeros((rows_padded, block_n), jnp.float32))
    out = acc * (x_scale_inv_ref[0] * w_scale_inv_ref[0])
    plgpu.store(out_ref.at[pl.ds(0, rows_padded), cols], out.astype(out_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


def fp8_gemm(x: jax.Array, w: jax.Array, x_scale_inv: jax.Array, w_scale_inv: jax.Array, out_dtype, *,
             block_n: int | None = None, block_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
             impl: str = "pallas") -> jax.Array:
    """``x [M, K]`` (FP8, quantized with scale ``1 / x_scale_inv``) times ``w [N, K]`` (FP8, K-major: a
    ``QuantizedKernel``'s data) -> ``[M, N]`` in ``out_dtype``, dequantized with both inverse scales (f32 scalars or
    [1]). ``impl``: ``pallas`` (GPU) or ``pallas_interpret`` (any backend: tests)."""
    (m, k), n = x.shape, w.shape[0]
    block_k = block_k or min(128, k)
    if k % block_k or x.shape[1] != w.shape[1] or jnp.dtype(x.dtype).itemsize != 1:
        raise ValueError(f"fp8_gemm takes FP8 x [M, K] and w [N, K] with block_k={block_k} dividing K; got "
                         f"{x.dtype} {x.shape} and {w.dtype} {w.shape}")
    block_n = block_n or default_block_n(n)
    rows_padded = max(_pow2_ceil(m), MIN_DOT_ROWS)
    kernel = functools.partial(_kernel, rows=m, rows_padded=rows_padded, n=n, block_n=block_n, block_k=block_k,
                               k_blocks=k // block_k)
    scales = [jnp.asarray(s, jnp.float32).reshape(1) for s in (x_scale_inv, w_scale_inv)]
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, block_n),),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=impl == "pallas_interpret",
        name="fp8_gemm",
    )(*scales, x, w)


SHAPES = {  # name: (N, K, out dtype)
    "wqkv": (3072, 2048, "bfloat16"), "wo": (2048, 2048, "float32"),
    "w_gate_up": (16384, 2048, "bfloat16"), "w_down": (2048, 8192, "float32"),
}
TINY = {"tiny": (48, 256, "float32")}
RESIDUAL_IMPLS = ("te_add", "xla_into")  # residual + x @ w (f32 output): compared with each other only
SWEEP = {"block_n": (16, 32, 64, 128), "block_k": (128, 256), "num_stages": (3, 5)}


def _gemm_fn(impl: str, tuning: dict, out_dtype, layers: int):
    recipe = Fp8Recipe()

    def one(x8, w8, x_scale, x_scale_inv, w_scale_inv, residual):
        if impl == "te_add":  # the rollout's earlier wo / w_down: TE's GEMM, then XLA's residual add
            return residual + te_backend.prequantized_matmul(x8, xla.QuantizedKernel(w8, w_scale_inv), x_scale, recipe,
                                                             out_dtype=jnp.float32, x_scale_inv=x_scale_inv)
        if impl == "xla_into":  # the add as the FP8 GEMM's C operand (precision.residual_in_gemm)
            return xla.prequantized_matmul_into(residual, x8, xla.QuantizedKernel(w8, w_scale_inv), x_scale, recipe,
                                                x_scale_inv=x_scale_inv)
        if impl == "te":
            return te_backend.prequantized_matmul(x8, xla.QuantizedKernel(w8, w_scale_inv), x_scale, recipe,
                                                  out_dtype=out_dtype, x_scale_inv=x_scale_inv)
        if impl == "xla":
            return xla.prequantized_matmul(x8, xla.QuantizedKernel(w8, w_scale_inv), x_scale, recipe,
                                           out_dtype=out_dtype, x_scale_inv=x_scale_inv)
        return fp8_gemm(x8, w8, x_scale_inv, w_scale_inv, out_dtype, impl=impl, **tuning)

    def run(xs, ws, x_scale, x_scale_inv, w_scale_inv, residual):
        # each layer its own input (XLA merges dots that share an operand: xla.gemm_into's would stop being FP8); the
        # residual impls add into the previous layer's output, as the residual stream does
        out = []
        for x8, w in zip(xs[:layers], ws[:layers], strict=True):
            out.append(one(x8, w, x_scale, x_scale_inv, w_scale_inv, residual))
            residual = out[-1] if impl in RESIDUAL_IMPLS else residual
        return out

    return jax.jit(run)


def _kernel_time(fn, args, layers: int, weight_bytes: int) -> dict:
    """GPU kernel microseconds per GEMM from a profiler trace of one call (all its kernels: a split-K GEMM's
    reduction included), and the weight bytes moved per second at that time. The wall time per GEMM above includes
    the host's launch of each kernel, which this harness cannot hide and the decode step does."""
    if jax.default_backend() != "gpu":
        return {"us_per_gemm": None}
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn(*args))
        summary = summarize_trace(trace_dir)
    us = summary["total_kernel_ms"] * 1e3 / layers
    return {"us_per_gemm": round(us, 3), "kernels_per_gemm": summary["kernels"] / layers,
            "kernel_names": [t["name"][:80] for t in summary["top"][:3]],
            "weight_tb_per_s": round(weight_bytes / (us * 1e-6) / 1e12, 3)}


def bench_shape(name, m, n, k, out_dtype, impls, tunings, layers, repeats, seed=0):
    rng = np.random.default_rng(seed)
    xs = [jnp.asarray(rng.normal(size=(m, k)) * 40, jnp.float32).astype(jnp.float8_e4m3fn) for _ in range(layers)]
    ws = [jnp.asarray(rng.normal(size=(n, k)) * 40, jnp.float32).astype(jnp.float8_e4m3fn) for _ in range(layers)]
    residual = jnp.asarray(rng.normal(size=(m, n)) * 100, jnp.float32)
    args = (xs, ws, jnp.float32(2.0), jnp.float32(0.5), jnp.float32(0.01), residual)
    rows, reference = [], None
    for impl in impls:
        for tuning in (tunings if impl.startswith("pallas") else [{}]):
            row = {"shape": name, "m": m, "n": n, "k": k, "out_dtype": out_dtype, "impl": impl, **tuning}
            try:
                fn = _gemm_fn(impl, tuning, jnp.dtype(out_dtype), layers)
                out = np.asarray(fn(*args)[0], np.float32)
                if reference is None:
                    reference = out
                row["max_rel_diff"] = float(np.max(np.abs(out - reference)) / max(np.max(np.abs(reference)), 1e-30))
                seconds = timeit(fn, *args, repeats=repeats)
            except Exception as e:  # a tiling Triton rejects, or TE missing: recorded, the sweep goes on
                row["error"] = error_text(e, 200)
                emit(rows, row)
                continue
            us = seconds / layers * 1e6
            row.update(wall_us_per_gemm=round(us, 3), **_kernel_time(fn, args, layers, n * k))
            emit(rows, row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="64,256", help="comma-separated M values")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--impls", default="te,xla,pallas",
                   help="te, xla, pallas; or the residual forms te_add, xla_into (f32 residual + x @ w; give both, "
                        "first as the reference)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help=f"the Pallas kernel over {SWEEP}")
    p.add_argument("--interpret", action="store_true", help="the kernel through Pallas' interpreter (CPU)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    shapes = TINY if args.interpret else {s: SHAPES[s] for s in args.shapes.split(",")}
    impls = ["pallas_interpret" if i == "pallas" and args.interpret else i for i in args.impls.split(",")]
    if args.interpret:
        impls = [i for i in impls if i != "te"]
    tunings = [{}]
    if args.sweep:
        tunings = [dict(zip(SWEEP, v, strict=True)) for v in itertools.product(*SWEEP.values())]
    t0 = time.time()
    rows = []
    for m, (name, (n, k, out_dtype)) in itertools.product([int(v) for v in args.rows.split(",")], shapes.items()):
        layers = 2 if args.interpret else args.layers
        rows += bench_shape(name, m, n, k, out_dtype, impls, tunings, layers, 2 if args.interpret else args.repeats)
    best = {}
    for r in rows:
        if r.get("us_per_gemm") is not None:
            key = f'{r["shape"]}/m{r["m"]}/{r["impl"].split("_")[0]}'
            if key not in best or r["us_per_gemm"] < best[key]["us_per_gemm"]:
                best[key] = r
    write_json(args.out, {**script_header("fp8_gemm", argv, t0), "rows": rows, "best": best})
    for key, r in sorted(best.items()):
        print(key, r["us_per_gemm"], "us", r["weight_tb_per_s"], "TB/s",
              {k: r[k] for k in SWEEP if k in r})
    print(f"wrote {args.out}: {len(rows)} rows", flush=True)
    if not best and jax.default_backend() == "gpu":
        sys.exit("no impl ran (see the rows' errors)")


if __name__ == "__main__":
    main()
