"""GSM8K JSONL loading: the real splits, gold-answer normalisation, errors that name the file and line."""

import fnmatch
import gzip
import json
import tomllib
from pathlib import Path

import pytest

from fp8rl_jax.config import base_config
from fp8rl_jax.data import gsm8k, prompts
from fp8rl_jax.model.tokenizer import char_tokenizer
from fp8rl_jax.plan import data_spec


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_shipped_splits_load(monkeypatch):
    monkeypatch.delenv(gsm8k.ENV_DIR, raising=False)
    train = gsm8k.load_gsm8k(gsm8k.default_gsm8k_path("train"))
    test = gsm8k.load_gsm8k(gsm8k.default_gsm8k_path("test"))
    # counted by hand in OpenAI's release (wc -l train.jsonl test.jsonl; no blank lines)
    assert (len(train), len(test)) == (7473, 1319)
    first = train[0]
    assert first.id == "gsm8k/train/1"
    assert first.question == ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                              "clips in May. How many clips did Natalia sell altogether in April and May?")
    assert first.answer == "72"
    assert first.solution == ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
                              "clips altogether in April and May.\n#### 72")
    assert test[0].question.startswith("Janet\u2019s ducks lay 16 eggs per day.") and test[0].answer == "18"
    assert test[-1].id == "gsm8k/test/1319"
    assert len({p.id for p in train}) == len(train)
    # every gold answer is an integer (a few negative): what the reward's numeric comparison relies on
    assert all(p.answer.lstrip("-").isdigit() for p in train + test)


def test_default_path_is_the_shipped_copy(monkeypatch):
    monkeypatch.delenv(gsm8k.ENV_DIR, raising=False)
    package_dir = Path(gsm8k.__file__).resolve().parent
    for split in gsm8k.SPLITS:
        path = gsm8k.default_gsm8k_path(split)
        assert path == package_dir / "gsm8k_data" / f"{split}.jsonl.gz" and path.is_file()
    assert "MIT License" in (package_dir / "gsm8k_data" / "LICENSE").read_text()


def test_shipped_files_are_package_data():
    """A wheel/sdist carries only what pyproject.toml names: every shipped file must match a pattern there."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["fp8rl_jax.data"]
    data_dir = Path(gsm8k.__file__).resolve().parent
    shipped = sorted(str(f.relative_to(data_dir)) for f in (data_dir / "gsm8k_data").iterdir())
    assert shipped == ["gsm8k_data/LICENSE", "gsm8k_data/test.jsonl.gz", "gsm8k_data/train.jsonl.gz"]
    for name in shipped:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name


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


def test_gzipped_file_reads_like_the_plain_one(tmp_path):
    rows = [{"question": "How many?", "answer": "#### 1,234"}, {"question": "Caf\u00e9?", "answer": "#### -3"}]
    plain = _write(tmp_path / "mine.jsonl", rows)
    zipped = tmp_path / "mine.jsonl.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    misnamed = tmp_path / "other.jsonl"  # gzip'd content under a plain name: told apart by its magic bytes
    misnamed.write_bytes(zipped.read_bytes())
    expected = [gsm8k.Problem("gsm8k/mine/1", "How many?", "1234", "#### 1,234"),
                gsm8k.Problem("gsm8k/mine/2", "Caf\u00e9?", "-3", "#### -3")]
    assert gsm8k.load_gsm8k(plain) == expected
    assert gsm8k.load_gsm8k(zipped) == expected
    assert [p.answer for p in gsm8k.load_gsm8k(misnamed)] == ["1234", "-3"]


def test_bad_line_in_a_gzipped_file_is_named(tmp_path):
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n'))
    with pytest.raises(ValueError, match=r"broken\.jsonl\.gz, line 2: missing string field 'answer'"):
        gsm8k.load_gsm8k(path)


def test_binary_file_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "\xff\xfe", "answer": "#### 2"}\n')
    with pytest.raises(ValueError) as err:
        gsm8k.load_gsm8k(path)
    message = str(err.value)
    assert message == f"{path}, line 2: not UTF-8 text (byte 0xff at column 15); expected UTF-8 JSONL"


def test_damaged_gzip_is_named(tmp_path):
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"question": "q", "answer": "#### 1"}\n' * 200)[:60])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: a damaged gzip file after line \d+"):
        gsm8k.load_gsm8k(path)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file_says_it_holds_no_problems(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"empty\.jsonl: holds no problems"):
        gsm8k.load_gsm8k(path)


def test_empty_train_file_is_named_by_the_trainers_loader(tmp_path, monkeypatch):
    """The trainer reaches the file through ``load_prompts``: it must blame the file, not max_prompt_tokens."""
    c = base_config()
    c.data.dataset, c.data.prompt_format, c.data.train_path = "gsm8k", "plain", str(tmp_path / "empty.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl: holds no problems") as err:
        prompts.load_prompts(data_spec(c), char_tokenizer(), "train")
    assert "max_prompt_tokens" not in str(err.value)
    # a dataset that yields nothing by any route is reported as such
    monkeypatch.setattr(prompts, "load_problems", lambda config, split: ([], "{question}"))
    with pytest.raises(ValueError, match="config.data.dataset='gsm8k': the train split holds no problems"):
        prompts.load_prompts(data_spec(c), char_tokenizer(), "train")
