"""The exact sampler (``rollout.exact``): every token drawn by the trainer's own scoring forward.

The KV-cache engine (``engine.py``) is fast, but its arithmetic is not the trainer's: one-token decode GEMMs and
attention over a cache against the scoring forward's [B * T]-row GEMMs and full causal attention. Rounding the two
differently is harmless in BF16 and is not in FP8, where every quantizer turns a last-bit difference into an FP8
step; the rollout's logprobs end up 0.17 nats per token from the trainer's on SmolLM2 (docs/accuracy.md).

This sampler runs no other arithmetic than the trainer's. At every step it runs ``sample_next_token``:
the scoring forward over the whole [microbatch, T] batch, with the trainer's master weights, FP8 state, KV scales
and precision, T fixed for the whole rollout, then the head's chunk GEMM, and draws each row's next token from
those logits. The trainer scores the finished sequences at the same [microbatch, T] shape (``RolloutBatch.width``),
so by causality it computes the very logits each token was drawn from.

Measured (tests/rollout/test_exact.py, docs/accuracy.md): the rollout's logprobs equal the scoring program's bit
for bit on CPU and on the H100 (BF16, XLA FP8, TE FP8). The train step's forward is a third program, a gradient
one: equal on CPU (with ``CPU_XLA_FLAG``); on the GPU XLA rounds some op of it differently, which FP8 amplifies
(0.13 nats per token on SmolLM2), so there the mismatch is reduced four-fold, not removed.

The price is compute: each new token costs a full forward of its microbatch, O(T) forwards per sequence instead
of one, and no KV cache. It is meant for short completions, for studies, and as the reference the fast engine is
measured against. Every sequence draws with its own key, ``fold_in(rng, row)``, split once per token.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fp8.linear import mesh_context
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import fp8_heads, heads, llama
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.parallel.distributed import host_get
from fp8rl_jax.rl.microbatch import ROW_MULTIPLE, row_width  # the trainer's widths: few shapes to compile
from fp8rl_jax.rl.step import jit_head_program
from fp8rl_jax.rollout.driver import RolloutBatch
from fp8rl_jax.rollout.sampling import SamplingParams, sample
from fp8rl_jax.xla_options import CPU_XLA_FLAG


def cpu_flag_missing() -> bool:
    """True on the CPU backend without ``CPU_XLA_FLAG`` in ``XLA_FLAGS``: programs of other shapes round apart there
    (the exact sampler is 1 ulp off; the packed and unpacked layouts score apart)."""
    return jax.default_backend() == "cpu" and CPU_XLA_FLAG not in os.environ.get("XLA_FLAGS", "")


def cpu_flag_note(exact: bool) -> str | None:
    """What a trainer says at its start where ``cpu_flag_missing``, ``exact`` where its rollouts are this module's;
    None elsewhere."""
    if not cpu_flag_missing():
        return None
    if exact:
        return (f"rollout.exact on XLA:CPU: set XLA_FLAGS={CPU_XLA_FLAG} before starting for bit-for-bit agreement "
                "(without it a few percent of the logprobs are 1 ulp off)")
    # programs of other shapes round apart
    return (f"XLA:CPU without XLA_FLAGS={CPU_XLA_FLAG}: packed and unpacked microbatches and the sampler round the "
            "attention softmax apart (FP8 amplifies it), so mismatch_* and the IS weights depend on the layout; set "
            "it before starting")


def sequence_width(prompt_lengths, max_new_tokens: int, multiple: int = ROW_MULTIPLE) -> int:
    """The fixed [rows, T] width of an exact rollout: the longest prompt plus ``max_new_tokens``, rounded up."""
    return row_width(max(prompt_lengths) + max_new_tokens, multiple)


def sample_next_token(
    params: dict,
    tokens: jax.Array,
    at: jax.Array,
    keys: jax.Array,
    *,
    config: LlamaConfig,
    precision: Precision,
    sampling: SamplingParams,
    fp8_state: dict | None = None,
    kv_scales: dict | None = None,
    chunk: int = heads.HEAD_CHUNK,
    forced: jax.Array | None = None,
):
    """Draw ``tokens[b, at[b]]`` from pi_T given ``tokens[b, :at[b]]``, with ``token_logprobs``'s own arithmetic.

    tokens [B, T] right-padded (what stands at ``at`` and after it does not matter), at [B] in [1, T), keys [B]
    (one PRNG key per row). The whole [B, T] batch runs through the scoring forward, and the head's GEMM is the
    [B, C, V] GEMM of the chunk that holds position ``at - 1``, exactly as ``token_logprobs`` computes them for a
    [B, T] batch. Causal attention gives a position nothing from the ones after it (their weights are exact
    zeros), so ``token_logprobs`` of the finished sequences, at this shape, sees the same logits at ``at - 1``:
    the sampler's distribution and logprob are the scorer's, bit for bit, as long as the two XLA programs round
    alike (``rollout.exact``; ``tests/rollout/test_exact.py`` checks it: they do, on CPU and GPU).

    Returns ``(token [B] int32, logp [B] f32)``; ``logp`` is the token's ``log pi_T`` by the scoring head's
    formula. ``sampling.temperature`` is pi_T's T; top-k / top-p / greedy choose the token as ``sample`` does.
    ``forced`` [B]: take these tokens instead of drawing (teacher forcing, ``bench agreement``); ``keys`` unused.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _, _ = llama.forward_hidden(params, tokens, positions, config=config, precision=precision,
                                        fp8_state=fp8_state, kv_scales=kv_scales)
    hidden = hidden[:, :-1]  # position t - 1 predicts token t, as in token_logprobs
    c = min(chunk, t - 1)
    rows = jnp.arange(b)
    k, r = (at - 1) // c, (at - 1) % c  # the chunk that holds position at - 1, and its place in it
    head_state = fp8_state.get("lm_head") if (fp8_state is not None and precision.lm_head_fp8) else None
    draw = dataclasses.replace(sampling, temperature=1.0)  # z below is already logits / T
    tied = "lm_head" not in params
    kernel = params["embed"] if tied else params["lm_head"]
    if head_state is not None and precision.recipe.scaling == "tensor":  # fp8_chunked_head_logprobs' chunk
        z = fp8_heads.chunk_logits(hidden, kernel, head_state, k, rows, c, precision=precision,
                                   temperature=sampling.temperature, kernel_nk=tied)  # [B, C, V]
    elif head_state is not None:  # autodiff_head_logprobs' chunk (rowwise scaling)
        z = heads.autodiff_chunk_logits(params, hidden, k, rows, c, precision=precision,
                                        temperature=sampling.temperature, head_state=head_state)  # [B, C, V]
        token = sample(z[rows, r], keys, draw)[0] if forced is None else forced
        return token, jax.nn.log_softmax(z, axis=-1)[rows, r, token]
    else:  # chunked_head_logprobs' chunk
        z = heads.chunk_logits(hidden, kernel, k, rows, c, temperature=sampling.temperature, kernel_nk=tied,
                               dtype=precision.dtype)  # [B, C, V]
    token = sample(z[rows, r], keys, draw)[0] if forced is None else forced
    return token, heads.chunk_token_logprob(z, rows, r, token)


class ExactSampler:
    """Rollouts drawn with the scoring forward of ``precision`` at the trainer's microbatch shape."""

    def __init__(self, model: LlamaConfig, precision: Precision, sampling: SamplingParams, *, max_new_tokens: int,
                 microbatch: int, stop_ids: tuple[int, ...] = (), pad_id: int = 0,
                 mesh: jax.sharding.Mesh | None = None):
        self.model, self.precision, self.sampling, self.mesh = model, precision, sampling, mesh
        self.max_new_tokens, self.microbatch = max_new_tokens, microbatch
        self.stop_ids, self.pad_id = tuple(stop_ids), pad_id
        # the scoring program's compile options: the same GEMMs, so the same bits
        self._generate = jit_head_program(self._generate_impl, precision)

    def rollout(self, state: dict, prompts: list, n: int, key: jax.Array) -> RolloutBatch:
        """``n`` completions of each prompt (token ids) from the policy ``state`` (the trainer's state dict: its
        ``params``, ``fp8_state``, ``kv_scales``); rows are sample-major within each prompt (row = p * n + s)."""
        total = len(prompts) * n
        if total % self.microbatch:
            raise ValueError(f"{total} sequences are not a whole number of {self.microbatch}-sequence microbatches")
        width = sequence_width([len(p) for p in prompts], self.max_new_tokens)
        tokens = np.full((total, width), self.pad_id, np.int32)
        starts = np.zeros(total, np.int32)
        for row in range(total):
            prompt = prompts[row // n]
            tokens[row, : len(prompt)] = prompt
            starts[row] = len(prompt)
        keys = jax.vmap(functools.partial(jax.random.fold_in, key))(jnp.arange(total))
        t0 = time.perf_counter()
        with mesh_context(self.mesh, self.precision.backend):  # traced as the train step is (its mesh, TE's axes)
            out = self._generate(state["params"], state["fp8_state"] if self.precision.fp8 else None,
                                 state["kv_scales"] if self.precision.kv_fp8 else None, jnp.asarray(tokens),
                                 jnp.asarray(starts), keys)
            out_tokens, out_logprobs, lengths = host_get(out)
        seconds = time.perf_counter() - t0
        stop = set(self.stop_ids)
        reasons = ["stop" if length and out_tokens[i, length - 1] in stop else "length"
                   for i, length in enumerate(lengths)]
        generated = float(lengths.sum())
        return RolloutBatch(
            prompt_index=np.repeat(np.arange(len(prompts)), n), tokens=out_tokens, logprobs=out_logprobs,
            lengths=lengths.astype(np.int64), finish_reasons=reasons,
            stats={"rollout_seconds": seconds, "prefill_seconds": 0.0, "generated_tokens": generated,
                   "tokens_per_second": generated / max(seconds, 1e-9)},
            width=width)

    def _generate_impl(self, params, fp8_state, kv_scales, tokens, starts, keys):
        """tokens [N, T] (prompts, then pad), starts [N] (prompt lengths), keys [N] -> (completion tokens
        [N, max_new], their logprobs [N, max_new], lengths [N]). Stops when every row is done."""
        n, t = tokens.shape
        mb, max_new = self.microbatch, self.max_new_tokens
        stop = jnp.asarray(self.stop_ids or (-1,), jnp.int32)
        rows = jnp.arange(n)

        def draw(xs):  # one microbatch: [mb, T] -> next tokens [mb], logprobs [mb]
            tok, at, k = xs
            return sample_next_token(params, tok, at, k, config=self.model, precision=self.precision,
                                     sampling=self.sampling, fp8_state=fp8_state, kv_scales=kv_scales)

        def step(carry):
            tokens, count, done, keys, out_tokens, out_logp = carry
            split = jax.vmap(jax.random.split)(keys)  # [N, 2, ...]: this token's key, and the rest of the stream
            keys, sub = split[:, 0], split[:, 1]
            at = jnp.minimum(starts + count, t - 1)
            grouped = (tokens.reshape(-1, mb, t), at.reshape(-1, mb), sub.reshape(-1, mb, *sub.shape[1:]))
            token, logp = (x.reshape(n) for x in jax.lax.map(draw, grouped))
            live = ~done
            tokens = tokens.at[rows, at].set(jnp.where(live, token, tokens[rows, at]))
            slot = jnp.minimum(count, max_new - 1)
            out_tokens = out_tokens.at[rows, slot].set(jnp.where(live, token, out_tokens[rows, slot]))
            out_logp = out_logp.at[rows, slot].set(jnp.where(live, logp, out_logp[rows, slot]))
            count = count + live
            done = done | (live & jnp.isin(token, stop)) | (count >= max_new) | (starts + count >= t)
            return tokens, count, done, keys, out_tokens, out_logp

        carry = (tokens, jnp.zeros(n, jnp.int32), starts >= t, keys, jnp.zeros((n, max_new), jnp.int32),
                 jnp.zeros((n, max_new), jnp.float32))
        _, count, _, _, out_tokens, out_logp = jax.lax.while_loop(lambda c: ~jnp.all(c[2]), step, carry)
        return out_tokens, out_logp, count
