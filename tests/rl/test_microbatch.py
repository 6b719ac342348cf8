"""The microbatch's token budget: sequences per microbatch by hand, what the shipped configs get, and the calibration
passes that go a microbatch at a time observing what one pass over all rows observes."""

import os
import re

import jax
import numpy as np
import pytest

from fp8rl_jax.config import ConfigError, base_config, load_config_file, validate
from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.plan import longest_row_tokens, microbatch_sequences
from fp8rl_jax.rl import microbatch
from fp8rl_jax.rl.step import make_calibrate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tokens: int, sequences: int = 0):
    c = base_config()
    c.rl.microbatch_tokens = tokens
    c.rl.microbatch_sequences = sequences
    return c


@pytest.mark.parametrize("tokens, sequences, minibatch, row, expected", [
    (32768, 0, 256, 512, 64),  # 32768 / 512 = 64 rows fit, and 64 divides 256
    (16384, 0, 256, 512, 32),
    (32768, 0, 256, 480, 64),  # 68 rows fit; the largest divisor of 256 up to 68 is 64
    (1000, 0, 12, 200, 4),  # 5 rows fit; the divisors of 12 are 1 2 3 4 6 12
    (1000, 0, 7, 100, 7),  # 10 rows fit, the batch has 7: all of it
    (600, 0, 7, 100, 1),  # 6 rows fit, and 7 is prime
    (100, 0, 64, 512, 1),  # not one row fits: still 1 (never 0)
    (0, 0, 256, 512, 256),  # no budget: the whole batch
    (32768, 32, 256, 512, 32),  # microbatch_sequences wins over the budget...
    (16, 32, 256, 512, 32),  # ...however small the budget
    (32768, 48, 64, 512, 32),  # a batch it does not divide (the calibration's): the largest divisor up to it
])
def test_microbatch_sequences_by_hand(tokens, sequences, minibatch, row, expected):
    assert microbatch_sequences(_config(tokens, sequences), minibatch, row) == expected
    assert microbatch.microbatch_sequences(minibatch, row, budget_tokens=tokens, sequences=sequences) == expected


@pytest.mark.parametrize("prompt, new, expected", [
    (256, 256, 512), (16, 12, 32), (128, 64, 192), (250, 3, 256), (256, 1024, 1280), (1, 31, 32), (1, 32, 64)])
def test_longest_row_is_prompt_plus_completion_padded_to_32(prompt, new, expected):
    c = base_config()
    c.data.max_prompt_tokens, c.rollout.max_new_tokens = prompt, new
    assert longest_row_tokens(c) == expected
    assert microbatch.longest_row_tokens(prompt, new) == expected


SCALED_DEMO = {"rollout.prompts_per_step": 32, "rollout.samples_per_prompt": 8, "rollout.max_new_tokens": 256,
               "rollout.decode_slots": 256}
# (config file, overrides, its row in microbatch.py's table: minibatch, longest row, sequences, what set them)
SHIPPED = [
    ("tiny", {}, "tiny", 64, 32, 64, "budget"),  # 8 x 8 rows; 16 + 12 -> 32 tokens
    ("smollm2_gsm8k", {}, "smollm2_gsm8k", 8, 384, 8, "budget"),  # 256 + 128
    # the run: 111 GiB with all 256 rows in one microbatch; 32768 / 512 = 64
    ("smollm2_gsm8k", SCALED_DEMO, "smollm2_gsm8k, scaled demo*", 256, 512, 64, "budget"),
    ("smollm2_arith", {}, "smollm2_arith", 128, 192, 32, "microbatch_sequences"),  # 16 x 8; 128 + 64
    ("llama1b", {}, "llama1b", 128, 1280, 32, "microbatch_sequences"),  # 64 x 8 / 4 minibatches; 256 + 1024
    ("llama8b", {}, "llama8b", 128, 2304, 16, "microbatch_sequences"),  # 128 x 8 / 8; 256 + 2048
]


@pytest.mark.parametrize("name, overrides, label, minibatch, row, expected, source", SHIPPED,
                         ids=[s[2] for s in SHIPPED])
def test_shipped_configs_microbatch(tmp_path, name, overrides, label, minibatch, row, expected, source):
    config = load_config_file(os.path.join(REPO, "configs", f"{name}.py"),
                              str(tmp_path) if name.startswith("llama") else None)
    config.update_from_flattened_dict(overrides)
    validate(config)
    got_minibatch = config.rollout.prompts_per_step * config.rollout.samples_per_prompt // config.rl.minibatches
    got = microbatch_sequences(config, got_minibatch, longest_row_tokens(config))
    print(f"{label}: minibatch {got_minibatch}, longest row {longest_row_tokens(config)}, microbatch {got}")
    assert (got_minibatch, longest_row_tokens(config), got) == (minibatch, row, expected)
    assert (config.rl.microbatch_sequences != 0) == (source == "microbatch_sequences")
    # the module's table says the same
    line = rf"^\s*{re.escape(label)}\s+{minibatch}\s+{row}\s+{expected} \({source}\)\s+{expected * row}$"
    assert re.search(line, microbatch.__doc__, re.M), line


def test_budget_keys_are_validated():
    for key, value, message in [
        ("rl.microbatch_tokens", -1, "config.rl.microbatch_tokens=-1 is invalid; allowed: >= 0"),
        ("rl.microbatch_sequences", 3, "config.rl.microbatch_sequences=3 is invalid; allowed: 0 (from "
                                       "rl.microbatch_tokens) or a divisor of the minibatch size 32"),
        ("precision.kv_calibration_sequences", 0, "config.precision.kv_calibration_sequences=0 is invalid; "
                                                  "allowed: > 0"),
    ]:
        c = base_config()
        section, name = key.split(".")
        c[section][name] = value
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(c)


def test_calibration_in_microbatches_observes_what_one_pass_over_all_rows_does():
    """Amaxes combine with max, and the cotangent's mean counts every row of the pass: 2 microbatches of 2 rows
    observe what one call over the 4 rows does (a per-microbatch mean would double the gradient amaxes)."""
    model = preset("tiny")
    params = llama.init_params(model, jax.random.PRNGKey(0))
    precision = Precision(backend="xla", lm_head_fp8=True, kv_cache_dtype="float8_e4m3fn")
    fp8_state = llama.init_fp8_state(model, precision)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 16), 0, model.vocab_size)
    kv = kvq.init_kv_scales(model.num_layers)
    kw = {"gradients": True, "temperature": 0.7, "passes": 2}
    whole, whole_kv = make_calibrate(model, precision, **kw)(params, fp8_state, kv, tokens)
    parts, parts_kv = make_calibrate(model, precision, microbatch=2, **kw)(params, fp8_state, kv, tokens)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=0), (whole, whole_kv),
                 (parts, parts_kv))
    # the head's gradient amax is d mean(logp) / d logits = (onehot - p) / (T n), n = 4 rows x 15 predictions:
    # below 1 / (0.7 * 60) = 1 / 42 (a mean over one microbatch's 2 rows would allow 1 / 21)
    head_grad = float(parts["lm_head"]["grad"]["amax_history"][0])
    assert 0.5 / 42 < head_grad < 1 / 42
    with pytest.raises(ValueError, match="4 rows are not a whole number of 3-row microbatches"):
        make_calibrate(model, precision, microbatch=3)(params, fp8_state, kv, tokens)


@pytest.mark.parametrize("longest, expected", [
    (512, (32, 64, 128, 256, 512)), (32, (32,)), (192, (32, 64, 128, 192)), (1280, (32, 64, 128, 256, 512, 1024, 1280)),
    (2304, (32, 64, 128, 256, 512, 1024, 2048, 2304)), (500, (32, 64, 128, 256, 512))])
def test_row_buckets_are_powers_of_two_times_32_and_the_longest_row(longest, expected):
    assert microbatch.row_buckets(longest) == expected


def test_bucket_width_bounds_the_widths_a_run_compiles_for():
    """Whatever the completion lengths, a run's rows take one of a few widths (a compile each), each the smallest
    bucket that holds the longest row; the old rounding to 32 gave a width per multiple of 32."""
    widths = {microbatch.bucket_width(n, 512) for n in range(1, 513)}
    assert widths == {32, 64, 128, 256, 512}
    assert len({microbatch.row_width(n) for n in range(1, 513)}) == 16
    assert microbatch.bucket_width(257, 512) == 512 and microbatch.bucket_width(256, 512) == 256
    assert microbatch.bucket_width(1100, 1280) == 1280 and microbatch.bucket_width(1000, 1280) == 1024
    with pytest.raises(ValueError, match="longer than the run's longest row"):
        microbatch.bucket_width(513, 512)
