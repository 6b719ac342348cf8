"""The GRPO trainer end to end on the tiny config: learning, resumption, faults, sampling."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from fp8rl_jax.config import load_config_file
from fp8rl_jax.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.py")
TIMING = ("time/", "tokens_per_s")


def _config(tmp_path, mode="fp8_e2e", **overrides):
    config = load_config_file(TINY, mode)
    with config.unlocked():
        config.workdir = str(tmp_path / "run")
        config.logging.progress = False
        config.logging.tensorboard = False
        config.logging.plots = False
        for key, value in overrides.items():
            section, name = key.split(".") if "." in key else (None, key)
            (config[section] if section else config)[name] = value
    return config


@pytest.mark.parametrize("mode", ["fp8_e2e", "bf16", "fp8_rollout"])
def test_tiny_reward_rises_in_30_steps(tmp_path, mode):
    trainer = Trainer(_config(tmp_path, mode))
    records = trainer.run()
    trainer.close()
    rewards = [r["reward_mean"] for r in records]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    print(f"{mode}: reward {first:.3f} (steps 1-5) -> {last:.3f} (steps 26-30)")
    assert len(records) == 30
    assert last > first + 0.15 and last > 2.5 * first
    if mode == "fp8_e2e":  # same FP8 linears and scales in rollout and training: importance weights stay ~1
        assert max(r["token_mult_prob_error"] for r in records) < 1.01
        assert all(abs(r["is_weight_mean"] - 1) < 1e-2 for r in records)


def _metrics_without_timing(records):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in records]


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    straight = Trainer(_config(tmp_path / "a", steps=4))
    expected = straight.run()
    params = jax.device_get(straight.state["params"])
    straight.close()

    first = Trainer(_config(tmp_path / "b", steps=4))
    first.run(2)
    first.close()
    resumed = Trainer(_config(tmp_path / "b", steps=4))  # checkpoint.resume = "auto"
    assert resumed.step_count == 2
    resumed.run()
    resumed.close()
    got = [json.loads(line) for line in open(tmp_path / "b" / "run" / "metrics.jsonl")]
    assert _metrics_without_timing(got) == _metrics_without_timing(expected)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.device_get(resumed.state["params"])), strict=True):
        np.testing.assert_array_equal(a, b)


def test_nan_step_is_skipped_and_reported_then_aborts(tmp_path, capsys):
    trainer = Trainer(_config(tmp_path, steps=6))
    trainer.run(1)
    before = jax.device_get(trainer.state)
    trainer.state["params"]["final_norm"] = trainer.state["params"]["final_norm"] * np.nan  # poison the policy
    poisoned = jax.device_get(trainer.state["params"])
    with pytest.raises(FloatingPointError, match="3 consecutive RL steps"):
        for _ in range(3):
            record = trainer.step()
            assert record["skipped_updates"] == 1
    out = capsys.readouterr()
    assert "skipped: non-finite loss or gradient" in out.out + out.err
    after = jax.device_get(trainer.state)
    # nothing moved but the step counter: params stay the poisoned ones, optimizer and FP8 state the old ones
    np.testing.assert_array_equal(after["params"]["embed"], poisoned["embed"])
    for a, b in zip(jax.tree.leaves(after["opt_state"]), jax.tree.leaves(before["opt_state"]), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(after["fp8_state"]), jax.tree.leaves(before["fp8_state"]), strict=True):
        np.testing.assert_array_equal(a, b)
    trainer.close()


def test_sample_from_the_current_policy(tmp_path):
    trainer = Trainer(_config(tmp_path))
    out = trainer.sample(["abcd:", "efgh:"], n=3)
    greedy = trainer.sample(["abcd:"], n=2, greedy=True)
    trainer.close()
    assert [len(x) for x in out] == [3, 3] and all(isinstance(s, str) for x in out for s in x)
    assert greedy[0][0] == greedy[0][1]


def test_sigkill_mid_run_resumes_from_last_complete_checkpoint(tmp_path):
    """A run killed with SIGKILL (here while it saves every step) resumes from its last complete checkpoint."""
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "fp8rl_jax.main", f"--config={TINY}", f"--config.workdir={workdir}",
           "--config.steps=30", "--config.checkpoint.every=1", "--config.logging.progress=False",
           "--config.logging.tensorboard=False"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoints = workdir / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not (checkpoints.exists() and any(
            p.name.endswith("orbax-checkpoint-tmp") for p in checkpoints.iterdir() if p.name[0] in "3456789")):
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    left = sorted(p.name for p in checkpoints.iterdir())
    print("on disk after SIGKILL:", left)
    from fp8rl_jax.checkpoint import latest_complete_step

    last = latest_complete_step(checkpoints)
    assert last is not None and last >= 2
    trainer = Trainer(_config(tmp_path, steps=last + 1, **{"checkpoint.every": 1}))
    assert trainer.step_count == last
    trainer.run()
    trainer.close()
    assert latest_complete_step(checkpoints) == last + 1
