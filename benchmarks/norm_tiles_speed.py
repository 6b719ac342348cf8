"""Block scaling's forward operand of q|k|v and gate|up in the rollout: RMSNorm (with the residual add before it) in
1 x 128 tiles from one kernel (``kernels.block_quantize.norm_tiles``) against the route it replaces (XLA's fusion
adds and norms, writes h in BF16, then ``block_quantize.quantize_tiles`` reads it), at llama1b's width.

    JAX_PLATFORMS=cuda python benchmarks/norm_tiles_speed.py --trace --out norm_tiles_h200.json
    python benchmarks/norm_tiles_speed.py --check --out /tmp/norm_tiles_cpu.json   # CPU: interpreted, tiny

A row: the path, the rows [P, D], the kernel's rows a program and warps, the median wall-clock ms of one jitted call,
the elements of the kernel's FP8 tiles that differ from XLA's route (their sums of squares add in other orders) and
(``--trace``) the GPU's kernel time and kernel count from a profiler trace.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8rl_jax import bench as harness  # noqa: E402
from fp8rl_jax.bench import emit, error_text, script_parser, timeit, trace, write_script_result  # noqa: E402
from fp8rl_jax.kernels.block_quantize import norm_tiles, quantize_tiles  # noqa: E402
from fp8rl_jax.model.norm import rms_norm  # noqa: E402

E4M3 = jnp.float8_e4m3fn
D = 2048  # llama1b's hidden size
SHAPES = {"decode": 256, "prefill": 16384}  # a decode step's 256 slots; a prefill of 256 prompts of 64 tokens
EPS = 1e-5


def inputs(p: int, d: int):
    k = jax.random.split(jax.random.PRNGKey(p), 3)
    x = (jax.random.normal(k[0], (p, d)) * 2).astype(jnp.bfloat16)
    y = jax.random.normal(k[1], (p, d)).astype(jnp.bfloat16)
    w = 1 + 0.1 * jax.random.normal(k[2], (d,))
    return x, y, w


def path_fn(path: str, rows: int | None, warps: int, interpret: bool):
    if path == "kernel":
        return lambda x, y, w: norm_tiles(x, w, EPS, E4M3, add=y, h_dtype=jnp.bfloat16, rows_per_program=rows,
                                          num_warps=warps, interpret=interpret)
    if path == "two_kernels":  # the route before: XLA adds and norms, the quantizer kernel reads h
        def two(x, y, w):
            s = x + y
            q, inv_t = quantize_tiles(rms_norm(s, w, EPS, jnp.bfloat16), E4M3, cols=False, interpret=interpret)
            return s, q, inv_t
        return two
    raise ValueError(f"unknown path {path!r}")


def bench(path, p, d, rows, warps, timed, interpret, with_trace) -> dict:
    row = {"path": path, "x": [p, d], "rows_per_program": rows, "num_warps": warps}
    args = inputs(p, d)
    fn = jax.jit(path_fn(path, rows, warps, interpret))
    try:
        ms = timeit(fn, *args, repeats=timed) * 1e3
        got = fn(*args)
    except Exception as e:  # a launch that does not compile: recorded, the rest runs
        row["error"] = error_text(e)
        return row
    row["ms"] = round(ms, 4)
    want = jax.jit(path_fn("two_kernels", None, 0, interpret))(*args)
    q = [np.asarray(t[1].astype(jnp.float32)) for t in (got, want)]
    row.update(values=int(q[0].size), differ=int(np.sum(q[0] != q[1])),
               scales_differ=int(np.sum(np.asarray(got[2]) != np.asarray(want[2]))),
               residual_differs=int(np.sum(np.asarray(got[0], np.float32) != np.asarray(want[0], np.float32))))
    if with_trace:
        summary = trace.trace_one_call(fn, *args)
        if "error" in summary:
            row["kernel_ms_error"] = summary["error"]
        else:
            row.update(kernel_ms=round(summary["total_kernel_ms"], 4), kernels=summary["kernels"])
    return row


def main(argv: list[str] | None = None) -> None:
    p = script_parser(__doc__, timed=20)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)}")
    p.add_argument("--paths", default="kernel,two_kernels")
    p.add_argument("--rows", default="1,2,4,8", help="the kernel's rows a program (comma-separated)")
    p.add_argument("--num-warps", default="1,2,4", help="the kernel's num_warps values (comma-separated)")
    args, argv = harness.parse_script_args(p, "norm_tiles_speed", argv)
    t0, rows = time.time(), []
    shapes = {"check": 128} if args.check else {s: SHAPES[s] for s in args.shapes.split(",")}
    d = 256 if args.check else D
    for p_rows in shapes.values():
        for path in args.paths.split(","):
            kernel = path == "kernel"
            for r in ([int(r) for r in args.rows.split(",")] if kernel else [None]):
                for warps in (map(int, args.num_warps.split(",")) if kernel else [0]):
                    emit(rows, bench(path, p_rows, d, r, warps, 1 if args.check else args.timed, args.check,
                                     args.trace and not args.check))
    write_script_result(args.out, "norm_tiles_speed", argv, t0, rows, args.commit)


if __name__ == "__main__":
    main()
