"""Synthetic tasks: determinism, answers checked by hand, the pattern reward's ladder."""

import re

import numpy as np
import pytest

from fp8rl_jax.data import synthetic
from fp8rl_jax.model.tokenizer import char_tokenizer


def test_streams_are_deterministic_and_splits_differ():
    a = synthetic.synthetic_problems("arithmetic", seed=3, count=50)
    assert a == synthetic.synthetic_problems("arithmetic", seed=3, count=50)
    assert a != synthetic.synthetic_problems("arithmetic", seed=4, count=50)
    assert a != synthetic.synthetic_problems("arithmetic", seed=3, count=50, split="test")
    assert len({p.id for p in a}) == 50
    with pytest.raises(ValueError, match="synthetic task 'copy'"):
        next(synthetic.iter_problems("copy", 0))


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_arithmetic_answers(digits):
    problems = synthetic.synthetic_problems("arithmetic", seed=0, count=300, digits=digits)
    ops = set()
    for p in problems:
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", p.question).groups()
        assert int(a) < 10**digits and int(b) < 10**digits
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        ops.add(op)
    assert ops == {"+", "-"}
    assert any(p.answer.startswith("-") for p in problems)


def test_pattern_problems():
    for p in synthetic.synthetic_problems("pattern", seed=1, count=200):
        letters = p.question[:-1]
        assert p.question.endswith(":") and len(letters) == 4 == len(set(letters))
        assert set(letters) <= set("abcdefgh") and p.answer == letters


@pytest.mark.parametrize("completion, expected", [
    ("bfcabfca", 1.0),
    ("bfcabfcazzzz", 1.0),  # only the first 8 chars count
    ("zzzzzzzzbfca", 0.0),
    ("b", 1 / 8),  # stopping early forfeits the rest of the window
    ("", 0.0),
    ("bxbxbxbx", 4 / 8),
    ("BFCA:bfc", 3 / 8),  # case matters, ':' is not a letter of the prompt
])
def test_pattern_score(completion, expected):
    assert synthetic.pattern_score("bfca", completion) == expected


def _mean_score(tokenizer, problems, sample_ids, rng):
    scores = []
    for p in problems:
        ids = list(sample_ids(p, rng))
        if tokenizer.eos_id in ids:
            ids = ids[: ids.index(tokenizer.eos_id)]
        scores.append(synthetic.pattern_score(p.answer, tokenizer.decode(ids)))
    return float(np.mean(scores))


def test_pattern_reward_ladder():
    """Random policy ~0.08 (in the documented 0.05-0.2); a unigram shift to the pool 0.5; copying 1.0."""
    tok = char_tokenizer()
    problems = synthetic.synthetic_problems("pattern", seed=0, count=2000)
    rng = np.random.default_rng(0)
    uniform = _mean_score(tok, problems, lambda p, r: r.integers(0, tok.vocab_size, 12), rng)
    pool_ids = tok.encode("abcdefgh", add_bos=False)
    unigram = _mean_score(tok, problems, lambda p, r: r.choice(pool_ids, 12), rng)
    copy = _mean_score(tok, problems, lambda p, r: r.choice(tok.encode(p.answer, add_bos=False), 12), rng)
    assert 0.05 <= uniform <= 0.2
    assert uniform == pytest.approx(4 / 50, abs=0.01)
    assert unigram == pytest.approx(0.5, abs=0.02)
    assert copy == 1.0


def test_arithmetic_qa_asks_the_arithmetic_sums_in_words_and_gsm8k_answer_judges_them():
    from fp8rl_jax.data.prompts import PromptRecord
    from fp8rl_jax.rl.rewards import gsm8k_answer

    plain = synthetic.synthetic_problems("arithmetic", 3, 50, "test", digits=1)
    words = synthetic.synthetic_problems("arithmetic_qa", 3, 50, "test", digits=1)
    for p, q in zip(plain, words, strict=True):  # the same draws, asked differently
        a, op, b = p.question[0], p.question[1], p.question[2]
        assert q.question == f"What is {a} {op} {b}?" and q.answer == p.answer
    assert {q.answer for q in words} >= {"-1", "9"}  # negatives come up
    record = PromptRecord("x", (1,), "", words[0].answer, "arithmetic_qa", words[0].question)
    assert gsm8k_answer([record] * 3, [f"so #### {words[0].answer}", "#### 99", f"it is {words[0].answer}."]) == [
        1.0, 0.0, 1.0]
