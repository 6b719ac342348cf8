"""``benchmarks/results/scale.json`` from the step records of ``benchmarks/scale_run.sh``: one run per
``scale_MODE_FxT[_shipped].jsonl`` (metrics.jsonl of ``python -m fp8rl_jax.main``), its last step (the earlier ones
compile), per phase: seconds, rollout tokens/s per GPU and peak memory per GPU; fp8_e2e over bf16 under the same
mesh; the rollout per GPU against the one-GPU ``bench rollout --model llama3_8b`` figure at the same per-GPU batch.
Every row says how many of its seconds went to compiling (``compile_s``, from ``time/<phase>_compile``);
``--less_compile`` takes them out of each phase and the step (for a run whose only step is its first).

    python benchmarks/scale_summary.py gpu_out/scale_*.jsonl --gpus 4 --device "4x NVIDIA H200" \
        --batch "128 prompts x 8, 2,048 new tokens, 512 decode slots" --shipped --one_gpu_rollout 24900 \
        --out benchmarks/results/scale.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

NAME = re.compile(r"scale_(?P<mode>[a-z0-9_]+?)_(?P<fsdp>\d+)x(?P<tensor>\d+)(?P<shipped>_shipped)?\.jsonl$")


PHASES = ("step", "rollout", "score", "train")


def run_row(path: Path, gpus: int, less_compile: bool = False) -> tuple[str, dict]:
    """(run name, its row) from one run's step records; the last step's numbers, less the seconds each phase spent
    compiling where ``less_compile``."""
    m = NAME.search(path.name)
    if m is None:
        raise SystemExit(f"error: {path}: not a scale_MODE_FxT.jsonl file of benchmarks/scale_run.sh")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"error: {path}: no step records (the run ended before its first step)")
    last = records[-1]
    fsdp, tensor = int(m["fsdp"]), int(m["tensor"])
    mesh = f"fsdp={fsdp}" + (f" x tensor={tensor}" if tensor > 1 else "")
    peaks = [v for k, v in last.items() if k.startswith("memory/") and k.endswith("_peak_gib")]
    compiled = {k[len("time/"):-len("_compile")]: v for k, v in last.items()
                if k.startswith("time/") and k.endswith("_compile")}
    compiled["step"] = sum(compiled.values())
    seconds = {p: last[f"time/{p}"] - (compiled.get(p, 0.0) if less_compile else 0.0) for p in PHASES}
    generated = last["rollout_tokens_per_s"] * last["time/rollout"]
    row = {"mode": m["mode"], "mesh": {"fsdp": fsdp, "tensor": tensor}, "backend": last.get("precision_backend"),
           "steps_completed": len(records), **{f"{p}_s": seconds[p] for p in PHASES},
           "peak_mem_gib": max(peaks) if peaks else None,
           "rollout_tokens_per_s_per_gpu": generated / seconds["rollout"] / gpus,
           "compile_s": {p: compiled.get(p, 0.0) for p in PHASES}}
    return f"{m['mode']} {mesh}", row


def one_gpu_figures(text: str | None) -> float | dict[str, float] | None:
    """``--one_gpu_rollout``: one number for every mode, or ``mode=N,mode=N`` (each mode's own one-GPU figure)."""
    if not text:
        return None
    if "=" not in text:
        return float(text)
    return {mode.strip(): float(value) for mode, value in (part.split("=") for part in text.split(","))}


def summarize(paths: list[Path], *, gpus: int, device: str, batch: str, shipped: bool,
              one_gpu_rollout: float | dict[str, float] | None,
              model: str = "llama3_8b (random weights, real shapes)", less_compile: bool = False) -> dict:
    runs = dict(run_row(p, gpus, less_compile) for p in paths)
    with_compile = lambda row, phase: row[f"{phase}_s"] + (row["compile_s"][phase] if less_compile else 0.0)
    ratios = {}
    for name, row in runs.items():
        one_gpu = one_gpu_rollout.get(row["mode"]) if isinstance(one_gpu_rollout, dict) else one_gpu_rollout
        if one_gpu:
            ratios.setdefault(name, {})["rollout_per_gpu_vs_one_gpu"] = row["rollout_tokens_per_s_per_gpu"] / one_gpu
        if row["mode"] != "fp8_e2e":
            continue
        bf16 = next((r for r in runs.values() if r["mode"] == "bf16" and r["mesh"] == row["mesh"]), None)
        if bf16:
            ratios.setdefault(name, {}).update({"train_speedup": bf16["train_s"] / row["train_s"],
                                                "step_speedup": bf16["step_s"] / row["step_s"]})
            if less_compile:  # the same steps as measured, compiling included
                ratios[name].update({f"{p}_speedup_with_compile": with_compile(bf16, p) / with_compile(row, p)
                                     for p in ("train", "step")})
    return {"model": model, "gpus": gpus, "device": device, "batch": batch, "shipped_sizes": shipped,
            "times_less_compile": less_compile, "runs": runs, "one_gpu_rollout_tokens_per_s": one_gpu_rollout,
            "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--batch", required=True, help="the batch sizes the runs used, in words")
    p.add_argument("--shipped", action="store_true", help="the runs used configs/llama8b.py's own sizes")
    p.add_argument("--one_gpu_rollout", default=None,
                   help="one GPU's bench rollout tokens/s at the same per-GPU batch: N, or mode=N,mode=N")
    p.add_argument("--less_compile", action="store_true",
                   help="take each phase's compile seconds out of its time (a run of one step)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    summary = summarize(args.files, gpus=args.gpus, device=args.device, batch=args.batch, shipped=args.shipped,
                        one_gpu_rollout=one_gpu_figures(args.one_gpu_rollout), less_compile=args.less_compile)
    text = json.dumps(summary, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
