"""GPU kernel time from a ``jax.profiler`` trace: by kernel name, by family, and how busy the GPU was.

``summarize_trace(dir)`` reads the newest ``*.trace.json.gz`` under ``dir``. Besides the kernel time summed by
name, it reports the span from the first kernel's start to the last kernel's end and the time inside it when no
kernel ran (``idle_ms``): a program whose kernels are short next to their launch cost shows up as idle time, which
no faster kernel removes. ``idle_between`` says between which kernels that time passes.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

FAMILIES = (  # first match wins; names are lower-cased kernel names
    ("gemm", ("gemm", "cublas", "cutlass", "sm90_xmma", "nvjet", "triton_gemm", "dot")),
    ("attention", ("attention", "flash", "fmha", "softmax", "decode_attention")),
    ("fp8_cast_amax", ("cast", "quantize", "amax", "transpose_kernel", "fp8")),
    ("collective", ("nccl", "all_reduce", "all_gather", "reduce_scatter")),
    ("copy", ("memcpy", "memset", "copy", "dynamic_update_slice", "dynamic-update-slice")),
    ("fusion", ("fusion", "loop_", "input_", "reduce", "triton")),
)


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, keys in FAMILIES if any(k in low for k in keys)), "other")


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in, milliseconds out): kernels that overlap on
    several streams count once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s >= end:
            total += e - s
        elif e > end:
            total += e - end
        end = max(end, e)
    return total / 1e3


def gaps(kernels: list[tuple[float, float, str]], top: int = 10) -> list[dict]:
    """The idle time between kernels (``(start, end, name)``, microseconds), summed by the pair of kernels around
    each gap (the last to end before it, the first to start after it), largest first: ``top`` rows of ``after``,
    ``before``, ``ms`` and ``gaps``."""
    by_pair, count = collections.Counter(), collections.Counter()
    end, last = float("-inf"), None
    for s, e, name in sorted(kernels):
        if last is not None and s > end:
            by_pair[(last, name)] += (s - end) / 1e3
            count[(last, name)] += 1
        if e >= end:
            end, last = e, name
    return [{"after": a[:100], "before": b[:100], "ms": round(ms, 3), "gaps": count[(a, b)]}
            for (a, b), ms in by_pair.most_common(top)]


def summarize_trace(trace_dir: str, top: int = 25) -> dict:
    """GPU kernel time by name from the newest ``*.trace.json.gz`` under ``trace_dir`` (see the module docstring)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        return {"error": f"no trace under {trace_dir}"}
    events = json.load(gzip.open(files[-1]))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "/device:GPU" in n}
    by_name, count = collections.Counter(), collections.Counter()
    kernels = []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            by_name[e["name"]] += e["dur"] / 1e3
            count[e["name"]] += 1
            kernels.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]))
    intervals = [(s, e) for s, e, _ in kernels]
    total = sum(by_name.values())
    if not total:
        return {"error": "no GPU kernels in the trace", "processes": sorted(names.values())}
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e3
    busy = busy_ms(intervals)
    families = collections.Counter()
    for n, ms in by_name.items():
        families[family(n)] += ms
    return {
        "total_kernel_ms": round(total, 3), "kernels": sum(count.values()),
        "span_ms": round(span, 3), "busy_ms": round(busy, 3), "idle_ms": round(span - busy, 3),
        "families": {f: {"ms": round(ms, 3), "share": round(ms / total, 3)} for f, ms in families.most_common()},
        "top": [{"name": n[:160], "ms": round(ms, 3), "calls": count[n], "share": round(ms / total, 3),
                 "family": family(n)} for n, ms in by_name.most_common(top)],
        "idle_between": gaps(kernels),
    }


def trace_one_call(fn, *args, top: int = 25) -> dict:
    """``summarize_trace`` of one call of ``fn(*args)`` (compiled beforehand by the caller), traced by
    ``jax.profiler`` into a temporary directory: the GPU's own kernel time, without launch gaps."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        return summarize_trace(d, top=top)
