"""Does a gradient program compute the same forward as a forward-only one? (docs/accuracy.md, the exact sampler)

    JAX_PLATFORMS=cuda python benchmarks/fwd_vs_grad.py [batch]

SmolLM2-135M-Instruct's blocks (1, and all 30) on random tokens [batch, 128], per precision: the hidden states of
``llama.forward_hidden`` jitted alone, against the same values returned from a ``jax.value_and_grad`` program; then
single ops (RMSNorm, attention, softmax, RoPE) on BF16 inputs the same way. Prints the largest difference and the
fraction of elements that differ. On CPU run it with ``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-reduce``.
"""

import dataclasses
import os
import sys

if os.environ.get("JAX_PLATFORMS") != "cpu":  # Transformer Engine loads before JAX's GPU backend starts
    from fp8rl_jax.fp8 import te

    te.preload()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8rl_jax.fp8 import kv as kvq  # noqa: E402
from fp8rl_jax.fp8.policy import Precision  # noqa: E402
from fp8rl_jax.fp8.recipe import update_state  # noqa: E402
from fp8rl_jax.model import assets, attention, llama, rope, weights  # noqa: E402
from fp8rl_jax.rl.step import make_calibrate  # noqa: E402

T = 128


def diff(a, b) -> str:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return f"max {np.abs(a - b).max():.3g}, fraction of elements that differ {(a != b).mean():.4f}"


def fwd_vs_grad(fn, *args) -> str:
    """``fn(*args)`` jitted alone against the same output of a jitted ``value_and_grad`` of a weighted sum of it."""
    alone = jax.jit(fn)(*args)
    w = jax.random.normal(jax.random.PRNGKey(1), alone.shape, jnp.float32)
    loss = lambda *a: (jnp.sum(fn(*a).astype(jnp.float32) * w), fn(*a))  # noqa: E731
    (_, in_grad), _ = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return diff(alone, in_grad)


def main(batch: int) -> None:
    model, params = weights.load_gguf(assets.smollm2_gguf())
    tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, T), 3, model.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(T), (batch, T))
    precisions = {"bf16": Precision(), "fp8_xla": Precision(backend="xla")}
    if jax.default_backend() == "gpu":
        precisions["fp8_te"] = Precision(backend="te")
    for name, precision in precisions.items():
        fp8_state, kv_scales = llama.init_fp8_state(model, precision), kvq.init_kv_scales(model.num_layers)
        if precision.fp8:
            observations, _ = make_calibrate(model, precision, gradients=True)(params, fp8_state, kv_scales,
                                                                               tokens[:16])
            fp8_state = update_state(fp8_state, observations, precision.recipe)
        for layers in (1, model.num_layers):
            first = lambda tree, n=layers: jax.tree.map(lambda a: a[:n], tree)  # noqa: E731
            p = dict(params, blocks=first(params["blocks"]))
            state = dict(fp8_state, blocks=first(fp8_state["blocks"])) if precision.fp8 else None
            config = dataclasses.replace(model, num_layers=layers)

            def hidden(p, state, config=config, precision=precision, kv_scales=kv_scales):
                return llama.forward_hidden(p, tokens, pos, config=config, precision=precision, fp8_state=state,
                                            kv_scales=kv_scales)[0]

            print(f"{name}, {layers} layer(s): hidden, alone vs in a gradient program: {fwd_vs_grad(hidden, p, state)}",
                  flush=True)
    h, n, k = model.head_dim, model.num_heads, model.num_kv_heads
    normal = lambda seed, shape: jax.random.normal(jax.random.PRNGKey(seed), shape).astype(jnp.bfloat16)  # noqa: E731
    x, q = normal(2, (batch, T, model.hidden_size)) * 3, normal(4, (batch, T, n, h))
    keys, values = normal(5, (batch, k, T, h)), normal(6, (batch, k, T, h))
    scale = jnp.full(model.hidden_size, 1.1)
    ops = {
        "rms_norm": (lambda x: llama.rms_norm(x, scale, 1e-5, jnp.bfloat16), x),
        "attention": (lambda q, k, v: attention.attention(q, k, v, pos, pos), q, keys, values),
        "softmax": (lambda s: jax.nn.softmax(s, axis=-1), normal(7, (batch, k, n // k, T, T)).astype(jnp.float32)),
        "rope": (lambda q: rope.apply_rope(q, pos, rope.rope_inv_freq(model)), q),
    }
    for name, (fn, *args) in ops.items():
        print(f"op {name}: alone vs in a gradient program: {fwd_vs_grad(fn, *args)}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32)
