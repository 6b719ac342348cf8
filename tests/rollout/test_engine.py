"""The rollout engine and driver against the full forward, and their batching and stopping behaviour."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import update_state
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.rl.scoring import token_logprobs
from fp8rl_jax.rollout import driver
from fp8rl_jax.rollout.engine import Engine, EngineConfig, prefill_bucket
from fp8rl_jax.rollout.sampling import SamplingParams

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

CONFIG = preset("tiny")
PROMPTS = [list(np.random.RandomState(i).randint(3, CONFIG.vocab_size, size=n)) for i, n in enumerate((5, 9, 3, 12))]


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CONFIG, jax.random.PRNGKey(0), std=0.1)


@functools.cache
def _engine(precision, slots, sampling, max_new, stop_ids):
    """One engine (and so one set of compiled steps) per configuration, shared by the tests."""
    return Engine(CONFIG, precision, EngineConfig(max_concurrent_decodes=slots, max_prefill_length=16,
                                                  max_new_tokens=max_new, sampling=sampling, stop_ids=stop_ids))


def _run(params, precision, *, slots=16, n=2, greedy=False, temperature=1.0, max_new=10, stop_ids=(), fp8_state=None,
         kv_scales=None, top_k=0, top_p=1.0, seed=1):
    sampling = SamplingParams(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    engine = _engine(precision, slots, sampling, max_new, stop_ids)
    engine_params = engine.load_params(params, fp8_state, kv_scales)
    return driver.generate(engine, engine_params, PROMPTS, n, jax.random.PRNGKey(seed), steps_per_sync=4)


def _sequences(batch):
    """prompt + completion per row, right-padded: [N, T]."""
    rows = [PROMPTS[p] + list(batch.completion(i)) for i, p in enumerate(batch.prompt_index)]
    t = max(map(len, rows))
    return jnp.asarray([r + [0] * (t - len(r)) for r in rows], jnp.int32)


def test_greedy_equals_stepwise_argmax_of_full_forward(params):
    f32 = Precision(compute_dtype="float32")
    batch = _run(params, f32, greedy=True, n=1)
    seqs = _sequences(batch)
    logits, _, _ = llama.forward(params, seqs, config=CONFIG, precision=f32)
    for i, p in enumerate(batch.prompt_index):
        start = len(PROMPTS[p])
        predicted = np.asarray(jnp.argmax(logits[i, start - 1 : start - 1 + batch.lengths[i]], -1))
        np.testing.assert_array_equal(predicted, batch.completion(i))


PRECISIONS = {
    "f32": (Precision(compute_dtype="float32"), 1e-5),
    "bf16": (Precision(), 1e-3),
    "fp8": (Precision(backend="xla"), 1e-3),
    "fp8_kv": (Precision(backend="xla", kv_cache_dtype="float8_e4m3fn"), 1e-3),
}


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_rollout_logprobs_match_scoring_forward(params, name):
    """Stated tolerance (max over tokens): |rollout - scoring logprob| <= 1e-5 in f32 and <= 1e-3 in BF16, FP8 and
    FP8 + FP8-KV: the decode step and the full-sequence forward run the same FP8 operands; only accumulation
    order and BF16 rounding of activations may differ (measured here on CPU: ~5e-7)."""
    precision, tol = PRECISIONS[name]
    fp8_state = kv_scales = None
    if precision.fp8:
        fp8_state = llama.init_fp8_state(CONFIG, precision)
        loss = lambda s: llama.forward(params, _sequences(_run(params, Precision(), n=1)), config=CONFIG,
                                       precision=precision, fp8_state=s,
                                       kv_scales=kvq.init_kv_scales(CONFIG.num_layers))[0].sum()
        fp8_state = update_state(fp8_state, jax.grad(loss)(fp8_state), precision.recipe)
    if precision.kv_fp8:
        probe = _sequences(_run(params, Precision(), n=1))
        kv_scales = kvq.scales_from_amax(llama.forward(params, probe, config=CONFIG, precision=Precision())[2])
    batch = _run(params, precision, temperature=0.8, fp8_state=fp8_state, kv_scales=kv_scales)
    seqs = _sequences(batch)
    scored, _, _ = token_logprobs(params, seqs, config=CONFIG, precision=precision, temperature=0.8,
                                  fp8_state=fp8_state, kv_scales=kv_scales, chunk=8)
    worst = 0.0
    for i, p in enumerate(batch.prompt_index):
        start, length = len(PROMPTS[p]), batch.lengths[i]
        diff = np.abs(np.asarray(scored[i, start : start + length]) - batch.logprobs[i, :length])
        worst = max(worst, float(diff.max()))
    print(f"{name}: max |rollout - scoring logprob| = {worst:.2e}")
    assert worst <= tol


def test_continuous_and_static_batching_agree(params):
    f32 = Precision(compute_dtype="float32")
    for greedy in (True, False):
        static = _run(params, f32, slots=16, greedy=greedy)
        continuous = _run(params, f32, slots=3, greedy=greedy)  # 8 samples through 3 slots: refills
        np.testing.assert_array_equal(static.tokens, continuous.tokens)
        np.testing.assert_array_equal(static.lengths, continuous.lengths)


def test_samples_of_one_prompt_differ_when_sampling_and_agree_when_greedy(params):
    f32 = Precision(compute_dtype="float32")
    sampled = _run(params, f32, n=4)
    greedy = _run(params, f32, n=4, greedy=True)
    for p in range(len(PROMPTS)):
        rows = np.flatnonzero(sampled.prompt_index == p)
        assert len({tuple(sampled.completion(r)) for r in rows}) > 1
        assert len({tuple(greedy.completion(r)) for r in rows}) == 1


def test_stop_tokens_and_max_new_tokens(params):
    f32 = Precision(compute_dtype="float32")
    free = _run(params, f32, greedy=True, n=1, max_new=10)
    assert all(r == "length" for r in free.finish_reasons) and (free.lengths == 10).all()
    stop = int(free.completion(0)[3])  # the 4th token of prompt 0's greedy completion
    stopped = _run(params, f32, greedy=True, n=1, max_new=10, stop_ids=(stop,))
    assert stopped.finish_reasons[0] == "stop" and stopped.lengths[0] == 4
    np.testing.assert_array_equal(stopped.completion(0), free.completion(0)[:4])  # the stop token is kept
    for i in range(len(PROMPTS)):
        completion = list(stopped.completion(i))
        assert stop not in completion[:-1]
        assert (stopped.finish_reasons[i] == "stop") == (completion[-1] == stop)
    short = _run(params, f32, greedy=True, n=1, max_new=3)
    assert (short.lengths == 3).all()


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus(params):
    f32 = Precision(compute_dtype="float32")
    greedy = _run(params, f32, greedy=True, n=1)
    np.testing.assert_array_equal(_run(params, f32, n=1, top_k=1).tokens, greedy.tokens)
    np.testing.assert_array_equal(_run(params, f32, n=1, top_p=1e-6).tokens, greedy.tokens)


def test_prefill_buckets():
    assert [prefill_bucket(n, 512) for n in (1, 16, 17, 300)] == [16, 16, 32, 512]
    assert prefill_bucket(40, 48) == 48
    with pytest.raises(ValueError, match="max_prefill_length=48"):
        prefill_bucket(49, 48)


def test_unrolled_steps_decode_as_the_loop_does(params):
    """``EngineConfig.step_loop='unrolled'``: generate_steps' steps as one straight-line program give the loop's
    tokens, logprobs and state, bit for bit; other names are refused."""
    precision = Precision(backend="xla", kv_cache_dtype="float8_e4m3fn")
    out = []
    for step_loop in ("scan", "unrolled"):
        engine = Engine(CONFIG, precision, EngineConfig(max_concurrent_decodes=2, max_prefill_length=16,
                                                        max_new_tokens=6, step_loop=step_loop))
        p = engine.load_params(params, llama.init_fp8_state(CONFIG, precision), kvq.init_kv_scales(CONFIG.num_layers))
        prefix = engine.prefill(p, np.asarray(PROMPTS[3] + [0] * 4, np.int32), len(PROMPTS[3]), jax.random.PRNGKey(1))
        state = engine.insert(prefix, engine.init_decode_state(), 1, jax.random.PRNGKey(2))
        out.append(jax.tree.leaves(engine.generate_steps(p, state, 3)))
    for a, b in zip(*out, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="step_loop='while'"):
        EngineConfig(step_loop="while")


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_insert_samples_equals_inserts_one_by_one(params, layer_loop):
    """Several samples of a prompt inserted in one call: the same decode state, bit for bit, as one insert per slot
    (FP8 KV cache, both cache layouts), and the same tokens after decoding; the padding writes nowhere."""
    precision = Precision(backend="xla", kv_cache_dtype="float8_e4m3fn")
    engine = Engine(CONFIG, precision, EngineConfig(max_concurrent_decodes=6, max_prefill_length=16,
                                                    max_new_tokens=8, layer_loop=layer_loop))
    p = engine.load_params(params, llama.init_fp8_state(CONFIG, precision), kvq.init_kv_scales(CONFIG.num_layers))
    prefix = engine.prefill(p, np.asarray(PROMPTS[3] + [0] * 4, np.int32), len(PROMPTS[3]), jax.random.PRNGKey(1))
    slots, keys = [4, 1, 2], jnp.stack([jax.random.PRNGKey(10 + i) for i in range(3)])  # 3 slots: padded to 4
    one_by_one = engine.init_decode_state()
    for slot, key in zip(slots, keys, strict=True):
        one_by_one = engine.insert(prefix, one_by_one, slot, key)
    together = engine.insert_samples(prefix, engine.init_decode_state(), slots, keys)
    for a, b in zip(jax.tree.leaves(one_by_one), jax.tree.leaves(together), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    steps_a = engine.generate_steps(p, one_by_one, 3)[1:]
    steps_b = engine.generate_steps(p, together, 3)[1:]
    for a, b in zip(steps_a, steps_b, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="distinct"):
        engine.insert_samples(prefix, engine.init_decode_state(), [1, 1], keys[:2])
    with pytest.raises(ValueError, match=r"in \[0, 6\)"):
        engine.insert_samples(prefix, engine.init_decode_state(), [6], keys[:1])


def test_prefill_batch_equals_prefill_per_prompt(params):
    """N prompts in one forward: each prompt's cache equals its own prefill's bit for bit, its last-position logits
    to f32 rounding (the head's GEMM has N rows instead of 1); ``insert_samples(row=i)`` inserts prompt i."""
    precision = Precision(backend="xla", kv_cache_dtype="float8_e4m3fn")
    engine = _engine(precision, 6, SamplingParams(), 8, ())
    p = engine.load_params(params, llama.init_fp8_state(CONFIG, precision), kvq.init_kv_scales(CONFIG.num_layers))
    # every input scale comes with its inverse, made once here rather than in every decode step
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(p["fp8_state"])]
    assert sum("['x']['scale_inv']" in k for k in paths) == sum("['x']['scale']" in k for k in paths) > 0
    padded = np.zeros((len(PROMPTS), 16), np.int32)
    for i, prompt in enumerate(PROMPTS):
        padded[i, : len(prompt)] = prompt
    keys = jnp.stack([jax.random.PRNGKey(i) for i in range(len(PROMPTS))])
    batch = engine.prefill_batch(p, padded, [len(x) for x in PROMPTS], keys)
    for i, prompt in enumerate(PROMPTS):
        one = engine.prefill(p, padded[i], len(prompt), keys[i])
        for name in ("k", "v"):
            np.testing.assert_array_equal(np.asarray(one.cache[name][:, 0]), np.asarray(batch.cache[name][:, i]))
        np.testing.assert_allclose(np.asarray(one.logits), np.asarray(batch.logits[i]), rtol=0, atol=1e-5)
        assert int(batch.length[i]) == len(prompt)
    from_batch = engine.insert_samples(batch, engine.init_decode_state(), [5, 0], keys[:2], row=2)
    assert np.asarray(from_batch.positions)[[5, 0]].tolist() == [len(PROMPTS[2])] * 2
    with pytest.raises(ValueError, match="row=4 outside"):
        engine.insert_samples(batch, engine.init_decode_state(), [0], keys[:1], row=4)


def test_rollout_does_not_depend_on_the_prompts_sharing_its_prefill(params, monkeypatch):
    """The driver prefills prompts several per call; replacing one prompt changes nothing in the others' rows."""
    bf16 = Precision()
    engine = _engine(bf16, 16, SamplingParams(), 10, ())
    p = engine.load_params(params)
    assert driver.prefill_group(16, backend="gpu") == 16 and driver.prefill_group(512, backend="gpu") == 2
    assert driver.prefill_group(16, backend="cpu") == 1  # on a CPU the padding's compute is what costs
    group = functools.partial(driver.prefill_group, backend="gpu")  # the GPU's grouping, here on any backend
    monkeypatch.setattr(driver, "prefill_group", group)
    assert driver.prefill_group(prefill_bucket(12, 16)) >= len(PROMPTS)  # all four share one call
    other = [*PROMPTS[:3], list(np.random.RandomState(9).randint(3, CONFIG.vocab_size, size=7))]
    a = driver.generate(engine, p, PROMPTS, 2, jax.random.PRNGKey(1), steps_per_sync=4)
    b = driver.generate(engine, p, other, 2, jax.random.PRNGKey(1), steps_per_sync=4)
    rows = slice(0, 6)  # prompts 0-2, two samples each
    np.testing.assert_array_equal(a.tokens[rows], b.tokens[rows])
    np.testing.assert_array_equal(a.logprobs[rows], b.logprobs[rows])


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_decode_kernel_writes_the_output_projection_input(params, layer_loop, monkeypatch):
    """FP8 rollout with the decode kernel (interpreted): the kernel hands ``wo`` its input already quantized and
    reads the KV scales it is given (each layer's, or all layers' under a scan); the tokens and logprobs are bit
    for bit those of the path that quantizes the BF16 attention output in XLA."""
    precision = Precision(backend="xla", kv_cache_dtype="float8_e4m3fn")
    calls = []
    original = llama._decode_output

    def spy(*args):
        calls.append(original(*args))
        return calls[-1]

    def rollout(decode_output):
        monkeypatch.setattr(llama, "_decode_output", decode_output)
        engine = Engine(CONFIG, precision, EngineConfig(max_concurrent_decodes=4, max_prefill_length=16,
                                                        max_new_tokens=6, layer_loop=layer_loop,
                                                        decode_attention="pallas_interpret"))
        state = llama.init_fp8_state(CONFIG, precision)
        wo = state["blocks"]["wo"]["x"]
        wo["scale"] = jnp.full_like(wo["scale"], 2.0**10)  # the attention outputs' FP8 range, some clipped
        p = engine.load_params(params, state, kvq.init_kv_scales(CONFIG.num_layers))
        return driver.generate(engine, p, PROMPTS[:2], 2, jax.random.PRNGKey(3), steps_per_sync=3)

    fused = rollout(spy)
    assert calls and all(c.get("out_dtype") == jnp.float8_e4m3fn for c in calls)
    plain = rollout(lambda *args: {})
    np.testing.assert_array_equal(fused.tokens, plain.tokens)
    np.testing.assert_array_equal(fused.logprobs, plain.logprobs)
