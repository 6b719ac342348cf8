"""The fidelity study: the same GRPO run in each precision mode, with and without TIS, side by side.

    python benchmarks/accuracy_study.py --seeds 0,1,2,3,4     # configs/smollm2_arith.py, every mode, one GPU
    python benchmarks/accuracy_study.py --seeds 0,1,2,3,4 --collect   # tables and plots again from the runs

Each (seed, mode) is ``python -m fp8rl_jax.main`` in its own process; within a seed every mode has the same
config, seed and data order, and only ``precision.mode`` and ``rl.is_correction`` differ (``MODES``). The seed
also draws the synthetic task's problems, test split included: each seed is a replicate of the whole
experiment. ``--parallel`` runs that many at once: the 135M model leaves an H100 mostly idle, so five runs
share it (each told to take its share of GPU memory). The config's periodic evaluation gives the accuracy
before training (step 0) and after it (the last step). Runs go to ``--workdir``/seed<S>/<mode>/.

Written: ``--out`` (``benchmarks/results/accuracy.json``)::

    {"model", "task", "steps", "seeds", "config", "device", "commit", "command", "seconds",
     "modes": {mode: {"acc_before", "acc_after", "acc_after_std", "mismatch_kl", "token_mult_prob_error",
                      ..., "per_seed": {seed: {...}}}}}

Per seed, ``mismatch_kl`` and ``token_mult_prob_error`` are means over the run's steps of the trainer's own
records (``mismatch_kl_k3``: the sampler's logprobs against the trainer's, per completion token); also the
reward at the start and the end (mean of the first and the last 5 steps), the IS-weight statistics and the step
time. A mode's top-level values are the means over its seeds that ran every step (``seeds_run`` of them; a run
cut short, by a time limit, is listed in ``incomplete`` and counts for nothing). And ``--docs``
(``docs/``): ``accuracy.md`` (the table, how it was made) and the plots ``accuracy_*.png`` (means over seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# mode -> config overrides; the rest of the config is the same for all
MODES = {
    "bf16": {"precision.mode": "bf16", "rl.is_correction": "none"},
    "fp8_rollout": {"precision.mode": "fp8_rollout", "rl.is_correction": "none"},
    "fp8_rollout_tis": {"precision.mode": "fp8_rollout", "rl.is_correction": "tis"},
    "fp8_e2e": {"precision.mode": "fp8_e2e", "rl.is_correction": "none"},
    "fp8_e2e_tis": {"precision.mode": "fp8_e2e", "rl.is_correction": "tis"},
    # per-tensor delayed scaling on the xla backend (fp8_e2e is Transformer Engine's where it is installed): the
    # per-tensor form in the block study's setting, without TE
    "fp8_e2e_xla": {"precision.mode": "fp8_e2e", "precision.backend": "xla", "rl.is_correction": "none"},
    # asynchronous GRPO: every batch sampled up to one update ahead (rollout.max_staleness), TIS against the
    # sampling version's logprobs; fp8_e2e_tis is its synchronous pair
    "fp8_e2e_tis_stale1": {"precision.mode": "fp8_e2e", "rl.is_correction": "tis", "rollout.max_staleness": 1},
    # two updates ahead, every load drained (rollout.inflight_updates off): every token exactly 2 updates old, the
    # most staleness 2 can cost (an in-flight load, delayed or not, samples some tokens fresher)
    "fp8_e2e_tis_stale2_drained": {"precision.mode": "fp8_e2e", "rl.is_correction": "tis", "rollout.max_staleness": 2,
                                   "rollout.inflight_updates": False},
    # four updates ahead: the bound at which the split rollout overlapped long-tailed completions (RESULTS.md)
    "fp8_e2e_tis_stale4": {"precision.mode": "fp8_e2e", "rl.is_correction": "tis", "rollout.max_staleness": 4},
    # the FP8 KV cache on top (the fastest rollout), with TIS
    "fp8_e2e_kv_tis": {"precision.mode": "fp8_e2e", "precision.kv_cache_dtype": "float8_e4m3fn",
                       "rl.is_correction": "tis"},
    # finer scaling: per token x per output channel in the forward (xla backend only)
    "fp8_e2e_rowwise_tis": {"precision.mode": "fp8_e2e", "precision.backend": "xla", "precision.scaling": "rowwise",
                            "rl.is_correction": "tis"},
    # the same without TIS, as fp8_e2e_block and fp8_e2e_xla run: whether a finer forward scaling other than block's
    # 1 x 128 tiles lifts the weights as block's forward does (docs/accuracy.md, "Block-scaled FP8")
    "fp8_e2e_rowwise": {"precision.mode": "fp8_e2e", "precision.backend": "xla", "precision.scaling": "rowwise",
                        "rl.is_correction": "none"},
    # block scaling (DeepSeek-V3's recipe: 1x128 activation tiles, 128x128 weight blocks, E4M3 both ways, the weight
    # gradient's operands in 128 x 1 tiles; xla backend), alone and with the head's backward in BF16: the fidelity
    # probe's two best FP8 end-to-end forms (their studies ran before precision.block_wgrad's default was grad_blocks)
    "fp8_e2e_block": {"precision.mode": "fp8_e2e", "precision.backend": "xla", "precision.scaling": "block",
                      "precision.fp8_format": "e4m3", "precision.block_wgrad": "tiles", "rl.is_correction": "none"},
    "fp8_e2e_block_bf16_head_grad": {"precision.mode": "fp8_e2e", "precision.backend": "xla",
                                     "precision.scaling": "block", "precision.fp8_format": "e4m3",
                                     "precision.block_wgrad": "tiles", "precision.lm_head_grad_fp8": False,
                                     "rl.is_correction": "none"},
    # block scaling as shipped: the weight gradient's output gradient in 128 x 128 blocks (precision.block_wgrad's
    # default), a faster wgrad GEMM on Hopper; whether it learns as DeepSeek-V3's 128 x 1 tiles do
    "fp8_e2e_block_grad_blocks": {"precision.mode": "fp8_e2e", "precision.backend": "xla", "precision.scaling": "block",
                                  "precision.fp8_format": "e4m3", "precision.block_wgrad": "grad_blocks",
                                  "rl.is_correction": "none"},
    # block scaling in the forward alone (BF16 input and weight gradients), and in the backward alone (the forward,
    # the rollout's too, BF16): which of block's GEMMs makes its weights end above BF16's (precision.fp8_gemms)
    "fp8_e2e_block_fprop": {"precision.mode": "fp8_e2e", "precision.backend": "xla", "precision.scaling": "block",
                            "precision.fp8_format": "e4m3", "precision.fp8_gemms": ("fprop",),
                            "rl.is_correction": "none"},
    "fp8_e2e_block_backward": {"precision.mode": "fp8_e2e", "precision.backend": "xla", "precision.scaling": "block",
                               "precision.fp8_format": "e4m3", "precision.fp8_gemms": ("dgrad", "wgrad"),
                               "precision.block_wgrad": "tiles", "rl.is_correction": "none"},
    # the two halves of block's forward apart (precision.block_forward), each alone as fp8_e2e_block_fprop: the
    # weight one scale an output channel with the input's 1 x 128 tiles, or the input one scale a token with the
    # weight's 128 x 128 blocks; which of them lifts the weights where rowwise's forward (both halves per row) does not
    **{f"fp8_e2e_block_fprop_{half}": {"precision.mode": "fp8_e2e", "precision.backend": "xla",
                                       "precision.scaling": "block", "precision.fp8_format": "e4m3",
                                       "precision.fp8_gemms": ("fprop",), "precision.block_forward": half,
                                       "rl.is_correction": "none"}
       for half in ("tiles_channels", "tokens_blocks")},
    # the forward alone in FP8 as the other scalings make it (BF16 input and weight gradients, as
    # fp8_e2e_block_fprop): whether training through any FP8 forward lifts the weights, or block's alone
    "fp8_e2e_rowwise_fprop": {"precision.mode": "fp8_e2e", "precision.backend": "xla", "precision.scaling": "rowwise",
                              "precision.fp8_gemms": ("fprop",), "rl.is_correction": "none"},
    "fp8_e2e_xla_fprop": {"precision.mode": "fp8_e2e", "precision.backend": "xla", "precision.fp8_gemms": ("fprop",),
                          "rl.is_correction": "none"},
    # the BF16 head's backward GEMMs in BF16 too (precision.lm_head_grad_fp8 off: the earlier default,
    # whose study called the default fp8_e2e_headgrad)
    "fp8_e2e_bf16_head_grad": {"precision.mode": "fp8_e2e", "precision.lm_head_grad_fp8": False,
                               "rl.is_correction": "none"},
    # the head's backward logit recompute in BF16 (precision.lm_head_recompute_fp8 off: the earlier default;
    # the FP8 recompute gives the FP8 head's gradient under the BF16 head's forward and logprobs)
    "fp8_e2e_bf16_recompute": {"precision.mode": "fp8_e2e", "precision.lm_head_recompute_fp8": False,
                               "rl.is_correction": "none"},
    # the exact sampler (rollout.exact): rollouts drawn by the trainer's own forward, sampler == trainer bit for bit
    "fp8_e2e_exact": {"precision.mode": "fp8_e2e", "rollout.exact": True, "rl.is_correction": "none"},
    "bf16_exact": {"precision.mode": "bf16", "rollout.exact": True, "rl.is_correction": "none"},
}
DEFAULT_MODES = ("bf16", "fp8_rollout", "fp8_rollout_tis", "fp8_e2e", "fp8_e2e_tis")
PLOTS = {  # file -> (metric, title)
    "accuracy_reward.png": ("reward_mean", "mean reward of the rollouts"),
    "accuracy_eval.png": ("eval_accuracy", "greedy accuracy (test problems)"),
    "accuracy_mismatch.png": ("mismatch_kl_k3", "mismatch KL (k3), sampler vs trainer"),
    "accuracy_is_weight.png": ("is_weight_max", "largest per-token IS weight r_t (before the cap)"),
}
# accuracy.md below this line is written by hand (what the numbers mean); rebuilding the table keeps it
FINDINGS = "<!-- findings: kept when the table is rebuilt -->"
EVAL_BF16 = "eval_bf16"  # a run's folder of its final checkpoint evaluated with the BF16 sampler (--eval_bf16)
TAIL = 5  # steps averaged for the reward at the start and at the end


def _commit() -> str:
    """``bench.tree_commit()``: FP8RL_COMMIT where the caller names the tree, else git's (no JAX imported here)."""
    sys.path.insert(0, str(REPO))
    from fp8rl_jax.bench import tree_commit

    return tree_commit() or "unknown"


def _device() -> str:
    """The GPUs the runs see (``CUDA_VISIBLE_DEVICES`` where set), e.g. ``1 x NVIDIA H200``; ``cpu`` without any."""
    only = ["-i", os.environ["CUDA_VISIBLE_DEVICES"]] if os.environ.get("CUDA_VISIBLE_DEVICES") else []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", *only], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return f"{len(out)} x {out[0]}" if out else "cpu"
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"


def _config(args):
    """The study's config file (``path[:arg]``, relative to the repository, as the runs read it), without the
    ``--set`` overrides."""
    from fp8rl_jax.config import load_config_file

    path, _, arg = args.config.partition(":")
    return load_config_file(str(REPO / path), arg or None)


def _pool(jobs: list[tuple[tuple, list[str], Path]], args, env: dict, deadline: float) -> dict[tuple, int]:
    """Run ``(key, command, log)`` jobs, ``args.parallel`` at a time, until done or ``deadline``; exit statuses."""
    pending, running, status = list(jobs), {}, {}
    while pending or running:
        while pending and len(running) < args.parallel:
            key, cmd, log_path = pending.pop(0)
            log = open(log_path, "w")
            print(f"[{' '.join(map(str, key))}] {shlex.join(cmd)}", flush=True)
            running[key] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log)
        time.sleep(2)
        for key, (proc, log) in list(running.items()):
            if proc.poll() is None and time.monotonic() > deadline:
                proc.kill()
                print(f"[{' '.join(map(str, key))}] killed at --timeout={args.timeout}s", flush=True)
            if proc.poll() is not None:
                log.close()
                status[key] = proc.returncode
                print(f"[{' '.join(map(str, key))}] exit {proc.returncode}", flush=True)
                del running[key]
    return status


def run_modes(args, modes: list[str]) -> dict[tuple[int, str], int]:
    """Train every (seed, mode) (``args.parallel`` at a time) and, with ``--eval_bf16``, evaluate each FP8 run's
    final checkpoint with the BF16 sampler; return each run's exit status (a failed evaluation counts)."""
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(REPO))
    if args.parallel > 1:  # several JAX processes on one GPU: each takes its share, not 75%
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / args.parallel:.2f}")
    deadline = time.monotonic() + args.timeout
    jobs = []
    for seed in args.seeds:
        for mode in modes:
            workdir = Path(args.workdir) / f"seed{seed}" / mode
            cmd = [sys.executable, "-m", "fp8rl_jax.main", f"--config={args.config}", f"--config.seed={seed}",
                   f"--config.workdir={workdir}", "--config.logging.progress=False",
                   "--config.logging.plots=False", "--config.checkpoint.every=0",
                   f"--config.checkpoint.save_final={args.eval_bf16}"]
            cmd += [f"--config.steps={args.steps}"] if args.steps else []
            cmd += [f"--config.{k}={v}" for k, v in MODES[mode].items()]
            cmd += [f"--config.{kv}" for kv in args.set]
            shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not a resume of an old one
            workdir.mkdir(parents=True)
            jobs.append(((seed, mode), cmd, workdir.parent / f"{mode}.log"))
    status = _pool(jobs, args, env, deadline)
    if args.eval_bf16:
        num = _config(args).data.num_eval
        num = next((int(kv.split("=", 1)[1]) for kv in args.set if kv.startswith("data.num_eval=")), num)
        evals = []
        for (seed, mode), code in status.items():
            if code != 0 or MODES[mode]["precision.mode"] == "bf16":
                continue
            workdir = Path(args.workdir) / f"seed{seed}" / mode
            # the same test problems as the run's own evaluation: the seed draws them, num_eval counts them
            cmd = [sys.executable, "-m", "fp8rl_jax.eval", f"--config={args.config}", f"--config.seed={seed}",
                   f"--checkpoint={workdir}", "--config.precision.mode=bf16", f"--out={workdir / EVAL_BF16}"]
            cmd += [f"--num={num}"] if num else []
            cmd += [f"--config.{kv}" for kv in args.set]
            evals.append(((seed, mode, "eval_bf16"), cmd, workdir.parent / f"{mode}_eval_bf16.log"))
        for (seed, mode, _), code in _pool(evals, args, env, deadline).items():
            status[seed, mode] = status[seed, mode] or code
    return status


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(records: list[dict], eval_bf16: Path | None = None) -> dict:
    """One run's row of accuracy.json from its metrics.jsonl records (and its ``--eval_bf16`` results, if any)."""
    steps = [r for r in records if r.get("step", 0) > 0 and "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    col = lambda key, rows=steps: [r[key] for r in rows if key in r]  # noqa: E731
    row = {
        "acc_before": evals[0]["eval_accuracy"] if evals and evals[0]["step"] == 0 else None,
        "acc_after": evals[-1]["eval_accuracy"] if evals and evals[-1]["step"] > 0 else None,
        "acc_after_step": evals[-1]["step"] if evals else None,
        "eval_problems": evals[-1].get("eval_problems") if evals else None,
        "mismatch_kl": _mean(col("mismatch_kl_k3")),
        "token_mult_prob_error": _mean(col("token_mult_prob_error")),
        "reward_start": _mean(col("reward_mean")[:TAIL]),
        "reward_end": _mean(col("reward_mean")[-TAIL:]),
        "is_weight_mean": _mean(col("is_weight_mean")),
        "is_weight_max": max(col("is_weight_max"), default=None),
        "is_clipped_fraction": _mean(col("is_clipped_fraction")),
        "step_seconds": _mean(col("time/step")[1:]),  # the first step compiles
        "steps": len(steps),
        "skipped_updates": sum(col("skipped_updates")),
    }
    if eval_bf16 is not None and (eval_bf16 / "results.json").exists():
        # the run's final weights through the BF16 sampler: what training learned, apart from FP8 at test time
        row["acc_after_bf16"] = json.loads((eval_bf16 / "results.json").read_text())["pass@1"]
    return row


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def mean_curve(runs: list[list[dict]], key: str) -> tuple[list[int], list[float]]:
    """(steps, mean over the runs) of ``key`` at the steps where every run has it."""
    per_run = [{r["step"]: r[key] for r in records if key in r} for records in runs]
    steps = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    return steps, [sum(d[t] for d in per_run) / len(per_run) for t in steps]


def plot(curves: dict[str, dict[int, list[dict]]], docs: Path) -> list[str]:
    """The plots, each curve the mean over a mode's seeds; ``curves``: mode -> seed -> records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, (key, title) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        for mode, by_seed in curves.items():
            steps, values = mean_curve(list(by_seed.values()), key)
            if steps:
                ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=f"{mode} ({len(by_seed)})")
        ax.set_title(f"{title}, mean over seeds", fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(docs / name, dpi=100)
        plt.close(fig)
        written.append(name)
    # mismatch against response length: one point per step and seed (its mean KL and mean completion length)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for mode, by_seed in curves.items():
        have = [r for records in by_seed.values() for r in records
                if "mismatch_kl_k3" in r and "response_length_mean" in r]
        ax.scatter([r["response_length_mean"] for r in have], [r["mismatch_kl_k3"] for r in have], s=6, label=mode)
    ax.set_title("mismatch KL (k3) of each step against its mean response length", fontsize=10)
    ax.set_xlabel("mean response length (tokens)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(docs / "accuracy_mismatch_vs_length.png", dpi=100)
    plt.close(fig)
    return [*written, "accuracy_mismatch_vs_length.png"]


def _fmt(v, pct=False) -> str:
    if v is None:
        return "–"
    return f"{100 * v:.1f}%" if pct else (f"{v:.3g}" if isinstance(v, float) else str(v))


def markdown(result: dict, plots: list[str]) -> str:
    seeds = result["seeds"]
    lines = [
        "# Fidelity study: GRPO in BF16 and FP8, with and without TIS",
        "",
        f"{result['model']}, task `{result['task']}`, {result['steps']} RL steps per run, seeds "
        f"{', '.join(map(str, seeds))} (within a seed every mode has the same data order); device "
        f"{result['device']}, commit `{result['commit'][:7]}`.",
        "",
        f"Command: `{result['command']}`",
        "",
        "Means over seeds (their number in brackets; ± the standard deviation of the final accuracy over seeds):",
        "",
        "| mode | acc before | acc after | reward start → end | mismatch KL (k3) | token_mult_prob_error | "
        "IS weight max | s/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    bf16_sampler = any("acc_after_bf16" in r for r in result["modes"].values())
    if bf16_sampler:
        lines[-2] = lines[-2].replace("| reward start", "| acc after, BF16 sampler | reward start")
        lines[-1] += "---|"
    for mode, r in result["modes"].items():
        spread = f" ± {100 * r['acc_after_std']:.1f}" if r.get("acc_after_std") is not None else ""
        if bf16_sampler:  # a BF16 run's own evaluation is already the BF16 sampler's
            own = r["acc_after"] if MODES[mode]["precision.mode"] == "bf16" else r.get("acc_after_bf16")
            spread += f" | {_fmt(own, True)}"
        lines.append(f"| {mode} ({r['seeds_run']}) | {_fmt(r['acc_before'], True)} | "
                     f"{_fmt(r['acc_after'], True)}{spread} | {_fmt(r['reward_start'])} → {_fmt(r['reward_end'])} | "
                     f"{_fmt(r['mismatch_kl'])} | {_fmt(r['token_mult_prob_error'])} | {_fmt(r['is_weight_max'])} | "
                     f"{_fmt(r['step_seconds'])} |")
    lines += ["", "Final accuracy per seed:", "", "| mode | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "|---|" + "---|" * len(seeds)]
    for mode, r in result["modes"].items():
        cells = [("–" if str(s) not in r["per_seed"] else _fmt(r["per_seed"][str(s)]["acc_after"], True)
                  if r["per_seed"][str(s)].get("complete", True)
                  else f"stopped at step {r['per_seed'][str(s)]['acc_after_step']}") for s in seeds]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += ["", "Accuracy: greedy pass@1 on the first test problems (`data.num_eval`) with the mode's own sampler, "
              "before the first step and after the last (with `--eval_bf16`, also the FP8 runs' final weights through "
              "the BF16 sampler). Mismatch KL and token_mult_prob_error: means over the steps "
              "of the trainer's records (sampler logprobs against the trainer's forward, per completion token).", ""]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


MEAN_KEYS = ("acc_before", "acc_after", "mismatch_kl", "token_mult_prob_error", "reward_start", "reward_end",
             "is_weight_mean", "is_clipped_fraction", "step_seconds")


def aggregate(per_seed: dict[int, dict], steps: int) -> dict:
    """A mode's row: means over its seeds that ran all ``steps`` (``MEAN_KEYS``), the spread of the final accuracy,
    the largest IS weight, and every seed's own row. A run stopped earlier (a time limit) is no seed's result: it
    is left out of the means and listed in ``incomplete`` (seed -> the step of its last evaluation)."""
    for row in per_seed.values():
        row["complete"] = row["acc_after_step"] == steps and row["steps"] == steps
    rows = [r for r in per_seed.values() if r["complete"]]
    out = {}
    for key in MEAN_KEYS:
        values = [r[key] for r in rows if r[key] is not None]
        out[key] = _mean(values) if len(values) == len(rows) else None  # a seed without it: no mean
    finals = [r["acc_after"] for r in rows if r["acc_after"] is not None]
    out["acc_after_std"] = ((sum((a - out["acc_after"]) ** 2 for a in finals) / (len(finals) - 1)) ** 0.5
                            if len(finals) > 1 and out["acc_after"] is not None else None)
    bf16_evals = [r.get("acc_after_bf16") for r in rows]
    if all(v is not None for v in bf16_evals):
        out["acc_after_bf16"] = _mean(bf16_evals)
    out["is_weight_max"] = max((r["is_weight_max"] for r in rows if r["is_weight_max"] is not None), default=None)
    out["seeds_run"] = len(rows)
    out["incomplete"] = {str(seed): row["acc_after_step"] for seed, row in per_seed.items() if not row["complete"]}
    out["per_seed"] = {str(seed): row for seed, row in per_seed.items()}
    return out


def collect(args, modes: list[str], seconds: float, command: str) -> dict:
    config = _config(args)
    curves = {}  # mode -> seed -> records
    for mode in modes:
        by_seed = {seed: _read(Path(args.workdir) / f"seed{seed}" / mode / "metrics.jsonl") for seed in args.seeds}
        if any(by_seed.values()):
            curves[mode] = {seed: records for seed, records in by_seed.items() if records}
    if not curves:
        raise SystemExit(f"no metrics.jsonl under {args.workdir}/seed<S>/<mode> for seeds {args.seeds} and modes "
                         f"{', '.join(modes)}")
    # rebuilding (--collect) keeps what the runs' own invocation recorded: where, at which commit, how
    previous = json.loads(Path(args.out).read_text()) if args.collect and Path(args.out).exists() else {}
    made = {"device": _device(), "commit": _commit(), "command": command, "seconds": seconds}
    made = {k: previous.get(k, v) for k, v in made.items()}
    per_seed = {m: {seed: summarize(records, Path(args.workdir) / f"seed{seed}" / m / EVAL_BF16)
                    for seed, records in by_seed.items()} for m, by_seed in curves.items()}
    steps = args.steps or config.steps
    modes_out = {m: {**aggregate(rows, steps), "overrides": MODES[m]} for m, rows in per_seed.items()}
    for m, row in modes_out.items():
        if row["incomplete"]:
            print(f"{m}: {len(row['incomplete'])} run(s) stopped before step {steps} (seed: last evaluated step "
                  f"{row['incomplete']}), left out of the means", flush=True)
    result = {
        "model": {"smollm2": "SmolLM2-135M-Instruct", "preset": config.model.preset}.get(config.model.source,
                                                                                          config.model.source),
        "task": f"{config.data.dataset}" + (f" (digits={config.data.digits})"
                                            if config.data.dataset.startswith("arithmetic") else ""),
        "steps": steps,
        "seeds": sorted({seed for by_seed in curves.values() for seed in by_seed}),
        "config": args.config, "overrides": list(args.set),
        **made,
        "modes": modes_out,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    try:
        plots = plot(curves, docs)
    except ImportError as e:  # a GPU image without matplotlib: the table now, the plots later with --collect
        print(f"no plots ({e}); rebuild them with --collect where matplotlib is installed", flush=True)
        plots = []
    page = docs / "accuracy.md"
    kept = page.read_text().split(FINDINGS, 1)[1] if page.exists() and FINDINGS in page.read_text() else ""
    page.write_text(markdown(result, plots) + (f"\n{FINDINGS}{kept}" if kept else ""))  # the findings stay
    print(markdown(result, []), flush=True)
    print(f"wrote {out}, {docs / 'accuracy.md'} and {len(plots)} plots", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2_arith.py")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"from: {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=0, help="RL steps (0: the config's)")
    p.add_argument("--seeds", default="0", help="comma-separated: each seed runs every mode")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another config override for every mode, e.g. --set optim.lr=1e-5")
    p.add_argument("--parallel", type=int, default=5, help="runs at once")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for all the runs")
    p.add_argument("--workdir", default="runs/accuracy_study")
    p.add_argument("--out", default="benchmarks/results/accuracy.json")
    p.add_argument("--docs", default="docs")
    p.add_argument("--eval_bf16", action="store_true",
                   help="save each run's final checkpoint and evaluate the FP8 runs' with the BF16 sampler too")
    p.add_argument("--collect", action="store_true", help="only rebuild the outputs from the runs in --workdir")
    args = p.parse_args(argv)
    args.seeds = [int(x) for x in args.seeds.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: {', '.join(unknown)} unknown; allowed: {', '.join(MODES)}")
    command = shlex.join(["python", "benchmarks/accuracy_study.py", *(sys.argv[1:] if argv is None else argv)])
    t = time.time()
    failed = {}
    if not args.collect:
        failed = [run for run, status in run_modes(args, modes).items() if status != 0]
        for seed, mode in failed:
            log = Path(args.workdir) / f"seed{seed}" / f"{mode}.log"
            print(f"[seed {seed} {mode}] failed; the end of {log}:\n" + "".join(log.read_text().splitlines(True)[-15:]),
                  flush=True)
    collect(args, modes, time.time() - t, command)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
