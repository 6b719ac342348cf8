"""Offline rollout for RL: prompts x n samples through the engine with continuous batching.

Every slot that finishes is refilled from the queue, so the decode batch stays full while completions of very
different lengths run. The decode steps run in chunks of ``steps_per_sync`` (one compiled loop), and one chunk is
always in flight: the next chunk is dispatched before the host reads the last one, so the device does not wait
for the host's bookkeeping. A slot that finishes inside a chunk idles until the end of the next one.

The n samples of a prompt share one prefill, and go into their slots in one ``insert_samples`` call. Prompts are
prefilled several per call (``prefill_group``: a fixed number per prompt bucket, padded). Sample s of prompt p
draws with ``fold_in(rng, p * n + s)``, so its tokens do not depend on the slot, on the batch it ran in, or on
the prompts that shared its prefill.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
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
    # the [rows, T] width the trainer must score the rows at (an exact rollout, ``rollout.exact``); 0 = any
    width: int = 0
    # a stream's batch (``rollout.stream``): the policy version that sampled each token ([N, max_new], -1 past
    # the end), the rows that must not train (dynamic sampling's filler), and its groups
    versions: np.ndarray | None = None
    masked: np.ndarray | None = None
    groups: list | None = None

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
    limits: np.ndarray | None = None,
) -> RolloutBatch:
    """Sample ``n`` completions for each prompt (token id lists) with continuous batching. ``limits`` ([prompts *
    n] ints, benchmarks): row i finishes ("stop") once it has ``limits[i]`` tokens, as if it had sampled a stop
    token there (random weights never do); its slot is then refilled as any finished row's."""
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

    def finish(row: int, reason: str | None = None) -> None:
        last = out_tokens[row, lengths[row] - 1]
        reasons[row] = reason or ("stop" if last in stop_ids else "length")
        if bar is not None:
            bar.update(1)

    def take(rows: list[int], tokens: np.ndarray, logprobs: np.ndarray, valid: np.ndarray, done: np.ndarray) -> int:
        """Append each live row's valid tokens ([n, B] arrays); finish the rows that are done. Returns the count."""
        count = 0
        for slot, row in enumerate(rows):
            if row < 0 or reasons[row]:  # an idle slot, or a row that finished in an earlier chunk
                continue
            steps, cut = chunk_steps(valid[:, slot], lengths[row], None if limits is None else limits[row])
            end = lengths[row] + len(steps)
            out_tokens[row, lengths[row]:end] = tokens[steps, slot]
            out_logprobs[row, lengths[row]:end] = logprobs[steps, slot]
            lengths[row] = end
            count += len(steps)
            if done[slot] or cut:
                finish(row, "stop" if cut else None)
                if slot_row[slot] == row:
                    slot_row[slot] = -1
        return count

    # One chunk in flight: chunk k + 1 is dispatched before the host reads chunk k, so the device never waits
    # for the host's bookkeeping. A slot that finishes in chunk k is refilled before chunk k + 2 (it idles for
    # one chunk); what a row samples does not depend on when or where it runs (see the module docstring).
    pending = None
    while queue or pending is not None or any(r >= 0 for r in slot_row):
        inserted = []
        by_prompt: dict[int, list[tuple[int, int]]] = {}  # prompt -> its (slot, row) pairs this round, in order
        for slot in range(engine.max_concurrent_decodes):
            if slot_row[slot] >= 0 or not queue:
                continue
            row = queue.popleft()
            by_prompt.setdefault(row // n, []).append((slot, row))
            slot_row[slot] = row
            inserted.append(slot)
        t = time.perf_counter()
        prefixes.update(_prefill(engine, params, prompts, [p for p in by_prompt if p not in prefixes], rng))
        prefill_s += time.perf_counter() - t
        for p, pairs in by_prompt.items():
            # the prompt's samples in one dispatch; sample (p, s) draws with fold_in(rng, p * n + s)
            slots, rows = zip(*pairs, strict=True)
            batch, i = prefixes[p]
            # padded to n: one compiled insert (and key derivation) for any number of a prompt's samples
            keys = row_keys(rng, rows, n)[: len(rows)]
            state = engine.insert_samples(batch, state, slots, keys, row=i, size=n)
            remaining[p] -= len(pairs)
            if remaining[p] == 0:
                del prefixes[p]
        dispatched = None
        if any(r >= 0 for r in slot_row):
            # the first tokens come from the inserts: read with the chunk, before its tokens
            # (copies: generate_steps donates the state)
            first = tuple(jnp.copy(a) for a in (state.tokens, state.logprobs, state.done)) if inserted else None
            state, tokens, logprobs, valid = engine.generate_steps(params, state, steps_per_sync)
            dispatched = (list(slot_row), inserted, first, (tokens, logprobs, valid, jnp.copy(state.done)))
        if pending is not None:
            generated += _read(pending, take)
            if bar is not None:
                bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - t0):.0f}")
        pending = dispatched
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



PREFILL_TOKENS = 1024  # positions per prefill call: 16 prompts of a 64-token bucket, 2 of a 512 one (at most 16)


def chunk_steps(valid: np.ndarray, length: int, limit: int | None) -> tuple[np.ndarray, bool]:
    """The steps of a chunk ([n] ``valid`` flags of one slot) that add a token to a row of ``length`` tokens, and
    whether the row reaches its ``limit`` (``generate(limits=)``; None: none) with them: then only the steps up to
    it, and the row stops there."""
    steps = np.flatnonzero(valid)
    cut = limit is not None and length + len(steps) >= limit
    return (steps[: max(int(limit) - int(length), 0)] if cut else steps), cut


def prefill_group(bucket: int, backend: str | None = None) -> int:
    """Prompts per prefill call for a bucket: fixed per bucket (padded with dummy prompts), so that a prompt's prefix
    does not depend on which prompts shared its call. One on a CPU, where the padding's compute is what costs (a GPU
    pays per dispatch and reads the weights once per call)."""
    if (backend or jax.default_backend()) == "cpu":
        return 1
    return max(1, min(16, PREFILL_TOKENS // bucket))


def prefill_prompts(engine: Engine, params: dict, prompts: Sequence[Sequence[int]],
                    keys: Callable[[list[int], int], object]) -> dict[int, tuple]:
    """Prefill ``prompts`` in groups of ``prefill_group(bucket)`` per call, in their order within each bucket:
    {index: (Prefix batch, row)}. ``keys(indices, g)``: the first-token keys of a call's prompts (``indices`` into
    ``prompts``), [g, 2] uint32; the rows past them are the padding prompts (one token 0 each), whose draws nothing
    reads. ``driver.generate`` and the rollout stream prefill through it."""
    by_bucket: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_bucket.setdefault(prefill_bucket(len(prompt), engine.config.max_prefill_length), []).append(i)
    out = {}
    for bucket, indices in by_bucket.items():
        g = prefill_group(bucket)
        for start in range(0, len(indices), g):
            group = indices[start:start + g]
            padded = np.zeros((g, bucket), np.int32)
            lengths = np.ones((g,), np.int32)
            for row, i in enumerate(group):
                padded[row, : len(prompts[i])] = prompts[i]
                lengths[row] = len(prompts[i])
            batch = engine.prefill_batch(params, padded, lengths, keys(group, g))
            out.update({i: (batch, row) for row, i in enumerate(group)})
    return out


def _prefill(engine: Engine, params: dict, prompts: list[list[int]], needed: list[int], rng: jax.Array) -> dict:
    """Prefill the ``needed`` prompts (``prefill_prompts``): {prompt: (Prefix batch, row)}. Prompt p's first token
    is drawn with ``fold_in(rng, 2**30 + p)`` (the padding prompts' with ``fold_in(rng, 0)``)."""
    keys = lambda group, g: row_keys(rng, [2**30 + needed[i] for i in group], g)  # noqa: E731
    out = prefill_prompts(engine, params, [prompts[p] for p in needed], keys)
    return {needed[i]: prefix for i, prefix in out.items()}


@jax.jit
def _fold_in_rows(rng: jax.Array, rows: jax.Array) -> jax.Array:
    return jax.vmap(lambda r: jax.random.fold_in(rng, r))(rows)


def row_keys(rng: jax.Array, rows, size: int) -> jax.Array:
    """``fold_in(rng, row)`` for each row, then for row 0 up to ``size`` keys ([size, 2] uint32), in one dispatch:
    one compiled program serves every count up to ``size``."""
    padded = np.zeros((max(size, len(rows)),), np.int32)
    padded[: len(rows)] = rows
    return _fold_in_rows(rng, jnp.asarray(padded))


def _read(dispatched, take) -> int:
    """Bring one dispatched chunk to the host and record it: its inserts' first tokens, then its steps."""
    rows, inserted, first, chunk = dispatched
    count = 0
    if first is not None:
        tokens, logprobs, done = host_get(first)
        mask = np.zeros((1, len(rows)), bool)
        mask[0, inserted] = True
        count += take(rows, tokens[None], logprobs[None], mask, np.where(mask[0], done, False))
    return count + take(rows, *host_get(chunk))
