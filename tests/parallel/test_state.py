"""Params and optimizer state created on the mesh: the values an unsharded init draws, in the rules' places."""

import os

import jax
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec as P

from fp8rl_jax.config import load_config_file
from fp8rl_jax.model.loading import load_model
from fp8rl_jax.model.sharded import load_model_sharded
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.mesh import make_mesh
from fp8rl_jax.parallel.state import init_sharded
from fp8rl_jax.plan import model_spec
from fp8rl_jax.rl.step import build_optimizer

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "tiny.py")


def test_random_init_on_the_mesh_draws_the_unsharded_values():
    config = load_config_file(TINY)
    mesh = make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 4, "tensor": 2}))
    arch, params, tokenizer = load_model_sharded(model_spec(config), mesh)
    ref_arch, _, _ = load_model(model_spec(config))
    assert arch == ref_arch and tokenizer.vocab_size == arch.vocab_size
    # the threefry RNG is partitionable: each device draws its own shard of the very same numbers as one device
    # running the same jitted init (eager init may differ in the last bit: XLA fuses the scaling differently)
    ref_params = jax.jit(lambda: load_model(model_spec(config))[1])()
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params),
                                 strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    expected = rules.state_shardings(params, mesh)
    assert jax.tree.all(jax.tree.map(lambda a, s: a.sharding == s, params, expected))
    assert params["blocks"]["w_gate_up"].sharding.spec == P(None, "fsdp", "tensor")
    assert params["blocks"]["w_gate_up"].addressable_shards[0].data.shape == (2, 64 // 4, 320 // 2)

    optimizer, _ = build_optimizer(config.optim, 10)
    opt_state = init_sharded(optimizer.init, params, mesh=mesh)
    mu = opt_state[1][0].mu
    assert mu["blocks"]["w_down"].sharding.spec == P(None, "tensor", "fsdp")
    assert mu["blocks"]["w_down"].addressable_shards[0].data.shape == (2, 160 // 2, 64 // 4)
    assert not np.any(np.asarray(mu["blocks"]["w_down"]))
