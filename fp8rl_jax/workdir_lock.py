"""One run per workdir: a lock file in the workdir that names its holder.

Two trainers started on one ``config.workdir`` would both run to the end: ``metrics.jsonl`` rewritten by each (steps
1, 2, 3, 1, 2, 3), the checkpoints whoever wrote last. So the trainer, and an evaluation or export that writes into
a workdir, first takes ``<workdir>/lock.json``; a second process is refused with an error that names the holder.

How. The file is opened and ``fcntl.flock``-ed (exclusive, without waiting), and stays open while the holder lives;
the holder writes its host, pid, start time and command into it, which is what a refused process reports. The
kernel drops a flock when its process dies, however it dies (SIGKILL, the OOM killer), so a lock left by a dead
run is free: the next run takes it over and says whose it was. A clean release (``release``: ``Trainer.close()``,
and at interpreter exit) deletes the file. On NFS, Linux implements flock with the server's byte-range locks, so
the lock holds across hosts too.

Filesystems without flock (``ENOLCK`` / ``EOPNOTSUPP``: some Lustre and FUSE mounts): the file is created with
``O_CREAT | O_EXCL`` instead, and an existing one is stale only when it names a pid of this host that is not
running; one left by another host is refused, and the message says to delete it once that process is gone.
(Two processes taking over one stale lock at the same instant can both succeed there; flock has no such gap.)

One holder per job: the processes of a multi-host job share the workdir, so only process 0 takes the lock
(``Trainer``), and the others learn from it whether it got it.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = "lock.json"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_held: dict[str, WorkdirLock] = {}  # lock files this process holds: POSIX locks (NFS) would let it take one twice


class WorkdirLockedError(RuntimeError):
    """Another live process (or an unclosed Trainer of this one) holds the workdir; the message names it."""


def _holder_entry() -> dict:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # python -m x.y: name the module, not its file
    if spec is not None and spec.name and sys.argv:
        command = shlex.join(["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])
    else:
        command = shlex.join(sys.argv) if sys.argv and sys.argv[0] else sys.executable
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": command if len(command) <= 300 else command[:297] + "..."}


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def describe(holder: dict | None) -> str:
    """``host H, pid P, since T (command)``; what is known of a holder that has not written its entry yet."""
    if not holder:
        return "a process that has not written its host and pid into the lock file yet"
    who = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {holder.get('since', '?')}"
    if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
        who = f"this process (pid {holder['pid']}, since {holder.get('since', '?')})"
    return f"{who} ({holder['command']})" if holder.get("command") else who


def _read(fd: int) -> dict | None:
    """The holder entry in the open lock file; None when it is empty or half written."""
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _read_settled(fd: int) -> dict | None:
    """``_read``, given a holder that has just flocked the file a moment to write its entry."""
    for _ in range(20):
        holder = _read(fd)
        if holder is not None:
            return holder
        time.sleep(0.05)
    return None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the open file ``fd`` (a releasing holder deletes the file it held)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


class WorkdirLock:
    """The lock of one workdir, held until ``release`` (or this process's exit).

    ``took_over``: the entry of an earlier holder whose lock was stale (its process gone), else None;
    ``took_over_message()`` says so in one line."""

    def __init__(self, path: Path, fd: int, holder: dict, took_over: dict | None):
        self.path, self._fd, self.holder, self.took_over = path, fd, holder, took_over

    @classmethod
    def acquire(cls, workdir: str | os.PathLike, *, alternative: str = "another workdir") -> WorkdirLock:
        """Take ``<workdir>/lock.json`` (creating ``workdir`` if missing), or raise ``WorkdirLockedError`` naming
        the holder and what to do; ``alternative`` is the other way out the message offers (``config.workdir``)."""
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / LOCK_NAME
        key = os.path.realpath(path)
        if key in _held:
            raise WorkdirLockedError(_locked_message(workdir, path, _held[key].holder, alternative))
        for _ in range(100):  # a holder releasing between our open and our flock deletes the file: open it anew
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(path, os.O_RDWR), False
                except FileNotFoundError:
                    continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_settled(fd)
                os.close(fd)
                raise WorkdirLockedError(_locked_message(workdir, path, holder, alternative)) from None
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    os.close(fd)
                    raise
                if created:  # O_EXCL made the file ours
                    return cls._hold(path, fd, took_over=None)
                os.close(fd)
                return cls._acquire_without_flock(workdir, path, alternative)
            if _same_file(fd, path):
                break
            os.close(fd)
        else:
            raise WorkdirLockedError(f"{path}: could not take the lock (the file kept changing); try again")
        return cls._hold(path, fd, took_over=_read(fd))  # an entry left in a free lock: its holder died

    @classmethod
    def _acquire_without_flock(cls, workdir: Path, path: Path, alternative: str) -> WorkdirLock:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            return cls._hold(path, fd, took_over=None)
        except FileExistsError:
            pass
        fd = os.open(path, os.O_RDWR)
        holder = _read_settled(fd)
        stale = (holder is not None and holder.get("host") == socket.gethostname()
                 and isinstance(holder.get("pid"), int) and not _pid_running(holder["pid"]))
        if not stale:
            os.close(fd)
            raise WorkdirLockedError(_locked_message(workdir, path, holder, alternative) + (
                " (this filesystem has no flock, so a lock of another host cannot be checked)"))
        return cls._hold(path, fd, took_over=holder)

    @classmethod
    def _hold(cls, path: Path, fd: int, took_over: dict | None) -> WorkdirLock:
        holder = _holder_entry()
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        lock = cls(path, fd, holder, took_over)
        _held[os.path.realpath(path)] = lock
        atexit.register(lock.release)  # a script that never closes its Trainer leaves no stale file behind
        return lock

    def took_over_message(self) -> str | None:
        if not self.took_over:
            return None
        pid, host = self.took_over.get("pid"), self.took_over.get("host")
        gone = f"pid {pid} is not running" if host == socket.gethostname() and isinstance(pid, int) and \
            not _pid_running(pid) else "no process holds it"
        return f"took over the stale lock {self.path} of {describe(self.took_over)}: {gone}"

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Delete the lock file and drop the lock; idempotent. A forked child never releases its parent's lock."""
        if self._fd is None or os.getpid() != self.holder["pid"]:
            return
        atexit.unregister(self.release)
        _held.pop(os.path.realpath(self.path), None)
        try:
            if _same_file(self._fd, self.path):  # deleted by hand and taken by another: not ours to delete
                os.unlink(self.path)
        except OSError:
            pass  # a read-only or vanished workdir: the kernel drops the flock below anyway
        finally:
            os.close(self._fd)
            self._fd = None


def _locked_message(workdir: Path, path: Path, holder: dict | None, alternative: str) -> str:
    if holder and holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
        todo = "close the Trainer that holds it first (trainer.close()), or use " + alternative
    else:
        todo = (f"wait for that run to finish or stop it, or use {alternative}; if that process is gone, "
                f"delete {path}")
    return f"workdir {str(workdir)!r} is in use by {describe(holder)}, which holds {path}: {todo}"


def lock_for_output(out: str | os.PathLike, workdirs, *, alternative: str) -> WorkdirLock | None:
    """For a tool writing ``out`` (evaluation results, an export): the lock of the first of ``workdirs`` that
    contains ``out``, taken as ``WorkdirLock.acquire`` does; None when ``out`` lies in none of them."""
    target = Path(os.path.realpath(out))
    for workdir in workdirs:
        if workdir and target.is_relative_to(os.path.realpath(workdir)):
            return WorkdirLock.acquire(workdir, alternative=alternative)
    return None
