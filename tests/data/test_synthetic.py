"""Synthetic tasks: determinism, answers checked by hand, the pattern reward's ladder, the char tokenizer."""

import re
import string

import numpy as np
import pytest

from fp8rl_jax.data import synthetic
from fp8rl_jax.model.config import PRESETS


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
    tok = synthetic.char_tokenizer()
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


def test_char_tokenizer_vocabulary():
    tok = synthetic.char_tokenizer()
    expected = ["<pad>", "<bos>", "<eos>", *string.digits, *string.ascii_lowercase, *"+-=*: ?.,#\n"]
    assert [tok.backend.id_to_token(i) for i in range(tok.vocab_size)] == expected
    assert tok.vocab_size == 50 <= PRESETS["tiny"].vocab_size
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.stop_ids) == (0, 1, 2, (2,))


@pytest.mark.parametrize("text", ["a b:12", "37+48=85", "kqz:\n\nx  y", "#### -3.5, ok?", "a*b=c"])
def test_char_tokenizer_round_trip(text):
    tok = synthetic.char_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and len(ids) == len(text) + 1  # one token per character, after <bos>
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text
    assert tok.encode(text, add_bos=False) == ids[1:]


def test_char_tokenizer_rejects_unknown_chars():
    tok = synthetic.char_tokenizer()
    with pytest.raises(ValueError, match=r"\['A', 'Q'\] are not in the char tokenizer"):
        tok.encode("Q: 2A")
    assert tok.encode("<bos>ab<eos>", add_bos=False) == [1, 13, 14, 2]  # special tokens are not unknown
