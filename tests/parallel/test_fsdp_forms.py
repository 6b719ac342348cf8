"""The FP8 linear's other forms (block and current scaling, fewer FP8 GEMMs) with an FSDP-sharded kernel, on 8 CPU
devices, against the same linear on one device. Their amaxes span the shards, so the f32 master is gathered first
(``xla.quantize_kernel``); the master gradient must still come back on its shards."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.parallel import fsdp
from fp8rl_jax.parallel.mesh import make_mesh, mesh_context

RECIPES = {"block": Fp8Recipe(scaling="block", fp8_format="e4m3"), "current": Fp8Recipe(scaling="current"),
           "fprop_wgrad": Fp8Recipe(fp8_gemms=("fprop", "wgrad"))}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_linear_forms_on_shards_equal_the_whole_kernel(recipe):
    recipe = RECIPES[recipe]
    mesh = make_mesh(types.SimpleNamespace(data=2, fsdp=4, tensor=1))
    rs = np.random.RandomState(0)
    w = (0.05 * rs.standard_t(3, (160, 192))).astype(np.float32)  # [K, N]: a partial block along each axis
    x = rs.randn(256, 160).astype(np.float32)
    g = rs.randn(256, 192).astype(np.float32)
    state = init_linear_state(recipe)
    state["x"]["scale"], state["kernel"]["scale"], state["grad"]["scale"] = (jnp.float32(v) for v in (50, 900, 3e3))

    def pullback(x, w, state, **kw):
        y, vjp = jax.vjp(lambda x, w, st: xla.fp8_matmul(x, w, st, recipe, **kw), x, w, state)
        return (y, *vjp(g))

    expected = jax.jit(pullback)(x, jnp.asarray(w), state)
    with mesh_context(mesh):
        s = fsdp.kernel_spec("w_gate_up", w.shape)
        sharded = jax.device_put(w, NamedSharding(mesh, s))
        x_sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
        amax = fsdp.kernel_amaxes({"w_gate_up": sharded[None]}, ["w_gate_up"])["w_gate_up"][0]
        got = jax.jit(lambda x, w, st, a: pullback(x, w, st, gather=s, kernel_amax=a))(x_sharded, sharded, state,
                                                                                        amax)
    assert fsdp.fsdp_dim(s) is not None
    for n, a, b in zip(("y", "dx", "dw"), got[:3], expected[:3], strict=True):
        # the same FP8 operands; the devices' partial sums of dw (and XLA:CPU's blocking) add in another order
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=n)
    assert got[2].sharding.is_equivalent_to(NamedSharding(mesh, s), 2)  # the master gradient on its shards
    for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(expected[3]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
