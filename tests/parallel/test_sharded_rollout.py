"""A sharded rollout (FP8 weights pre-quantized on the mesh, FP8 KV cache) equals the single-device one.

Tolerance (f32 compute, xla FP8 backend, tiny preset, 4 prompts x 2 samples, 10 new tokens): the same tokens and
lengths, greedy and sampled with fixed keys (the threefry RNG is partitionable: a key draws the same bits whatever
the sharding); the reported logprobs differ by reduction order only, measured <= 1e-6 (bound 5e-6).
"""

import functools

import jax
import ml_collections
import numpy as np
import pytest

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.mesh import make_mesh
from fp8rl_jax.rollout import driver
from fp8rl_jax.rollout.engine import Engine, EngineConfig
from fp8rl_jax.rollout.sampling import SamplingParams

CONFIG = preset("tiny")
PROMPTS = [list(np.random.RandomState(i).randint(3, CONFIG.vocab_size, size=n)) for i, n in enumerate((5, 9, 3, 12))]
PRECISION = Precision(backend="xla", compute_dtype="float32", kv_cache_dtype="float8_e4m3fn")
MESHES = {"fsdp8": (1, 8, 1), "fsdp4_tensor2": (1, 4, 2), "data2_fsdp4": (2, 4, 1)}
LOGPROB_ATOL = 5e-6


@functools.cache
def _policy():
    params = llama.init_params(CONFIG, jax.random.PRNGKey(0), std=0.1)
    # delayed scales other than 1 (as after some training), so the FP8 kernels and inputs are really rescaled
    fp8_state = jax.tree.map(lambda a: a * 0 + 3.0 if a.ndim == 1 else a, llama.init_fp8_state(CONFIG, PRECISION))
    kv_scales = jax.tree.map(lambda a: a * 20.0, kvq.init_kv_scales(CONFIG.num_layers))
    return params, fp8_state, kv_scales


def _engine(greedy: bool, mesh=None) -> Engine:
    config = EngineConfig(max_concurrent_decodes=8, max_prefill_length=16, max_new_tokens=10,
                          sampling=SamplingParams(greedy=greedy))
    return Engine(CONFIG, PRECISION, config, mesh=mesh)


@functools.cache
def _single_device(greedy: bool):
    engine = _engine(greedy)
    return driver.generate(engine, engine.load_params(*_policy()), PROMPTS, 2, jax.random.PRNGKey(1),
                           steps_per_sync=4)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_rollout_equals_single_device(mesh_name, greedy):
    data, fsdp, tensor = MESHES[mesh_name]
    mesh = make_mesh(ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor}))
    params, fp8_state, kv_scales = _policy()
    # as the trainer holds them: params by the rules, FP8 state and KV scales replicated
    params = jax.device_put(params, rules.state_shardings(params, mesh))
    fp8_state, kv_scales = jax.device_put((fp8_state, kv_scales), rules.replicated(mesh))
    engine = _engine(greedy, mesh)
    with jax.transfer_guard("disallow_explicit"):  # no transfer at all: the new weights never leave the devices
        weights = engine.load_params(params, fp8_state, kv_scales)

    fp8_segment = weights["weights"]["blocks"][0]
    assert fp8_segment["wqkv"].data.sharding == rules.state_shardings(fp8_segment, mesh)["wqkv"].data
    # FP8 values, stored as float8 (GPU) or as their exact f32 values (the CPU GEMM form, fp8.xla.gemm_form)
    assert fp8_segment["wqkv"].data.dtype == np.dtype("float8_e4m3fn" if xla.gemm_form() == "f8" else "float32")
    state = engine.init_decode_state()
    assert state.cache["k"].sharding == rules.cache_sharding(mesh, state.cache["k"].shape)
    assert state.tokens.sharding == rules.batch_sharding(mesh, state.tokens.shape)

    batch = driver.generate(engine, weights, PROMPTS, 2, jax.random.PRNGKey(1), steps_per_sync=4)
    reference = _single_device(greedy)
    np.testing.assert_array_equal(batch.lengths, reference.lengths)
    np.testing.assert_array_equal(batch.tokens, reference.tokens)
    error = float(np.max(np.abs(batch.logprobs - reference.logprobs)))
    print(f"{mesh_name} {'greedy' if greedy else 'sampled'}: max |logprob difference| {error:.2e}")
    assert error < LOGPROB_ATOL
    if not greedy:  # sampling really sampled: samples of one prompt differ
        assert not np.array_equal(batch.tokens[0], batch.tokens[1])
