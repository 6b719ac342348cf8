"""The exact sampler (``rollout.exact``): its logprobs equal the trainer's, bit for bit.

Compared with the two programs the trainer runs: the scoring forward (``make_score``), equal on CPU and GPU, and
the loss's own forward inside the train step's gradient (``make_train_step(old_logp_from_forward=True)``), equal on
CPU (on the GPU XLA compiles a gradient program's reductions its own way), in BF16 and FP8 (per tensor, the FP8
head, and TE's GEMMs on the GPU), at the microbatch shape the sampler drew at.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import update_state
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.policy_io import right_pad
from fp8rl_jax.rl.step import LossConfig, make_calibrate, make_score, make_train_step
from fp8rl_jax.rollout import driver
from fp8rl_jax.rollout.engine import Engine, EngineConfig
from fp8rl_jax.rollout.exact import ExactSampler, sequence_width
from fp8rl_jax.rollout.sampling import SamplingParams

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

CONFIG = preset("tiny")
PROMPTS = [list(np.random.RandomState(i).randint(3, CONFIG.vocab_size, size=n)) for i, n in enumerate((5, 9, 3, 12))]
N = 2  # samples per prompt
MAX_NEW = 12
MICROBATCH = 4


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CONFIG, jax.random.PRNGKey(0), std=0.1)


def _state(params, precision):
    """The trainer's state dict with calibrated FP8 scales and KV scales for ``precision``."""
    tokens = jnp.asarray(right_pad(PROMPTS, 0))
    fp8_state = llama.init_fp8_state(CONFIG, precision)
    kv_scales = kvq.init_kv_scales(CONFIG.num_layers)
    if precision.fp8:
        observations, _ = make_calibrate(CONFIG, precision, gradients=True)(params, fp8_state, kv_scales, tokens)
        fp8_state = update_state(fp8_state, observations, precision.recipe)
    return {"params": params, "fp8_state": fp8_state, "kv_scales": kv_scales}


def _rows(batch):
    return right_pad([PROMPTS[p] + list(batch.completion(i)) for i, p in enumerate(batch.prompt_index)], 0,
                     width=batch.width)


def _completion_logp(batch, logp):
    """[rows, T] logprobs -> the completion tokens' values, row by row, concatenated."""
    return np.concatenate([np.asarray(logp[i, len(PROMPTS[p]) : len(PROMPTS[p]) + batch.lengths[i]])
                           for i, p in enumerate(batch.prompt_index)])


def _sampled_logp(batch):
    return np.concatenate([batch.logprobs[i, : batch.lengths[i]] for i in range(len(batch.lengths))])


PRECISIONS = {
    "bf16": Precision(),
    "fp8": Precision(backend="xla"),
    "fp8_head": Precision(backend="xla", lm_head_fp8=True),
    "fp8_te": Precision(backend="te"),  # Transformer Engine's GEMMs: GPU only
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=(pytest.mark.gpu, pytest.mark.te)) if n.endswith("_te")
                                  else n for n in PRECISIONS])
def test_exact_rollout_logprobs_equal_scoring_and_the_train_forward_bit_for_bit(params, name):
    precision = PRECISIONS[name]
    state = _state(params, precision)
    sampler = ExactSampler(CONFIG, precision, SamplingParams(temperature=0.9), max_new_tokens=MAX_NEW,
                           microbatch=MICROBATCH, stop_ids=(5,))
    batch = sampler.rollout(state, PROMPTS, N, jax.random.PRNGKey(3))
    assert batch.width == sequence_width(map(len, PROMPTS), MAX_NEW) == 32
    assert batch.lengths.min() >= 1 and batch.lengths.max() <= MAX_NEW
    for i, length in enumerate(batch.lengths):  # a row ends at a stop token, or at max_new_tokens
        row = batch.completion(i)
        assert list(row[:-1]).count(5) == 0 and (row[-1] == 5) == (batch.finish_reasons[i] == "stop")
        assert batch.finish_reasons[i] == "stop" or length == MAX_NEW
    sampled = _sampled_logp(batch)
    tokens = jnp.asarray(_rows(batch))

    # the scoring program, a microbatch at a time (batches.score_right_padded)
    score = make_score(CONFIG, precision, 0.9)
    scored = jnp.concatenate([score(params, state["fp8_state"], state["kv_scales"], tokens[i : i + MICROBATCH])
                              for i in range(0, len(tokens), MICROBATCH)])
    np.testing.assert_array_equal(_completion_logp(batch, scored), sampled)

    # the train step's own forward under jax.grad, microbatches in a shuffled order (Trainer.step)
    step = make_train_step(CONFIG, precision, optax.sgd(0.0), LossConfig(temperature=0.9), old_logp_from_forward=True)
    order = np.random.default_rng(0).permutation(len(tokens))
    mask = np.zeros(tokens.shape, np.float32)
    rollout_logp = np.zeros(tokens.shape, np.float32)
    for i, p in enumerate(batch.prompt_index):
        start, end = len(PROMPTS[p]), len(PROMPTS[p]) + batch.lengths[i]
        mask[i, start:end] = 1
        rollout_logp[i, start:end] = batch.logprobs[i, : batch.lengths[i]]
    arrays = {"tokens": tokens, "mask": jnp.asarray(mask), "rollout_logp": jnp.asarray(rollout_logp),
              "advantages": jnp.ones(len(tokens), jnp.float32)}
    minibatch = {k: v[order].reshape(-1, MICROBATCH, *v.shape[1:]) for k, v in arrays.items()}
    train_state = {**state, "opt_state": optax.sgd(0.0).init(params), "rng": jax.random.PRNGKey(0),
                   "step": jnp.int32(0)}
    train_state = jax.tree.map(jnp.copy, train_state)  # donated
    _, metrics, own = step(train_state, minibatch)
    own = np.asarray(own).reshape(len(tokens), -1)[np.argsort(order)]
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(_completion_logp(batch, own), sampled)
        assert float(metrics["is_weight_max"]) == 1.0 and float(metrics["is_weight_mean"]) == 1.0
    else:
        # a gradient program is compiled apart from the forward-only ones, and XLA:GPU fuses some of its reductions
        # differently: 1 ulp here (the FP8 head); through SmolLM2's FP8 layers it grows (docs/accuracy.md)
        np.testing.assert_allclose(_completion_logp(batch, own), sampled, rtol=0, atol=4e-6)


def test_exact_greedy_matches_the_engine_in_f32(params):
    """Greedy in f32: the exact sampler and the KV-cache engine draw the same tokens (a check on positions,
    stopping and the per-row bookkeeping; their arithmetic differs in rounding only)."""
    f32 = Precision(compute_dtype="float32")
    state = _state(params, f32)
    greedy = SamplingParams(greedy=True)
    exact = ExactSampler(CONFIG, f32, greedy, max_new_tokens=MAX_NEW, microbatch=MICROBATCH, stop_ids=(5,))
    got = exact.rollout(state, PROMPTS, 1, jax.random.PRNGKey(0))
    engine = Engine(CONFIG, f32, EngineConfig(max_concurrent_decodes=4, max_prefill_length=16,
                                              max_new_tokens=MAX_NEW, sampling=greedy, stop_ids=(5,)))
    want = driver.generate(engine, engine.load_params(params), PROMPTS, 1, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(got.lengths, want.lengths)
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(got.completion(i), want.completion(i))
    # f32 GEMMs run as TF32 on the GPU by default
    np.testing.assert_allclose(_sampled_logp(got), _sampled_logp(want),
                               atol=1e-5 if jax.default_backend() == "cpu" else 5e-3)
    assert got.finish_reasons == want.finish_reasons


def test_exact_rollout_refuses_a_batch_that_is_not_whole_microbatches(params):
    exact = ExactSampler(CONFIG, Precision(), SamplingParams(), max_new_tokens=4, microbatch=3)
    with pytest.raises(ValueError, match="microbatches"):
        exact.rollout(_state(params, Precision()), PROMPTS, 1, jax.random.PRNGKey(0))
