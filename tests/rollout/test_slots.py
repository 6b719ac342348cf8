"""Decode slots (``rollout.decode_slots``): automatic sizing against the device memory, the bytes a slot takes, the
messages the trainer prints, and the trainer's engine getting the resolved number."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.model.config import preset
from fp8rl_jax.rollout import slots
from fp8rl_jax.rollout.slots import plan_slots

GIB = 2**30


def test_slot_bytes_by_hand():
    """SmolLM2-135M (30 layers, 3 kv heads of 64) with 256 + 256 positions and the prompt's prefill cache in BF16:
    2 x 30 x 3 x 64 x (2 x 256 + 256) x 2 B of K/V, and 4 f32 [49152] logit arrays."""
    model = preset("smollm2_135m")
    kv = 2 * 30 * 3 * 64 * (2 * 256 + 256) * 2
    logits = 4 * 49152 * 4
    got = slots.slot_bytes(model, max_prompt_tokens=256, max_new_tokens=256, cache_dtype=jnp.bfloat16)
    assert got == kv + logits
    fp8 = slots.slot_bytes(model, max_prompt_tokens=256, max_new_tokens=256, cache_dtype=jnp.float8_e4m3fn)
    assert fp8 == kv // 2 + logits
    assert slots.slot_bytes(model, max_prompt_tokens=256, max_new_tokens=256, cache_dtype=jnp.bfloat16,
                            tensor_parallel=3) == -(-(kv + logits) // 3)


def test_automatic_takes_every_sequence_when_memory_holds_them():
    plan = plan_slots(0, 256, slot_bytes=12 * 2**20, held_bytes=3 * GIB, limit=(59 * GIB, "test"))
    assert (plan.slots, plan.waves, plan.automatic) == (256, 1, True)
    assert plan.waves_message() is None
    assert "decode slots: 256 for 256 sequences a step, automatic (rollout.decode_slots=0)" in plan.describe()
    assert "3.0 GiB of train state and rollout weights, of 59.0 GiB (test)" in plan.describe()


def test_automatic_is_capped_by_memory_and_says_which_keys_help():
    # 10 GiB left beside the held 50: 90% of it holds 92 slots of 100 MiB
    plan = plan_slots(0, 256, slot_bytes=100 * 2**20, held_bytes=50 * GIB, limit=(60 * GIB, "test"))
    assert plan.slots == int(0.9 * 10 * GIB // (100 * 2**20)) == 92
    assert plan.waves == 3
    message = plan.waves_message()
    assert "256 sequences a step through 92 decode slots, 3 waves" in message
    assert "rollout.max_new_tokens" in message and "precision.kv_cache_dtype=float8_e4m3fn" in message
    # no memory left at all: still one slot a replica group, never zero
    assert plan_slots(0, 256, slot_bytes=GIB, held_bytes=70 * GIB, limit=(60 * GIB, "test")).slots == 1


def test_given_slots_are_kept_and_the_waves_name_the_key():
    plan = plan_slots(8, 256, slot_bytes=12 * 2**20, held_bytes=GIB, limit=(59 * GIB, "test"))
    assert (plan.slots, plan.waves, plan.automatic) == (8, 32, False)
    assert plan.waves_message() == ("rollout: 256 sequences a step through 8 decode slots, 32 waves of the decode "
                                    "batch; rollout.decode_slots=256 (or 0, automatic: as many as memory holds) runs "
                                    "them in one")
    assert "rollout.decode_slots=8" in plan.describe()


def test_automatic_slots_are_a_multiple_of_the_replica_groups():
    assert plan_slots(0, 12, slot_bytes=2**20, held_bytes=0, replicas=8, limit=(GIB, "t")).slots == 16
    assert plan_slots(0, 3, slot_bytes=2**20, held_bytes=0, replicas=4, limit=(GIB, "t")).slots == 4
    # memory for 20 slots a device x 4 groups = 80, rounded down to a multiple of 4; the step wants 100
    plan = plan_slots(0, 100, slot_bytes=2**20, held_bytes=0, replicas=4, limit=(int(20 / 0.9 * 2**20) + 1, "t"))
    assert plan.slots == 80 and plan.slots % 4 == 0


def test_tree_device_bytes_counts_each_devices_shard():
    tree = {"a": jnp.zeros((4, 8), jnp.float32), "b": np.zeros(3, np.int8),
            "s": jax.ShapeDtypeStruct((16, 2), jnp.bfloat16)}
    assert slots.tree_device_bytes(tree) == 4 * 8 * 4 + 3 + 16 * 2 * 2
    devices = jax.devices()
    if len(devices) >= 2:
        mesh = jax.sharding.Mesh(np.asarray(devices[:2]), ("x",))
        sharded = jax.device_put(jnp.zeros((4, 8), jnp.float32),
                                 jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
        assert slots.tree_device_bytes(sharded) == 2 * 8 * 4


def test_device_limit_without_allocator_statistics_is_a_share_of_host_memory():
    limit, source = slots.device_limit(jax.devices("cpu")[:1])
    assert limit > 0
    assert "host's memory" in source


@pytest.mark.parametrize("requested", [-1])
def test_bad_requests_are_refused(requested):
    with pytest.raises(ValueError, match="requested=-1"):
        plan_slots(requested, 8, slot_bytes=1, held_bytes=0, limit=(GIB, "t"))
