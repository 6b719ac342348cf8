"""GRPO with end-to-end FP8: ``python -m fp8rl_jax.main --config=configs/llama8b.py:/path/to/model``.

A thin shell over ``fp8rl_jax.trainer.Trainer``: parse and validate the config, build the trainer, run.
Config keys are overridden as ``--config.rollout.temperature=0.7``; ``--config=file.py:arg`` passes ``arg`` to
the file's ``get_config``.

Exit status: 0 done; 2 a bad flag, config key or value, one the machine or model cannot run, or a workdir that
cannot be written (one ``error:`` line); 3 the workdir is in use by another run (the error names its host, pid and
start); 4 a checkpoint could not be saved (disk full, permission, quota: the error names the step, the folder, the
cause and the last complete step, from which rerunning the command resumes; plots, metrics or TensorBoard events
that then fail on the same disk do not replace it); 5 a device ran out of memory (one ``error:`` line naming the
phase, its shapes, the device's memory and the config keys that lower it, ``fp8rl_jax.memory.DeviceOutOfMemory``);
1 anything else (a Python traceback).
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

EXIT_CONFIG, EXIT_WORKDIR_IN_USE, EXIT_CHECKPOINT_SAVE = 2, 3, 4  # the module docstring says what each means

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    "configs/smollm2_gsm8k.py",
    "Run configuration: a Python file with get_config(arg=None); --config=path.py:arg passes arg. "
    "Override any key with --config.section.key=value.",
    lock_config=True,
)
_STEPS = flags.DEFINE_integer(
    "steps", None, "The run's total RL steps (overrides config.steps). A run in the workdir resumes and stops there, "
    "so rerunning the same command after a crash finishes the same run.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate the config, print it and exit.")


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """What bad input raises, which every entry point (this one, ``fp8rl_jax.eval``, ``.export``, ``.serve``) says as
    one ``error:`` line with exit status 2 (``input_error``): a config key or value (``ConfigError``), a data, model or
    tokenizer file that does not read as one (``fp8rl_jax.errors.InputFileError``), a file or folder that is missing
    or cannot be opened (``OSError``; the message names it)."""
    from fp8rl_jax.config import ConfigError
    from fp8rl_jax.errors import InputFileError

    return ConfigError, InputFileError, OSError


def input_error(error) -> int:
    """Print ``error`` (an exception or a message) as one ``error:`` line on stderr; the exit status of bad input,
    ``EXIT_CONFIG``."""
    print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
    return EXIT_CONFIG


def _validated_config(**validate_kw):
    """The ``--config``, checked by ``config.validate(**validate_kw)``; None after printing the one-line error."""
    from fp8rl_jax.config import validate

    try:
        config = _CONFIG.value
        config.get("seed")  # a config file that failed to load raises its error on first access
        validate(config, config_file=_config_path(sys.argv).partition(":")[0], **validate_kw)
    except bad_input_errors() as e:
        input_error(e)
        return None
    return config


def tool_config(argv, *, training: bool = True):
    """The ``--config`` of a non-training entry point (export, serve), validated: ``(config, None)``, or
    ``(None, exit_code)`` when it should stop (a one-line error: 2; ``--dry_run``: the config printed, 0)."""
    if len(argv) > 1:
        return None, input_error(f"unexpected arguments: {argv[1:]}")
    if _STEPS.value is not None:
        return None, input_error(f"--steps={_STEPS.value}: a trainer flag (python -m fp8rl_jax.main)")
    config = _validated_config(training=training)
    if config is None:
        return None, EXIT_CONFIG
    if _DRY_RUN.value:
        print(config)
        return None, 0
    return config, None
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0 (else $FP8RL_COORDINATOR, SLURM, or one process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: the number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index, 0-based.")


def main(argv) -> int:
    if len(argv) > 1:
        return input_error(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    from fp8rl_jax.rollout import exact

    # before the first JAX computation: on XLA:CPU the sampler's, packed and unpacked programs then round alike, so the
    # mismatch metrics and IS weights do not depend on the layout (the user's XLA_FLAGS wins)
    exact.use_cpu_xla_flag()
    from fp8rl_jax.rl.rewards import reward_names

    config = _validated_config(known_rewards=reward_names)
    if config is None:
        return EXIT_CONFIG
    if _STEPS.value is not None:
        if _STEPS.value < 1:
            return input_error(f"--steps={_STEPS.value} is invalid; allowed: a positive number, the run's total RL "
                               "steps (it overrides config.steps)")
        config.steps = _STEPS.value
    if _DRY_RUN.value:
        print(config)
        return 0
    if config.precision.backend in ("te", "auto"):
        from fp8rl_jax.fp8 import te

        te.preload()  # before JAX starts its GPU backend (see fp8rl_jax.fp8.te)
    from fp8rl_jax.parallel import distributed

    try:  # before anything touches a device: every host's devices then form one mesh
        distributed.initialize(distributed.cluster_spec(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value))
    except ValueError as e:
        return input_error(e)
    from fp8rl_jax.checkpoint import CheckpointSaveError
    from fp8rl_jax.errors import InputFileError
    from fp8rl_jax.memory import EXIT_OUT_OF_MEMORY, DeviceOutOfMemory
    from fp8rl_jax.trainer import Trainer
    from fp8rl_jax.workdir_lock import WorkdirLockedError

    try:  # checks what needs the machine or the model (backend, positions, workdir), reads the model and the data
        trainer = Trainer(config)
    except bad_input_errors() as e:
        return input_error(e)
    except WorkdirLockedError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_WORKDIR_IN_USE
    except DeviceOutOfMemory as e:  # the initial calibration's allocation failed: phase, shapes, knobs in one line
        print(f"error: {e}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    failure = None
    try:
        trainer.run()
    except (CheckpointSaveError, DeviceOutOfMemory) as e:  # a save, or a phase of an RL step that did not fit
        failure = e
    except InputFileError as e:  # the evaluation's data file (data.eval_path), read at the first evaluation
        failure = e
    finally:  # also on any other error: the pending save finishes, the workdir is released
        try:
            trainer.close()  # the final save's failure shows here
        except CheckpointSaveError as e:
            failure = failure or e
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        if isinstance(failure, InputFileError):
            return EXIT_CONFIG
        return EXIT_OUT_OF_MEMORY if isinstance(failure, DeviceOutOfMemory) else EXIT_CHECKPOINT_SAVE
    return 0


def _config_path(argv: list[str]) -> str:
    path = _CONFIG.default
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    return path


def _unknown_override(argv: list[str]) -> str | None:
    """Name the first ``--config.a.b=...`` override whose key the config file does not define."""
    from fp8rl_jax.config import load_config_file

    path, _, arg = _config_path(argv).partition(":")
    try:
        config = load_config_file(path, arg or None)
    except Exception as e:  # the file itself is broken: report that
        return f"{path}: {e}"
    for a in argv:
        if not a.startswith("--config."):
            continue
        key = a[len("--config."):].split("=", 1)[0]
        node, walked = config, []
        for part in key.split("."):
            where = "config" + "".join("." + w for w in walked)
            if not hasattr(node, "keys"):
                return f"--config.{key}: {where} is a value ({type(node).__name__}), not a section with keys"
            if part not in node:
                return f"--config.{key}: unknown key {part!r} in {where}; known: {', '.join(sorted(node.keys()))}"
            node, walked = node[part], [*walked, part]
    return None


def _config_file_error(argv: list[str]) -> str | None:
    """One line saying what is wrong with the ``--config`` file itself (missing, raising, no get_config), or None."""
    from fp8rl_jax.config import ConfigError, load_config_file

    path, _, arg = _config_path(argv).partition(":")
    try:
        load_config_file(path, arg or None)
    except (ConfigError, OSError) as e:
        return str(e)
    return None


def flag_error(argv: list[str], error: Exception) -> str:
    """The one line of a flag that failed to parse: an unknown ``--config.a.b`` key names the keys there are (absl
    and ml_collections say only that it failed), an unknown flag points at ``--help``."""
    unknown = _unknown_override(argv)
    if unknown is not None:
        return unknown
    if isinstance(error, flags.UnrecognizedFlagError):
        return f"{error} (--help lists the flags)"
    return str(error)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with bad input said in one ``error:`` line and exit status 2 (``EXIT_CONFIG``): a config
    file that does not load, an unknown flag or config key, a value that does not parse."""
    if any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:]):
        print(__doc__)
        print(flags.FLAGS.main_module_help())
        sys.exit(0)
    # checked before absl loads the file: it would print the file's traceback, or defer an OSError to first use
    problem = _config_file_error(argv)
    if problem is not None:
        sys.exit(input_error(problem))
    try:
        return flags.FLAGS(argv)
    except (flags.Error, KeyError, AttributeError, ValueError, TypeError) as e:
        sys.exit(input_error(flag_error(argv, e)))


def run() -> None:
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
