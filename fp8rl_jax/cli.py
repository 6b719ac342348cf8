"""The command line every entry point shares (``python -m fp8rl_jax.main``, ``.eval``, ``.export``, ``.serve``): the
``--config`` flag (a config file, ``--config=file.py:arg``, keys overridden as ``--config.rollout.temperature=0.7``),
``--dry_run``, the trainer's ``--steps`` and multi-host flags (defined here, so that the other entry points parse the
same command line and name ``--steps`` as the trainer's), and bad input said in one ``error:`` line with exit status 2
(``EXIT_CONFIG``): a bad flag, config file, key or value (``parse_flags``, ``flag_error``, ``tool_config``).
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

EXIT_CONFIG = 2  # a bad flag, config key or value, said in one error: line (fp8rl_jax.main's docstring lists the rest)

CONFIG = config_flags.DEFINE_config_file(
    "config",
    "configs/smollm2_gsm8k.py",
    "Run configuration: a Python file with get_config(arg=None); --config=path.py:arg passes arg. "
    "Override any key with --config.section.key=value.",
    lock_config=True,
)
STEPS = flags.DEFINE_integer(
    "steps", None, "The run's total RL steps (overrides config.steps). A run in the workdir resumes and stops there, "
    "so rerunning the same command after a crash finishes the same run.")
DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate the config, print it and exit.")
COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0 (else $FP8RL_COORDINATOR, SLURM, or one process).")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: the number of processes.")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index, 0-based.")


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """What bad input raises, which every entry point (``fp8rl_jax.main``, ``.eval``, ``.export``, ``.serve``) says as
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


def validated_config(**validate_kw):
    """The ``--config``, checked by ``config.validate(**validate_kw)``; None after printing the one-line error."""
    from fp8rl_jax.config import validate

    try:
        config = CONFIG.value
        config.get("seed")  # a config file that failed to load raises its error on first access
        validate(config, config_file=config_path(sys.argv).partition(":")[0], **validate_kw)
    except bad_input_errors() as e:
        input_error(e)
        return None
    return config


def tool_config(argv, *, training: bool = True):
    """The ``--config`` of a non-training entry point (export, serve), validated: ``(config, None)``, or
    ``(None, exit_code)`` when it should stop (a one-line error: 2; ``--dry_run``: the config printed, 0)."""
    if len(argv) > 1:
        return None, input_error(f"unexpected arguments: {argv[1:]}")
    if STEPS.value is not None:
        return None, input_error(f"--steps={STEPS.value}: a trainer flag (python -m fp8rl_jax.main)")
    config = validated_config(training=training)
    if config is None:
        return None, EXIT_CONFIG
    if DRY_RUN.value:
        print(config)
        return None, 0
    return config, None


def config_path(argv: list[str]) -> str:
    """The ``--config`` value of ``argv`` (``file.py`` or ``file.py:arg``), else the flag's default."""
    path = CONFIG.default
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    return path


def _unknown_override(argv: list[str]) -> str | None:
    """Name the first ``--config.a.b=...`` override whose key the config file does not define."""
    from fp8rl_jax.config import load_config_file

    path, _, arg = config_path(argv).partition(":")
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


def config_file_error(argv: list[str]) -> str | None:
    """One line saying what is wrong with the ``--config`` file itself (missing, raising, no get_config), or None."""
    from fp8rl_jax.config import ConfigError, load_config_file

    path, _, arg = config_path(argv).partition(":")
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


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with bad input said in one ``error:`` line and exit status 2 (``EXIT_CONFIG``): a config
    file that does not load, an unknown flag or config key, a value that does not parse. Each entry point prints
    its own ``--help`` first."""
    # checked before absl loads the file: it would print the file's traceback, or defer an OSError to first use
    problem = config_file_error(argv)
    if problem is not None:
        sys.exit(input_error(problem))
    try:
        return flags.FLAGS(argv)
    except (flags.Error, KeyError, AttributeError, ValueError, TypeError) as e:
        sys.exit(input_error(flag_error(argv, e)))
