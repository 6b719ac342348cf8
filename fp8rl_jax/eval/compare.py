"""Two evaluations of the same problems, problem by problem: do the greedy completions agree, and how far?

The first folder is the *reference* (say the BF16 run), the second the *other* (the FP8 one). Problems are matched
by ``id`` (both runs must hold the same question and gold answer under it); those in one run only are counted, not
compared. Per problem, of the two greedy completions:
- ``same_verdict``: both correct or both wrong;
- ``identical``: the same text;
- ``prefix_chars``: the length in characters of their common prefix, and ``prefix_fraction``: that length over the
  reference completion's (1 when the reference completion is empty: all of it is shared).
The summary (``compare.json``, ``compare.md``) gives the fraction of problems with the same verdict and with
identical text, the mean common prefix in characters and as a fraction, and how many problems each run alone got
right; ``compare.jsonl`` holds the per-problem values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from fp8rl_jax.eval import DESCRIBED_KEYS, ResultsError, format_percent, read_results, write_jsonl, write_text_atomic

COMPARE_JSON, COMPARE_MD, COMPARE_JSONL = "compare.json", "compare.md", "compare.jsonl"
RUN_KEYS = DESCRIBED_KEYS  # what compare.json says of each run (read_results refuses a results.json without them)


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, in characters."""
    return len(os.path.commonprefix([a, b]))


def compare_rows(reference: list[dict], other: list[dict]) -> tuple[list[dict], dict]:
    """``(per problem, summary)`` of two runs' completions.jsonl rows (see the module docstring)."""
    by_id = {row["id"]: row for row in other}
    ref_ids = {row["id"] for row in reference}
    per_problem = []
    for ref in reference:
        oth = by_id.get(ref["id"])
        if oth is None:
            continue
        if (ref.get("question"), ref["gold"]) != (oth.get("question"), oth["gold"]):
            raise ResultsError(f"problem {ref['id']!r} differs between the two runs (question or gold answer): "
                               "they evaluated different datasets")
        a, b = ref["completion"], oth["completion"]
        prefix = common_prefix(a, b)
        per_problem.append({
            "id": ref["id"], "reference_correct": bool(ref["correct"]), "other_correct": bool(oth["correct"]),
            "same_verdict": bool(ref["correct"]) == bool(oth["correct"]), "identical": a == b,
            "prefix_chars": prefix, "prefix_fraction": prefix / len(a) if a else 1.0,
            "reference_chars": len(a), "other_chars": len(b),
        })
    if not per_problem:
        raise ResultsError("the two runs have no problem in common (no id in both)")
    n = len(per_problem)
    count = lambda ref, oth: sum(p["reference_correct"] == ref and p["other_correct"] == oth for p in per_problem)
    summary = {
        "problems": n,
        "only_in_reference": len(ref_ids - by_id.keys()),
        "only_in_other": len(by_id.keys() - ref_ids),
        "same_verdict": sum(p["same_verdict"] for p in per_problem) / n,
        "identical": sum(p["identical"] for p in per_problem) / n,
        "prefix_chars_mean": float(np.mean([p["prefix_chars"] for p in per_problem])),
        "prefix_fraction_mean": float(np.mean([p["prefix_fraction"] for p in per_problem])),
        "reference_pass@1": sum(p["reference_correct"] for p in per_problem) / n,
        "other_pass@1": sum(p["other_correct"] for p in per_problem) / n,
        "both_correct": count(True, True),
        "reference_only_correct": count(True, False),
        "other_only_correct": count(False, True),
        "both_wrong": count(False, False),
    }
    return per_problem, summary


def compare_dirs(reference: str | os.PathLike, other: str | os.PathLike) -> tuple[list[dict], dict]:
    """``(per problem, report)`` of two results folders: the summary of ``compare_rows`` with what each run was."""
    ref_results, ref_rows = read_results(reference)
    oth_results, oth_rows = read_results(other)
    per_problem, summary = compare_rows(ref_rows, oth_rows)
    describe = lambda folder, results: {"dir": str(folder), **{k: results.get(k) for k in RUN_KEYS}}
    report = {"reference": describe(reference, ref_results), "other": describe(other, oth_results), **summary}
    return per_problem, report


def compare_markdown(report: dict) -> str:
    """``compare.json`` as Markdown: the two runs side by side, then the per-problem agreement."""
    r, n = report, report["problems"]
    ref, oth = r["reference"], r["other"]
    run = lambda d: (f"{d['precision_mode']} ({d['precision_backend']}, KV {d['kv_cache_dtype']})"
                     if d.get("precision_mode") else "-")
    policy = lambda d: f"`{d['checkpoint']}` step {d['step']}" if d.get("checkpoint") else "initial weights"
    lines = [
        f"# Comparison: `{ref['dir']}` (reference) vs `{oth['dir']}`",
        "",
        "| | reference | other |",
        "|---|---|---|",
        f"| config | `{ref.get('config')}` | `{oth.get('config')}` |",
        f"| precision | {run(ref)} | {run(oth)} |",
        f"| policy | {policy(ref)} | {policy(oth)} |",
        f"| pass@1 on the {n} problems compared | {format_percent(r['reference_pass@1'], n)} | "
        f"{format_percent(r['other_pass@1'], n)} |",
        f"| correct in this run only | {r['reference_only_correct']} | {r['other_only_correct']} |",
        "",
        f"Greedy completions, problem by problem ({n} problems in both runs"
        + (f"; {r['only_in_reference']} in the reference only, {r['only_in_other']} in the other only"
           if r["only_in_reference"] or r["only_in_other"] else "") + "):",
        "",
        "| | |",
        "|---|---|",
        f"| same verdict | {format_percent(r['same_verdict'], n)} |",
        f"| identical text | {format_percent(r['identical'], n)} |",
        f"| common prefix, mean | {r['prefix_chars_mean']:.1f} characters, "
        f"{format_percent(r['prefix_fraction_mean'])} of the reference completion |",
        "",
    ]
    return "\n".join(lines)


def write_compare(out: str | os.PathLike, per_problem: list[dict], report: dict) -> Path:
    """``compare.json``, ``compare.md`` and ``compare.jsonl`` into the folder ``out`` (made if missing)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / COMPARE_JSONL, per_problem)
    write_text_atomic(out / COMPARE_JSON, json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    write_text_atomic(out / COMPARE_MD, compare_markdown(report))
    return out
