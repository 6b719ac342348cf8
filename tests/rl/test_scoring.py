"""The scoring forward's bookkeeping: FP8 amax observations of the chunked LM head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.rl.scoring import token_logprobs

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def head_setup():
    config = preset("tiny")
    params = llama.init_params(config, jax.random.PRNGKey(0))
    # f32 compute: the head's input is the hidden state itself, no rounding to compare through
    precision = Precision(backend="xla", compute_dtype="float32", lm_head_fp8=True)
    fp8_state = llama.init_fp8_state(config, precision)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, config.vocab_size)
    return config, params, precision, fp8_state, tokens


def _head_observations(setup, chunk):
    config, params, precision, fp8_state, tokens = setup

    def total_logp(state):
        logp, _, _ = token_logprobs(params, tokens, config=config, precision=precision, temperature=TEMPERATURE,
                                    fp8_state=state, chunk=chunk)
        return jnp.sum(logp)

    observed = jax.jit(jax.grad(total_logp))(fp8_state)["lm_head"]
    return {role: float(observed[role]["amax_history"][0]) for role in ("x", "kernel", "grad")}


def test_lm_head_amaxes_do_not_depend_on_the_chunk_size(head_setup):
    """Each role's observation is a max over the whole sequence: a sum over the chunks made the kernel amax 4x
    the true one with chunk 5 (4 chunks of the 20 predicted positions), the scales 4x too small."""
    config, params, precision, fp8_state, tokens = head_setup
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _, _ = llama.forward_hidden(params, tokens, positions, config=config, precision=precision,
                                        fp8_state=fp8_state)
    hidden = np.asarray(hidden[:, :-1], np.float64)  # [B, T - 1, D]: the positions that predict a token
    kernel = np.asarray(llama.lm_head_kernel(params), np.float64)  # [D, V]
    # d sum(logp) / d logits = (onehot(target) - softmax(logits / T)) / T; the logits are the FP8 head's, taken
    # from the unchunked forward
    logits = np.asarray(llama.forward(params, tokens, config=config, precision=precision,
                                      fp8_state=fp8_state)[0][:, :-1], np.float64)  # [B, T - 1, V]
    p = np.exp(logits / TEMPERATURE - logits.max(-1, keepdims=True) / TEMPERATURE)
    p /= p.sum(-1, keepdims=True)
    onehot = np.eye(config.vocab_size)[np.asarray(tokens[:, 1:])]
    want = {"x": np.abs(hidden).max(), "kernel": np.abs(kernel).max(),
            "grad": np.abs((onehot - p) / TEMPERATURE).max()}

    for chunk in (256, 8, 5, 3):  # 1, 3, 4 and 7 chunks of the 20 predicted positions
        got = _head_observations(head_setup, chunk)
        for role in ("x", "kernel", "grad"):
            np.testing.assert_allclose(got[role], want[role], rtol=1e-5, err_msg=f"chunk={chunk} role={role}")
