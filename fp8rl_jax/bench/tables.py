"""Markdown tables of benchmark result files, as in benchmarks/RESULTS.md: ``python -m fp8rl_jax.bench table
gemm_h100.json rollout_h100.json ...``."""

from __future__ import annotations

import json
from collections.abc import Callable


def gemm_table(rows: list[dict]) -> str:
    """Markdown: per shape and M, best BF16 against each FP8 path (time, and weight TB/s or TFLOP/s)."""
    by = {}
    for r in rows:
        by.setdefault((r["M"], r["K"], r["N"]), {})[r["path"]] = r
    names = {(4096, 6144): "qkv", (4096, 4096): "o", (4096, 28672): "gate_up", (14336, 4096): "down"}
    paths = ["xla_fp8", "te_fp8", "xla_fp8_prequant", "te_fp8_prequant"]
    out = ["| M | linear (K x N) | best BF16 us | " + " | ".join(f"{p} us (x)" for p in paths) + " |",
           "|---|---|---|" + "---|" * len(paths)]
    for (m, k, n), d in sorted(by.items()):
        bf = [d[p] for p in ("bf16", "bf16_cublas") if p in d]
        if not bf:
            continue
        best = min(bf, key=lambda r: r["us"])
        unit = (lambda r: f"{r['weight_tbps']:.2f} TB/s") if m <= 1024 else (lambda r: f"{r['tflops']:.0f} TF/s")
        cells = [f"{d[p]['us']:.1f} ({best['us'] / d[p]['us']:.2f}x)" if p in d else "-" for p in paths]
        out.append(f"| {m} | {names.get((k, n), '')} {k}x{n} | {best['us']:.1f} ({best['path']}, {unit(best)}) | "
                   + " | ".join(cells) + " |")
    out += ["", "| M | linear | best BF16 fwd+bwd us | xla_fp8 fwd+bwd us (x) | te_fp8 fwd+bwd us (x) |",
            "|---|---|---|---|---|"]
    for (m, k, n), d in sorted(by.items()):
        fb = [d[p] for p in ("bf16_fwd_bwd", "bf16_cublas_fwd_bwd") if p in d]
        if not fb:
            continue
        best = min(fb, key=lambda r: r["us"])
        cells = [f"{d[p]['us']:.0f} ({best['us'] / d[p]['us']:.2f}x)" if p in d else "-"
                 for p in ("xla_fp8_fwd_bwd", "te_fp8_fwd_bwd")]
        out.append(f"| {m} | {names.get((k, n), '')} {k}x{n} | {best['us']:.0f} ({best['path']}) | " + " | ".join(cells)
                   + " |")
    return "\n".join(out)


def rollout_table(rows: list[dict]) -> str:
    out = ["| batch | new tokens | mode | tokens/s | ms/step | HBM-bound tokens/s | fraction of bound |",
           "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["new_tokens"], r["batch"])):
        out.append(f"| {r['batch']} | {r['new_tokens']} | {r['mode']} | {r['tokens_per_s']:.0f} "
                   f"| {r['ms_per_step']:.2f} | {r['hbm_bound_tokens_per_s']:.0f} | {r['hbm_bound_fraction']:.2f} |")
    return "\n".join(out)


def agreement_table(rows: list[dict]) -> str:
    out = ["| precision | tokens | rollout vs scoring: mean / p99 / max abs dlogp | vs f32: mean / p99 abs dlogp |",
           "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['precision']} | {r['tokens']} | {r['decode_vs_full_mean']:.4f} / "
                   f"{r['decode_vs_full_p99']:.3f} / {r['decode_vs_full_max']:.3f} | {r['vs_f32_mean']:.4f} / "
                   f"{r['vs_f32_p99']:.3f} |")
    return "\n".join(out)


# which table a result file gets, by the keys of its rows: (predicate on the first row, table); first match wins
TABLES: list[tuple[Callable[[dict], bool], Callable[[list[dict]], str]]] = [
    (lambda row: "M" in row, gemm_table),
    (lambda row: "batch" in row, rollout_table),
    (lambda row: "precision" in row, agreement_table),
]


def table(rows: list[dict]) -> str:
    """The markdown table for one result file's rows."""
    for matches, make in TABLES:
        if matches(rows[0]):
            return make(rows)
    raise ValueError(f"no table for rows with keys {sorted(rows[0])}")


def print_tables(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        if not rows:
            raise ValueError(f"{path}: no rows")
        print(table(rows), end="\n\n")
