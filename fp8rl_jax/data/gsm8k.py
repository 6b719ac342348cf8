"""GSM8K as JSONL (one ``{"question", "answer"}`` object per line, the answer's last line ``#### <number>``).

Both splits ship with the package, gzip'd, in ``gsm8k_data/`` (OpenAI's grade-school-math release, MIT: its
LICENSE is beside them); ``$FP8RL_GSM8K_DIR`` points the defaults at another folder. ``load_gsm8k`` reads plain
or gzip'd JSONL (told apart by the gzip magic bytes, not the name), so users can pass their own files either way.

The gold final answer is the text after ``####`` with thousands separators removed ("1,234" -> "1234"); every
GSM8K gold answer is an integer (a few negative). Loading is strict: a bad line names the file and its 1-based
line number, since a silently skipped problem would change the training set without anyone noticing.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path

from fp8rl_jax.errors import InputFileError

SPLITS = ("train", "test")
ENV_DIR = "FP8RL_GSM8K_DIR"
SHIPPED_DIR = Path(__file__).resolve().parent / "gsm8k_data"  # {train,test}.jsonl.gz and their LICENSE
_GZIP_MAGIC = b"\x1f\x8b"


@dataclasses.dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str  # the gold final answer, normalised ("1234", "-3")
    solution: str = ""  # the worked solution when the dataset has one (GSM8K's full ``answer`` field)


def final_answer(answer: str) -> str | None:
    """The text after the last ``####`` of a GSM8K ``answer`` field, commas removed; None without ``####``."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(1-based line number, text)`` of a UTF-8 file, gzip'd or not; ``InputFileError`` (a ValueError) naming the
    file (and the line, for bytes that are not UTF-8) on anything unreadable."""
    with path.open("rb") as f:
        gzipped = f.read(2) == _GZIP_MAGIC
    line_no = 0
    try:
        with gzip.open(path, "rb") if gzipped else path.open("rb") as f:
            for line_no, raw in enumerate(f, start=1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise InputFileError(f"{path}, line {line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                                     f"column {e.start + 1}); expected UTF-8 JSONL") from None
                yield line_no, text
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut-off .gz ends in EOFError
        what = "a damaged gzip file" if gzipped else "unreadable"
        raise InputFileError(f"{path}: {what} after line {line_no} ({type(e).__name__}: {e})") from None


def load_gsm8k(path: str | os.PathLike) -> list[Problem]:
    """Every problem of a GSM8K JSONL file (``.jsonl`` or ``.jsonl.gz``); ``InputFileError`` (a ValueError) naming
    the file and line on the first bad line, and naming the file when it holds no problem at all."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GSM8K file {path} not found")
    stem = Path(path.name.removesuffix(".gz")).stem  # "train.jsonl.gz" -> "train": ids as for the plain file
    problems = []
    for line_no, line in _lines(path):
        if not line.strip():
            continue  # a trailing blank line is not a problem
        where = f"{path}, line {line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputFileError(f"{where}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise InputFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                raise InputFileError(f"{where}: missing string field {key!r}")
        gold = final_answer(row["answer"])
        if not gold:
            raise InputFileError(f"{where}: the answer has no '#### <final answer>'")
        problems.append(Problem(f"gsm8k/{stem}/{line_no}", row["question"], gold, row["answer"]))
    if not problems:
        raise InputFileError(f"{path}: holds no problems (the file is empty or blank); expected one JSON object "
                         '{"question": ..., "answer": "... #### <number>"} per line')
    return problems


def default_gsm8k_path(split: str) -> Path:
    """``$FP8RL_GSM8K_DIR/{split}.jsonl`` if the variable is set, else the copy shipped in the package
    (``gsm8k_data/{split}.jsonl.gz``)."""
    if split not in SPLITS:
        raise ValueError(f"GSM8K split {split!r} is invalid; allowed: {' | '.join(SPLITS)}")
    env = os.environ.get(ENV_DIR)
    if env:  # set means "here": no silent fallback to another copy of the data
        path = Path(env) / f"{split}.jsonl"
    else:
        path = SHIPPED_DIR / f"{split}.jsonl.gz"
    if path.exists():
        return path
    if not env:  # the package itself is incomplete: an install that dropped its package data
        raise FileNotFoundError(f"GSM8K {split} split not found at {path}: this install of fp8rl_jax lacks its "
                                f"package data. Reinstall it, or set ${ENV_DIR} to a folder holding {split}.jsonl.")
    raise FileNotFoundError(
        f"GSM8K {split} split not found at {path}. "
        f"Set ${ENV_DIR} to a folder holding {split}.jsonl, or config.data.train_path / eval_path."
    )
