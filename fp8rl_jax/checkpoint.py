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
"""

from __future__ import annotations

import json
import logging
import os
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
        started = self._manager.save(step, args=args, force=True)
        if started:
            log.info("checkpoint: saving step %d to %s", step, self.directory)
        return bool(started)

    def latest_step(self) -> int | None:
        """The newest saved step, or None. A step whose async save is still running counts (``wait`` first to
        be sure it is on disk); a step left unfinished by an earlier, killed process does not."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Saved steps, ascending (in-flight async saves included, as in ``latest_step``)."""
        return sorted(self._manager.all_steps())

    def restore(self, step: int | None = None, *, like: PyTree) -> tuple[PyTree, dict]:
        """Restores ``(train_state, metadata)`` of ``step`` (default: the latest).

        ``like`` gives the structure, shapes, dtypes and placement: a concrete tree (as built at start-up) or an
        abstract one (``jax.ShapeDtypeStruct`` with ``sharding``, e.g. from ``jax.eval_shape``). jax.Array leaves
        come back on ``like``'s shardings and in ``like``'s dtypes; typed-key leaves come back as typed keys.
        Waits for this process's pending saves first.
        """
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; steps there: {steps}")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
        target = jax.tree.unflatten(treedef, [_restore_target(x) for _, x in leaves])
        args = ocp.args.Composite(
            **{_TREE: ocp.args.StandardRestore(target), _META: ocp.args.JsonRestore(), _KEYS: ocp.args.JsonRestore()}
        )
        step_dir = os.path.join(self.directory, str(step))
        try:  # our own check first: clearer than Orbax's error and no noise from its cancelled reads
            on_disk = self._manager.item_metadata(step)[_TREE]
        except Exception:  # metadata layout differs across Orbax versions; Orbax still checks
            on_disk = None
        if on_disk is not None and (problems := _mismatches(target, getattr(on_disk, "tree", on_disk))):
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
        """Blocks until every started save is committed (re-raises a failed background write)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, then stops Orbax's background threads."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
