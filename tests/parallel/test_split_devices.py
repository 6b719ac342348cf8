"""``mesh.rollout_devices``: the rollout on devices of its own, its weights sent there as FP8 bytes once per RL step
(``parallel.mesh.split_devices``, ``plan.meshes``, ``rollout/refit.py``).

The split rollout equals the colocated one bit for bit (tokens and logprobs) where both decode on the same devices in
the same layout: the same weights arrive (bit for bit, tested), each row's draws depend on its own key only, and the
decode programs are the same. Against a colocated rollout over all 8 devices the tokens are the same but logprobs
differ by ~1e-6: each device then decodes fewer rows, and XLA:CPU's GEMM rows at one M differ from those at another
in the last bits (DESIGN.md, "Why end-to-end FP8").
"""

import functools
import math
import os

import jax
import ml_collections
import numpy as np
import pytest

from fp8rl_jax import plan
from fp8rl_jax.config import ConfigError, base_config, load_config_file, validate
from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.mesh import make_mesh, split_devices
from fp8rl_jax.rollout import driver
from fp8rl_jax.rollout.engine import Engine, EngineConfig
from fp8rl_jax.rollout.sampler import plan_decode_slots
from fp8rl_jax.rollout.sampling import SamplingParams
from fp8rl_jax.rollout.weights import interleave_fused, per_layer, rollout_params

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny.py")
CONFIG = preset("tiny")
# the tiny preset with a small vocabulary and a wider MLP: block kernels hold most of the weights, as in a real model
# (Llama-3.1-8B: 87%); in the tiny preset itself the two BF16 tables outweigh them
WIDE = CONFIG.replace(vocab_size=128, intermediate_size=256)
PROMPTS = [list(np.random.RandomState(i).randint(3, CONFIG.vocab_size, size=n)) for i, n in enumerate((5, 9, 3, 12))]
# BF16 compute: every float a refit moves is an FP8 kernel, a BF16 table, or a small f32 (norms, scales)
REFIT = {"fp8": Precision(backend="xla"), "bf16": Precision()}
ROLLOUT = Precision(backend="xla", compute_dtype="float32", kv_cache_dtype="float8_e4m3fn")


def _mesh(devices, fsdp=-1):
    return make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": fsdp, "tensor": 1}), devices)


@functools.cache
def _policy(model, precision):
    params = llama.init_params(model, jax.random.PRNGKey(0), std=0.1)
    fp8_state = kv_scales = None
    if precision.fp8:  # delayed scales other than 1, as after some training
        fp8_state = jax.tree.map(lambda a: a * 0 + 3.0 if a.ndim == 1 else a, llama.init_fp8_state(model, precision))
    if precision.kv_fp8:
        kv_scales = jax.tree.map(lambda a: a * 20.0, kvq.init_kv_scales(model.num_layers))
    return params, fp8_state, kv_scales


def _on(mesh, model, precision):
    """The policy as the trainer holds it: params by the rules, FP8 state and KV scales replicated."""
    params, fp8_state, kv_scales = _policy(model, precision)
    return (jax.device_put(params, rules.state_shardings(params, mesh)),
            *jax.device_put((fp8_state, kv_scales), rules.replicated(mesh)))


def _config(**mesh):
    c = base_config()
    c.model.source, c.model.preset, c.model.tokenizer = "preset", "tiny", "char"
    for key, value in mesh.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


# -- (a) the two groups ------------------------------------------------------------------------------------------


def test_rollout_and_train_devices_are_disjoint_and_cover_all():
    devices = jax.devices()
    assert split_devices(0) == (devices, None)
    for k in (1, 2, 7):
        train, roll = split_devices(k)
        assert roll == devices[:k] and train == devices[k:]
    train_mesh, roll = plan.meshes(_config(**{"mesh.rollout_devices": 2}))
    assert dict(train_mesh.shape) == {"data": 1, "fsdp": 6, "tensor": 1}
    engine = Engine(CONFIG, REFIT["fp8"], EngineConfig(tensor_parallel=2), mesh=train_mesh, rollout_devices=roll)
    trained, rolled = set(train_mesh.devices.flat), set(engine.mesh.devices.flat)
    assert dict(engine.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 2}
    assert not trained & rolled and trained | rolled == set(devices) and rolled == set(devices[:2])
    mesh, none = plan.meshes(_config())  # 0: today's layout, the rollout over the trainer's devices
    assert none is None and set(mesh.devices.flat) == set(devices)


# -- (d) config errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"mesh.rollout_devices": -1}, r"config.mesh.rollout_devices=-1 is invalid"),
    ({"mesh.rollout_devices": True}, r"config.mesh.rollout_devices=True is invalid"),
    ({"mesh.rollout_devices": 3, "rollout.tensor_parallel": 2},
     r"config.mesh.rollout_devices=3 is invalid; allowed: a multiple of rollout.tensor_parallel=2"),
    ({"mesh.rollout_devices": 2, "rollout.exact": True, "precision.mode": "bf16"},
     r"config.mesh.rollout_devices=2 is invalid; allowed: 0 with rollout.exact=True"),
])
def test_bad_rollout_devices_are_named_by_validate(overrides, message):
    c = _config(**overrides)
    with pytest.raises(ConfigError, match=message):
        validate(c)


@pytest.mark.parametrize("overrides, processes, message", [
    ({"mesh.rollout_devices": 8}, 1, r"mesh.rollout_devices=8 leaves no device for training: 8 devices present"),
    ({"mesh.rollout_devices": 2, "mesh.fsdp": 4}, 1,
     r"mesh.fsdp=4.*does not divide the 6 devices.*\(mesh.rollout_devices=2 leaves 6 devices to train on\)"),
    ({"mesh.rollout_devices": 2}, 2, r"mesh.rollout_devices=2 needs one process; this run has 2"),
])
def test_devices_that_cannot_hold_the_split_are_named(monkeypatch, overrides, processes, message):
    c = _config(**overrides)
    validate(c)  # valid as values: what fails is this machine's devices
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    with pytest.raises(ConfigError, match=message):
        plan.meshes(c)


# -- decode slots ------------------------------------------------------------------------------------------------


class _Device:
    """A device whose allocator reports ``limit`` bytes."""

    platform = "gpu"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_automatic_slots_size_to_the_rollout_devices_beside_the_rollout_weights_alone():
    """With a split only the rollout weights stay on the rollout devices, whose memory is read: a train state larger
    than any device leaves the colocated rollout its minimum (one slot a replica group), the split one every
    sequence."""
    spec = plan.sampler_spec(_config(**{"rollout.tensor_parallel": 2}))
    params = jax.eval_shape(lambda: llama.init_params(CONFIG, jax.random.PRNGKey(0)))
    held = {"params": params, "opt_state": jax.ShapeDtypeStruct((2**40,), np.float32)}  # 4 TiB of moments
    mesh = _mesh(jax.devices()[2:])
    colocated = plan_decode_slots(spec, CONFIG, REFIT["bf16"], mesh, sequences=64, held=held)
    assert colocated.slots == 3  # 6 devices / tensor_parallel 2: one slot per replica group
    devices = [_Device(2**30), _Device(2**31), _Device(2**31), _Device(2**31)]
    split = plan_decode_slots(spec, CONFIG, REFIT["bf16"], mesh, sequences=64, held=held, rollout_devices=devices)
    weights = 2 * (_kernel_weights(CONFIG) + 2 * CONFIG.vocab_size * CONFIG.hidden_size)  # BF16, f32 norms aside
    assert split.slots == 64 and split.limit_bytes == 2**30  # the smallest rollout device's allocator limit
    assert weights // 2 <= split.held_bytes < weights  # the rollout weights, halved over tensor_parallel=2
    assert "of rollout weights" in split.describe() and "GPU allocator" in split.describe()


def test_a_streams_slots_leave_room_for_the_weight_versions_it_holds_ahead():
    """An asynchronous run's RL sampler may hold the loaded rollout weights, up to rollout.max_staleness versions
    published ahead of them and the one the trainer is making: the automatic slot count is planned beside all of
    them; eval and serve's samplers (``rl`` False) and synchronous runs beside one."""
    params = jax.eval_shape(lambda: llama.init_params(CONFIG, jax.random.PRNGKey(0)))
    devices = [_Device(2**31)] * 2
    mesh = _mesh(jax.devices()[2:])

    def held(**overrides):
        spec = plan.sampler_spec(_config(**overrides), rl=True)
        return plan_decode_slots(spec, CONFIG, REFIT["bf16"], mesh, sequences=64, held={"params": params},
                                 rollout_devices=devices)

    one, four = held(), held(**{"rollout.max_staleness": 2})
    assert four.held_bytes == 4 * one.held_bytes and "4 versions of rollout weights" in four.describe()
    assert plan.sampler_spec(_config(**{"rollout.max_staleness": 2})).weight_versions == 1


# -- (b) what one refit moves ------------------------------------------------------------------------------------


def _kernel_weights(model) -> int:
    """The block kernels' weights, by hand: [q|k|v], wo, [gate|up], w_down per layer."""
    d, f = model.hidden_size, model.intermediate_size
    return model.num_layers * (d * (model.q_size + 2 * model.kv_size) + model.q_size * d + 2 * d * f + f * d)


def _spy_transfers(monkeypatch):
    """Every array ``jax.device_put`` sends to other devices than its own, with the sharding it goes to."""
    moved, put = [], jax.device_put

    def spy(x, device=None, **kw):
        flat = jax.tree.leaves(x)
        one = isinstance(device, jax.sharding.Sharding)
        targets = [device] * len(flat) if one else jax.tree.leaves(device, is_leaf=lambda s: s is None)
        moved.extend((a, s) for a, s in zip(flat, targets, strict=True)
                     if isinstance(a, jax.Array) and a.sharding.device_set != s.device_set)
        return put(x, device, **kw)

    monkeypatch.setattr(jax, "device_put", spy)
    return moved


@pytest.mark.parametrize("precision_name, tensor_parallel, devices", [
    ("fp8", 1, 6), ("fp8", 2, 6), ("fp8", 2, 5), ("bf16", 1, 6)],
    ids=["fp8-tp1", "fp8-tp2", "fp8-tp2-train3", "bf16-tp1"])
def test_one_refit_moves_fp8_bytes(monkeypatch, precision_name, tensor_parallel, devices):
    """A refit across the groups moves the FP8 kernels as one byte a weight (about half what BF16 kernels would
    move), bit for bit the weights a colocated rollout quantizes, device to device. 2 rollout devices and 4 training
    devices (FSDP over 4 splits the masters' rows; over 6 it would not divide them); ``train3``: 3 training devices,
    which ``tensor_parallel=2`` does not divide: the bits go whole and the rollout slices them."""
    precision = REFIT[precision_name]
    train, roll = split_devices(2, jax.devices()[:devices])
    mesh = _mesh(train)
    engine = Engine(WIDE, precision, EngineConfig(tensor_parallel=tensor_parallel), mesh=mesh, rollout_devices=roll)
    policy = _on(mesh, WIDE, precision)
    moved = _spy_transfers(monkeypatch)
    got = engine.load_params(*policy)["weights"]
    record = engine.last_refit

    kernels, tables = _kernel_weights(WIDE), 2 * WIDE.vocab_size * WIDE.hidden_size  # embedding and LM head, BF16
    if precision.fp8:
        assert record["bytes"]["float8_e4m3fn"] == kernels
        assert set(record["bytes"]) == {"float8_e4m3fn", "bfloat16", "float32"}
        assert record["bf16_equivalent_bytes"] == record["total_bytes"] + kernels
        ratio = record["total_bytes"] / record["bf16_equivalent_bytes"]
        print(f"{precision_name} tp={tensor_parallel}: {record}, {ratio:.3f} of BF16")
        assert ratio < 0.6
    else:
        assert set(record["bytes"]) == {"bfloat16", "float32"}
        assert record["bf16_equivalent_bytes"] == record["total_bytes"]
    assert record["bytes"]["bfloat16"] == 2 * (tables + (0 if precision.fp8 else kernels))
    assert record["bytes"]["float32"] < 0.05 * record["total_bytes"]  # norms, scales: a few KiB
    assert record["seconds"] > 0

    # what really crossed: from the trainer's devices to the rollout's, as bits, as many bytes as recorded; every
    # slice the rollout holds is a buffer on the trainer's side (a device-to-device copy, no host round trip)
    assert moved and sum(a.nbytes for a, _ in moved) == record["total_bytes"]
    by_dtype = {}
    for a, target in moved:
        by_dtype[a.dtype.name] = by_dtype.get(a.dtype.name, 0) + a.nbytes
        assert a.sharding.device_set <= set(train) and target.device_set <= set(roll)
        have = {tuple((s.start, s.stop) for s in i) for i in a.sharding.devices_indices_map(a.shape).values()}
        need = {tuple((s.start, s.stop) for s in i) for i in target.devices_indices_map(a.shape).values()}
        assert need <= have, (a.shape, a.sharding, target)
    assert by_dtype.get("uint8", 0) == (kernels if precision.fp8 else 0)
    assert by_dtype["uint16"] == record["bytes"]["bfloat16"] and set(by_dtype) <= {"uint8", "uint16", "float32"}

    params, fp8_state, _ = _policy(WIDE, precision)
    want = per_layer(interleave_fused(rollout_params(params, fp8_state, precision, WIDE.num_layers), WIDE,
                                      tensor_parallel))
    got_leaves, tree = jax.tree_util.tree_flatten_with_path(got)
    assert tree == jax.tree.structure(want)
    for (path, g), w in zip(got_leaves, jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.sharding.device_set == set(roll), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))


# -- (c) the same rollout ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_split_rollout_equals_colocated_bit_for_bit(tensor_parallel):
    """The same prompts, keys and weights, sampled in FP8 (FP8 KV cache): the rollout on 2 devices of its own with
    the weights from 4 training devices (FSDP) equals the colocated rollout over the same 2 devices, token for token
    and logprob for logprob."""
    train, roll = split_devices(2, jax.devices()[:6])
    config = EngineConfig(max_concurrent_decodes=8, max_prefill_length=16, max_new_tokens=10,
                          sampling=SamplingParams(), tensor_parallel=tensor_parallel)
    batches = []
    for mesh, rollout_devices in ((_mesh(train), roll), (_mesh(roll), None)):
        engine = Engine(CONFIG, ROLLOUT, config, mesh=mesh, rollout_devices=rollout_devices)
        assert set(engine.mesh.devices.flat) == set(roll)
        weights = engine.load_params(*_on(mesh, CONFIG, ROLLOUT))
        batches.append(driver.generate(engine, weights, PROMPTS, 2, jax.random.PRNGKey(1), steps_per_sync=4))
    split, colocated = batches
    assert not np.array_equal(split.tokens[0], split.tokens[1])  # it sampled: two samples of a prompt differ
    np.testing.assert_array_equal(split.lengths, colocated.lengths)
    np.testing.assert_array_equal(split.tokens, colocated.tokens)
    np.testing.assert_array_equal(split.logprobs, colocated.logprobs)


# -- (e) the trainer ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_trainer_with_its_own_rollout_devices_runs(tmp_path):
    from fp8rl_jax.trainer import Trainer

    config = load_config_file(TINY)
    with config.unlocked():
        config.workdir = str(tmp_path / "run")
        config.steps, config.mesh.rollout_devices = 2, 2
        config.rollout.prompts_per_step = 4  # of 8 samples each: 32 sequences a step
        config.logging.progress = config.logging.plots = False
    trainer = Trainer(config)
    try:
        records = trainer.run()
        assert set(trainer.mesh.devices.flat) == {jax.devices()[2]}  # tiny.py: mesh.fsdp=1, on the first left
        assert set(trainer.engine.mesh.devices.flat) == set(jax.devices()[:2])
        assert trainer.engine.last_refit["bytes"]["float8_e4m3fn"] == _kernel_weights(CONFIG)
    finally:
        trainer.close()
    assert [r["step"] for r in records] == [1, 2]
    values = [v for r in records for v in r.values() if isinstance(v, (int, float))]
    assert values and all(math.isfinite(v) for v in values)
    assert all(r["reward_mean"] >= 0 and r["response_length_mean"] > 0 for r in records)
