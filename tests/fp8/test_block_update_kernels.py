"""Block scaling's kernels made once per optimizer update on the xla backend
(``train_kernel.block_kernel_for_update``, ``llama.update_kernels``): the bits each microbatch made before, and the
same training step, bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import block, train_kernel, xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset

BLOCK = Fp8Recipe(scaling="block", fp8_format="e4m3")


def _kernel(shape, seed=0):
    w = jax.random.normal(jax.random.PRNGKey(seed), shape) * 0.05
    return w.at[..., 3, 5].set(2.0)  # a large weight: its block's scale only


def test_the_forms_are_the_per_call_bits():
    """``nk`` and its scales are ``quantize_kernel``'s (the forward's), ``kn`` with the transposed scales is
    ``block.block_quantize``'s (the dgrad's); stacked layers quantize as each layer alone; other recipes refused."""
    w = _kernel((3, 200, 300))  # sizes 128 does not divide: padded blocks
    hoisted = train_kernel.block_kernel_for_update(w, BLOCK)
    assert hoisted.nk.shape == (3, 300, 200) and hoisted.nk.dtype == jnp.float8_e4m3fn
    for i in range(3):
        forward = xla.quantize_kernel(w[i], init_linear_state(BLOCK)["kernel"], BLOCK, "f8")
        np.testing.assert_array_equal(np.asarray(hoisted.nk[i], np.float32), np.asarray(forward.data, np.float32))
        np.testing.assert_array_equal(np.asarray(hoisted.scale_inv[i]), np.asarray(forward.scale_inv))
        q, s = block.block_quantize(w[i], BLOCK.fwd_dtype)
        np.testing.assert_array_equal(np.asarray(hoisted.kn[i], np.float32), np.asarray(q, np.float32))
        np.testing.assert_array_equal(np.asarray(hoisted.scale_inv[i].T), np.asarray(s))
    for recipe in (Fp8Recipe(), Fp8Recipe(scaling="block", block_forward="tokens_blocks"),
                   Fp8Recipe(scaling="block", fp8_gemms=("fprop", "wgrad"))):
        with pytest.raises(ValueError, match="once per update"):
            train_kernel.block_kernel_for_update(w, recipe)


def test_a_linear_with_them_is_the_linear_with_its_master():
    """``fp8_matmul`` of a ``TrainKernel``: the master's output and gradients bit for bit, the gradient into the
    master; the forward reads the hoisted operand."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 200)), jnp.bfloat16)
    w, g = _kernel((200, 300)), jnp.asarray(1e-2 * rng.normal(size=(256, 300)), jnp.float32)
    state = init_linear_state(BLOCK)

    def run(kernel_of):
        def f(x, w):
            return xla.fp8_matmul(x, kernel_of(w), state, BLOCK, jnp.float32)
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(g))

    hoisted = train_kernel.block_kernel_for_update(w, BLOCK)
    with_master = jax.jit(lambda: run(lambda w: w))()
    with_hoisted = jax.jit(lambda: run(lambda w: dataclasses.replace(hoisted, master=w)))()
    for a, b in zip(with_master, with_hoisted, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    zeroed = dataclasses.replace(hoisted, nk=jnp.zeros_like(hoisted.nk))
    assert not np.any(np.asarray(xla.fp8_matmul(x, zeroed, state, BLOCK, jnp.float32)))
    with pytest.raises(ValueError, match="block scaling's whole kernel"):
        xla.fp8_matmul(x, zeroed, init_linear_state(Fp8Recipe()), Fp8Recipe())


def test_the_training_step_with_them_is_the_same():
    """Through ``forward_hidden`` under remat (the fused MLP and the attention's linears): the loss, the masters'
    gradients and the observations of kernels made once for the update equal those made in every microbatch, bit for
    bit; the forward reads them. Another recipe on the xla backend makes none."""
    sizes = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
             "num_layers": 2}
    config = preset("tiny").replace(**sizes)
    params = llama.init_params(config, jax.random.PRNGKey(0), std=0.05)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (2, 64)))
    precision = Precision(backend="xla", recipe=BLOCK)
    state = llama.init_fp8_state(config, precision)
    hoisted = llama.update_kernels(params, state, config, precision)
    assert set(hoisted) == {"wqkv", "wo", "w_gate_up", "w_down"}
    assert hoisted["w_down"]["nk"].shape == (2, 128, 256) and hoisted["w_down"]["scale_inv"].shape == (2, 1, 2)
    assert llama.update_kernels(params, state, config, Precision(backend="xla")) is None

    from test_te_plumbing import hoisted_loss

    grad = jax.jit(jax.value_and_grad(hoisted_loss(config, precision, tokens), argnums=(0, 1)))
    (l0, g0), (l1, g1) = grad(params, state, None), grad(params, state, hoisted)
    assert float(l0) == float(l1)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in ("wo", "w_gate_up", "w_down"):  # a linear, and the fused MLP's two
        wrong = {**hoisted, name: {**hoisted[name], "nk": jnp.zeros_like(hoisted[name]["nk"])}}
        assert float(grad(params, state, wrong)[0]) != float(l0), name
