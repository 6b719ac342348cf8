"""The trainer on a mesh: a checkpoint saved on fsdp=8 restores on fsdp=2 x tensor=4 and training goes on."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from fp8rl_jax.config import load_config_file
from fp8rl_jax.parallel import rules
from fp8rl_jax.trainer import Trainer

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "tiny.py")


def _config(tmp_path, data=1, fsdp=1, tensor=1, steps=2):
    config = load_config_file(TINY, "fp8_e2e")
    with config.unlocked():
        config.workdir = str(tmp_path / "run")
        config.steps = steps
        config.logging.progress = config.logging.tensorboard = config.logging.plots = False
        config.rollout.prompts_per_step = 2  # 8 sequences: a batch that data * fsdp = 8 divides
        config.rollout.decode_slots = 8
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, fsdp, tensor
    return config


def test_checkpoint_saved_on_fsdp8_restores_on_fsdp2_tensor4_and_training_continues(tmp_path):
    first = Trainer(_config(tmp_path, fsdp=8))
    assert dict(first.mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert first.state["params"]["blocks"]["wqkv"].sharding.spec == P(None, "fsdp")
    record = first.run(1)[0]
    assert np.isfinite(record["loss"])
    saved = jax.device_get(first.state)
    first.close()

    resumed = Trainer(_config(tmp_path, fsdp=2, tensor=4))  # checkpoint.resume = "auto"
    assert resumed.step_count == 1
    assert dict(resumed.mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    # values as saved, placed by the rules on the new mesh
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(resumed.state)[0], jax.tree.leaves(saved),
                                 strict=True):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))
    expected = rules.state_shardings(resumed.state, resumed.mesh)
    assert jax.tree.all(jax.tree.map(lambda a, s: a.sharding == s, resumed.state, expected))
    assert resumed.state["params"]["blocks"]["wqkv"].sharding.spec == P(None, "fsdp", "tensor")
    assert resumed.state["opt_state"][1][0].mu["blocks"]["w_down"].sharding.spec == P(None, "tensor", "fsdp")
    assert resumed.state["fp8_state"]["blocks"]["wo"]["x"]["scale"].sharding.is_fully_replicated

    record = resumed.step()
    assert record["step"] == 2 and resumed.step_count == 2
    assert np.isfinite(record["loss"]) and record["skipped_updates"] == 0
    assert not any(k.startswith("memory/") for k in record)  # no allocator statistics on CPU
    moved = jax.device_get(resumed.state["params"]["blocks"]["wqkv"])
    assert not np.array_equal(moved, saved["params"]["blocks"]["wqkv"])  # the update was applied
    resumed.close()
