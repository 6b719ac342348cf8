"""The FP8 weight gradient's transposes alone on one GPU: XLA's transpose of a one-byte array against the Pallas
kernel (``fp8rl_jax.kernels.transpose``) over its block shapes and warps, at a llama1b microbatch's shapes
(32 x 1,280 tokens by the four linears' input and output widths).

    JAX_PLATFORMS=cuda python benchmarks/transpose_fp8.py --out transpose_fp8.json

Each entry: the median of ``--runs`` calls of one jitted transpose (``fp8rl_jax.bench.timeit``), and the rate as
bytes read plus written per second, beside the copy rate of the same bytes (``x + 1`` on uint8, read once and
written once) measured in the same process.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.bench import device_name, timeit
from fp8rl_jax.kernels.transpose import transpose_bytes

CONFIGS = [((32, 32), 4), ((64, 64), 4), ((64, 64), 8), ((64, 128), 4), ((128, 64), 4), ((128, 128), 4),
           ((128, 128), 8), ((32, 128), 4), ((128, 32), 4)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32 * 1280)
    p.add_argument("--cols", default="2048,3072,8192,16384")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", default="")
    args = p.parse_args()
    out = {"device": device_name(), "rows": args.rows, "shapes": []}
    for cols in map(int, args.cols.split(",")):
        x = jnp.asarray(np.random.RandomState(0).randint(0, 255, (args.rows, cols), np.uint8)).view(jnp.float8_e4m3fn)
        nbytes = 2 * x.size
        ref = np.asarray(x[:256, :256]).view(np.uint8).T
        entry = {"cols": cols, "bytes": nbytes}
        copy = jax.jit(lambda a: (lax_view(a) + 1))
        entry["copy_tb_s"] = nbytes / timeit(copy, x, repeats=args.runs) / 1e12
        entry["xla_tb_s"] = nbytes / timeit(jax.jit(lambda a: transpose_bytes(a, impl="xla")), x,
                                            repeats=args.runs) / 1e12
        entry["pallas"] = []
        for block, warps in CONFIGS:
            fn = jax.jit(lambda a, block=block, warps=warps: transpose_bytes(a, impl="pallas", block=block,
                                                                            num_warps=warps))
            try:
                y = fn(x)
                ok = bool((np.asarray(y[:256, :256]).view(np.uint8) == ref).all())
                rate = nbytes / timeit(fn, x, repeats=args.runs) / 1e12
                entry["pallas"].append({"block": block, "num_warps": warps, "tb_s": rate, "correct": ok})
            except Exception as e:  # a config Triton refuses: say so, go on
                entry["pallas"].append({"block": block, "num_warps": warps, "error": str(e)[:200]})
        print(json.dumps(entry))
        out["shapes"].append(entry)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def lax_view(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint8)


if __name__ == "__main__":
    main()
