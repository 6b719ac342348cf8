"""Issue 43's learning check: ``accuracy_study.py`` outputs of ``fp8_e2e_tis`` (synchronous) and
``fp8_e2e_tis_stale1`` (``rollout.max_staleness=1``), merged into one file with the paired difference by seed.

    python benchmarks/async_summary.py --studies s0_4.json s5_9.json --runs runs_dir --out results/accuracy_async.json

``--runs``: the studies' run folders (``seed<S>/<mode>/metrics.jsonl``), for the asynchronous runs' staleness.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_merge import paired_diff  # noqa: E402

SYNC, ASYNC = "fp8_e2e_tis", "fp8_e2e_tis_stale1"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--studies", nargs="+", required=True)
    ap.add_argument("--runs", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    per_seed, commands, device = {}, [], None
    for path in args.studies:
        study = json.loads(Path(path).read_text())
        commands.append(study["command"])
        device = study["device"]
        for mode, key in ((SYNC, "sync"), (ASYNC, "async")):
            for seed, values in study["modes"][mode]["per_seed"].items():
                per_seed.setdefault(int(seed), {})[key] = values
    seeds = sorted(s for s, v in per_seed.items() if {"sync", "async"} <= v.keys())
    for s in seeds:
        records = [json.loads(line) for line in (Path(args.runs) / f"seed{s}" / ASYNC / "metrics.jsonl").open()]
        stale = [r for r in records if "async/staleness_mean" in r]
        per_seed[s]["async"]["staleness_mean"] = float(np.mean([r["async/staleness_mean"] for r in stale]))
        per_seed[s]["async"]["staleness_max"] = float(max(r["async/staleness_max"] for r in stale))
    acc = {k: np.array([per_seed[s][k]["acc_after"] for s in seeds]) for k in ("sync", "async")}
    diff = paired_diff(acc["async"], acc["sync"])
    out = {
        "seeds": seeds, "task": "configs/smollm2_arith.py (SmolLM2-135M-Instruct, one-digit sums, 40 steps)",
        "modes": {"sync": f"{SYNC}: precision.mode=fp8_e2e, rl.is_correction=tis",
                  "async": f"{ASYNC}: the same with rollout.max_staleness=1"},
        "acc_after": {k: float(v.mean()) for k, v in acc.items()},
        "acc_after_std": {k: float(v.std(ddof=1)) for k, v in acc.items()},
        "acc_before": {k: float(np.mean([per_seed[s][k]["acc_before"] for s in seeds])) for k in ("sync", "async")},
        "diff_async_minus_sync": {"mean": diff["mean"], "se": diff["se"], "ci95_bootstrap": diff["ci95"]},
        "staleness_mean": float(np.mean([per_seed[s]["async"]["staleness_mean"] for s in seeds])),
        "mismatch_kl": {k: float(np.mean([per_seed[s][k]["mismatch_kl"] for s in seeds])) for k in ("sync", "async")},
        "step_seconds": {k: float(np.mean([per_seed[s][k]["step_seconds"] for s in seeds])) for k in ("sync", "async")},
        "per_seed": {str(s): {k: per_seed[s][k] for k in ("sync", "async")} for s in seeds},
        "device": device, "commit": args.commit, "commands": commands,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("acc_after", "diff_async_minus_sync", "staleness_mean")}))


if __name__ == "__main__":
    main()
