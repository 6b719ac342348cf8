"""The sampler's argmax and categorical draw against JAX's own (on CPU they are computed differently)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.rollout import sampling

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out


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


def test_vocab_block_is_the_smallest_divisor_past_the_square_root():
    assert sampling.vocab_block(128256) == 384  # Llama 3: 334 blocks
    assert sampling.vocab_block(49152) == 256  # SmolLM2: 192 blocks
    assert sampling.vocab_block(64) == 8
    assert sampling.vocab_block(97) == 97  # a prime: one block, a one-level draw
    assert sampling.vocab_block(1) == 1


def _draws(logits: np.ndarray, n: int, temperature: float, seed: int = 1):
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    params = sampling.SamplingParams(temperature=temperature)
    rows = jnp.broadcast_to(jnp.asarray(logits), (n, logits.shape[0]))
    # the rows as an argument: a captured [n, V] constant would be folded by XLA at compile time (slow)
    return jax.jit(lambda k, x: sampling.sample(x, k, params))(keys, rows)


def test_two_level_draw_is_softmax_and_reports_its_logprob():
    # 100 tokens in 10 blocks of 10; block 3 has no mass at all, block 7 one token of all of it but a little
    r = np.random.RandomState(0)
    logits = (r.randn(100) * 2).astype(np.float32)
    logits[30:40] = -np.inf
    logits[75] = 6.0
    n, temperature = 200_000, 0.7
    tokens, logprobs = map(np.asarray, _draws(logits, n, temperature))
    p = np.asarray(jax.nn.softmax(jnp.asarray(logits) / temperature))
    counts = np.bincount(tokens, minlength=100)
    assert counts[30:40].sum() == 0
    seen = p > 0
    chi2 = ((counts[seen] - n * p[seen]) ** 2 / (n * p[seen])).sum()
    # 89 degrees of freedom: the 0.999 quantile is ~135; a block of ~20% of the mass drawn 10% too often would add ~500
    assert chi2 < 135, chi2
    reference = np.asarray(jax.nn.log_softmax(jnp.asarray(logits) / temperature))[tokens]
    np.testing.assert_allclose(logprobs, reference, rtol=0, atol=2e-6)


def test_two_level_draw_depends_on_the_row_key_only():
    r = np.random.RandomState(3)
    logits = jnp.asarray(r.randn(4, 384).astype(np.float32))
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    params = sampling.SamplingParams()
    draw = jax.jit(lambda x, k: sampling.sample(x, k, params))
    tokens, logprobs = draw(logits, keys)
    # the same rows in reverse order, and each row alone
    flipped, _ = draw(logits[::-1], keys[::-1])
    np.testing.assert_array_equal(np.asarray(flipped)[::-1], tokens)
    for b in range(4):
        alone, lp = draw(logits[b:b + 1], keys[b:b + 1])
        assert int(alone[0]) == int(tokens[b])
        np.testing.assert_allclose(float(lp[0]), float(logprobs[b]), rtol=0, atol=1e-6)


def test_block_stats_one_pass_against_float64():
    """``block_stats``' single variadic reduction: each block's max exactly, its sum of exp(z - max) to f32 rounding
    of a float64 reference, rows of -inf only as (-inf, 0), a block's -inf entries adding nothing; one reduction in
    the compiled program (a max and then a sum of exps would be two)."""
    rng = np.random.default_rng(3)
    blocks = (rng.standard_normal((3, 50, 384)) * 12).astype(np.float32)
    blocks[0, 0, 0] = 80.0  # exp(80) alone would overflow nothing in f32, exp of its neighbours' gap underflows
    blocks[1, 7] = -np.inf
    blocks[2, 9, :100] = -np.inf
    got_max, got_sum = jax.jit(sampling.block_stats)(jnp.asarray(blocks))
    want_max = blocks.max(-1)
    shift = np.where(np.isfinite(want_max), want_max, 0.0).astype(np.float64)
    want_sum = np.exp(blocks.astype(np.float64) - shift[..., None]).sum(-1)
    np.testing.assert_array_equal(np.asarray(got_max), want_max)
    np.testing.assert_allclose(np.asarray(got_sum, np.float64), want_sum, rtol=2e-6, atol=0)
    assert got_sum[1, 7] == 0 and got_max[1, 7] == -np.inf
    hlo = jax.jit(sampling.block_stats).lower(jnp.asarray(blocks)).compile().as_text()
    assert hlo.count(" reduce(") == 1, hlo
