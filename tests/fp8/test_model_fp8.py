"""FP8 through the whole model: rollout weights, the FP8 KV cache, and the training gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, update_state
from fp8rl_jax.fp8.xla import QuantizedKernel
from fp8rl_jax.model import kv_cache, llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.rollout.weights import rollout_params

CONFIG = preset("tiny").replace(num_layers=4)
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, CONFIG.vocab_size, (3, 20)))


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CONFIG, jax.random.PRNGKey(0), std=0.05)


def _calibrated_state(params, precision):
    """FP8 state after one observed training step (scales no longer 1)."""
    state = llama.init_fp8_state(CONFIG, precision)
    kv_scales = kvq.init_kv_scales(CONFIG.num_layers) if precision.kv_fp8 else None
    loss = lambda s: llama.forward(params, TOKENS, config=CONFIG, precision=precision, fp8_state=s,
                                   kv_scales=kv_scales)[0].sum()
    return update_state(state, jax.grad(loss)(state), precision.recipe)


POLICIES = {
    "all_fp8": Precision(backend="xla"),
    "bf16_ends_fp8_head": Precision(backend="xla", bf16_first_layers=1, bf16_last_layers=1, lm_head_fp8=True),
    "fp8_kv": Precision(backend="xla", kv_cache_dtype="float8_e4m3fn"),
    "bf16_layer_and_down": Precision(backend="xla", bf16_layers=(2,), bf16_linears=("w_down",)),
    "bf16": Precision(),
    # per-token x per-output-channel current scales in the forward (xla backend)
    "rowwise_fp8_head": Precision(backend="xla", recipe=Fp8Recipe(scaling="rowwise"), lm_head_fp8=True),
    # the head's backward GEMMs in FP8 only: the rollout's head stays BF16, as the training forward's
    "fp8_head_grad": Precision(backend="xla", lm_head_grad_fp8=True),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_rollout_weights_reproduce_training_forward_exactly(params, name):
    precision = POLICIES[name]
    state = _calibrated_state(params, precision)
    kv_scales = kvq.init_kv_scales(CONFIG.num_layers) if precision.kv_fp8 else None
    train = jax.jit(lambda p, s: llama.forward(p, TOKENS, config=CONFIG, precision=precision, fp8_state=s,
                                               kv_scales=kv_scales)[0])(params, state)
    rp = jax.jit(lambda p, s: rollout_params(p, s, precision, CONFIG.num_layers))(params, state)
    if precision.fp8:
        kernels = [k for seg in rp["blocks"] for k in seg.values() if isinstance(k, QuantizedKernel)]
        # E4M3 values, stored as float8 in the GPU's GEMM form and as their exact f32 values in the CPU's
        form_dtype = jnp.float32 if xla.gemm_form() == "f32" else jnp.float8_e4m3fn
        assert kernels and all(k.data.dtype == form_dtype for k in kernels)
        for k in kernels:
            as_e4m3 = np.asarray(k.data.astype(jnp.float8_e4m3fn).astype(jnp.float32))
            np.testing.assert_array_equal(as_e4m3, np.asarray(k.data, np.float32))
    cache = kv_cache.init_cache(CONFIG, 3, 32, kv_cache.cache_dtype(precision))
    roll = jax.jit(lambda p, s, c: llama.forward(p, TOKENS, config=CONFIG, precision=precision, fp8_state=s,
                                                 kv_scales=kv_scales, cache=c)[0])(rp, state, cache)
    np.testing.assert_array_equal(np.asarray(roll), np.asarray(train))


def test_fp8_logits_differ_from_bf16_by_quantization_error(params):
    fp8 = POLICIES["all_fp8"]
    state = _calibrated_state(params, fp8)
    lp = lambda prec, s: jax.nn.log_softmax(llama.forward(params, TOKENS, config=CONFIG, precision=prec,
                                                          fp8_state=s)[0], -1)
    exact = lp(Precision(compute_dtype="float32"), None)
    d_fp8 = float(jnp.abs(lp(fp8, state) - exact).max())
    d_bf16 = float(jnp.abs(lp(Precision(), None) - exact).max())
    print(f"max |dlogp| vs f32: fp8 {d_fp8:.4f}, bf16 {d_bf16:.4f}")
    assert d_bf16 < d_fp8 < 0.2


def test_training_gradient_observes_every_fp8_layer(params):
    precision = POLICIES["bf16_ends_fp8_head"]
    state = llama.init_fp8_state(CONFIG, precision)

    def loss(p, s):
        logits = llama.forward(p, TOKENS, config=CONFIG, precision=precision, fp8_state=s)[0]
        return jax.nn.logsumexp(logits, -1).mean()

    grads, obs = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, state)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    for name in llama.LINEARS:
        for role in ("x", "kernel", "grad"):
            seen = np.asarray(obs["blocks"][name][role]["amax_history"][:, 0])
            # layers 0 and 3 run in BF16 (first/last): nothing observed; layers 1, 2 in FP8
            assert seen[0] == 0 and seen[3] == 0 and (seen[1:3] > 0).all(), (name, role, seen)
    assert float(obs["lm_head"]["grad"]["amax_history"][0]) > 0


def test_fp8_kv_cache_decode_close_to_bf16_kv_and_equal_to_scoring(params):
    """Stated tolerance: FP8-KV decode logits within 5% (relative L2) and 0.1 (max |dlogp|) of BF16-KV decode
    on the tiny model; the full-sequence forward with FP8 K/V equals the FP8-KV decode to float rounding."""
    f32 = Precision(compute_dtype="float32")
    f8kv = f32.replace(kv_cache_dtype="float8_e4m3fn")
    _, _, kv_amax = llama.forward(params, TOKENS, config=CONFIG, precision=f32)  # calibration pass
    scales = kvq.scales_from_amax(kv_amax)
    np.testing.assert_allclose(scales["k"], 448.0 / np.asarray(kv_amax["k"]), rtol=1e-6)

    def decode(precision, kv_scales, prompt=8):
        cache = kv_cache.init_cache(CONFIG, 3, 32, kv_cache.cache_dtype(precision))
        step = jax.jit(lambda t, pos, c: llama.forward(params, t, pos, config=CONFIG, precision=precision,
                                                       cache=c, kv_scales=kv_scales)[:2])
        logits, cache = step(TOKENS[:, :prompt], jnp.broadcast_to(jnp.arange(prompt), (3, prompt)), cache)
        out = [logits]
        for i in range(prompt, TOKENS.shape[1]):
            logits, cache = step(TOKENS[:, i : i + 1], jnp.full((3, 1), i), cache)
            out.append(logits)
        assert cache["k"].dtype == kv_cache.cache_dtype(precision)
        return jax.nn.log_softmax(jnp.concatenate(out, 1), -1)

    bf16_kv, fp8_kv = decode(f32, None), decode(f8kv, scales)
    rel = float(jnp.linalg.norm(fp8_kv - bf16_kv) / jnp.linalg.norm(bf16_kv))
    dmax = float(jnp.abs(fp8_kv - bf16_kv).max())
    print(f"FP8 KV vs BF16 KV decode: relative {rel:.4f}, max |dlogp| {dmax:.4f}")
    assert 0 < dmax < 0.1 and rel < 0.05
    scoring = jax.nn.log_softmax(llama.forward(params, TOKENS, config=CONFIG, precision=f8kv, kv_scales=scales)[0], -1)
    np.testing.assert_allclose(np.asarray(scoring), np.asarray(fp8_kv), atol=1e-5)


def test_segments_and_excluded_linears(params):
    p = Precision(backend="xla", bf16_first_layers=1, bf16_layers=(2,), bf16_linears=("w_down",))
    assert p.segments(4) == ((0, 1, False), (1, 2, True), (2, 3, False), (3, 4, True))
    assert Precision().segments(4) == ((0, 4, False),)
    with pytest.raises(ValueError, match="bf16_layers"):
        Precision(backend="xla", bf16_layers=(7,)).segments(4)
    state = llama.init_fp8_state(CONFIG, p)
    loss = lambda s: llama.forward(params, TOKENS, config=CONFIG, precision=p, fp8_state=s)[0].sum()
    obs = jax.grad(loss)(state)
    seen = {name: np.asarray(obs["blocks"][name]["x"]["amax_history"][:, 0]) > 0 for name in llama.LINEARS}
    assert seen["wqkv"].tolist() == [False, True, False, True]
    assert not seen["w_down"].any()  # w_down runs in BF16 everywhere
    rp = rollout_params(params, state, p, CONFIG.num_layers)
    assert isinstance(rp["blocks"][1]["wqkv"], QuantizedKernel)
    assert rp["blocks"][1]["w_down"].dtype == jnp.bfloat16
