"""``python -m fp8rl_jax.eval``: end to end on the tiny config through its ``main(argv)`` (the results folder's keys,
determinism, a checkpoint evaluated as the trainer samples it), the GSM8K prompts and grading, the metrics on
hand-written completions, the comparison of two results folders on a hand-made pair, and the errors for bad input."""

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from fp8rl_jax.config import load_config_file
from fp8rl_jax.data import synthetic
from fp8rl_jax.data.prompts import PromptRecord
from fp8rl_jax.eval import METRIC_KEYS, ROW_KEYS, evaluate_policy
from fp8rl_jax.eval.cli import RUN_KEYS, main, resolve_checkpoint

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.py")
VARYING = ("time", "seconds", "greedy_tokens_per_s", "sample_tokens_per_s", "command")  # differ run to run
CHECKPOINT_FORMS = "expected a run's workdir, its checkpoints/ folder, or one step's folder checkpoints/<step>"


def _read(out: Path) -> tuple[dict, list[dict]]:
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return json.loads((out / "results.json").read_text()), rows


def _eval(tmp_path, *args, config=TINY, out: Path) -> tuple[dict, list[dict]]:
    """``main`` on ``config`` with a workdir under ``tmp_path``; ``out=None``: the default results folder."""
    argv = ["fp8rl_jax.eval", f"--config={config}", f"--config.workdir={tmp_path / 'run'}", *args]
    assert main(argv if out is None else [*argv, f"--out={out}"]) == 0
    return _read(out) if out is not None else (None, None)


def test_cli_end_to_end(tmp_path, capsys):
    """FP8 E2E from the initial weights (scales calibrated as the trainer does): the results folder's keys, each
    completion judged by the config's reward, the metrics from the rows; compared with itself: full agreement."""
    a = tmp_path / "a"
    results, rows = _eval(tmp_path, "--num=3", "--k=2", out=a)
    assert tuple(results) == RUN_KEYS + METRIC_KEYS
    assert {k: results[k] for k in ("config", "dataset", "split", "precision_mode", "precision_backend",
                                    "kv_cache_dtype", "checkpoint", "step", "prompts_dropped", "num_problems",
                                    "reward_fn", "max_new_tokens", "k", "temperature", "seed")} == {
        "config": TINY, "dataset": "pattern", "split": "test", "precision_mode": "fp8_e2e", "precision_backend": "xla",
        "kv_cache_dtype": "bfloat16", "checkpoint": None, "step": None, "prompts_dropped": 0, "num_problems": 3,
        "reward_fn": "pattern", "max_new_tokens": 12, "k": 2, "temperature": 1.0, "seed": 0}
    assert results["scales"] == "FP8 scales calibrated on the first 8 training prompts (no checkpoint)"
    assert results["command"].startswith(f"python -m fp8rl_jax.eval --config={TINY} ")
    # block scaling reads no delayed scale: nothing to calibrate (a BF16 KV cache here)
    block, _ = _eval(tmp_path, "--num=1", "--config.precision.scaling=block", "--config.precision.fp8_format=e4m3",
                     out=tmp_path / "block")
    assert block["scales"] == "none: block scaling takes each scale from its operand"

    # the first 3 problems of the test split, each completion judged by the pattern reward (correct: a perfect score)
    problems = synthetic.synthetic_problems("pattern", 0, 3, "test")
    assert [(r["index"], r["id"], r["question"], r["gold"]) for r in rows] == [
        (i, p.id, p.question, p.answer) for i, p in enumerate(problems)]
    assert results["prompt_example"] == problems[0].question  # plain format: the question alone
    for row in rows:
        assert tuple(row) == (*ROW_KEYS, "samples", "samples_correct") and len(row["samples"]) == 2
        for c in [row, *row["samples"]]:
            score = synthetic.pattern_score(row["gold"], c["completion"])
            assert (c["reward"], c["correct"], c["answer"]) == (score, score == 1.0, c["completion"][:8])
            assert 1 <= c["tokens"] <= 12 and c["finish_reason"] in ("stop", "length")
        assert row["samples_correct"] == sum(s["correct"] for s in row["samples"]) / 2
    assert results["pass@1"] == sum(r["correct"] for r in rows) / 3
    assert results["greedy_reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 3, abs=1e-15)
    assert results["mean@k"] == pytest.approx(sum(r["samples_correct"] for r in rows) / 3, abs=1e-15)
    assert results["pass@k"] == sum(r["samples_correct"] > 0 for r in rows) / 3
    assert results["sample_reward_mean"] == pytest.approx(
        sum(s["reward"] for r in rows for s in r["samples"]) / 6, abs=1e-15)
    markdown = (a / "results.md").read_text()
    assert "| dataset | pattern, test split: 3 problems |" in markdown
    assert f"| greedy, 12 new tokens at most | pass@1 **{100 * results['pass@1']:.1f}% (" in markdown
    assert "| 2 samples, T=1 | mean@2 **" in markdown
    assert markdown in capsys.readouterr().out  # and printed

    assert main(["fp8rl_jax.eval", "compare", str(a), str(a), f"--out={tmp_path / 'self'}"]) == 0
    report = json.loads((tmp_path / "self" / "compare.json").read_text())
    lengths = [len(r["completion"]) for r in rows]
    assert {k: v for k, v in report.items() if k not in ("reference", "other")} == {
        "problems": 3, "only_in_reference": 0, "only_in_other": 0, "same_verdict": 1.0, "identical": 1.0,
        "prefix_chars_mean": float(np.mean(lengths)), "prefix_fraction_mean": 1.0,
        "reference_pass@1": results["pass@1"], "other_pass@1": results["pass@1"],
        "both_correct": sum(r["correct"] for r in rows), "reference_only_correct": 0, "other_only_correct": 0,
        "both_wrong": sum(not r["correct"] for r in rows)}


def test_cli_on_a_checkpoint_is_deterministic_and_samples_as_the_trainer(tmp_path):
    """A trainer's checkpoint (FP8 E2E, calibrated scales) through --checkpoint: the greedy completions the trainer's
    own sampler gives, the numbers Trainer.evaluate reports (one code path), and the same again on a second run."""
    from fp8rl_jax.trainer import Trainer

    config = load_config_file(TINY)
    with config.unlocked():
        config.workdir = str(tmp_path / "run")
        config.logging.progress = config.logging.tensorboard = config.logging.plots = False
    trainer = Trainer(config)
    trainer.save()
    questions = [p.question for p in synthetic.synthetic_problems("pattern", 0, 4, "test")]
    want = [texts[0] for texts in trainer.sample(questions, greedy=True)]
    evaluated = trainer.evaluate(4)
    trainer.close()

    checkpoints = (tmp_path / "run" / "checkpoints").resolve()
    for form in (tmp_path / "run", checkpoints, checkpoints / "0"):
        assert resolve_checkpoint(str(form)) == (checkpoints, 0)
    first = tmp_path / "run" / "eval" / "step0_fp8_e2e"  # the default --out of a checkpoint's evaluation
    _eval(tmp_path, "--num=4", f"--checkpoint={tmp_path / 'run'}", out=None)
    results, rows = _read(first)
    assert [r["completion"] for r in rows] == want
    assert (results["checkpoint"], results["step"], results["scales"], results["checkpoint_precision_mode"]) == (
        str(checkpoints), 0, "from the checkpoint", "fp8_e2e")
    assert (results["k"], results["mean@k"], "samples" in rows[0]) == (1, None, False)
    assert evaluated == {"eval_accuracy": results["pass@1"], "eval_reward": results["greedy_reward_mean"],
                         "eval_problems": 4.0}

    # the same evaluation again, from the step's folder, compared with the first: identical completions
    second = tmp_path / "second"
    again, rows_again = _eval(tmp_path, "--num=4", f"--checkpoint={checkpoints / '0'}", f"--compare={first}",
                              out=second)
    assert rows_again == rows
    assert {k: v for k, v in again.items() if k not in VARYING} == {k: v for k, v in results.items()
                                                                      if k not in VARYING}
    report = json.loads((second / "compare.json").read_text())
    assert (report["problems"], report["same_verdict"], report["identical"], report["prefix_fraction_mean"]) == (
        4, 1.0, 1.0, 1.0)
    assert (report["reference"]["dir"], report["other"]["dir"]) == (str(first), str(second))


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """A tiny run's workdir with the checkpoints of steps 0 and 1 (the same weights: which step is read matters here,
    not what it holds)."""
    from fp8rl_jax.trainer import Trainer

    workdir = tmp_path_factory.mktemp("two_steps") / "run"
    config = load_config_file(TINY)
    with config.unlocked():
        config.workdir = str(workdir)
        config.logging.progress = config.logging.tensorboard = config.logging.plots = False
    trainer = Trainer(config)
    trainer.save()
    trainer.state = {**trainer.state, "step": trainer.state["step"] + 1}
    trainer.save()
    trainer.close()
    return workdir


def _rotate_away_step_1(monkeypatch, when: str) -> list:
    """``policy_io.restore_policy`` as a live trainer's checkpoint rotation meets it: step 1's folder is deleted after
    the evaluation chose it at start-up, ``before`` the restore reads it or ``during`` the read (which then fails)."""
    import fp8rl_jax.policy_io as policy_io

    real, calls = policy_io.restore_policy, []

    def rotating(config, directory, step=None):
        calls.append(step)
        if len(calls) == 1:
            shutil.rmtree(Path(directory) / "1")
            if when == "during":
                raise FileNotFoundError(f"{directory}/1: deleted while it was read")
        return real(config, directory, step)

    monkeypatch.setattr(policy_io, "restore_policy", rotating)
    return calls


@pytest.mark.parametrize("when", ["before", "during"])
def test_cli_on_a_live_run_takes_the_newest_step_it_can_restore(two_steps, tmp_path, monkeypatch, capsys, when):
    """A trainer saving every step keeps the last few: the step the evaluation found at start-up (the newest then)
    was deleted before it was read, and the evaluation failed (``no checkpoint of step 17 ...; steps there: [27, 28,
    29]``). With no step asked for, the newest step that can be restored is evaluated."""
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    calls = _rotate_away_step_1(monkeypatch, when)
    results, _ = _eval(tmp_path, "--num=2", f"--checkpoint={workdir}", out=tmp_path / "out")
    assert (results["checkpoint"], results["step"]) == (str((workdir / "checkpoints").resolve()), 0)
    assert len(calls) == {"before": 1, "during": 2}[when]


def test_cli_step_asked_for_that_is_gone_stays_an_error(two_steps, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    _rotate_away_step_1(monkeypatch, "before")
    checkpoints = (workdir / "checkpoints").resolve()
    assert main(["fp8rl_jax.eval", f"--config={TINY}", f"--config.workdir={workdir}", "--num=2",
                 f"--checkpoint={checkpoints / '1'}", f"--out={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err == f"error: no checkpoint of step 1 in {checkpoints}; steps there: [0]\n"


def test_cli_gsm8k_prompts_and_grading(tmp_path):
    """GSM8K as configs/smollm2_gsm8k.py sets it up (chat template, system prompt, gsm8k_answer), on a tiny random
    model with SmolLM2's tokenizer, in BF16: the test split's first problems, prompted and graded as in training."""
    from fp8rl_jax.data.gsm8k import default_gsm8k_path, load_gsm8k
    from fp8rl_jax.model import assets
    from fp8rl_jax.model.tokenizer import Tokenizer, gguf_tokenizer_cache
    from fp8rl_jax.rl.rewards import gsm8k_correct, read_gsm8k_answer

    gguf = assets.smollm2_gguf()
    tokenizer = Tokenizer.from_gguf(gguf)  # converted once, cached beside the GGUF file
    config = str(REPO / "configs" / "smollm2_gsm8k.py")
    results, rows = _eval(tmp_path, "--num=2", "--max_new_tokens=8", "--config.model.source=preset",
                          "--config.model.preset=tiny", f"--config.model.tokenizer={gguf_tokenizer_cache(gguf)}",
                          "--config.precision.mode=bf16", config=config, out=tmp_path / "gsm8k")
    problems = load_gsm8k(default_gsm8k_path("test"))[:2]
    assert [(r["id"], r["question"], r["gold"]) for r in rows] == [(p.id, p.question, p.answer) for p in problems]
    system = load_config_file(config).data.system_prompt
    assert results["prompt_example"] == tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": problems[0].question}])
    assert (results["reward_fn"], results["precision_mode"], results["scales"], results["max_new_tokens"]) == (
        "gsm8k_answer", "bf16", "none: BF16 rollout", 8)
    for row in rows:
        answer = read_gsm8k_answer(row["completion"])
        assert row["correct"] == gsm8k_correct(row["completion"], row["gold"])
        assert row["answer"] == (answer.text if answer else None)


class _ScriptedSampler:
    """Stands in for ``rollout.sampler.Sampler``: each ``rollout`` returns the next scripted completions."""

    def __init__(self, *scripts: list[str]):
        self.spec = types.SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0)
        self.scripts, self.calls = list(scripts), []

    def engine(self, sampling, max_new_tokens):
        return sampling

    def rollout(self, engine, state, prompts, n, key):
        texts = self.scripts.pop(0)
        assert len(texts) == len(prompts) * n
        self.calls.append((engine.greedy, n))
        return types.SimpleNamespace(texts=texts, finish_reasons=["stop"] * len(texts), lengths=[5] * len(texts),
                                     stats={"tokens_per_second": 1.0})

    def texts(self, batch):
        return batch.texts


def test_metrics_on_written_completions():
    """pass@1 from the greedy completions, mean@k and pass@k from the samples (rows sample-major per problem), the
    answers as gsm8k_answer reads them."""
    records = [PromptRecord(f"gsm8k/test/{i}", (1, 2), "", gold, "gsm8k", f"q{i}") for i, gold in
               enumerate(["72", "10", "5"])]
    sampler = _ScriptedSampler(
        ["so 48 + 24 = 72\n#### 72", "#### 11", "#### 5 apples"],
        ["#### 72", "72 apples", "the answer is 71",  # problem 0: 2 of 3 right
         "#### 10", "#### $10.00", "#### 10",  # problem 1: 3 of 3
         "#### 4", "#### x5", ""])  # problem 2: none ("x5" is an identifier, not 5)
    run = evaluate_policy(sampler, {}, records, reward="gsm8k_answer", max_new_tokens=16, temperature=0.7, k=3)
    assert sampler.calls == [(True, 1), (False, 3)]
    assert [(r["answer"], r["correct"]) for r in run.rows] == [("72", True), ("11", False), ("5", True)]
    assert [[(s["answer"], s["correct"]) for s in r["samples"]] for r in run.rows] == [
        [("72", True), ("72", True), ("71", False)], [("10", True), ("$10.00", True), ("10", True)],
        [("4", False), (None, False), (None, False)]]
    assert {k: run.metrics[k] for k in ("pass@1", "mean@k", "pass@k", "k", "temperature", "num_problems")} == {
        "pass@1": 2 / 3, "mean@k": (2 / 3 + 1 + 0) / 3, "pass@k": 2 / 3, "k": 3, "temperature": 0.7,
        "num_problems": 3}
    assert tuple(run.metrics) == METRIC_KEYS


# ----------------------------------------------------------------------------------------------------------
# comparing two results folders


def _results_folder(path: Path, rows: list[tuple[str, str, bool]], mode: str) -> Path:
    """A hand-made results folder: ``rows`` of (id, completion, correct)."""
    path.mkdir()
    (path / "results.json").write_text(json.dumps({
        "config": "c.py", "precision_mode": mode, "precision_backend": "xla", "kv_cache_dtype": "bfloat16",
        "checkpoint": "/runs/x/checkpoints", "step": 7, "k": 1, "pass@1": 0.0}))
    lines = [json.dumps({"index": i, "id": id_, "question": f"question {id_}", "gold": "18", "completion": text,
                         "answer": None, "correct": correct}) for i, (id_, text, correct) in enumerate(rows)]
    (path / "completions.jsonl").write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def hand_made_pair(tmp_path):
    reference = _results_folder(tmp_path / "bf16", [
        ("p1", "#### 18", True), ("p2", "abcdef", False), ("p3", "1234", False), ("p4", "", False),
        ("p5", "only here", True)], "bf16")
    other = _results_folder(tmp_path / "fp8", [
        ("p6", "only there", False), ("p1", "#### 18", True), ("p2", "abcxyz", True), ("p3", "12xy", False),
        ("p4", "x", False)], "fp8_e2e")
    return reference, other


def test_compare_a_hand_made_pair(hand_made_pair, tmp_path, capsys):
    reference, other = hand_made_pair
    assert main(["fp8rl_jax.eval", "compare", str(reference), str(other)]) == 0
    report = json.loads((other / "compare.json").read_text())  # written into the other folder by default
    assert report == {
        "reference": {"dir": str(reference), "config": "c.py", "precision_mode": "bf16", "precision_backend": "xla",
                      "kv_cache_dtype": "bfloat16", "checkpoint": "/runs/x/checkpoints", "step": 7, "k": 1},
        "other": {"dir": str(other), "config": "c.py", "precision_mode": "fp8_e2e", "precision_backend": "xla",
                  "kv_cache_dtype": "bfloat16", "checkpoint": "/runs/x/checkpoints", "step": 7, "k": 1},
        "problems": 4, "only_in_reference": 1, "only_in_other": 1,
        "same_verdict": 0.75,  # p2: wrong in the reference, right in the other
        "identical": 0.25,  # p1
        "prefix_chars_mean": 3.0,  # (7 + 3 + 2 + 0) / 4
        "prefix_fraction_mean": 0.75,  # (7/7 + 3/6 + 2/4 + 1) / 4: an empty reference is all shared
        "reference_pass@1": 0.25, "other_pass@1": 0.5,
        "both_correct": 1, "reference_only_correct": 0, "other_only_correct": 1, "both_wrong": 2,
    }
    per_problem = [json.loads(line) for line in (other / "compare.jsonl").read_text().splitlines()]
    assert [(p["id"], p["same_verdict"], p["identical"], p["prefix_chars"], p["prefix_fraction"])
            for p in per_problem] == [("p1", True, True, 7, 1.0), ("p2", False, False, 3, 0.5),
                                      ("p3", True, False, 2, 0.5), ("p4", True, False, 0, 1.0)]
    markdown = (other / "compare.md").read_text()
    for line in ("| precision | bf16 (xla, KV bfloat16) | fp8_e2e (xla, KV bfloat16) |",
                 "| pass@1 on the 4 problems compared | 25.0% (1 / 4) | 50.0% (2 / 4) |",
                 "| same verdict | 75.0% (3 / 4) |", "| identical text | 25.0% (1 / 4) |",
                 "| common prefix, mean | 3.0 characters, 75.0% of the reference completion |"):
        assert line in markdown
    assert markdown in capsys.readouterr().out

    # the other way round: the prefix is measured against the other completion now (p4: 0 of 1 character)
    assert main(["fp8rl_jax.eval", "compare", str(other), str(reference), f"--out={tmp_path / 'swapped'}"]) == 0
    swapped = json.loads((tmp_path / "swapped" / "compare.json").read_text())
    assert (swapped["prefix_fraction_mean"], swapped["only_in_reference"], swapped["reference_only_correct"]) == (
        0.5, 1, 1)


def test_compare_refuses_different_problems(hand_made_pair, tmp_path, capsys):
    reference, _ = hand_made_pair
    other = _results_folder(tmp_path / "other", [("p1", "#### 18", True)], "bf16")
    rows = (other / "completions.jsonl").read_text().replace('"gold": "18"', '"gold": "19"')
    (other / "completions.jsonl").write_text(rows)
    assert main(["fp8rl_jax.eval", "compare", str(reference), str(other)]) == 2
    assert capsys.readouterr().err == ("error: problem 'p1' differs between the two runs (question or gold answer): "
                                       "they evaluated different datasets\n")


@pytest.mark.parametrize("content, lacks", [
    ("{}", "lacks config, precision_mode, precision_backend, kv_cache_dtype, checkpoint, step, k"),
    ('{"config": "c.py", "precision_mode": "bf16", "precision_backend": "xla", "kv_cache_dtype": "bfloat16", "k": 1}',
     "lacks checkpoint, step"),
    ("[]", ": a JSON list, not the object python -m fp8rl_jax.eval writes"),
], ids=["empty", "no_policy", "list"])
def test_compare_refuses_a_results_json_that_does_not_say_its_run(hand_made_pair, tmp_path, capsys, content, lacks):
    """A results.json without the run's description was compared as "initial weights" (its checkpoint missing read
    as none) with exit status 0; a list was a traceback. Refused, naming the file and what it lacks."""
    reference, other = hand_made_pair
    (other / "results.json").write_text(content)
    assert main(["fp8rl_jax.eval", "compare", str(reference), str(other)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith(f"error: {other / 'results.json'}{' ' if lacks.startswith('lacks') else ''}{lacks}")
    assert out.err.count("\n") == 1
    assert not (other / "compare.json").exists()
    # the same reference given to an evaluation fails at start-up, before the model loads
    assert main(["fp8rl_jax.eval", f"--config={TINY}", f"--compare={other}", f"--out={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {other / 'results.json'}")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------
# bad input: one line, exit status 2, before anything is loaded


@pytest.mark.parametrize("args, message", [
    (["--checkpoint={tmp}/nope"], "--checkpoint={tmp}/nope: no such file or directory (" + CHECKPOINT_FORMS + ")"),
    (["--checkpoint={tmp}"], "--checkpoint={tmp} holds no complete checkpoint; " + CHECKPOINT_FORMS),
    (["--num=0"], "flag --num=0: 0 is not a positive integer"),
    (["--k=two"], "flag --k=two: invalid literal for int() with base 10: 'two'"),
    (["--nosuchflag"], "Unknown command line flag 'nosuchflag' (--help lists the flags)"),
    (["--temperature=0"], "--temperature=0.0 is invalid; allowed: > 0 (the temperature of the k samples; greedy "
                          "decoding needs none)"),
    (["--config.rollout.tempreature=0.5"], "--config.rollout.tempreature: unknown key 'tempreature' in "
     "config.rollout; known: decode_attention, decode_slots, exact, inflight_updates, load_delay_chunks, "
     "max_new_tokens, max_staleness, prompts_per_step, samples_per_prompt, temperature, tensor_parallel, top_k, "
     "top_p"),
    (["--config.precision.mode=fp4"], "config.precision.mode='fp4' is invalid; allowed: bf16 | fp8_rollout | fp8_e2e"),
    (["--compare={tmp}"], "{tmp} is not an eval results folder: it has no results.json (python -m fp8rl_jax.eval "
                          "--out=FOLDER writes one)"),
    (["extra"], "unexpected arguments: ['extra'] (compare two results folders with: python -m fp8rl_jax.eval "
                "compare REFERENCE_DIR OTHER_DIR)"),
], ids=["missing_checkpoint", "no_checkpoint_in_folder", "num", "k", "flag", "temperature", "config_key",
        "config_value", "compare_folder", "positional"])
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["fp8rl_jax.eval", f"--config={TINY}", *args]) == 2
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", f"error: {message.replace('{tmp}', str(tmp_path))}\n")
    assert not (tmp_path / "nope").exists()  # nothing created on the way


def test_bad_checkpoint_through_python_m(tmp_path):
    missing = tmp_path / "runs" / "nope"
    result = subprocess.run([sys.executable, "-m", "fp8rl_jax.eval", "--config=configs/tiny.py",
                             f"--checkpoint={missing}"], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"error: --checkpoint={missing}: no such file or directory ({CHECKPOINT_FORMS})\n")
