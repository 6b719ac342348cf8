"""Sequence packing (``rl.packing``): prompt + completion rows packed into fixed-width token rows for scoring and
training, so that neither spends FLOPs or memory on the padding of a batch right-padded to its longest row.

A minibatch's sequences are placed into rows of ``width`` tokens by first-fit decreasing (longest first, each into
the first row with room, at most ``attention.row_segments(width)`` per row); the rows are grouped into microbatches of
``rows`` rows, the token budget ``rl.microbatch_tokens`` >= rows x width. Each sequence is a *segment* of its row:
segment ids count 1, 2, ... from the row's start and the padding tail is segment 0; positions restart at 0 in each
segment (RoPE), attention stays inside it (``llama.forward_hidden(segment_ids=...)``), and every per-sequence
reduction (sequence-level IS weights, ``seq_mean_*`` loss aggregations) sums over the segment's tokens
(``sequence_keys`` + ``metrics.segment_sums``) where an unpacked row sums along its axis.

Few compiled shapes: the width is fixed by the config (the longest row a step can produce, ``data.max_prompt_tokens
+ rollout.max_new_tokens``, rounded up to 32), a microbatch is always [rows, width], and a minibatch's arrays are
[microbatches, rows, width] with ``microbatches`` the most a minibatch can ever need (one sequence per row). The
train step loops over only the microbatches that hold rows (a ``fori_loop`` with a trip count read from the data,
``rl.step.make_train_step``); scoring calls its [rows, width] program once per such microbatch. So each program
compiles once per run, whatever the completion lengths, and the padding microbatches cost a transfer of zeros,
no compute.

Layout of a packed minibatch (host numpy, ``pack``): ``tokens``, ``segment_ids``, ``positions`` [M, R, W] int32;
per-token values (``mask``, ``rollout_logp``, the sequence's ``advantages`` on each of its tokens) [M, R, W] f32, 0 on
padding; ``placement`` [S, 3] (flat row, start, length) of each sequence, for ``unpack``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.errors import ConfigError
from fp8rl_jax.model.attention import row_segments
from fp8rl_jax.rl.microbatch import ROW_MULTIPLE

# what ``PackingPlan.choose_rows`` counts a microbatch's own cost at, in rows: a rough figure from the H100's llama1b
# step at fixed lengths (16-row packed microbatches of 1,280 tokens against 32-row unpacked ones: about 36 ms more per
# extra microbatch pass, 1.5 rows' worth, with the attention path differing too; benchmarks/RESULTS.md, "Sequence
# packing")
MICROBATCH_COST_ROWS = 1


@dataclasses.dataclass(frozen=True)
class PackingPlan:
    """The static shape of packed minibatches: [microbatches, rows, width], at most ``max_segments`` sequences per
    row, ``sequences`` sequences per minibatch."""

    width: int
    rows: int
    microbatches: int
    max_segments: int
    sequences: int
    row_options: tuple[int, ...] = ()  # other row counts a step may choose (``choose_rows``), fewer than ``rows``

    @property
    def tokens(self) -> int:
        """Tokens per microbatch (rows x width): at most the budget ``rl.microbatch_tokens``."""
        return self.rows * self.width

    def with_rows(self, rows: int) -> PackingPlan:
        """This plan with ``rows`` rows per microbatch (and microbatches for one sequence per row)."""
        return dataclasses.replace(self, rows=rows, microbatches=math.ceil(self.sequences / rows))

    def choose_rows(self, bins: Sequence[int]) -> PackingPlan:
        """The plan, of ``rows`` and ``row_options``, that costs least for minibatches of ``bins`` packed rows
        each: the rows it runs (the last microbatch of a minibatch runs all its rows, used or not) plus
        ``MICROBATCH_COST_ROWS`` per microbatch; ties: more rows a microbatch. Each choice a run takes compiles
        its shape once."""
        def cost(r: int) -> tuple[int, int]:
            return sum(-(-b // r) * (r + MICROBATCH_COST_ROWS) for b in bins), -r

        return self.with_rows(min((self.rows, *self.row_options), key=cost))

    @classmethod
    def build(cls, *, width: int, sequences: int, budget_tokens: int, microbatch_sequences: int,
              batch_devices: int = 1) -> PackingPlan:
        """The plan of a run (``fp8rl_jax.plan.packing_plan`` passes a config's values): rows ``width`` tokens wide
        (the longest possible row, ``rl.microbatch.longest_row_tokens``), for minibatches of ``sequences``
        sequences; rows ``microbatch_sequences`` (``rl.microbatch_sequences``) where set (the unpacked layout's
        microbatch at its widest: the same memory), else from the token budget ``budget_tokens``
        (``rl.microbatch_tokens``; 0: no budget), no more than a minibatch has sequences, rounded down to a multiple
        of ``batch_devices`` (the mesh's data x fsdp devices that split the rows) where it holds as many;
        microbatches for the worst case of one sequence per row. ``row_options``: divisors of a minibatch's
        sequences (multiples of ``batch_devices``), the largest under ``rows`` where it is fewer, then the largest
        under half of the one before, down to ``rows // 8``.

        Why: the last microbatch of a minibatch runs all its rows, used or not. With one sequence a row
        (completions near the width) 25 rows of 1,280 for 64 sequences ran 75 rows, and the H100's llama1b train
        step ran 25% slower than unpacked (benchmarks/RESULTS.md, "Sequence packing"); a divisor fills its
        microbatches exactly. Short sequences pack into few rows, where fewer rows a microbatch waste less (14
        rows for 11 used, 4 rows for 12): each step takes the option that costs least (``choose_rows``)."""
        budget = budget_tokens
        if microbatch_sequences > 0:
            rows = microbatch_sequences
        elif budget == 0:
            rows = sequences
        elif budget < width:
            raise ConfigError(f"config.rl.microbatch_tokens={budget} is less than one packed row of {width} tokens "
                              f"(data.max_prompt_tokens + rollout.max_new_tokens, rounded up to {ROW_MULTIPLE})")
        else:
            rows = budget // width
        rows = min(rows, sequences)
        if rows >= batch_devices:  # rows split evenly over the devices (else the microbatch stays replicated)
            rows -= rows % batch_devices

        def divisor(most: int) -> int | None:  # of the minibatch's sequences, split evenly over the devices
            return next((d for d in range(most, 0, -1) if sequences % d == 0 and d % batch_devices == 0), None)

        options = []
        d = divisor(rows)
        if d and d < rows:
            options.append(d)
        d = divisor((d or rows) // 2)
        while d and d >= max(1, rows // 8):
            options.append(d)
            d = divisor(d // 2)
        return cls(width=width, rows=rows, microbatches=math.ceil(sequences / rows),
                   max_segments=row_segments(width), sequences=sequences, row_options=tuple(options))


def first_fit_decreasing(lengths: Sequence[int], width: int, max_segments: int | None = None) -> list[list[int]]:
    """Bins of sequence indices: each sequence, longest first (ties: lower index first), goes into the first row
    whose free tokens hold it and that holds fewer than ``max_segments`` sequences, else into a new row. Within a
    row the sequences are in the order they were placed. A sequence longer than ``width`` is an error."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and int(lengths.max()) > width:
        i = int(np.argmax(lengths))
        raise ValueError(f"sequence {i} has {int(lengths[i])} tokens; a packed row holds {width}")
    cap = max_segments or width
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    free = np.zeros(len(lengths), np.int64)  # per row opened so far (at most one per sequence)
    count = np.zeros(len(lengths), np.int64)
    rows: list[list[int]] = []
    for i in order:
        fits = np.flatnonzero((free[: len(rows)] >= lengths[i]) & (count[: len(rows)] < cap))
        r = int(fits[0]) if fits.size else len(rows)
        if r == len(rows):
            rows.append([])
            free[r] = width
        rows[r].append(i)
        free[r] -= lengths[i]
        count[r] += 1
    return rows


def pack(plan: PackingPlan, tokens: Sequence[np.ndarray], per_token: dict[str, Sequence[np.ndarray]],
         per_sequence: dict[str, np.ndarray], pad_id: int = 0, bins: list[list[int]] | None = None
         ) -> dict[str, np.ndarray]:
    """One minibatch's sequences packed as ``plan`` says.

    ``tokens[i]``: sequence i's ids (prompt then completion); ``per_token[name][i]``: values on its tokens (as long
    as ``tokens[i]``); ``per_sequence[name][i]``: one value spread over its tokens (its advantage). ``bins``: the
    rows' sequence indices where the caller has them already (``first_fit_decreasing`` of the lengths, the plan's
    width and ``max_segments``; made here otherwise). Returns the arrays of the module docstring, [M, R, W] each,
    plus ``placement`` [S, 3] and ``microbatches`` (a 0-d int: the microbatches that hold rows; the rest is padding).
    """
    m, r, w = plan.microbatches, plan.rows, plan.width
    lengths = [len(t) for t in tokens]
    if bins is None:
        bins = first_fit_decreasing(lengths, w, plan.max_segments)
    if len(bins) > m * r:  # cannot happen for a plan's own minibatch: one sequence per row at worst
        raise ValueError(f"{len(tokens)} sequences need {len(bins)} packed rows; the plan holds {m} x {r}")
    # [M * R, W] while filling, reshaped to [M, R, W] at the end
    out = {"tokens": np.full((m * r, w), pad_id, np.int32), "segment_ids": np.zeros((m * r, w), np.int32),
           "positions": np.zeros((m * r, w), np.int32)}
    for name in (*per_token, *per_sequence):
        out[name] = np.zeros((m * r, w), np.float32)
    placement = np.zeros((len(tokens), 3), np.int64)
    for row, members in enumerate(bins):
        start = 0
        for segment, i in enumerate(members, 1):
            n = lengths[i]
            span = slice(start, start + n)
            out["tokens"][row, span] = tokens[i]
            out["segment_ids"][row, span] = segment
            out["positions"][row, span] = np.arange(n)
            for name, values in per_token.items():
                out[name][row, span] = values[i]
            for name, values in per_sequence.items():
                out[name][row, span] = values[i]
            placement[i] = (row, start, n)
            start += n
        out["positions"][row, start:] = np.arange(w - start)  # the padding tail: a segment of its own (id 0)
    # rows past the last bin: all padding, positions 0..W-1 (one segment)
    out["positions"][len(bins):] = np.arange(w)
    packed = {k: v.reshape(m, r, w) for k, v in out.items()}
    packed["placement"] = placement
    packed["microbatches"] = np.asarray(-(-len(bins) // r), np.int32)
    return packed


def unpack(packed: np.ndarray, placement: np.ndarray, width: int, fill=0) -> np.ndarray:
    """[S, width]: each sequence's values from a packed [M, R, W] array, back at positions 0.. of its own row (the
    layout ``policy_io.right_pad`` makes), ``fill`` after its end."""
    packed = np.asarray(packed)
    flat = packed.reshape(-1, packed.shape[-1])  # [M * R, W]
    out = np.full((len(placement), width), fill, packed.dtype)
    for i, (row, start, n) in enumerate(placement):
        out[i, :n] = flat[row, start : start + n]
    return out


def sequence_keys(segment_ids: jax.Array) -> jax.Array:
    """[B, T] -> [B, T]: one value per (row, segment) in [0, B * T), the ``segments`` argument of
    ``metrics.segment_sums`` (and of the losses and IS weights that reduce per sequence)."""
    b, t = segment_ids.shape
    return jnp.arange(b, dtype=jnp.int32)[:, None] * t + segment_ids
