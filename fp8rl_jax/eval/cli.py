"""Evaluate a policy on the config's test split: ``python -m fp8rl_jax.eval --config=configs/smollm2_gsm8k.py``.

    python -m fp8rl_jax.eval --config=CONFIG [--checkpoint=PATH] [--num=N] [--k=K] [--temperature=T]
                             [--max_new_tokens=M] [--seed=S] [--out=DIR] [--compare=REFERENCE_DIR]
                             [--config.section.key=value ...]
    python -m fp8rl_jax.eval compare REFERENCE_DIR OTHER_DIR [--out=DIR]

Greedy pass@1 on the first ``--num`` problems of the test split (default: all of it; GSM8K's ships with the package),
and with ``--k`` > 1 also mean@k and pass@k over k sampled completions per problem at ``--temperature`` (default
``rollout.temperature``). Prompts are built as in training (``data.prompt_format``, ``data.system_prompt``, the
chat template); a prompt longer than ``data.max_prompt_tokens`` is dropped and counted. Completions are judged by
the config's first reward fn (``gsm8k_answer`` for GSM8K: the final answer after ``####``, else the last number,
read with regular expressions, never run). ``--max_new_tokens`` defaults to ``rollout.max_new_tokens``.

The sampler is the trainer's: the rollout precision of ``precision.mode`` (``bf16``, ``fp8_rollout``, ``fp8_e2e``)
on ``precision.backend``, FP8 rollout weights, the KV cache of ``precision.kv_cache_dtype``. ``--checkpoint`` takes
a run's workdir, its ``checkpoints/`` folder (both: the latest complete step) or one step's folder
(``checkpoints/<step>``); without it the model ``config.model`` loads is evaluated (its initial weights). FP8 and
KV scales come from the checkpoint; where it has none (no checkpoint, or a run trained without them, e.g. a
``bf16`` run evaluated with ``--config.precision.mode=fp8_e2e``), they are calibrated as the trainer does before
its first step, on the first ``rollout.prompts_per_step`` training prompts. ``results.json`` says which.

Written to ``--out`` (default ``<workdir>/eval/<step N | init>_<precision.mode>``): ``results.json``, ``results.md``
and ``completions.jsonl`` (``fp8rl_jax.eval`` documents their keys); the table is printed too.

Comparing two runs: ``compare REFERENCE_DIR OTHER_DIR`` compares two results folders problem by problem (same
verdict, identical text, common prefix of the greedy completions; ``fp8rl_jax.eval.compare``) and writes
``compare.json``, ``compare.md`` and ``compare.jsonl`` into ``--out`` (default: ``OTHER_DIR``). ``--compare=DIR`` on
an evaluation does the same after it, with DIR as the reference and the new results as the other. For example, the
same checkpoint in BF16 and in FP8:

    python -m fp8rl_jax.eval --config=C --checkpoint=runs/x --config.precision.mode=bf16 --out=runs/x/eval/bf16
    python -m fp8rl_jax.eval --config=C --checkpoint=runs/x --out=runs/x/eval/fp8 --compare=runs/x/eval/bf16

Bad input (flags, config keys, a checkpoint path that holds no checkpoint, a folder that is not a results folder)
fails at start-up with one line ``error: ...`` and exit status 2, and so does a data, model or tokenizer file that
does not read, once it is loaded (``fp8rl_jax.cli.bad_input_errors``); a checkpoint that does not fit the config's
model exits with status 1, in one line too. Results that would go into a run's workdir (the default ``--out``) are
written only while no other process holds it (``fp8rl_jax.workdir_lock``): under a live trainer the evaluation stops
at start-up with exit status 3 and names the trainer's host and pid; ``--out`` elsewhere evaluates a live run, its
newest step when ``--checkpoint`` names none: where the trainer deletes the step found at start-up
(``checkpoint.keep``) before it is read, the newest one then (``restore_newest``).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from absl import flags

from fp8rl_jax.eval import ResultsError, read_results, results_markdown, write_results
from fp8rl_jax.eval.compare import compare_dirs, compare_markdown, write_compare

DEFAULT_CONFIG = "configs/smollm2_gsm8k.py"
HELP_ARGS = ("-h", "--help", "--helpshort", "--helpfull", "-?")
# what results.json says of the run, before the metrics of fp8rl_jax.eval.METRIC_KEYS
RUN_KEYS = ("config", "dataset", "split", "precision_mode", "precision_backend", "precision_backend_reason",
            "kv_cache_dtype", "scales", "checkpoint", "step", "checkpoint_precision_mode", "prompts_dropped", "seed",
            "prompt_example", "commit", "commit_dirty", "command", "time", "seconds")


class UsageError(ValueError):
    """Bad input found before any work: reported as one ``error:`` line, exit status 2."""


def _error(message, status: int = 2) -> int:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    return status


def _command(argv: list[str]) -> str:
    return shlex.join(["python", "-m", "fp8rl_jax.eval", *argv[1:]])


# ----------------------------------------------------------------------------------------------------------
# inputs


def resolve_checkpoint(path: str) -> tuple[Path, int]:
    """``(checkpoints folder, step)`` of ``--checkpoint``: a run's workdir or its ``checkpoints/`` folder (the
    latest complete step), or one step's folder ``checkpoints/<step>``; ``UsageError`` for anything else."""
    return _resolve_checkpoint(path)[:2]


def _resolve_checkpoint(path: str) -> tuple[Path, int, bool]:
    """``resolve_checkpoint`` and whether ``path`` named the step (one step's folder)."""
    from fp8rl_jax.checkpoint import latest_complete_step

    p = Path(path)
    expected = "expected a run's workdir, its checkpoints/ folder, or one step's folder checkpoints/<step>"
    if not p.exists():
        raise UsageError(f"--checkpoint={path}: no such file or directory ({expected})")
    if not p.is_dir():
        raise UsageError(f"--checkpoint={path} is a file; {expected}")
    if p.name.isdigit() and latest_complete_step(p.parent) is not None:
        import orbax.checkpoint as ocp

        if int(p.name) in ocp.utils.checkpoint_steps(str(p.parent)):
            return p.parent.resolve(), int(p.name), True
    for folder in (p / "checkpoints", p):
        step = latest_complete_step(folder) if folder.is_dir() else None
        if step is not None:
            return folder.resolve(), step, False
    raise UsageError(f"--checkpoint={path} holds no complete checkpoint; {expected}")


def restore_newest(config, directory: Path, step: int, *, newest: bool, attempts: int = 3):
    """``(model, policy, tokenizer, metadata, step restored)`` of the checkpoints in ``directory``
    (``policy_io.restore_policy``): ``step``, or with ``newest`` (no step was asked for) the newest step when the
    restore starts. A live trainer saving every few steps deletes its older steps (``checkpoint.keep``), so the step
    found at start-up may be gone by the time the model has loaded, or go while it is read: where the restore fails
    and the folder's steps changed meanwhile, it is tried again on the newest step then (``attempts`` in all). A step
    asked for that is not there stays an error (``FileNotFoundError`` naming it and the steps there)."""
    import orbax.checkpoint as ocp

    from fp8rl_jax.policy_io import restore_policy

    for attempt in range(1, attempts + 1):
        steps = ocp.utils.checkpoint_steps(str(directory))
        try:
            model, policy, tokenizer, meta = restore_policy(config, directory, None if newest else step)
        except Exception:
            now = ocp.utils.checkpoint_steps(str(directory))
            if not newest or attempt == attempts or not now or sorted(now) == sorted(steps):
                raise
            print(f"the steps in {directory} changed while it was read (a live run rotating its checkpoints): "
                  f"restoring step {max(now)}, the newest now", flush=True)
            continue
        return model, policy, tokenizer, meta, int(meta.get("step", step))
    raise AssertionError("unreachable")


def _git_commit() -> tuple[str | None, bool | None]:
    """(HEAD, whether tracked files differ from it) of the git checkout this package runs from; None, None outside
    one (an installed package)."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "HEAD"), None if status is None else bool(status)


def _define_flags(argv: list[str]) -> tuple[flags.FlagValues, dict]:
    """The evaluation's flags in a FlagValues of their own: ``main`` parses a fresh one per call."""
    from ml_collections import config_flags

    fv = flags.FlagValues()
    held = {
        "config": config_flags.DEFINE_config_file(
            "config", DEFAULT_CONFIG, "Run configuration: a Python file with get_config(arg=None); "
            "--config=path.py:arg passes arg. Override any key with --config.section.key=value.", flag_values=fv,
            lock_config=True, sys_argv=argv),
        "checkpoint": flags.DEFINE_string(
            "checkpoint", None, "A run's workdir, its checkpoints/ folder (the latest step) or one step's folder "
            "checkpoints/<step>; default: the model config.model loads.", flag_values=fv),
        "num": flags.DEFINE_integer("num", None, "The first N problems of the test split (default: all).",
                                    lower_bound=1, flag_values=fv),
        "k": flags.DEFINE_integer("k", 1, "Sampled completions per problem for mean@k and pass@k (1: greedy only).",
                                  lower_bound=1, flag_values=fv),
        "temperature": flags.DEFINE_float("temperature", None, "Sampling temperature of the k samples (default: "
                                          "rollout.temperature).", flag_values=fv),
        "max_new_tokens": flags.DEFINE_integer("max_new_tokens", None, "Tokens per completion at most (default: "
                                               "rollout.max_new_tokens).", lower_bound=1, flag_values=fv),
        "seed": flags.DEFINE_integer("seed", None, "Seed of the k samples (default: config.seed).", flag_values=fv),
        "out": flags.DEFINE_string("out", None, "The results folder (default: <workdir>/eval/<step N | init>_<mode>).",
                                   flag_values=fv),
        "compare": flags.DEFINE_string("compare", None, "A results folder to compare with afterwards, as the "
                                       "reference.", flag_values=fv),
    }
    return fv, held


def _parse(argv: list[str]) -> tuple[dict, list[str]]:
    """``({flag: value}, positional args)``; ``UsageError`` with the message ``fp8rl_jax.cli`` gives."""
    from fp8rl_jax import cli as shared_cli

    if not any(a.startswith("--config=") or a == "--config" for a in argv[1:]):
        argv = [argv[0], f"--config={DEFAULT_CONFIG}", *argv[1:]]
    problem = shared_cli.config_file_error(argv)  # before absl loads the file: one line naming it
    if problem is not None:
        raise UsageError(problem)
    fv, held = _define_flags(argv)
    try:
        rest = fv(argv)
    except (flags.Error, KeyError, AttributeError, ValueError, TypeError) as e:
        raise UsageError(shared_cli.flag_error(argv, e)) from None
    return {name: holder.value for name, holder in held.items()}, rest[1:]


# ----------------------------------------------------------------------------------------------------------
# the evaluation


def _observed(fp8_state: dict) -> bool:
    """Whether any FP8 amax history holds an observation (a state that never saw one has scales of 1)."""
    import jax
    import numpy as np

    leaves = jax.tree_util.tree_flatten_with_path(fp8_state)[0]
    return any(np.any(np.asarray(x) != 0) for path, x in leaves if "amax_history" in jax.tree_util.keystr(path))


def _kv_calibrated(kv_scales: dict) -> bool:
    import numpy as np

    return any(np.any(np.asarray(x) != 1) for x in kv_scales.values())


def evaluate(config, values: dict, argv: list[str]) -> tuple[Path, dict]:
    """Load the policy, calibrate what it lacks, evaluate, write the results folder: ``(folder, results)``."""
    import jax

    from fp8rl_jax.config import check_fits_model
    from fp8rl_jax.config_values import config_list
    from fp8rl_jax.data.prompts import load_prompts, prompt_iterator
    from fp8rl_jax.eval import evaluate_policy
    from fp8rl_jax.fp8 import kv as kvq
    from fp8rl_jax.fp8.policy import choose_backend
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.sharded import load_model_sharded
    from fp8rl_jax.parallel.mesh import make_mesh
    from fp8rl_jax.plan import data_spec, model_spec, run_precision, sampler_spec
    from fp8rl_jax.policy_io import initial_calibration, right_pad
    from fp8rl_jax.rollout.sampler import Sampler

    c, start = config, time.perf_counter()
    checkpoint, step = values["checkpoint"], values["step"]
    precision = run_precision(c, "rollout")
    backend, reason = choose_backend(c.precision.backend) if precision.fp8 else ("bf16", "precision.mode=bf16: no FP8")
    mesh = make_mesh(c.mesh)
    checkpoint_mode = None
    if checkpoint is not None:
        newest = not values.get("step_asked", True)  # no step in --checkpoint: the newest one when it is read
        model, policy, tokenizer, meta, step = restore_newest(c, checkpoint, step, newest=newest)
        try:  # the precision the checkpoint's run trained in, from the config saved with it
            checkpoint_mode = json.loads(meta.get("config", "{}")).get("precision", {}).get("mode")
        except (json.JSONDecodeError, AttributeError, TypeError):
            checkpoint_mode = None
    else:
        model, params, tokenizer = load_model_sharded(model_spec(c), mesh)
        policy = {"params": params,
                  "fp8_state": llama.init_fp8_state(model, precision.replace(lm_head_fp8=c.precision.lm_head_fp8)),
                  "kv_scales": kvq.init_kv_scales(model.num_layers)}
    check_fits_model(c, model.max_position_embeddings,
                     f"preset {c.model.preset!r}" if c.model.source == "preset" else c.model.source)

    # the scales the rollout needs and the policy lacks: calibrated as the trainer does before its first step (FP8
    # linears without delayed scales, Fp8Recipe.delayed, read none; an FP8 LM head's forward reads its own)
    fp8_delayed = precision.fp8 and (precision.recipe.delayed or precision.lm_head_fp8)
    fp8_missing = fp8_delayed and not _observed(policy["fp8_state"])
    kv_missing = precision.kv_fp8 and not _kv_calibrated(policy["kv_scales"])
    if not (precision.fp8 or precision.kv_fp8):
        scales = "none: BF16 rollout"
    elif not (fp8_delayed or precision.kv_fp8):
        scales = f"none: {precision.recipe.scaling} scaling takes each scale from its operand"
    elif not (fp8_missing or kv_missing):
        scales = "from the checkpoint"
    else:
        records = prompt_iterator(data_spec(c), tokenizer, "train").take(c.rollout.prompts_per_step)
        tokens = right_pad([r.prompt_ids for r in records], tokenizer.pad_id or 0)
        policy = initial_calibration(c, model, precision, policy, tokens, fp8=fp8_missing, kv=kv_missing)
        what = " and ".join(name for name, missing in (("FP8", fp8_missing), ("KV-cache", kv_missing)) if missing)
        source = "the checkpoint has none" if checkpoint is not None else "no checkpoint"
        scales = f"{what} scales calibrated on the first {len(records)} training prompts ({source})"
    print(f"precision: {c.precision.mode}, FP8 backend {backend} ({reason}); scales: {scales}", flush=True)

    prompts = load_prompts(data_spec(c), tokenizer, "test", limit=values["num"])
    if prompts.dropped:
        print(f"{prompts.dropped} of {prompts.total} test prompts are longer than data.max_prompt_tokens="
              f"{c.data.max_prompt_tokens} and were dropped", flush=True)
    sampler = Sampler(sampler_spec(c), model, tokenizer, precision, mesh, sequences=len(prompts.records) * values["k"],
                      held=policy)
    seed = c.seed if values["seed"] is None else values["seed"]
    temperature = c.rollout.temperature if values["temperature"] is None else values["temperature"]
    run = evaluate_policy(sampler, policy, prompts.records, reward=config_list(c.reward.fns)[0],
                          max_new_tokens=c.rollout.max_new_tokens, temperature=temperature, k=values["k"],
                          key=jax.random.PRNGKey(seed))
    commit, dirty = _git_commit()
    results = {
        "config": values["config_path"],
        "dataset": c.data.dataset,
        "split": "test",
        "precision_mode": c.precision.mode,
        "precision_backend": backend,
        "precision_backend_reason": reason,
        "kv_cache_dtype": precision.kv_cache_dtype,
        "scales": scales,
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "step": step,
        "checkpoint_precision_mode": checkpoint_mode,
        "prompts_dropped": prompts.dropped,
        "seed": seed,
        "prompt_example": prompts.records[0].prompt_text,
        "commit": commit,
        "commit_dirty": dirty,
        "command": _command(argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": None,
        **run.metrics,
    }
    results["seconds"] = round(time.perf_counter() - start, 3)
    return write_results(values["out"], results, run.rows), results


def _compare_command(argv: list[str]) -> int:
    """``compare REFERENCE_DIR OTHER_DIR [--out=DIR]``."""
    fv = flags.FlagValues()
    out = flags.DEFINE_string("out", None, "Where compare.* go (default: OTHER_DIR).", flag_values=fv)
    try:
        rest = fv([argv[0], *argv[2:]])[1:]
    except flags.Error as e:
        return _error(e)
    if len(rest) != 2:
        return _error(f"compare takes two results folders, REFERENCE_DIR OTHER_DIR; got {len(rest)}: {rest}")
    try:
        per_problem, report = compare_dirs(*rest)
    except ResultsError as e:
        return _error(e)
    folder = write_compare(out.value or rest[1], per_problem, report)
    print(compare_markdown(report))
    print(f"wrote {folder}/compare.json, compare.md, compare.jsonl")
    return 0


def main(argv: list[str]) -> int:
    """The command line (``argv[0]`` is the program); returns the exit status."""
    from absl import logging

    if argv[1:2] == ["compare"]:
        return _compare_command(argv)
    if any(a in HELP_ARGS for a in argv[1:]):
        fv, _ = _define_flags([argv[0], f"--config={DEFAULT_CONFIG}"])
        print(__doc__)
        print("\n".join(f"--{name}: {fv[name].help}" for name in fv))
        return 0
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    from fp8rl_jax import cli as shared_cli
    from fp8rl_jax.config import validate
    from fp8rl_jax.rl.rewards import reward_names

    try:
        values, rest = _parse(argv)
        if rest:
            raise UsageError(f"unexpected arguments: {rest} (compare two results folders with: python -m "
                             "fp8rl_jax.eval compare REFERENCE_DIR OTHER_DIR)")
        if values["temperature"] is not None and not values["temperature"] > 0:
            raise UsageError(f"--temperature={values['temperature']} is invalid; allowed: > 0 (the temperature of "
                             "the k samples; greedy decoding needs none)")
        config = values["config"]
        config.get("seed")  # a config file that failed to load raises its error on first access
        if values["max_new_tokens"] is not None:
            config.rollout.max_new_tokens = values["max_new_tokens"]
        validate(config, known_rewards=reward_names, training=False,
                 config_file=shared_cli.config_path(argv).partition(":")[0])
        values["checkpoint"], values["step"], values["step_asked"] = (
            _resolve_checkpoint(values["checkpoint"]) if values["checkpoint"] else (None, None, False))
        if values["compare"] is not None:
            read_results(values["compare"])  # a bad reference fails now, not after the evaluation
    except (UsageError, ResultsError, *shared_cli.bad_input_errors()) as e:
        return _error(e)
    values["config_path"] = shared_cli.config_path(argv)
    if values["out"] is None:
        where = values["checkpoint"].parent if values["checkpoint"] else Path(config.workdir)
        name = f"step{values['step']}" if values["checkpoint"] else "init"
        values["out"] = str(where / "eval" / f"{name}_{config.precision.mode}")
    from fp8rl_jax.workdir_lock import WorkdirLockedError, lock_for_output

    try:  # results written into a run's workdir: not while another process (a trainer) owns it
        run_dirs = [values["checkpoint"].parent if values["checkpoint"] else None, config.workdir]
        lock = lock_for_output(values["out"], run_dirs, alternative="--out=<a folder outside it>")
    except WorkdirLockedError as e:
        return _error(e, status=3)
    if config.precision.backend in ("te", "auto"):
        from fp8rl_jax.fp8 import te

        te.preload()  # before JAX starts its GPU backend (see fp8rl_jax.fp8.te)
    try:
        folder, results = evaluate(config, values, argv)
    except shared_cli.bad_input_errors() as e:  # what needs the model (positions, the backend), a file that won't read
        return _error(e)
    except ValueError as e:  # a checkpoint that does not fit the config's model
        return _error(e, status=1)
    finally:
        if lock is not None:
            lock.release()
    print(results_markdown(results))
    print(f"wrote {folder}/results.json, results.md, completions.jsonl")
    if values["compare"] is not None:
        per_problem, report = compare_dirs(values["compare"], folder)
        write_compare(folder, per_problem, report)
        print(compare_markdown(report))
        print(f"wrote {folder}/compare.json, compare.md, compare.jsonl")
    return 0


def run() -> None:
    sys.exit(main(sys.argv))
