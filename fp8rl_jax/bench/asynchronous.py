"""``bench async``: the synchronous GRPO step on all devices against the asynchronous one on the same devices split
into a rollout group and a training group (``mesh.rollout_devices``, ``rollout.max_staleness``).

    python -m fp8rl_jax.bench async --config configs/llama1b.py --set model.source=preset \\
        --lengths lognormal:0.3,1.0 --splits 0,1 --out async_gpu.json

Each variant runs in a process of its own: ``--splits`` lists the rollout group's sizes, 0 being the synchronous
step over every device (``rollout.max_staleness=0``) and k > 0 the stream on the first k devices with the trainer on
the rest (``rollout.max_staleness`` = ``--staleness``), once for each ``--load-delays`` value
(``rollout.load_delay_chunks``). Completion lengths (``--lengths``, as ``bench e2e``'s):
random weights never sample a stop token, so each sample stops at a length drawn for it (the same draws in every
variant: seeded by the run's seed, the step and the sample), through ``driver.generate(limits=)`` and
``Stream(limits=)``: a slot whose sample stops is refilled as a real stop would refill it, and the synchronous
rollout waits for its longest sample as a real one does.

Measured over the steps after ``--warmup``: completion tokens trained per second of the steps' wall time, per
device (``tokens_per_s_per_gpu``), the tokens' mean staleness, and the weight update's seconds (the trainer's
quantize-and-send of each version). The stream may enter that window up to S batches ahead of the trainer, which a
short window counts as throughput: each step's time and the trainer's wait are kept (``step_seconds_each``,
``train_idle_s_each``) to show whether the window reached the steady state.

Written: ``{"gpus", "tokens_per_s_per_gpu": {"sync", "async"}, "speedup",
"staleness_mean", "weight_update_s", "rows", ...}`` with the best split as ``async``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fp8rl_jax.bench import emit, tree_commit
from fp8rl_jax.bench.e2e import LENGTHS_HELP, _value, parse_lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/llama1b.py")
    parser.add_argument("--set", action="append", default=[], help="config overrides KEY=VALUE (repeatable)")
    parser.add_argument("--lengths", default="lognormal:0.3,1.0", type=parse_lengths, help=LENGTHS_HELP)
    parser.add_argument("--splits", default="0,1", help="rollout devices of each variant; 0 = synchronous")
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--load-delays", default="0",
                        help="rollout.load_delay_chunks of the asynchronous variants, a comma list: each split runs "
                             "once per value; 'auto' = the trainer's working seconds a step over a decode chunk's, "
                             "both from the split's variant before it")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps: a short window flatters the stream")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per variant")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)


def run(args) -> list[dict]:
    if args.one is not None:
        return [measure(args, args.one)]
    rows = []
    delays = [d if d == "auto" else int(d) for d in args.load_delays.split(",")]
    if delays[0] == "auto":
        raise SystemExit("--load-delays: 'auto' reads the variant before it: give a number first (e.g. 0,auto)")
    variants = [(split, delay) for split in (int(s) for s in args.splits.split(","))
                for delay in (delays if split else [0])]
    for split, delay in variants:
        if delay == "auto":
            delay = auto_delay(rows[-1])
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            cmd = [sys.executable, "-m", "fp8rl_jax.bench", "async", "--one", str(split), "--config", args.config,
                   f"--lengths={args.lengths.spec}", "--staleness", str(args.staleness), "--warmup",
                   str(args.warmup), "--steps", str(args.steps), "--load-delays", str(delay), "--out", str(out),
                   *[f"--set={s}" for s in args.set]]
            try:
                code = subprocess.run(cmd, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            row = json.loads(out.read_text())["rows"][0] if code == 0 and out.exists() else {
                "rollout_devices": split, "load_delay_chunks": delay, "error": f"child exited {code}"}
        emit(rows, row)
    return rows


def auto_delay(row: dict) -> int:
    """``rollout.load_delay_chunks`` from an asynchronous variant's row: the decode chunks the rollout makes while the
    trainer works a step (its step time less its wait for the batch), so that a version is loaded about when it is
    published. 0 where the row has no chunk time (a failed variant)."""
    if row.get("error") or not row.get("chunk_s"):
        return 0
    return max(0, round((row["step_seconds"] - row["train_idle_s"]) / row["chunk_s"]))


def measure(args, split: int) -> dict:
    import jax

    from fp8rl_jax.trainer import Trainer

    path, _, arg = args.config.partition(":")
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)}
    staleness = args.staleness if split else 0
    with tempfile.TemporaryDirectory() as workdir:
        overrides.update({"workdir": workdir, "steps": args.warmup + args.steps, "checkpoint.every": 0,
                          "checkpoint.save_final": False, "logging.progress": False, "logging.tensorboard": False,
                          "logging.plots": False, "data.num_eval": 0, "mesh.rollout_devices": split,
                          "rollout.max_staleness": staleness,
                          "rollout.load_delay_chunks": int(args.load_delays) if staleness else 0,
                          # in-flight updates bring new KV scales mid-sequence (config.py): a BF16 cache in both
                          "precision.kv_cache_dtype": "bfloat16"})
        trainer = Trainer.from_file(path, arg or None, **overrides)
        c = trainer.config
        max_new, seed, n = c.rollout.max_new_tokens, c.seed, c.rollout.samples_per_prompt
        draw = lambda step, j: args.lengths.draw(n, max_new, np.random.default_rng([seed, step, j]))  # noqa: E731
        if staleness:
            trainer.length_limits = draw
        else:  # the synchronous step's rollout: prompt j of the step is row j * n .. j * n + n - 1
            rollout = trainer.sampler.rollout

            def limited(engine, state, prompts, group, key, params=None):
                step = trainer.step_count
                limits = np.concatenate([draw(step, j) for j in range(len(prompts))])
                return rollout(engine, state, prompts, group, key, params=params, limits=limits)

            trainer.sampler.rollout = limited
        ends = []  # when each step's record is logged: the steps' wall time, stream included

        def log(record, _log=trainer.reporter.log, **kwargs):
            ends.append(time.perf_counter())
            return _log(record, **kwargs)

        trainer.reporter.log = log
        records = trainer.run()  # synchronous steps, or one stream over all of them
        devices = jax.device_count()
        trainer.close()
    timed = records[args.warmup:]
    tokens = sum(r["response_length_mean"] * c.rollout.prompts_per_step * n for r in timed)
    seconds = ends[-1] - ends[args.warmup - 1]
    mean = lambda key: float(np.mean([r[key] for r in timed])) if key in timed[0] else None  # noqa: E731
    chunks = mean("async/rollout_chunks")
    return {"rollout_devices": split, "max_staleness": staleness,
            "load_delay_chunks": c.rollout.load_delay_chunks, "devices": devices, "lengths": args.lengths.spec,
            "config": args.config, "overrides": args.set, "warmup": args.warmup, "steps": args.steps,
            "sequences": c.rollout.prompts_per_step * n, "max_new_tokens": max_new,
            "response_length_mean": mean("response_length_mean"), "seconds": seconds,
            "step_seconds": seconds / len(timed), "tokens_per_s_per_gpu": tokens / seconds / devices,
            # each timed step's wall time and the trainer's wait for its batch: a window that starts with the
            # stream ahead shows as waits that grow towards its end
            "step_seconds_each": np.diff(ends[args.warmup - 1:]).round(3).tolist(),
            "train_idle_s_each": [round(r.get("time/rollout", 0.0), 3) for r in timed],
            "staleness_mean": mean("async/staleness_mean") or 0.0, "weight_update_s": mean("time/weights"),
            "train_idle_s": mean("time/rollout"), "rollout_idle_s": mean("async/rollout_idle_s"),
            "weight_transfer_s": mean("async/weight_transfer_s"),
            # decode chunks a batch and a chunk's seconds (the rollout's time not waiting for a version over its
            # chunks, prefill and bookkeeping included): the unit of rollout.load_delay_chunks (``auto_delay``)
            "decode_chunks": chunks,
            "chunk_s": mean("async/rollout_busy_s") / chunks if chunks else None,
            "weight_update_bytes": mean("async/weight_update_bytes"),
            "weight_update_bf16_bytes": mean("async/weight_update_bf16_bytes"),
            "backend": timed[-1]["precision_backend"], "precision": c.precision.mode,
            **{f"time_{k}": mean(f"time/{k}") for k in ("rollout", "score", "train", "calibrate", "weights")}}


def output(rows: list[dict], args) -> dict:
    good = [r for r in rows if "error" not in r]
    sync = next((r for r in good if r["rollout_devices"] == 0), None)
    split = max((r for r in good if r["rollout_devices"]), key=lambda r: r["tokens_per_s_per_gpu"], default=None)
    out = {"gpus": (sync or split or {}).get("devices"), "command": " ".join(["python -m fp8rl_jax.bench",
                                                                          *sys.argv[1:]]),
           "commit": tree_commit(), "rows": rows}
    if sync and split:
        out.update({"tokens_per_s_per_gpu": {"sync": sync["tokens_per_s_per_gpu"],
                                             "async": split["tokens_per_s_per_gpu"]},
                    "speedup": split["tokens_per_s_per_gpu"] / sync["tokens_per_s_per_gpu"],
                    "best_split": split["rollout_devices"], "load_delay_chunks": split["load_delay_chunks"],
                    "staleness_mean": split["staleness_mean"],
                    "weight_update_s": split["weight_update_s"]})
    return out
