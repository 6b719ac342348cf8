"""The demo scaled up as a new GPU user would: ``configs/smollm2_gsm8k.py`` with 32 prompts x 8 samples x 256 new
tokens, nothing else changed, for 20 RL steps; its records and a summary into one JSON file.

    python benchmarks/demo_scaled.py --out benchmarks/results/demo_scaled_h100.json [--commit SHA]

The summary is over the steps after the second (the first two compile the run's programs): the median
``time/step`` and ``rollout_tokens_per_s``, and the ``time/*_compile`` seconds as a share of the summed
``time/step``, over those steps and over all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

OVERRIDES = ("--config.rollout.prompts_per_step=32", "--config.rollout.samples_per_prompt=8",
             "--config.rollout.max_new_tokens=256")


def summary(records: list[dict], skip: int = 2) -> dict:
    """Medians after ``skip`` steps and the compile share, from the run's metrics records."""
    steps = [r for r in records if r.get("step", 0) >= 1]
    late = [r for r in steps if r["step"] > skip]

    def compile_share(rows):
        compiled = sum(v for r in rows for k, v in r.items() if k.startswith("time/") and k.endswith("_compile"))
        total = sum(r["time/step"] for r in rows)
        return compiled / total if total else None

    return {
        "steps": len(steps),
        "median_step_s_after_2": statistics.median(r["time/step"] for r in late) if late else None,
        "median_rollout_tokens_per_s_after_2": (statistics.median(r["rollout_tokens_per_s"] for r in late)
                                                if late else None),
        "compile_share_after_2": compile_share(late),
        "compile_share_all": compile_share(steps),
        "compile_s_by_step": {int(r["step"]): round(sum(v for k, v in r.items() if k.endswith("_compile")), 3)
                              for r in steps},
    }


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workdir", default="runs/smollm2_gsm8k", help="the config's own workdir (emptied first)")
    parser.add_argument("--commit", default="",
                        help="the commit that runs (a device's copy of the tree may report an older one)")
    parser.add_argument("--timeout", type=int, default=480)
    parser.add_argument("--log", default="", help="also write the run's whole output here (with JAX_LOG_COMPILES=1 "
                        "set: which programs compiled when)")
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    command = [sys.executable, "-m", "fp8rl_jax.main", "--config=configs/smollm2_gsm8k.py", *OVERRIDES,
               f"--steps={args.steps}"]
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if args.log:
        with open(args.log, "w") as f:
            f.write(run.stdout + run.stderr)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if not line.startswith(("W", "I0"))]
    print("\n".join(lines[-12:]), flush=True)
    metrics = os.path.join(args.workdir, "metrics.jsonl")
    records = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
    from fp8rl_jax.bench import tree_commit  # no JAX: the run itself is a child process

    commit = args.commit or tree_commit()
    out = {"records": records, "summary": summary(records), "device": device_name(), "commit": commit,
           "command": "python -m fp8rl_jax.main " + " ".join(command[3:]), "exit_status": run.returncode,
           "wall_s": round(time.perf_counter() - start, 1),
           "startup_messages": [line for line in lines if line.startswith(("precision:", "decode slots", "row widths",
                                                                          "rollout:"))]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["summary"]), flush=True)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
