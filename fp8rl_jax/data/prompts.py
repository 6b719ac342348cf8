"""Problems -> prompt token ids, and the checkpointable grain stream of prompts the trainer draws from.

Prompts are rendered and tokenized once, up front (7.5k GSM8K chat prompts take ~2 s on one CPU core), so the length
filter is exact and its count known before step one: a prompt longer than ``data.max_prompt_tokens`` is dropped,
never truncated (a cut question has a different answer), and ``PromptSet.dropped`` says how many went.

The stream is ``grain.MapDataset.source(records).shuffle(seed).repeat(None)`` for training — a fresh permutation
every epoch, forever — and the records in file order, once, for evaluation. Batching is the trainer's:
it takes ``rollout.prompts_per_step`` records at a time. The iterator's position is a small JSON-safe dict
(``get_state`` / ``set_state``), saved with the checkpoint so a resumed run sees the same prompts.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
from collections.abc import Sequence

import grain

from fp8rl_jax.data import gsm8k, synthetic

DATASETS = ("gsm8k", *synthetic.TASKS)
SPLITS = ("train", "test")
PROMPT_FORMATS = ("chat", "plain")
GSM8K_PLAIN_TEMPLATE = "Question: {question}\nAnswer:"
SYNTHETIC_SIZES = {"train": 8192, "test": 512}  # problems per split; training cycles through them in new orders
# records live in memory: reader threads would only fight over the GIL
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The run's settings the prompts come from (``fp8rl_jax.plan.data_spec`` reads them from ``config.data`` and
    ``config.seed``)."""

    dataset: str  # data.dataset: gsm8k | a synthetic task
    max_prompt_tokens: int  # data.max_prompt_tokens: longer prompts are dropped
    prompt_format: str  # data.prompt_format: chat | plain
    system_prompt: str  # data.system_prompt
    train_path: str  # data.train_path (gsm8k; empty: the default file)
    eval_path: str  # data.eval_path
    digits: int  # data.digits (arithmetic tasks)
    seed: int  # config.seed: the synthetic problems' and the default shuffle's
    shuffle: bool  # data.shuffle (train)
    num_eval: int  # data.num_eval (test: the first this many; 0 = all)


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    id: str
    prompt_ids: tuple[int, ...]
    prompt_text: str  # the rendered prompt (chat template applied), before tokenization
    answer: str  # the gold answer the reward functions check against
    task: str  # the dataset name: gsm8k | arithmetic | pattern
    question: str = ""  # the problem as the dataset states it (before the prompt format)


@dataclasses.dataclass(frozen=True)
class PromptSet:
    records: tuple[PromptRecord, ...]
    dropped: int  # problems whose prompt was longer than data.max_prompt_tokens
    total: int  # problems read, kept or dropped


def build_prompt(tokenizer, question: str, *, prompt_format: str, system_prompt: str = "",
                 plain_template: str = "{question}") -> tuple[str, tuple[int, ...]]:
    """(prompt text, prompt ids) for one question.

    ``chat``: the tokenizer's own chat template over an optional system message and the user question, ending
    in the assistant's generation prompt (the template writes any BOS). ``plain``: ``plain_template`` with the
    question put in (after the system prompt and a blank line, if any); BOS first if the tokenizer adds one.
    """
    if prompt_format == "chat":
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return text, tuple(tokenizer.encode(text, add_bos=False))
    if prompt_format == "plain":
        # str.replace, not str.format: a question may hold braces
        text = plain_template.replace("{question}", question)
        if system_prompt:
            text = f"{system_prompt}\n\n{text}"
        return text, tuple(tokenizer.encode(text))
    raise ValueError(f"prompt_format {prompt_format!r} is invalid; allowed: {' | '.join(PROMPT_FORMATS)}")


def load_problems(spec: DataSpec, split: str) -> tuple[list[gsm8k.Problem], str]:
    """(problems, plain template) of ``spec.dataset`` (``data.dataset``) for ``split`` (train | test)."""
    name = spec.dataset
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is invalid; allowed: {' | '.join(SPLITS)}")
    if name == "gsm8k":
        path = spec.train_path if split == "train" else spec.eval_path
        return gsm8k.load_gsm8k(path or gsm8k.default_gsm8k_path(split)), GSM8K_PLAIN_TEMPLATE
    if name in synthetic.TASKS:
        kw = {"digits": spec.digits} if name.startswith("arithmetic") else {}
        return synthetic.synthetic_problems(name, spec.seed, SYNTHETIC_SIZES[split], split, **kw), "{question}"
    raise ValueError(f"config.data.dataset={name!r} is invalid; allowed: {' | '.join(DATASETS)}")


def load_prompts(spec: DataSpec, tokenizer, split: str = "train", limit: int | None = None) -> PromptSet:
    """Every prompt of ``split`` (of its first ``limit`` problems), tokenized, those over ``data.max_prompt_tokens``
    dropped and counted."""
    problems, template = load_problems(spec, split)
    problems = problems[:limit]
    if not problems:  # nothing to filter: not a max_prompt_tokens problem
        raise ValueError(f"config.data.dataset={spec.dataset!r}: the {split} split holds no problems")
    max_tokens = spec.max_prompt_tokens
    records = []
    for p in problems:
        text, ids = build_prompt(tokenizer, p.question, prompt_format=spec.prompt_format,
                                 system_prompt=spec.system_prompt, plain_template=template)
        if len(ids) <= max_tokens:
            records.append(PromptRecord(p.id, ids, text, p.answer, spec.dataset, p.question))
    if not records:
        raise ValueError(f"config.data.max_prompt_tokens={max_tokens} drops all {len(problems)} {split} prompts of "
                         f"{spec.dataset}; raise it")
    return PromptSet(tuple(records), len(problems) - len(records), len(problems))


def prompt_dataset(spec: DataSpec, tokenizer, split: str = "train", seed: int | None = None,
                   prompts: PromptSet | None = None) -> grain.MapDataset:
    """Train: shuffled per epoch (``seed``, default ``spec.seed``) and endless. Test: file order, one pass,
    the first ``data.num_eval`` records if that is set."""
    prompts = prompts if prompts is not None else load_prompts(spec, tokenizer, split)
    ds = grain.MapDataset.source(prompts.records)
    if split == "train":
        if spec.shuffle:
            # grain reseeds each epoch (seed + epoch), so every pass is a new permutation
            ds = ds.shuffle(seed=spec.seed if seed is None else seed)
        return ds.repeat(None)
    if spec.num_eval > 0:
        ds = ds.slice(slice(0, spec.num_eval))
    return ds


class PromptIterator:
    """Iterates ``PromptRecord`` s; ``get_state`` / ``set_state`` save and restore the position as JSON-safe
    dicts (grain's ``DatasetIterator`` state, with any bytes base64-encoded)."""

    def __init__(self, dataset: grain.MapDataset, *, dropped: int = 0, total: int | None = None):
        self._it = iter(dataset.to_iter_dataset(_READ_OPTIONS))
        self.dropped, self.total = dropped, total

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> PromptRecord:
        return next(self._it)

    def take(self, n: int) -> list[PromptRecord]:
        """The next ``n`` records (fewer at the end of a one-pass eval stream)."""
        return list(itertools.islice(self._it, n))

    def get_state(self) -> dict:
        return to_json_safe(self._it.get_state())

    def set_state(self, state: dict) -> None:
        self._it.set_state(from_json_safe(state))


def prompt_iterator(spec: DataSpec, tokenizer, split: str = "train", seed: int | None = None) -> PromptIterator:
    """The trainer's entry point: load, tokenize, filter, and iterate ``split``."""
    prompts = load_prompts(spec, tokenizer, split)
    ds = prompt_dataset(spec, tokenizer, split, seed, prompts)
    return PromptIterator(ds, dropped=prompts.dropped, total=prompts.total)


# grain 0.2.18's MapDataset iterator state is {"next_index": int}; other grain iterators (and later versions)
# may hold bytes, which JSON cannot carry, so encode them rather than trust the shape.
_BYTES_KEY = "__bytes_b64__"


def to_json_safe(state):
    """``state`` with bytes replaced by ``{"__bytes_b64__": "..."}`` and tuples by lists."""
    if isinstance(state, bytes):
        return {_BYTES_KEY: base64.b64encode(state).decode("ascii")}
    if isinstance(state, dict):
        return {str(k): to_json_safe(v) for k, v in state.items()}
    if isinstance(state, Sequence) and not isinstance(state, str):
        return [to_json_safe(v) for v in state]
    return state


def from_json_safe(state):
    """The inverse of ``to_json_safe`` (lists stay lists)."""
    if isinstance(state, dict):
        if set(state) == {_BYTES_KEY}:
            return base64.b64decode(state[_BYTES_KEY])
        return {k: from_json_safe(v) for k, v in state.items()}
    if isinstance(state, list):
        return [from_json_safe(v) for v in state]
    return state
