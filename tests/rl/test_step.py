"""The jitted pieces of the RL step on a tiny random model: metric reductions over microbatches, the loss's own
old-policy logprobs, and the calibration of the gradient role."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.rl.step import LossConfig, make_calibrate, make_score, make_train_step

CONFIG = preset("tiny")
F32 = Precision(compute_dtype="float32")  # no FP8, f32 GEMMs: the score and the loss agree to ~1e-7


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CONFIG, jax.random.PRNGKey(0))


def _state(params, optimizer, precision=F32):
    params = jax.tree.map(jnp.copy, params)  # the train step donates its state
    return {"params": params, "opt_state": optimizer.init(params),
            "fp8_state": llama.init_fp8_state(CONFIG, precision) if precision.fp8 else {},
            "kv_scales": kvq.init_kv_scales(CONFIG.num_layers), "rng": jax.random.PRNGKey(0), "step": jnp.int32(0)}


def _tokens(shape, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, CONFIG.vocab_size)


def test_metrics_over_microbatches_are_those_of_the_whole_minibatch(params):
    # 2 microbatches x 2 sequences x 8 tokens; the completion is tokens 4..7 (4 per sequence), but the last
    # sequence's ends after 2: microbatch 0 holds 8 completion tokens, microbatch 1 holds 6
    tokens = _tokens((4, 8))
    mask = np.zeros((4, 8), np.float32)
    mask[:, 4:] = 1
    mask[3, 6:] = 0
    logp = np.asarray(make_score(CONFIG, F32, 1.0)(params, None, None, tokens))
    # per-token ratios r = exp(logp - old): microbatch 0 spans [0.9, 1.5], microbatch 1 spans [0.7, 1.2]; IS
    # weights w = exp(old - rollout) (TIS, cap 2): microbatch 0 peaks at 1.8, microbatch 1 at 1.3
    ratio = np.ones((4, 8))
    ratio[0, 4:] = [1.5, 0.9, 1.0, 1.1]
    ratio[3, 4:] = [1.2, 0.7, 1.0, 1.0]
    weight = np.ones((4, 8))
    weight[1, 5] = 1.8
    weight[2, 6] = 1.3
    old = logp - np.log(ratio)
    rollout = old - np.log(weight)
    minibatch = {"tokens": tokens, "mask": mask, "old_logp": old, "rollout_logp": rollout,
                 "advantages": np.asarray([1.0, -1.0, 0.5, -0.5], np.float32)}
    minibatch = {k: jnp.asarray(v, jnp.float32 if k != "tokens" else jnp.int32).reshape(2, 2, *v.shape[1:])
                 for k, v in minibatch.items()}
    optimizer = optax.sgd(0.0)
    step = make_train_step(CONFIG, F32, optimizer, LossConfig(is_correction="tis", is_cap=2.0))
    _, metrics = step(_state(params, optimizer), minibatch)
    # means of the per-microbatch maxima would be 1.35, 1.55 and 0.8
    np.testing.assert_allclose(metrics["ratio_max"], 1.5, rtol=1e-5)
    np.testing.assert_allclose(metrics["is_weight_max"], 1.8, rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_min"], 0.7, rtol=1e-5)
    # a mean is the minibatch's token mean, whatever the microbatches: mb 0's ratios sum to 4 + 4.5 over 8 tokens,
    # mb 1's to 4 + 1.9 over 6 (the mean of the two microbatch means would be 1.0230)
    np.testing.assert_allclose(metrics["ratio_mean"], (4 + 4.5 + 4 + 1.9) / 14, rtol=1e-5)


def _keep_gradients():
    """An optimizer whose state is the last gradient and whose update is 0: the train step returns its gradient."""
    return optax.GradientTransformation(init=lambda p: jax.tree.map(jnp.zeros_like, p),
                                        update=lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def test_seq_mean_token_sum_norm_is_the_same_whatever_the_microbatches(params):
    """Dr. GRPO's aggregation over a minibatch of 4 sequences (ragged completions, ratios off 1 so that the clip and
    the dual clip act): one microbatch of 4, two of 2 and four of 1 give one loss and one gradient, the minibatch's
    sum over sequences / (4 sequences * loss_agg_norm), as the other aggregations do with their global normalisers;
    and the loss is the hand-computed one."""
    tokens = _tokens((4, 10), seed=5)
    mask = np.zeros((4, 10), np.float32)
    mask[:, 4:] = 1
    mask[1, 6:] = 0
    mask[3, 5:] = 0  # completions of 6, 2, 6 and 1 tokens
    logp = np.asarray(make_score(CONFIG, F32, 1.0)(params, None, None, tokens))
    rng = np.random.default_rng(7)
    old = logp - rng.normal(scale=0.5, size=logp.shape)
    old[1, 4], old[2, 5] = logp[1, 4] - math.log(5.0), logp[2, 5] - math.log(4.0)  # ratios 5 and 4 with A < 0
    old = old.astype(np.float32)
    adv = np.asarray([1.0, -1.0, -0.5, 2.0], np.float32)
    minibatch = {"tokens": np.asarray(tokens), "mask": mask, "old_logp": old, "rollout_logp": old,
                 "advantages": adv}
    cfg = LossConfig(loss_agg="seq_mean_token_sum_norm", loss_agg_norm=16.0, clip_ratio_c=3.0, is_correction="none")
    # by hand (float64): the clipped, dual-clipped surrogate summed over the completion tokens, / (4 * 16)
    r = np.exp(logp.astype(np.float64) - old)
    a = adv[:, None].astype(np.float64)
    per = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.2))
    per = np.where(a < 0, np.minimum(per, -a * 3.0), per)
    want = np.sum(per * mask) / (4 * 16)
    assert np.any((a < 0) & (r > 3) & (mask > 0))  # the dual clip acts on some token
    optimizer = _keep_gradients()
    results = []
    for microbatches in (1, 2, 4):
        batch = {k: jnp.asarray(v).reshape(microbatches, 4 // microbatches, *v.shape[1:]) for k, v in minibatch.items()}
        step = make_train_step(CONFIG, F32, optimizer, cfg)
        state, metrics = step(_state(params, optimizer), batch)
        results.append((float(metrics["loss"]), jax.tree.leaves(state["opt_state"])))
    np.testing.assert_allclose(results[0][0], want, rtol=1e-5)
    for loss, grads in results[1:]:
        np.testing.assert_allclose(loss, results[0][0], rtol=1e-6)
        for g, ref in zip(grads, results[0][1], strict=True):
            np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(ref))))


def test_seq_mean_token_sum_norm_needs_its_constant_in_the_train_step():
    # without loss_agg_norm the constant would be the row width, which differs between the padded and the packed
    # layouts (and includes the prompt): plan.loss_config sets it, a hand-built LossConfig must
    with pytest.raises(ValueError, match="loss_agg_norm"):
        make_train_step(CONFIG, F32, optax.sgd(0.0), LossConfig(loss_agg="seq_mean_token_sum_norm"))


def test_old_logp_from_forward_makes_the_ratio_exactly_one(params):
    # old_logp deliberately far off: the option must ignore it (no such key is needed at all)
    tokens = _tokens((4, 12), seed=2)
    mask = jnp.zeros((4, 12)).at[:, 6:].set(1.0)
    rollout = jnp.asarray(make_score(CONFIG, F32, 1.0)(params, None, None, tokens)) - 0.01  # IS weights e^.01
    minibatch = {"tokens": tokens, "mask": mask, "rollout_logp": rollout,
                 "advantages": jnp.asarray([1.0, -1.0, 2.0, 0.0])}
    minibatch = jax.tree.map(lambda a: a.reshape(2, 2, *a.shape[1:]), minibatch)
    optimizer = optax.sgd(0.1)
    step = make_train_step(CONFIG, F32, optimizer, LossConfig(), old_logp_from_forward=True)
    state = _state(params, optimizer)
    new, metrics, old_logp = step(state, minibatch)
    assert float(metrics["ratio_max"]) == 1.0 and float(metrics["ratio_min"]) == 1.0
    assert float(metrics["clip_fraction"]) == 0.0
    np.testing.assert_allclose(metrics["is_weight_max"], math.exp(0.01), rtol=1e-5)
    # the returned logprobs are the forward's: the separate scoring program agrees to f32 rounding
    scored = make_score(CONFIG, F32, 1.0)(params, None, None, tokens)
    np.testing.assert_allclose(np.asarray(old_logp).reshape(4, 12)[:, 1:], scored[:, 1:], atol=1e-5)
    # and the gradient still flows through the live logprobs (ratio 1 has gradient d ratio = d logp)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), new["params"], params)
    assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.parametrize("head", ["lm_head_fp8", "lm_head_grad_fp8"])
def test_initial_calibration_observes_every_gradient_role(params, head):
    """Also the head's three roles where only its backward GEMMs are FP8 (``lm_head_grad_fp8``): its BF16 forward
    observes nothing through the pullback, so the calibration observes the hidden state, the kernel and the logits'
    cotangent itself (the forward-only pass: the gradient role observes 0)."""
    precision = Precision(backend="xla", **{head: True})
    fp8_state = llama.init_fp8_state(CONFIG, precision)
    tokens = _tokens((4, 16), seed=3)
    kv = kvq.init_kv_scales(CONFIG.num_layers)
    forward_only, _ = make_calibrate(CONFIG, precision)(params, fp8_state, kv, tokens)
    observed, _ = make_calibrate(CONFIG, precision, gradients=True, temperature=0.7, passes=2)(
        params, fp8_state, kv, tokens)
    for (path, got), (_, zero_cotangent) in zip(jax.tree_util.tree_leaves_with_path(observed),
                                                jax.tree_util.tree_leaves_with_path(forward_only), strict=True):
        name = jax.tree_util.keystr(path)
        if "amax_history" not in name:
            continue
        assert np.all(np.asarray(got)[..., 0] > 0), name  # every linear, every role, every layer
        if "grad" in name:
            assert np.all(np.asarray(zero_cotangent) == 0), name  # a zero cotangent observes nothing
    # the head's gradient is d mean(logp) / d logits = (onehot - p) / (T n), n = 4 * 15 predicted positions:
    # at most (1 - p) / (0.7 * 60) < 1 / 42
    head_grad = float(observed["lm_head"]["grad"]["amax_history"][0])
    assert 0.5 / 42 < head_grad < 1 / 42


def test_fp8_head_programs_compile_without_triton_gemms_on_a_gpu(monkeypatch):
    """On a GPU, the programs that run an FP8 LM head (scoring, train step, calibration, the exact sampler) compile
    with XLA's Triton GEMMs off (their FP8 dots go to cuBLAS: with Triton the H100 had not finished the head's
    program after 90 s); the user's XLA_FLAGS win; nothing changes for a BF16 head or off the GPU (XLA:CPU
    refuses GPU options)."""
    from fp8rl_jax.rl import step
    from fp8rl_jax.xla_options import gpu_compiler_options

    options = {"xla_gpu_enable_triton_gemm": False}
    assert gpu_compiler_options(options, backend="cpu") == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert gpu_compiler_options(options, backend="gpu") == options
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert gpu_compiler_options(options, backend="gpu") == {}
    monkeypatch.delenv("XLA_FLAGS")

    seen = []
    monkeypatch.setattr(step.jax, "jit", lambda fn, **kwargs: seen.append(kwargs.get("compiler_options")) or fn)
    monkeypatch.setattr(step.jax, "default_backend", lambda: "gpu")
    for head_fp8, grad_fp8 in ((True, False), (False, False), (False, True)):
        step.jit_head_program(lambda x: x, Precision(backend="xla", lm_head_fp8=head_fp8, lm_head_grad_fp8=grad_fp8))
    assert seen == [step.FP8_HEAD_GPU_OPTIONS, None, step.FP8_HEAD_GPU_OPTIONS]


def test_head_grad_fp8_step_has_the_bf16_heads_loss_and_observes_the_head(params):
    """A train step with the head's backward GEMMs in FP8 (``lm_head_grad_fp8``): its loss is the BF16 head's bit
    for bit (the same forward), its update differs by the FP8 rounding of the head's gradients, and the head's
    FP8 state has rolled in the step's three observations."""
    tokens = _tokens((4, 12), seed=4)
    mask = jnp.zeros((4, 12)).at[:, 6:].set(1.0)
    minibatch = {"tokens": tokens, "mask": mask, "old_logp": jnp.full((4, 12), -5.0),
                 "rollout_logp": jnp.full((4, 12), -5.0), "advantages": jnp.asarray([1.0, -1.0, 2.0, -0.5])}
    minibatch = jax.tree.map(lambda a: a.reshape(2, 2, *a.shape[1:]), minibatch)
    optimizer = optax.sgd(0.1)
    # every linear's scales (the head's too) from a first step on the same minibatch, so that the steps compared
    # quantize with scales fitted to their tensors (from scale 1, E4M3 flushes the kernels to subnormals)
    head_grad = Precision(backend="xla", lm_head_grad_fp8=True)
    fp8_state = make_train_step(CONFIG, head_grad, optimizer, LossConfig())(
        _state(params, optimizer, head_grad), minibatch)[0]["fp8_state"]
    results = {}
    for precision in (Precision(backend="xla"), head_grad):
        state = _state(params, optimizer, precision)
        state["fp8_state"] = jax.tree.map(jnp.copy, {k: v for k, v in fp8_state.items() if k in state["fp8_state"]})
        results[precision.lm_head_grad_fp8] = make_train_step(CONFIG, precision, optimizer, LossConfig())(
            state, minibatch)
    (bf16, bf16_metrics), (fp8, fp8_metrics) = results[False], results[True]
    assert not np.any(np.asarray(bf16["fp8_state"]["lm_head"]["grad"]["amax_history"])[0])  # unused: unobserved
    assert float(fp8_metrics["loss"]) == float(bf16_metrics["loss"])  # the same forward, bit for bit
    for name in ("ratio_mean", "entropy"):
        assert float(fp8_metrics[name]) == float(bf16_metrics[name]), name
    head = fp8["fp8_state"]["lm_head"]
    for role in ("x", "kernel", "grad"):
        history = np.asarray(head[role]["amax_history"])
        assert history[0] > 0 and history[1] > 0, role  # this step's observation, then the first's
    # the update: the BF16 head's up to the FP8 rounding of the head's gradients (E5M2: 2 mantissa bits), relative
    # (norm) error per leaf, measured: the head's kernel 5.8%, the final norm 6.2%; in the blocks up to 14%, where
    # each run's FP8 backward (E5M2 gradients) rounds its own, slightly different, gradients anew
    for (path, new), old, before in zip(jax.tree_util.tree_leaves_with_path(fp8["params"]),
                                        jax.tree.leaves(bf16["params"]), jax.tree.leaves(params), strict=True):
        step_fp8, step_bf16 = np.asarray(new) - np.asarray(before), np.asarray(old) - np.asarray(before)
        err = np.linalg.norm(step_fp8 - step_bf16) / np.linalg.norm(step_bf16)
        name = jax.tree_util.keystr(path)
        assert err < (0.25 if "blocks" in name else 0.1), (name, err)
