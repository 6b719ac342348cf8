"""Top GPU kernels of one decode chunk and one train step of a GRPO run, per precision mode.

    python benchmarks/profile_step.py --modes bf16,fp8_e2e --out profile.json [--set KEY=VALUE ...]

For each mode (a child process each, like ``bench e2e``): build the trainer from ``--config``, run one warm-up
RL step, then trace (``jax.profiler``) one ``generate_steps`` chunk of the rollout and the first minibatch update of
the next step, and sum the GPU kernels' durations by name. Writes ``{mode: {"decode": {...}, "train": {...}}}``
with each phase's total kernel time, the kernel count and the top kernels (name, ms, share), grouped into
families (GEMM, FP8 cast/amax, attention, elementwise/fusion, copies, collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from fp8rl_jax.bench.trace import summarize_trace


def profile_mode(config: str, mode: str, sets: list[str], trace_root: str, top: int = 25) -> dict:
    import jax

    from fp8rl_jax.bench.e2e import MODES, _value
    from fp8rl_jax.trainer import Trainer

    path, _, arg = config.partition(":")
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in sets)}
    overrides.update({"precision.mode": MODES[mode][0], "workdir": os.path.join(trace_root, "run"), "steps": 2,
                      "checkpoint.every": 0, "checkpoint.save_final": False, "logging.progress": False,
                      "logging.tensorboard": False, "logging.plots": False, "data.num_eval": 0})
    overrides.update(MODES[mode][2])  # the mode's own settings (fp8_e2e_head: the FP8 head; fp8_e2e_xla: the backend)
    trainer = Trainer.from_file(path, arg or None, **overrides)
    trainer.step()  # compile, calibrate
    out = {}

    def traced(phase, fn):
        def wrapper(*args, **kw):
            if phase in out:
                return fn(*args, **kw)
            jax.block_until_ready([a for a in jax.tree.leaves(args) if isinstance(a, jax.Array)])
            d = os.path.join(trace_root, phase)
            jax.profiler.start_trace(d)
            result = jax.block_until_ready(fn(*args, **kw))
            jax.profiler.stop_trace()
            out[phase] = summarize_trace(d, top=top)
            return result
        return wrapper

    trainer.engine.generate_steps = traced("decode", trainer.engine.generate_steps)
    trainer._train_step = traced("train", trainer._train_step)
    record = trainer.step()
    trainer.close()
    out["decode"]["steps"] = 8  # the driver's steps_per_sync: one chunk
    out["train"]["sequences"] = trainer.minibatch
    out["step_time"] = {k: round(v, 3) for k, v in record.items() if k.startswith("time/")}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/llama1b.py")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--modes", default="bf16_cublas,fp8_e2e")
    ap.add_argument("--out", default="profile.json")
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--top", type=int, default=25, help="kernel names kept per phase (by time)")
    ap.add_argument("--one", default="")
    args = ap.parse_args(argv)
    if args.one:
        from fp8rl_jax.fp8 import te

        te.preload()
        with tempfile.TemporaryDirectory() as tmp:
            result = profile_mode(args.config, args.one, args.set, tmp, args.top)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    from fp8rl_jax.bench.e2e import MODES

    results = {}
    for mode in args.modes.split(","):
        env = dict(os.environ)
        if MODES[mode][1]:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {MODES[mode][1]}".strip()
        with tempfile.TemporaryDirectory() as tmp:
            one = os.path.join(tmp, "one.json")
            cmd = [sys.executable, __file__, "--one", mode, "--config", args.config, "--out", one,
                   "--top", str(args.top), *[f"--set={s}" for s in args.set]]
            try:
                code = subprocess.run(cmd, env=env, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            results[mode] = json.load(open(one)) if code == 0 and os.path.exists(one) else {"error": f"exit {code}"}
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        for phase in ("decode", "train"):
            r = results[mode].get(phase)
            if r and "error" not in r:
                print(mode, phase, r["total_kernel_ms"], "ms", {f: v["share"] for f, v in r["families"].items()})


if __name__ == "__main__":
    main()
