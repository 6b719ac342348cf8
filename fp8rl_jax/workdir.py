"""A training run's workdir: what a run writes there (``RUN_OUTPUTS``), what an earlier run left (``previous_run``;
``prepare_workdir`` refuses or clears it as ``checkpoint.resume`` says), ``run.json`` (``write_run_json``) and the
lock that keeps one run per workdir (``lock_workdir``, over ``fp8rl_jax.workdir_lock``)."""

from __future__ import annotations

import errno
import json
import shutil
import time
from pathlib import Path

import jax
import numpy as np

from fp8rl_jax.checkpoint import latest_complete_step
from fp8rl_jax.config import ConfigError
from fp8rl_jax.parallel.distributed import is_primary
from fp8rl_jax.workdir_lock import LOCK_NAME, WorkdirLock, WorkdirLockedError

# What a run writes into its workdir; ``checkpoint.resume=overwrite`` deletes these and nothing else.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "plots", "tensorboard", "run.json")


def previous_run(workdir: Path) -> list[str]:
    """What of an earlier run ``workdir`` holds (checkpoints, metrics records); empty when it holds none."""
    held = []
    checkpoints = workdir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        step = latest_complete_step(checkpoints)
        held.append(f"checkpoints up to step {step}" if step is not None else "unfinished checkpoints")
    metrics = workdir / "metrics.jsonl"
    if metrics.is_file() and (lines := sum(1 for line in metrics.read_text().splitlines() if line.strip())):
        held.append(f"{lines} metrics records")
    return held


def lock_workdir(workdir: Path) -> WorkdirLock | None:
    """One run per workdir (``fp8rl_jax.workdir_lock``). Process 0 holds the lock for its whole job; the other
    processes learn whether it got it, so that all of them stop (rather than wait for it at a collective). A
    workdir where the lock cannot be written (read-only, no permission) is a ``ConfigError`` naming it: the
    first write of the run, so the run stops before it loads anything."""
    lock = error = None
    if is_primary():
        try:
            lock = WorkdirLock.acquire(workdir, alternative="another config.workdir")
        except OSError as e:  # a read-only filesystem, no permission, a file in the way: another workdir it is
            reason = f"{e.strerror or e} [{errno.errorcode.get(e.errno, e.errno)}]" if e.errno else str(e)
            error = ConfigError(f"config.workdir={str(workdir)!r} cannot be written: {reason}"
                                f"{f' ({e.filename})' if e.filename else ''}; choose another config.workdir")
        except Exception as e:  # raised below, once the other processes heard of it
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if not int(multihost_utils.broadcast_one_to_all(np.int32(error is None))) and error is None:
            error = WorkdirLockedError(f"config.workdir={str(workdir)!r}: process 0 of this job could not "
                                       f"take {workdir / LOCK_NAME} (its error says why)")
    if error is not None:
        raise error
    return lock


def prepare_workdir(workdir: Path, mode: str) -> None:
    """Never destroy a run by accident: ``checkpoint.resume=never`` (``mode``) refuses a workdir that holds one,
    ``overwrite`` deletes that run's outputs (``RUN_OUTPUTS``, nothing else in the folder) first."""
    held = previous_run(workdir)
    if mode == "never" and held:
        raise ConfigError(
            f"config.workdir={str(workdir)!r} holds a run ({', '.join(held)}) and checkpoint.resume=never; "
            "continue it with checkpoint.resume=auto, delete it and start over with checkpoint.resume=overwrite, "
            "or choose another config.workdir")
    if mode == "overwrite":
        if is_primary():  # one process deletes; the others wait for it (they would race it, then see its gaps)
            for name in RUN_OUTPUTS:
                path = workdir / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("fp8rl_jax: workdir overwritten")


def write_run_json(workdir: Path, config, step: int, backend: str, backend_reason: str) -> None:
    """``workdir/run.json``: the config and the FP8 backend chosen, with one entry per start of the run (at
    ``step``; a resumed run may land on another machine, and ``auto`` on another backend)."""
    path = workdir / "run.json"
    starts = []
    if step and path.exists():
        try:
            starts = json.loads(path.read_text()).get("starts", [])
        except (json.JSONDecodeError, AttributeError):
            starts = []
    starts.append({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step": step,
                   "precision_backend": backend, "precision_backend_reason": backend_reason,
                   "devices": [str(d) for d in jax.devices()][:8], "jax": jax.__version__})
    run = {"config": json.loads(config.to_json()), "precision_backend": backend,
           "precision_backend_reason": backend_reason, "starts": starts}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(run, indent=1) + "\n")
    tmp.replace(path)
