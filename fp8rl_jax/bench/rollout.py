"""``bench rollout``: decode throughput of the rollout engine against the HBM bound (``fp8rl_jax.bench``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from fp8rl_jax.bench import timeit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--new_tokens", default="1024,4096")
    parser.add_argument("--modes", default="bf16,fp8,fp8_kv")
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--options", default="auto",
                        help="the engine's compiler_options, comma-separated: auto (the decode options), none")
    parser.add_argument("--layer_loops", default="auto", help="the engine's layer_loop: auto, scan, unrolled")
    parser.add_argument("--decode_tuning", default="default",
                        help="the decode kernel's launch rules, comma-separated: default (DecodeTuning()'s) or "
                             "max_block_k:target_programs:num_stages (a DecodeTuning with these), e.g. 128:2048:2")
    parser.add_argument("--variants", default="default",
                        help="comma-separated: default, or '+'-joined forms to run instead: one_head_per_program "
                             "(the decode kernel's programs of one kv head at every batch: DecodeTuning "
                             "heads_per_program=1), residual_add_kernels (TE's FP8 GEMM for wo and w_down, then XLA's "
                             "residual add: precision.residual_in_gemm off); e.g. "
                             "default,one_head_per_program+residual_add_kernels")
    parser.add_argument("--profile", action="store_true",
                        help="also trace one chunk: kernel and idle time per step, top kernels")
    parser.add_argument("--smoke", action="store_true")


def run(args) -> list[dict]:
    if args.smoke:
        args.model, args.batches, args.new_tokens, args.prompt_len, args.chunk = "tiny", "4", "9", 16, 4
    return bench_rollout(args.model, [int(b) for b in args.batches.split(",")],
                         [int(n) for n in args.new_tokens.split(",")], args.modes.split(","), args.prompt_len,
                         args.chunk, copy_gib=0.01 if args.smoke else 2.0, options=args.options.split(","),
                         layer_loops=args.layer_loops.split(","), profile=args.profile,
                         decode_tunings=args.decode_tuning.split(","), variants=args.variants.split(","))


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device copy bandwidth in bytes/s (bytes read + bytes written), measured with a large elementwise op."""
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x: x * jnp.bfloat16(1.0009765625))
    return 2 * n * 2 / timeit(f, x, repeats=20)


def bench_rollout(model_name: str, batches: list[int], new_tokens: list[int], modes: list[str], prompt_len: int,
                  chunk: int, copy_gib: float = 2.0, options: tuple[str, ...] = ("auto",),
                  layer_loops: tuple[str, ...] = ("auto",), profile: bool = False,
                  decode_tunings: tuple[str, ...] = ("default",),
                  variants: tuple[str, ...] = ("default",)) -> list[dict]:
    import itertools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.fp8 import kv as kvq
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.config import preset
    from fp8rl_jax.rollout.engine import Engine, EngineConfig
    from fp8rl_jax.rollout.sampling import SamplingParams

    for tuning, variant in itertools.product(decode_tunings, variants):  # bad names fail before any work
        variant_values(Precision(), tuning, variant)
    for mode in modes:
        mode_precision(mode)
    cfg = preset(model_name)
    # BF16 master weights: the rollout weights come from them as from f32 ones, and an 8B model's f32 copy (32 GB)
    # would crowd out the rollout's own memory on one GPU
    params = llama.init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    bw = copy_bandwidth(copy_gib)
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for mode in modes:
        precision = mode_precision(mode)
        head = precision.lm_head_fp8
        fp8_state = llama.init_fp8_state(cfg, precision) if precision.fp8 else None
        if fp8_state is not None:  # plausible scales: weights ~N(0, 0.02), activations O(1)
            fp8_state = jax.tree.map(lambda a: a, fp8_state)
            for lin in [*fp8_state["blocks"].values(), *([fp8_state["lm_head"]] if head else [])]:
                lin["kernel"]["scale"] = jnp.full_like(lin["kernel"]["scale"], 448.0 / 0.1)
                lin["x"]["scale"] = jnp.full_like(lin["x"]["scale"], 448.0 / 8.0)
        kv_scales = kvq.init_kv_scales(cfg.num_layers) if precision.kv_fp8 else None
        for new, batch, option, layer_loop, tuning, variant in itertools.product(
                new_tokens, batches, options, layer_loops, decode_tunings, variants):
            run_precision, decode_tuning, engine_fields = variant_values(precision, tuning, variant)
            engine_config = EngineConfig(max_concurrent_decodes=batch, max_prefill_length=prompt_len,
                                         max_new_tokens=new, sampling=SamplingParams(), compiler_options=option,
                                         layer_loop=layer_loop, decode_tuning=decode_tuning, **engine_fields)
            engine = Engine(cfg, run_precision, engine_config)
            p = engine.load_params(params, fp8_state, kv_scales)
            state = engine.init_decode_state()
            prompt = np.arange(1, prompt_len + 1, dtype=np.int32) % cfg.vocab_size
            jax.block_until_ready(engine.prefill(p, prompt, prompt_len, jax.random.PRNGKey(1)))  # compiles
            t = time.perf_counter()
            prefix = jax.block_until_ready(engine.prefill(p, prompt, prompt_len, jax.random.PRNGKey(1)))
            prefill_ms = 1e3 * (time.perf_counter() - t)
            state = jax.block_until_ready(engine.insert(prefix, state, 0, jax.random.PRNGKey(0)))  # compiles
            insert_temp = _temp_bytes(engine._insert, prefix, state, 0, jax.random.PRNGKey(0))
            singles = range(1, min(batch, 9))  # a few one-slot inserts, then the rest in one insert_samples call
            t = time.perf_counter()
            for slot in singles:
                state = engine.insert(prefix, state, slot, jax.random.PRNGKey(slot))
            jax.block_until_ready(state)
            insert_ms = 1e3 * (time.perf_counter() - t) / max(len(singles), 1)
            rest = list(range(len(singles) + 1, batch))
            samples_ms = None
            if rest:
                keys = jnp.stack([jax.random.PRNGKey(slot) for slot in rest])
                state = jax.block_until_ready(engine.insert_samples(prefix, state, rest, keys))  # compiles
                t = time.perf_counter()  # the same slots again
                state = jax.block_until_ready(engine.insert_samples(prefix, state, rest, keys))
                samples_ms = round(1e3 * (time.perf_counter() - t), 3)
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
                         # three significant digits: a loaded CPU's tiny fraction is not rounded to 0
                         "hbm_bound_fraction": float(f"{tok_s / bound_tok_s:.3g}"), "model": model_name,
                         "ms_per_step": round(1e3 * sec / done_steps, 3), "compiler_options": option,
                         "layer_loop": layer_loop, "decode_tuning": tuning, "variant": variant,
                         "prefill_ms": round(prefill_ms, 3),
                         "insert_ms": round(insert_ms, 3),
                         "insert_temp_bytes": insert_temp, "insert_samples_slots": len(rest),
                         "insert_samples_ms": samples_ms})
            print(json.dumps(rows[-1]), flush=True)
            if profile:  # one more chunk, traced (the cache is fuller than the timed average: late in the rollout)
                rows[-1]["profile"] = _profile_chunk(engine, p, state, chunk)
                print(json.dumps({k: v for k, v in rows[-1]["profile"].items() if k != "top"}), flush=True)
            del state, p, engine
    return rows


# ``--variants``' forms, each a value: the engine's precision with these fields replaced, or its decode tuning
PRECISION_FORMS = {"residual_add_kernels": {"residual_in_gemm": False}}
RECIPE_FORMS = {"cublaslt_gemms": {"block_gemm": "cublaslt"}, "mosaic_gemms": {"block_gemm": "mosaic"}}
TUNING_FORMS = {"one_head_per_program": {"heads_per_program": 1}}
ENGINE_FORMS = {"unrolled_steps": {"step_loop": "unrolled"}}


def parse_decode_tuning(text: str):
    """``--decode_tuning``'s ``default`` or ``max_block_k:target_programs:num_stages`` as a ``DecodeTuning``."""
    from fp8rl_jax.kernels.decode_attention import DecodeTuning

    if text == "default":
        return DecodeTuning()
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--decode_tuning: {text!r} is not 'default' or max_block_k:target_programs:num_stages")
    max_block_k, target_programs, num_stages = map(int, parts)
    return DecodeTuning(max_block_k=max_block_k, target_programs=target_programs, num_stages=num_stages)


def mode_precision(mode: str):
    """``--modes``' ``mode`` as the ``Precision`` its rows run: ``bf16``, ``fp8`` or ``fp8_kv`` (FP8 GEMMs, and the FP8
    KV cache), with ``_te`` (Transformer Engine's GEMMs), ``_head`` (the LM head in FP8 too) or ``_block`` (block
    scaling, E4M3: ``kernels.block_gemm`` on a Hopper GPU), e.g. ``fp8_kv_te_head``, ``fp8_kv_block``."""
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.fp8.recipe import Fp8Recipe

    parts = mode.split("_")
    base = "_".join(p for p in parts if p not in ("te", "head", "block"))
    if base not in ("bf16", "fp8", "fp8_kv") or (base == "bf16" and len(parts) > 1) or {"te", "block"} <= set(parts):
        raise ValueError(f"--modes: unknown mode {mode!r}; known: bf16, fp8, fp8_kv, with _te, _head or _block "
                         "(block scaling runs on the xla backend, not with _te)")
    if base == "bf16":
        return Precision()
    precision = Precision(backend="te" if "te" in parts else "xla", lm_head_fp8="head" in parts)
    if "block" in parts:
        precision = precision.replace(recipe=Fp8Recipe(scaling="block", fp8_format="e4m3"))
    return precision.replace(kv_cache_dtype="float8_e4m3fn") if base == "fp8_kv" else precision


def variant_values(precision, tuning: str, variant: str):
    """The (precision, ``DecodeTuning``, ``EngineConfig`` fields) a row runs under: ``--decode_tuning``'s ``tuning``
    with the '+'-joined forms of ``variant`` (``PRECISION_FORMS``, ``RECIPE_FORMS`` (block scaling's GEMMs),
    ``TUNING_FORMS``, ``ENGINE_FORMS``) applied."""
    decode_tuning, engine = parse_decode_tuning(tuning), {}
    for form in variant.split("+") if variant != "default" else ():
        if form in PRECISION_FORMS:
            precision = precision.replace(**PRECISION_FORMS[form])
        elif form in RECIPE_FORMS:
            precision = precision.replace(recipe=dataclasses.replace(precision.recipe, **RECIPE_FORMS[form]))
        elif form in TUNING_FORMS:
            decode_tuning = dataclasses.replace(decode_tuning, **TUNING_FORMS[form])
        elif form in ENGINE_FORMS:
            engine.update(ENGINE_FORMS[form])
        else:
            raise ValueError(f"--variants: unknown form {form!r}; known: default, "
                             f"{', '.join([*PRECISION_FORMS, *RECIPE_FORMS, *TUNING_FORMS, *ENGINE_FORMS])}")
    return precision, decode_tuning, engine


def _temp_bytes(jitted, *args) -> int | None:
    """Scratch bytes XLA allocates for one call of ``jitted`` (None where the backend does not say)."""
    import jax.numpy as jnp

    args = tuple(jnp.int32(a) if isinstance(a, int) else a for a in args)
    stats = jitted.lower(*args).compile().memory_analysis()
    return getattr(stats, "temp_size_in_bytes", None)


def _profile_chunk(engine, params, state, chunk: int) -> dict:
    """One ``generate_steps`` chunk under ``jax.profiler``: kernel, busy and idle milliseconds per decode step."""
    from fp8rl_jax.bench.trace import trace_one_call

    summary = trace_one_call(engine.generate_steps, params, state, chunk, top=40)
    if "error" in summary:
        return summary
    per_step = {f"{k}_per_step": round(summary[k] / chunk, 4)
                for k in ("total_kernel_ms", "span_ms", "busy_ms", "idle_ms", "kernels")}
    return {**per_step, "families": summary["families"], "idle_between": summary["idle_between"][:4],
            "top": summary["top"]}


def _weight_bytes(cfg, precision) -> float:
    blocks = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    # the head reads the whole table each step, in BF16 unless lm_head_fp8
    head = cfg.vocab_size * cfg.hidden_size * (1 if precision.lm_head_fp8 else 2)
    return blocks * (1 if precision.fp8 else 2) + head
