"""``bench agreement``: how far the sampler's logprobs are from the trainer's, and each precision from f32.

Teacher-forced on GSM8K test problems with their reference solutions, SmolLM2-135M-Instruct:

- ``decode_vs_full``: |log p| of each solution token from the rollout path (the rollout ``Engine``: pre-quantized
  FP8 weights, the prompt prefilled in its bucket, then one token per step against the KV cache, batch 1) against
  the scoring forward (``rl.scoring.token_logprobs`` over the full sequence): the sampler/trainer mismatch that
  the IS correction has to absorb;
- the same mismatch as the trainer's metrics name it (``rl.metrics.mismatch_metrics``: KL k1 / k3,
  ``token_mult_prob_error``, chi2) and the spread of the per-token importance weights exp(scoring - rollout);
- ``vs_f32``: |log p| of the scoring forward in this precision against the f32 model.

A variant named ``<precision>_exact`` (``fp8_te_exact``) takes the exact sampler's path (``rollout.exact``,
``rollout/exact.py``) for the rollout instead: each token's logprob from the scoring forward over the whole batch
with that token and the ones after it replaced by padding, as the exact sampler computes it when it draws.

FP8 scales come from one calibration pass over the same sequences (``rl.step.make_calibrate``, as the trainer
calibrates before its first rollout), and FP8 KV-cache scales from a second pass under those FP8 scales.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, update_state
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.rl.metrics import mismatch_metrics
from fp8rl_jax.rl.scoring import token_logprobs
from fp8rl_jax.rl.step import jit_head_program, make_calibrate, make_score
from fp8rl_jax.rollout.engine import DecodeState, Engine, EngineConfig, prefill_bucket
from fp8rl_jax.rollout.exact import sample_next_token
from fp8rl_jax.rollout.sampling import SamplingParams

PRECISIONS = {
    "bf16": Precision(),
    "fp8": Precision(backend="xla"),
    "fp8_bf16_down": Precision(backend="xla", bf16_linears=("w_down",)),
    "fp8_kv": Precision(backend="xla", kv_cache_dtype="float8_e4m3fn"),
    # FP8 GEMMs, everything between them (activations, attention, KV cache) in f32
    "fp8_f32": Precision(backend="xla", compute_dtype="float32"),
    # Transformer Engine's GEMMs (GPU only), the trainer's default backend there
    "fp8_te": Precision(backend="te"),
    # the GPU rollout's FP8 + FP8 KV (``bench rollout``'s fp8_kv_te; configs/llama1b.py and llama8b.py)
    "fp8_kv_te": Precision(backend="te", kv_cache_dtype="float8_e4m3fn"),
    # the LM head in FP8 too (precision.lm_head_fp8): its logprob error on top of the blocks'
    "fp8_head": Precision(backend="xla", lm_head_fp8=True),
    # per-token x per-output-channel current scales in the forward (precision.scaling=rowwise)
    "fp8_rowwise": Precision(backend="xla", recipe=Fp8Recipe(scaling="rowwise")),
    # 1 x 128 activation tiles and 128 x 128 weight blocks, E4M3 both ways (precision.scaling=block)
    "fp8_block": Precision(backend="xla", recipe=Fp8Recipe(scaling="block", fp8_format="e4m3")),
}
MAX_PREFILL = 1024  # prompts longer than this are an error
EXACT = "_exact"  # a variant's suffix: the rollout is the exact sampler's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num", type=int, default=6)
    parser.add_argument("--completion_tokens", type=int, default=64)
    # Transformer Engine's (fp8_te, fp8_kv_te): GPU only, so not by default
    parser.add_argument("--precisions", default=",".join(n for n, p in PRECISIONS.items() if p.backend != "te"))


def run(args) -> list[dict]:
    from fp8rl_jax.data.gsm8k import default_gsm8k_path, load_gsm8k
    from fp8rl_jax.model import assets, weights
    from fp8rl_jax.model.tokenizer import Tokenizer

    unknown = [p for p in args.precisions.split(",") if p.removesuffix(EXACT) not in PRECISIONS]
    if unknown:
        raise SystemExit(f"--precisions: {unknown} unknown; allowed: {', '.join(PRECISIONS)}, each with or without "
                         f"{EXACT}")
    path = assets.smollm2_gguf()
    model, params = weights.load_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    problems = load_gsm8k(default_gsm8k_path("test"))[: args.num]
    sequences = [(tokenizer.encode_chat([{"role": "user", "content": p.question}]),
                  tokenizer.encode(p.solution)[: args.completion_tokens]) for p in problems]
    return bench_agreement(model, params, sequences,
                           {name: PRECISIONS[name.removesuffix(EXACT)] for name in args.precisions.split(",")})


class TeacherForcedEngine(Engine):
    """The rollout engine fed the given tokens instead of its own samples: ``forced_step`` runs the engine's decode
    forward and head on its rollout weights and KV cache, and returns log pi_T over the vocabulary."""

    def __init__(self, model: LlamaConfig, precision: Precision, config: EngineConfig):
        super().__init__(model, precision, config)
        self._forced_step = jax.jit(self._forced_step_impl, donate_argnums=(1,))

    def forced_step(self, params: dict, decode_state: DecodeState, tokens: jax.Array):
        """Feed ``tokens`` [B] at each slot's position: (state one position on, logp [B, V] of the next token)."""
        return self._forced_step(params, decode_state, jnp.asarray(tokens, jnp.int32))

    def _forced_step_impl(self, params, state: DecodeState, tokens):
        hidden, cache, _ = self._forward(params, tokens[:, None], state.positions[:, None], state.cache)
        logits = self._logits(params, hidden[:, 0])  # [B, V]
        state = dataclasses.replace(state, cache=cache, tokens=tokens, positions=state.positions + 1)
        return state, jax.nn.log_softmax(logits / self.config.sampling.temperature, axis=-1)


def rollout_logprobs(engine: TeacherForcedEngine, params: dict, prompt: list[int], completion: list[int]) -> np.ndarray:
    """log pi_T of each ``completion`` token as the sampler sees it: the prompt prefilled, then one token per step."""
    padded = np.zeros(prefill_bucket(len(prompt), engine.max_prefill_length), np.int32)
    padded[: len(prompt)] = prompt
    prefix = engine.prefill(params, padded, len(prompt), jax.random.PRNGKey(0))
    got = [jax.nn.log_softmax(prefix.logits / engine.config.sampling.temperature)[completion[0]]]
    state = engine.insert(prefix, engine.init_decode_state(), 0)
    for token, following in zip(completion[:-1], completion[1:], strict=True):
        state, logp = engine.forced_step(params, state, [token])
        got.append(logp[0, following])
    return np.asarray(jax.device_get(got), np.float32)


def exact_logprobs(model: LlamaConfig, precision: Precision, params: dict, fp8_state, kv_scales, batch: jax.Array,
                   sequences: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """log pi_T of each completion token as the exact sampler computes it when it draws that token: the scoring
    forward over the whole ``batch`` [N, T] with the token and every one after it replaced by padding (0)."""
    step = jit_head_program(lambda tokens, at, forced: sample_next_token(
        params, tokens, at, jax.random.split(jax.random.PRNGKey(0), len(at)), config=model, precision=precision,
        sampling=SamplingParams(), fp8_state=fp8_state, kv_scales=kv_scales, forced=forced)[1], precision)
    n, width = batch.shape
    starts = np.asarray([len(prompt) for prompt, _ in sequences])
    steps = max(len(completion) for _, completion in sequences)
    got = np.zeros((n, steps), np.float32)
    for g in range(steps):
        at = np.minimum(starts + g, width - 1)
        hidden_from = jnp.arange(width)[None, :] >= jnp.asarray(at)[:, None]
        got[:, g] = np.asarray(step(jnp.where(hidden_from, 0, batch), jnp.asarray(at), batch[jnp.arange(n), at]))
    return [got[i, : len(completion)] for i, (_, completion) in enumerate(sequences)]


def calibrated(model: LlamaConfig, precision: Precision, params: dict, tokens: jax.Array):
    """``(fp8_state, kv_scales)`` for ``precision`` from calibration passes over ``tokens`` (None where unused)."""
    fp8_state = llama.init_fp8_state(model, precision) if precision.fp8 else None
    kv_scales = kvq.init_kv_scales(model.num_layers) if precision.kv_fp8 else None
    calibrate = make_calibrate(model, precision)
    if precision.fp8:
        observations, _ = calibrate(params, fp8_state, kv_scales, tokens)
        fp8_state = update_state(fp8_state, observations, precision.recipe)
    if precision.kv_fp8:
        _, kv_scales = calibrate(params, fp8_state, kv_scales, tokens)  # K/V as the calibrated FP8 layers make them
    return fp8_state, kv_scales


def bench_agreement(model: LlamaConfig, params: dict, sequences: list[tuple[list[int], list[int]]],
                    precisions: dict[str, Precision]) -> list[dict]:
    """One row per precision: |dlogp| of the completions, rollout path against scoring, and scoring against f32.

    ``sequences``: (prompt, completion) token lists, teacher-forced."""
    # a multiple of 16: Transformer Engine's FP8 GEMMs need their contracting sizes so (the calibration's weight
    # gradient contracts over the B * T tokens); padding after the last token changes no earlier logprob
    width = -(-max(len(a) + len(b) for a, b in sequences) // 16) * 16
    batch = jnp.asarray([a + b + [0] * (width - len(a) - len(b)) for a, b in sequences], jnp.int32)
    ref = np.asarray(token_logprobs(params, batch, config=model, precision=Precision(compute_dtype="float32"))[0])
    max_prefill = max(prefill_bucket(len(prompt), MAX_PREFILL) for prompt, _ in sequences)
    rows = []
    for name, precision in precisions.items():
        fp8_state, kv_scales = calibrated(model, precision, params, batch)
        # the trainer's scoring program (jitted: an op-by-op forward rounds differently from any compiled one)
        full = np.asarray(make_score(model, precision, 1.0)(params, fp8_state, kv_scales, batch))
        if name.endswith(EXACT):
            sampler = exact_logprobs(model, precision, params, fp8_state, kv_scales, batch, sequences)
        else:
            engine = TeacherForcedEngine(model, precision, EngineConfig(
                max_concurrent_decodes=1, max_prefill_length=max_prefill,
                max_new_tokens=max(len(completion) for _, completion in sequences), sampling=SamplingParams()))
            engine_params = engine.load_params(params, fp8_state, kv_scales)
            sampler = [rollout_logprobs(engine, engine_params, prompt, completion) for prompt, completion in sequences]
        trainer, f32_d = [], []  # per token of the completions
        for i, (prompt, completion) in enumerate(sequences):
            span = slice(len(prompt), len(prompt) + len(completion))
            trainer.append(full[i, span])
            f32_d.append(np.abs(full[i, span] - ref[i, span]))
        sampler, trainer, e = np.concatenate(sampler), np.concatenate(trainer), np.concatenate(f32_d)
        d, w = np.abs(trainer - sampler), np.exp(trainer - sampler)  # w: the per-token IS weight
        rows.append({"precision": name, "tokens": int(d.size), "decode_vs_full_mean": float(d.mean()),
                     "decode_vs_full_p99": float(np.quantile(d, 0.99)), "decode_vs_full_max": float(d.max()),
                     # the mismatch as the trainer's metrics report it (KL estimators, token_mult_prob_error, chi2)
                     **{k: float(v) for k, v in mismatch_metrics(jnp.asarray(sampler), jnp.asarray(trainer),
                                                                 jnp.ones(d.shape, bool)).items()},
                     "is_weight_std": float(w.std()), "is_weight_min": float(w.min()), "is_weight_max": float(w.max()),
                     "vs_f32_mean": float(e.mean()), "vs_f32_p99": float(np.quantile(e, 0.99))})
        print(json.dumps(rows[-1]), flush=True)
    return rows
