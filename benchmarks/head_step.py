"""The LM head of the train step alone, custom VJP against autodiff: forward (scoring) and forward+backward (loss).

    python benchmarks/head_step.py [--batch 32] [--length 1088] [--vocab 128256] [--dim 2048] [--chunk 256]
                                   [--untied] [--reps 5] [--out head_step.json]

Defaults: one microbatch of the Llama-3.2-1B profile of issue #9 (tied 128256 x 2048 table held in f32, 32
sequences of 1088 tokens, chunks of 256, BF16 compute, entropy computed and not differentiated, as in the train
step). ``new`` is ``rl.scoring.chunked_head_logprobs`` (what ``token_logprobs`` runs for a BF16 head); ``old`` is
``rl.scoring.autodiff_head_logprobs`` without FP8 state, the head every train step ran before. Prints and writes
the median wall time of each jitted program over ``--reps`` calls after one warm-up call.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.rl.scoring import autodiff_head_logprobs, chunked_head_logprobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=1088)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--untied", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tied = not a.untied
    precision = Precision(compute_dtype="bfloat16")
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shape = (a.vocab, a.dim) if tied else (a.dim, a.vocab)
    kernel = 0.02 * jax.random.normal(keys[0], shape, jnp.float32)
    hidden = jax.random.normal(keys[1], (a.batch, a.length, a.dim), jnp.float32).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (a.batch, a.length), 0, a.vocab)
    weights = jax.random.normal(keys[3], (a.batch, a.length), jnp.float32)

    def head(which, h, k):
        if which == "new":
            return chunked_head_logprobs(h, k, targets, chunk=a.chunk, with_entropy=True, kernel_nk=tied,
                                         dtype=precision.dtype)
        params = {"embed": k} if tied else {"lm_head": k}
        return autodiff_head_logprobs(params, h, targets, precision=precision, chunk=a.chunk, with_entropy=True)

    def loss(h, k, which):
        logp, ent = head(which, h, k)
        return jnp.sum(logp * weights) + 0.0 * jnp.sum(jax.lax.stop_gradient(ent))

    programs = {}
    for which in ("old", "new"):
        programs[f"{which}_score"] = jax.jit(lambda h, k, w=which: head(w, h, k))
        programs[f"{which}_loss_grad"] = jax.jit(jax.value_and_grad(lambda h, k, w=which: loss(h, k, w),
                                                                    argnums=(0, 1)))
    result = {"device": str(jax.devices()[0].device_kind), "args": vars(a), "median_ms": {}}
    for name, fn in programs.items():
        jax.block_until_ready(fn(hidden, kernel))
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(hidden, kernel))
            times.append(time.perf_counter() - t0)
        result["median_ms"][name] = round(1e3 * float(np.median(times)), 2)
        print(name, result["median_ms"][name], "ms", flush=True)
    m = result["median_ms"]
    result["speedup"] = {"score": round(m["old_score"] / m["new_score"], 3),
                         "loss_grad": round(m["old_loss_grad"] / m["new_loss_grad"], 3)}
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
