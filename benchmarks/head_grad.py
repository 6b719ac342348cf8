"""The head's fused FP8 logit gradient alone on one GPU (``fp8rl_jax.kernels.head_grad``): the Pallas kernel over
block sizes, grids and warps against its XLA form (what ``lm_head_recompute_fp8``'s backward ran before: the sum of
the exponentials, then the gradient with its E5M2 quantize and amax), at one llama1b head chunk (32 x 256 tokens x
128,256 logits, BF16) unless told otherwise.

    JAX_PLATFORMS=cuda python benchmarks/head_grad.py --out head_grad.json

Each entry: the median of ``--runs`` calls of one jitted function (``fp8rl_jax.bench.timeit``), the bytes it must
move (the logits read once, the E5M2 gradient written) per second, and how many of its E5M2 values differ from the
XLA form's.
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

# one kernel: "1:block_v:programs per SM:warps:stages:prefetch"; two: "2:block_m x block_v:warps:stages"
CONFIGS = ["1:2048:4:8:2:0", "1:2048:2:8:2:2", "1:2048:2:8:2:4", "1:4096:2:8:2:2", "1:4096:1:8:2:4",
           "1:2048:4:4:2:2", "1:8192:1:16:2:2", "1:4096:2:16:2:2", "1:1024:4:4:2:4", "1:2048:1:8:2:8",
           "2:4x1024:4:2", "2:8x512:4:2", "2:4x2048:8:2", "2:1x4096:8:2", "2:16x256:4:2", "2:2x2048:4:2"]


def _kwargs(config: str, cores: int) -> dict:
    passes, *rest = config.split(":")
    if passes == "1":
        block_v, per_sm, warps, stages, prefetch = (int(c) for c in rest)
        return dict(passes=1, block_v=block_v, programs=per_sm * cores, num_warps=warps, num_stages=stages,
                    prefetch=prefetch)
    (block_m, block_v), warps, stages = (int(c) for c in rest[0].split("x")), int(rest[1]), int(rest[2])
    return dict(passes=2, block_m=block_m, block_v=block_v, num_warps=warps, num_stages=stages)


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
    cores = getattr(jax.devices()[0], "core_count", None) or 132
    nbytes = m * v * (2 + 1)
    out = {"device": device_name(), "rows": m, "vocab": v, "bytes": nbytes, "sms": cores, "rows_out": []}

    def run(name, fn):
        f = jax.jit(fn)
        seconds = timeit(f, z, shift, g, y, repeats=args.runs)
        q, a = f(z, shift, g, y)
        row = {"impl": name, "ms": 1e3 * seconds, "tb_s": nbytes / seconds / 1e12, "amax": float(a)}
        if ref is not None:
            row["differs"] = float(np.mean(np.asarray(q.astype(jnp.float32) != ref.astype(jnp.float32))))
        print(json.dumps(row), flush=True)
        out["rows_out"].append(row)
        return q

    ref = None
    ref = run("xla", lambda z, s, g, y: logit_grad_fp8(z, s, g, y, inv_scale, g_scale, E5M2, impl="xla"))
    for config in args.configs.split(","):
        kwargs = _kwargs(config, cores)
        try:
            run(f"pallas {config}", lambda z, s, g, y, kw=kwargs: logit_grad_fp8(
                z, s, g, y, inv_scale, g_scale, E5M2, impl="pallas", **kw))
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not the end of the sweep
            print(json.dumps({"impl": f"pallas {config}", "error": repr(e)[:300]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
