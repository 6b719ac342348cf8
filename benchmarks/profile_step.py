"""Top GPU kernels of one decode chunk and one train step of a GRPO run, per precision mode.

    python benchmarks/profile_step.py --modes bf16,fp8_e2e --out profile.json [--set KEY=VALUE ...]

For each mode (a child process each, like ``bench e2e``): build the trainer from ``--config``, run one warm-up RL
step, then trace (``jax.profiler``) ``generate_steps`` chunks of the next step's rollout and that step's first
minibatch update, and sum the GPU kernels' durations by name. The decode trace starts once the first traced chunk's
arguments are ready (its host dispatch shows as idle time) and runs over ``--decode_chunks`` consecutive chunks,
dispatched as the driver dispatches them (one in flight), so a gap between chunks shows too. Writes ``{mode:
{"decode": {...}, "train": {...}}}`` with each phase's total kernel time, the kernel count and the top kernels
(name, ms, share), grouped into families (GEMM, FP8 cast/amax, attention, elementwise/fusion, copies, collectives).

While it profiles, XLA runs its command buffers (CUDA graphs) as separate launches unless
``--xla_enable_command_buffers_during_profiling=true``: idle time between kernels in such a trace is the launches',
which a graph replay would not pay. ``--graphs`` sets that flag, so the trace shows the run as it runs unprofiled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from fp8rl_jax.bench import tree_commit
from fp8rl_jax.bench.trace import summarize_trace

GRAPHS_FLAG = "--xla_enable_command_buffers_during_profiling=true"


def profile_mode(config: str, mode: str, sets: list[str], trace_root: str, top: int = 25,
                 decode_chunks: int = 1) -> dict:
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
    out, calls = {}, {}

    def traced(phase, fn, count=1):
        """Trace ``count`` consecutive calls of ``fn``: the first after its arguments are ready, the last waited."""
        def wrapper(*args, **kw):
            if phase in out:
                return fn(*args, **kw)
            calls[phase] = calls.get(phase, 0) + 1
            d = os.path.join(trace_root, phase)
            if calls[phase] == 1:
                unfinished = [p for p in calls if p != phase and p not in out]
                if unfinished:  # a trace of fewer calls than asked is still open: no second one can start
                    jax.profiler.stop_trace()
                    raise RuntimeError(f"the step made {calls[unfinished[0]]} traced {unfinished[0]} calls, fewer "
                                       f"than the {decode_chunks} asked (--decode_chunks)")
                jax.block_until_ready([a for a in jax.tree.leaves(args) if isinstance(a, jax.Array)])
                jax.profiler.start_trace(d)
            result = fn(*args, **kw)
            if calls[phase] == count:
                jax.block_until_ready(result)
                jax.profiler.stop_trace()
                out[phase] = summarize_trace(d, top=top)
            return result
        return wrapper

    trainer.engine.generate_steps = traced("decode", trainer.engine.generate_steps, decode_chunks)
    trainer._train_step = traced("train", trainer._train_step)
    record = trainer.step()
    trainer.close()
    if "decode" not in out:
        raise RuntimeError(f"the rollout made {calls.get('decode', 0)} generate_steps calls, fewer than "
                           f"--decode_chunks={decode_chunks}")
    out["decode"]["steps"] = 8 * decode_chunks  # the driver's steps_per_sync: 8 a chunk
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
    ap.add_argument("--decode_chunks", type=int, default=1, help="consecutive generate_steps calls traced")
    ap.add_argument("--graphs", action="store_true",
                    help="keep XLA's command buffers (CUDA graphs) while profiling (by default XLA launches their "
                         "kernels one by one under a profiler)")
    ap.add_argument("--one", default="")
    args = ap.parse_args(argv)
    if args.one:
        from fp8rl_jax.fp8 import te

        te.preload()
        with tempfile.TemporaryDirectory() as tmp:
            result = profile_mode(args.config, args.one, args.set, tmp, args.top, args.decode_chunks)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    from fp8rl_jax.bench.e2e import MODES

    results = {}
    for mode in args.modes.split(","):
        env = dict(os.environ)
        flags = [MODES[mode][1], GRAPHS_FLAG if args.graphs else ""]
        env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), *flags) if f)
        with tempfile.TemporaryDirectory() as tmp:
            one = os.path.join(tmp, "one.json")
            cmd = [sys.executable, __file__, "--one", mode, "--config", args.config, "--out", one,
                   "--top", str(args.top), "--decode_chunks", str(args.decode_chunks),
                   *[f"--set={s}" for s in args.set]]
            try:
                code = subprocess.run(cmd, env=env, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            results[mode] = json.load(open(one)) if code == 0 and os.path.exists(one) else {"error": f"exit {code}"}
            results[mode]["xla_flags"] = env["XLA_FLAGS"]
            results[mode]["commit"] = tree_commit()
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        for phase in ("decode", "train"):
            r = results[mode].get(phase)
            if r and "error" not in r:
                print(mode, phase, r["total_kernel_ms"], "ms", {f: v["share"] for f, v in r["families"].items()})


if __name__ == "__main__":
    main()
