"""The MLP's fused SwiGLU backward alone on one GPU (``fp8rl_jax.kernels.swiglu_grad``): the Pallas kernel over
block shapes and warps against what the te backend ran before it (XLA's autodiff of ``silu(gate) * up`` in BF16,
its quantization and amaxes, and the byte transposes of q(h) and q(dgate_up)) and against the kernel's own XLA form,
at a llama1b microbatch's shape (32 x 1,184 tokens, F = 8,192) unless told otherwise.

    JAX_PLATFORMS=cuda python benchmarks/swiglu_grad.py --out swiglu_grad.json

Each entry: the median of ``--runs`` calls of one jitted function (``fp8rl_jax.bench.timeit``) and the bytes it
must move (the gate/up output and g_h read; q(h) token-minor, q(dgate_up) in both layouts written) per second.

``--block-scaling``: block scaling's kernel instead (``swiglu_grad_tiles``, through ``fp8.block_mlp``) over
``--warps``, against the two linears' route it replaces (autodiff's BF16 gradient, then block scaling's quantizer
kernels on it and on h) and against its XLA form.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.bench import device_name, timeit
from fp8rl_jax.fp8.recipe import E4M3, E5M2, amax, quantize
from fp8rl_jax.kernels.swiglu_grad import swiglu_grad_fp8
from fp8rl_jax.kernels.transpose import transpose_bytes

CONFIGS = [((64, 64), 4), ((64, 64), 8), ((32, 128), 4), ((64, 128), 4), ((64, 128), 8), ((128, 64), 8),
           ((128, 128), 8), ((32, 64), 4)]


def before(gate_up, g_h, s_h, s_g):
    """The te backend's MLP backward before the kernel: autodiff in BF16, XLA quantize + amax, byte transposes."""
    f = g_h.shape[1]
    h, vjp = jax.vjp(lambda gu: (lambda g, u: jax.nn.silu(g) * u)(gu[:, :f], gu[:, f:]), gate_up)
    (dgu,) = vjp(g_h)
    qh, qg = quantize(h, s_h, E4M3), quantize(dgu, s_g, E5M2)
    return transpose_bytes(qh), qg, transpose_bytes(qg), amax(h), amax(dgu)


def block_rows(out: dict, gate_up, g_h, warps: list[int], chunks: list[int | None], runs: int,
               g_blocks: bool = False) -> None:
    """Block scaling's SwiGLU backward: the two linears' route, the XLA form and the kernel at each of ``warps`` and
    ``chunks`` (the same bytes to move as the te backend's kernel, the tiles' scales left out); ``g_blocks``: the
    gradient's weight-gradient form in 128 x 128 blocks (``block_wgrad='grad_blocks'``) in every route."""
    from fp8rl_jax.fp8 import block, block_mlp
    from fp8rl_jax.kernels.swiglu_grad import swiglu_grad_tiles

    nbytes, f = out["bytes"], g_h.shape[1]

    def two_linears(gate_up, g_h):
        h, vjp = jax.vjp(lambda gu: jax.nn.silu(gu[:, :f]) * gu[:, f:], gate_up)
        return (block.tile_quantize_both(h, E4M3, rows=False),
                block.tile_quantize_both(vjp(g_h)[0], E4M3, col_blocks=g_blocks))

    fns = {"two linears (autodiff BF16, then the quantizer kernels on dgate_up and h)": two_linears,
           "xla form": lambda a, b: block_mlp.swiglu_grad_tiles_any(a, b, E4M3, E4M3, "xla", g_blocks)}
    fns.update({f"pallas, {w} warps" + (f", chunks of {c}" if c else ""):
                (lambda a, b, w=w, c=c: swiglu_grad_tiles(a, b, E4M3, E4M3, num_warps=w, chunk=c, g_blocks=g_blocks))
                for c in chunks for w in warps})
    whole = jax.jit(lambda a, b: swiglu_grad_tiles(a, b, E4M3, E4M3, chunk=None, g_blocks=g_blocks))(gate_up, g_h)
    for name, fn in fns.items():
        row = {"impl": name}
        try:
            sec = timeit(jax.jit(fn), gate_up, g_h, repeats=runs)
            row.update(ms=sec * 1e3, tb_s=nbytes / sec / 1e12)
            if name.startswith("pallas"):  # every value and scale as the whole-block program's
                got = jax.jit(fn)(gate_up, g_h)
                same = [bool(jnp.array_equal(a, b)) for a, b in zip(got, whole, strict=True)]
                row["same_bits_as_whole_block"] = all(same)
        except Exception as e:  # a launch Triton refuses: say so, go on
            row["error"] = str(e)[:300]
        print(json.dumps(row))
        out["rows"].append(row)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32 * 1184)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--configs", default="",
                   help="block shapes and warps instead of CONFIGS', e.g. 16x64:4,32x64:8 (tokens x columns:warps)")
    p.add_argument("--block-scaling", action="store_true", help="block scaling's kernel (module docstring)")
    p.add_argument("--warps", default="4,8,16", help="--block-scaling's num_warps values")
    p.add_argument("--chunks", default="whole", help="--block-scaling's chunk values (whole: None), e.g. whole,32")
    p.add_argument("--g-blocks", action="store_true", help="--block-scaling: the gradient's wgrad form in blocks")
    p.add_argument("--out", default="")
    args = p.parse_args()
    configs = CONFIGS
    if args.configs:
        configs = [(tuple(int(v) for v in shape.split("x")), int(warps))
                   for shape, warps in (c.split(":") for c in args.configs.split(","))]
    m, f = args.tokens, args.intermediate
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    gate_up = (jax.random.normal(k[0], (m, 2 * f), jnp.float32) * 2).astype(jnp.bfloat16)
    g_h = (jax.random.normal(k[1], (m, f), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    nbytes = m * f * (2 * 2 + 2) + m * f + 2 * 2 * m * f  # read gate_up, g_h; write q(h)^T, q(dgate_up) x2
    out = {"device": device_name(), "tokens": m, "intermediate": f, "bytes": nbytes, "rows": []}
    if args.block_scaling:
        chunks = [None if c == "whole" else int(c) for c in args.chunks.split(",")]
        out["g_blocks"] = args.g_blocks
        block_rows(out, gate_up, g_h, [int(w) for w in args.warps.split(",")], chunks, args.runs, args.g_blocks)
    else:
        per_tensor_rows(out, gate_up, g_h, configs, args.runs)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


def per_tensor_rows(out: dict, gate_up, g_h, configs, runs: int) -> None:
    """The te backend's kernel over block shapes and warps against its XLA form and what it replaced."""
    nbytes = out["bytes"]
    s_h, s_g = jnp.float32(448 / 30), jnp.float32(57344 / 0.05)
    ref = jax.jit(lambda a, b: swiglu_grad_fp8(a, b, s_h, s_g, E4M3, E5M2, impl="xla"))(gate_up, g_h)
    for name, fn in (("before (autodiff BF16 + XLA quantize/amax + byte transposes)", before),
                     ("xla form of the kernel", lambda a, b, s, t: swiglu_grad_fp8(a, b, s, t, E4M3, E5M2,
                                                                                     impl="xla"))):
        sec = timeit(jax.jit(lambda a, b, fn=fn: fn(a, b, s_h, s_g)), gate_up, g_h, repeats=runs)
        row = {"impl": name, "ms": sec * 1e3, "tb_s": nbytes / sec / 1e12}
        print(json.dumps(row))
        out["rows"].append(row)
    for block, warps in configs:
        fn = jax.jit(lambda a, b, block=block, warps=warps: swiglu_grad_fp8(
            a, b, s_h, s_g, E4M3, E5M2, impl="pallas", block=block, num_warps=warps))
        row = {"impl": "pallas", "block": block, "num_warps": warps}
        try:
            got = fn(gate_up, g_h)
            same = [float(np.mean(np.asarray(a[:512, :512].astype(jnp.float32) == b[:512, :512].astype(jnp.float32))))
                    for a, b in zip(got[:3], ref[:3], strict=True)]
            sec = timeit(fn, gate_up, g_h, repeats=runs)
            row.update(ms=sec * 1e3, tb_s=nbytes / sec / 1e12, equal_to_xla_form=min(same),
                       amax_rel=[abs(float(a) / float(b) - 1) for a, b in zip(got[3:], ref[3:], strict=True)])
        except Exception as e:  # a config Triton refuses: say so, go on
            row["error"] = str(e)[:300]
        print(json.dumps(row))
        out["rows"].append(row)


if __name__ == "__main__":
    main()
