"""How many sequences one microbatch holds: the one place a microbatch's token budget is turned into a shape.

Every device program that runs over the RL batch a piece at a time (the train step's gradient accumulation, the
scoring forward, the exact sampler, the calibration passes) takes its rows ``microbatch_sequences(...)`` at a time.
The count is fixed once, at start-up, from the longest row the run can make (``longest_row_tokens``), so the
programs compile for one microbatch shape per row width however long the completions of a step turn out to be.
The trainer right-pads a step's rows to the smallest of a few fixed widths that holds its longest row
(``row_buckets``: 32 x 2**k below the longest possible row, and that row), so each program compiles at most
``len(row_buckets(...))`` times in a run (five for rows of up to 512 tokens) whatever the completion lengths.

``rl.microbatch_sequences`` > 0 is that count, as given. Otherwise ``rl.microbatch_tokens`` is a budget of tokens
(sequences x padded row width, over the whole mesh) per microbatch, and the count is the largest divisor of the
batch whose rows fit it, at least 1; 0 means no budget (the whole batch at once).

The default budget, ``DEFAULT_MICROBATCH_TOKENS`` = 32768 tokens, from the activation memory a train step keeps
per token (``model.remat=none`` for SmolLM2, ``full`` for the Llama configs) on one H100 of 80 GB, of which JAX's
allocator takes 75% by default: ``bytes_limit`` 59.4 GiB.

- SmolLM2-135M (d=576, F=1536, 30 layers, vocab 49152), no remat. Per layer and token the backward keeps the f32
  residual stream (2 x 2.3 kB), the BF16 norm outputs and their FP8 copies (2 x 1.7 kB), q/k/v (1.9 kB), the
  attention output (1.2 kB), gate/up (6.1 kB), silu(gate) * up and its FP8 copy (4.6 kB) and some f32 temporaries:
  ~25-30 kB, x 30 layers = 0.75-0.9 MB per token. The head adds, per sequence, one 256-position chunk's f32 logits
  and their gradient (256 x 49152 x ~8 B = 100 MB): up to 0.4 MB per token when rows are 256 tokens or shorter.
  Data point: the scaled demo below asked XLA for 111.14 GiB with 256 x 512 = 131072 tokens in one microbatch,
  0.87 MiB per token. Measured (XLA's memory analysis of the compiled train step, xla backend, H100, JAX 0.11.2;
  ``benchmarks/train_memory.py``, ``benchmarks/results/train_memory_h100.jsonl``): 33.3 GiB at 64 x 512 (1.04 MiB
  per token), 37.6 GiB at 128 x 256 and at 256 x 128 (1.17 MiB per token: the head's share). So 32768 tokens take
  33-38 GiB, beside 1.5 GiB of weights and Adam state. The scaled demo at 64 x 512 (what 32768 gives it) ran 3
  steps with a 30.4 GiB peak, 1.5 s per step once compiled.
- Llama-3.2-1B (d=2048, F=8192, 16 layers, vocab 128256), remat full. Kept per token: the 16 blocks' f32 inputs
  (16 x 8 kB = 128 kB), one block's recomputed activations at a time and the head chunk (256 x 128256 x ~8 B =
  260 MB per sequence, 0.2 MB per token at T = 1280). Measured: 12.8 GiB at 16 x 1280, 0.64 MiB per token, beside
  13.8 GiB of f32 weights and Adam moments: 32768 tokens ~ 20 GiB. (The shipped 32 x 1280 = 40960 tokens peaked at
  45-48 GiB in 3-step runs, benchmarks/RESULTS.md, "Train-step memory".)
- Llama-3.1-8B, remat full: 32 x 16 kB of block inputs, a block of twice the 1B's width and the head: ~1.2 MiB per
  token by the same arithmetic (not measured: its compile outlasted the session), split over the FSDP devices that
  split the batch; its weights and Adam state (96 GB) need several GPUs anyway.

So 32768 tokens keep the largest per-token cost shipped (SmolLM2 without remat) near 60% of an H100's limit. What
the shipped configs get (``tests/rl/test_microbatch.py`` checks this table):

    config                     minibatch  longest row  sequences per microbatch    tokens
    tiny                              64           32  64 (budget)                   2048
    smollm2_gsm8k                      8          384  8 (budget)                    3072
    smollm2_gsm8k, scaled demo*      256          512  64 (budget)                  32768
    smollm2_arith                    128          192  32 (microbatch_sequences)     6144
    llama1b                          128         1280  32 (microbatch_sequences)    40960
    llama8b                          128         2304  16 (microbatch_sequences)    36864

(* ``rollout.prompts_per_step=32 samples_per_prompt=8 max_new_tokens=256 decode_slots=256``, which asked for 111 GiB
with the whole minibatch in one microbatch.) The budget alone would give smollm2_arith 128, llama1b 16 and llama8b
8 sequences; those files keep the counts they were measured with (smollm2_arith's fits a fifth of an H100).
"""

from __future__ import annotations

ROW_MULTIPLE = 32  # the trainer pads rows to a multiple of this (policy_io.right_pad): few shapes to compile
DEFAULT_MICROBATCH_TOKENS = 32768


def row_width(tokens: int, multiple: int = ROW_MULTIPLE) -> int:
    """A row of ``tokens`` tokens padded up to a multiple of ``multiple``: the widths the trainer compiles for."""
    return -(-tokens // multiple) * multiple


def row_buckets(longest: int, multiple: int = ROW_MULTIPLE) -> tuple[int, ...]:
    """The widths a run's rows are padded to when their longest possible row is ``longest`` tokens:
    ``multiple * 2**k`` below it, and ``longest`` rounded up to ``multiple``."""
    top = row_width(longest, multiple)
    widths, w = [], multiple
    while w < top:
        widths.append(w)
        w *= 2
    return (*widths, top)


def bucket_width(tokens: int, longest: int, multiple: int = ROW_MULTIPLE) -> int:
    """The smallest of ``row_buckets(longest, multiple)`` that holds a row of ``tokens`` tokens."""
    if tokens > row_width(longest, multiple):
        raise ValueError(f"a row of {tokens} tokens is longer than the run's longest row, {longest} tokens")
    return next(w for w in row_buckets(longest, multiple) if w >= tokens)


def row_width_note(longest: int, multiple: int = ROW_MULTIPLE) -> str:
    """The row widths of a run in words, for its start-up messages."""
    widths = row_buckets(longest, multiple)
    return (f"each step's rows right-padded to one of {', '.join(map(str, widths))} tokens (the smallest that holds "
            f"its longest row): each scoring and training program compiles at most {len(widths)} "
            f"time{'s' if len(widths) > 1 else ''}")


def longest_row_tokens(max_prompt_tokens: int, max_new_tokens: int) -> int:
    """The widest [rows, T] row the trainer can score or train: the longest prompt kept (``data.max_prompt_tokens``;
    longer ones are dropped) plus ``rollout.max_new_tokens``, padded up to a multiple of ``ROW_MULTIPLE``."""
    return row_width(max_prompt_tokens + max_new_tokens)


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` (> 0) that is <= ``limit``; 1 when ``limit`` < 1."""
    return max((d for d in range(1, min(n, max(limit, 1)) + 1) if n % d == 0), default=1)


def microbatch_sequences(minibatch: int, row_tokens: int, *, budget_tokens: int, sequences: int) -> int:
    """Sequences per microbatch of a batch of ``minibatch`` rows of (at most) ``row_tokens`` tokens each.

    ``sequences`` (``rl.microbatch_sequences``) > 0 wins (the largest divisor of ``minibatch`` up to it: itself when
    it divides, as ``config.validate`` requires of the train minibatch); else the largest divisor of ``minibatch``
    whose rows fit ``budget_tokens`` (``rl.microbatch_tokens``) tokens, at least 1; a budget of 0 takes the whole
    batch.
    """
    if minibatch < 1 or row_tokens < 1:
        raise ValueError(f"microbatch_sequences: minibatch={minibatch} and row_tokens={row_tokens} must be positive")
    if sequences:
        return largest_divisor_at_most(minibatch, sequences)
    if not budget_tokens:
        return minibatch
    return largest_divisor_at_most(minibatch, budget_tokens // row_tokens)


def microbatch_source(*, budget_tokens: int, sequences: int) -> str:
    """Which key set the microbatch: for messages (``rl.microbatch_sequences=32``, ``rl.microbatch_tokens=32768``)."""
    if sequences:
        return f"rl.microbatch_sequences={sequences}"
    return f"rl.microbatch_tokens={budget_tokens}"
