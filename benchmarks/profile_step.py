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
import collections
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile

FAMILIES = (  # first match wins; names are lower-cased kernel names
    ("gemm", ("gemm", "cublas", "cutlass", "sm90_xmma", "nvjet", "triton_gemm", "dot")),
    ("attention", ("attention", "flash", "fmha", "softmax", "decode_attention")),
    ("fp8_cast_amax", ("cast", "quantize", "amax", "transpose_kernel", "fp8")),
    ("collective", ("nccl", "all_reduce", "all_gather", "reduce_scatter")),
    ("copy", ("memcpy", "memset", "copy", "dynamic_update_slice", "dynamic-update-slice")),
    ("fusion", ("fusion", "loop_", "input_", "reduce", "triton")),
)


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, keys in FAMILIES if any(k in low for k in keys)), "other")


def summarize_trace(trace_dir: str, top: int = 25) -> dict:
    """GPU kernel time by name from the newest ``*.trace.json.gz`` under ``trace_dir``."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        return {"error": f"no trace under {trace_dir}"}
    events = json.load(gzip.open(files[-1]))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "/device:GPU" in n}
    by_name, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            by_name[e["name"]] += e["dur"] / 1e3
            count[e["name"]] += 1
    total = sum(by_name.values())
    if not total:
        return {"error": "no GPU kernels in the trace", "processes": sorted(names.values())}
    families = collections.Counter()
    for n, ms in by_name.items():
        families[family(n)] += ms
    return {
        "total_kernel_ms": round(total, 3), "kernels": sum(count.values()),
        "families": {f: {"ms": round(ms, 3), "share": round(ms / total, 3)} for f, ms in families.most_common()},
        "top": [{"name": n[:160], "ms": round(ms, 3), "calls": count[n], "share": round(ms / total, 3),
                 "family": family(n)} for n, ms in by_name.most_common(top)],
    }


def profile_mode(config: str, mode: str, sets: list[str], trace_root: str) -> dict:
    import jax

    from fp8rl_jax.bench.e2e import MODES, _value
    from fp8rl_jax.trainer import Trainer

    path, _, arg = config.partition(":")
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in sets)}
    overrides.update({"precision.mode": MODES[mode][0], "workdir": os.path.join(trace_root, "run"), "steps": 2,
                      "checkpoint.every": 0, "checkpoint.save_final": False, "logging.progress": False,
                      "logging.tensorboard": False, "logging.plots": False, "data.num_eval": 0})
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
            out[phase] = summarize_trace(d)
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
    ap.add_argument("--one", default="")
    args = ap.parse_args(argv)
    if args.one:
        from fp8rl_jax.fp8 import te

        te.preload()
        with tempfile.TemporaryDirectory() as tmp:
            result = profile_mode(args.config, args.one, args.set, tmp)
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
                   *[f"--set={s}" for s in args.set]]
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
