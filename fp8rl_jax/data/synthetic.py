"""Synthetic tasks for runs with no model download: ``arithmetic`` and ``pattern`` (their character tokenizer is
``fp8rl_jax.model.tokenizer.char_tokenizer``).

Problems come from ``numpy.random.default_rng([seed, split])``, one after another, forever: the same seed and
split give the same problems; train and test are different streams.

``arithmetic``: "37+48=" -> "85", operands below ``10**digits``, ``+`` or ``-`` (answers may be negative).

``arithmetic_qa``: the same sums asked in words for a chat model, "What is 37 + 48?" -> "85", judged like GSM8K
(``gsm8k_answer``: the number after "####", else the last number). The fidelity study's task
(``configs/smollm2_arith.py``): with ``digits`` = 1 and the GSM8K system prompt, SmolLM2-135M-Instruct answers
about 28% of 256 test problems greedily before training (64 new tokens; the study's step 0, benchmarks/RESULTS.md,
"Accuracy study"), with room to learn the format and to stop.

``pattern`` (the CPU smoke task, ``configs/tiny.py``): the prompt is ``PATTERN_LETTERS`` = 4 distinct letters
drawn from the pool ``PATTERN_POOL`` = "abcdefgh", then ':' — e.g. "bfca:". A completion char *scores* when it
is one of the prompt's letters, and the reward is the fraction of scoring chars among the first
``PATTERN_WINDOW`` = 8 completion chars (a completion that stops early has fewer chances, so stopping is
never rewarded). Perfect: "bfcabfca" -> 1.0.

Why a 2-layer d=64 model learns it from reward alone in ~30 GRPO steps (8 prompts x 8 samples, lr 3e-3):
- The reward is dense: it counts chars, so the 8 samples of a group almost always score differently and GRPO's
  group-relative advantage is non-zero from step one. A uniform policy over the 50-char vocabulary scores
  ~4/50 per char: measured 0.077 (EOS, 1 in 50, ends some completions early; tests/data/test_synthetic.py).
- It is a ladder with no cliff. A *unigram* shift — raise the logits of "abcdefgh" in every context, one fixed
  direction of the output layer that every rewarded sample pushes the same way — already lifts the score to
  4/8 = 0.5. A *copy* shift (attend from the completion to the prompt's letters) takes it to 1.0. Each rung is
  a smooth move of probability mass, not a discrete discovery the policy must stumble on.
- Caveat: the model's vocabulary (512 in the ``tiny`` preset) is larger than the tokenizer's (50); ids past 50
  decode to nothing, so a sampler that does not mask them starts near 0.011 instead (still learnable, slower).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from fp8rl_jax.data.gsm8k import Problem

TASKS = ("arithmetic", "arithmetic_qa", "pattern")
SPLITS = ("train", "test")
PATTERN_POOL = "abcdefgh"
PATTERN_LETTERS = 4
PATTERN_WINDOW = 8


def _arithmetic_draw(rng: np.random.Generator, digits: int) -> tuple[int, str, int, str]:
    """(a, "+" or "-", b, the answer) with operands below ``10**digits``."""
    a, b = (int(x) for x in rng.integers(0, 10**digits, size=2))
    if rng.integers(2):
        return a, "+", b, str(a + b)
    return a, "-", b, str(a - b)


def arithmetic_problem(rng: np.random.Generator, digits: int = 2) -> tuple[str, str]:
    """(question, answer), e.g. ("37+48=", "85")."""
    a, op, b, answer = _arithmetic_draw(rng, digits)
    return f"{a}{op}{b}=", answer


def arithmetic_qa_problem(rng: np.random.Generator, digits: int = 2) -> tuple[str, str]:
    """(question, answer), e.g. ("What is 37 + 48?", "85"): ``arithmetic_problem``'s draw, in words."""
    a, op, b, answer = _arithmetic_draw(rng, digits)
    return f"What is {a} {op} {b}?", answer


def pattern_problem(rng: np.random.Generator, pool: str = PATTERN_POOL, letters: int = PATTERN_LETTERS
                    ) -> tuple[str, str]:
    """(question, answer): "bfca:" and the allowed letters "bfca" (what ``pattern_score`` checks against)."""
    picked = "".join(pool[i] for i in rng.permutation(len(pool))[:letters])
    return f"{picked}:", picked


def pattern_score(allowed: str, completion: str, window: int = PATTERN_WINDOW) -> float:
    """The pattern task's dense reward: the fraction of the first ``window`` chars that are in ``allowed``."""
    # range: [0, 1]
    allowed_set = set(allowed)
    return sum(c in allowed_set for c in completion[:window]) / window


def iter_problems(task: str, seed: int, split: str = "train", **kw) -> Iterator[Problem]:
    """Endless, deterministic stream of ``task`` problems; ``kw`` goes to the task's generator (``digits`` for the
    arithmetic tasks)."""
    if task not in TASKS:
        raise ValueError(f"synthetic task {task!r} is invalid; allowed: {' | '.join(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is invalid; allowed: {' | '.join(SPLITS)}")
    make = {"arithmetic": arithmetic_problem, "arithmetic_qa": arithmetic_qa_problem, "pattern": pattern_problem}[task]
    rng = np.random.default_rng([seed, SPLITS.index(split)])  # split in the seed: test never replays train
    for i in itertools.count():
        question, answer = make(rng, **kw)
        yield Problem(f"{task}/{split}/{seed}/{i}", question, answer)


def synthetic_problems(task: str, seed: int, count: int, split: str = "train", **kw) -> list[Problem]:
    """The first ``count`` problems of ``iter_problems(task, seed, split)``."""
    return list(itertools.islice(iter_problems(task, seed, split, **kw), count))
