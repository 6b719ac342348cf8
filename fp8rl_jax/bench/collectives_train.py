"""The train section of ``bench collectives``: what the sharded train step moves between devices, per precision.

The train step (``rl.step.make_train_step``) of a cut-down Llama-3.1-8B is compiled under an FSDP mesh (8 forced CPU
devices by default) and its collectives are read from the compiled HLO (``parallel.hlo``), each weighted by how many
times it runs in one step (the trip counts of the loops around it). Nothing runs: the step is lowered on abstract
arrays and compiled, so any shape fits.

Per mode (``bf16``, ``fp8_e2e``, ``fp8_rollout``, whose train step is the BF16 one):
  all_gather_bytes   bytes every device receives through all-gathers in one step (its own shard included)
  all_gather_dtypes  their HLO element types
  weight_gathers     how many times the step gathers each block weight, counted in the HLO: the all-gathers whose
                     result has the shape of one layer's kernel, over (layers x 4 linears)
  gathers_needed     G, how many times it must: per microbatch once in the forward and, with ``model.remat=full``
                     (as ``configs/llama8b.py`` ships), once more in the backward pass
  gather_ratio       all_gather_bytes / (G x params_f32_bytes): 1 when the whole model crosses in f32 each time,
                     0.25 for FP8 block weights and nothing else, 0.5 for BF16 ones
  all_reduce_count   all-reduces run in one step (the gradient reductions, the loss's sums, the FP8 amaxes)

The shape (``--train_model llama3_8b`` cut down): D 256, F 896, 8 heads and 2 kv heads of 32, 4 layers, vocab 1024:
the 8B's proportions (F = 3.5 D, kv = D / 4) with embedding and head at 13% of the parameters, as in the 8B.

``python -m fp8rl_jax.bench.collectives_train`` prints the section (it forces 8 CPU devices when JAX is not yet
started).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MODES = ("bf16", "fp8_e2e", "fp8_rollout")
LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
# the cut-down Llama-3.1-8B: 8B's ratios, 16x narrower, 4 layers, a vocab that keeps embed + head at 13% of it
SMALL_8B = {"hidden_size": 256, "intermediate_size": 896, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2,
            "head_dim": 32, "vocab_size": 1024}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train_modes", default="bf16,fp8_e2e,fp8_rollout")
    parser.add_argument("--train_fsdp", type=int, default=8, help="the mesh's fsdp axis (data = tensor = 1)")
    parser.add_argument("--train_remat", default="full", help="model.remat of the train step")
    parser.add_argument("--train_microbatches", type=int, default=1)
    parser.add_argument("--train_sequences", type=int, default=16, help="sequences per microbatch")
    parser.add_argument("--train_length", type=int, default=64, help="tokens per sequence")


def small_config():
    """The cut-down Llama-3.1-8B of this section (``SMALL_8B``)."""
    from fp8rl_jax.model.config import preset

    return preset("llama3_8b").replace(**SMALL_8B)


def params_f32_bytes(config) -> int:
    """The f32 bytes of all the model's params (blocks, embedding, head, norms)."""
    import jax
    import numpy as np

    from fp8rl_jax.model import llama

    shapes = jax.eval_shape(lambda: llama.init_params(config, jax.random.PRNGKey(0)))
    return sum(4 * int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))


def kernel_shapes(config) -> set[tuple[int, int]]:
    """One layer's kernels, [K, N] and [N, K] (a gather may move either layout)."""
    c = config
    shapes = {(c.hidden_size, c.q_size + 2 * c.kv_size), (c.q_size, c.hidden_size),
              (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size)}
    return shapes | {(n, k) for k, n in shapes}


def train_step_hlo(config, mode: str, fsdp: int = 8, remat: str = "full", microbatches: int = 1,
                   sequences: int = 16, length: int = 64) -> str:
    """The compiled HLO text of the train step of ``mode`` under a mesh of ``fsdp`` devices (lowered on abstract
    arrays: nothing is allocated or run)."""
    import types

    import jax
    import jax.numpy as jnp
    import optax

    from fp8rl_jax.fp8 import kv as kvq
    from fp8rl_jax.fp8.linear import mesh_context
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.model import llama
    from fp8rl_jax.parallel import rules
    from fp8rl_jax.parallel.mesh import make_mesh
    from fp8rl_jax.rl.step import LossConfig, make_train_step

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {MODES}")
    if jax.device_count() < fsdp:
        raise ValueError(f"fsdp={fsdp} needs {fsdp} devices, JAX sees {jax.device_count()} (on CPU set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={fsdp} before JAX starts)")
    # the train step's precision: FP8 only in fp8_e2e (fp8_rollout trains in BF16); the xla backend on CPU
    precision = Precision(backend="xla" if mode == "fp8_e2e" else "bf16")
    optimizer = optax.adamw(1e-5)
    mesh = make_mesh(types.SimpleNamespace(data=1, fsdp=fsdp, tensor=1), devices=jax.devices()[:fsdp])
    params = jax.eval_shape(lambda: llama.init_params(config, jax.random.PRNGKey(0)))
    state = {"params": params, "opt_state": jax.eval_shape(optimizer.init, params),
             "fp8_state": jax.eval_shape(lambda: llama.init_fp8_state(config, precision)),
             "kv_scales": jax.eval_shape(lambda: kvq.init_kv_scales(config.num_layers)),
             "rng": jax.eval_shape(lambda: jax.random.PRNGKey(0)), "step": jax.ShapeDtypeStruct((), jnp.int32)}
    sharding = rules.state_shardings(state, mesh)
    step = make_train_step(config, precision, optimizer, LossConfig(), remat=remat, state_sharding=sharding)
    shape = (microbatches, sequences, length)
    minibatch = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32), "mask": jax.ShapeDtypeStruct(shape, jnp.float32),
                 "old_logp": jax.ShapeDtypeStruct(shape, jnp.float32),
                 "rollout_logp": jax.ShapeDtypeStruct(shape, jnp.float32),
                 "advantages": jax.ShapeDtypeStruct(shape[:2], jnp.float32)}
    # as the step places them: sequences (axis 1) over data+fsdp
    minibatch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rules.batch_sharding(mesh, a.shape, 1))
                 for k, a in minibatch.items()}
    with mesh_context(mesh, precision.backend):
        return step.jitted.lower(state, minibatch).compile().as_text()


def measure(text: str, config, needed: int | None = None) -> dict:
    """The section's numbers of one compiled train step (see the module docstring). ``needed``: how many times the
    step needs each block weight (microbatches x 2 under ``remat=full``); the gather ratio's G, else the counted one
    (``weight_gathers``)."""
    from fp8rl_jax.parallel import hlo

    ran = [(c, n) for c, n in hlo.executed(text) if n]
    gathers = [(c, n) for c, n in ran if c.kind == "all-gather"]
    kernels = kernel_shapes(config)
    weight = [(c, n) for c, n in gathers if len(c.shape) == 1 and c.shape[0] in kernels]
    g = sum(n for _, n in weight) / (config.num_layers * len(LINEARS))
    by_dtype: dict[str, int] = {}
    for c, n in gathers:
        by_dtype[c.dtype] = by_dtype.get(c.dtype, 0) + c.bytes * n
    gather_bytes = sum(c.bytes * n for c, n in gathers)
    total = params_f32_bytes(config)
    reduces = [(c, n) for c, n in ran if c.kind == "all-reduce"]
    return {
        "all_gather_bytes": gather_bytes,
        "all_gather_dtypes": sorted(by_dtype),
        "all_gather_bytes_by_dtype": by_dtype,
        "weight_gathers": int(g) if g == int(g) else g,
        "weight_gather_bytes": sum(c.bytes * n for c, n in weight),
        "weight_gather_dtypes": sorted({c.dtype for c, _ in weight}),
        "params_f32_bytes": total,
        "gathers_needed": needed or g,
        "gather_ratio": round(gather_bytes / ((needed or g) * total), 4) if (needed or g) else None,
        "all_reduce_count": sum(n for _, n in reduces),
        "all_reduce_ops": len(reduces),
        "reduce_scatter_bytes": sum(c.bytes * n for c, n in ran if c.kind == "reduce-scatter"),
        "all_reduce_bytes": sum(c.bytes * n for c, n in reduces),
    }


def needed_gathers(remat: str, microbatches: int) -> int | None:
    """How many times a step must gather each block weight: per microbatch once in the forward and, with
    ``remat=full``, once more in the backward's recomputation (None: count it from the HLO)."""
    return 2 * microbatches if remat == "full" else None


def train_section(args=None) -> dict:
    """``{mode: {"mesh", "all_gather_bytes", "all_gather_dtypes", "weight_gathers", "all_reduce_count", ...}}`` of
    the cut-down 8B's train step under FSDP (``args``: the flags of ``add_arguments``; any missing take their
    defaults)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    opt = {k: getattr(args, k, v) for k, v in vars(defaults).items()}
    config = small_config()
    out = {}
    for mode in opt["train_modes"].split(","):
        text = train_step_hlo(config, mode, opt["train_fsdp"], opt["train_remat"], opt["train_microbatches"],
                              opt["train_sequences"], opt["train_length"])
        out[mode] = {"mesh": {"data": 1, "fsdp": opt["train_fsdp"], "tensor": 1}, "remat": opt["train_remat"],
                     "microbatches": opt["train_microbatches"], "model": {"preset": "llama3_8b", **SMALL_8B},
                     **measure(text, config, needed_gathers(opt["train_remat"], opt["train_microbatches"]))}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fp8rl_jax.bench.collectives_train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if "jax" not in sys.modules:  # forced CPU devices, unless the caller chose otherwise
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flag = f"--xla_force_host_platform_device_count={args.train_fsdp}"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    print(json.dumps(train_section(args), indent=1))


if __name__ == "__main__":
    main()
