"""Offline rollout for RL: prompts x n samples through the engine with continuous batching.

Every slot that finishes is refilled from the queue at the next host sync, so the decode batch stays full while
completions of very different lengths run. The host syncs every ``steps_per_sync`` decode steps (one compiled
loop); a slot that finishes inside a chunk idles until the chunk ends.

The n samples of a prompt share one prefill. Sample s of prompt p draws with ``fold_in(rng, p * n + s)``, so
its tokens do not depend on the slot or on the batch it ran in.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import numpy as np

from fp8rl_jax.parallel.distributed import host_get
from fp8rl_jax.rollout.engine import Engine, prefill_bucket


@dataclasses.dataclass
class RolloutBatch:
    """Completions of ``prompts x n``, sample-major within each prompt (row = p * n + s)."""

    prompt_index: np.ndarray  # [N] int
    tokens: np.ndarray  # [N, max_new] int32, right-padded with 0
    logprobs: np.ndarray  # [N, max_new] f32: log pi_T of each token when it was sampled
    lengths: np.ndarray  # [N] int
    finish_reasons: list[str]  # "stop" (a stop token, included in tokens) | "length"
    stats: dict[str, float]

    def completion(self, i: int) -> np.ndarray:
        return self.tokens[i, : self.lengths[i]]


def generate(
    engine: Engine,
    params: dict,
    prompts: list[list[int]],
    n: int,
    rng: jax.Array,
    *,
    steps_per_sync: int = 8,
    progress: bool = False,
) -> RolloutBatch:
    """Sample ``n`` completions for each prompt (token id lists) with continuous batching."""
    cfg = engine.config
    total = len(prompts) * n
    max_new = cfg.max_new_tokens
    out_tokens = np.zeros((total, max_new), np.int32)
    out_logprobs = np.zeros((total, max_new), np.float32)
    lengths = np.zeros(total, np.int64)
    reasons = [""] * total
    stop_ids = set(cfg.stop_ids)

    queue = collections.deque(range(total))
    prefixes: dict[int, object] = {}
    remaining = collections.Counter({p: n for p in range(len(prompts))})
    slot_row = [-1] * engine.max_concurrent_decodes
    state = engine.init_decode_state()

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="rollout", unit="seq", leave=False)
    t0 = time.perf_counter()
    prefill_s = 0.0
    generated = 0

    def record(row: int, token: int, logprob: float) -> None:
        out_tokens[row, lengths[row]] = token
        out_logprobs[row, lengths[row]] = logprob
        lengths[row] += 1

    def finish(slot: int) -> None:
        row = slot_row[slot]
        last = out_tokens[row, lengths[row] - 1]
        reasons[row] = "stop" if last in stop_ids else "length"
        slot_row[slot] = -1
        if bar is not None:
            bar.update(1)

    while queue or any(r >= 0 for r in slot_row):
        inserted = []
        for slot in range(engine.max_concurrent_decodes):
            if slot_row[slot] >= 0 or not queue:
                continue
            row = queue.popleft()
            p = row // n
            if p not in prefixes:
                t = time.perf_counter()
                prompt = prompts[p]
                padded = np.zeros(prefill_bucket(len(prompt), cfg.max_prefill_length), np.int32)
                padded[: len(prompt)] = prompt
                prefixes[p] = engine.prefill(params, padded, len(prompt), jax.random.fold_in(rng, 2**30 + p))
                prefill_s += time.perf_counter() - t
            state = engine.insert(prefixes[p], state, slot, jax.random.fold_in(rng, row))
            remaining[p] -= 1
            if remaining[p] == 0:
                del prefixes[p]
            slot_row[slot] = row
            inserted.append(slot)
        if inserted:  # first tokens come from the inserts
            first, first_lp, done = host_get((state.tokens, state.logprobs, state.done))
            for slot in inserted:
                record(slot_row[slot], int(first[slot]), float(first_lp[slot]))
                generated += 1
                if done[slot]:
                    finish(slot)
        if not any(r >= 0 for r in slot_row):
            continue
        state, tokens, logprobs, valid = engine.generate_steps(params, state, steps_per_sync)
        tokens, logprobs, valid, done = host_get((tokens, logprobs, valid, state.done))
        for slot, row in enumerate(slot_row):
            if row < 0:
                continue
            for i in np.flatnonzero(valid[:, slot]):
                record(row, int(tokens[i, slot]), float(logprobs[i, slot]))
                generated += 1
            if done[slot]:
                finish(slot)
        if bar is not None:
            bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - t0):.0f}")
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    return RolloutBatch(
        prompt_index=np.repeat(np.arange(len(prompts)), n),
        tokens=out_tokens,
        logprobs=out_logprobs,
        lengths=lengths,
        finish_reasons=reasons,
        stats={
            "rollout_seconds": seconds,
            "prefill_seconds": prefill_s,
            "generated_tokens": float(generated),
            "tokens_per_second": generated / max(seconds, 1e-9),
        },
    )

