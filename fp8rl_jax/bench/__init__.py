"""Benchmarks: ``python -m fp8rl_jax.bench {gemm,rollout,agreement,e2e,table} [--out FILE]``.

gemm       Llama-3.1-8B linear shapes at decode sizes (M = 64, 256, 1024) and a training size (M = 16384):
           BF16 through XLA's default GEMM (Triton for many shapes) and through cuBLAS (a child process with
           ``--xla_gpu_enable_triton_gemm=false``), FP8 through ``xla`` and ``te`` quantizing the BF16 weight per
           call, and both with pre-quantized FP8 weights; forward plus backward at the training size.
rollout    Decode throughput of the engine on a Llama-3.2-1B shape with random weights, batch 64 and 256, 1k and
           4k new tokens: BF16, FP8 weights, FP8 weights + FP8 KV cache, next to the HBM bound (bytes a step must
           read, weights + the KV of the average context, over the measured copy bandwidth).
agreement  How far the sampler's logprobs are from the trainer's, and each precision's from f32 (SmolLM2, GSM8K
           solutions teacher-forced through the rollout engine and the scoring forward).
e2e        Whole GRPO steps of a config (default ``configs/llama1b.py``) per phase, bf16 / bf16 with cuBLAS /
           fp8_rollout / fp8_e2e / fp8_e2e_head (the LM head in FP8 too) / fp8_e2e_bf16_head_grad (the head's
           backward GEMMs in BF16 too) / fp8_e2e_cublas / fp8_e2e_xla (XLA's FP8 GEMMs, no TE), each mode in its
           own process after warm-up steps: phase times, tokens/s, train TFLOP/s and MFU, peak memory, fp8_e2e's
           speedups over the best BF16 (``bench/e2e.py``).
table      Markdown tables of result files, for benchmarks/RESULTS.md.

Timing: everything runs inside one jit (a scan over several distinct weights for small GEMMs, so dispatch and
cache effects stay out), after a warm-up, median of repeats, ``block_until_ready`` around each.
``--smoke`` runs tiny shapes on any backend to check the code paths (the test suite does this on CPU).

One module per benchmark (``gemm.py``, ``rollout.py``, ``agreement.py``), each with ``add_arguments(parser)`` and
``run(args) -> rows``; ``__main__.py`` lists them, ``tables.py`` formats their rows.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time


def tree_commit() -> str:
    """The commit a result came from: ``FP8RL_COMMIT`` where the caller names the tree (a device's copy of a working
    tree has no HEAD, or a stale one), else git's short HEAD of this checkout, else ""."""
    if os.environ.get("FP8RL_COMMIT"):
        return os.environ["FP8RL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def error_text(e: BaseException, limit: int = 300) -> str:
    """A benchmark row's ``error``: the exception's type and the first line of its message (at most ``limit``
    characters; empty for an empty message)."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:limit] if lines else ''}"


def emit(rows: list, row: dict) -> None:
    """Keep ``row`` and print it as one JSON line (a sweep's progress, and its rows if it dies)."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def timeit(fn, *args, repeats: int = 10) -> float:
    """Median seconds of ``fn(*args)`` (compiled and warmed up first)."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def script_parser(doc: str, timed: int = 10):
    """The ``argparse`` parser of a ``benchmarks/`` kernel script, with the arguments they share: ``--out``, ``--timed``
    (timed calls, median), ``--trace`` (GPU kernel time from a profiler trace), ``--check`` (tiny shapes through
    Pallas' interpreter, on any backend) and ``--commit`` (what ``write_script_result`` records)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--timed", type=int, default=timed, help="timed calls (median)")
    p.add_argument("--trace", action="store_true", help="also each row's GPU kernel time from a profiler trace")
    p.add_argument("--check", action="store_true", help="tiny shapes, the kernels through Pallas' interpreter")
    p.add_argument("--commit", default="", help="the commit that runs (a device's copy may report an older one)")
    return p


def parse_script_args(parser, script: str, argv: list[str] | None = None):
    """``(args, argv)`` of a ``script_parser`` script: ``argv`` (default the command line's) parsed; a timed run (no
    ``--check``) on a backend other than a GPU exits, naming ``script``."""
    import sys

    import jax

    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if not args.check and jax.default_backend() != "gpu":
        sys.exit(f"{script} times a GPU; on this backend run --check")
    return args, argv


def script_header(script: str, argv: list[str], started: float | None = None, commit: str = "") -> dict:
    """What every ``benchmarks/`` script's result file starts with: the device, backend, JAX version, commit
    (``commit`` or ``tree_commit``: a device's copy of the tree may report an older one), its command line and, with
    ``started``, the seconds since."""
    import jax

    header = {"device": device_name(), "backend": jax.default_backend(), "jax": jax.__version__,
              "commit": commit or tree_commit(), "command": " ".join(["python", f"benchmarks/{script}.py", *argv])}
    if started is not None:
        header["seconds"] = round(time.time() - started, 1)
    return header


def write_json(out: str, result: dict) -> None:
    """``result`` as indented JSON at ``out`` (its folder made)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def write_script_result(out: str, script: str, argv: list[str], started: float, rows: list[dict], commit: str = "",
                        **extra) -> None:
    """A ``benchmarks/`` script's result file: ``script_header``, ``extra`` fields and ``rows``; then exits non-zero
    if a row holds an error."""
    import sys

    write_json(out, {**script_header(script, argv, started, commit), **extra, "rows": rows})
    print(f"wrote {out}: {len(rows)} rows", flush=True)
    if any("error" in r for r in rows):
        sys.exit(f"{sum('error' in r for r in rows)} rows failed")


def device_name() -> str:
    import jax

    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)
