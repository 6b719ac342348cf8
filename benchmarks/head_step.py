"""The LM head's training step alone on one GPU: forward + backward of the chunked head (BF16, the FP8 custom VJP,
the autodiff FP8 head it replaced, ``fp8_grad``: the BF16 head with its backward GEMMs in FP8,
``precision.lm_head_grad_fp8``, and ``fp8_recompute``: that head with its backward's logit recompute in FP8 too,
``precision.lm_head_recompute_fp8``; ``fp8_recompute_f32``: that recompute writing its logits in f32 instead of
``fp8_heads.RECOMPUTE_LOGITS_DTYPE``; ``fp8_recompute_xla``: its logit gradient by XLA's ops, not the
``kernels.head_grad`` kernel) at a microbatch's shape, compile and run timed separately.

    JAX_PLATFORMS=cuda python benchmarks/head_step.py --out head_step.json [--hidden 4096 --untied]

Each variant is one value_and_grad over the hidden state, the kernel and (FP8) the head's state, jitted as the
trainer jits it (``rl.step.jit_head_program``); the run time is the median of ``--runs`` calls after two warm-up
calls (``fp8rl_jax.bench.timeit``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp

from fp8rl_jax.bench import device_name, emit, timeit
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import fp8_heads, heads, llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.rl.step import jit_head_program


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=1280)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--variants", default="bf16,fp8,fp8_autodiff")
    p.add_argument("--out", default="")
    args = p.parse_args()
    tied = not args.untied
    precision = Precision(backend="xla", lm_head_fp8=True)
    programs = {"bf16": precision.replace(lm_head_fp8=False),  # each variant's precision, as the trainer jits it
                "fp8_grad": precision.replace(lm_head_fp8=False, lm_head_grad_fp8=True),
                "fp8_recompute": precision.replace(lm_head_fp8=False, lm_head_grad_fp8=True,
                                                   lm_head_recompute_fp8=True)}
    programs["fp8_recompute_f32"] = programs["fp8_recompute_xla"] = programs["fp8_recompute"]
    config = dataclasses.replace(preset("tiny"), hidden_size=args.hidden, vocab_size=args.vocab, tie_embeddings=tied)
    state = llama.init_fp8_state(config, precision)["lm_head"]
    for role, scale in (("x", 448 / 8.0), ("kernel", 448 / 0.1), ("grad", 57344 / 0.05)):
        state[role] = dict(state[role], scale=jnp.float32(scale))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    hidden = jax.random.normal(keys[0], (args.rows, args.tokens, args.hidden), jnp.bfloat16)
    shape = (args.vocab, args.hidden) if tied else (args.hidden, args.vocab)
    kernel = 0.02 * jax.random.normal(keys[1], shape, jnp.float32)
    targets = jax.random.randint(keys[2], (args.rows, args.tokens), 0, args.vocab)

    def loss(variant, h, k, st):
        if variant == "bf16":
            logp, _ = heads.chunked_head_logprobs(h, k, targets, kernel_nk=tied, dtype=jnp.bfloat16)
        elif variant == "fp8":
            logp, _ = fp8_heads.fp8_chunked_head_logprobs(h, k, targets, st, precision=precision, kernel_nk=tied)
        elif variant in ("fp8_grad", "fp8_recompute", "fp8_recompute_f32", "fp8_recompute_xla"):
            logits = jnp.float32 if variant == "fp8_recompute_f32" else None  # None: the package's default
            logp, _ = fp8_heads.fp8_grad_head_logprobs(h, k, targets, st, precision=programs[variant], kernel_nk=tied,
                                                     recompute_dtype=logits,
                                                     grad_impl="xla" if variant == "fp8_recompute_xla" else "auto")
        else:
            params = {"embed": k} if tied else {"lm_head": k}
            logp, _ = heads.autodiff_head_logprobs(params, h, targets, precision=precision, head_state=st)
        return jnp.sum(logp)

    rows = []
    for variant in args.variants.split(","):
        grad = jax.value_and_grad(lambda h, k, st, v=variant: loss(v, h, k, st), argnums=(0, 1, 2))
        # the trainer's jit: an FP8 head's programs compile with XLA's Triton GEMMs off on a GPU
        fn = jit_head_program(grad, programs.get(variant, precision))
        t0 = time.perf_counter()
        compiled = fn.lower(hidden, kernel, state).compile()
        compile_s = time.perf_counter() - t0
        seconds = timeit(compiled, hidden, kernel, state, repeats=args.runs)
        flops = 3 * 2 * args.rows * args.tokens * args.hidden * args.vocab  # forward, dx, dW (+ a recompute)
        row = {"variant": variant, "compile_s": compile_s, "step_ms": 1e3 * seconds, "tflops": flops / seconds / 1e12,
               "rows": args.rows, "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "tied": tied,
               "device": device_name()}
        emit(rows, row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
