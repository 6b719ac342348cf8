"""The head's FP8 logit gradient alone on one GPU (``fp8rl_jax.kernels.head_grad``): the two Pallas kernels over
tile shapes and warps, with their transposed store and without it (then the byte transpose kernel), against the
XLA form (what ``lm_head_recompute_fp8``'s backward ran before: the sum of the exponentials, then the gradient with
its E5M2 quantize and amax, then the byte transpose), at one llama1b head chunk (32 x 256 tokens x 128,256 logits,
BF16) unless told otherwise.

    JAX_PLATFORMS=cuda python benchmarks/head_grad.py --out head_grad.json

Each entry: the median of ``--runs`` calls of one jitted function (``fp8rl_jax.bench.timeit``), the bytes it must
move (the logits read once, the E5M2 gradient written, and its transpose where made) per second, and the share of
its E5M2 values that differ from the XLA form's.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.bench import device_name, timeit
from fp8rl_jax.fp8.recipe import E5M2
from fp8rl_jax.kernels.head_grad import logit_grad_fp8
from fp8rl_jax.kernels.transpose import transpose_bytes

# tiles "block_m x block_v : warps"
CONFIGS = ["32x256:4", "32x256:8", "32x128:4", "16x256:4", "32x512:8", "64x128:4", "64x256:8", "16x512:4",
           "8x1024:4", "2x2048:4"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32 * 256)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--configs", default=",".join(CONFIGS), help="as CONFIGS, comma-separated")
    p.add_argument("--out", default="")
    args = p.parse_args()
    m, v = args.rows, args.vocab
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    inv_scale, g_scale = jnp.float32(1 / 400.0), jnp.float32(57344 / 0.05)
    z = (jax.random.normal(k[0], (m, v), jnp.float32) * 1200).astype(jnp.bfloat16)  # logits ~ N(0, 3)
    shift = jnp.max(z.astype(jnp.float32) * inv_scale, axis=-1)
    g = jax.random.normal(k[1], (m,), jnp.float32) * 0.01
    y = jax.random.randint(k[2], (m,), 0, v)
    nbytes = m * v * (2 + 1)
    out = {"device": device_name(), "rows": m, "vocab": v, "bytes": nbytes, "rows_out": []}

    def run(name, fn):
        f = jax.jit(fn)
        seconds = timeit(f, z, shift, g, y, repeats=args.runs)
        q, a = f(z, shift, g, y)
        row = {"impl": name, "ms": 1e3 * seconds, "tb_s": nbytes / seconds / 1e12, "amax": float(a)}
        if isinstance(q, tuple):  # with the transpose: the bytes it writes
            q, q_t = q
            row["tb_s"] = (nbytes + m * v) / seconds / 1e12
            row["transpose_exact"] = bool(jnp.all(q_t == q.T))
        if ref is not None:
            row["differs"] = float(np.mean(np.asarray(q.astype(jnp.float32) != ref.astype(jnp.float32))))
        print(json.dumps(row), flush=True)
        out["rows_out"].append(row)
        return q

    ref = None
    ref = run("xla", lambda z, s, g, y: logit_grad_fp8(z, s, g, y, inv_scale, g_scale, E5M2, impl="xla")[0::2])
    run("xla + byte transpose", lambda z, s, g, y: (lambda q, _, a: ((q, transpose_bytes(q)), a))(
        *logit_grad_fp8(z, s, g, y, inv_scale, g_scale, E5M2, impl="xla")))
    for config in args.configs.split(","):
        shape, warps = config.split(":")
        kw = dict(impl="pallas", block=tuple(int(b) for b in shape.split("x")), num_warps=int(warps))
        try:  # the kernels with their transposed store, and without it followed by the byte transpose kernel
            run(f"pallas {config} transposed", lambda z, s, g, y, kw=kw: (lambda q, q_t, a: ((q, q_t), a))(
                *logit_grad_fp8(z, s, g, y, inv_scale, g_scale, E5M2, transposed=True, **kw)))
            run(f"pallas {config} + byte transpose", lambda z, s, g, y, kw=kw: (lambda q, _, a: (
                (q, transpose_bytes(q)), a))(*logit_grad_fp8(z, s, g, y, inv_scale, g_scale, E5M2, **kw)))
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not the end of the sweep
            print(json.dumps({"impl": f"pallas {config}", "error": repr(e)[:300]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
