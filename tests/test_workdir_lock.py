"""One run per workdir (``fp8rl_jax.workdir_lock``): a second holder is refused with the first one's host, pid and
start; a lock whose process died is taken over and said so; the trainer, evaluation and export keep to it."""

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fp8rl_jax.workdir_lock import LOCK_NAME, WorkdirLock, WorkdirLockedError, lock_for_output

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = socket.gethostname()


def _env() -> dict:
    # conftest's XLA flags for a subprocess (XLA:CPU's code generation at -O0, as for every test's programs; not its
    # 8 devices): the tiny config runs on one device
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ["FP8RL_TEST_CHILD_XLA_FLAGS"])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _wait_for_entry(path, child, timeout=120) -> dict:
    """The holder entry ``child`` writes into lock file ``path``, once it is there."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if child.poll() is not None:
            raise AssertionError(f"the holder exited ({child.returncode}) before taking {path}: "
                                 f"{child.stderr.read() if child.stderr else ''}")
        try:
            entry = json.loads(path.read_text())
            if entry.get("pid") == child.pid:
                return entry
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path} not written within {timeout} s")


def test_one_holder_in_this_process_until_released(tmp_path):
    workdir = tmp_path / "run"
    lock = WorkdirLock.acquire(workdir)
    entry = json.loads((workdir / LOCK_NAME).read_text())
    assert (entry["host"], entry["pid"]) == (HOST, os.getpid()) and entry["since"] and lock.took_over is None
    with pytest.raises(WorkdirLockedError) as err:
        WorkdirLock.acquire(workdir, alternative="another config.workdir")
    message = str(err.value)
    assert f"workdir {str(workdir)!r} is in use by this process (pid {os.getpid()}, since {entry['since']})" in message
    assert "close the Trainer that holds it first" in message and "another config.workdir" in message
    lock.release()
    lock.release()  # idempotent
    assert not (workdir / LOCK_NAME).exists()  # a clean release leaves nothing behind
    again = WorkdirLock.acquire(workdir)
    assert again.took_over is None  # nothing stale after a clean release
    again.release()


def test_a_live_process_holds_it_and_its_death_frees_it(tmp_path):
    workdir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from fp8rl_jax.workdir_lock import WorkdirLock; "
         "WorkdirLock.acquire(sys.argv[1]); time.sleep(600)", str(workdir)],
        env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        entry = _wait_for_entry(workdir / LOCK_NAME, holder)
        with pytest.raises(WorkdirLockedError) as err:
            WorkdirLock.acquire(workdir)
        message = str(err.value)
        assert f"is in use by host {HOST}, pid {holder.pid}, since {entry['since']} (" in message
        assert f"which holds {workdir / LOCK_NAME}" in message and f"delete {workdir / LOCK_NAME}" in message
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # no release, no atexit: the kernel drops its flock
        holder.wait()
    assert json.loads((workdir / LOCK_NAME).read_text())["pid"] == holder.pid  # its entry is still there
    lock = WorkdirLock.acquire(workdir)
    assert lock.took_over["pid"] == holder.pid
    assert lock.took_over_message() == (f"took over the stale lock {workdir / LOCK_NAME} of host {HOST}, pid "
                                        f"{holder.pid}, since {entry['since']} ({entry['command']}): pid {holder.pid} "
                                        "is not running")
    assert json.loads((workdir / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_entry_of_a_dead_pid_is_taken_over(tmp_path):
    dead = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": HOST, "pid": dead, "since": "2025-01-01 00:00:00"}))
    lock = WorkdirLock.acquire(tmp_path)
    assert lock.took_over["pid"] == dead
    assert f"pid {dead} is not running" in lock.took_over_message()
    lock.release()


def test_without_flock_the_entry_decides(tmp_path, monkeypatch):
    """A filesystem without flock: O_EXCL creation; an entry of a live pid or of another host is respected, one of
    a dead pid on this host is taken over."""
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock = WorkdirLock.acquire(tmp_path / "a")
    assert json.loads((tmp_path / "a" / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "a" / LOCK_NAME).exists()

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        for name, entry, expected in [
            ("live", {"host": HOST, "pid": sleeper.pid, "since": "t0"}, f"host {HOST}, pid {sleeper.pid}, since t0"),
            ("other_host", {"host": HOST + "-elsewhere", "pid": 1, "since": "t1"}, f"host {HOST}-elsewhere, pid 1"),
        ]:
            (tmp_path / name).mkdir()
            (tmp_path / name / LOCK_NAME).write_text(json.dumps(entry))
            with pytest.raises(WorkdirLockedError, match="this filesystem has no flock") as err:
                WorkdirLock.acquire(tmp_path / name)
            assert expected in str(err.value)
    finally:
        sleeper.kill()
        sleeper.wait()
    (tmp_path / "dead").mkdir()
    (tmp_path / "dead" / LOCK_NAME).write_text(json.dumps({"host": HOST, "pid": _dead_pid(), "since": "t2"}))
    lock = WorkdirLock.acquire(tmp_path / "dead")
    assert lock.took_over["since"] == "t2"
    lock.release()


def test_lock_for_output_only_inside_a_workdir(tmp_path):
    run = tmp_path / "run"
    assert lock_for_output(tmp_path / "elsewhere" / "out", [None, run], alternative="--out") is None
    lock = lock_for_output(run / "eval" / "x", [None, run], alternative="--out")
    assert lock is not None and (run / LOCK_NAME).exists()
    with pytest.raises(WorkdirLockedError, match="--out"):
        lock_for_output(run / "export", [run], alternative="--out")
    lock.release()


@pytest.mark.slow
def test_a_second_trainer_eval_and_export_are_refused_while_a_run_holds_the_workdir(tmp_path):
    """Real processes: the first trainer runs to the end with each step logged once; a second trainer, an
    evaluation writing its default results folder and an export into the workdir stop at start-up (exit 3)."""
    workdir = tmp_path / "run"
    tiny = ["--config=configs/tiny.py", f"--config.workdir={workdir}"]
    quiet = ["--config.logging.progress=False", "--config.logging.plots=False"]
    first = subprocess.Popen([sys.executable, "-m", "fp8rl_jax.main", *tiny, *quiet, "--steps=6",
                              "--config.checkpoint.every=2"], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        entry = _wait_for_entry(workdir / LOCK_NAME, first)
        others = {
            "trainer": ["-m", "fp8rl_jax.main", *tiny, *quiet, "--steps=6"],
            "eval": ["-m", "fp8rl_jax.eval", *tiny, "--num=2"],  # results into <workdir>/eval/init_fp8_e2e
            "export": ["-m", "fp8rl_jax.export", *tiny, f"--out={workdir / 'hf'}"],
        }
        procs = {name: subprocess.Popen([sys.executable, *args], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True) for name, args in others.items()}
        results = {name: (p.wait(timeout=300), *p.communicate()) for name, p in procs.items()}
        assert first.poll() is None, "the first run ended before the others were refused: the test proves nothing"
        for name, (code, out, err) in results.items():
            assert code == 3, f"{name}: exit {code}\n{out[-2000:]}\n{err[-2000:]}"
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"error: workdir {str(workdir)!r} is in use by host "
                                                           f"{HOST}, pid {first.pid}, since {entry['since']}"), err
            assert "Traceback" not in err
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err[-3000:]
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # each once: the refused trainer never rewrote the file
    assert not (workdir / "eval").exists() and not (workdir / "hf").exists()
    assert not (workdir / LOCK_NAME).exists()  # released at close


# The trainer's command line with every path under $READ_ONLY_DIR read-only (EROFS), as on a read-only mount:
# for a machine where mounting one is not allowed
READ_ONLY_MAIN = """
import errno, os
root = os.path.realpath(os.environ["READ_ONLY_DIR"])
real_open, real_mkdir = os.open, os.mkdir

def read_only(path):
    path = os.path.realpath(os.fspath(path))
    return path == root or path.startswith(root + os.sep)

def erofs(path):
    return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

def open_read_only(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND) and read_only(path):
        raise erofs(path)
    return real_open(path, flags, *args, **kwargs)

def mkdir_read_only(path, *args, **kwargs):
    if read_only(path):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path)) if os.path.exists(path) \\
            else erofs(path)
    return real_mkdir(path, *args, **kwargs)

os.open, os.mkdir = open_read_only, mkdir_read_only
from fp8rl_jax.main import run
run()
"""


@pytest.fixture(params=["mount", "injected"])
def read_only_dir(request, tmp_path):
    """A read-only folder: a read-only tmpfs mounted at ``tmp_path / "ro"`` (root; skipped where mounting is not
    allowed), or a plain folder the trainer's process sees as read-only (``READ_ONLY_MAIN``). Root writes into a
    folder without write permission, so chmod would not do. Yields the folder and the Python arguments to run."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if request.param == "injected":
        yield folder, ["-c", READ_ONLY_MAIN]
        return
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder, ["-m", "fp8rl_jax.main"]
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.parametrize("where", ["workdir", "parent"])
def test_a_read_only_workdir_is_one_error_line_and_exit_2(read_only_dir, where):
    """``config.workdir`` on a read-only filesystem (itself, or a new folder in a read-only one): the trainer
    cannot take its lock there, and says so in one line naming the path (a config problem: choose another
    workdir). Was: a 28-line traceback from the lock file's ``os.open`` (or the folder's ``mkdir``), exit 1."""
    folder, python_args = read_only_dir
    workdir = folder if where == "workdir" else folder / "run"
    env = dict(_env(), READ_ONLY_DIR=str(folder))
    result = subprocess.run([sys.executable, *python_args, "--config=configs/tiny.py", f"--config.workdir={workdir}",
                             "--steps=1", "--config.logging.progress=False"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: config.workdir={str(workdir)!r} cannot be written: Read-only file system "
                                f"[EROFS] ({workdir}"), errors[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not os.path.exists(workdir / LOCK_NAME)
