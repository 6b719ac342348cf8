"""Reward functions by name: ``fn(prompts, completions, **kw) -> list[float]``, one float per completion.

``prompts[i]`` is the ``PromptRecord`` that ``completions[i]`` answers (the trainer repeats each record once per
sample of its group). Rewards run on the host, in pure Python, and never eval/exec model text: answers are read
with regular expressions and compared as exact fractions. ``math_verify`` reaches SymPy's ``parse_expr``, which
calls Python's ``eval``, and can spin forever on "9^9^9^9"; so it only ever sees a short answer span that has
passed a whitelist of digits, + - * / ( ) and a few LaTeX commands (see ``_math_verify_equal``).

Add a reward with ``@register("name")``; select them with ``config.reward.fns`` / ``config.reward.weights``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from fp8rl_jax.data import synthetic

if TYPE_CHECKING:
    from fp8rl_jax.data.prompts import PromptRecord

RewardFn = Callable[..., list[float]]
AnswerFn = Callable[[str], str | None]  # completion -> the answer a reward reads in it, as written (None: none)
_REGISTRY: dict[str, RewardFn] = {}
_ANSWERS: dict[str, AnswerFn] = {}


def register(name: str, answer: AnswerFn | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as ``config.reward.fns`` entry ``name``; ``answer`` (optional) shows what
    the reward reads as a completion's answer, for evaluation reports (``answer_text``)."""

    def add(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered (by {_REGISTRY[name].__module__})")
        _REGISTRY[name] = fn
        if answer is not None:
            _ANSWERS[name] = answer
        return fn

    return add


def get_reward_fn(name: str) -> RewardFn:
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; allowed: {', '.join(reward_names())}")
    return _REGISTRY[name]


def reward_names() -> list[str]:
    return sorted(_REGISTRY)


def answer_text(name: str, completion: str) -> str | None:
    """The answer reward ``name`` reads in ``completion``, as written ("$18.00", "36/2"), for reports; None when it
    finds none, or when the reward registered no reader. Regular expressions only, like the rewards."""
    get_reward_fn(name)  # an unknown name fails as it does for the reward itself
    read = _ANSWERS.get(name)
    return None if read is None else read(completion)


def combined_rewards(names: Sequence[str] | str, weights: Sequence[float] | str | None,
                     prompts: Sequence[PromptRecord], completions: Sequence[str]
                     ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(weighted sum ``[N]``, each fn's raw rewards ``[N]``) over ``N`` completions; weights default to 1.

    ``names`` and ``weights`` may be the config's comma-separated strings.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if isinstance(weights, str):
        weights = [float(w) for w in weights.split(",") if w.strip()]
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(f"{len(weights)} reward weights for {len(names)} reward fns {list(names)}")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions; need one each")
    total = np.zeros(len(completions), np.float32)
    per_fn = {}
    for name, weight in zip(names, weights, strict=True):
        values = np.asarray(get_reward_fn(name)(list(prompts), list(completions)), np.float32)
        if values.shape != total.shape or not np.all(np.isfinite(values)):
            raise ValueError(f"reward {name!r} returned {values.shape} values (finite: "
                             f"{bool(np.all(np.isfinite(values)))}); need {total.shape}, all finite")
        per_fn[name] = values
        total += np.float32(weight) * values
    return total, per_fn


# ----------------------------------------------------------------------------------------------------------
# reading numbers

# A number as written in a solution: an optional sign (not the minus of "5-3", hence the look-behind), an
# optional "$", digits with optional thousands commas ("1,234" but not the list "1,2,3"), optional decimals.
_NUMBER = re.compile(r"(?<![\w.)])(-)?[ \t]?\$?[ \t]?((?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
_MAX_DIGITS = 40  # longer digit strings are not answers, and int() refuses past 4300 digits anyway


def _value(match: re.Match) -> Fraction | None:
    sign, digits = match.groups()
    digits = digits.replace(",", "")
    return Fraction((sign or "") + digits) if len(digits) <= _MAX_DIGITS else None


def numbers(text: str) -> list[Fraction]:
    """Every number in ``text``, in order, as an exact fraction ("1,234" -> 1234, "$18.00" -> 18, "-3" -> -3)."""
    return [v for v in map(_value, _NUMBER.finditer(text)) if v is not None]


def _as_number(text: str) -> Fraction | None:
    found = numbers(text.strip())
    return found[0] if len(found) == 1 else None


def final_answer_span(completion: str) -> str | None:
    """The first non-empty line after the last ``####``, and of that the part after its last "=" ("#### 3*6 = 18"
    -> "18"); None when the completion has no ``####``."""
    if "####" not in completion:
        return None
    line = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    parts = [part.strip() for part in line.split("=") if part.strip()]
    return parts[-1] if parts else ""


# math_verify is let in only on spans of arithmetic it cannot blow up: no "^"/"**" (9^9^9 never returns), no "!",
# no letters, at most 64 chars and 18-digit numbers. Then it runs with its timeouts off.
_MV_LATEX = re.compile(r"\\(?:[dt]?frac|boxed|left|right|cdot|times|div)(?![a-zA-Z])|\\[,$ ]")
_MV_CHARS = re.compile(r"[\d\s+\-*/().,${}]*")
# an answer span is an expression when its first number is a LaTeX fraction's or is followed by an operator
# and an operand ("36/2", "3 * 6"); then that first number is not the answer
_FRACTION = re.compile(r"\\[dt]?frac")
_OPERATOR_NEXT = re.compile(r"\s*[-+*/^\u00d7\u00f7][\s*^]*[\d(.$\\]")


def _math_verify_safe(span: str) -> bool:
    return (len(span) <= 64 and "**" not in span.replace(" ", "") and not re.search(r"\d{19}", span)
            and _MV_CHARS.fullmatch(_MV_LATEX.sub(" ", span)) is not None)


class _DropTimeoutWarning(logging.Filter):
    # with timeouts off math_verify warns "you must provide the logic for timeout interruption yourself": the
    # whitelist above is that logic, so the warning is noise in every run's log
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _quiet_math_verify() -> None:
    """``_DropTimeoutWarning`` on math_verify's two loggers, once per process."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutWarning())


def _math_verify_equal(span: str, gold: str) -> bool:
    """Whether math_verify finds ``span`` (e.g. "\\frac{36}{2}", "3*6") equal to ``gold``; False if not safe.

    math_verify's timeouts use ``signal.alarm``, which raises ValueError outside the main thread (the reward may
    run in a worker thread). ``parsing_timeout=None`` / ``timeout_seconds=None`` turn that machinery off — it
    becomes a plain call in any thread — and ``_math_verify_safe`` keeps out the inputs that would need it.
    """
    if not _math_verify_safe(span):
        return False
    from math_verify import parse, verify  # imports SymPy (~0.5 s): only once a span needs it

    _quiet_math_verify()
    try:
        target = parse(span, parsing_timeout=None)
        return bool(target) and bool(verify(parse(gold, parsing_timeout=None), target, timeout_seconds=None))
    except Exception:  # a parser failure on model text is a wrong answer, not a crashed step
        return False


# What only code or a path holds, so an answer line (or a number) showing it is not an answer:
# - on the line: a double quote or backtick; a single quote that is not an apostrophe ("Janet's", "James'" are
#   prose: a quote after a letter, followed by a letter, a space or the end); an underscore; a call "name(" (not
#   LaTeX's "\left(")
# - right before the number: a letter ("x18", "a$5"), or "/" ("/tmp/18"), or a "-" / "." / "$" glued to a letter or "/"
#   ("pytest-0", "v.2"); around it, in its run of non-space characters, two "/" and a letter ("18/tmp/x")
_CODE_ON_LINE = re.compile(r"[\"`_]|(?<![A-Za-z])'|'(?=[^A-Za-z\s])|(?<![\\\w])[A-Za-z][\w.]*\(")
_GLUED_BEFORE = re.compile(r"(?:[A-Za-z/]|[A-Za-z/][-.$])\Z")
_NON_SPACE = re.compile(r"\S*")
_LETTER = re.compile(r"[A-Za-z]")


def _glued(text: str, number: re.Match) -> bool:
    """Whether ``number`` (a ``_NUMBER`` match in ``text``) is part of an identifier or a path, not a number."""
    start, end = number.span()
    if _GLUED_BEFORE.search(text[max(0, start - 2):start]):
        return True
    token_start = max(text.rfind(" ", 0, start), text.rfind("\t", 0, start), text.rfind("\n", 0, start)) + 1
    token = text[token_start:_NON_SPACE.match(text, end).end()]
    return token.count("/") >= 2 and _LETTER.search(token) is not None


@dataclasses.dataclass(frozen=True)
class Gsm8kAnswer:
    """What ``gsm8k_correct`` reads as a completion's final answer."""

    text: str  # as written: "$1,234", "18.00", "36/2", "\\frac{36}{2}"
    value: Fraction | None  # its exact value; None for an expression, which is left to math_verify


def read_gsm8k_answer(completion: str) -> Gsm8kAnswer | None:
    """The final answer of ``completion`` as ``gsm8k_correct`` reads it; None when it holds none.

    The answer line is the first non-empty line after the last ``####``; the answer is the first number of its
    part after the last "=" ("#### 3*6 = 18" -> 18, "#### $18.00" -> 18, "#### 18 dollars" -> 18), or that whole
    part when it is an expression ("36/2", "\\frac{36}{2}"). With no ``####`` it is the *last* number anywhere in
    the completion (a model that has not learned the format yet still gets credit for the right result, which is
    what gets it started).

    Code and paths are not answers: an answer line holding what only code holds (a quote other than an apostrophe,
    a backtick, an underscore, a call ``name(``), or whose first number is glued into an identifier or a path
    ("x18", "/tmp/18", "pytest-0", "18/a/b"), has no answer. Without ``####``, such glued numbers are skipped when
    looking for the last one. A number of more than 40 digits is no answer either.
    """
    span = final_answer_span(completion)
    if span is None:
        for number in reversed(list(_NUMBER.finditer(completion))):
            if not _glued(completion, number):
                value = _value(number)
                return None if value is None else Gsm8kAnswer(number.group(0).strip(), value)
        return None
    line = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    if _CODE_ON_LINE.search(line):
        return None
    first = _NUMBER.search(span)
    first_digit = re.search(r"\d", span)
    if first_digit is not None and (first is None or first_digit.start() >= first.end() or _glued(span, first)):
        return None  # the first digit is not a number's (_NUMBER refuses "x18"), or its number is glued
    if first is None or _FRACTION.search(span[: first.start()]) or _OPERATOR_NEXT.match(span, first.end()):
        return Gsm8kAnswer(span, None) if span else None
    value = _value(first)
    return None if value is None else Gsm8kAnswer(first.group(0).strip(), value)


def gsm8k_correct(completion: str, gold: str) -> bool:
    """Whether ``completion``'s final answer (``read_gsm8k_answer``) equals ``gold`` (a number, as GSM8K's gold
    answers all are). Numbers compare exactly ("18.00" == "18", "$1,234" == "1234"); an answer that is an
    expression ("36/2", "\\frac{36}{2}") is left to math_verify. Code and paths earn 0 even when they hold the gold
    number. Model text is only ever read with regular expressions, never run.
    """
    gold_value = _as_number(gold)
    if gold_value is None:
        raise ValueError(f"gsm8k_answer needs a numeric gold answer, got {gold!r}")
    answer = read_gsm8k_answer(completion)
    if answer is None:
        return False
    if answer.value is None:
        return _math_verify_equal(answer.text, gold)
    return answer.value == gold_value


# ----------------------------------------------------------------------------------------------------------
# the rewards


def _gsm8k_answer_text(completion: str) -> str | None:
    answer = read_gsm8k_answer(completion)
    return None if answer is None else answer.text


@register("gsm8k_answer", answer=_gsm8k_answer_text)
def gsm8k_answer(prompts: Sequence[PromptRecord], completions: Sequence[str], **kw) -> list[float]:
    # range: [0, 1] — 1 when the final answer (after "####", else the last number) equals the gold answer
    return [float(gsm8k_correct(c, p.answer)) for p, c in zip(prompts, completions, strict=True)]


_FORMAT = re.compile(r"####[ \t]*-?[ \t]*\$?[ \t]*\d")


def _format_text(completion: str) -> str | None:
    """The line that earns the format reward, from its ``####`` on."""
    found = _FORMAT.search(completion)
    return None if found is None else completion[found.start():].split("\n", 1)[0].strip()


@register("gsm8k_format", answer=_format_text)
def gsm8k_format(prompts: Sequence[PromptRecord], completions: Sequence[str], **kw) -> list[float]:
    # range: [0, 1] — 1 when a line holds "#### <number>", right or wrong
    return [float(_FORMAT.search(c) is not None) for c in completions]


_INTEGER = re.compile(r"-?\d+")


def _first_integer(completion: str) -> str | None:
    found = _INTEGER.search(completion)
    return None if found is None else found.group()


@register("arithmetic", answer=_first_integer)
def arithmetic(prompts: Sequence[PromptRecord], completions: Sequence[str], **kw) -> list[float]:
    # range: [0, 1] — 1 when the first integer of the completion equals the answer ("85", "-36")
    out = []
    for p, c in zip(prompts, completions, strict=True):
        answer = _first_integer(c)
        out.append(float(answer is not None and int(answer) == int(p.answer)))
    return out


@register("pattern", answer=lambda completion: completion[: synthetic.PATTERN_WINDOW])
def pattern(prompts: Sequence[PromptRecord], completions: Sequence[str], **kw) -> list[float]:
    # range: [0, 1] — the fraction of the first 8 completion chars that are letters of the prompt
    return [synthetic.pattern_score(p.answer, c) for p, c in zip(prompts, completions, strict=True)]
