"""The sampler's argmax and categorical draw against JAX's own (on CPU they are computed differently)."""

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.rollout import sampling


def _rows(seed: int) -> np.ndarray:
    r = np.random.RandomState(seed)
    x = (r.randn(6, 1000) * (1 + seed % 4)).astype(np.float32)
    x[1, ::7] = -np.inf  # truncated proposal
    x[2, :] = -np.inf  # nothing left: index 0
    x[3, [5, 9]] = np.nan  # the first NaN wins
    x[4, [3, 800]] = x[4].max() + 1  # a tie: the first index wins
    x[5] = np.round(x[5])  # many ties
    return x


def test_argmax_is_jnp_argmax():
    for seed in range(5):
        x = jnp.asarray(_rows(seed))
        np.testing.assert_array_equal(jax.jit(sampling.argmax)(x), jnp.argmax(x, axis=-1))


def test_categorical_is_jax_random_categorical():
    draw = jax.jit(jax.vmap(sampling.categorical))
    reference = jax.jit(jax.vmap(lambda k, row: jax.random.categorical(k, row)))
    for seed in range(20):
        logits = jax.nn.log_softmax(jnp.asarray(_rows(seed)[[0, 1, 4, 5]]), axis=-1)
        keys = jax.random.split(jax.random.PRNGKey(seed), logits.shape[0])
        np.testing.assert_array_equal(draw(keys, logits), reference(keys, logits))
