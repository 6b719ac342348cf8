"""How fast the ``xla`` backend's block-scaled emulation runs a gradient on a GPU, by ``block.GROUP_BYTES``.

    python benchmarks/block_step_speed.py [--out PATH]

``block.block_gemm`` adds one f32 product per 128-wide slice of its contraction axis; ``GROUP_BYTES`` sets how many
slices one batched dot makes (0: one dot a slice, a loop of 128-deep dots; the wgrad's contraction axis is the
tokens). Timed here: the policy-gradient loss's gradient (``bench fidelity``'s ``_loss_and_grad``) of SmolLM2-135M's
shapes with random weights on one microbatch of the arithmetic study (32 sequences x 192 tokens), ``--repeat`` calls
after a compile, for ``tensor`` scaling and for ``block`` at each ``--group-bytes``. Random weights: the shapes
decide the time, not the values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax import plan
from fp8rl_jax.bench import emit, fidelity, tree_commit
from fp8rl_jax.config import load_config_file
from fp8rl_jax.fp8 import block
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-bytes", default="0,33554432,268435456,1073741824")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="/tmp/block_step_speed.json")
    args = parser.parse_args()
    config = load_config_file("configs/smollm2_arith.py")
    config.precision.mode, config.precision.backend = "fp8_e2e", "xla"
    base = plan.run_precision(config, "train")
    forms = {"tensor": base, "block": base.replace(recipe=dataclasses.replace(base.recipe, scaling="block",
                                                                               fp8_format="e4m3"))}
    model = preset("smollm2_135m")
    params = llama.init_params(model, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.vocab_size, (args.sequences, args.width)), jnp.int32)
    mask = jnp.asarray(np.arange(args.width)[None] >= args.width // 4).repeat(args.sequences, 0)
    advantages = jnp.asarray(rng.standard_normal(args.sequences), jnp.float32)
    loss_cfg = plan.loss_config(config)
    runs = [("tensor", None)] + [("block", int(g)) for g in args.group_bytes.split(",")]
    rows = []
    for form, group_bytes in runs:
        if group_bytes is not None:
            block.GROUP_BYTES = group_bytes
        jax.clear_caches()
        precision = forms[form]
        state = llama.init_fp8_state(model, precision)
        step = fidelity._loss_and_grad(model, precision, loss_cfg)
        t = time.perf_counter()
        jax.block_until_ready(step(params, state, tokens, mask, advantages))
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.repeat):
            out = step(params, state, tokens, mask, advantages)
        jax.block_until_ready(out)
        row = {"form": form, "group_bytes": group_bytes, "ms": 1e3 * (time.perf_counter() - t) / args.repeat,
               "compile_s": compile_s}
        emit(rows, row)
    out = {"device": str(jax.devices()[0].device_kind), "commit": tree_commit(),
           "command": "python benchmarks/block_step_speed.py " + " ".join(sys.argv[1:]),
           "shape": f"SmolLM2-135M shapes, random weights, {args.sequences} x {args.width} tokens, one gradient",
           "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
