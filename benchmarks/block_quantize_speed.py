"""Block scaling's quantizer kernel alone (``kernels.block_quantize.quantize_tiles``) at the llama1b train step's
sizes: its time and the HBM bandwidth it reaches, by form and ``num_warps``.

    JAX_PLATFORMS=cuda python benchmarks/block_quantize_speed.py --out block_quantize_h200.json [--trace]
    python benchmarks/block_quantize_speed.py --check --out /tmp/block_quantize_cpu.json   # CPU: interpreted

Tensors (one microbatch: 32 sequences x 1280 tokens), each in the forms the step asks of it:

  x        [40960, 2048] BF16   a linear's input: 1 x 128 tiles (the forward), 128 x 1 tiles transposed (the wgrad)
  x_down   [40960, 8192] BF16   w_down's input (the SwiGLU output), the same two forms
  g_res    [40960, 2048] f32    o's and w_down's output gradient (the residual stream's): both forms at once
  g_qkv    [40960, 3072] BF16   q|k|v's output gradient, both forms
  g_gate_up [40960, 16384] BF16 gate|up's output gradient, both forms

A row reports the median wall-clock ms of one jitted call (``--timed`` calls after a warm-up), the bytes the
kernel must move (its input read once, each form's FP8 values and f32 scales written) and the GB/s that makes;
``--trace`` adds the GPU's kernel time from a profiler trace and the GB/s at that time.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fp8rl_jax import bench as harness  # noqa: E402
from fp8rl_jax.bench import emit, error_text, script_parser, timeit, trace, write_script_result  # noqa: E402
from fp8rl_jax.kernels.block_quantize import TILE, quantize_tiles  # noqa: E402

TOKENS = 40960
TENSORS = {  # name -> (columns, dtype, the forms the step asks: "rows", "cols" or "both")
    "x": (2048, jnp.bfloat16, ("rows", "cols")),
    "x_down": (8192, jnp.bfloat16, ("rows", "cols")),
    "g_res": (2048, jnp.float32, ("both",)),
    "g_qkv": (3072, jnp.bfloat16, ("both",)),
    "g_gate_up": (16384, jnp.bfloat16, ("both",)),
}
CHECK_TENSORS = {"x": (256, jnp.bfloat16, ("rows", "cols", "both")), "g_res": (384, jnp.float32, ("both",))}
E4M3 = jnp.float8_e4m3fn


def moved_bytes(p: int, c: int, dtype, form: str) -> int:
    """The bytes one call must move: ``a`` read once; per form, P x C FP8 values and P x C / 128 f32 scales."""
    forms = 2 if form == "both" else 1
    return p * c * jnp.dtype(dtype).itemsize + forms * (p * c + p * c // 128 * 4)


def _kernel_ms(fn, a) -> dict:
    summary = trace.trace_one_call(fn, a)
    if "error" in summary:
        return {"kernel_ms_error": summary["error"]}
    return {"kernel_ms": round(summary["total_kernel_ms"], 4), "kernels": summary["kernels"]}


def bench(name, p, c, dtype, form, num_warps, timed, interpret, with_trace, block_rows=TILE) -> dict:
    row = {"tensor": name, "shape": [p, c], "dtype": jnp.dtype(dtype).name, "form": form, "num_warps": num_warps,
           "block_rows": block_rows, "bytes": moved_bytes(p, c, dtype, form)}
    a = jax.random.normal(jax.random.PRNGKey(0), (p, c), jnp.float32).astype(dtype)
    fn = jax.jit(lambda a: quantize_tiles(a, E4M3, rows=form in ("rows", "both"), cols=form in ("cols", "both"),
                                          interpret=interpret, num_warps=num_warps, block_rows=block_rows))
    try:
        ms = timeit(fn, a, repeats=timed) * 1e3
    except Exception as e:  # a kernel that does not compile at this num_warps: recorded, the rest runs
        row["error"] = error_text(e)
        return row
    row.update(ms=round(ms, 4), gb_per_s=round(row["bytes"] / (ms * 1e-3) / 1e9, 1))
    if with_trace:
        row.update(_kernel_ms(fn, a))
        if row.get("kernel_ms"):
            row["kernel_gb_per_s"] = round(row["bytes"] / (row["kernel_ms"] * 1e-3) / 1e9, 1)
    return row


def main(argv: list[str] | None = None) -> None:
    p = script_parser(__doc__)
    p.add_argument("--tensors", default=",".join(TENSORS), help=f"of {list(TENSORS)}")
    p.add_argument("--num-warps", default="4,8,16", help="the kernel's num_warps values (comma-separated)")
    p.add_argument("--tokens", type=int, default=TOKENS, help="the rows (256: a decode step's)")
    p.add_argument("--forms", default="", help="only these forms (rows, cols, both), e.g. rows")
    p.add_argument("--block-rows", default=str(TILE),
                   help="rows a program holds (below 128: the rows form alone; the kernel's default is by size)")
    args, argv = harness.parse_script_args(p, "block_quantize_speed", argv)
    table, tokens = (CHECK_TENSORS, 256) if args.check else (TENSORS, args.tokens)
    names = list(table) if args.check else args.tensors.split(",")
    for name in names:
        if name not in table:
            p.error(f"unknown tensor {name!r}; known: {list(table)}")
    t0, rows = time.time(), []
    for name in names:
        cols, dtype, forms = table[name]
        for form in forms:
            if args.forms and form not in args.forms.split(","):
                continue
            for block_rows in map(int, args.block_rows.split(",")):
                if block_rows != TILE and form != "rows":
                    continue
                for warps in map(int, args.num_warps.split(",")):
                    emit(rows, bench(name, tokens, cols, dtype, form, warps, 1 if args.check else args.timed,
                                     args.check, args.trace, block_rows))
    write_script_result(args.out, "block_quantize_speed", argv, t0, rows, args.commit)


if __name__ == "__main__":
    main()
