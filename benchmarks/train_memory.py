"""XLA's memory for one train step (and the initial calibration's pass) at given microbatch shapes, from the
compiled programs' memory analysis on this machine's first device: the state is abstract, nothing is allocated, so
shapes far past the device's memory can be asked about. The numbers behind ``rl.microbatch_tokens``' default
(``fp8rl_jax/rl/microbatch.py``).

    python benchmarks/train_memory.py --config configs/smollm2_gsm8k.py --preset smollm2_135m --shapes 32x512,256x512
    python benchmarks/train_memory.py --config configs/llama1b.py --preset llama3_1b --shapes 16x1280,32x1280

One JSON line per program and shape: XLA's temp bytes (the activations: what "Out of memory while trying to
allocate" asks for), argument and output bytes, and temp bytes per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's fp8rl_jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8rl_jax.config import load_config_file  # noqa: E402
from fp8rl_jax.fp8 import kv as kvq  # noqa: E402
from fp8rl_jax.model import llama  # noqa: E402
from fp8rl_jax.model.config import PRESETS  # noqa: E402
from fp8rl_jax.plan import (
    loss_config,  # noqa: E402
    run_precision,  # noqa: E402
)
from fp8rl_jax.rl.step import build_optimizer, make_calibrate, make_train_step  # noqa: E402


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--preset", required=True, help="the architecture: a name from model.config.PRESETS")
    parser.add_argument("--shapes", required=True, help="comma-separated SEQUENCESxTOKENS microbatch shapes")
    parser.add_argument("--set", action="append", default=[], help="config overrides key=value (ints, strs)")
    parser.add_argument("--programs", default="train", help="train and/or calibrate (the gradient pass)")
    args = parser.parse_args()
    path, _, arg = args.config.partition(":")
    c = load_config_file(path, arg or None)
    for item in args.set:
        k, v = item.split("=", 1)
        c.update_from_flattened_dict({k: type(c[k.split(".")[0]][k.split(".")[1]])(v)})
    model = PRESETS[args.preset]
    if c.model.num_layers:  # --set model.num_layers=N: the preset cut to its first N blocks, as the trainer does
        model = dataclasses.replace(model, num_layers=c.model.num_layers)
    precision = run_precision(c, "train")
    optimizer, _ = build_optimizer(c.optim, 10)
    dtype = jnp.dtype(c.model.param_dtype)
    params = jax.eval_shape(lambda: llama.init_params(model, jax.random.PRNGKey(0), dtype))
    state = {"params": params, "opt_state": jax.eval_shape(optimizer.init, params),
             "fp8_state": _abstract(llama.init_fp8_state(model, precision)),
             "kv_scales": _abstract(kvq.init_kv_scales(model.num_layers)),
             "rng": jax.ShapeDtypeStruct((2,), jnp.uint32), "step": jax.ShapeDtypeStruct((), jnp.int32)}
    own = c.rl.minibatches == 1
    for program in args.programs.split(","):
        for shape in args.shapes.split(","):
            b, t = map(int, shape.split("x"))
            t0 = time.perf_counter()
            if program == "train":
                fn = make_train_step(model, precision, optimizer, loss_config(c),
                                     old_logp_from_forward=own, remat=c.model.remat)
                f32 = jax.ShapeDtypeStruct((1, b, t), jnp.float32)
                mb = {"tokens": jax.ShapeDtypeStruct((1, b, t), jnp.int32), "mask": f32, "rollout_logp": f32,
                      "advantages": jax.ShapeDtypeStruct((1, b), jnp.float32), **({} if own else {"old_logp": f32})}
                compiled = fn.lower(state, mb).compile()
            else:  # the initial calibration's gradient pass over one microbatch
                fn = make_calibrate(model, precision, gradients=True, remat=c.model.remat)
                compiled = fn.observe.lower(params, state["fp8_state"], state["kv_scales"],
                                            jax.ShapeDtypeStruct((b, t), jnp.int32),
                                            jax.ShapeDtypeStruct((), jnp.float32)).compile()
            m = compiled.memory_analysis()
            out = {"program": program, "config": args.config, "preset": args.preset, "mode": c.precision.mode,
                   "backend": precision.backend, "remat": c.model.remat, "attention": c.precision.attention,
                   "sequences": b, "tokens": t, "temp_gib": m.temp_size_in_bytes / 2**30,
                   "argument_gib": m.argument_size_in_bytes / 2**30, "output_gib": m.output_size_in_bytes / 2**30,
                   "temp_mib_per_token": m.temp_size_in_bytes / 2**20 / (b * t),
                   "compile_s": round(time.perf_counter() - t0, 1), "device": str(jax.devices()[0])}
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
