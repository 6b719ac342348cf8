"""The ``te`` backend's own code on the CPU, with a stand-in for Transformer Engine's GEMM.

TE does not run here; its GEMM's contract does: FP8 operands with inverse scales, both contracted on their last axis
(Hopper's FP8 GEMMs take only that layout, and TE refuses any other), a contracting size divisible by 16, the output
written in the left operand's ``dq_dtype``. The stand-in checks that contract and computes the GEMM in f32 (exact
products of FP8 values), so the layouts, scales and dtypes of ``te.py``'s forward and backward are checked against
the ``xla`` backend on the same operands. The real GEMMs are checked on the GPU (``test_te_gpu.py``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import te, xla
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state, quantize, with_input_scale_inv

RECIPE = Fp8Recipe()


@dataclasses.dataclass
class _Scaled:
    data: jax.Array
    scale_inv: jax.Array
    dq_dtype: object


class _Factory:
    @staticmethod
    def create_1x(data, scale_inv, *, scaling_mode, dq_dtype):
        assert scaling_mode == "delayed" and scale_inv.shape == (1,) and scale_inv.dtype == jnp.float32
        assert data.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2), data.dtype
        return _Scaled(data, scale_inv, jnp.dtype(dq_dtype))


class _Tex:
    calls: list = []

    @classmethod
    def gemm(cls, lhs, rhs, contracting_dims):
        assert contracting_dims == ((1,), (1,)), f"not K-major on both sides: {contracting_dims}"
        assert lhs.data.shape[1] == rhs.data.shape[1] and lhs.data.shape[1] % 16 == 0, (lhs.data.shape, rhs.data.shape)
        cls.calls.append((lhs.data.dtype, rhs.data.dtype, lhs.dq_dtype))
        y = jax.lax.dot_general(lhs.data.astype(jnp.float32), rhs.data.astype(jnp.float32),
                                (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return (y * (lhs.scale_inv[0] * rhs.scale_inv[0])).astype(lhs.dq_dtype)


@pytest.fixture
def fake_te(monkeypatch):
    _Tex.calls = []
    monkeypatch.setattr(te, "_te", lambda: {"tex": _Tex, "Factory": _Factory, "Mode": type("M", (), {
        "DELAYED_TENSOR_SCALING": "delayed"})})
    te._fp8_matmul_fn.cache_clear()
    te._fp8_swiglu_mlp_fn.cache_clear()
    yield _Tex
    te._fp8_matmul_fn.cache_clear()
    te._fp8_swiglu_mlp_fn.cache_clear()


def _inputs(m=64, k=96, n=48):
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(m, k), jnp.bfloat16)
    w = jnp.asarray(rng.randn(k, n) * 0.05, jnp.float32)
    g = jnp.asarray(rng.randn(m, n) * 1e-2, jnp.float32)
    st = init_linear_state(RECIPE)
    st["x"]["scale"] = jnp.float32(448 / 3.0)  # some of x saturates
    st["kernel"]["scale"] = jnp.float32(448 / 0.2)
    st["grad"]["scale"] = jnp.float32(57344 / 0.03)
    return x, w, g, st


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_forward_backward_and_observations_equal_the_xla_backend(fake_te, out_dtype):
    x, w, g, st = _inputs()
    g = g.astype(out_dtype)
    outs = {}
    for name, backend in (("xla", xla), ("te", te)):
        fn = jax.jit(lambda a, b, s, backend=backend: jax.vjp(
            lambda a, b, s: backend.fp8_matmul(a, b, s, RECIPE, out_dtype), a, b, s))
        y, vjp = fn(x, w, st)
        outs[name] = (y, *vjp(g))
    (y_x, dx_x, dw_x, obs_x), (y_t, dx_t, dw_t, obs_t) = outs["xla"], outs["te"]
    assert y_t.dtype == out_dtype and dx_t.dtype == x.dtype and dw_t.dtype == w.dtype
    # the same FP8 operands and f32 products: equal up to the order of the f32 sums
    np.testing.assert_allclose(np.asarray(y_t, np.float32), np.asarray(y_x, np.float32), rtol=1e-2, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx_t, np.float32), np.asarray(dx_x, np.float32), rtol=1e-2, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw_t), np.asarray(dw_x), rtol=1e-5, atol=1e-7)
    for role in ("x", "kernel", "grad"):
        np.testing.assert_array_equal(obs_t[role]["amax_history"], obs_x[role]["amax_history"])
    # three GEMMs (forward, dgrad, wgrad), E4M3 forward and E5M2 gradient operands, outputs in the wanted dtypes
    assert [c[2] for c in fake_te.calls] == [jnp.dtype(out_dtype), jnp.dtype(x.dtype), jnp.dtype(w.dtype)]
    assert fake_te.calls[1][0] == jnp.float8_e5m2 and fake_te.calls[2][1] == jnp.float8_e5m2


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_rollout_and_training_forward_are_the_same_gemm(fake_te, out_dtype):
    """Through ``linear``: the rollout's pre-quantized kernel and the training forward give the same output in the
    wanted dtype (an f32 output, ``wo`` and ``w_down`` into the residual stream, is not rounded to BF16 in either)."""
    from fp8rl_jax.fp8.linear import linear
    from fp8rl_jax.fp8.policy import Precision

    precision = Precision(backend="te")
    x, w, _, st = _inputs(m=8)
    train = jax.jit(lambda x, w: linear(x, w, st, precision, out_dtype))(x, w)
    qw = xla.quantize_kernel(w, st["kernel"], precision.recipe, "f8")  # as rollout.weights makes it on a GPU
    roll = jax.jit(lambda x, qw: linear(x, qw, st, precision, out_dtype))(x, qw)
    assert train.dtype == roll.dtype == out_dtype
    assert [c[2] for c in fake_te.calls] == [jnp.dtype(out_dtype)] * 2  # written so by the GEMM itself
    # the same FP8 operands and scales; the stand-in's f32 sums may run in another order on XLA:CPU (one ulp; TE's
    # GEMM gives the same bits, tests/fp8/test_te_gpu.py)
    np.testing.assert_allclose(np.asarray(roll, np.float32), np.asarray(train, np.float32), rtol=2e-7, atol=0)
    # the rollout's state carries 1/scale of the input, made once per RL step (``recipe.with_input_scale_inv``):
    # the same value, and no division left in the step
    st_inv = with_input_scale_inv(st)
    step = lambda x, qw: linear(x, qw, st_inv, precision, out_dtype)
    assert "div" not in str(jax.make_jaxpr(step)(x, qw))
    np.testing.assert_array_equal(np.asarray(jax.jit(step)(x, qw), np.float32), np.asarray(roll, np.float32))
    # an input already quantized with the input scale (the decode attention kernel's output) goes to the GEMM as
    # it is: the same result
    x8 = quantize(x.astype(precision.dtype), st["x"]["scale"], precision.recipe.fwd_dtype)
    pre = jax.jit(lambda x8, qw: linear(x8, qw, st_inv, precision, out_dtype))(x8, qw)
    np.testing.assert_array_equal(np.asarray(pre, np.float32), np.asarray(roll, np.float32))
    with pytest.raises(TypeError, match="pre-quantized: it needs a QuantizedKernel"):
        linear(x8, w, st, precision, out_dtype)


def tiny_model(tokens_shape=(2, 16), **sizes):
    """A tiny Llama (``sizes`` override its shape), random tokens and an FP8 state whose scales come from one observed
    xla-backend step, so that nothing sits at scale 1. Returns (llama, config, params, tokens, te precision, state);
    ``test_te_gpu.py`` uses it too."""
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.fp8.recipe import update_state
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.config import preset

    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
             "num_layers": 3, **sizes}
    config = preset("tiny").replace(**sizes)
    params = llama.init_params(config, jax.random.PRNGKey(0), std=0.05)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, tokens_shape))
    precision = Precision(backend="te")
    state = llama.init_fp8_state(config, precision)
    ref = precision.replace(backend="xla")
    loss = lambda s: llama.forward(params, tokens, config=config, precision=ref, fp8_state=s)[0].sum()
    state = update_state(state, jax.grad(loss)(state), ref.recipe)
    return llama, config, params, tokens, precision, state


def hoisted_loss(config, precision, tokens):
    """``(params, fp8_state, update_kernels) -> loss``: a sum of squares of ``forward_hidden``'s output under full
    remat, with the kernels made once for the update (``llama.update_kernels``) or, given None, in every forward."""
    from fp8rl_jax.model import llama

    def loss(params, state, hoisted):
        hidden, _, _ = llama.forward_hidden(params, tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
                                            config=config, precision=precision, fp8_state=state, remat="full",
                                            update_kernels=hoisted)
        return jnp.sum(hidden.astype(jnp.float32) ** 2)

    return loss


def test_kernels_quantized_once_per_update_give_the_same_step(fake_te, monkeypatch):
    """``llama.update_kernels``: the FP8 operands made once for an update give the same loss, gradients (into the
    masters) and FP8 observations as quantizing the kernels in every forward, and the forward really reads them.
    (With the MLP's two linears as such: its fused form, which the hoisted kernels enable, has a test of its own.)"""
    from fp8rl_jax.model import mlp

    llama, config, params, tokens, precision, state = tiny_model()
    monkeypatch.setattr(mlp, "fused_mlp", lambda *args: False)
    hoisted = llama.update_kernels(params, state, config, precision)
    assert set(hoisted) == {"wqkv", "wo", "w_gate_up", "w_down"}
    assert hoisted["w_down"]["nk"].shape == (3, 64, 128) and hoisted["w_down"]["nk"].dtype == jnp.float8_e4m3fn

    grad = jax.jit(jax.value_and_grad(hoisted_loss(config, precision, tokens), argnums=(0, 1)))
    (l0, (g0, o0)), (l1, (g1, o1)) = grad(params, state, None), grad(params, state, hoisted)
    assert float(l0) == float(l1)
    for a, b in zip(jax.tree.leaves((g0, o0)), jax.tree.leaves((g1, o1)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wrong = {**hoisted, "wo": {**hoisted["wo"], "nk": jnp.zeros_like(hoisted["wo"]["nk"])}}
    assert float(grad(params, state, wrong)[0]) != float(l0)


def mlp_vjps(m: int, d: int, f: int, seed: int, weight_std: tuple[float, float], amaxes) -> dict:
    """An MLP of random ``x`` [m, d], ``w_gate_up`` [d, 2f], ``w_down`` [f, d] with two linear states (``amaxes``: per
    linear the (x, kernel, grad) amaxes its scales come from), differentiated at a random f32 cotangent in two ways:
    ``te.fp8_swiglu_mlp`` with kernels made once for the update ("fused") and the two ``te.fp8_matmul`` calls it
    replaces ("two"). Each: (y, dx, dw_gate_up, dw_down, observations of w_gate_up, of w_down). ``test_te_gpu.py``
    runs it on TE's GEMMs."""
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.randn(m, d), jnp.bfloat16)
    w_gu = jnp.asarray(rng.randn(d, 2 * f) * weight_std[0], jnp.float32)
    w_down = jnp.asarray(rng.randn(f, d) * weight_std[1], jnp.float32)
    g = jnp.asarray(rng.randn(m, d) * 1e-2, jnp.float32)
    states = []
    for linear_amaxes in amaxes:
        st = init_linear_state(RECIPE)
        for role, a in zip(("x", "kernel", "grad"), linear_amaxes, strict=True):
            st[role]["scale"] = jnp.float32((57344 if role == "grad" else 448) / a)
        states.append(st)
    hoisted = [te.quantize_for_update(w, st["kernel"]["scale"], RECIPE)
               for w, st in zip((w_gu, w_down), states, strict=True)]

    def two_linears(x, w_gu, w_down, st_gu, st_down):
        gate, up = jnp.split(te.fp8_matmul(x, w_gu, st_gu, RECIPE), 2, axis=-1)
        return te.fp8_matmul(jax.nn.silu(gate) * up, w_down, st_down, RECIPE, jnp.float32)

    def fused(x, w_gu, w_down, st_gu, st_down):
        k_gu, k_down = (dataclasses.replace(k, master=w) for k, w in zip(hoisted, (w_gu, w_down), strict=True))
        return te.fp8_swiglu_mlp(x, k_gu, k_down, st_gu, st_down, RECIPE, jnp.float32)

    outs = {}
    for name, fn in (("two", two_linears), ("fused", fused)):
        y, vjp = jax.jit(lambda *a, fn=fn: jax.vjp(fn, *a))(x, w_gu, w_down, *states)
        outs[name] = (y, *vjp(g))
    return outs


def test_fused_mlp_forward_is_the_two_linears_and_its_backward_follows_them(fake_te):
    """``te.fp8_swiglu_mlp`` (what the training step runs with kernels made once for the update) against the two
    ``fp8_matmul`` calls it replaces: the same output bit for bit (the rollout runs the two linears), gradients and
    observations within the FP8 rounding that its f32 SwiGLU backward (BF16 in autodiff) can move."""
    outs = mlp_vjps(m=64, d=32, f=64, seed=3, weight_std=(0.2, 0.1), amaxes=((4.0, 0.8, 0.05), (1.0, 0.4, 0.02)))
    (y0, *grads0), (y1, *grads1) = outs["two"], outs["fused"]
    assert y1.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    for a, b in zip(grads0[:3], grads1[:3], strict=True):  # dx, dw_gate_up, dw_down
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=0, atol=0.15 * np.abs(a).max())  # an E5M2 step of a few terms
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.999
    for obs0, obs1 in zip(grads0[3:], grads1[3:], strict=True):
        for role in ("x", "kernel", "grad"):
            np.testing.assert_allclose(obs1[role]["amax_history"], obs0[role]["amax_history"], rtol=1e-2)
    # the kernel amaxes and the gate/up input's are the same values
    for obs0, obs1 in zip(grads0[3:], grads1[3:], strict=True):
        np.testing.assert_array_equal(obs1["kernel"]["amax_history"], obs0["kernel"]["amax_history"])
    np.testing.assert_array_equal(grads1[3]["x"]["amax_history"], grads0[3]["x"]["amax_history"])


def test_fused_mlp_runs_in_the_model_step_with_kernels_made_once(fake_te):
    """Through ``forward_hidden`` with ``update_kernels``: the fused MLP is taken (one custom VJP per layer) and the
    step's loss is the unfused one's, bit for bit once XLA may not keep BF16 intermediates in f32 (its "excess
    precision", which depends on how it fuses the ops around them); its gradients follow the unfused step's."""
    llama, config, params, tokens, precision, state = tiny_model()
    hoisted = llama.update_kernels(params, state, config, precision)

    loss = hoisted_loss(config, precision, tokens)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), compiler_options={"xla_allow_excess_precision": False})
    assert "name=fp8_swiglu_mlp" not in str(jax.make_jaxpr(loss)(params, state, None))
    assert "name=fp8_swiglu_mlp" in str(jax.make_jaxpr(loss)(params, state, hoisted))
    (l0, (g0, _)), (l1, (g1, _)) = grad(params, state, None), grad(params, state, hoisted)
    assert float(l0) == float(l1)
    for name in ("w_gate_up", "w_down", "wqkv", "wo"):
        a, b = np.asarray(g0["blocks"][name]), np.asarray(g1["blocks"][name])
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99, name


def test_update_kernels_need_the_te_backend_or_block_scaling():
    llama, config, params, _, precision, state = tiny_model()
    assert llama.update_kernels(params, state, config, precision.replace(backend="xla")) is None
    assert llama.update_kernels(params, None, config, precision) is None


def test_under_fsdp_the_token_transposes_stay_on_their_devices(fake_te, monkeypatch):
    """FSDP over 8 forced CPU devices: tokens split over ``fsdp``, the te backend's forward and backward (the byte
    transposes through the Pallas kernel's interpreter, under ``shard_map``) equal the one-device result, and the
    only collective is the weight gradient's reduction (no activation is gathered)."""
    import functools
    import types

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fp8rl_jax.kernels import transpose
    from fp8rl_jax.parallel import hlo
    from fp8rl_jax.parallel.mesh import make_mesh, mesh_context

    monkeypatch.setattr(te, "transpose_bytes", functools.partial(transpose.transpose_bytes, impl="pallas_interpret"))
    x, w, g, st = _inputs(m=8 * 128, k=128, n=256)

    def step(x, w, st):
        y, vjp = jax.vjp(lambda a, b, s: te.fp8_matmul(a, b, s, RECIPE), x, w, st)
        return y, vjp(g.astype(y.dtype))

    want = jax.jit(step)(x, w, st)
    mesh = make_mesh(types.SimpleNamespace(data=1, fsdp=8, tensor=1))
    xs = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    with mesh_context(mesh):
        fn = jax.jit(step)
        got = fn(xs, w, st)
        text = fn.lower(xs, w, st).compile().as_text()
        assert str(jax.make_jaxpr(step)(xs, w, st)).count("shard_map") == 2  # q(x) and q(g), token-minor
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)
    kinds = {c.kind for c in hlo.collectives(text)}
    assert kinds <= {"all-reduce", "reduce-scatter"}, hlo.collectives(text)
