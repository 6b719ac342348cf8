"""``bench collectives``: what the compiled programs move between devices, on 8 forced CPU devices.

No GPU needed: the programs are compiled for a mesh of 8 XLA:CPU devices and their collectives read from the
optimized HLO (``parallel.hlo``). This process forces the devices itself (``JAX_PLATFORMS=cpu``,
``--xla_force_host_platform_device_count=8``, set before JAX starts a backend; where one had already started it
runs itself again in a child process with them).

    python -m fp8rl_jax.bench collectives --out benchmarks/results/collectives_cpu.json

Sections. The file is one JSON object, a list of rows per section: ``{"decode": [...], ...}``. A section is one
function ``<name>_section(args) -> list[dict]`` listed in ``SECTIONS``; ``run`` tags each row with its section and
``output`` groups them back. A ``train`` section is one more function and one more entry in ``SECTIONS``.

``decode``: the rollout engine's decode program (``generate_steps``, its loop of decode steps) per trainer mesh and
rollout ``tensor_parallel``: the collectives inside the loop (count, and bytes per device: each collective's result,
a loop body counted once), those of the once-per-RL-step weight reshard (``load_params``), and, as the reference,
the same loop as the rollout ran on a mesh before it had a layout of its own (the weights in the trainer's layout,
sharded like their FSDP masters; the layers scanned).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

DEVICES = 8
_CHILD = "FP8RL_BENCH_COLLECTIVES_CHILD"


def _force_cpu_devices() -> None:
    """8 CPU devices, if no JAX backend has started yet (XLA reads its flags when it starts one)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    flag = f"--xla_force_host_platform_device_count={DEVICES}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


_force_cpu_devices()  # this module is imported only when its subcommand is chosen, before any backend starts

# (name, trainer mesh (data, fsdp, tensor), rollout tensor_parallel)
DECODE_MESHES = (("fsdp=8", (1, 8, 1), 1), ("fsdp=4 x tensor=2", (1, 4, 2), 1), ("fsdp=4 x tensor=2", (1, 4, 2), 2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama_small",
                        help="a model preset, or llama_small: Llama-3.2-1B's layout at D=256, 4 layers, 8 heads, "
                             "4 kv heads, F=1024, V=8192")
    parser.add_argument("--mode", default="fp8", choices=("bf16", "fp8", "fp8_kv"))
    parser.add_argument("--decode_slots", type=int, default=16)
    parser.add_argument("--decode_attention", default="xla", choices=("xla", "pallas_interpret"))
    parser.add_argument("--layer_loop", default="auto", choices=("auto", "scan", "unrolled"))
    parser.add_argument("--steps", type=int, default=4, help="decode steps in the compiled loop")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset")
    parser.add_argument("--sections", default="decode,train", help="which programs: decode, train")
    from fp8rl_jax.bench import collectives_train

    collectives_train.add_arguments(parser)  # the train section's --train_* flags


def _model(name: str):
    from fp8rl_jax.model.config import preset

    if name == "llama_small":
        return preset("llama3_1b").replace(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8,
                                           num_kv_heads=4, head_dim=32, vocab_size=8192)
    return preset(name)


def _precision(mode: str):
    from fp8rl_jax.fp8.policy import Precision

    return {"bf16": Precision(), "fp8": Precision(backend="xla"),
            "fp8_kv": Precision(backend="xla", kv_cache_dtype="float8_e4m3fn")}[mode]


def _counts(found) -> dict:
    from fp8rl_jax.parallel import hlo

    s = hlo.summary(found)
    return {"collectives": s["count"], "bytes": s["bytes"], "by_kind": s["by_kind"]}


def decode_section(args) -> list[dict]:
    """One row per ``DECODE_MESHES`` entry (see the module docstring)."""
    import jax
    import ml_collections

    from fp8rl_jax.fp8 import kv as kvq
    from fp8rl_jax.model import llama
    from fp8rl_jax.parallel import hlo, rules
    from fp8rl_jax.parallel.mesh import make_mesh, mesh_context
    from fp8rl_jax.rollout.engine import Engine, EngineConfig

    model, precision = _model("tiny" if args.smoke else args.model), _precision(args.mode)
    params = llama.init_params(model, jax.random.PRNGKey(0))
    fp8_state = llama.init_fp8_state(model, precision) if precision.fp8 else None
    kv_scales = kvq.init_kv_scales(model.num_layers) if precision.kv_fp8 else None
    rows = []
    for name, (data, fsdp, tensor), tensor_parallel in DECODE_MESHES:
        mesh = make_mesh(ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor}))
        on_mesh = (jax.device_put(params, rules.state_shardings(params, mesh)),
                   *jax.device_put((fp8_state, kv_scales), rules.replicated(mesh)))
        engine = Engine(model, precision, EngineConfig(
            max_concurrent_decodes=args.decode_slots, max_prefill_length=16, max_new_tokens=args.steps + 1,
            decode_attention=args.decode_attention, layer_loop=args.layer_loop, tensor_parallel=tensor_parallel),
            mesh=mesh)
        weights = engine.load_params(*on_mesh)
        reshard = engine._refit.program.lower(*on_mesh).compile().as_text()
        state = engine.init_decode_state()
        with mesh_context(engine.mesh):
            loop = hlo.loop_collectives(engine._generate_steps.lower(weights, state, args.steps).compile().as_text())
        # the reference, the rollout as it was on a mesh before it had a layout of its own: layers scanned, the
        # weights in the trainer's layout (sharded like their masters)
        old = Engine(model, precision, dataclasses.replace(engine.config, layer_loop="scan"), mesh=mesh)
        old_weights = old.load_params(*on_mesh)
        old_weights["weights"] = jax.device_put(old_weights["weights"],
                                                rules.state_shardings(old_weights["weights"], mesh))
        with mesh_context(old.mesh):
            before_loop = hlo.loop_collectives(old._generate_steps.lower(
                old_weights, old.init_decode_state(), args.steps).compile().as_text())
        loop_counts, reshard_counts = _counts(loop), _counts(hlo.collectives(reshard))
        rows.append({
            "mesh": name, "mesh_shape": dict(mesh.shape), "tensor_parallel": tensor_parallel,
            "rollout_mesh": dict(engine.mesh.shape), "model": "tiny" if args.smoke else args.model,
            "mode": args.mode, "decode_slots": args.decode_slots, "decode_attention": args.decode_attention,
            "layer_loop": args.layer_loop, "steps_per_loop": args.steps,
            "loop_collectives": loop_counts["collectives"], "loop_bytes": loop_counts["bytes"],
            "loop_by_kind": loop_counts["by_kind"],
            "reshard_collectives": reshard_counts["collectives"], "reshard_bytes": reshard_counts["bytes"],
            "reshard_by_kind": reshard_counts["by_kind"],
            "trainer_layout_loop_collectives": len(before_loop),
            "trainer_layout_loop_bytes": _counts(before_loop)["bytes"],
        })
        print(f"decode {name} tensor_parallel={tensor_parallel}: {rows[-1]['loop_collectives']} collectives, "
              f"{rows[-1]['loop_bytes']} bytes per device in the loop (trainer layout: "
              f"{rows[-1]['trainer_layout_loop_collectives']}, {rows[-1]['trainer_layout_loop_bytes']} bytes); "
              f"reshard {rows[-1]['reshard_bytes']} bytes", flush=True)
    return rows


def train_section(args) -> list[dict]:
    """The train step's FSDP weight gathers per precision mode (``bench/collectives_train.py``), a row per mode."""
    from fp8rl_jax.bench import collectives_train

    params = collectives_train.params_f32_bytes(collectives_train.small_config())
    return [{"mode": mode, "params_f32_bytes": params, **row}
            for mode, row in collectives_train.train_section(args).items()]


SECTIONS = {"decode": decode_section, "train": train_section}


def run(args) -> list[dict]:
    import jax

    if jax.default_backend() != "cpu" or jax.device_count() < DEVICES:
        # a backend had started before this module set the flags: the same command in a fresh process
        if os.environ.get(_CHILD):
            raise RuntimeError(f"bench collectives: {jax.device_count()} {jax.default_backend()} devices after "
                               f"forcing {DEVICES} CPU devices (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
        env = {**os.environ, _CHILD: "1"}
        sys.exit(subprocess.run([sys.executable, "-m", "fp8rl_jax.bench", *sys.argv[1:]], env=env).returncode)
    return [{"section": name, **row} for name in args.sections.split(",")
            for row in SECTIONS[name](args)]


def output(rows: list[dict], args) -> dict:
    """The file: ``{"decode": [a row per mesh], "train": {mode: row}, "params_f32_bytes": B}``."""
    out: dict = {}
    for row in rows:
        row = dict(row)
        section = row.pop("section")
        if section == "train":
            out["params_f32_bytes"] = row.pop("params_f32_bytes")
            out.setdefault("train", {})[row.pop("mode")] = row
        else:
            out.setdefault(section, []).append(row)
    return out
