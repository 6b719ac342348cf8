"""``python -m fp8rl_jax.bench gemm|rollout|agreement|fidelity|table ...``: one subcommand per benchmark module.

A benchmark module has ``add_arguments(parser)`` and ``run(args) -> rows`` (a list of dicts); its rows
are written as JSON to ``--out`` (default ``<name>_<unix time>.json``), each with the device it ran on. A new
benchmark is one more module and one more line in ``BENCHMARKS`` (and a table in ``tables.TABLES``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import fp8rl_jax.bench as bench

# subcommand -> (module, one-line help); a module is imported only when chosen, after Transformer Engine's preload
BENCHMARKS = {
    "gemm": ("fp8rl_jax.bench.gemm", "FP8 vs BF16 GEMMs, Llama-3.1-8B linear shapes, decode and training sizes"),
    "rollout": ("fp8rl_jax.bench.rollout",
                "decode tokens/s of the rollout engine (Llama-3.2-1B shape, random weights) against the HBM bound"),
    "agreement": ("fp8rl_jax.bench.agreement",
                  "rollout-vs-scoring logprob agreement and error vs f32 (SmolLM2, GSM8K)"),
    "collectives": ("fp8rl_jax.bench.collectives",
                    "collectives of the compiled decode program on 8 forced CPU devices, per mesh (no GPU needed)"),
    "async": ("fp8rl_jax.bench.asynchronous",
              "synchronous GRPO on all devices against asynchronous on the same devices split (lognormal lengths)"),
    "fidelity": ("fp8rl_jax.bench.fidelity",
                 "each FP8 form's logprobs and policy gradient against f32: whole model, per GEMM role, per block"),
    "e2e": ("fp8rl_jax.bench.e2e",
            "whole GRPO steps per phase: bf16, bf16_cublas, fp8_rollout, fp8_e2e (a process each)"),
}


def _parser(chosen: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fp8rl_jax.bench", description=bench.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, (module_name, help_line) in BENCHMARKS.items():
        parser = sub.add_parser(name, help=help_line)
        if name == chosen:  # only the chosen benchmark's module is imported for its flags
            importlib.import_module(module_name).add_arguments(parser)
        parser.add_argument("--out", default="")
    t = sub.add_parser("table", help="markdown tables of result files (gemm_*.json, rollout_*.json, ...)")
    t.add_argument("files", nargs="+")
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    from fp8rl_jax.fp8 import te

    te.preload()  # before anything starts JAX's GPU backend (see fp8rl_jax.fp8.te)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = _parser(chosen if chosen in BENCHMARKS else None).parse_args(argv)
    if args.cmd == "table":
        from fp8rl_jax.bench.tables import print_tables

        print_tables(args.files)
        return
    args.out = args.out or f"{args.cmd}_{int(time.time())}.json"
    module = importlib.import_module(BENCHMARKS[args.cmd][0])
    rows = module.run(args)
    device = bench.device_name()
    for row in rows:
        row.setdefault("device", device)
    with open(args.out, "w") as f:  # a module may shape its file (``output``): a summary around its rows
        json.dump(module.output(rows, args) if hasattr(module, "output") else rows, f, indent=1)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
