"""FSDP weight gathers in the GEMM's precision (``parallel.fsdp``), on 8 CPU devices.

The references are computed without a mesh: the whole f32 kernel quantized (``xla.quantize_kernel``) or cast, and
the FP8 / BF16 linear of the whole kernel. The compiled-HLO test reads the train step's collectives
(``bench.collectives_train``, ``parallel.hlo``).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.bench import collectives_train as ct
from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.parallel import fsdp, hlo
from fp8rl_jax.parallel.mesh import make_mesh, mesh_context

MESHES = {"fsdp8": (1, 8, 1), "fsdp4_tensor2": (1, 4, 2), "data2_fsdp4": (2, 4, 1)}
SHAPES = {"wqkv": (64, 96), "wo": (64, 64), "w_gate_up": (64, 160), "w_down": (80, 64)}  # [K, N]


def _mesh(name):
    data, f, tensor = MESHES[name]
    return make_mesh(types.SimpleNamespace(data=data, fsdp=f, tensor=tensor))


def _kernel(name, seed=0):
    # wide-ranged values, so that the quantization saturates, rounds and flushes some of them
    rs = np.random.RandomState(seed)
    w = rs.standard_t(3, SHAPES[name]) * 0.05
    return np.where(rs.rand(*w.shape) < 0.1, w * 1e-5, w).astype(np.float32)  # a tenth flushed to 0 in E4M3


def _bits(a):
    a = np.asarray(a)
    return a.view(f"uint{8 * a.dtype.itemsize}")


def _sharded(mesh, name, w):
    with mesh_context(mesh):
        s = fsdp.kernel_spec(name, w.shape)
    return jax.device_put(w, NamedSharding(mesh, s)), s


@pytest.mark.parametrize("mesh_name", ["fsdp8", "fsdp4_tensor2"])
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("scaling", ["tensor", "rowwise"])
def test_quantized_shards_gathered_equal_the_quantized_whole_kernel(mesh_name, name, scaling):
    mesh = _mesh(mesh_name)
    recipe = Fp8Recipe(scaling=scaling)
    w = _kernel(name)
    meta = {"scale": jnp.float32(448.0 / 0.3), "amax_history": jnp.zeros(16)}  # saturates the largest values
    expected = xla.quantize_kernel(jnp.asarray(w), meta, recipe, "f8")
    sharded, s = _sharded(mesh, name, w)
    assert fsdp.fsdp_dim(s) is not None, s  # the kernel is really sharded over fsdp here

    @jax.jit
    def gathered(w):
        return xla.quantize_kernel(w, meta, recipe, "f8", gather=s)

    with mesh_context(mesh):
        got = gathered(sharded)
        text = gathered.lower(sharded).compile().as_text()
    assert got.data.dtype == jnp.float8_e4m3fn and got.data.shape == expected.data.shape
    np.testing.assert_array_equal(_bits(got.data), _bits(expected.data))
    np.testing.assert_array_equal(np.asarray(got.scale_inv), np.asarray(expected.scale_inv))
    values = np.abs(np.asarray(expected.data, np.float32))
    assert 0 < np.mean(values == 0) < 0.2  # some flushed, most not
    assert scaling == "rowwise" or np.any(values == 448)  # some saturated (per-tensor delayed scale)
    # what crosses the devices: the FP8 bits of the kernel, once (rowwise: plus its per-channel amaxes)
    gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
    assert [(c.dtype, c.bytes) for c in gathers] == [("u8", w.size // mesh.shape["tensor"])], gathers


@pytest.mark.parametrize("name", ["wqkv", "wo"])
def test_gathered_cast_and_its_gradient(name):
    mesh = _mesh("fsdp4_tensor2")
    w = _kernel(name)
    c = np.random.RandomState(1).randn(*w.shape).astype(np.float32)
    sharded, s = _sharded(mesh, name, w)

    def loss(w, cast):
        full = cast(w)
        return jnp.sum(full.astype(jnp.float32) * c) ** 2, full  # a gradient that depends on the forward value

    plain = jax.jit(jax.grad(lambda w: loss(w, lambda a: a.astype(jnp.bfloat16)), has_aux=True))
    expected_grad, expected = plain(jnp.asarray(w))
    with mesh_context(mesh):
        step = jax.jit(jax.grad(lambda w: loss(w, lambda a: fsdp.gathered_cast(a, jnp.bfloat16, s)), has_aux=True))
        grad, full = step(sharded)
        text = step.lower(sharded).compile().as_text()
    assert full.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(full), _bits(expected))
    assert grad.dtype == jnp.float32 and grad.sharding.is_equivalent_to(NamedSharding(mesh, s), 2)  # f32, sharded
    # the loss's sum runs over tensor shards on the mesh: its last bits differ, and the cotangent of the BF16 cast
    # is rounded to BF16, so an element next to a rounding boundary may move by one BF16 ulp (seen on AMD EPYC)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_grad), rtol=2.0**-7)
    gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
    assert {c.dtype for c in gathers} == {"u16"}, gathers


def _pullback_on_shards(mesh, recipe, w, x, g):
    """The FP8 linear's value and its cotangents for ``g`` (dx, dw, the FP8 state's observations) with ``w``
    FSDP-sharded over ``mesh`` as ``w_gate_up`` and ``x`` split over the batch, and the same on one device: (got,
    expected, the kernel's spec)."""
    state = init_linear_state(recipe)
    state["x"]["scale"], state["kernel"]["scale"], state["grad"]["scale"] = (jnp.float32(v) for v in (50, 900, 3e3))

    def pullback(x, w, state, **kw):
        y, vjp = jax.vjp(lambda x, w, st: xla.fp8_matmul(x, w, st, recipe, **kw), x, w, state)
        return (y, *vjp(g))

    expected = jax.jit(pullback)(x, jnp.asarray(w), state)
    sharded, s = _sharded(mesh, "w_gate_up", w)
    with mesh_context(mesh):
        x_sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
        amax = fsdp.kernel_amaxes({"w_gate_up": sharded[None]}, ["w_gate_up"])["w_gate_up"][0]
        got = jax.jit(lambda x, w, st, a: pullback(x, w, st, gather=s, kernel_amax=a))(x_sharded, sharded, state,
                                                                                        amax)
    return got, expected, s


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_fp8_linear_on_shards_equals_the_whole_kernel(mesh_name):
    """Value, input gradient, master gradient and the amax observations of the FP8 linear with a gathered
    kernel against the same linear on one device."""
    mesh = _mesh(mesh_name)
    w = _kernel("w_gate_up")
    rs = np.random.RandomState(2)
    x = rs.randn(32, w.shape[0]).astype(np.float32)
    g = rs.randn(32, w.shape[1]).astype(np.float32)
    got, expected, s = _pullback_on_shards(mesh, Fp8Recipe(), w, x, g)
    names = ("y", "dx", "dw")
    for n, a, b in zip(names, got[:3], expected[:3], strict=True):
        # y contracts over the whole (gathered) K on each device, but XLA:CPU may block a GEMM of N / tensor
        # columns otherwise (an f32 ulp on AMD EPYC); dw sums the batch shards' partial products, and with
        # tensor > 1 dx sums over N's shards: another order. Values are O(1): a few f32 ulps of them
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=n)
    assert got[2].sharding.is_equivalent_to(NamedSharding(mesh, s), 2)  # the master gradient on its shards
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got[3])[0], jax.tree.leaves(expected[3]),
                            strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert float(np.asarray(got[3]["kernel"]["amax_history"])[0]) == float(np.max(np.abs(w)))


# the FP8 linear's other forms (block and current scaling, fewer FP8 GEMMs): their amaxes span the shards, so the f32
# master is gathered first (``xla.quantize_kernel``); the master gradient must still come back on its shards
FORMS = {"block": Fp8Recipe(scaling="block", fp8_format="e4m3"), "current": Fp8Recipe(scaling="current"),
         "fprop_wgrad": Fp8Recipe(fp8_gemms=("fprop", "wgrad"))}


@pytest.mark.parametrize("recipe", list(FORMS))
def test_fp8_linear_forms_on_shards_equal_the_whole_kernel(recipe):
    rs = np.random.RandomState(0)
    w = (0.05 * rs.standard_t(3, (160, 192))).astype(np.float32)  # [K, N]: a partial block along each axis
    x = rs.randn(256, 160).astype(np.float32)
    g = rs.randn(256, 192).astype(np.float32)
    mesh = make_mesh(types.SimpleNamespace(data=2, fsdp=4, tensor=1))
    got, expected, s = _pullback_on_shards(mesh, FORMS[recipe], w, x, g)
    assert fsdp.fsdp_dim(s) is not None
    for n, a, b in zip(("y", "dx", "dw"), got[:3], expected[:3], strict=True):
        # the same FP8 operands; the devices' partial sums of dw (and XLA:CPU's blocking) add in another order
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=n)
    assert got[2].sharding.is_equivalent_to(NamedSharding(mesh, s), 2)  # the master gradient on its shards
    for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(expected[3]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernel_amaxes_are_one_all_reduce():
    mesh = _mesh("fsdp4_tensor2")
    rs = np.random.RandomState(3)
    blocks = {n: rs.randn(3, *SHAPES[n]).astype(np.float32) for n in SHAPES}
    with mesh_context(mesh):
        sharded = {n: jax.device_put(a, NamedSharding(mesh, P(None, *fsdp.kernel_spec(n, a.shape[1:]))))
                   for n, a in blocks.items()}
        f = jax.jit(lambda b: fsdp.kernel_amaxes(b, list(SHAPES)))
        got = f(sharded)
        text = f.lower(sharded).compile().as_text()
    for n, a in blocks.items():
        np.testing.assert_array_equal(np.asarray(got[n]), np.max(np.abs(a), axis=(1, 2)))
    assert [(c.kind, c.shape) for c in hlo.collectives(text)] == [("all-reduce", ((4, 3),))]


def test_no_gather_without_fsdp():
    """On one device and on a mesh without fsdp the forward is the program it was: no shard_map, no gather."""
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.config import preset

    config = preset("tiny")
    precision = Precision(backend="xla")
    params = llama.init_params(config, jax.random.PRNGKey(0))
    state = llama.init_fp8_state(config, precision)
    tokens = jnp.zeros((8, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8), (8, 8))

    def program(mesh):
        def loss(p):
            return llama.forward_hidden(p, tokens, positions, config=config, precision=precision,
                                        fp8_state=state)[0].sum()
        with mesh_context(mesh):
            return str(jax.make_jaxpr(jax.grad(loss))(params))

    assert "shard_map" not in program(None)
    assert "shard_map" not in program(make_mesh(types.SimpleNamespace(data=8, fsdp=1, tensor=1)))
    assert "all_gather" in program(make_mesh(types.SimpleNamespace(data=1, fsdp=8, tensor=1)))


@pytest.fixture(scope="module")
def step_hlo():
    config = ct.small_config()
    return config, {mode: ct.train_step_hlo(config, mode, fsdp=8, remat="full") for mode in ("bf16", "fp8_e2e")}


def test_train_step_gathers_block_weights_in_the_gemm_precision(step_hlo):
    """The fp8_e2e train step under fsdp=8 moves its block weights as FP8 bytes, the bf16 one as BF16; each
    block weight is gathered twice per microbatch (forward, and again in the backward under remat=full), and the
    gather ratio (all all-gather bytes / (G x the model's f32 bytes)) is about a quarter / a half."""
    config, texts = step_hlo
    c = config
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size + 3 * c.hidden_size * (
        c.intermediate_size)
    for mode, dtype, itemsize, bound in (("fp8_e2e", "u8", 1, 0.3), ("bf16", "u16", 2, 0.55)):
        m = ct.measure(texts[mode], config, needed=ct.needed_gathers("full", 1))
        print(mode, {k: v for k, v in m.items() if k != "all_gather_bytes_by_dtype"})
        assert m["weight_gathers"] == 2, (mode, m)
        assert m["weight_gather_dtypes"] == [dtype], (mode, m)
        assert m["weight_gather_bytes"] == 2 * c.num_layers * per_layer * itemsize, (mode, m)
        assert m["gather_ratio"] <= bound, (mode, m)
        assert "f32" not in m["all_gather_dtypes"], (mode, m)  # no f32 master crosses the devices


def test_train_step_reduces_the_kernel_amaxes_once(step_hlo):
    """The FP8 kernels' amaxes of every layer and linear: one all-reduce of a [4, L] array per microbatch, outside
    the loops over layers (the x and gradient amaxes stay per layer: they depend on the activations)."""
    config, texts = step_hlo
    ran = [(c, n) for c, n in hlo.executed(texts["fp8_e2e"]) if n and c.kind == "all-reduce"]
    stacked = [(c, n) for c, n in ran if (4, config.num_layers) in c.shape]
    assert len(stacked) == 1 and stacked[0][1] == 1, stacked


def test_train_section_takes_partial_flags():
    """``train_section`` as the bench module calls it: flags it does not get take their defaults."""
    import argparse

    out = ct.train_section(argparse.Namespace(train_modes="bf16", train_fsdp=4, out="ignored"))
    assert list(out) == ["bf16"]
    m = out["bf16"]
    assert m["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1} and m["remat"] == "full"
    assert m["weight_gather_dtypes"] == ["u16"] and m["gathers_needed"] == 2
    assert m["params_f32_bytes"] == ct.params_f32_bytes(ct.small_config())
    assert m["all_reduce_count"] >= m["all_reduce_ops"] > 0
