"""The CPU engine's per-layer forms (weights, FP8 state, KV scales, cache) against the stacked ones: bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import kv_cache, llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.rollout.weights import per_layer, rollout_params

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

CONFIG = preset("tiny").replace(num_layers=4)
B, P, S = 3, 6, 12

POLICIES = {
    "bf16": Precision(),
    "fp8": Precision(backend="xla"),
    "fp8_mixed_segments": Precision(backend="xla", bf16_first_layers=1, bf16_layers=(2,), bf16_linears=("w_down",)),
    "fp8_kv": Precision(backend="xla", kv_cache_dtype="float8_e4m3fn"),
}


def _split(tree):
    return None if tree is None else {**tree, "blocks": llama.split_layers(tree["blocks"])}


@pytest.mark.parametrize("name", list(POLICIES))
def test_per_layer_forward_is_bit_identical(name):
    precision = POLICIES[name]
    params = llama.init_params(CONFIG, jax.random.PRNGKey(0), std=0.05)
    fp8_state = llama.init_fp8_state(CONFIG, precision) if precision.fp8 else None
    kv_scales = kvq.init_kv_scales(CONFIG.num_layers) if precision.kv_fp8 else None
    stacked = rollout_params(params, fp8_state, precision, CONFIG.num_layers)
    layers = per_layer(stacked)
    layer_kv = kv_scales and {n: tuple(a) for n, a in kv_scales.items()}
    dtype = kv_cache.cache_dtype(precision)
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, CONFIG.vocab_size, (B, P + 3)))
    kw = dict(config=CONFIG, precision=precision)

    def run(weights, fp8, kv, cache, to_layers):
        if to_layers:
            cache = kv_cache.cache_layers(cache, as_bits=jax.default_backend() == "cpu")
        outs = []
        fwd = jax.jit(lambda w, f, k, c, t, p: llama.forward_hidden(w, t, p, fp8_state=f, kv_scales=k, cache=c,
                                                                    cache_dtype=dtype, **kw))
        # a prefill of P tokens, then three decode steps
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        hidden, cache, amax = fwd(weights, fp8, kv, cache, tokens[:, :P], positions)
        outs += [hidden, amax["k"], amax["v"]]
        for t in range(P, P + 3):
            hidden, cache, _ = fwd(weights, fp8, kv, cache, tokens[:, t : t + 1], jnp.full((B, 1), t, jnp.int32))
            outs.append(hidden)
        if to_layers:
            cache = kv_cache.cache_stack(cache, dtype)
        return outs + [cache["k"].astype(jnp.float32), cache["v"].astype(jnp.float32)]

    cache = kv_cache.init_cache(CONFIG, B, S, dtype)
    want = run(stacked, fp8_state, kv_scales, cache, False)
    got = run(layers, _split(fp8_state), layer_kv, cache, True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
