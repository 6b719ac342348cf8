"""Orbax checkpoints for the RL trainer: one step = the train-state pytree + a JSON metadata dict.

Design note
-----------
What a step holds. ``train_state`` is any pytree of arrays: params, the optax state, the FP8 state (``scale`` /
``amax_history`` per role), KV scales, the RNG key and the step counter. ``metadata`` is a JSON-able dict: the
step, the data iterator's state (a JSON string), the config, free-form counters. Both go through one Orbax
``CheckpointManager`` as items of one ``Composite`` (``StandardSave`` for the tree, ``JsonSave`` for the
metadata and for the RNG-key note below), so they are committed together or not at all.

Atomicity (what Orbax does on disk). A save writes every item into ``<dir>/<step>.orbax-checkpoint-tmp``,
writes ``commit_success.txt`` into it last, then renames it to ``<dir>/<step>`` (on object stores without an
atomic rename Orbax requires the marker file instead). Steps are listed only from directories named by a bare
integer, so a save killed at any point leaves at most a ``<step>.orbax-checkpoint-tmp`` directory that
``latest_complete_step`` and ``restore`` never see. Leftover tmp directories are removed when a ``Checkpointer``
is created and when the same step is saved again, so keep to one writing process per directory.

RNG keys. New-style typed keys (``jax.random.key``) are stored as their ``uint32`` key data; the name of each
key's implementation is recorded in an internal JSON item, and ``restore`` re-wraps the data when ``like`` holds
a typed key at that place. Raw ``uint32`` keys (``jax.random.PRNGKey``) are ordinary arrays.

Sharded arrays. Orbax writes each ``jax.Array`` shard by shard (every process its own shards) and reads the
saved array back onto whatever sharding the restore target carries: ``like``'s leaves (``jax.Array`` or
``ShapeDtypeStruct`` with ``sharding``) decide the placement, not the mesh that saved. The trainer restores against
its state as laid out on the current mesh (``fp8rl_jax.parallel.rules``), so a run saved on ``fsdp=8`` resumes on
``fsdp=2, tensor=4`` (tests/parallel/test_sharded_trainer.py).

Async saves. ``save`` copies the arrays to host memory and returns; the write runs in a background thread.
``save`` waits for the previous save first, ``wait`` blocks until it is committed, ``close`` stops the threads.

A failed save (disk full, permission, quota) raises ``CheckpointSaveError`` from the call that learns of it: ``save``
of the next step (the previous save's failure, named by that step), ``wait`` or ``close``. Its one line names the
step, the folder, the OS error and the last complete step, from which a rerun resumes (the unfinished
``<step>.orbax-checkpoint-tmp`` is never read, and removed by the next ``Checkpointer`` there). Orbax logs the same
failure from each of its threads, with tracebacks, its writer's callbacks meet a closed event loop, and asyncio
reports each of its failed write tasks when they are collected ("Task exception was never retrieved"); those
duplicates are dropped (``_quiet_orbax_failures``), so the error is said once. ``failed_save`` lets another writer on
the same full disk (the trainer's plots and metrics) report the save's failure rather than its own.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any
log = logging.getLogger(__name__)

_TREE, _META, _KEYS = "train_state", "metadata", "prng_keys"  # Composite item names


def latest_complete_step(directory: str | os.PathLike) -> int | None:
    """The newest committed step in ``directory`` (None if there is none or the directory is missing).

    Reads the directory listing only, so it needs no ``CheckpointManager``: ``resume='auto'`` asks this first.
    Unfinished saves (``<step>.orbax-checkpoint-tmp``) are not steps.
    """
    steps = ocp.utils.checkpoint_steps(os.fspath(directory))
    return max(steps) if steps else None


def existing_checkpoint_folder(directory: str | os.PathLike) -> str:
    """``directory``, a folder of checkpoints to read (``--checkpoint`` of export and serve), checked before anything
    opens it: ``FileNotFoundError`` naming it where it is not an existing folder. A ``Checkpointer`` (Orbax's
    ``CheckpointManager``) creates its folder, so a mistyped path would otherwise be created, then found empty."""
    path = os.fspath(directory)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint folder {path} does not exist (expected a trainer's <workdir>/checkpoints)")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"checkpoint folder {path} is a file (expected a trainer's <workdir>/checkpoints)")
    return path


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written. ``step``: the step being saved (None if unknown); ``directory``: the
    checkpoints folder; ``cause``: the OS error (or the first line of the error) in one line; ``last_complete``:
    the newest committed step there (None: none), where a rerun of the same command resumes."""

    def __init__(self, step: int | None, directory: str, cause: str, last_complete: int | None):
        self.step, self.directory, self.cause, self.last_complete = step, directory, cause, last_complete
        what = f"checkpoint step {step}" if step is not None else "a checkpoint"
        resume = (f"the last complete checkpoint is step {last_complete}: fix the cause and rerun the same command "
                  "to resume from it" if last_complete is not None
                  else "there is no complete checkpoint yet: a rerun starts the run over")
        super().__init__(f"{what} could not be saved to {directory}: {cause}; {resume}")


def _errors(e: BaseException):
    """``e`` and the exceptions it was raised from or during, once each."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _cause(e: BaseException) -> str:
    """One line for a failed save: ``<OS error text> [ERRNO] (<file>)`` where an OS error is behind it (a Python
    OSError, or tensorstore's ``... [os_error_code='28']`` in a ValueError), else the error's first line."""
    for x in _errors(e):
        if isinstance(x, OSError) and x.errno:
            where = f" ({x.filename})" if x.filename else ""
            return f"{x.strerror or os.strerror(x.errno)} [{errno.errorcode.get(x.errno, x.errno)}]{where}"
    text = str(e)
    if m := re.search(r"os_error_code='(\d+)'", text):
        code = int(m.group(1))
        files = re.findall(r'"(/[^"]+)"', text)  # tensorstore quotes the files it names; the last is the one
        where = f" ({files[-1]})" if files else ""
        return f"{os.strerror(code)} [{errno.errorcode.get(code, code)}]{where}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    first = first if len(first) <= 300 else first[:297] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


_ORBAX_DIR = os.path.dirname(os.path.abspath(ocp.__file__)) + os.sep


class _OrbaxRaisedFilter(logging.Filter):
    """Drops Orbax's ERROR records that carry an exception: a failed save's exception is also raised to the caller
    (``wait``, ``save``, ``close``), where it becomes one ``CheckpointSaveError``; Orbax logs it from each thread
    it passes through, traceback and all."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info and record.pathname.startswith(_ORBAX_DIR))


_ORBAX_RAISED_FILTER = _OrbaxRaisedFilter()


def _orbax_frames(tb) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_ORBAX_DIR):
            return True
        tb = tb.tb_next
    return False


class _OrbaxTaskFilter(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" (and "Future ...", "_GatheringFuture ...") for Orbax's
    writes: a failed async save leaves one per array (tensorstore's ``RESOURCE_EXHAUSTED ... No space left on
    device``), logged with its traceback when the task is collected, after the failure was raised to the caller as
    one ``CheckpointSaveError``. Orbax's are the tasks of its coroutines, and the futures whose error names a file
    of an unfinished save."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).partition("\n")[0].endswith(" exception was never retrieved"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        ours = _ORBAX_DIR in str(record.msg) or (exc is not None and (
            _orbax_frames(exc.__traceback__) or ".orbax-checkpoint-tmp" in str(exc)))
        return not ours


_ORBAX_TASK_FILTER = _OrbaxTaskFilter()


def _make_unraisable_hook(previous):
    """A ``sys.unraisablehook`` that drops the noise of a failed async save and passes anything else to
    ``previous``: tensorstore's write callbacks reaching Orbax's event loop after the failure closed it
    ("Event loop is closed" in ``call_soon_threadsafe``), and Orbax's unfinished write coroutines collected at
    exit. It looks only at the exception and its frames: at exit, module globals may already be gone."""
    orbax_dir = _ORBAX_DIR

    def hook(unraisable):
        exc, obj = unraisable.exc_value, unraisable.object
        code = getattr(obj, "cr_code", None)
        if code is not None and code.co_filename.startswith(orbax_dir):
            return
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            tb, names = unraisable.exc_traceback, set()
            while tb is not None:
                names.add(tb.tb_frame.f_code.co_name)
                tb = tb.tb_next
            if "call_soon_threadsafe" in names:
                return
        previous(unraisable)

    hook.fp8rl_orbax_quiet = True
    return hook


def _quiet_orbax_failures() -> None:
    """Install the filters above (once; again if something replaced the hook since), and drop the warning that
    an abandoned write coroutine of a failed save was never awaited."""
    logging.getLogger("absl").addFilter(_ORBAX_RAISED_FILTER)  # Orbax logs through absl.logging
    logging.getLogger("asyncio").addFilter(_ORBAX_TASK_FILTER)
    warnings.filterwarnings("ignore", r"coroutine 'async_serialize_from_host\.<locals>\.write_fragment' was never "
                            "awaited", RuntimeWarning)
    if not getattr(sys.unraisablehook, "fp8rl_orbax_quiet", False):
        sys.unraisablehook = _make_unraisable_hook(sys.unraisablehook)


def _is_typed_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _restore_target(x: Any) -> Any:
    """Template leaf for Orbax: jax.Arrays become ShapeDtypeStructs on their sharding; typed keys their data."""
    if _is_typed_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        # A key's data has one trailing dim more; a NamedSharding spec leaves trailing dims replicated.
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x  # ShapeDtypeStruct, np.ndarray, Python scalar: Orbax restores into these as they are


def _path_name(path: tuple) -> str:
    """``('opt_state', 0, 'mu', 'w')`` style name of a key path, the same for a namedtuple and its on-disk dict."""
    parts = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return ".".join(str(p) for p in parts)


def _absent(like: PyTree, on_disk: PyTree | None, prefixes: tuple[str, ...]) -> list[str]:
    """The leaves of ``like`` under ``prefixes`` that the saved tree ``on_disk`` lacks (none where Orbax gave no
    metadata to compare with: the restore then checks, as ever)."""
    if on_disk is None or not prefixes:
        return []
    have = {_path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(on_disk)[0]}
    names = [_path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
    return sorted(n for n in names if n not in have and any(n == q or n.startswith(q + ".") for q in prefixes))


def _without(tree: PyTree, names: set[str], prefix: tuple = ()) -> PyTree:
    """``tree`` without the leaves named in ``names`` (``_path_name``) and the dicts they leave empty; the named
    leaves must sit in nested dicts."""
    if isinstance(tree, dict):
        kept = {k: _without(v, names, (*prefix, k)) for k, v in tree.items()}
        kept = {k: v for k, v in kept.items() if v is not _DROPPED}
        return kept if kept or not tree else _DROPPED
    name = ".".join(str(p) for p in prefix)
    if name in names:
        return _DROPPED
    if any(n.startswith(name + ".") for n in names if name):
        raise TypeError(f"{name}: leaves to leave out must sit in nested dicts, not in a {type(tree).__name__}")
    return tree


_DROPPED = object()


def _mismatches(target: PyTree, on_disk: PyTree) -> list[str]:
    """Differences in structure and shape between a restore target and the saved tree's metadata."""
    want = {_path_name(p): np.shape(x) for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    have = {_path_name(p): getattr(m, "shape", None) for p, m in jax.tree_util.tree_flatten_with_path(on_disk)[0]}
    problems = [f"{k}: in `like`, not in the checkpoint" for k in want.keys() - have.keys()]
    problems += [f"{k}: in the checkpoint, not in `like`" for k in have.keys() - want.keys()]
    problems += [
        f"{k}: shape {have[k]} on disk, {want[k]} in `like`"
        for k in want.keys() & have.keys()
        if have[k] is not None and tuple(have[k]) != tuple(want[k])
    ]
    return sorted(problems)


class Checkpointer:
    """Saves and restores ``(train_state, metadata)`` per RL step under ``directory``.

    Args:
        directory: where step directories live (created if missing), e.g. ``<workdir>/checkpoints``.
        keep: how many newest steps to keep; older ones are deleted after a newer one is committed.
        async_save: write in a background thread (the trainer goes on with the next step meanwhile).
        save_every: ``save`` writes steps that are multiples of this; 0 = only when forced.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True, save_every: int = 0):
        if keep < 1:
            raise ValueError(f"checkpoint keep={keep}; must be >= 1")
        if save_every < 0:
            raise ValueError(f"checkpoint save_every={save_every}; must be >= 0 (0 = only forced saves)")
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # unfinished saves of a killed run
            create=True,
        )
        # Name each item's handler up front: a manager that has not saved yet (a resumed run) would otherwise meet
        # the items first on disk, warn that each "could not be restored" and return no metadata for them.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, handler, save, restore in (
            (_TREE, ocp.StandardCheckpointHandler, ocp.args.StandardSave, ocp.args.StandardRestore),
            (_META, ocp.JsonCheckpointHandler, ocp.args.JsonSave, ocp.args.JsonRestore),
            (_KEYS, ocp.JsonCheckpointHandler, ocp.args.JsonSave, ocp.args.JsonRestore),
        ):
            handler = handler()  # one instance per item, for its save and its restore
            registry.add(item, save, handler)
            registry.add(item, restore, handler)
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        self._pending: int | None = None  # the step of a started save not yet seen committed
        self._failure: CheckpointSaveError | None = None
        _quiet_orbax_failures()

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` without ``force`` would write."""
        return self.save_every > 0 and step % self.save_every == 0

    def save(self, step: int, train_state: PyTree, metadata: dict, *, force: bool = False) -> bool:
        """Starts saving ``step``; returns True if a save started.

        Skipped (False) when ``step`` is not a multiple of ``save_every`` and not ``force``, or when ``step`` is
        not newer than the latest saved step (e.g. a forced final save right after a periodic one).
        ``metadata`` must be JSON-able (tuples come back as lists); ``step`` is added to it. With
        ``async_save`` the write goes on in the background: call ``wait`` before reading the files.
        """
        if not (force or self.should_save(step)):
            return False
        self.wait()  # Orbax waits for the previous save anyway; a failure of it is reported as that step's
        latest = self.latest_step()
        if latest is not None and step <= latest:
            log.info("checkpoint: step %d not saved, %s already holds step %d", step, self.directory, latest)
            return False
        if metadata.get("step", step) != step:
            raise ValueError(f"checkpoint metadata['step']={metadata['step']} but saving step {step}")
        metadata = {**metadata, "step": step}
        try:
            json.dumps(metadata)
        except TypeError as e:
            raise TypeError(f"checkpoint metadata for step {step} is not JSON-able: {e}") from None
        leaves, treedef = jax.tree_util.tree_flatten_with_path(train_state)
        key_impls = {jax.tree_util.keystr(p): str(jax.random.key_impl(x)) for p, x in leaves if _is_typed_key(x)}
        arrays = [jax.random.key_data(x) if _is_typed_key(x) else x for _, x in leaves]
        args = ocp.args.Composite(
            **{
                _TREE: ocp.args.StandardSave(jax.tree.unflatten(treedef, arrays)),
                _META: ocp.args.JsonSave(metadata),
                _KEYS: ocp.args.JsonSave(key_impls),
            }
        )
        try:
            started = self._manager.save(step, args=args, force=True)
        except Exception as e:  # the synchronous part (a sync save, creating its folder) failed
            raise self._failed(step, e) from e
        if started:
            self._pending = step
            log.info("checkpoint: saving step %d to %s", step, self.directory)
        return bool(started)

    def _failed(self, step: int | None, e: BaseException) -> CheckpointSaveError:
        self._pending = None
        self._failure = CheckpointSaveError(step, self.directory, _cause(e), latest_complete_step(self.directory))
        return self._failure

    def latest_step(self) -> int | None:
        """The newest saved step, or None. A step whose async save is still running counts (``wait`` first to
        be sure it is on disk); a step left unfinished by an earlier, killed process does not."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Saved steps, ascending (in-flight async saves included, as in ``latest_step``)."""
        return sorted(self._manager.all_steps())

    def restore(self, step: int | None = None, *, like: PyTree, absent_ok: tuple[str, ...] = ()) -> tuple[PyTree, dict]:
        """Restores ``(train_state, metadata)`` of ``step`` (default: the latest).

        ``like`` gives the structure, shapes, dtypes and placement: a concrete tree (as built at start-up) or an
        abstract one (``jax.ShapeDtypeStruct`` with ``sharding``, e.g. from ``jax.eval_shape``). jax.Array leaves
        come back on ``like``'s shardings and in ``like``'s dtypes; typed-key leaves come back as typed keys.
        Waits for this process's pending saves first.

        ``absent_ok``: subtrees of dicts, named as the mismatch messages name them (``"fp8_state.lm_head"``), that a
        checkpoint written before they existed may lack: they keep ``like``'s (concrete) values, and the metadata's
        ``"absent"`` lists their leaves. Anything else missing is an error, as ever.
        """
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; steps there: {steps}")
        try:  # our own check first: clearer than Orbax's error and no noise from its cancelled reads
            on_disk = self._manager.item_metadata(step)[_TREE]
            on_disk = getattr(on_disk, "tree", on_disk)
        except Exception:  # metadata layout differs across Orbax versions; Orbax still checks
            on_disk = None
        if (absent := _absent(like, on_disk, absent_ok)):
            restored, meta = self.restore(step, like=_without(like, set(absent)))
            by_name = {_path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
            leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
            return jax.tree.unflatten(treedef, [by_name.get(_path_name(p), x) for p, x in leaves]), {**meta,
                                                                                                   "absent": absent}
        leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
        target = jax.tree.unflatten(treedef, [_restore_target(x) for _, x in leaves])
        args = ocp.args.Composite(
            **{_TREE: ocp.args.StandardRestore(target), _META: ocp.args.JsonRestore(), _KEYS: ocp.args.JsonRestore()}
        )
        step_dir = os.path.join(self.directory, str(step))
        if on_disk is not None and (problems := _mismatches(target, on_disk)):
            shown = "\n  ".join(problems[:10]) + (f"\n  ... {len(problems) - 10} more" if len(problems) > 10 else "")
            raise ValueError(f"checkpoint {step_dir} does not match the `like` tree:\n  {shown}")
        try:
            restored = self._manager.restore(step, args=args)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"checkpoint {step_dir} does not match the `like` tree: {e}") from e
        key_impls = restored[_KEYS] or {}
        arrays = jax.tree.leaves(restored[_TREE])
        if len(arrays) != len(leaves):
            raise ValueError(f"checkpoint {step_dir} has {len(arrays)} arrays, the `like` tree {len(leaves)}")
        out = []
        for (path, x), a in zip(leaves, arrays, strict=True):
            if _is_typed_key(x):
                impl = key_impls.get(jax.tree_util.keystr(path))
                if impl is None:  # saved as raw key data
                    impl = str(jax.random.key_impl(x)) if isinstance(x, jax.Array) else jax.config.jax_default_prng_impl
                a = jax.random.wrap_key_data(a, impl=impl)
            elif isinstance(x, np.ndarray):
                a = np.asarray(a)
            out.append(a)
        return jax.tree.unflatten(treedef, out), dict(restored[_META])

    def wait(self) -> None:
        """Blocks until every started save is committed; ``CheckpointSaveError`` if one failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._failed(self._pending, e) from e
        self._pending = None

    def failed_save(self) -> CheckpointSaveError | None:
        """The failure of a save (waiting for the pending one first), or None: what a writer that failed meanwhile
        (plots, metrics on the same full disk, most likely) reports instead of its own error. Raises nothing."""
        if self._failure is None:
            try:
                self.wait()
            except CheckpointSaveError:
                pass
        return self._failure

    def close(self) -> None:
        """Waits for pending saves (``CheckpointSaveError`` if one failed, unless a failure was raised already),
        then stops Orbax's background threads."""
        try:
            self._manager.close()
        except Exception as e:
            if self._failure is None:
                raise self._failed(self._pending, e) from e

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
