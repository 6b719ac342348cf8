"""Where a block-scaled FP8 linear's training time goes: one linear's forward and backward at llama1b's training
shapes, BF16 against block scaling (``fp8.xla``, its GEMMs ``kernels.block_gemm``), split into its GEMMs and its
quantizers.

    JAX_PLATFORMS=cuda python benchmarks/block_linear_speed.py --out block_linear_h100.json

Linears ``x [M, K] @ w [K, N]``, M = one microbatch's tokens (32 sequences x 1280), llama1b's four (q|k|v 2048 ->
3072, o 2048 -> 2048, gate|up 2048 -> 16384, down 8192 -> 2048). Paths, each y, dx and dw of one linear (BF16
activations and output gradient, f32 master weight, as the train step has them):

  bf16         ``jax.vjp`` of a BF16 ``x @ w`` (f32 accumulation; XLA's cuBLAS GEMMs)
  tensor       ``xla.fp8_matmul`` under per-tensor delayed scaling, E4M3 (XLA's cuBLASLt FP8 GEMMs)
  block        ``xla.fp8_matmul`` under block scaling, E4M3 (1 x 128 tiles, 128 x 128 weight blocks)
  block_gemms  the block path's three kernel calls alone, on operands quantized beforehand
  block_quant  the block path's quantizers alone: x and g in 1 x 128 tiles, x^T and g^T in 1 x 128 tiles along
               the tokens (``block.tile_quantize_both``: its kernels on a GPU), w in 128 x 128 blocks twice (the
               forward's w^T and the dgrad's w)
  block_quant_xla  the same with XLA's form of ``tile_quantize_both`` (``tile_quantize`` of x^T and g^T)
  q_x, q_xt, q_g, q_gt, q_w   each of those quantizers alone (XLA's): x's 1 x 128 tiles, x^T's, g's, g^T's, w's
                              blocks (both forms); against a per-tensor ``q_x_tensor`` (x's amax, then x scaled to E4M3)

One timed call is one jit holding a ``lax.scan`` over ``--repeats`` linears, each on its own x and g (the weight
shared), every output kept; the median of ``--timed`` calls, divided by the repeats. XLA's Triton GEMMs are off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--xla_gpu_enable_triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from fp8rl_jax.bench import device_name, emit, error_text, timeit, tree_commit  # noqa: E402
from fp8rl_jax.fp8 import block, xla  # noqa: E402
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state  # noqa: E402
from fp8rl_jax.kernels.block_gemm import block_gemm_mgpu  # noqa: E402

LINEARS = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}  # K, N
PATHS = ("bf16", "tensor", "block", "block_gemms", "block_quant", "block_quant_xla")
QUANT_PATHS = ("q_x", "q_xt", "q_g", "q_gt", "q_w", "q_x_tensor")  # --paths only
E4M3 = jnp.float8_e4m3fn
BLOCK = Fp8Recipe(scaling="block", fp8_format="e4m3")
TENSOR = Fp8Recipe(fp8_format="e4m3")


def _linear(recipe):
    state = init_linear_state(recipe)

    def run(x, w, g):
        y, vjp = jax.vjp(lambda x, w: xla.fp8_matmul(x, w, state, recipe, jnp.bfloat16), x, w)
        dx, dw = vjp(g)
        return y, dx, dw

    return run


def _bf16(x, w, g):
    y, vjp = jax.vjp(lambda x, w: jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16), x, w)
    dx, dw = vjp(g)
    return y, dx, dw


def _quant(x, w, g, impl="auto"):
    """The block linear's quantizers, as ``fp8.xla`` calls them (``impl``: ``block.tile_quantize_both``'s)."""
    qx, sx = block.tile_quantize(x, E4M3)
    (qg, sg), (qgt, sgt) = block.tile_quantize_both(g, E4M3, impl=impl)
    _, (qxt, sxt) = block.tile_quantize_both(x, E4M3, rows=False, impl=impl)
    qwt, swt = block.block_quantize(w.T, E4M3)
    qw, sw = block.block_quantize(w, E4M3)
    return qx, sx, qg, sg, qxt, sxt, qgt, sgt, qwt, swt, qw, sw


def _tensor_quant(x):
    scale = 448.0 / jnp.max(jnp.abs(x)).astype(jnp.float32)
    return (x.astype(jnp.float32) * scale).astype(E4M3), 1.0 / scale


ONE_QUANT = {"q_x": lambda x, w, g: block.tile_quantize(x, E4M3),
             "q_xt": lambda x, w, g: block.tile_quantize(x.T, E4M3),
             "q_g": lambda x, w, g: block.tile_quantize(g, E4M3),
             "q_gt": lambda x, w, g: block.tile_quantize(g.T, E4M3),
             "q_w": lambda x, w, g: (block.block_quantize(w.T, E4M3), block.block_quantize(w, E4M3)),
             "q_x_tensor": lambda x, w, g: _tensor_quant(x)}


def _gemms(q):
    qx, sx, qg, sg, qxt, sxt, qgt, sgt, qwt, swt, qw, sw = q
    y = block_gemm_mgpu(qx, sx, qwt, swt, jnp.bfloat16)  # [M, N]
    dx = block_gemm_mgpu(qg, sg, qw, sw, jnp.bfloat16)  # [M, K]
    dw = block_gemm_mgpu(qxt, sxt, qgt, sgt)  # [K, N] f32
    return y, dx, dw


def _scanned(path):
    """One jit: a scan over the (x, g) pairs, every output kept."""
    one = {"bf16": _bf16, "tensor": _linear(TENSOR), "block": _linear(BLOCK), "block_quant": _quant,
           "block_quant_xla": lambda x, w, g: _quant(x, w, g, "xla"), **ONE_QUANT}[path]
    return jax.jit(lambda xs, w, gs: lax.scan(lambda c, xg: (c, one(xg[0], w, xg[1])), 0, (xs, gs))[1])


def bench(name, m, k, n, paths, repeats, timed):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    xs = jax.random.normal(kx, (repeats, m, k), jnp.bfloat16)
    gs = (jax.random.normal(kg, (repeats, m, n), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
    flop = 6.0 * m * k * n
    rows = []
    for path in paths:
        row = {"linear": name, "m": m, "k": k, "n": n, "path": path}
        try:
            if path == "block_gemms":  # the operands quantized beforehand, outside the timed program
                q = jax.jit(lambda xs, gs: lax.scan(lambda c, xg: (c, _quant(xg[0], w, xg[1])), 0, (xs, gs))[1])(
                    xs, gs)
                fn = jax.jit(lambda q: lax.scan(lambda c, qq: (c, _gemms(qq)), 0, q)[1])
                seconds = timeit(fn, q, repeats=timed)
            else:
                seconds = timeit(_scanned(path), xs, w, gs, repeats=timed)
        except Exception as e:  # recorded, the rest runs
            row["error"] = error_text(e)
            emit(rows, row)
            continue
        ms = seconds / repeats * 1e3
        row.update(ms=round(ms, 3), tflops=round(flop / (ms * 1e-3) / 1e12, 1))
        emit(rows, row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--linears", default=",".join(LINEARS))
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--tokens", type=int, default=32 * 1280, help="M: one microbatch's tokens")
    p.add_argument("--repeats", type=int, default=3, help="linears in one timed call (a scan)")
    p.add_argument("--timed", type=int, default=5, help="timed calls (median)")
    p.add_argument("--commit", default="", help="default: bench.tree_commit()")
    args = p.parse_args(argv)
    start = time.time()
    rows = []
    for name in args.linears.split(","):
        k, n = LINEARS[name]
        rows += bench(name, args.tokens, k, n, args.paths.split(","), args.repeats, args.timed)
    totals = {}
    for r in rows:
        if "ms" in r:
            totals[r["path"]] = round(totals.get(r["path"], 0.0) + r["ms"], 3)
    out = {"device": device_name(), "backend": jax.default_backend(), "jax": jax.__version__,
           "commit": args.commit or tree_commit(),
           "command": "python benchmarks/block_linear_speed.py " + " ".join(sys.argv[1:]),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "tokens": args.tokens, "repeats": args.repeats,
           "ms_per_layer": totals, "rows": rows, "seconds": round(time.time() - start, 1)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({"ms_per_layer": totals}), flush=True)
    print(f"wrote {args.out}: {len(rows)} rows", flush=True)


if __name__ == "__main__":
    main()
