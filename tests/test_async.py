"""Asynchronous GRPO and dynamic sampling (``rollout/stream.py``, ``streaming.py``) on the tiny config, CPU.

The stream at staleness 0 draws what the synchronous step draws, bit for bit; a run with ``rollout.max_staleness=1``
and dynamic sampling killed with SIGKILL and run again ends with the metrics and parameters of an uninterrupted run;
dynamic sampling never trains on a group whose rewards are all equal and always fills the batch.
"""

import json
import os
import signal
import subprocess
import sys
import time
import zlib

import jax
import numpy as np
import pytest

from fp8rl_jax import plan, streaming
from fp8rl_jax.checkpoint import latest_complete_step
from fp8rl_jax.config import ConfigError, load_config_file, validate
from fp8rl_jax.rl.rewards import reward_names
from fp8rl_jax.rollout import driver
from fp8rl_jax.rollout.stream import Stream, StreamPlan
from fp8rl_jax.trainer import Trainer

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.py")
QUIET = {"logging.progress": False, "logging.tensorboard": False, "logging.plots": False}


def _config(workdir, **overrides):
    config = load_config_file(TINY)
    config.update_from_flattened_dict({"workdir": str(workdir), **QUIET, **overrides})
    return config


def _varying(record: dict) -> dict:
    """A record without what depends on the clock or the process (the rollout window's ``async/rollout_*``)."""
    return {k: v for k, v in record.items()
            if not k.startswith(("time/", "memory/", "async/rollout_", "async/weight"))
            and not k.endswith("_per_s")}


def test_the_stream_at_staleness_0_draws_the_synchronous_batch(tmp_path):
    """One batch through the stream (admission, prefill groups, slot refills, per-row keys) against
    ``driver.generate`` on the same weights and prompts: the same tokens, logprobs and lengths."""
    trainer = Trainer(_config(tmp_path / "run", **{"rollout.decode_slots": 24}))  # slots refill mid-batch
    try:
        c = trainer.config
        position = trainer.prompts.get_state()
        records = trainer.prompts.take(c.rollout.prompts_per_step)
        trainer.prompts.set_state(position)
        weights = trainer.sampler.weights(trainer.engine, trainer.state)
        key = jax.random.fold_in(trainer.state["rng"], 0)
        expected = driver.generate(trainer.engine, weights, [list(r.prompt_ids) for r in records], trainer.group, key)
        queue = iter(records)
        judged = []
        stream = Stream(trainer.engine, StreamPlan(prompts=len(records), samples=trainer.group, max_staleness=0,
                                                   first=0, end=1),
                        next_prompt=lambda: next(queue), prompt_state=dict, batch_key=lambda b: jax.device_get(key),
                        judge=lambda record, completions: (judged.append(record) or np.zeros(len(completions)), {}),
                        weights=weights, version=0)
        batch = stream.take(0)
        np.testing.assert_array_equal(batch.tokens, expected.tokens)
        np.testing.assert_array_equal(batch.logprobs, expected.logprobs)
        np.testing.assert_array_equal(batch.lengths, expected.lengths)
        assert batch.finish_reasons == expected.finish_reasons
        assert [g.record for g in batch.groups] == list(records) and len(judged) == len(records)
        valid = np.arange(batch.tokens.shape[1])[None] < batch.lengths[:, None]
        assert (batch.versions[valid] == 0).all() and (batch.versions[~valid] == -1).all()
    finally:
        trainer.close()


def test_a_step_through_the_stream_at_staleness_0_is_the_synchronous_step(tmp_path, monkeypatch):
    """``rollout.max_staleness=0`` is the synchronous step; forced through the stream it gives that step's
    records and parameters bit for bit (the stream adds nothing at staleness 0)."""
    sync = Trainer(_config(tmp_path / "sync", steps=2))
    assert not plan.streaming(sync.config)
    records = sync.run()
    params = jax.device_get(sync.state["params"])
    sync.close()
    monkeypatch.setattr(plan, "streaming", lambda config: True)
    streamed = Trainer(_config(tmp_path / "stream", steps=2))
    stream_records = streamed.run()
    stream_params = jax.device_get(streamed.state["params"])
    streamed.close()
    for a, b in zip(records, stream_records, strict=True):
        b = {k: v for k, v in b.items() if not k.startswith(("async/", "dynamic/"))}
        assert _varying(a) == _varying(b)
    jax.tree.map(np.testing.assert_array_equal, params, stream_params)


def _main(workdir, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-m", "fp8rl_jax.main", f"--config={TINY}", f"--config.workdir={workdir}", "--steps=6",
         "--config.rollout.max_staleness=1", "--config.rl.dynamic_sampling=True", "--config.checkpoint.every=2",
         "--config.rollout.load_delay_chunks=1", "--config.checkpoint.async_save=False",
         *(f"--config.{k}={v}" for k, v in QUIET.items()), *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _final(workdir):
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    trainer = Trainer(_config(workdir, steps=6, **{"rollout.max_staleness": 1, "rl.dynamic_sampling": True,
                                                   "rollout.load_delay_chunks": 1}))
    try:  # the finished run, restored from its last checkpoint
        assert trainer.step_count == 6
        return [_varying(r) for r in metrics], jax.device_get(trainer.state["params"])
    finally:
        trainer.close()


def test_sigkill_then_rerun_equals_an_uninterrupted_run(tmp_path):
    """Staleness 1, dynamic sampling and a load delay of one chunk, checkpoints every 2 steps: killed after its first
    checkpoint (while the stream has the next batches in flight), the rerun resumes from step 2's checkpoint, whose
    queue holds batch 2 as sampled before, and ends as the uninterrupted run did (the delay's count included)."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    child = _main(killed)
    deadline = time.time() + 600
    while latest_complete_step(killed / "checkpoints") is None and time.time() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL
    assert latest_complete_step(killed / "checkpoints") in (2, 4)
    for run in (_main(whole), _main(killed)):
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
    assert "resumed" in out + err
    whole_metrics, whole_params = _final(whole)
    killed_metrics, killed_params = _final(killed)
    assert [r["step"] for r in killed_metrics] == [1, 2, 3, 4, 5, 6]
    assert killed_metrics == whole_metrics
    assert whole_metrics[2]["async/staleness_max"] == 1  # it ran asynchronously
    jax.tree.map(np.testing.assert_array_equal, whole_params, killed_params)


def test_dynamic_sampling_trains_on_no_uniform_group_and_fills_the_batch(tmp_path, monkeypatch):
    trainer = Trainer(_config(tmp_path / "run", steps=3, **{"rl.dynamic_sampling": True,
                                                            "rl.dynamic_sampling_max_rounds": 3}))
    judge = streaming.make_judge  # every other prompt's group judged all equal: there are groups to drop

    def halved(*args):
        inner = judge(*args)
        return lambda record, completions: ((np.zeros(len(completions), np.float32), {"pattern": np.zeros(
            len(completions), np.float32)}) if zlib.crc32(record.id.encode()) % 2 else inner(record, completions))

    monkeypatch.setattr(streaming, "make_judge", halved)
    taken = []
    take = Stream.take
    monkeypatch.setattr(Stream, "take", lambda self, b: taken.append(take(self, b)) or taken[-1])
    try:
        records = trainer.run()
    finally:
        trainer.close()
    c = trainer.config
    dropped = 0
    for batch, record in zip(taken, records, strict=True):
        assert len(batch.groups) == c.rollout.prompts_per_step  # full
        for i, g in enumerate(batch.groups):
            uniform = bool(np.all(g.rewards == g.rewards[0]))
            masked = batch.masked[i * trainer.group:(i + 1) * trainer.group]
            assert masked.all() == uniform and masked.any() == uniform  # a uniform group only as masked filler
        dropped += record["dynamic/dropped_groups"]
        assert record["dynamic/extra_prompts"] <= (3 - 1) * c.rollout.prompts_per_step
        assert record["dynamic/fill_rounds"] <= 3
    assert dropped > 0


@pytest.mark.parametrize("inflight, delay", [(True, 0), (False, 0), (True, 1)])
def test_staleness_is_bounded_and_inflight_updates_are_what_the_keys_say(tmp_path, monkeypatch, inflight, delay):
    """Staleness 1: every token of step b's batch was sampled by version b - 1 or b; with in-flight updates some
    sequences span two versions, without them none does; with ``rollout.load_delay_chunks`` D every load with rows
    live comes D chunks or more after its batch completed, the first exactly D (with 96 slots the next batch has
    free slots when a batch completes: the load is due with rows live, and D = 0 would load at once)."""
    trainer = Trainer(_config(tmp_path / "run", steps=4, **{"rollout.max_staleness": 1,
                                                            "rollout.inflight_updates": inflight,
                                                            "rollout.load_delay_chunks": delay,
                                                            "rollout.decode_slots": 96 if delay else 24}))
    taken, loads = [], []
    take, load = Stream.take, Stream._load
    monkeypatch.setattr(Stream, "take", lambda self, b: taken.append((b, take(self, b))) or taken[-1][1])

    def counted(self, version, block):  # chunks since batch version - 1 completed, rows live, at each load
        loads.append((self._chunks - self._completed_at[version - 1], self._live()))
        return load(self, version, block)

    monkeypatch.setattr(Stream, "_load", counted)
    try:
        trainer.run()
    finally:
        trainer.close()
    spanning = 0
    for b, batch in taken:
        valid = batch.versions >= 0
        assert set(np.unique(batch.versions[valid])) <= {max(b - 1, 0), b}
        spanning += sum(len(set(row[row >= 0])) > 1 for row in batch.versions)
    assert (spanning > 0) == inflight
    live_loads = [chunks for chunks, live in loads if live]
    assert bool(live_loads) == inflight and all(chunks >= delay for chunks in live_loads)
    if delay:
        assert min(live_loads) == delay  # not later than due either


@pytest.mark.parametrize("overrides, key", [
    ({"rollout.max_staleness": -1}, "rollout.max_staleness"),
    ({"rollout.max_staleness": 1, "rollout.exact": True}, "rollout.max_staleness"),
    ({"rollout.max_staleness": 1, "precision.kv_cache_dtype": "float8_e4m3fn"}, "rollout.max_staleness"),
    ({"rl.dynamic_sampling_max_rounds": 0}, "rl.dynamic_sampling_max_rounds"),
    ({"rollout.load_delay_chunks": -1}, "rollout.load_delay_chunks"),
    ({"rollout.load_delay_chunks": 2, "rollout.inflight_updates": False}, "rollout.load_delay_chunks"),
])
def test_bad_async_keys_are_refused_by_name(tmp_path, overrides, key):
    config = _config(tmp_path, **overrides)
    with pytest.raises(ConfigError, match=f"config.{key}="):
        validate(config, known_rewards=reward_names)
