"""``bench gemm``: FP8 and BF16 GEMMs at Llama-3.1-8B linear shapes (``fp8rl_jax.bench`` has the details)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from fp8rl_jax.bench import timeit

LLAMA8B_LINEARS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ms", default="64,256,1024,16384")
    parser.add_argument("--paths", default="bf16,xla_fp8,te_fp8,xla_fp8_prequant,te_fp8_prequant")
    parser.add_argument("--tag", default="")
    parser.add_argument("--cublas_child", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--smoke", action="store_true")


def _gemm_kernels(fn, *args) -> str:
    """GEMM custom calls / fusions in the compiled HLO (which library XLA picked)."""
    import re

    text = fn.lower(*args).compile().as_text()
    found = set(re.findall(r'custom_call_target="([^"]*(?:gemm|matmul|cublas|triton)[^"]*)"', text))
    if '"kind":"__triton_gemm"' in text or "__triton_gemm" in text:
        found.add("triton_gemm")
    return ",".join(sorted(found)) or "fusion"


def _gemm_paths(paths: list[str], recipe) -> dict:
    """path name -> (f(x, w, state), weight transform, bytes per stored weight element)."""
    import jax.numpy as jnp

    from fp8rl_jax.fp8 import xla as xla_fp8

    backends = {"xla": xla_fp8}
    if any(p.startswith("te") for p in paths):
        from fp8rl_jax.fp8 import te as te_fp8

        if te_fp8.is_available():
            backends["te"] = te_fp8
        else:
            print("transformer engine not available: te paths skipped", file=sys.stderr)
    out = {}
    for path in paths:
        name = path.split("_")[0]
        # "..._rowwise": per-token x per-output-channel current scales in the forward (xla only)
        r = dataclasses.replace(recipe, scaling="rowwise") if "rowwise" in path.split("_") else recipe
        if path.startswith("bf16"):
            out[path] = (lambda x, w, s: jnp.dot(x, w, preferred_element_type=jnp.bfloat16), None, 2)
        elif name in backends and path.endswith("prequant"):
            b = backends[name]
            out[path] = (
                lambda x, qw, s, b=b, r=r: b.prequantized_matmul(x, qw, s["x"]["scale"], r).astype(x.dtype),
                lambda w, s, r=r: xla_fp8.quantize_kernel(w, s["kernel"], r),
                1,
            )
        elif name in backends:
            out[path] = (lambda x, w, s, b=backends[name], r=r: b.fp8_matmul(x, w, s, r), None, 2)
    return out


def bench_gemm(ms: list[int], shapes: dict, paths: list[str], fwd_bwd_m: int, tag: str = "") -> list[dict]:
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state

    recipe = Fp8Recipe()
    fns = _gemm_paths(paths, recipe)
    state = init_linear_state(recipe)
    state["x"]["scale"] = jnp.float32(448.0 / 4.0)
    state["kernel"]["scale"] = jnp.float32(448.0 / 0.1)
    state["grad"]["scale"] = jnp.float32(57344.0 / 4.0)
    rows = []
    key = jax.random.PRNGKey(0)
    for m in ms:
        print(f"-- M={m}", flush=True)
        for k, n in shapes.values():
            reps = 8 if m <= 1024 else 2  # distinct weights per timed call (keeps weights out of L2)
            kx, kw = jax.random.split(jax.random.fold_in(key, m * 7 + k))
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            ws = tuple((0.02 * jax.random.normal(jax.random.fold_in(kw, i), (k, n))).astype(jnp.bfloat16)
                       for i in range(reps))
            for path, (f, prepare, wbytes) in fns.items():
                weights = ws if prepare is None else tuple(jax.jit(prepare)(w, state) for w in ws)
                fn, calls = _many_gemms(f, m, n, state)
                sec = timeit(fn, x, weights) / (calls * len(weights))
                row = _gemm_row(m, k, n, tag or path, sec, 2 * m * k * n, wbytes, _gemm_kernels(fn, x, weights))
                rows.append(row)
                print(_fmt(row), flush=True)
            if m != fwd_bwd_m:
                continue
            g = jax.random.normal(jax.random.fold_in(kx, 1), (m, n), jnp.bfloat16)
            for path, (f, prepare, _) in fns.items():
                if prepare is not None:
                    continue  # rollout-only path: no backward

                def fwd_bwd(x, w, g, f=f):
                    y, vjp = jax.vjp(lambda x, w: f(x, w, state), x, w)
                    return y, vjp(g)  # y returned: the forward GEMM is not dead code

                fn = jax.jit(fwd_bwd)
                sec = timeit(fn, x, ws[0], g)
                row = _gemm_row(m, k, n, (tag or path) + "_fwd_bwd", sec, 6 * m * k * n, 2,
                                _gemm_kernels(fn, x, ws[0], g))
                rows.append(row)
                print(_fmt(row), flush=True)
    return rows


def _many_gemms(f, m: int, n: int, state: dict, loops: int = 16):
    """A jitted ``(x, weights) -> outputs`` running ``f(x, w, state)`` once per weight, ``calls`` times.

    Small GEMMs take microseconds, less than dispatching a jit call: for M <= 256 a loop repeats the whole set
    ``loops`` times inside the jit. Each pass's input and kernel scale depend on the loop carry (through a
    multiply by 0 that XLA keeps for floats), so neither the GEMMs nor an on-the-fly weight quantization can be
    hoisted out of the loop; the accumulators cost one small [M, N] add per GEMM.
    """
    import jax
    import jax.numpy as jnp

    if m > 256:
        return jax.jit(lambda x, ws: [f(x, w, state) for w in ws]), 1

    def run(x, ws):
        def body(_, accs):
            zero = accs[0][0, 0].astype(jnp.float32) * 0.0
            x_i = x + zero.astype(x.dtype)
            state_i = {**state, "kernel": {**state["kernel"], "scale": state["kernel"]["scale"] + zero}}
            return tuple(a + f(x_i, w, state_i).astype(a.dtype) for a, w in zip(accs, ws, strict=True))

        accs = tuple(jnp.zeros((m, n), jnp.bfloat16) for _ in ws)
        return jax.lax.fori_loop(0, loops, body, accs)

    return jax.jit(run), loops


def _gemm_row(m, k, n, path, sec, flops, wbytes, kernels) -> dict:
    return {"M": m, "K": k, "N": n, "path": path, "us": round(sec * 1e6, 2), "tflops": round(flops / sec / 1e12, 1),
            "weight_tbps": round(wbytes * k * n / sec / 1e12, 3), "kernels": kernels}


def _fmt(r: dict) -> str:
    return (f"M={r['M']:>6} K={r['K']:>6} N={r['N']:>6} {r['path']:<24} {r['us']:>10.1f} us "
            f"{r['tflops']:>7.1f} TFLOP/s {r['weight_tbps']:>6.3f} TB/s  {r.get('kernels', '')}")


def run(args) -> list[dict]:
    shapes = {"tiny": (64, 96)} if args.smoke else LLAMA8B_LINEARS
    ms = [16, 32] if args.smoke else [int(m) for m in args.ms.split(",")]
    fwd_bwd_m = ms[-1]
    paths = args.paths.split(",")
    rows = []
    if args.cublas_child and not args.smoke:
        # XLA flags are read once per process: BF16 through cuBLAS runs in a child process, first, before this
        # process's JAX takes the GPU's memory
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false"))
        child = [sys.executable, "-m", "fp8rl_jax.bench", "gemm", "--ms", args.ms, "--paths", "bf16",
                 "--tag", "bf16_cublas", "--no-cublas_child", "--out", args.out + ".cublas"]
        subprocess.run(child, env=env, check=True)
        with open(args.out + ".cublas") as f:
            rows += json.load(f)
        os.remove(args.out + ".cublas")
    rows += bench_gemm(ms, shapes, paths, fwd_bwd_m, tag=args.tag)
    return rows
