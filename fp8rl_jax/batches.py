"""A step's rollout batch as the device arrays the trainer scores and trains on: [rows, width] right-padded rows
(``StepBatches.right_padded``), or with ``rl.packing`` each minibatch's rows packed into [minibatches, microbatches,
rows, width] (``StepBatches.packed``); and their per-token logprobs under a policy, a microbatch at a time
(``score_right_padded``, ``score_packed``)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.parallel.distributed import host_get
from fp8rl_jax.policy_io import padded_width, right_pad
from fp8rl_jax.rl.microbatch import row_width_note
from fp8rl_jax.rl.packing import PackingPlan, first_fit_decreasing, pack


@jax.jit
def _microbatch(arrays: dict, mb: jax.Array, i: jax.Array) -> dict:
    """``arrays[k][mb, i]`` for each key, the indices traced: one program whatever the microbatch (eager integer
    indexing compiles a slice per index)."""
    return {k: v[mb, i] for k, v in arrays.items()}


@functools.partial(jax.jit, donate_argnums=0)
def _put_microbatch(out: jax.Array, value: jax.Array, mb: jax.Array, i: jax.Array) -> jax.Array:
    """``out`` with ``out[mb, i] = value`` in place, the indices traced (stacking the scored microbatches with zeros
    for the empty ones compiled anew for each new pattern of empty ones)."""
    return out.at[mb, i].set(value)


def _masked(batch, i: int) -> bool:
    """Whether row ``i`` of ``batch`` must not train (dynamic sampling's filler: ``RolloutBatch.masked``)."""
    return batch.masked is not None and bool(batch.masked[i])


@dataclasses.dataclass
class StepBatches:
    """How a ``Trainer`` lays out a step's rollout batch (prompt + completion rows, their completion masks, rollout
    logprobs and advantages) on the device."""

    pad_id: int
    row_tokens: int  # the longest row the run can make: a step's right-padded rows take the smallest bucket holding it
    minibatch: int  # sequences an update
    minibatches: int  # updates a step (rl.minibatches)
    calibration_sequences: int  # precision.kv_calibration_sequences
    packing: PackingPlan | None = None  # rl.packing

    def row_widths(self) -> str:
        """The widths of a step's rows, in words (said at the start of a run)."""
        if self.packing:
            return (f"row widths: packed into rows of {self.packing.width} tokens (rl.packing); a step that packing "
                    f"would not shorten: {row_width_note(self.row_tokens)}")
        return f"row widths: {row_width_note(self.row_tokens)}"

    def right_padded(self, records, batch, advantages: jax.Array) -> dict:
        """Right-padded prompt + completion rows and their per-token masks and rollout logprobs, put on the device
        once (built on the host, where the rollout's tokens are), with the (device) advantages [rows]."""
        rows = [[*records[p].prompt_ids, *batch.completion(i)] for i, p in enumerate(batch.prompt_index)]
        # an exact rollout's width, else the bucket of the step's longest row
        tokens = right_pad(rows, self.pad_id, width=batch.width, bucket=self.row_tokens)
        mask = np.zeros(tokens.shape, np.float32)
        rollout_logp = np.zeros(tokens.shape, np.float32)
        for i, p in enumerate(batch.prompt_index):
            prompt, done = records[p].prompt_ids, int(batch.lengths[i])
            mask[i, len(prompt) : len(prompt) + done] = 0.0 if _masked(batch, i) else 1.0
            rollout_logp[i, len(prompt) : len(prompt) + done] = batch.logprobs[i, :done]
        arrays = jax.device_put({"tokens": tokens, "mask": mask, "rollout_logp": rollout_logp})
        return {**arrays, "advantages": advantages.astype(jnp.float32)}

    def train(self, train_step, state: dict, arrays: dict, order: np.ndarray, *, packed: bool,
              microbatch: int) -> tuple[dict, list[dict]]:
        """The step's ``minibatches`` updates by ``train_step`` over ``arrays`` (``packed``: [minibatches, ...]
        arrays as ``packed`` lays them out; else right-padded rows, minibatch mb the rows ``order[mb * minibatch:]
        [:minibatch]`` in microbatches of ``microbatch``): the new state and each update's metrics (host values).
        With one minibatch the loss's own forward gives ``arrays["old_logp"]`` (set here, in ``arrays``' layout)."""
        train_metrics, own_old_logp = [], []
        for mb in range(self.minibatches):
            if packed:
                part = {k: v[mb] for k, v in arrays.items()}
            else:
                rows = order[mb * self.minibatch : (mb + 1) * self.minibatch]
                # [minibatch, ...] -> [microbatches, microbatch, ...]
                part = {k: v[rows].reshape(-1, microbatch, *v.shape[1:]) for k, v in arrays.items()}
            state, metrics, *own = train_step(state, part)
            own_old_logp += own  # one minibatch: the loss's own forward, [microbatches, microbatch (rows), T]
            train_metrics.append(metrics)
        if own_old_logp and packed:  # the packed layout of `arrays` itself
            arrays["old_logp"] = own_old_logp[0][None]
        elif own_old_logp:  # back to the order of `arrays`: row order[i] of the batch is row i of the minibatch
            arrays["old_logp"] = own_old_logp[0].reshape(len(order), -1)[np.argsort(order)]
        return state, host_get(train_metrics)

    def packed(self, records, batch, advantages: jax.Array, order: np.ndarray) -> tuple[tuple | None, dict]:
        """``rl.packing``: each minibatch's prompt + completion rows packed (``rl.packing.pack``; minibatch mb holds
        rows ``order[mb * minibatch:][:minibatch]`` of the batch, as unpacked), stacked into [minibatches,
        microbatches, rows, width] arrays put on the device once; also how many microbatches of each minibatch hold
        rows (host ints), and the KV calibration's rows, right-padded as the unpacked layout has them. None where
        the packed rows would run at least as many tokens as the right-padded layout (``packing/rows`` 0): packing
        there only adds its segment bookkeeping (the H100's llama1b step at fixed lengths ran 7% slower packed).
        Returned with the step's ``packing/*`` metrics."""
        rows = [np.asarray([*records[p].prompt_ids, *batch.completion(i)], np.int32)
                for i, p in enumerate(batch.prompt_index)]
        masks, rollout_logp = [], []
        for i, p in enumerate(batch.prompt_index):
            prompt, done = len(records[p].prompt_ids), int(batch.lengths[i])
            masks.append(np.concatenate([np.zeros(prompt, np.float32),
                                         np.full(done, 0.0 if _masked(batch, i) else 1.0, np.float32)]))
            rollout_logp.append(np.concatenate([np.zeros(prompt, np.float32), batch.logprobs[i, :done]]))
        advantages = np.asarray(host_get(advantages), np.float32)
        pad = self.pad_id
        takes = [order[mb * self.minibatch : (mb + 1) * self.minibatch] for mb in range(self.minibatches)]
        # each minibatch's packed rows (sequence indices into `take`), then the step's rows per microbatch: of the
        # plan's options, the one that costs least
        bins = [first_fit_decreasing([len(rows[i]) for i in take], self.packing.width, self.packing.max_segments)
                for take in takes]
        plan = self.packing.choose_rows([len(b) for b in bins])
        run = sum(-(-len(b) // plan.rows) for b in bins) * plan.tokens  # the tokens the packed step would run
        padded = len(rows) * padded_width(rows, width=batch.width, bucket=self.row_tokens)  # and right_padded's
        if run >= padded:  # nothing to gain (e.g. every sequence alone in a row): this step runs right-padded
            return None, {"packing/rows": 0.0, "packing/fill": sum(map(len, rows)) / padded}
        parts = []
        for take, rows_of in zip(takes, bins, strict=True):
            parts.append(pack(plan, [rows[i] for i in take],
                              {"mask": [masks[i] for i in take], "rollout_logp": [rollout_logp[i] for i in take]},
                              {"advantages": advantages[take]}, pad_id=pad, bins=rows_of))
        active = [int(p["microbatches"]) for p in parts]
        # the step's rows per microbatch, and the share of the tokens it runs (used rows or not) that sequences fill
        record = {"packing/rows": float(plan.rows), "packing/fill": sum(map(len, rows)) / (sum(active) * plan.tokens)}
        names = ("tokens", "segment_ids", "positions", "mask", "rollout_logp", "advantages")
        arrays = jax.device_put({k: np.stack([p[k] for p in parts]) for k in names})
        k = self.calibration_sequences
        return (arrays, active, right_pad(rows, pad, width=batch.width, bucket=self.row_tokens)[:k]), record


def score_packed(score, state: dict, params, arrays: dict, active: list[int]) -> jax.Array:
    """Per-token logprobs [minibatches, microbatches, rows, width] of packed ``arrays`` under ``params`` with
    ``state``'s FP8 and KV scales (``score``: ``make_score``'s function): one [rows, width] call per microbatch that
    holds rows (``active``: how many microbatches of each minibatch do), zeros for the rest."""
    s = state
    layout = {k: arrays[k] for k in ("tokens", "segment_ids", "positions")}
    out = jnp.zeros(arrays["tokens"].shape, jnp.float32)
    for mb, count in enumerate(active):
        for i in range(count):
            where = np.int32(mb), np.int32(i)
            logp = score(params, s["fp8_state"], s["kv_scales"], _microbatch(layout, *where))
            out = _put_microbatch(out, logp, *where)
    return out


def score_right_padded(score, state: dict, params, tokens: jax.Array, microbatch: int) -> jax.Array:
    """Per-token logprobs [rows, T] of ``tokens`` under ``params`` with ``state``'s FP8 and KV scales (``score``:
    ``make_score``'s function), scored ``microbatch`` rows at a time."""
    s = state
    parts = [score(params, s["fp8_state"], s["kv_scales"], tokens[i : i + microbatch])
             for i in range(0, len(tokens), microbatch)]
    return jnp.concatenate(parts)
