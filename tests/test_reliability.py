"""Findings of the reliability pass (issue 10, items 5 and 6), each reproduced on the tiny config.

Backend choice reported, never a quiet fallback; a workdir that holds a run is never overwritten unasked;
non-finite hyperparameters and updates refused; ``--steps`` is the run's total, and a failed checkpoint save is one
error line after which the rerun resumes; prompt + new tokens must fit the model; list keys and overrides parsed in
one place.
"""

import errno
import json
import math
import os
import re
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from fp8rl_jax.checkpoint import Checkpointer, latest_complete_step
from fp8rl_jax.config import ConfigError, load_config_file
from fp8rl_jax.config_values import config_list
from fp8rl_jax.trainer import Trainer

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.py")


def _config(workdir, **overrides):
    """The tiny fp8_e2e config in ``workdir``, quiet, with dotted-key ``overrides``."""
    config = load_config_file(TINY)
    config.update_from_flattened_dict({
        "workdir": str(workdir), "logging.progress": False, "logging.tensorboard": False, "logging.plots": False,
        **overrides,
    })
    return config


def _main(*args, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "fp8rl_jax.main", f"--config={TINY}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _metrics(workdir) -> list[dict]:
    path = workdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ----------------------------------------------------------------------------------------------------------
# 1. the FP8 backend: reported when chosen, refused with the reason when unavailable


def test_auto_backend_is_reported_in_log_run_json_metrics_and_checkpoint(tmp_path, capsys):
    workdir = tmp_path / "run"
    trainer = Trainer(_config(workdir, steps=1, **{"precision.backend": "auto"}))
    trainer.run()
    trainer.close()
    out = capsys.readouterr().out
    # no GPU here: auto must say it chose xla, and why
    line = next((s for s in out.splitlines() if "precision.backend=auto" in s), "")
    assert "xla" in line and ("Transformer Engine" in line or "GPU" in line), out
    run = json.loads((workdir / "run.json").read_text())
    assert run["precision_backend"] == "xla" and run["config"]["precision"]["backend"] == "auto"
    assert "Transformer Engine" in run["precision_backend_reason"] or "GPU" in run["precision_backend_reason"]
    assert [r["precision_backend"] for r in _metrics(workdir)] == ["xla"]
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        _, meta = ckpt.restore(like=jax.eval_shape(lambda: trainer.state))
    assert meta["precision_backend"] == "xla"


def test_te_backend_unavailable_fails_at_startup_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match=r"config.precision.backend='te'.*(No module named|no GPU)"):
        Trainer(_config(tmp_path / "run", **{"precision.backend": "te"}))
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything was built


# ----------------------------------------------------------------------------------------------------------
# 2. a workdir that holds a run is never overwritten unless asked


def test_resume_never_refuses_a_workdir_holding_a_run_and_overwrite_clears_it(tmp_path):
    workdir = tmp_path / "run"
    first = Trainer(_config(workdir, steps=1))
    first.run()
    first.close()
    metrics_before = (workdir / "metrics.jsonl").read_text()
    assert latest_complete_step(workdir / "checkpoints") == 1

    with pytest.raises(ConfigError) as info:
        Trainer(_config(workdir, steps=1, **{"checkpoint.resume": "never"}))
    message = str(info.value)
    assert str(workdir) in message and "checkpoint.resume=auto" in message and "checkpoint.resume=overwrite" in message
    assert (workdir / "metrics.jsonl").read_text() == metrics_before  # nothing touched
    assert latest_complete_step(workdir / "checkpoints") == 1

    (workdir / "plots").mkdir()
    (workdir / "plots" / "reward.png").write_bytes(b"old")
    (workdir / "notes.txt").write_text("mine")  # not the run's: left alone
    fresh = Trainer(_config(workdir, steps=1, **{"checkpoint.resume": "overwrite"}))
    assert fresh.step_count == 0
    assert latest_complete_step(workdir / "checkpoints") is None
    assert _metrics(workdir) == [] and not (workdir / "plots").exists()
    assert (workdir / "notes.txt").read_text() == "mine"
    fresh.close()


# ----------------------------------------------------------------------------------------------------------
# 3. an update that leaves params or optimizer state non-finite is skipped, never checkpointed


def test_overflowing_update_is_skipped_and_not_checkpointed(tmp_path):
    from fp8rl_jax.plan import loss_config
    from fp8rl_jax.rl.step import build_optimizer, make_train_step

    config = _config(tmp_path / "run", steps=1)
    trainer = Trainer(config)
    # the loss and gradient are finite; only the update overflows (the config refuses lr=inf, so build it here)
    optim = ml_collections.ConfigDict(config.optim.to_dict())
    optim.lr = math.inf
    optimizer, _ = build_optimizer(optim, 1)
    trainer._train_step = make_train_step(trainer.model, trainer.train_precision, optimizer,
                                          loss_config(config),
                                          old_logp_from_forward=trainer._own_old_logp)
    before = jax.device_get(trainer.state["params"])
    records = trainer.run()
    trainer.close()
    assert records[0]["skipped_updates"] == 1
    assert np.isfinite(records[0]["loss"]) and np.isfinite(records[0]["grad_norm"])
    after = jax.device_get(trainer.state["params"])
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    with Checkpointer(tmp_path / "run" / "checkpoints", async_save=False) as ckpt:
        saved, _ = ckpt.restore(like=jax.eval_shape(lambda: trainer.state))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((saved["params"], saved["opt_state"])))


# ----------------------------------------------------------------------------------------------------------
# 4. --steps is the run's total: rerunning the same command after a crash finishes the same run


def test_rerunning_the_command_after_a_crash_finishes_the_same_run(tmp_path):
    workdir = tmp_path / "run"
    crashed = Trainer(_config(workdir, steps=3, **{"checkpoint.every": 1}))
    with pytest.raises(ValueError, match="config.steps=3"):
        crashed.run(4)  # past the run's total (the LR schedule ends there)
    with pytest.raises(ValueError, match="positive"):
        crashed.run(0)
    crashed.run(1)  # ... and the process dies here
    crashed.close()

    result = _main(f"--config.workdir={workdir}", "--steps=3", "--config.checkpoint.every=1",
                   "--config.logging.tensorboard=False", "--config.logging.plots=False")
    assert result.returncode == 0, result.stderr[-3000:]
    assert latest_complete_step(workdir / "checkpoints") == 3
    assert [r["step"] for r in _metrics(workdir)] == [1, 2, 3]
    assert "3/3" in result.stderr and "/30" not in result.stderr  # the progress bar counts to the run's total

    again = _main(f"--config.workdir={workdir}", "--steps=3", "--config.logging.progress=False")
    assert again.returncode == 0, again.stderr[-3000:]
    assert latest_complete_step(workdir / "checkpoints") == 3
    assert "step 3 of 3" in again.stdout


@pytest.mark.parametrize("steps", ["-1", "0"])
def test_steps_must_be_positive(steps, tmp_path):
    result = _main(f"--config.workdir={tmp_path}", f"--steps={steps}")
    assert result.returncode != 0
    assert f"--steps={steps}" in result.stderr and "positive" in result.stderr
    assert not any(tmp_path.iterdir())


# The trainer's command line, with every file Orbax opens for writing inside step FAIL_STEP's unfinished folder
# failing with ENOSPC (its JSON items and metadata, written from Orbax's background threads): a disk that fills up
# during that save. tensorstore's array writes are C++ and go through; a real full disk fails those too.
ENOSPC_MAIN = """
import builtins, errno, os, sys
real_open = builtins.open
marker = os.sep + os.environ["FAIL_STEP"] + ".orbax-checkpoint-tmp" + os.sep
def failing_open(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, os.PathLike)) and marker in os.fspath(file) and set(mode) & set("wax+"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
    return real_open(file, mode, *args, **kwargs)
builtins.open = failing_open
from fp8rl_jax.main import run
run()
"""


def test_a_failed_checkpoint_save_is_one_error_line_and_the_rerun_resumes(tmp_path):
    workdir = tmp_path / "run"
    args = [f"--config={TINY}", f"--config.workdir={workdir}", "--steps=3", "--config.checkpoint.every=1",
            "--config.logging.progress=False", "--config.logging.plots=False"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", FAIL_STEP="2")
    failed = subprocess.run([sys.executable, "-c", ENOSPC_MAIN, *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert failed.returncode == 4, failed.stderr[-3000:]
    checkpoints = workdir / "checkpoints"
    assert re.fullmatch(
        rf"error: checkpoint step 2 could not be saved to {re.escape(str(checkpoints))}: No space left on device "
        rf"\[ENOSPC\] \({re.escape(str(checkpoints))}/2\.orbax-checkpoint-tmp/\S+\); the last complete checkpoint "
        r"is step 1: fix the cause and rerun the same command to resume from it\n", failed.stderr), failed.stderr
    assert "Traceback" not in failed.stderr  # was 899 lines of Orbax and asyncio tracebacks, exit status 1
    assert latest_complete_step(checkpoints) == 1 and not (workdir / "lock.json").exists()

    again = _main(*args[1:])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {checkpoints} at step 1" in again.stdout
    assert latest_complete_step(checkpoints) == 3
    assert [r["step"] for r in _metrics(workdir)] == [1, 2, 3]  # each once: the failed run's step 2 was dropped


# The trainer's command line with a disk that is full from the moment a checkpoint save starts: every writer after
# it fails too (Orbax's array writes and JSON items, the plots, metrics.jsonl, TensorBoard's flush). FULL_DISK=tmpfs:
# the workdir lies on a small tmpfs, filled up to its last byte before the save; FULL_DISK=injected (no mount needed):
# from then on every file opened for writing under the workdir fails with ENOSPC (tensorstore's C++ array writes go
# through).
FULL_DISK_MAIN = """
import builtins, errno, os
from fp8rl_jax import checkpoint
workdir = os.path.realpath(os.environ["FULL_DISK_WORKDIR"]) + os.sep
full = []

def fill_up():
    if os.environ["FULL_DISK"] == "tmpfs":
        fd = os.open(workdir + "filler", os.O_WRONLY | os.O_CREAT)
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, bytes(size))
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
        os.close(fd)
    full.append(True)

real_open = builtins.open
def failing_open(file, mode="r", *args, **kwargs):
    if full and isinstance(file, (str, os.PathLike)) and os.path.realpath(file).startswith(workdir) and \\
            set(mode) & set("wax+"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
    return real_open(file, mode, *args, **kwargs)
if os.environ["FULL_DISK"] == "injected":
    builtins.open = failing_open

real_save = checkpoint.Checkpointer.save
def save(self, step, *args, **kwargs):
    fill_up()
    return real_save(self, step, *args, **kwargs)
checkpoint.Checkpointer.save = save
from fp8rl_jax.main import run
run()
"""


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 MB tmpfs mounted at ``tmp_path / "disk"``; skips where mounting is not allowed (not root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.parametrize("disk", ["tmpfs", "injected"])
def test_a_final_async_save_on_a_full_disk_is_the_one_error_whatever_else_fails(tmp_path, request, disk):
    """The final save, async (the default), on a disk that is full: the plots written meanwhile, TensorBoard's
    flush at close and Orbax's background tasks fail as well. Was: a PIL ``OSError`` traceback (exit status 1,
    the save's error never said), or the error line followed by asyncio's "Task exception was never retrieved"
    tracebacks of Orbax's write tasks, depending on which writer met the full disk first."""
    workdir = (request.getfixturevalue("small_tmpfs") if disk == "tmpfs" else tmp_path) / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", FULL_DISK=disk, FULL_DISK_WORKDIR=str(workdir))
    failed = subprocess.run([sys.executable, "-c", FULL_DISK_MAIN, f"--config={TINY}", f"--config.workdir={workdir}",
                             "--steps=1", "--config.logging.progress=False", "--config.logging.tensorboard=True",
                             "--config.logging.plots=True"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert failed.returncode == 4 and len(errors) == 1, failed.stderr[-5000:]
    checkpoints = workdir / "checkpoints"
    assert re.fullmatch(rf"error: checkpoint step 1 could not be saved to {re.escape(str(checkpoints))}: No space "
                        rf"left on device \[ENOSPC\]( \({re.escape(str(checkpoints))}/1\.orbax-checkpoint-tmp/\S+\))?; "
                        r"there is no complete checkpoint yet: a rerun starts the run over", errors[0]), errors[0]
    for noise in ("Traceback", "Task exception was never retrieved", "Exception in thread", "Exception ignored"):
        assert noise not in failed.stderr, failed.stderr[-5000:]
    assert latest_complete_step(checkpoints) is None and not (workdir / "lock.json").exists()


def test_a_tensorboard_write_failure_raises_in_the_caller(tmp_path, monkeypatch):
    """A TensorBoard events write that fails (a full disk) is an OSError from ``Reporter.log``, which the trainer
    turns into a failed save's error where there is one. Was: tensorboardX's worker thread died of it (a traceback
    on stderr), and the next record's scalars filled its queue: ``log`` blocked for good."""
    import threading

    from tensorboardX import record_writer

    from fp8rl_jax.reporting import Reporter

    reporter = Reporter(tmp_path, tensorboard=True, progress=False)
    reporter.log({"step": 1, "loss": 0.5})

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(record_writer.os, "fsync", full)  # every flush of the events file fails from here on
    thread_errors, outcome = [], []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)

    def log_two_steps():
        try:
            for step in (2, 3):
                reporter.log({"step": step, **{f"metric_{i}": float(i) for i in range(20)}})
        except OSError as e:
            outcome.append(e)

    logging_thread = threading.Thread(target=log_two_steps, daemon=True)
    logging_thread.start()
    logging_thread.join(30)
    assert not logging_thread.is_alive(), "Reporter.log blocked"
    assert [e.errno for e in outcome] == [errno.ENOSPC] and thread_errors == []
    with pytest.raises(OSError):
        reporter.close()
    reporter.close()  # once: a second close does nothing


# ----------------------------------------------------------------------------------------------------------
# 5. start-up validation against the model


def test_prompt_plus_new_tokens_must_fit_the_preset_model(tmp_path):
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens=16 \+ config.rollout.max_new_tokens=100000 "
                                          r"= 100016.*512"):
        Trainer(_config(tmp_path / "run", **{"rollout.max_new_tokens": 100000}))


def test_prompt_plus_new_tokens_must_fit_a_loaded_model(tmp_path):
    """The embedded SmolLM2 GGUF (8192 positions): the limit is read from the file, checked before compiling."""
    config = load_config_file(os.path.join(REPO, "configs", "smollm2_gsm8k.py"))
    config.update_from_flattened_dict({"workdir": str(tmp_path), "rollout.max_new_tokens": 8000,
                                       "logging.progress": False})
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=8000 = 8256.*8192"):
        Trainer(config)


# ----------------------------------------------------------------------------------------------------------
# 8. list keys and overrides: one parser, ConfigDict's own dotted update


def test_from_file_refuses_an_unknown_override():
    with pytest.raises(ConfigError, match="rl.kl_coeff"):
        Trainer.from_file(TINY, **{"rl.kl_coeff": 0.1})


@pytest.mark.parametrize(
    "value, kind, expected",
    [
        (("gsm8k_answer", "gsm8k_format"), str, ("gsm8k_answer", "gsm8k_format")),  # a config file
        (("gsm8k_answer,gsm8k_format",), str, ("gsm8k_answer", "gsm8k_format")),  # --config.reward.fns=a,b
        (("",), str, ()),  # --config.precision.bf16_linears=
        ((1, 0.5), float, (1.0, 0.5)),  # --config.reward.weights=1,0.5
        (("1.0, 0.1",), float, (1.0, 0.1)),
        ((11, 28), int, (11, 28)),
        ("11, 28,", int, (11, 28)),  # an old-style string
    ],
)
def test_config_list_accepts_what_files_and_the_command_line_give(value, kind, expected):
    got = config_list(value, kind)
    assert got == expected and all(type(x) is kind for x in got)


@pytest.mark.parametrize("value, kind", [(("w_down", 3), str), ((1.5,), int), (("x",), float), ((True,), int)])
def test_config_list_refuses_wrong_items(value, kind):
    with pytest.raises(ValueError):
        config_list(value, kind)
