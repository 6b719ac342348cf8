"""Reward functions on hand-written completions, the registry, and the thread/hang safety of gsm8k_answer."""

import threading
import time

import numpy as np
import pytest

from fp8rl_jax.data.prompts import PromptRecord
from fp8rl_jax.rl import rewards


def _records(answer, n=1, task="gsm8k"):
    return [PromptRecord(f"p{i}", (), "", answer, task) for i in range(n)]


def _score(name, answer, completion):
    return rewards.get_reward_fn(name)(_records(answer), [completion])[0]


@pytest.mark.parametrize("completion, gold, expected", [
    ("48 / 2 = 24 clips in May.\n48 + 24 = 72 in total.\n#### 72", "72", 1.0),
    ("48 + 24 = 72\n#### 71", "72", 0.0),
    ("#### 72\nThen I kept talking about 5 apples.", "72", 1.0),  # the #### line decides, not the last number
    ("She sold 48 + 24 = 72 clips.", "72", 1.0),  # no ####: the last number
    ("She sold 72 clips, 3 more than 69", "72", 0.0),  # no ####: the last number, 69, is wrong
    ("#### 1,234", "1234", 1.0),
    ("The total is 1,234.", "1234", 1.0),
    ("#### $18", "18", 1.0),
    ("She makes $18.00 every day.", "18", 1.0),
    ("#### 18.00", "18", 1.0),
    ("#### 18.5", "18", 0.0),
    ("#### -3", "-3", 1.0),
    ("#### 3", "-3", 0.0),
    ("The temperature drops 5-3 degrees", "-3", 0.0),  # a minus between numbers is not a sign
    ("#### 3*6 = 18", "18", 1.0),  # after the last "=" on the answer line
    ("#### 36/2", "18", 1.0),  # an expression: math_verify
    ("#### \\frac{36}{2}", "18", 1.0),
    ("#### 36/2", "36", 0.0),  # its first number is not the answer
    ("#### \\boxed{18}", "18", 1.0),
    ("#### eighteen", "18", 0.0),
    ("####", "18", 0.0),
    ("", "18", 0.0),
    ("no numbers here", "18", 0.0),
    ("__import__('os').system('x')", "0", 0.0),
    ("#### __import__('os').system('x')", "18", 0.0),
    ("#### __import__('os').system('echo 18')", "18", 0.0),  # code holding the gold number: not an answer
    ("#### 9^9^9^9", "18", 0.0),  # would never return without the whitelist
    ("#### 9**9**9**9", "18", 0.0),
    ("#### 18" + "9" * 10_000, "18", 0.0),
])
def test_gsm8k_answer(completion, gold, expected):
    assert _score("gsm8k_answer", gold, completion) == expected


# Code and paths are not answers (the rule in gsm8k_correct's docstring): hand-written cases, both directions.
@pytest.mark.parametrize("completion, gold, expected", [
    # still answers: money, units, rates, prose, markdown / LaTeX wrappers, apostrophes of prose
    ("#### 18", "18", 1.0),
    ("#### $18.00", "18", 1.0),
    ("#### 18 dollars", "18", 1.0),
    ("#### 3*6 = 18", "18", 1.0),
    ("#### 18km", "18", 1.0),
    ("#### 18 km/h", "18", 1.0),
    ("#### $18/hour", "18", 1.0),
    ("#### **18**", "18", 1.0),
    ("#### (18)", "18", 1.0),
    ("#### \\$18", "18", 1.0),
    ("#### \\left(18\\right)", "18", 1.0),
    ("#### Janet's total is 18.", "18", 1.0),
    ("#### The twins' total: 18", "18", 1.0),
    ("#### - 3", "-3", 1.0),
    # not answers: the number glued into an identifier or a path, or a line of code around it
    ("#### x18", "18", 0.0),
    ("#### a$18", "18", 0.0),
    ("#### /tmp/18", "18", 0.0),
    ("#### /tmp/run/pytest-18/pwned", "18", 0.0),
    ("#### pytest-18", "18", 0.0),
    ("#### v.18", "18", 0.0),
    ("#### 18/tmp/pwned", "18", 0.0),
    ("#### print(18)", "18", 0.0),
    ("#### '18'", "18", 0.0),
    ('#### "18"', "18", 0.0),
    ("#### `18`", "18", 0.0),
    ("#### 18_000", "18", 0.0),
    ("#### open('pwned') or x == 18", "18", 0.0),  # the "=" split must not let code through
    ("#### 18');import os;os.system('x", "18", 0.0),
    # without ####: the last number that is not glued into a path or identifier
    ("open('/tmp/run/pytest-18/pwned')", "18", 0.0),
    ("The log is in /tmp/run/pytest-7/out, and the answer is 18", "18", 1.0),
    ("The answer is 18, see /tmp/run/pytest-7/out", "18", 1.0),
])
def test_gsm8k_answer_code_and_paths(completion, gold, expected):
    assert _score("gsm8k_answer", gold, completion) == expected


def test_gsm8k_answer_never_executes_model_text(tmp_path, monkeypatch):
    """Code in the answer neither runs nor earns. The attacks name their marker by a relative path from a
    working directory of our own, so no digit of the machine's tmp path (pytest-0, pytest-1, ...) is in them."""
    monkeypatch.chdir(tmp_path)
    attacks = ["#### __import__('os').system('touch pwned')", "#### eval(\"open('pwned', 'w')\")",
               "#### (lambda: open('pwned', 'w'))()", "#### exec(\"open('pwned', 'w')\")",
               "__import__('os').system('touch pwned')"]
    # no digit in the attacks: whatever the rule for code, they can never form the gold 7
    assert not any(ch.isdigit() for attack in attacks for ch in attack)
    assert rewards.get_reward_fn("gsm8k_answer")(_records("7", len(attacks)), attacks) == [0.0] * len(attacks)
    # the same attacks holding the gold's digits: code is not an answer, so they earn 0 all the same
    with_gold = [a.replace("pwned", "pwned7") for a in attacks] + ["#### __import__('os').system('echo 7 > pwned')"]
    assert rewards.get_reward_fn("gsm8k_answer")(_records("7", len(with_gold)), with_gold) == [0.0] * len(with_gold)
    assert list(tmp_path.iterdir()) == []


def test_gsm8k_answer_in_a_worker_thread():
    """math_verify's default timeouts use signal.alarm, which fails outside the main thread; ours must not."""
    from math_verify import parse

    def library_default():
        parse("$\\frac{36}{2}$")

    errors = []
    t = threading.Thread(target=lambda: _catch(library_default, errors))
    t.start()
    t.join()
    assert errors and "thread" in str(errors[0])  # the hazard this reward is written around is real

    completions = ["#### \\frac{36}{2}", "#### 36/2", "#### 18", "#### 17", "so 18", "#### 9^9^9^9"]
    results = []
    t = threading.Thread(target=lambda: results.append(
        rewards.get_reward_fn("gsm8k_answer")(_records("18", len(completions)), completions)))
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and results == [[1.0, 1.0, 1.0, 0.0, 1.0, 0.0]]


def _catch(fn, errors):
    try:
        fn()
    except Exception as e:
        errors.append(e)


def test_hostile_answers_return_quickly():
    hostile = ["#### " + "(" * 30 + "1" + ")" * 30, "#### " + "9" * 18 + "*" + "9" * 18, "#### 99!" * 3,
               "#### 1/0", "#### " + "1," * 5000, "####" * 5000 + " 7"]
    start = time.perf_counter()
    for c in hostile:
        assert _score("gsm8k_answer", "18", c) == 0.0
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("completion, expected", [
    ("so the answer is\n#### 42", 1.0),
    ("#### -3", 1.0),
    ("####$1,234", 1.0),
    ("#### 7 wrong but well formed", 1.0),
    ("The answer is 42", 0.0),
    ("####\n42", 0.0),  # the number must be on the #### line
    ("#### forty-two", 0.0),
    ("", 0.0),
])
def test_gsm8k_format(completion, expected):
    assert _score("gsm8k_format", "42", completion) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("85", "85", 1.0),
    ("85<eos>junk", "85", 1.0),
    (" 85 because", "85", 1.0),
    ("86", "85", 0.0),
    ("850", "85", 0.0),
    ("-36", "-36", 1.0),
    ("36", "-36", 0.0),
    ("1 then 85", "85", 0.0),  # the first integer counts
    ("", "85", 0.0),
    ("__import__('os')", "0", 0.0),
])
def test_arithmetic(completion, answer, expected):
    assert _score("arithmetic", answer, completion) == expected


def test_pattern():
    fn = rewards.get_reward_fn("pattern")
    records = _records("bfca", 4, task="pattern")
    assert fn(records, ["bfcabfca", "bbbbzzzz", "", "zzzzzzzzbfca"]) == [1.0, 0.5, 0.0, 0.0]


def test_registry():
    assert {"gsm8k_answer", "gsm8k_format", "arithmetic", "pattern"} <= set(rewards.reward_names())
    with pytest.raises(ValueError, match="unknown reward 'nope'; allowed: .*gsm8k_answer"):
        rewards.get_reward_fn("nope")
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("pattern")(lambda prompts, completions, **kw: [])


def test_combined_rewards():
    records = _records("18", 3)
    completions = ["#### 18", "18", "#### 17"]
    total, per_fn = rewards.combined_rewards(["gsm8k_answer", "gsm8k_format"], [1.0, 0.1], records, completions)
    np.testing.assert_allclose(per_fn["gsm8k_answer"], [1, 1, 0])
    np.testing.assert_allclose(per_fn["gsm8k_format"], [1, 0, 1])
    np.testing.assert_allclose(total, [1.1, 1.0, 0.1], rtol=1e-6)
    total2, _ = rewards.combined_rewards("gsm8k_answer, gsm8k_format", "", records, completions)
    np.testing.assert_allclose(total2, [2, 1, 1])
    with pytest.raises(ValueError, match="1 reward weights for 2"):
        rewards.combined_rewards("gsm8k_answer,gsm8k_format", "1.0", records, completions)
    with pytest.raises(ValueError, match="3 prompts for 2 completions"):
        rewards.combined_rewards("gsm8k_answer", None, records, completions[:2])


def test_combined_rewards_rejects_bad_fn_output():
    name = "test_only_nan_reward"
    if name not in rewards.reward_names():
        rewards.register(name)(lambda prompts, completions, **kw: [float("nan")] * len(completions))
    with pytest.raises(ValueError, match=f"reward '{name}'.*finite"):
        rewards.combined_rewards([name], None, _records("1", 2), ["a", "b"])


@pytest.mark.parametrize("name, completion, answer", [
    ("gsm8k_answer", "48 + 24 = 72 in total.\n#### 72", "72"),
    ("gsm8k_answer", "#### 72\nThen I kept talking about 5 apples.", "72"),
    ("gsm8k_answer", "She sold 72 clips, 3 more than 69", "69"),  # no ####: the last number
    ("gsm8k_answer", "#### $18.00", "$18.00"),  # as written; it reads as 18
    ("gsm8k_answer", "#### -3", "-3"),
    ("gsm8k_answer", "#### 3*6 = 18", "18"),
    ("gsm8k_answer", "#### 36/2", "36/2"),  # an expression: math_verify decides
    ("gsm8k_answer", "#### \\frac{36}{2}", "\\frac{36}{2}"),
    ("gsm8k_answer", "#### __import__('os').system('echo 18')", None),  # code is no answer
    ("gsm8k_answer", "#### x18", None),
    ("gsm8k_answer", "the file is /tmp/18", None),
    ("gsm8k_answer", "####", None),
    ("gsm8k_answer", "no numbers here", None),
    ("gsm8k_answer", "#### 18" + "9" * 100, None),  # too long to be a number
    ("gsm8k_format", "so 40 + 2\n#### 42 apples\nthe end", "#### 42 apples"),
    ("gsm8k_format", "#### forty-two", None),
    ("arithmetic", " 85<eos>junk", "85"),
    ("arithmetic", "no digits", None),
    ("pattern", "bfcabfcazz", "bfcabfca"),  # the first 8 characters: what the reward scores
])
def test_answer_text(name, completion, answer):
    assert rewards.answer_text(name, completion) == answer


def test_answer_text_agrees_with_the_reward():
    """The answer shown is the one graded: its value decides gsm8k_answer."""
    for completion, gold in [("#### $1,234.00", "1234"), ("she has 12, then 18", "18"), ("#### 36/2", "18"),
                             ("#### 7", "18")]:
        shown = rewards.answer_text("gsm8k_answer", completion)
        assert rewards.gsm8k_correct(completion, gold) == rewards.gsm8k_correct(f"#### {shown}", gold)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        rewards.answer_text("nope", "")
