"""A sharded train step equals the single-device one, and its FP8 state is replicated and identical everywhere.

Tolerances (f32 compute on CPU, tiny preset, SGD with momentum: after one step the momentum trace is the gradient
itself). Sharding changes only the order of reductions (partial sums over fsdp / tensor shards, then a collective).
Measured with ``pytest -s`` (the printed ``worst`` values), bounded here with a margin:
  gradients (the trace), max |sharded - single| / max |single| per leaf: <= 1.6e-6 (bound 1e-5)
  params after the update, same measure: <= 1e-7, i.e. f32 rounding (bound 1e-6)
  loss: f32 rounding (rtol 1e-5)
  FP8 state: replicated and bitwise identical on every device; the ``kernel`` amaxes equal the single-device
  ones exactly (the weights are the same bits before the step); the ``x`` / ``grad`` amaxes and the scales,
  which see activations whose last bits depend on the reduction order, agree to 2.2e-7 relative (bound 2e-6).
"""

import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe
from fp8rl_jax.model import llama, mlp
from fp8rl_jax.model.config import preset
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.mesh import make_mesh
from fp8rl_jax.rl.step import LossConfig, make_train_step

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

CONFIG = preset("tiny")
MESHES = {"fsdp8": (1, 8, 1), "fsdp4_tensor2": (1, 4, 2), "data2_fsdp4": (2, 4, 1)}
PRECISIONS = {"fp8": Precision(backend="xla", compute_dtype="float32"),
              "fp8_head": Precision(backend="xla", compute_dtype="float32", lm_head_fp8=True),
              "fp8_head_grad": Precision(backend="xla", compute_dtype="float32", lm_head_grad_fp8=True),
              "fp8_head_recompute": Precision(backend="xla", compute_dtype="float32", lm_head_grad_fp8=True,
                                              lm_head_recompute_fp8=True),
              "f32": Precision(backend="bf16", compute_dtype="float32")}
TOLERANCE = {"params": 1e-6, "opt_state": 1e-5}  # max |sharded - single| / max |single|, per leaf
AMAX_RTOL = 2e-6
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


def _minibatch(microbatches=2, sequences=8, length=24):
    rs = np.random.RandomState(0)
    shape = (microbatches, sequences, length)
    return {"tokens": rs.randint(0, CONFIG.vocab_size, shape).astype(np.int32),
            "mask": (rs.rand(*shape) > 0.3).astype(np.float32),
            "old_logp": -rs.rand(*shape).astype(np.float32),
            "rollout_logp": -rs.rand(*shape).astype(np.float32),
            "advantages": rs.randn(microbatches, sequences).astype(np.float32)}


def _state(precision):
    params = llama.init_params(CONFIG, jax.random.PRNGKey(0), std=0.1)
    fp8_state = llama.init_fp8_state(CONFIG, precision)
    # a second history row, so that scales are not all 1 and the step quantizes with real delayed scales
    fp8_state = jax.tree.map(lambda a: a.at[..., 1].set(3.0) if a.ndim and a.shape[-1] == 16 else a, fp8_state)
    return {"params": params, "opt_state": OPTIMIZER.init(params), "fp8_state": fp8_state,
            "kv_scales": kvq.init_kv_scales(CONFIG.num_layers), "rng": jax.random.PRNGKey(0), "step": jnp.int32(0)}


@functools.cache
def _single_device(precision_name):
    precision = PRECISIONS[precision_name]
    state, metrics = make_train_step(CONFIG, precision, OPTIMIZER, LossConfig())(_state(precision), _minibatch())
    return jax.device_get(state), jax.device_get(metrics)


def _relative_error(got, expected):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


def _check_step(precision_name, mesh_name, remat="none"):
    precision = PRECISIONS[precision_name]
    data, fsdp, tensor = MESHES[mesh_name]
    mesh = make_mesh(ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor}))
    before = _state(precision)
    sharding = rules.state_shardings(before, mesh)
    step = make_train_step(CONFIG, precision, OPTIMIZER, LossConfig(), remat=remat, state_sharding=sharding)
    state, metrics = step(jax.device_put(before, sharding), _minibatch())
    reference, ref_metrics = _single_device(precision_name)

    # the state comes back where the rules put it
    got = jax.tree.map(lambda a: a.sharding, state)
    assert jax.tree.all(jax.tree.map(lambda a, s: a == s, got, sharding))
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5, atol=1e-7)
    assert bool(metrics["finite"])

    worst = {}
    for part in ("params", "opt_state"):
        paths = jax.tree_util.tree_flatten_with_path(state[part])[0]
        for (path, got), expected in zip(paths, jax.tree.leaves(reference[part]), strict=True):
            err = _relative_error(jax.device_get(got), expected)
            worst[part] = max(worst.get(part, 0.0), err)
            assert err < TOLERANCE[part], f"{part}{jax.tree_util.keystr(path)}: differs by {err:.2e}"

    if precision.fp8:
        fp8_paths = jax.tree_util.tree_flatten_with_path(state["fp8_state"])[0]
        for (path, array), ref in zip(fp8_paths, jax.tree.leaves(reference["fp8_state"]), strict=True):
            name = jax.tree_util.keystr(path)
            # replicated, and the very same bits on every device: every device quantizes with the same scales
            assert array.sharding.is_fully_replicated and len(array.sharding.device_set) == mesh.devices.size
            shards = [np.asarray(s.data) for s in array.addressable_shards]
            assert all(np.array_equal(shards[0], s) for s in shards[1:]), name
            if "'kernel'" in name:
                np.testing.assert_array_equal(shards[0], ref, err_msg=name)
            else:
                err = float(np.max(np.abs(shards[0] - ref) / np.maximum(np.abs(ref), 1e-30)))
                worst["fp8 amax/scale"] = max(worst.get("fp8 amax/scale", 0.0), err)
                assert err < AMAX_RTOL, f"{name}: {err:.2e}"
        observed = np.asarray(state["fp8_state"]["blocks"]["wqkv"]["x"]["amax_history"])[:, 0]
        assert np.all(observed > 0)  # the step did observe (not a vacuous comparison of untouched zeros)
    print(f"{precision_name} {mesh_name} remat={remat}: worst {worst}")


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_fp8_train_step_equals_single_device(mesh_name):
    _check_step("fp8", mesh_name)


@pytest.mark.parametrize("mesh_name", ["fsdp8", "fsdp4_tensor2"])
def test_sharded_fp8_head_train_step_equals_single_device(mesh_name):
    """The FP8 head's custom VJP under FSDP: its kernel's shards quantized where they are, the FP8 bits gathered,
    the gradient reduce-scattered back (``fp8_heads.fp8_chunked_head_logprobs``)."""
    _check_step("fp8_head", mesh_name)


@pytest.mark.parametrize("precision_name", ["fp8_head_grad", "fp8_head_recompute"])
def test_sharded_fp8_head_grad_train_step_equals_single_device(precision_name):
    """The BF16 head with FP8 backward GEMMs under FSDP (``fp8_heads.fp8_grad_head_logprobs``): the BF16 forward's
    gathered cast, the kernel's shards quantized where they are in the backward and their FP8 bits gathered (both
    layouts with ``lm_head_recompute_fp8``), the gradient reduce-scattered back."""
    _check_step(precision_name, "fsdp4_tensor2")


def test_sharded_f32_train_step_equals_single_device():
    _check_step("f32", "fsdp4_tensor2")


def test_remat_full_changes_nothing_but_memory():
    tokens = jnp.zeros((2, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))

    def program(remat):
        forward = lambda p: llama.forward_hidden(p, tokens, positions, config=CONFIG, precision=PRECISIONS["f32"],
                                                 remat=remat)[0].sum()
        return str(jax.make_jaxpr(forward)(llama.init_params(CONFIG, jax.random.PRNGKey(0))))

    remat = re.compile(r"\b(remat\w*|checkpoint)\[")  # the jax.checkpoint primitive (remat2 in JAX 0.10)
    assert remat.search(program("full"))  # the knob reaches the scan body
    if jax.default_backend() != "cpu":  # on CPU llama rematerializes the blocks under grad anyway (XLA:CPU speed)
        assert not remat.search(program("none"))
    _check_step("fp8", "data2_fsdp4", remat="full")


def test_unknown_remat_is_refused():
    step = make_train_step(CONFIG, PRECISIONS["f32"], OPTIMIZER, LossConfig(), remat="some")
    with pytest.raises(ValueError, match="remat='some'"):
        step(_state(PRECISIONS["f32"]), _minibatch())


def test_sharded_packed_train_step_equals_single_device():
    """A packed minibatch (rl.packing: its rows split over data x fsdp, the loop over the filled microbatches, sums
    per segment) on 8 devices against one device; FP8 (xla), the tolerances above."""
    from fp8rl_jax.rl.packing import PackingPlan, pack

    precision = PRECISIONS["fp8"]
    rs = np.random.RandomState(1)
    lengths = rs.randint(6, 31, 40)
    tokens = [rs.randint(0, CONFIG.vocab_size, n).astype(np.int32) for n in lengths]
    per_token = {"mask": [(rs.rand(n) > 0.3).astype(np.float32) for n in lengths],
                 "old_logp": [-rs.rand(n).astype(np.float32) for n in lengths],
                 "rollout_logp": [-rs.rand(n).astype(np.float32) for n in lengths]}
    plan = PackingPlan(width=32, rows=8, microbatches=5, max_segments=2, sequences=40)
    packed = pack(plan, tokens, per_token, {"advantages": rs.randn(40).astype(np.float32)})
    assert 1 < int(packed.pop("microbatches")) < plan.microbatches  # several filled, one of padding at least
    del packed["placement"]
    loss_cfg = LossConfig(loss_agg="seq_mean_token_mean", is_correction="seq_tis")
    reference, ref_metrics = make_train_step(CONFIG, precision, OPTIMIZER, loss_cfg, packed_sequences=40)(
        _state(precision), packed)
    mesh = make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 8, "tensor": 1}))
    before = _state(precision)
    sharding = rules.state_shardings(before, mesh)
    step = make_train_step(CONFIG, precision, OPTIMIZER, loss_cfg, state_sharding=sharding, packed_sequences=40)
    state, metrics = step(jax.device_put(before, sharding), packed)
    assert bool(metrics["finite"])
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    for part in ("params", "opt_state"):
        for got, expected in zip(jax.tree.leaves(state[part]), jax.tree.leaves(reference[part]), strict=True):
            assert _relative_error(jax.device_get(got), jax.device_get(expected)) < TOLERANCE[part], part
    for got, expected in zip(jax.tree.leaves(state["fp8_state"]), jax.tree.leaves(reference["fp8_state"]),
                             strict=True):
        np.testing.assert_allclose(jax.device_get(got), jax.device_get(expected), rtol=AMAX_RTOL)


def test_block_fused_mlp_under_a_data_mesh_equals_the_two_linears(monkeypatch):
    """Block scaling's MLP in one custom VJP (``fp8.block_mlp``) under a mesh of 8 data-parallel devices: the same
    loss and, in f32 compute (where its f32 SwiGLU gradient and autodiff's are the same arithmetic), the same
    gradients as the two linears' autodiff, to f32 rounding. (Against one device, block's weight gradients differ
    more: their 128-token tiles hold other tokens when the batch is split.)"""
    taken = []
    fused_mlp = mlp.fused_mlp
    monkeypatch.setattr(mlp, "fused_mlp", lambda *a: taken.append(fused_mlp(*a)) or taken[-1])
    mesh = make_mesh(ml_collections.ConfigDict({"data": 8, "fsdp": 1, "tensor": 1}))
    out = {}
    for fused in (True, False):
        precision = Precision(backend="xla", compute_dtype="float32", recipe=Fp8Recipe(scaling="block",
                              fp8_format="e4m3"), fused_mlp=fused)
        before = _state(precision)
        sharding = rules.state_shardings(before, mesh)
        step = make_train_step(CONFIG, precision, OPTIMIZER, LossConfig(), state_sharding=sharding)
        state, metrics = step(jax.device_put(before, sharding), _minibatch())
        out[fused] = jax.device_get(state["opt_state"]), float(metrics["loss"]), set(taken)
        taken.clear()
    assert (out[True][2], out[False][2]) == ({"block"}, {None})
    assert out[True][1] == pytest.approx(out[False][1], rel=1e-6)
    for a, b in zip(jax.tree.leaves(out[True][0]), jax.tree.leaves(out[False][0]), strict=True):
        assert _relative_error(a, b) < 1e-5
