"""Block scaling's forward operand of the down projection: h = silu(gate) * up in 1 x 128 tiles, made by one kernel
from the gate/up GEMM's output (``kernels.swiglu_grad.swiglu_tiles``) against the route it replaces (XLA's fusion
writes h in BF16, then ``block_quantize.quantize_tiles`` reads it) and against XLA alone, at llama1b's sizes.

    JAX_PLATFORMS=cuda python benchmarks/swiglu_tiles_speed.py --out swiglu_tiles_h200.json [--bits]
    python benchmarks/swiglu_tiles_speed.py --check --out /tmp/swiglu_tiles_cpu.json   # CPU: interpreted, tiny

A row: the path, the gate/up output's shape [M, 2F], the kernel's rows a program and warps, the median wall-clock
ms of one jitted call, and (``--trace``) the GPU's kernel time from a profiler trace with the GB/s of the bytes the
kernel must move (gate/up read once, h's FP8 values and f32 scales written). ``--bits`` first compares, on every
finite BF16 value, the sigmoid of each of ``SIGMOIDS`` as XLA computes it and as a Pallas (Triton) kernel does, and
the kernel's tiles against XLA's form of them: a kernel and XLA must make the same tiles, since a rollout and a
trainer may each take one of them.
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
from fp8rl_jax.fp8 import block_mlp  # noqa: E402
from fp8rl_jax.kernels.block_quantize import TILE, quantize_tiles  # noqa: E402
from fp8rl_jax.kernels.swiglu_grad import swiglu_tiles  # noqa: E402

E4M3 = jnp.float8_e4m3fn
F = 8192  # llama1b's intermediate size
SHAPES = {"train": 40960, "decode": 256}  # rows: one microbatch of 32 x 1280 tokens; a decode step's 256 slots
SIGMOIDS = {
    "exp": lambda x: 1.0 / (1.0 + jnp.exp(-x)),  # kernels.swiglu_grad.sigmoid's
    "exp2": lambda x: 1.0 / (1.0 + jnp.exp2(x * -1.4426950408889634)),
    "logistic": jax.lax.logistic,
    "tanh": lambda x: 0.5 + 0.5 * jnp.tanh(0.5 * x),
}


def moved_bytes(m: int, f: int) -> int:
    """gate/up [M, 2F] BF16 read once; h's FP8 values [M, F] and f32 scales [M, F / 128] written."""
    return m * 2 * f * 2 + m * f + m * f // TILE * 4


def all_bf16(rows: int = 512) -> jax.Array:
    """Every finite BF16 value (65,280), zeros after them: [rows, 128] f32."""
    bits = np.arange(2**16, dtype=np.uint16)
    v = bits.view(jnp.bfloat16).astype(np.float32)
    v = v[np.isfinite(v)]
    return jnp.asarray(np.pad(v, (0, rows * TILE - v.size)).reshape(rows, TILE))


def sigmoid_bits(interpret: bool = False) -> list[dict]:
    """Each sigmoid of ``SIGMOIDS`` on every finite BF16 value: XLA's f32 against a Pallas kernel's."""
    from jax.experimental import pallas as pl

    x = all_bf16()
    rows = []
    for name, fn in SIGMOIDS.items():
        def kernel(x_ref, o_ref, fn=fn):
            o_ref[...] = fn(x_ref[...])

        spec = pl.BlockSpec((64, TILE), lambda i: (i, 0))
        pallas = jax.jit(pl.pallas_call(kernel, grid=(x.shape[0] // 64,), in_specs=[spec], out_specs=spec,
                                        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32), interpret=interpret))
        a, b = np.asarray(jax.jit(fn)(x)), np.asarray(pallas(x))
        ulps = np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))
        rows.append({"sigmoid": name, "values": int(x.size), "differ": int(np.sum(a != b)), "max_ulp": int(ulps.max())})
    return rows


def tiles_bits(interpret: bool = False) -> dict:
    """``swiglu_tiles`` against XLA's form, every finite BF16 gate with random ups: values and scales that differ."""
    gate = all_bf16().astype(jnp.bfloat16)
    up = jax.random.normal(jax.random.PRNGKey(0), gate.shape).astype(jnp.bfloat16)
    gate_up = jnp.concatenate([gate, up], axis=1)
    want = jax.jit(lambda a: block_mlp.swiglu_tiles_any(a, jnp.bfloat16, E4M3, "xla"))(gate_up)
    impl = "pallas_interpret" if interpret else "pallas"
    got = jax.jit(lambda a: block_mlp.swiglu_tiles_any(a, jnp.bfloat16, E4M3, impl))(gate_up)
    q = [np.asarray(t[0].astype(jnp.float32)) for t in (want, got)]
    same = lambda a, b: (a == b) | (np.isnan(a) & np.isnan(b))
    return {"check": "swiglu_tiles_vs_xla", "values": int(q[0].size), "differ": int(np.sum(~same(*q))),
            "scales_differ": int(np.sum(~same(np.asarray(want[1]), np.asarray(got[1]))))}


def path_fn(path: str, block_rows: int | None, warps: int, interpret: bool):
    if path == "kernel":
        return lambda a: swiglu_tiles(a, E4M3, jnp.bfloat16, interpret=interpret, num_warps=warps,
                                      block_rows=block_rows)
    if path == "two_kernels":  # the route before: XLA writes h, the quantizer kernel reads it
        def two(a):
            f = a.shape[1] // 2
            h = block_mlp.swiglu_h(a[:, :f], a[:, f:], jnp.bfloat16)
            return quantize_tiles(h, E4M3, cols=False, interpret=interpret, num_warps=warps, block_rows=block_rows)
        return two
    if path == "xla":
        return lambda a: block_mlp.swiglu_tiles_any(a, jnp.bfloat16, E4M3, "xla")
    raise ValueError(f"unknown path {path!r}")


def bench(path, m, f, block_rows, warps, timed, interpret, with_trace) -> dict:
    row = {"path": path, "gate_up": [m, 2 * f], "block_rows": block_rows, "num_warps": warps,
           "bytes": moved_bytes(m, f)}
    gate_up = (jax.random.normal(jax.random.PRNGKey(1), (m, 2 * f), jnp.float32) * 2).astype(jnp.bfloat16)
    fn = jax.jit(path_fn(path, block_rows, warps, interpret))
    try:
        ms = timeit(fn, gate_up, repeats=timed) * 1e3
    except Exception as e:  # a launch that does not compile: recorded, the rest runs
        row["error"] = error_text(e)
        return row
    row["ms"] = round(ms, 4)
    if with_trace:
        summary = trace.trace_one_call(fn, gate_up)
        if "error" in summary:
            row["kernel_ms_error"] = summary["error"]
        else:
            row.update(kernel_ms=round(summary["total_kernel_ms"], 4), kernels=summary["kernels"])
            row["kernel_gb_per_s"] = round(row["bytes"] / (row["kernel_ms"] * 1e-3) / 1e9, 1)
    return row


def main(argv: list[str] | None = None) -> None:
    p = script_parser(__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)}")
    p.add_argument("--paths", default="kernel,two_kernels,xla")
    p.add_argument("--block-rows", default="16,32,64,128", help="the kernel's rows a program (comma-separated)")
    p.add_argument("--num-warps", default="2,4,8", help="the kernel's num_warps values (comma-separated)")
    p.add_argument("--bits", action="store_true", help="first the sigmoids' and the tiles' bits, XLA against Pallas")
    args, argv = harness.parse_script_args(p, "swiglu_tiles_speed", argv)
    t0, rows, bits = time.time(), [], []
    if args.bits:
        for row in (*sigmoid_bits(args.check), tiles_bits(args.check)):
            emit(bits, row)
    shapes = {"check": 256} if args.check else {s: SHAPES[s] for s in args.shapes.split(",")}
    f = 256 if args.check else F
    for m in shapes.values():
        for path in args.paths.split(","):
            sizes = [None] if path == "xla" else [int(b) for b in args.block_rows.split(",")]
            for block_rows in sizes:
                for warps in ([0] if path == "xla" else map(int, args.num_warps.split(","))):
                    emit(rows, bench(path, m, f, block_rows, warps, 1 if args.check else args.timed, args.check,
                                     args.trace and not args.check))
    write_script_result(args.out, "swiglu_tiles_speed", argv, t0, rows, args.commit, bits=bits)


if __name__ == "__main__":
    main()
