"""GSM8K JSONL loading: the real splits, gold-answer normalisation, errors that name the file and line."""

import json

import pytest

from fp8rl_jax.data import gsm8k


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_real_splits_load():
    train = gsm8k.load_gsm8k(gsm8k.default_gsm8k_path("train"))
    test = gsm8k.load_gsm8k(gsm8k.default_gsm8k_path("test"))
    assert (len(train), len(test)) == (7473, 1319)
    first = train[0]
    assert first.question.startswith("Natalia sold clips to 48 of her friends")
    assert first.answer == "72" and first.solution.endswith("#### 72")
    assert len({p.id for p in train}) == len(train)
    # every gold answer is an integer (a few negative): what the reward's numeric comparison relies on
    assert all(p.answer.lstrip("-").isdigit() for p in train + test)


def test_default_path_is_beside_the_repo(monkeypatch):
    monkeypatch.delenv(gsm8k.ENV_DIR, raising=False)
    path = gsm8k.default_gsm8k_path("test")
    assert path.parts[-4:] == ("shared", "data", "gsm8k", "test.jsonl")


def test_env_var_overrides_and_missing_file_is_named(tmp_path, monkeypatch):
    _write(tmp_path / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    monkeypatch.setenv(gsm8k.ENV_DIR, str(tmp_path))
    assert gsm8k.default_gsm8k_path("train") == tmp_path / "train.jsonl"
    with pytest.raises(FileNotFoundError, match=f"test.jsonl.*{gsm8k.ENV_DIR}"):
        gsm8k.default_gsm8k_path("test")
    with pytest.raises(ValueError, match="split 'dev'"):
        gsm8k.default_gsm8k_path("dev")


def test_gold_answer_drops_commas_and_takes_last_marker(tmp_path):
    path = _write(tmp_path / "mini.jsonl", [
        {"question": "How many?", "answer": "It is 1,000 + 234.\n#### 1,234"},
        {"question": "Below zero?", "answer": "5 - 8 = -3\n####  -3 "},
        "",  # a blank line is skipped, not an error
        {"question": "Two markers", "answer": "#### 1\n#### 2"},
    ])
    problems = gsm8k.load_gsm8k(path)
    assert [p.answer for p in problems] == ["1234", "-3", "2"]
    assert problems[0].id == "gsm8k/mini/1" and problems[2].id == "gsm8k/mini/4"


@pytest.mark.parametrize("bad_line, message", [
    ('{"question": "q", "answer": "#### 1"', "invalid JSON"),
    ('{"question": "q"}', "missing string field 'answer'"),
    ('{"question": 3, "answer": "#### 1"}', "missing string field 'question'"),
    ('["q", "#### 1"]', "expected a JSON object"),
    ('{"question": "q", "answer": "the answer is 7"}', "no '#### <final answer>'"),
    ('{"question": "q", "answer": "7\\n####   "}', "no '#### <final answer>'"),
])
def test_bad_line_3_is_named(tmp_path, bad_line, message):
    good = {"question": "q", "answer": "#### 1"}
    path = _write(tmp_path / "broken.jsonl", [good, good, bad_line, good])
    with pytest.raises(ValueError) as err:
        gsm8k.load_gsm8k(path)
    assert "broken.jsonl" in str(err.value) and "line 3" in str(err.value) and message in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        gsm8k.load_gsm8k(tmp_path / "nope.jsonl")
