"""Evaluation of a policy on a test split: greedy pass@1, and mean@k over k sampled completions per problem.

``evaluate_policy`` is the one code path: ``Trainer.evaluate`` calls it with the trainer's live policy, and
``python -m fp8rl_jax.eval`` (``fp8rl_jax.eval.cli``, which documents the command line) with a checkpoint's. It
samples through the trainer's own ``Sampler`` (rollout precision, FP8 rollout weights, KV cache, stop tokens) and
judges each completion with the config's first reward function (``reward.fns[0]``, ``gsm8k_answer`` for GSM8K),
which reads model text with regular expressions and never runs it.

A completion is *correct* when that reward gives it 1 (for ``gsm8k_answer``: its final answer equals the gold one;
for the dense ``pattern`` reward: a perfect score). Over N problems:
- ``pass@1``: the fraction whose greedy completion is correct;
- ``mean@k`` (k > 1): the mean over problems of the fraction of their k sampled completions that are correct;
- ``pass@k`` (k > 1): the fraction with at least one correct sample among the k.
The mean reward of the greedy and of the sampled completions is reported beside them (for a 0/1 reward it is the
same number).

A results folder holds ``results.json`` (the run and its metrics), ``results.md`` (the same as a table) and
``completions.jsonl`` (one line per problem: ``index``, ``id``, ``question``, ``gold``, the greedy ``completion``,
its ``answer`` as the reward reads it, ``correct``, ``reward``, ``finish_reason``, ``tokens``; with k > 1 also
``samples``, a list of k such dicts, and ``samples_correct``). ``fp8rl_jax.eval.compare`` compares two of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from fp8rl_jax.rl.rewards import answer_text, combined_rewards
from fp8rl_jax.rollout.sampling import SamplingParams

RESULTS_JSON, RESULTS_MD, COMPLETIONS = "results.json", "results.md", "completions.jsonl"
# the keys of a completions.jsonl row (and of each of its samples: the part from "completion" on)
ROW_KEYS = ("index", "id", "question", "gold", "completion", "answer", "correct", "reward", "finish_reason", "tokens")
SAMPLE_KEYS = ROW_KEYS[4:]
# the metrics evaluate_policy returns (results.json holds them beside the run's description)
METRIC_KEYS = ("num_problems", "reward_fn", "max_new_tokens", "pass@1", "greedy_reward_mean", "greedy_stop_fraction",
               "greedy_tokens_mean", "k", "temperature", "mean@k", "pass@k", "sample_reward_mean",
               "greedy_tokens_per_s", "sample_tokens_per_s")
# what results.json must say of its run for a comparison to describe it (compare.json's "reference" and "other";
# "checkpoint": null is the initial weights, so a results.json without the key cannot say which policy it was)
DESCRIBED_KEYS = ("config", "precision_mode", "precision_backend", "kv_cache_dtype", "checkpoint", "step", "k")


@dataclasses.dataclass
class EvalRun:
    rows: list[dict]  # one per problem, as completions.jsonl holds them
    metrics: dict  # METRIC_KEYS


def _judged(reward: str, records: Sequence, texts: list[str], batch) -> list[dict]:
    """One dict per completion: text, the answer ``reward`` reads, correct (reward 1), reward, how it ended."""
    _, per_fn = combined_rewards([reward], None, list(records), texts)
    return [{"completion": text, "answer": answer_text(reward, text), "correct": bool(score == 1.0),
             "reward": float(score), "finish_reason": batch.finish_reasons[i], "tokens": int(batch.lengths[i])}
            for i, (text, score) in enumerate(zip(texts, per_fn[reward], strict=True))]


def evaluate_policy(sampler, state: dict, records: Sequence, *, reward: str, max_new_tokens: int,
                    temperature: float, k: int = 1, key: jax.Array | None = None) -> EvalRun:
    """Greedy completions of ``records`` (``PromptRecord`` s) from the policy ``state`` (``params``,
    ``fp8_state``, ``kv_scales``) through ``sampler`` (``fp8rl_jax.rollout.sampler.Sampler``), and with ``k`` > 1
    also ``k`` samples each at ``temperature`` (with the config's ``rollout.top_k`` / ``top_p``; sample s of
    problem p draws with ``fold_in(key, p * k + s)``), judged by the reward fn ``reward``."""
    if k < 1:
        raise ValueError(f"k={k}: the samples per problem must be >= 1")
    if not records:
        raise ValueError("no problems to evaluate")
    key = jax.random.PRNGKey(0) if key is None else key
    prompts = [r.prompt_ids for r in records]
    rollout = sampler.spec  # the run's rollout.temperature, top_k, top_p
    # greedy decoding does not depend on the temperature: the config's keeps one engine for any --temperature
    greedy = sampler.rollout(sampler.engine(SamplingParams(temperature=rollout.temperature, greedy=True),
                                            max_new_tokens), state, prompts, 1, key)
    rows = []
    for i, (record, judged) in enumerate(zip(records, _judged(reward, records, sampler.texts(greedy), greedy),
                                             strict=True)):
        rows.append({"index": i, "id": record.id, "question": record.question, "gold": record.answer, **judged})
    metrics = {
        "num_problems": len(rows),
        "reward_fn": reward,
        "max_new_tokens": max_new_tokens,
        "pass@1": float(np.mean([r["correct"] for r in rows])),
        "greedy_reward_mean": float(np.mean([r["reward"] for r in rows])),
        "greedy_stop_fraction": float(np.mean([r["finish_reason"] == "stop" for r in rows])),
        "greedy_tokens_mean": float(np.mean([r["tokens"] for r in rows])),
        "k": k, "temperature": None, "mean@k": None, "pass@k": None, "sample_reward_mean": None,
        "greedy_tokens_per_s": greedy.stats["tokens_per_second"], "sample_tokens_per_s": None,
    }
    if k > 1:
        sampling = SamplingParams(temperature=temperature, top_k=rollout.top_k, top_p=rollout.top_p)
        batch = sampler.rollout(sampler.engine(sampling, max_new_tokens), state, prompts, k, key)
        samples = _judged(reward, [r for r in records for _ in range(k)], sampler.texts(batch), batch)
        for i, row in enumerate(rows):
            row["samples"] = samples[i * k : (i + 1) * k]  # rows are sample-major within each problem
            row["samples_correct"] = float(np.mean([s["correct"] for s in row["samples"]]))
        metrics.update({
            "temperature": temperature,
            "mean@k": float(np.mean([r["samples_correct"] for r in rows])),
            "pass@k": float(np.mean([r["samples_correct"] > 0 for r in rows])),
            "sample_reward_mean": float(np.mean([s["reward"] for s in samples])),
            "sample_tokens_per_s": batch.stats["tokens_per_second"],
        })
    return EvalRun(rows, metrics)


# ----------------------------------------------------------------------------------------------------------
# results folders


class ResultsError(ValueError):
    """A folder that is not a complete results folder, or two that cannot be compared."""


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def format_percent(fraction: float | None, count: int | None = None) -> str:
    if fraction is None:
        return "-"
    of = f" ({round(fraction * count)} / {count})" if count is not None else ""
    return f"{100 * fraction:.1f}%{of}"


def results_markdown(results: dict) -> str:
    """``results.json`` as a Markdown table."""
    r, n = results, results["num_problems"]
    policy = (f"checkpoint `{r['checkpoint']}`, step {r['step']}" if r.get("checkpoint")
              else "the model `config.model` loads (initial weights)")
    lines = [
        f"# Evaluation: `{r['config']}`, pass@1 {format_percent(r['pass@1'])}",
        "",
        "| | |",
        "|---|---|",
        f"| dataset | {r['dataset']}, {r['split']} split: {n} problems"
        + (f" ({r['prompts_dropped']} more dropped: prompt over data.max_prompt_tokens)" if r["prompts_dropped"]
           else "") + " |",
        f"| precision | {r['precision_mode']}, FP8 backend {r['precision_backend']}, KV cache {r['kv_cache_dtype']} |",
        f"| scales | {r['scales']} |",
        f"| policy | {policy} |",
        f"| reward | {r['reward_fn']} (correct: reward 1) |",
        f"| greedy, {r['max_new_tokens']} new tokens at most | pass@1 **{format_percent(r['pass@1'], n)}**, "
        f"mean reward {r['greedy_reward_mean']:.3f}, {format_percent(r['greedy_stop_fraction'])} stopped, "
        f"{r['greedy_tokens_mean']:.1f} tokens on average |",
    ]
    if r["k"] > 1:
        lines.append(f"| {r['k']} samples, T={r['temperature']:g} | mean@{r['k']} **{format_percent(r['mean@k'])}**, "
                     f"pass@{r['k']} {format_percent(r['pass@k'], n)}, mean reward {r['sample_reward_mean']:.3f} |")
    lines.append(f"| commit | {r['commit'] or '-'}{' (with uncommitted changes)' if r.get('commit_dirty') else ''} |")
    lines += ["", f"Command: `{r['command']}`", ""]
    return "\n".join(lines)


def write_results(out: str | os.PathLike, results: dict, rows: Sequence[dict]) -> Path:
    """``results.json``, ``results.md`` and ``completions.jsonl`` into the folder ``out`` (made if missing);
    a comparison written there before (``compare.*``) is removed: it was of the results replaced now."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("compare.*"):
        stale.unlink()
    write_jsonl(out / COMPLETIONS, rows)
    write_text_atomic(out / RESULTS_JSON, json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    write_text_atomic(out / RESULTS_MD, results_markdown(results))
    return out


def read_results(folder: str | os.PathLike) -> tuple[dict, list[dict]]:
    """``(results.json, completions.jsonl rows)`` of a results folder; ``ResultsError`` naming what is wrong (a
    ``results.json`` that is not an object holding ``DESCRIBED_KEYS``, a row without its keys)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ResultsError(f"{folder}: no such results folder")
    for name in (RESULTS_JSON, COMPLETIONS):
        if not (folder / name).is_file():
            raise ResultsError(f"{folder} is not an eval results folder: it has no {name} "
                               "(python -m fp8rl_jax.eval --out=FOLDER writes one)")
    try:
        results = json.loads((folder / RESULTS_JSON).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultsError(f"{folder / RESULTS_JSON}: not JSON ({e})") from None
    if not isinstance(results, dict):
        raise ResultsError(f"{folder / RESULTS_JSON}: a JSON {type(results).__name__}, not the object python -m "
                           "fp8rl_jax.eval writes")
    missing = [k for k in DESCRIBED_KEYS if k not in results]
    if missing:
        raise ResultsError(f"{folder / RESULTS_JSON} lacks {', '.join(missing)} (what it says of the evaluated run; "
                           "python -m fp8rl_jax.eval writes them)")
    rows = []
    with open(folder / COMPLETIONS, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ResultsError(f"{folder / COMPLETIONS}, line {line_no}: invalid JSON ({e.msg})") from None
            missing = [k for k in ("id", "gold", "completion", "correct") if not isinstance(row, dict) or k not in row]
            if missing:
                raise ResultsError(f"{folder / COMPLETIONS}, line {line_no}: missing {', '.join(missing)}")
            rows.append(row)
    if not rows:
        raise ResultsError(f"{folder / COMPLETIONS} holds no problems")
    return results, rows
