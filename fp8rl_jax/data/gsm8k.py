"""GSM8K as JSONL (one ``{"question", "answer"}`` object per line, the answer's last line ``#### <number>``).

The gold final answer is the text after ``####`` with thousands separators removed ("1,234" -> "1234"); every
GSM8K gold answer is an integer (a few negative). Loading is strict: a bad line names the file and its 1-based
line number, since a silently skipped problem would change the training set without anyone noticing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

SPLITS = ("train", "test")
ENV_DIR = "FP8RL_GSM8K_DIR"


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


def load_gsm8k(path: str | os.PathLike) -> list[Problem]:
    """Every problem of a GSM8K JSONL file; ``ValueError`` naming the file and line on the first bad line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GSM8K file {path} not found")
    problems = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # a trailing blank line is not a problem
            where = f"{path}, line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in ("question", "answer"):
                if not isinstance(row.get(key), str):
                    raise ValueError(f"{where}: missing string field {key!r}")
            gold = final_answer(row["answer"])
            if not gold:
                raise ValueError(f"{where}: the answer has no '#### <final answer>'")
            problems.append(Problem(f"gsm8k/{path.stem}/{line_no}", row["question"], gold, row["answer"]))
    return problems


def default_gsm8k_path(split: str) -> Path:
    """``$FP8RL_GSM8K_DIR/{split}.jsonl`` if the variable is set, else ``<repo>/../shared/data/gsm8k/{split}.jsonl``."""
    if split not in SPLITS:
        raise ValueError(f"GSM8K split {split!r} is invalid; allowed: {' | '.join(SPLITS)}")
    env = os.environ.get(ENV_DIR)
    if env:  # set means "here": no silent fallback to another copy of the data
        path = Path(env) / f"{split}.jsonl"
    else:  # fp8rl_jax/data/gsm8k.py -> parents[2] is the repo root; the data sit beside it, shared by checkouts
        path = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k" / f"{split}.jsonl"
    if path.exists():
        return path
    raise FileNotFoundError(
        f"GSM8K {split} split not found at {path}. "
        f"Set ${ENV_DIR} to a folder holding {split}.jsonl, or config.data.train_path / eval_path."
    )
