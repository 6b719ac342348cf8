"""The sharding rules put each leaf where rules.py says (specs written out by hand for the tiny preset)."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from fp8rl_jax.config import base_config
from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.mesh import make_mesh, mesh_context
from fp8rl_jax.rl.step import build_optimizer
from fp8rl_jax.rollout.weights import rollout_params

CONFIG = preset("tiny")  # V 512, D 64, F 160, N 4, K 2, H 16, L 2: wqkv [2, 64, 128], wo [2, 64, 64]
FP8 = Precision(backend="xla", compute_dtype="float32")


def _mesh(data, fsdp, tensor):
    return make_mesh(ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor}))


def _specs(tree, mesh):
    return jax.tree.map(lambda s: s.spec, rules.state_shardings(tree, mesh))


@functools.cache
def _abstract_params():
    return jax.eval_shape(lambda: llama.init_params(CONFIG, jax.random.PRNGKey(0)))


def test_param_specs_on_fsdp4_tensor2():
    specs = _specs(_abstract_params(), _mesh(1, 4, 2))
    assert specs["embed"] == P("tensor", "fsdp")  # [V, D]
    assert specs["lm_head"] == P("fsdp", "tensor")  # [D, V]
    assert specs["final_norm"] == P()
    b = specs["blocks"]
    assert b["wqkv"] == P(None, "fsdp", "tensor")  # [L, D, (N+2K)H]: layer axis never sharded
    assert b["wo"] == P(None, "tensor", "fsdp")  # [L, NH, D]
    assert b["w_gate_up"] == P(None, "fsdp", "tensor")  # [L, D, 2F]
    assert b["w_down"] == P(None, "tensor", "fsdp")  # [L, F, D]
    assert b["attn_norm"] == b["mlp_norm"] == P()


def test_param_specs_pure_fsdp_and_data_parallel():
    fsdp = _specs(_abstract_params(), _mesh(1, 8, 1))
    assert fsdp["blocks"]["wqkv"] == P(None, "fsdp") and fsdp["blocks"]["w_down"] == P(None, None, "fsdp")
    assert fsdp["embed"] == P(None, "fsdp") and fsdp["lm_head"] == P("fsdp")
    data = _specs(_abstract_params(), _mesh(2, 4, 1))  # data replicates params: the same placement as fsdp=4
    assert data["blocks"]["wqkv"] == P(None, "fsdp") and data["embed"] == P(None, "fsdp")


def test_optimizer_state_mirrors_params_and_small_state_is_replicated():
    mesh = _mesh(1, 4, 2)
    params = _abstract_params()
    state = {
        "params": params,
        "opt_state": jax.eval_shape(build_optimizer(base_config().optim, 10)[0].init, params),
        "fp8_state": jax.eval_shape(lambda: llama.init_fp8_state(CONFIG, FP8.replace(lm_head_fp8=True))),
        "kv_scales": jax.eval_shape(lambda: kvq.init_kv_scales(CONFIG.num_layers)),
        "rng": jax.eval_shape(lambda: jax.random.PRNGKey(0)),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    specs = _specs(state, mesh)
    adam = specs["opt_state"][1][0]  # the trainer's chain(clip, adamw): adamw's first state is ScaleByAdamState
    assert adam.mu["blocks"]["wqkv"] == adam.nu["blocks"]["wqkv"] == P(None, "fsdp", "tensor")
    assert adam.mu["embed"] == P("tensor", "fsdp") and adam.count == P()
    # fp8_state mirrors the linears' names ("wqkv", "lm_head") but is replicated whole: same scales everywhere
    assert set(jax.tree.leaves(specs["fp8_state"])) == {P()}
    assert specs["fp8_state"]["lm_head"]["x"]["amax_history"] == P()
    assert specs["kv_scales"] == {"k": P(), "v": P()} and specs["rng"] == P() and specs["step"] == P()


def test_rollout_kernels_are_sharded_like_their_masters_transposed():
    mesh = _mesh(2, 2, 2)
    precision = FP8.replace(bf16_first_layers=1, lm_head_fp8=True)
    fp8_state = llama.init_fp8_state(CONFIG, precision)
    weights = jax.eval_shape(functools.partial(rollout_params, precision=precision, num_layers=2),
                             _abstract_params(), fp8_state)
    specs = _specs(weights, mesh)
    bf16_seg, fp8_seg = specs["blocks"]  # layer 0 in BF16 (cast master layout), layer 1 pre-quantized
    assert bf16_seg["wqkv"] == P(None, "fsdp", "tensor")
    assert fp8_seg["wqkv"].data == P(None, "tensor", "fsdp")  # data [L, N, K]: wqkv's [L, K, N] axes swapped
    assert fp8_seg["wo"].data == P(None, "fsdp", "tensor")
    assert fp8_seg["w_down"].data == P(None, "fsdp", "tensor")
    assert fp8_seg["wqkv"].scale_inv == P()
    assert specs["lm_head"].data == P("tensor", "fsdp")  # [V, D], the head [D, V] transposed


@pytest.mark.parametrize("logical, shape, mesh_shape, expected", [
    (("batch", None), (16, 7), {"data": 2, "fsdp": 4}, P(("data", "fsdp"))),
    (("batch", None), (4, 7), {"data": 2, "fsdp": 4}, P("data")),  # 8 does not divide 4: the prefix that does
    (("batch", None), (3, 7), {"data": 2, "fsdp": 4}, P()),  # nothing divides 3: replicated
    (("batch", None), (1, 7), {"data": 1, "fsdp": 8}, P()),  # a prefill's single sequence
    ((None, "batch", "kv_heads", None, None), (2, 16, 2, 32, 16), {"fsdp": 2, "tensor": 4}, P(None, "fsdp")),
    (("vocab", "embed"), (510, 64), {"fsdp": 4, "tensor": 2}, P("tensor", "fsdp")),
    (("vocab", "embed"), (511, 64), {"fsdp": 4, "tensor": 2}, P(None, "fsdp")),
    (("embed", "embed"), (64, 64), {"fsdp": 4}, P("fsdp")),  # a mesh axis is used once per array
    (("embed", "qkv"), (64, 128), {"data": 1, "fsdp": 1, "tensor": 1}, P()),  # size-1 axes shard nothing
])
def test_spec_keeps_what_divides_and_replicates_the_rest(logical, shape, mesh_shape, expected):
    assert rules.spec(logical, shape, mesh_shape) == expected


def test_decode_state_cache_and_token_batches():
    mesh = _mesh(2, 4, 1)
    cache = {"k": jax.ShapeDtypeStruct((2, 16, 2, 40, 16), jnp.float8_e4m3fn)}
    state = {"cache": cache, "tokens": jax.ShapeDtypeStruct((16,), jnp.int32),
             "keys": jax.ShapeDtypeStruct((16, 2), jnp.uint32)}
    specs = jax.tree.map(lambda s: s.spec, rules.decode_state_shardings(state, mesh))
    assert specs == {"cache": {"k": P(None, ("data", "fsdp"))}, "tokens": P(("data", "fsdp")),
                     "keys": P(("data", "fsdp"))}
    assert rules.cache_sharding(_mesh(1, 4, 2), (2, 16, 2, 40, 16)).spec == P(None, "fsdp", "tensor")
    assert rules.batch_sharding(mesh, (3, 16, 40), batch_axis=1).spec == P(None, ("data", "fsdp"))


def test_constrain_applies_only_under_a_mesh():
    mesh = _mesh(1, 8, 1)
    x = np.ones((8, 4, 6), np.float32)
    unconstrained = jax.jit(lambda a: rules.constrain(a * 2, rules.RESIDUAL_AXES)).lower(x).as_text()
    assert "sharding_constraint" not in unconstrained and "mhlo.sharding" not in unconstrained
    with mesh_context(mesh):
        y = jax.jit(lambda a: rules.constrain(a * 2, rules.RESIDUAL_AXES))(x)
    assert y.sharding.spec == P("fsdp") and len(y.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(y), 2 * x)
