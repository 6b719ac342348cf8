"""Sequence packing (``rl.packing``): the packing algorithm on hand-derived rows, and the packed scoring forward and
train step against the unpacked ones on a tiny random model.

Tolerances (tiny preset, 8 sequences of 7-17 tokens; packed rows of 32 tokens x 2 rows per microbatch, or of 64
tokens x 1 row; the unpacked reference is one microbatch of the 8 right-padded rows):
  f32 compute: per-token logprobs within 2e-6 abs (measured <= 4.8e-7); loss and metrics within 1e-5 relative
    (measured <= 1.5e-6, the KL); every gradient within 1e-5 relative + 1e-6 of its largest entry (measured <=
    4.7e-7 of the largest entry): the same arithmetic per token, summed in another order (per segment where an
    unpacked row sums along its axis, GEMMs of another M).
  FP8 (xla backend, calibrated delayed scales): the same bounds. Measured: logprobs bit for bit, gradients <= 2.7e-7
    of the largest entry, the rolled FP8 state (the observed amaxes) equal. The amaxes count padding positions in
    both layouts (as before packing); they could differ only where a padding position held a tensor's maximum.
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from fp8rl_jax.config import ConfigError
from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import update_state
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.plan import packing_plan
from fp8rl_jax.policy_io import right_pad
from fp8rl_jax.rl import packing
from fp8rl_jax.rl.packing import PackingPlan, first_fit_decreasing, pack, sequence_keys, unpack
from fp8rl_jax.rl.step import LossConfig, make_calibrate, make_score, make_train_step

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

CONFIG = preset("tiny")
F32 = Precision(compute_dtype="float32")
FP8 = Precision(backend="xla")

# ----------------------------------------------------------------------------------------------------------
# the algorithm, by hand


def test_first_fit_decreasing_by_hand():
    # longest first: 8 (seq 2) opens row 0 (2 free); 6 (seq 5) row 1 (4 free); 5 (seq 0) fits neither, row 2 (5
    # free); 4 (seq 4) fits row 1 (0 free); 3 (seq 1) fits row 2 (2 free); 2 (seq 3) fits row 0 (0 free)
    assert first_fit_decreasing([5, 3, 8, 2, 4, 6], 10) == [[2, 3], [5, 4], [0, 1]]
    # at most one sequence per row: one row each, longest first
    assert first_fit_decreasing([5, 3, 8, 2, 4, 6], 10, max_segments=1) == [[2], [5], [0], [4], [1], [3]]
    # ties go by index; two of three fit a row
    assert first_fit_decreasing([3, 3, 3], 6) == [[0, 1], [2]]
    assert first_fit_decreasing([], 6) == []
    with pytest.raises(ValueError, match="sequence 1 has 7 tokens; a packed row holds 6"):
        first_fit_decreasing([3, 7], 6)


def test_pack_by_hand():
    # width 8, 2 rows per microbatch, 2 microbatches; sequences of 3, 5 and 2 tokens: 5 (seq 1) opens row 0 (3
    # free), 3 (seq 0) fills it, 2 (seq 2) opens row 1; microbatch 1 is all padding
    plan = PackingPlan(width=8, rows=2, microbatches=2, max_segments=4, sequences=3)
    tokens = [np.array([1, 2, 3]), np.array([4, 5, 6, 7, 8]), np.array([9, 10])]
    mask = [np.array([0, 1, 1.0]), np.array([0, 0, 1, 1, 1.0]), np.array([0, 1.0])]
    packed = pack(plan, tokens, {"mask": mask}, {"advantages": np.array([0.5, -1.0, 2.0])}, pad_id=99)
    p = 99
    np.testing.assert_array_equal(packed["tokens"], [[[4, 5, 6, 7, 8, 1, 2, 3], [9, 10, p, p, p, p, p, p]],
                                                     [[p] * 8, [p] * 8]])
    np.testing.assert_array_equal(packed["segment_ids"], [[[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 0, 0, 0, 0, 0, 0]],
                                                          [[0] * 8, [0] * 8]])
    # positions restart per segment; the padding tail counts from 0 as a segment of its own
    np.testing.assert_array_equal(packed["positions"], [[[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]],
                                                        [list(range(8))] * 2])
    np.testing.assert_array_equal(packed["mask"][0], [[0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(packed["advantages"][0], [[-1, -1, -1, -1, -1, 0.5, 0.5, 0.5],
                                                            [2, 2, 0, 0, 0, 0, 0, 0]])
    assert not packed["mask"][1].any() and not packed["advantages"][1].any()
    np.testing.assert_array_equal(packed["placement"], [[0, 5, 3], [0, 0, 5], [1, 0, 2]])
    assert int(packed["microbatches"]) == 1
    np.testing.assert_array_equal(unpack(packed["tokens"], packed["placement"], 6, fill=0),
                                  [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 0], [9, 10, 0, 0, 0, 0]])
    # one key per (row, segment) over the flattened microbatch
    np.testing.assert_array_equal(sequence_keys(jnp.asarray(packed["segment_ids"][0])),
                                  [[1, 1, 1, 1, 1, 2, 2, 2], [9, 9, 8, 8, 8, 8, 8, 8]])


def _config(max_prompt=16, max_new=12, budget=100, prompts=8, samples=8, minibatches=1, microbatch_sequences=0):
    rl = {"microbatch_tokens": budget, "minibatches": minibatches, "microbatch_sequences": microbatch_sequences}
    return ml_collections.ConfigDict({"data": {"max_prompt_tokens": max_prompt},
                                      "rollout": {"max_new_tokens": max_new, "prompts_per_step": prompts,
                                                  "samples_per_prompt": samples}, "rl": rl})


def test_plan_from_config():
    # a packed row is the widest row a step can make (rl.microbatch.longest_row_tokens): 16 + 12 up to 32
    assert packing_plan(_config(max_prompt=17, max_new=16)).width == 64
    # 100 tokens hold 3 rows of 32; 64 sequences per minibatch need at most 64 rows: 22 microbatches; or 2 rows
    # (the largest divisor of 64 within 3), or 1 (within half of 2)
    plan = packing_plan(_config())
    assert (plan.width, plan.rows, plan.microbatches, plan.max_segments, plan.sequences) == (32, 3, 22, 2, 64)
    assert plan.tokens == 96 and plan.row_options == (2, 1)
    assert plan.with_rows(2) == PackingPlan(32, 2, 32, 2, 64, (2, 1))
    # cost: rows run + MICROBATCH_COST_ROWS (1) a microbatch. 64 rows: 22 x (3 + 1) = 88 < 32 x 3 < 64 x 2
    assert packing.MICROBATCH_COST_ROWS == 1
    assert plan.choose_rows([64]).rows == 3 and plan.choose_rows([21]).rows == 3  # 28 < 33 < 42
    assert PackingPlan(32, 7, 10, 2, 64, (4, 2)).choose_rows([9, 10]).rows == 4  # 32 of 7; 30 of 4 and of 2
    # llama1b at fixed lengths: 64 sequences of one row each, 25 rows in the budget: 16 (4 x 4 x 17 = 272 < 288
    # of 8 < 312 of 25); at lognormal lengths (11-13 rows of 32 sequences): 14 (60 < 65 of 4 < 72 of 8)
    assert PackingPlan(1280, 25, 3, 8, 64, (16, 8)).choose_rows([64] * 4).rows == 16
    assert PackingPlan(2304, 14, 3, 8, 32, (8, 4, 2)).choose_rows([11, 12, 12, 13]).rows == 14
    # 7 rows of 32 in the budget: 7, 4, 2 or 1 (divisors of 64); 48 sequences (prompts=6): 7, 6, 3 or 1
    assert packing_plan(_config(budget=7 * 32)).row_options == (4, 2, 1)
    assert packing_plan(_config(budget=7 * 32, prompts=6)).row_options == (6, 3, 1)
    plan = packing_plan(_config(budget=7 * 32, prompts=6), batch_devices=4)
    assert (plan.rows, plan.row_options) == (4, ())  # 4 devices: no multiple of 4 within half of 4
    # rl.microbatch_sequences sets the rows (the budget is not asked); 0 tokens: no budget, a minibatch's rows
    plan = packing_plan(_config(budget=20, microbatch_sequences=32))
    assert (plan.rows, plan.row_options) == (32, (16, 8, 4))
    assert packing_plan(_config(budget=0)).rows == 64
    # rows split over 2 devices: 2 rows; 3 devices: no divisor of 64 is a multiple of 3, so 6 rows alone
    plan = packing_plan(_config(), batch_devices=2)
    assert (plan.rows, plan.row_options) == (2, ())
    plan = packing_plan(_config(budget=7 * 32), batch_devices=3)
    assert (plan.rows, plan.row_options) == (6, ())
    # never more rows than a minibatch has sequences (4 minibatches of 16)
    plan = packing_plan(_config(budget=1 << 20, minibatches=4))
    assert (plan.rows, plan.microbatches) == (16, 1)
    with pytest.raises(ConfigError, match="rl.microbatch_tokens=20 is less than one packed row of 32 tokens"):
        packing_plan(_config(budget=20))


# ----------------------------------------------------------------------------------------------------------
# packed against unpacked, on a tiny model

PROMPTS = [5, 9, 3, 7, 4, 6, 8, 2]
COMPLETIONS = [6, 2, 10, 4, 7, 1, 9, 5]  # sequences of 7 to 17 tokens
PLANS = {  # 2 segments per 32-token row, 2 rows per microbatch: 2 of 4 microbatches used; 4 per 64-token row
    "w32": PackingPlan(width=32, rows=2, microbatches=4, max_segments=2, sequences=8),
    "w64": PackingPlan(width=64, rows=1, microbatches=8, max_segments=4, sequences=8),
}


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CONFIG, jax.random.PRNGKey(0), std=0.05)


def _sequences(seed=0):
    """Per sequence: tokens, completion mask, old / rollout / reference logprobs (perturbed per sequence, so that
    ratios, IS weights, MIS rejections and the KL are not trivial), and advantages."""
    rng = np.random.RandomState(seed)
    pairs = list(zip(PROMPTS, COMPLETIONS, strict=True))
    tokens = [rng.randint(1, CONFIG.vocab_size, p + c).astype(np.int32) for p, c in pairs]
    mask = [np.r_[np.zeros(p), np.ones(c)].astype(np.float32) for p, c in pairs]
    shift = [rng.uniform(-0.05, 0.05, len(t)).astype(np.float32) for t in tokens]
    bias = np.where(np.arange(len(tokens)) % 3 == 0, 0.03, 0.0)  # a few sequences off on average: MIS drops them
    drift = [(s + b).astype(np.float32) for s, b in zip(shift, bias, strict=True)]
    advantages = rng.randn(len(tokens)).astype(np.float32)
    return tokens, mask, shift, drift, advantages


def _batches(params, plan, precision, fp8_state=None, kv_scales=None):
    """The same minibatch unpacked ([1, S, T], one microbatch) and packed (``plan``)."""
    tokens, mask, shift, drift, advantages = _sequences()
    unpacked_tokens = right_pad(tokens, 0)
    scored = np.asarray(make_score(CONFIG, precision, 0.7)(params, fp8_state, kv_scales, unpacked_tokens))
    width = unpacked_tokens.shape[1]
    per_token = {"mask": mask, "old_logp": [], "rollout_logp": [], "ref_logp": []}
    for i, t in enumerate(tokens):
        old = scored[i, : len(t)] + shift[i] * mask[i]
        per_token["old_logp"].append(old)
        per_token["rollout_logp"].append(old + drift[i] * mask[i])
        per_token["ref_logp"].append(old - 2 * shift[i] * mask[i])
    # right-padded f32 rows (right_pad makes int32 ones)
    unpacked = {name: np.stack([np.r_[v, np.zeros(width - len(v))] for v in values]).astype(np.float32)
                for name, values in per_token.items()}
    unpacked.update(tokens=unpacked_tokens, advantages=advantages)
    unpacked = {k: jnp.asarray(v)[None] for k, v in unpacked.items()}
    packed = pack(plan, tokens, per_token, {"advantages": advantages})
    placement = packed.pop("placement")
    active = int(packed.pop("microbatches"))
    return unpacked, {k: jnp.asarray(v) for k, v in packed.items()}, placement, active


def _keep_gradients():
    """An optimizer whose state is the last gradient and whose update is 0: the train step returns its gradient."""
    return optax.GradientTransformation(init=lambda p: jax.tree.map(jnp.zeros_like, p),
                                        update=lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def _state(params, optimizer, precision, fp8_state=None):
    params = jax.tree.map(jnp.copy, params)  # the train step donates its state
    return {"params": params, "opt_state": optimizer.init(params),
            "fp8_state": jax.tree.map(jnp.copy, fp8_state) if precision.fp8 else {},
            "kv_scales": kvq.init_kv_scales(CONFIG.num_layers), "rng": jax.random.PRNGKey(0), "step": jnp.int32(0)}


def _calibrated(params):
    """A calibrated FP8 state (from scale 1 every weight is an E4M3 subnormal)."""
    tokens = jnp.asarray(right_pad(_sequences()[0], 0))
    state = llama.init_fp8_state(CONFIG, FP8)
    observed, _ = make_calibrate(CONFIG, FP8, gradients=True, temperature=0.7, passes=2)(
        params, state, kvq.init_kv_scales(CONFIG.num_layers), tokens)
    return update_state(state, observed, FP8.recipe)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("precision", ["f32", "fp8"])
def test_packed_scoring_equals_unpacked(params, plan, precision):
    plan = PLANS[plan]
    prec = F32 if precision == "f32" else FP8
    fp8_state = _calibrated(params) if prec.fp8 else None
    kv = kvq.init_kv_scales(CONFIG.num_layers)
    unpacked, packed, placement, active = _batches(params, plan, prec, fp8_state, kv)
    score = make_score(CONFIG, prec, 0.7)
    ref = np.asarray(score(params, fp8_state, kv, unpacked["tokens"][0]))
    rows = [score(params, fp8_state, kv, {k: packed[k][i] for k in ("tokens", "segment_ids", "positions")})
            for i in range(active)]
    got = np.zeros(packed["tokens"].shape, np.float32)
    got[:active] = np.stack(rows)
    got = unpack(got, placement, ref.shape[1])
    lengths = [len(t) for t in _sequences()[0]]
    valid = np.arange(ref.shape[1])[None] < np.asarray(lengths)[:, None]
    assert np.all(got[:, 0] == 0)  # each segment's first token: no logprob, as t = 0 unpacked
    np.testing.assert_allclose(got[valid], ref[valid], atol=2e-6, rtol=0)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("loss_agg, is_correction, kl", [
    ("token_mean", "tis", 0.0), ("seq_mean_token_mean", "seq_tis", 0.0), ("seq_mean_token_sum", "mis", 0.1),
    ("seq_mean_token_mean", "mis", 0.0), ("token_mean", "icepop", 0.1), ("seq_mean_token_sum_norm", "tis", 0.1)])
def test_packed_train_step_equals_unpacked_f32(params, plan, loss_agg, is_correction, kl):
    _compare_train_steps(params, PLANS[plan], F32, LossConfig(
        temperature=0.7, loss_agg=loss_agg, is_correction=is_correction, kl_coef=kl, mis_band=(0.98, 1.02),
        loss_agg_norm=12.0), rtol=1e-5)


@pytest.mark.parametrize("own_old_logp", [False, True])
def test_packed_train_step_equals_unpacked_fp8(params, own_old_logp):
    _compare_train_steps(params, PLANS["w32"], FP8, LossConfig(
        temperature=0.7, loss_agg="seq_mean_token_mean", is_correction="seq_tis"), rtol=1e-5,
        own_old_logp=own_old_logp, fp8_state=_calibrated(params))


def _compare_train_steps(params, plan, precision, loss_cfg, *, rtol, own_old_logp=False, fp8_state=None):
    unpacked, packed, placement, active = _batches(params, plan, precision, fp8_state,
                                                   kvq.init_kv_scales(CONFIG.num_layers))
    if own_old_logp:
        del unpacked["old_logp"], packed["old_logp"]
    if not loss_cfg.kl_coef:
        del unpacked["ref_logp"], packed["ref_logp"]
    optimizer = _keep_gradients()
    kw = {"old_logp_from_forward": own_old_logp}
    ref_step = make_train_step(CONFIG, precision, optimizer, loss_cfg, **kw)
    packed_step = make_train_step(CONFIG, precision, optimizer, loss_cfg, packed_sequences=plan.sequences, **kw)
    ref_state, ref_metrics, *ref_old = ref_step(_state(params, optimizer, precision, fp8_state), unpacked)
    state, metrics, *old = packed_step(_state(params, optimizer, precision, fp8_state), packed)
    assert bool(metrics["finite"]) and bool(ref_metrics["finite"])
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=rtol, atol=1e-7, err_msg=name)
    if loss_cfg.is_correction == "mis":  # the band rejects some sequences and keeps others
        assert 0 < float(ref_metrics["is_masked_fraction"]) < 1
    grads, ref_grads = jax.tree.leaves(state["opt_state"]), jax.tree.leaves(ref_state["opt_state"])
    for g, r in zip(grads, ref_grads, strict=True):
        scale = float(jnp.max(jnp.abs(r)))
        assert scale > 0
        np.testing.assert_allclose(g, r, rtol=rtol, atol=1e-6 * scale)
    if precision.fp8:  # the observed amaxes (padding counts in both layouts; it holds no maximum here)
        for a, b in zip(jax.tree.leaves(state["fp8_state"]), jax.tree.leaves(ref_state["fp8_state"]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    if own_old_logp:  # the loss's own logprobs, in the packed layout
        got = unpack(np.asarray(old[0]), placement, ref_old[0].shape[-1])
        ref = np.asarray(ref_old[0][0])
        lengths = np.asarray([len(t) for t in _sequences()[0]])
        valid = (np.arange(ref.shape[1])[None] < lengths[:, None]) & (np.arange(ref.shape[1])[None] > 0)
        np.testing.assert_allclose(got[valid], ref[valid], atol=2e-6, rtol=0)
        assert math.isclose(float(metrics["ratio_max"]), 1.0) and math.isclose(float(metrics["ratio_min"]), 1.0)
