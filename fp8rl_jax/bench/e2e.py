"""``bench e2e``: whole GRPO steps per phase, one precision mode per child process (``fp8rl_jax.bench``).

Each mode runs the trainer from ``--config`` (with ``--set`` overrides) in a fresh process, so that every mode
starts with an empty device and its own ``XLA_FLAGS``: ``--warmup`` steps (compilation, the first calibration),
then ``--steps`` timed steps whose phase times (``time/weights``: the sampler's FP8 kernels quantized;
``rollout``, ``reward``, ``score``, ``train``, ``calibrate``: KV and FP8 recalibration) are averaged. Modes:

    bf16           BF16 everywhere, XLA's default GEMMs (Triton for many shapes)
    bf16_cublas    the same with ``--xla_gpu_enable_triton_gemm=false`` (cuBLAS); the best BF16 is the faster
    fp8_rollout    FP8 sampler, BF16 trainer
    fp8_e2e        FP8 sampler and trainer, one set of delayed scales

Train throughput counts model FLOPs only (``6 x`` the GEMM parameters per trained token plus causal attention;
remat's recomputation is not counted), MFU is against the device's dense BF16 peak for every mode. The rollout's
fraction of its HBM bound uses the bytes one decode step must read (the sampler's weights once, the KV of the
average context of each slot) over the measured copy bandwidth; the phase includes prefill and host syncs.

Speedups in the summary are fp8_e2e over the best BF16 mode, phase by phase.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("weights", "rollout", "reward", "score", "train", "calibrate", "step")
MODES = {  # mode -> (precision.mode, extra XLA flags)
    "bf16": ("bf16", ""),
    "bf16_cublas": ("bf16", "--xla_gpu_enable_triton_gemm=false"),
    "fp8_rollout": ("fp8_rollout", ""),
    "fp8_e2e": ("fp8_e2e", ""),
}
# dense BF16 tensor-core peaks (TFLOP/s) by device kind prefix; FP8 doubles them on Hopper
BF16_PEAK_TFLOPS = {"NVIDIA H100": 989.4, "NVIDIA H200": 989.4, "NVIDIA GH200": 989.4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/llama1b.py", help="a config file (path[:arg])")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, e.g. --set model.source=preset (repeatable)")
    parser.add_argument("--modes", default="fp8_e2e,bf16,bf16_cublas,fp8_rollout")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per mode")
    parser.add_argument("--smoke", action="store_true", help="configs/tiny.py, bf16 and fp8_e2e, one timed step")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # child: run this mode, write --out


def run(args) -> list[dict]:
    if args.one:
        return [measure(args.config, args.one, args.set, args.warmup, args.steps)]
    if args.smoke:
        args.config, args.modes, args.steps = "configs/tiny.py", "bf16,fp8_e2e", 1
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"error: bench e2e: mode {mode!r}; allowed: {', '.join(MODES)}")
    rows = []
    for mode in modes:
        row = _child(args, mode)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # a mode that times out later still leaves the earlier ones
            Path(args.out).write_text(json.dumps(summarize(rows, args), indent=1))
    return rows


def _child(args, mode: str) -> dict:
    env = dict(os.environ)
    if MODES[mode][1]:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {MODES[mode][1]}".strip()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "fp8rl_jax.bench", "e2e", "--one", mode, "--config", args.config,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", str(out),
               *[f"--set={s}" for s in args.set]]
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code != 0 or not out.exists():
            return {"mode": mode, "error": f"child exited {code}"}
        return json.loads(out.read_text())[0]


def measure(config_path: str, mode: str, sets: list[str], warmup: int, steps: int) -> dict:
    """Build the trainer for ``mode``, run ``warmup`` then ``steps`` RL steps; the timed steps' averages."""
    import jax

    from fp8rl_jax.bench import device_name
    from fp8rl_jax.bench.rollout import _weight_bytes, copy_bandwidth
    from fp8rl_jax.model import llama
    from fp8rl_jax.trainer import Trainer

    path, _, arg = config_path.partition(":")
    overrides = dict(s.split("=", 1) for s in sets)
    overrides = {k: _value(v) for k, v in overrides.items()}
    with tempfile.TemporaryDirectory() as workdir:
        overrides.update({"precision.mode": MODES[mode][0], "workdir": workdir, "steps": warmup + steps,
                          "checkpoint.every": 0, "checkpoint.save_final": False, "logging.progress": False,
                          "logging.tensorboard": False, "logging.plots": False, "data.num_eval": 0})
        trainer = Trainer.from_file(path, arg or None, **overrides)
        records = [trainer.step() for _ in range(warmup + steps)]
        timed = records[warmup:]
        c, model = trainer.config, trainer.model
        precision = trainer.rollout_precision
        trainer.close()
    mean = lambda key: mean_of(timed, lambda r: r[key])  # noqa: E731
    row = {"mode": mode, "backend": timed[-1]["precision_backend"], "config": config_path, "overrides": sets,
           "warmup": warmup, "steps": steps, "sequences": c.rollout.prompts_per_step * c.rollout.samples_per_prompt,
           "max_new_tokens": c.rollout.max_new_tokens, "decode_slots": c.rollout.decode_slots,
           "device": device_name(), "devices": jax.device_count(),
           "attention": llama.resolve_attention(precision.attention, precision.dtype, model.head_dim),
           **{f"time_{p}": mean(f"time/{p}") for p in PHASES if f"time/{p}" in timed[0]},
           "response_length_mean": mean("response_length_mean"),
           "rollout_tokens_per_s": mean("rollout_tokens_per_s")}
    # train: model FLOPs of the trained tokens (prompt + completion) per train-phase second
    tokens = mean_of(timed, lambda r: r["train_tokens_per_s"] * r["time/train"])
    context = tokens / row["sequences"]  # mean trained sequence length
    prompt = context - row["response_length_mean"]
    attention = 6 * model.num_layers * model.q_size * context  # causal: 2 x 2 x T/2 per token and layer, x3 with bwd
    matmul_params = model.num_params() - model.vocab_size * model.hidden_size * (0 if model.tie_embeddings else 1)
    train_flops = tokens * (6 * matmul_params + attention)
    row["train_tflops"] = train_flops / row["time_train"] / 1e12 / jax.device_count()
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if row["device"].startswith(k)), None)
    row["mfu_bf16_peak"] = row["train_tflops"] / peak if peak else None
    # rollout: the decode step's bytes against the copy bandwidth
    if jax.default_backend() != "cpu":
        kv_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * (1 if precision.kv_fp8 else 2)
        step_bytes = _weight_bytes(model, precision) + row["decode_slots"] * (
            prompt + row["response_length_mean"] / 2) * kv_bytes
        bound = row["decode_slots"] / (step_bytes / copy_bandwidth()) / jax.device_count()
        row["rollout_hbm_bound_tokens_per_s"] = bound
        row["hbm_bound_fraction"] = row["rollout_tokens_per_s"] / bound
    row["peak_memory_gib"] = {p: timed[-1][f"memory/{p}_peak_gib"] for p in PHASES
                              if f"memory/{p}_peak_gib" in timed[-1]}
    return row


def mean_of(records: list[dict], fn) -> float:
    return sum(fn(r) for r in records) / len(records)


def _value(text: str):
    """A ``--set`` value: a Python literal where it parses as one (``true``/``false`` too, as on the main command
    line), else the string."""
    import ast

    if text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def output(rows: list[dict], args):
    """What ``--out`` holds: the child's row, or the summary."""
    return rows if args.one else summarize(rows, args)


def summarize(rows: list[dict], args) -> dict:
    """The file ``bench e2e`` writes: speedups of fp8_e2e over the best BF16 mode, and every mode's row."""
    import subprocess as sp

    ok = {r["mode"]: r for r in rows if "error" not in r}
    bf16 = [r for m, r in ok.items() if m.startswith("bf16")]
    fp8 = ok.get("fp8_e2e")
    best = lambda key: min(r[key] for r in bf16) if bf16 else None  # noqa: E731
    speedup = lambda key: best(key) / fp8[key] if fp8 and bf16 else None  # noqa: E731
    try:
        commit = sp.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "rollout_speedup": speedup("time_rollout"),
        "train_speedup": speedup("time_train"),
        "step_speedup": speedup("time_step"),
        "hbm_bound_fraction": fp8.get("hbm_bound_fraction") if fp8 else None,
        "device": next((r["device"] for r in ok.values()), None),
        "commit": commit,
        "command": "python -m fp8rl_jax.bench e2e " + " ".join(sys.argv[2:]),
        "modes": rows,
    }
