"""Benchmarks: ``python -m fp8rl_jax.bench {gemm,rollout} [--out FILE]``.

gemm     Llama-3.1-8B linear shapes at decode sizes (M = 64, 256, 1024) and a training size (M = 16384):
         BF16 through XLA's default GEMM (Triton for many shapes) and through cuBLAS (a child process with
         ``--xla_gpu_enable_triton_gemm=false``), FP8 through ``xla`` and ``te`` quantizing the BF16 weight per
         call, and both with pre-quantized FP8 weights; forward plus backward at the training size.
rollout  Decode throughput of the engine on a Llama-3.2-1B shape with random weights, batch 64 and 256, 1k and
         4k new tokens: BF16, FP8 weights, FP8 weights + FP8 KV cache, next to the HBM bound (bytes a step must
         read, weights + the KV of the average context, over the measured copy bandwidth).

Timing: everything runs inside one jit (a scan over several distinct weights for small GEMMs, so dispatch and
cache effects stay out), after a warm-up, median of repeats, ``block_until_ready`` around each.
``--smoke`` runs tiny shapes on any backend to check the code paths (the test suite does this on CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

LLAMA8B_LINEARS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def _timeit(fn, *args, repeats: int = 10) -> float:
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


def _gemm_kernels(fn, *args) -> str:
    """GEMM custom calls / fusions in the compiled HLO (which library XLA picked)."""
    import re

    text = fn.lower(*args).compile().as_text()
    found = set(re.findall(r'custom_call_target="([^"]*(?:gemm|matmul|cublas|triton)[^"]*)"', text))
    if '"kind":"__triton_gemm"' in text or "__triton_gemm" in text:
        found.add("triton_gemm")
    return ",".join(sorted(found)) or "fusion"


def _device_name() -> str:
    import jax

    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)


# ----------------------------------------------------------------------------------------------------------
# gemm


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
        if path.startswith("bf16"):
            out[path] = (lambda x, w, s: jnp.dot(x, w, preferred_element_type=jnp.bfloat16), None, 2)
        elif name in backends and path.endswith("prequant"):
            b = backends[name]
            out[path] = (
                lambda x, qw, s, b=b: b.prequantized_matmul(x, qw, s["x"]["scale"], recipe).astype(x.dtype),
                lambda w, s: xla_fp8.quantize_kernel(w, s["kernel"], recipe),
                1,
            )
        elif name in backends:
            out[path] = (lambda x, w, s, b=backends[name]: b.fp8_matmul(x, w, s, recipe), None, 2)
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
                sec = _timeit(fn, x, weights) / (calls * len(weights))
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
                sec = _timeit(fn, x, ws[0], g)
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


def run_gemm(args) -> list[dict]:
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


# ----------------------------------------------------------------------------------------------------------
# rollout


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device copy bandwidth in bytes/s (bytes read + bytes written), measured with a large elementwise op."""
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x: x * jnp.bfloat16(1.0009765625))
    return 2 * n * 2 / _timeit(f, x, repeats=20)


def bench_rollout(model_name: str, batches: list[int], new_tokens: list[int], modes: list[str], prompt_len: int,
                  chunk: int, copy_gib: float = 2.0) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.fp8 import kv as kvq
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.config import preset
    from fp8rl_jax.rollout.engine import Engine, EngineConfig
    from fp8rl_jax.rollout.sampling import SamplingParams

    cfg = preset(model_name)
    params = llama.init_params(cfg, jax.random.PRNGKey(0))
    bw = copy_bandwidth(copy_gib)
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for mode in modes:
        backend = "te" if "te" in mode.split("_") else "xla"
        precision = {
            "bf16": Precision(),
            "fp8": Precision(backend=backend),
            "fp8_kv": Precision(backend=backend, kv_cache_dtype="float8_e4m3fn"),
        }[mode.replace("_te", "")]
        fp8_state = llama.init_fp8_state(cfg, precision) if precision.fp8 else None
        if fp8_state is not None:  # plausible scales: weights ~N(0, 0.02), activations O(1)
            fp8_state = jax.tree.map(lambda a: a, fp8_state)
            for lin in fp8_state["blocks"].values():
                lin["kernel"]["scale"] = jnp.full_like(lin["kernel"]["scale"], 448.0 / 0.1)
                lin["x"]["scale"] = jnp.full_like(lin["x"]["scale"], 448.0 / 8.0)
        kv_scales = kvq.init_kv_scales(cfg.num_layers) if precision.kv_fp8 else None
        for new in new_tokens:
            for batch in batches:
                engine_config = EngineConfig(max_concurrent_decodes=batch, max_prefill_length=prompt_len,
                                             max_new_tokens=new, sampling=SamplingParams())
                engine = Engine(cfg, precision, engine_config)
                p = engine.load_params(params, fp8_state, kv_scales)
                state = engine.init_decode_state()
                prompt = np.arange(1, prompt_len + 1, dtype=np.int32) % cfg.vocab_size
                prefix = engine.prefill(p, prompt, prompt_len, jax.random.PRNGKey(1))
                for slot in range(batch):
                    state = engine.insert(prefix, state, slot, jax.random.PRNGKey(slot))
                jax.block_until_ready(state)
                # the first chunk compiles the loop; time the rest
                state = engine.generate_steps(p, state, chunk)[0]
                jax.block_until_ready(state)
                steps = new - 1 - chunk  # the first token came from the prefill
                t = time.perf_counter()
                for _ in range(steps // chunk):
                    state = engine.generate_steps(p, state, chunk)[0]
                jax.block_until_ready(state)
                sec = time.perf_counter() - t
                done_steps = (steps // chunk) * chunk
                tok_s = batch * done_steps / sec
                weight_bytes = _weight_bytes(cfg, precision)
                kv_bytes_per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (1 if precision.kv_fp8 else 2)
                avg_ctx = prompt_len + chunk + done_steps / 2
                step_bytes = weight_bytes + batch * avg_ctx * kv_bytes_per_pos
                bound_tok_s = batch / (step_bytes / bw)
                rows.append({"batch": batch, "new_tokens": new, "mode": mode, "tokens_per_s": round(tok_s, 1),
                             "hbm_bound_tokens_per_s": round(bound_tok_s, 1),
                             "hbm_bound_fraction": round(tok_s / bound_tok_s, 3), "model": model_name,
                             "ms_per_step": round(1e3 * sec / done_steps, 3)})
                print(json.dumps(rows[-1]), flush=True)
                del state, p, engine
    return rows


def _weight_bytes(cfg, precision) -> float:
    blocks = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    head = cfg.vocab_size * cfg.hidden_size * 2  # the head reads the whole table each step (BF16)
    return blocks * (1 if precision.fp8 else 2) + head


# ----------------------------------------------------------------------------------------------------------
# agreement: how far the sampler's logprobs are from the trainer's, and each precision from f32


def bench_agreement(num: int, completion_tokens: int, precisions: list[str]) -> list[dict]:
    """Teacher-forced on GSM8K test problems with their reference solutions, SmolLM2-135M-Instruct:

    - ``decode_vs_full``: |log p| of each solution token from the rollout path (bucketed prefill, then one
      token per step against the KV cache, pre-quantized FP8 weights) against the scoring forward (full
      sequence): the sampler/trainer mismatch that the IS correction has to absorb;
    - ``vs_f32``: |log p| of the scoring forward in this precision against the f32 model.
    FP8 scales come from one calibration pass over the same sequences.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.data.gsm8k import default_gsm8k_path, load_gsm8k
    from fp8rl_jax.fp8 import kv as kvq
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.rollout.weights import rollout_params
    from fp8rl_jax.fp8.recipe import update_state
    from fp8rl_jax.model import assets, llama, weights
    from fp8rl_jax.model.tokenizer import Tokenizer
    from fp8rl_jax.rl.scoring import token_logprobs
    from fp8rl_jax.rollout.engine import prefill_bucket

    path = assets.smollm2_gguf()
    cfg, params = weights.load_gguf(path)
    tok = Tokenizer.from_gguf(path)
    problems = load_gsm8k(default_gsm8k_path("test"))[:num]
    seqs = [(tok.encode_chat([{"role": "user", "content": p.question}]), tok.encode(p.solution)[:completion_tokens])
            for p in problems]
    width = max(len(a) + len(b) for a, b in seqs)
    batch = jnp.asarray([a + b + [0] * (width - len(a) - len(b)) for a, b in seqs], jnp.int32)
    f32 = Precision(compute_dtype="float32")
    ref = np.asarray(token_logprobs(params, batch, config=cfg, precision=f32)[0])
    kinds = {
        "bf16": Precision(),
        "fp8": Precision(backend="xla"),
        "fp8_bf16_down": Precision(backend="xla", bf16_linears=("w_down",)),
        "fp8_kv": Precision(backend="xla", kv_cache_dtype="float8_e4m3fn"),
    }
    rows = []
    for name in precisions:
        prec = kinds[name]
        state = llama.init_fp8_state(cfg, prec) if prec.fp8 else None
        kv_scales = kvq.init_kv_scales(cfg.num_layers) if prec.kv_fp8 else None
        if prec.fp8:
            grad = jax.grad(lambda s, p, kv: llama.forward(params, batch, config=cfg, precision=p, fp8_state=s,
                                                           kv_scales=kv)[0].sum())
            state = update_state(state, grad(state, prec, kv_scales), prec.recipe)
        if prec.kv_fp8:
            kv_amax = llama.forward(params, batch, config=cfg, precision=prec, fp8_state=state, kv_scales=kv_scales)[2]
            kv_scales = kvq.scales_from_amax(kv_amax)
        full = np.asarray(token_logprobs(params, batch, config=cfg, precision=prec, fp8_state=state,
                                         kv_scales=kv_scales)[0])
        rp = jax.jit(lambda p, s, prec=prec: rollout_params(p, s, prec, cfg.num_layers))(params, state)

        @functools.partial(jax.jit, static_argnums=0)
        def step(prec, rp, state, kv_scales, t, pos, cache):
            return llama.forward(rp, t, pos, config=cfg, precision=prec, fp8_state=state, kv_scales=kv_scales,
                                 cache=cache)[:2]

        decode_d, f32_d = [], []
        for i, (prompt, sol) in enumerate(seqs):
            bucket = prefill_bucket(len(prompt), 1024)
            cache = llama.init_cache(cfg, 1, bucket + len(sol), llama.cache_dtype(prec))
            padded = np.zeros((1, bucket), np.int32)
            padded[0, : len(prompt)] = prompt
            logits, cache = step(prec, rp, state, kv_scales, jnp.asarray(padded), jnp.arange(bucket)[None], cache)
            got = [jax.nn.log_softmax(logits[0, len(prompt) - 1])[sol[0]]]
            for j in range(len(sol) - 1):
                logits, cache = step(prec, rp, state, kv_scales, jnp.asarray([[sol[j]]]),
                                     jnp.asarray([[len(prompt) + j]]), cache)
                got.append(jax.nn.log_softmax(logits[0, 0])[sol[j + 1]])
            span = slice(len(prompt), len(prompt) + len(sol))
            decode_d.append(np.abs(full[i, span] - np.asarray(got)))
            f32_d.append(np.abs(full[i, span] - ref[i, span]))
        d, e = np.concatenate(decode_d), np.concatenate(f32_d)
        rows.append({"precision": name, "tokens": int(d.size), "decode_vs_full_mean": float(d.mean()),
                     "decode_vs_full_p99": float(np.quantile(d, 0.99)), "decode_vs_full_max": float(d.max()),
                     "vs_f32_mean": float(e.mean()), "vs_f32_p99": float(np.quantile(e, 0.99))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------------
# tables for benchmarks/RESULTS.md


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fp8rl_jax.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gemm")
    g.add_argument("--ms", default="64,256,1024,16384")
    g.add_argument("--paths", default="bf16,xla_fp8,te_fp8,xla_fp8_prequant,te_fp8_prequant")
    g.add_argument("--tag", default="")
    g.add_argument("--cublas_child", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--smoke", action="store_true")
    g.add_argument("--out", default="")
    r = sub.add_parser("rollout")
    r.add_argument("--model", default="llama3_1b")
    r.add_argument("--batches", default="64,256")
    r.add_argument("--new_tokens", default="1024,4096")
    r.add_argument("--modes", default="bf16,fp8,fp8_kv")
    r.add_argument("--prompt_len", type=int, default=64)
    r.add_argument("--chunk", type=int, default=64)
    r.add_argument("--smoke", action="store_true")
    r.add_argument("--out", default="")
    a = sub.add_parser("agreement", help="rollout-vs-scoring logprob agreement and error vs f32 (SmolLM2, GSM8K)")
    a.add_argument("--num", type=int, default=6)
    a.add_argument("--completion_tokens", type=int, default=64)
    a.add_argument("--precisions", default="bf16,fp8,fp8_bf16_down,fp8_kv")
    a.add_argument("--out", default="")
    t = sub.add_parser("table", help="markdown tables of result files (gemm_*.json, rollout_*.json)")
    t.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    from fp8rl_jax.fp8 import te

    te.preload()  # before JAX starts its GPU backend (see fp8rl_jax.fp8.te)
    if args.cmd == "table":
        for path in args.files:
            with open(path) as f:
                rows = json.load(f)
            if "M" in rows[0]:
                print(gemm_table(rows), end="\n\n")
            elif "batch" in rows[0]:
                print(rollout_table(rows), end="\n\n")
            else:
                print(agreement_table(rows), end="\n\n")
        return

    if args.cmd == "gemm":
        args.out = args.out or f"gemm_{int(time.time())}.json"
        rows = run_gemm(args)
    elif args.cmd == "agreement":
        rows = bench_agreement(args.num, args.completion_tokens, args.precisions.split(","))
        args.out = args.out or f"agreement_{int(time.time())}.json"
    else:
        if args.smoke:
            args.model, args.batches, args.new_tokens, args.prompt_len, args.chunk = "tiny", "4", "9", 16, 4
        rows = bench_rollout(args.model, [int(b) for b in args.batches.split(",")],
                             [int(n) for n in args.new_tokens.split(",")], args.modes.split(","), args.prompt_len,
                             args.chunk, copy_gib=0.01 if args.smoke else 2.0)
        args.out = args.out or f"rollout_{int(time.time())}.json"
    meta = {"device": _device_name()}
    for row in rows:
        row.setdefault("device", meta["device"])
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
