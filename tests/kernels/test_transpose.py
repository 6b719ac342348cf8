"""``kernels.transpose``: the FP8 wgrad's byte transpose, through Pallas' interpreter on the CPU (the same kernel
body the GPU compiles), alone and under a mesh of forced CPU devices."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.kernels.transpose import transpose_bytes
from fp8rl_jax.parallel import hlo
from fp8rl_jax.parallel.mesh import make_mesh, mesh_context


def _bytes(shape, dtype, seed=0):
    raw = np.random.RandomState(seed).randint(0, 256, shape, np.uint8)
    raw[raw == 0x7F] = 0  # no E4M3 NaN bit patterns (any byte pattern transposes alike; NaNs only upset the check)
    return jnp.asarray(raw).view(dtype)


def _as_np_bytes(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint8])
def test_kernel_is_the_transpose_bit_for_bit(dtype):
    q = _bytes((256, 384), dtype)
    fn = lambda a: transpose_bytes(a, impl="pallas_interpret")
    assert "pallas_call" in str(jax.make_jaxpr(fn)(q))
    got = jax.jit(fn)(q)
    assert got.dtype == q.dtype and got.shape == (384, 256)
    np.testing.assert_array_equal(_as_np_bytes(got), _as_np_bytes(q).T)


def test_shapes_the_blocks_do_not_divide_get_xla_transpose():
    q = _bytes((100, 64), jnp.float8_e4m3fn)
    assert "pallas_call" in str(jax.make_jaxpr(lambda a: transpose_bytes(a, impl="pallas_interpret"))(
        _bytes((128, 256), jnp.float8_e4m3fn)))
    assert "pallas_call" not in str(jax.make_jaxpr(lambda a: transpose_bytes(a, impl="pallas_interpret"))(q))
    np.testing.assert_array_equal(_as_np_bytes(transpose_bytes(q, impl="pallas_interpret")), _as_np_bytes(q).T)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="one-byte"):
        transpose_bytes(jnp.zeros((64, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="impl"):
        transpose_bytes(jnp.zeros((64, 64), jnp.uint8), impl="cuda")


@pytest.mark.parametrize("data,fsdp", [(1, 8), (2, 4)])
def test_under_a_mesh_each_device_transposes_its_own_tokens(data, fsdp):
    mesh = make_mesh(types.SimpleNamespace(data=data, fsdp=fsdp, tensor=1))
    q = _bytes((8 * 128, 256), jnp.float8_e4m3fn)
    batch = tuple(a for a, n in (("data", data), ("fsdp", fsdp)) if n > 1)
    spec = batch if len(batch) > 1 else batch[0]
    q = jax.device_put(q, NamedSharding(mesh, P(spec, None)))
    fn = jax.jit(lambda a: transpose_bytes(a, impl="pallas_interpret"))
    with mesh_context(mesh):
        got = fn(q)
        text = fn.lower(q).compile().as_text()
        assert "shard_map" in str(jax.make_jaxpr(fn)(q)) and "pallas_call" in str(jax.make_jaxpr(fn)(q))
    np.testing.assert_array_equal(_as_np_bytes(got), _as_np_bytes(q).T)
    assert got.sharding.spec == P(None, spec)  # the tokens stay where they were: columns of the transpose
    assert hlo.collectives(text) == [], hlo.collectives(text)


def test_a_kernel_or_a_tensor_parallel_mesh_gets_xla_transpose():
    q = _bytes((256, 128), jnp.float8_e4m3fn)
    for sizes, tokens in (((1, 8, 1), False), ((1, 4, 2), True)):
        mesh = make_mesh(types.SimpleNamespace(data=sizes[0], fsdp=sizes[1], tensor=sizes[2]))
        with mesh_context(mesh):
            jaxpr = str(jax.make_jaxpr(lambda a, tokens=tokens: transpose_bytes(a, tokens=tokens,
                                                                              impl="pallas_interpret"))(q))
        assert "pallas_call" not in jaxpr and "transpose" in jaxpr
