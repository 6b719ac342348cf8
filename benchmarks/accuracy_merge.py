"""Several ``accuracy_study.py`` outputs (seeds run in different calls, on different days) merged into one file, each
mode's seeds side by side, with every mode's accuracy difference against BF16 (and against fp8_e2e and
fp8_e2e_block) paired by seed.

    python benchmarks/accuracy_merge.py --into benchmarks/results/accuracy.json study_a.json study_b.json ...

Each input is an ``accuracy_study.py --out`` file (``modes`` -> ``per_seed`` rows) or an earlier output of this
script. A mode's seed that two inputs both ran is an error (which one is the result?), unless the rows are equal.
Each mode keeps where its seeds ran (``runs``: seeds, device, commit, command of each input); the means are
``accuracy_study.aggregate``'s over the seeds that ran every step. ``diff_vs_<ref>``: the mean of the per-seed
differences over the seeds both completed, its standard error and a bootstrap 95% interval (10,000 resamples of
the seed pairs, seeded, so a rebuild gives the same numbers); ``diff_vs_bf16_bf16_sampler`` the same for the mode's
final weights evaluated through the BF16 sampler (``accuracy_study.py --eval_bf16``), where every pair has it.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_study import aggregate  # noqa: E402

REFERENCES = ("bf16", "fp8_e2e", "fp8_e2e_block")
RESAMPLES = 10_000


def paired_diff(a: list[float], b: list[float], seed: int = 0) -> dict:
    """``a - b`` paired by position: mean, standard error and a percentile bootstrap 95% interval."""
    diff = np.asarray(a, float) - np.asarray(b, float)
    rng = np.random.default_rng(seed)
    boot = rng.choice(diff, (RESAMPLES, len(diff))).mean(axis=1)
    return {"mean": float(diff.mean()), "se": float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else None,
            "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))], "pairs": len(diff)}


def _runs_of(study: dict, row: dict) -> list[dict]:
    if "runs" in row:  # an earlier merge
        return row["runs"]
    return [{"seeds": sorted(int(s) for s in row["per_seed"]), **{k: study.get(k) for k in ("device", "commit",
                                                                                              "command")}}]


def merge(studies: list[dict]) -> dict:
    studies = copy.deepcopy(studies)  # the rows are marked (``complete``) and kept: none of the caller's
    steps = {s["steps"] for s in studies}
    if len(steps) > 1:
        raise SystemExit(f"the studies ran different step counts ({sorted(steps)}): not one study")
    rows: dict[str, dict[int, dict]] = {}
    runs: dict[str, list[dict]] = {}
    overrides: dict[str, dict] = {}
    for study in studies:
        for mode, row in study["modes"].items():
            for seed, values in row["per_seed"].items():
                have = rows.setdefault(mode, {}).get(int(seed))
                if have is not None and have != values:
                    raise SystemExit(f"mode {mode}, seed {seed}: two different runs; keep one input of them")
                rows[mode][int(seed)] = values
            runs.setdefault(mode, []).extend(r for r in _runs_of(study, row) if r not in runs[mode])
            overrides[mode] = row.get("overrides")
    modes = {}
    for mode, per_seed in rows.items():
        out = aggregate(dict(sorted(per_seed.items())), studies[0]["steps"])
        out["overrides"], out["runs"] = overrides[mode], runs[mode]
        modes[mode] = out
    for mode, out in modes.items():
        for ref in REFERENCES:
            if ref == mode or ref not in modes:
                continue
            mine, theirs = out["per_seed"], modes[ref]["per_seed"]
            seeds = sorted((s for s in mine if s in theirs and mine[s]["complete"] and theirs[s]["complete"]), key=int)
            if seeds:
                out[f"diff_vs_{ref}"] = {**paired_diff([mine[s]["acc_after"] for s in seeds],
                                                       [theirs[s]["acc_after"] for s in seeds]),
                                         "ref_acc_after_same_seeds": float(np.mean([theirs[s]["acc_after"]
                                                                                    for s in seeds]))}
            if seeds and ref == "bf16" and all(mine[s].get("acc_after_bf16") is not None for s in seeds):
                # the mode's final weights through the BF16 sampler (--eval_bf16): what it learned, apart from its
                # own sampler's answers at test time
                out["diff_vs_bf16_bf16_sampler"] = paired_diff([mine[s]["acc_after_bf16"] for s in seeds],
                                                               [theirs[s]["acc_after"] for s in seeds])
    first = studies[0]
    return {
        **{k: first[k] for k in ("model", "task", "steps", "config") if k in first},
        "seeds": sorted({int(s) for out in modes.values() for s in out["per_seed"]}),
        "paired": f"diff_vs_<mode>: per seed, over the seeds both modes completed; bootstrap 95% over the seed pairs "
                  f"({RESAMPLES:,} resamples)",
        "modes": modes,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("studies", nargs="+", help="accuracy_study.py outputs (or this script's)")
    p.add_argument("--into", required=True, help="the merged file to write")
    args = p.parse_args(argv)
    studies = [json.loads(Path(f).read_text()) for f in args.studies]
    result = merge(studies)
    Path(args.into).write_text(json.dumps(result, indent=1) + "\n")
    for mode, out in result["modes"].items():
        d = out.get("diff_vs_bf16")
        print(f"{mode}: {out['seeds_run']} seeds, {out['acc_after']:.1%} after"
              + (f", vs bf16 {d['mean']:+.1%} ({d['ci95'][0]:+.1%} to {d['ci95'][1]:+.1%})" if d else ""))
    print(f"wrote {args.into}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
