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

from fp8rl_jax import cli  # defines --config, --steps, --dry_run and the multi-host flags

EXIT_WORKDIR_IN_USE, EXIT_CHECKPOINT_SAVE = 3, 4  # the module docstring says what each means (2: cli.EXIT_CONFIG)
flags.adopt_module_key_flags(cli)  # --help lists them as this module's flags


def main(argv) -> int:
    if len(argv) > 1:
        return cli.input_error(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    from fp8rl_jax.xla_options import use_cpu_xla_flag

    # before the first JAX computation: on XLA:CPU the sampler's, packed and unpacked programs then round alike, so the
    # mismatch metrics and IS weights do not depend on the layout (the user's XLA_FLAGS wins)
    use_cpu_xla_flag()
    from fp8rl_jax.rl.rewards import reward_names

    config = cli.validated_config(known_rewards=reward_names)
    if config is None:
        return cli.EXIT_CONFIG
    if (steps := cli.STEPS.value) is not None:
        if steps < 1:
            return cli.input_error(f"--steps={steps} is invalid; allowed: a positive number, the run's total RL "
                                   "steps (it overrides config.steps)")
        config.steps = steps
    if cli.DRY_RUN.value:
        print(config)
        return 0
    if config.precision.backend in ("te", "auto"):
        from fp8rl_jax.fp8 import te

        te.preload()  # before JAX starts its GPU backend (see fp8rl_jax.fp8.te)
    from fp8rl_jax.parallel import distributed

    try:  # before anything touches a device: every host's devices then form one mesh
        distributed.initialize(distributed.cluster_spec(cli.COORDINATOR.value, cli.NUM_PROCESSES.value,
                                                        cli.PROCESS_ID.value))
    except ValueError as e:
        return cli.input_error(e)
    from fp8rl_jax.checkpoint import CheckpointSaveError
    from fp8rl_jax.errors import InputFileError
    from fp8rl_jax.memory import EXIT_OUT_OF_MEMORY, DeviceOutOfMemory
    from fp8rl_jax.trainer import Trainer
    from fp8rl_jax.workdir_lock import WorkdirLockedError

    try:  # checks what needs the machine or the model (backend, positions, workdir), reads the model and the data
        trainer = Trainer(config)
    except cli.bad_input_errors() as e:
        return cli.input_error(e)
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
            return cli.EXIT_CONFIG
        return EXIT_OUT_OF_MEMORY if isinstance(failure, DeviceOutOfMemory) else EXIT_CHECKPOINT_SAVE
    return 0


def _parse_flags(argv: list[str]) -> list[str]:
    """``cli.parse_flags``, after ``--help``: this docstring and the flags."""
    if any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:]):
        print(__doc__)
        print(flags.FLAGS.main_module_help())
        sys.exit(0)
    return cli.parse_flags(argv)


def run() -> None:
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
