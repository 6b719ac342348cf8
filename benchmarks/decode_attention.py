"""Decode attention micro-benchmark: the length-aware Pallas kernel against the model's whole-cache einsum.

    python benchmarks/decode_attention.py --out benchmarks/results/decode_attention_h100.json
    python benchmarks/decode_attention.py --interpret --out /tmp/decode_attention_cpu.json   # CPU, tiny shape

Each timed call is one jit holding a ``lax.scan`` over the layers, as in the model's decode step: per layer, the
new token's K/V are scattered into the carried cache [L, B, K, S, H] at position length-1 (the same for both
paths), then attention of one query token per sequence over that layer. ``xla`` is the model's path (the layer
sliced out of the cache, FP8 dequantized to BF16, ``attention.attention`` over all S positions, masked);
``pallas`` is ``fp8rl_jax.kernels.decode_attention`` (positions 0..length-1 only, FP8 read in place);
``scatter_only`` is the cache write alone (the floor both share).

Rows report microseconds per layer-step (median of ``--repeats`` after warm-up, divided by the layers timed)
and the achieved bandwidth on the K/V bytes a step actually needs, ``2 * K * H * bytes * sum(lengths)`` per
layer. Lengths are ragged around ``fill * S`` (uniform in [0.5, 1.5] x fill x S, clipped to [1, S]; fill 1.0
means all S). Caches that would not fit use fewer layers (``layers_timed``); the per-layer figure is the same.
``--sweep`` tunes the kernel on ``SWEEP_SHAPES``: block_k x k_splits (num_warps 4, the default num_stages), then
num_warps x num_stages around the best pair; ``--sweep_heads_per_program 1,2,4`` crosses the first stage with the
kernel's kv heads per program (values that do not divide a shape's K are left out for it); ``--sweep_num_warps 1,2,4``
(and ``--sweep_num_stages``) cross launch settings into the first stage too (the grid is then all of it: no
second stage). The full default run is ~150
timed configurations (each compiled once): split it with ``--models`` / ``--kv`` to keep each invocation within a
few minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8rl_jax.bench import emit, error_text, script_header, write_json  # noqa: E402
from fp8rl_jax.fp8 import kv as kvq  # noqa: E402
from fp8rl_jax.kernels import decode_attention as da  # noqa: E402
from fp8rl_jax.model import attention  # noqa: E402

MODELS = {  # name: (kv heads K, query heads per kv head G, head dim H, layers L)
    "1b": (8, 4, 64, 16),  # Llama-3.2-1B
    "8b": (8, 4, 128, 32),  # Llama-3.1-8B
    "tiny": (2, 2, 16, 2),  # the CPU check (--interpret)
}
SWEEP_TILES = {"block_k": (32, 64, 128, 256), "k_splits": (1, 2, 4, 8)}  # first stage
SWEEP_LAUNCH = {"num_warps": (4, 8), "num_stages": (2, 3, 4)}  # second stage, at the best tiles
SWEEP_SHAPES = (  # model, batch, cache_len, fill, kv
    ("1b", 64, 1088, 0.5, "fp8"), ("1b", 256, 1088, 0.5, "fp8"), ("1b", 256, 4160, 0.5, "fp8"),
    ("1b", 64, 1088, 0.5, "bf16"), ("1b", 256, 1088, 0.5, "bf16"), ("8b", 64, 4160, 0.5, "fp8"),
    ("8b", 256, 1088, 0.5, "fp8"),
)


def _lengths(batch: int, cache_len: int, fill: float, seed: int = 0) -> np.ndarray:
    if fill >= 1.0:
        return np.full((batch,), cache_len, np.int32)
    ragged = np.random.default_rng(seed).uniform(0.5, 1.5, batch) * fill * cache_len
    return np.clip(np.round(ragged), 1, cache_len).astype(np.int32)


def _make_cache(layers, batch, kv_heads, cache_len, head_dim, kv: str, seed: int):
    """A random [L, B, K, S, H] cache (one random layer repeated) and its scale (FP8) or None."""
    one = jax.random.normal(jax.random.PRNGKey(seed), (batch, kv_heads, cache_len, head_dim), jnp.bfloat16)
    if kv == "fp8":
        scale = jnp.float32(448.0 / 5.0)
        one = kvq.quantize_kv(one, scale)
    else:
        scale = None
    stack = jax.jit(lambda x: jnp.broadcast_to(x[None], (layers, *x.shape)))(one)  # a jit output: materialized
    return stack, scale


def _attention_fn(impl: str, tuning: da.DecodeTuning, interpret: bool):
    """attention(q [B, K, G, H], k_cache, v_cache [L, B, K, S, H], lengths [B], layer, k_scale, v_scale)."""
    if impl == "pallas":
        def attend(q, k_cache, v_cache, lengths, layer, k_scale, v_scale):
            return da.decode_attention_pallas(q, k_cache, v_cache, lengths, layer=layer, k_scale=k_scale,
                                              v_scale=v_scale, interpret=interpret, tuning=tuning)
        return attend

    def model_xla_path(q, k_cache, v_cache, lengths, layer, k_scale, v_scale):
        # what llama._block does with a cache today: slice the layer, dequantize, masked attention over all S
        b, kh, g, h = q.shape
        keys, values = k_cache[layer], v_cache[layer]
        if k_scale is not None:
            keys, values = kvq.dequantize_kv(keys, k_scale, q.dtype), kvq.dequantize_kv(values, v_scale, q.dtype)
        s = k_cache.shape[3]
        q_pos = (lengths - 1)[:, None]
        k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
        # [B, K, G, H] -> [B, 1, K*G, H]
        out = attention.attention(q.reshape(b, 1, kh * g, h), keys.astype(q.dtype), values.astype(q.dtype), q_pos,
                                  k_pos)
        # [B, 1, N, H] -> [B, K, G, H]
        return out.reshape(b, kh, g, h)

    return model_xla_path


def _layer_scan(impl: str, tuning: da.DecodeTuning, interpret: bool):
    """jit(cache_k, cache_v, q_layers [L, B, K, G, H], lengths, scales) -> (caches, outputs [L, B, K, G, H])."""
    attend = None if impl == "scatter_only" else _attention_fn(impl, tuning, interpret)

    def run(k_cache, v_cache, q_layers, lengths, k_scale, v_scale):
        b = lengths.shape[0]
        rows = jnp.arange(b)

        def body(carry, xs):
            k_cache, v_cache = carry
            q, layer = xs
            # the new token's K/V at position length-1 (the model writes before it attends)
            new = q[:, :, 0, :].astype(k_cache.dtype)  # [B, K, H]
            k_cache = k_cache.at[layer, rows, :, lengths - 1].set(new, mode="drop")
            v_cache = v_cache.at[layer, rows, :, lengths - 1].set(new, mode="drop")
            if attend is None:
                out = jnp.zeros_like(q)
            else:
                out = attend(q, k_cache, v_cache, lengths, layer, k_scale, v_scale)
            return (k_cache, v_cache), out

        layers = q_layers.shape[0]
        (k_cache, v_cache), outs = jax.lax.scan(body, (k_cache, v_cache), (q_layers, jnp.arange(layers)))
        return k_cache, v_cache, outs

    return jax.jit(run, donate_argnums=(0, 1))


def _time_layers(fn, k_cache, v_cache, args, repeats: int, warmup: int):
    """Median seconds of one call, the caches fed back (they are donated)."""
    times = []
    for i in range(warmup + repeats):
        t = time.perf_counter()
        k_cache, v_cache, outs = fn(k_cache, v_cache, *args)
        jax.block_until_ready((k_cache, v_cache, outs))
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times), k_cache, v_cache


def _memory_budget(fraction: float) -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(fraction * stats.get("bytes_limit", 8 * 2**30))


def bench_shape(model, batch, cache_len, fill, kv, impls, *, tunings, repeats, warmup, interpret, mem_fraction,
                max_layers=None, seed=0):
    """Rows for one shape: every impl (and every tuning of the kernel, ``tunings``: ``DecodeTuning`` values)."""
    kv_heads, groups, head_dim, layers = MODELS[model]
    itemsize = 1 if kv == "fp8" else 2
    per_layer = 2 * batch * kv_heads * cache_len * head_dim * itemsize  # K and V
    layers_timed = min(layers, max_layers or layers, _memory_budget(mem_fraction) // per_layer)
    base = {"model": model, "batch": batch, "cache_len": cache_len, "fill": fill, "kv_dtype": kv,
            "kv_heads": kv_heads, "groups": groups, "head_dim": head_dim}
    if layers_timed < 2:
        return [{**base, "skipped": f"K/V of 2 layers ({2 * per_layer / 2**30:.1f} GiB) over the memory budget"}]
    lengths = _lengths(batch, cache_len, fill, seed)
    needed = 2 * kv_heads * head_dim * itemsize * int(lengths.sum())  # K/V bytes one layer-step must read
    k_cache, scale = _make_cache(layers_timed, batch, kv_heads, cache_len, head_dim, kv, seed)
    v_cache, _ = _make_cache(layers_timed, batch, kv_heads, cache_len, head_dim, kv, seed + 1)
    q_layers = jax.random.normal(jax.random.PRNGKey(seed + 2), (layers_timed, batch, kv_heads, groups, head_dim),
                                 jnp.bfloat16)
    lengths_dev = jnp.asarray(lengths)

    # correctness on this device, before any timing (the timed scans write into the caches): every tuning of
    # the kernel against the model's path, on layer 0
    check = (q_layers[0], k_cache, v_cache, lengths_dev, 0, scale, scale)
    reference = _attention_fn("xla", da.DEFAULT_TUNING, interpret)(*check).astype(jnp.float32)
    diffs = {}
    if "pallas" in impls:
        for i, tuning in enumerate(tunings):
            try:
                got = _attention_fn("pallas", tuning, interpret)(*check).astype(jnp.float32)
                diffs[i] = float(jnp.max(jnp.abs(got - reference)))
            except Exception as e:  # a tuning Triton rejects: the timing below records the error
                diffs[i] = f"{type(e).__name__}"
    rows, xla_us = [], None
    for impl in impls:
        for i, tuning in enumerate(tunings if impl == "pallas" else [da.DEFAULT_TUNING]):
            fn = _layer_scan(impl, tuning, interpret)
            row = {**base, "impl": impl, "layers_timed": layers_timed, "mean_length": float(lengths.mean()),
                   "kv_bytes_needed_per_layer": needed}
            if impl == "pallas":  # the launch as the kernel resolves it
                try:
                    launch = tuning.resolved(batch * kv_heads, kv_heads, groups, head_dim, itemsize, cache_len)
                except ValueError:  # a heads_per_program that does not divide K: the timing records the error
                    launch = tuning
                row.update(block_k=launch.block_k, k_splits=launch.k_splits, heads_per_program=launch.heads_per_program,
                           num_warps=launch.num_warps, num_stages=launch.num_stages,
                           dot_dtype=str(jnp.dtype(launch.dot_dtype or da.default_dot_dtype(
                               jnp.bfloat16, jnp.float8_e4m3fn if kv == "fp8" else jnp.bfloat16))),
                           tail_loop=launch.tail_loop)
                row["max_abs_diff_vs_xla"] = diffs[i]
            try:
                seconds, k_cache, v_cache = _time_layers(fn, k_cache, v_cache, (q_layers, lengths_dev, scale, scale),
                                                         repeats, warmup)
            except Exception as e:  # a tuning Triton rejects (shared memory, registers): record it, go on
                row["error"] = error_text(e, 200)
                k_cache, _ = _make_cache(layers_timed, batch, kv_heads, cache_len, head_dim, kv, seed)
                v_cache, _ = _make_cache(layers_timed, batch, kv_heads, cache_len, head_dim, kv, seed + 1)
                rows.append(row)
                continue
            us = seconds / layers_timed * 1e6
            row.update(us_per_layer=round(us, 3), gb_per_s_needed=round(needed / (us * 1e-6) / 1e9, 1))
            if impl == "xla":
                xla_us = us
            emit(rows, row)
    for row in rows:
        if xla_us and "us_per_layer" in row:
            row["speedup_vs_xla"] = round(xla_us / row["us_per_layer"], 3)
    del k_cache, v_cache
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    p.add_argument("--batch", nargs="+", type=int, default=None)
    p.add_argument("--cache_len", nargs="+", type=int, default=None)
    p.add_argument("--fill", nargs="+", type=float, default=(0.25, 0.5, 1.0))
    p.add_argument("--kv", nargs="+", default=("bf16", "fp8"), choices=("bf16", "fp8"))
    p.add_argument("--impls", nargs="+", default=("xla", "pallas", "scatter_only"),
                   choices=("xla", "pallas", "scatter_only"))
    p.add_argument("--sweep", action="store_true", help="also tune the kernel on SWEEP_SHAPES")
    p.add_argument("--sweep_filter", default="",
                   help="only the sweep shapes with all these parts of model/bBATCH/sCACHE/kv, e.g. 1b/s1088/bf16")
    p.add_argument("--sweep_block_k", default="", help="comma-separated block_k values instead of SWEEP_TILES'")
    p.add_argument("--sweep_k_splits", default="", help="comma-separated k_splits values instead of SWEEP_TILES'")
    p.add_argument("--sweep_heads_per_program", default="1",
                   help="comma-separated kv heads per kernel program to cross the first stage with, e.g. 1,2,4")
    p.add_argument("--sweep_num_warps", default="",
                   help="comma-separated num_warps crossed into the first stage (e.g. 1,2,4)")
    p.add_argument("--sweep_num_stages", default="",
                   help="comma-separated num_stages crossed into the first stage (e.g. 2,3)")
    p.add_argument("--ab_tail_loop", action="store_true",
                   help="time the kernel with tail_loop=True and False (whole blocks unmasked, or every block masked)")
    p.add_argument("--ab_heads_per_program", default="",
                   help="with the --ab_ flags: comma-separated heads_per_program values crossed in")
    p.add_argument("--ab_num_warps", default="", help="with the --ab_ flags: comma-separated num_warps crossed in")
    p.add_argument("--ab_block_k", default="",
                   help="with the --ab_ flags: comma-separated block_k values crossed in")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max_layers", type=int, default=None)
    p.add_argument("--mem_fraction", type=float, default=0.6, help="of device memory for the two caches")
    p.add_argument("--interpret", action="store_true", help="run the kernel through Pallas' interpreter (CPU)")
    args = p.parse_args(argv)

    if args.interpret:  # tiny defaults: the interpreter is slow
        models, batches, lens = args.models or ["tiny"], args.batch or [4], args.cache_len or [40]
    else:
        models, batches, lens = args.models or ["1b", "8b"], args.batch or [64, 256], args.cache_len or [1088, 4160]
    common = dict(repeats=args.repeats, warmup=args.warmup, interpret=args.interpret, mem_fraction=args.mem_fraction,
                  max_layers=args.max_layers)
    ints = lambda arg: [int(v) for v in arg.split(",")] if arg else []  # noqa: E731
    ab_crossed = [(key, values) for key, values in (
        ("tail_loop", (True, False) if args.ab_tail_loop else ()),
        ("heads_per_program", ints(args.ab_heads_per_program)), ("num_warps", ints(args.ab_num_warps)),
        ("block_k", ints(args.ab_block_k))) if values]
    rows = []
    for model, batch, cache_len, fill, kv in itertools.product(models, batches, lens, args.fill, args.kv):
        tunings = [da.DEFAULT_TUNING]
        for key, values in ab_crossed:  # each A/B option crossed with the ones before it
            tunings = [dataclasses.replace(t, **{key: v}) for t in tunings for v in values]
        rows += bench_shape(model, batch, cache_len, fill, kv, args.impls, tunings=tunings, **common)
    sweep = []
    if args.sweep:
        shapes = [("tiny", 4, 40, 0.5, "fp8")] if args.interpret else SWEEP_SHAPES
        wanted = set(filter(None, args.sweep_filter.split("/")))  # e.g. 1b/fp8 or 1b/s1088/bf16
        shapes = [sh for sh in shapes if wanted <= {sh[0], f"b{sh[1]}", f"s{sh[2]}", sh[4]}]
        grid = dict(SWEEP_TILES)
        crossed = {key: arg for key, arg in (("num_warps", args.sweep_num_warps),
                                             ("num_stages", args.sweep_num_stages)) if arg}
        for key, arg in (("block_k", args.sweep_block_k), ("k_splits", args.sweep_k_splits), *crossed.items()):
            if arg:
                grid[key] = tuple(int(v) for v in arg.split(","))
        heads_per_program = tuple(int(v) for v in args.sweep_heads_per_program.split(","))
        launch = [dict(zip(SWEEP_LAUNCH, v, strict=True)) for v in itertools.product(*SWEEP_LAUNCH.values())]
        for shape in shapes:
            kv_heads = MODELS[shape[0]][0]
            heads = [n for n in heads_per_program if kv_heads % n == 0]
            if len(heads) < len(heads_per_program):
                print(f"{shape}: heads_per_program {sorted(set(heads_per_program) - set(heads))} left out "
                      f"(K={kv_heads})", flush=True)
            # the dots' operand dtype is the kernel's default (F16 for an FP8 cache: measured faster)
            tiles = [da.DecodeTuning(**dict(zip(grid, v, strict=True)), heads_per_program=n)
                     for v in itertools.product(*grid.values()) for n in heads]
            if args.interpret:  # the interpreter ignores launch settings; a few tilings show the path works
                picked = {}  # the first tiling of each heads_per_program, and the last one
                for t in tiles:
                    picked.setdefault(t.heads_per_program, t)
                tiles = [*picked.values()] + ([] if tiles[-1] in picked.values() else [tiles[-1]])
                launch = launch[:1]
            first = bench_shape(*shape, ("xla", "pallas"), tunings=tiles, **common)
            timed = [r for r in first if r.get("impl") == "pallas" and "us_per_layer" in r]
            sweep += first
            if timed and not crossed:
                best = min(timed, key=lambda r: r["us_per_layer"])
                first_launch = (da.DEFAULT_TUNING.num_warps, da.DEFAULT_TUNING.num_stages)  # the first stage's
                around = [da.DecodeTuning(block_k=best["block_k"], k_splits=best["k_splits"],
                                          heads_per_program=best["heads_per_program"], **lc)
                          for lc in launch if (lc["num_warps"], lc["num_stages"]) != first_launch]
                second = bench_shape(*shape, ("pallas",), tunings=around, **common)
                xla = [r["us_per_layer"] for r in first if r.get("impl") == "xla" and "us_per_layer" in r]
                for row in second:
                    if xla and "us_per_layer" in row:
                        row["speedup_vs_xla"] = round(xla[0] / row["us_per_layer"], 3)
                sweep += second
    result = {**script_header("decode_attention", sys.argv[1:] if argv is None else argv), "interpret": args.interpret,
              "rows": rows, "sweep": sweep}
    best = {}
    for row in sweep:
        if row.get("impl") == "pallas" and "us_per_layer" in row:
            key = f'{row["model"]}/b{row["batch"]}/s{row["cache_len"]}/f{row["fill"]}/{row["kv_dtype"]}'
            if key not in best or row["us_per_layer"] < best[key]["us_per_layer"]:
                best[key] = {k: row[k] for k in ("block_k", "k_splits", "heads_per_program", "num_warps",
                                                 "num_stages", "dot_dtype", "us_per_layer", "gb_per_s_needed")}
    result["sweep_best"] = best
    write_json(args.out, result)
    print(f"wrote {args.out}: {len(rows)} rows, {len(sweep)} sweep rows", flush=True)
    if not all(math.isfinite(r.get("max_abs_diff_vs_xla", 0.0)) for r in rows + sweep
               if isinstance(r.get("max_abs_diff_vs_xla", 0.0), float)):
        sys.exit("the kernel's output is not finite on some shape (see max_abs_diff_vs_xla)")


if __name__ == "__main__":
    main()
