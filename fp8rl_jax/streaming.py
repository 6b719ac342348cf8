"""The trainer's rollout stream (``rollout.stream``): built from a run's pieces, its queue in a checkpoint, and the
metrics of a streamed batch.

A checkpoint of a streamed run is taken at one of the stream's barriers (``StreamPlan.barriers``: the checkpoint
steps), where nothing is in flight: it keeps the finished, untrained groups (the next ``rollout.max_staleness``
batches, sampled by earlier versions) and the data iterator's position there, in its metadata. A run resumed from
it regenerates nothing: it trains on those groups and samples on from that position, as the uninterrupted run did.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import json

import jax
import numpy as np

from fp8rl_jax import plan
from fp8rl_jax.data.prompts import PromptRecord
from fp8rl_jax.rl.rewards import combined_rewards
from fp8rl_jax.rollout.stream import Group, Stream


def open_stream(trainer, count: int) -> Stream:
    """The stream of ``trainer``'s (a ``Trainer``'s) next ``count`` steps from its policy (version: its step), with
    a barrier at each checkpoint step and at the last, and the queue of the checkpoint it restored. In a thread of
    its own where the rollout has devices of its own, else driven by ``Stream.take``."""
    first = trainer.step_count
    end = first + count
    barriers = {v for v in range(first + 1, end) if trainer.checkpointer.should_save(v)} | {end}
    rng = jax.device_get(trainer.state["rng"])
    batch_key = functools.lru_cache(maxsize=None)(lambda b: jax.device_get(jax.random.fold_in(rng, b)))
    weights = jax.block_until_ready(trainer.sampler.weights(trainer.engine, trainer.state))
    prompts = trainer.prompts
    stream = Stream(trainer.engine, plan.stream_plan(trainer.config, first, end, barriers),
                    next_prompt=lambda: next(prompts), prompt_state=prompts.get_state, batch_key=batch_key,
                    judge=make_judge(trainer.tokenizer, trainer.reward_fns, trainer.reward_weights), weights=weights,
                    version=first, restored=[g for g in trainer._restored_groups or () if g.batch >= first],
                    limits=trainer.length_limits)
    return stream.start() if trainer.rollout_devices is not None else stream


def refit_metrics(engine) -> dict[str, float]:
    """What the last weight update moved to the rollout's own devices (``Engine.last_refit``): its bytes, the bytes
    a BF16 refit would move, and the transfer's seconds; nothing where the rollout shares the trainer's devices."""
    last = engine.last_refit
    if not last:
        return {}
    return {"async/weight_update_bytes": float(last["total_bytes"]),
            "async/weight_update_bf16_bytes": float(last["bf16_equivalent_bytes"]),
            "async/weight_transfer_s": float(last["seconds"])}


def make_judge(tokenizer, reward_fns, reward_weights):
    """A stream's ``judge``: a finished group's rewards and per-fn rewards, from its completions' text."""

    def judge(record, completions):
        texts = [tokenizer.decode(c) for c in completions]
        return combined_rewards(reward_fns, reward_weights, [record] * len(texts), texts)

    return judge


def _array(a: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, a, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _from_array(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


ARRAYS = ("tokens", "logprobs", "versions", "lengths", "rewards")


def encode_groups(groups: list[Group]) -> str:
    """Finished groups as JSON (arrays exact, as .npy bytes in base64), for a checkpoint's metadata."""
    return json.dumps([{
        "batch": g.batch, "index": g.index, "record": dataclasses.asdict(g.record), "reasons": g.reasons,
        "admitted_version": g.admitted_version, **{k: _array(np.asarray(getattr(g, k))) for k in ARRAYS},
        "per_fn": {k: _array(np.asarray(v)) for k, v in g.per_fn.items()},
    } for g in groups])


def decode_groups(text: str) -> list[Group]:
    out = []
    for d in json.loads(text):
        record = d["record"]
        record = PromptRecord(**{**record, "prompt_ids": tuple(record["prompt_ids"])})
        arrays = {k: _from_array(d[k]) for k in ARRAYS}
        out.append(Group(d["batch"], d["index"], record, arrays["tokens"], arrays["logprobs"], arrays["versions"],
                         arrays["lengths"], list(d["reasons"]), arrays["rewards"],
                         {k: _from_array(v) for k, v in d["per_fn"].items()}, d["admitted_version"]))
    return out


def batch_rewards(batch) -> tuple[list, np.ndarray, dict[str, np.ndarray]]:
    """A streamed batch's prompt records (one per group: row i's is ``batch.prompt_index[i]``), its rewards and
    per-fn rewards (judged by the stream), row by row."""
    groups = batch.groups
    records = [g.record for g in groups]
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float32)
    per_fn = {k: np.concatenate([g.per_fn[k] for g in groups]) for k in groups[0].per_fn}
    return records, rewards, per_fn


def stream_metrics(batch, step: int) -> dict[str, float]:
    """``async/*`` and ``dynamic/*`` of step ``step``'s batch: staleness per token (the updates between the
    version that sampled it and the one that trains on it), idle seconds of the rollout, dynamic sampling's
    dropped groups, extra prompts and fill rounds."""
    valid = batch.versions >= 0
    staleness = np.where(valid, step - batch.versions, 0)
    out = {k: float(v) for k, v in batch.stats.items() if k.startswith(("dynamic/", "async/"))}
    out.update({
        "async/staleness_mean": float(staleness[valid].mean()) if valid.any() else 0.0,
        "async/staleness_max": float(staleness[valid].max()) if valid.any() else 0.0,
        "async/rollout_idle_s": float(batch.stats.get("rollout_idle_seconds", 0.0)),
    })
    return out
