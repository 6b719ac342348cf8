"""Checkpointer: bit-exact round trips, keep-N, save_every, a save killed by SIGKILL, a failed save, helpful errors."""

import asyncio
import builtins
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8rl_jax.checkpoint import (
    Checkpointer,
    CheckpointSaveError,
    _cause,
    _make_unraisable_hook,
    latest_complete_step,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_state(seed: int):
    """A small train state: adamw over f32/bf16 params (stepped once, so the moments are nonzero), FP8 state."""
    rng = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
        "emb": jnp.asarray(rng.standard_normal((6, 4)), jnp.bfloat16),
    }
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    fp8_state = {
        role: {"scale": jnp.float32(rng.uniform(1, 100)), "amax_history": jnp.asarray(rng.uniform(size=16), "f4")}
        for role in ("x", "kernel", "grad")
    }
    return {
        "params": params,
        "opt_state": opt_state,
        "fp8_state": {"layer0": fp8_state},
        "kv_scales": jnp.asarray(rng.uniform(size=(2, 2)), jnp.float32),
        "rng": jax.random.PRNGKey(seed),  # raw uint32[2]
        "step": jnp.int32(seed),
    }


def metadata(step: int) -> dict:
    return {
        "step": step,
        "data_state": json.dumps({"epoch": 1, "index": 37 + step, "seed": [1, 2]}),
        "config": {"rl": {"clip": 0.2, "loss_agg": "token_mean"}, "steps": 100},
        "metrics_len": step * 3,
    }


def assert_bit_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        # compare the raw bits, so -0.0 / NaN payloads / bf16 rounding can't hide behind ==
        gb, wb = np.asarray(g), np.asarray(w)
        assert gb.tobytes() == wb.tobytes()


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip(tmp_path, async_save):
    state = make_state(3)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(state)}
    assert {"float32", "bfloat16", "uint32", "int32"} <= dtypes
    with Checkpointer(tmp_path / "ckpt", async_save=async_save) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(3, state, metadata(3), force=True)
        ckpt.wait()
        assert ckpt.latest_step() == 3 and ckpt.all_steps() == [3]
        # a concrete template of the same structure with different numbers
        restored, meta = ckpt.restore(like=make_state(9))
    assert_bit_equal(restored, state)
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
    assert meta == metadata(3)
    assert json.loads(meta["data_state"])["index"] == 40
    assert latest_complete_step(tmp_path / "ckpt") == 3


def test_restore_keeps_like_where_a_checkpoint_lacks_an_added_subtree(tmp_path):
    """``absent_ok``: a subtree added since the checkpoint was written keeps ``like``'s values, the rest is restored
    bit for bit and the metadata lists what was absent; a missing leaf elsewhere is still an error."""
    state = make_state(3)
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(3, state, metadata(3), force=True)
        like = make_state(9)
        like["fp8_state"]["head"] = {"x": {"scale": jnp.float32(7.0)}}
        restored, meta = ckpt.restore(like=like, absent_ok=("fp8_state.head",))
        assert meta["absent"] == ["fp8_state.head.x.scale"]
        assert float(restored["fp8_state"]["head"]["x"]["scale"]) == 7.0
        del restored["fp8_state"]["head"]
        assert_bit_equal(restored, state)
        like["fp8_state"]["other"] = {"scale": jnp.float32(1.0)}
        with pytest.raises(ValueError, match="fp8_state.other.scale: in `like`, not in the checkpoint"):
            ckpt.restore(like=like, absent_ok=("fp8_state.head",))


def test_restore_abstract_like_and_typed_key(tmp_path):
    state = make_state(1)
    state["rng"] = jax.random.split(jax.random.key(5, impl="rbg"), 3)  # typed key, non-default impl
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, {"note": "typed"}, force=True)
        like = jax.eval_shape(lambda: state)
        restored, meta = ckpt.restore(1, like=like)
    assert meta == {"note": "typed", "step": 1}
    assert jax.random.key_impl(restored["rng"]) == jax.random.key_impl(state["rng"])
    assert np.array_equal(jax.random.key_data(restored["rng"]), jax.random.key_data(state["rng"]))
    del restored["rng"], state["rng"]
    assert_bit_equal(restored, state)


def test_restore_onto_shardings(tmp_path):
    mesh = jax.make_mesh((4,), ("fsdp",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    state = {"w": jnp.arange(32, dtype=jnp.float32).reshape(8, 4)}
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, {}, force=True)
        like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharded)}
        restored, _ = ckpt.restore(like=like)
    assert restored["w"].sharding == sharded
    assert np.array_equal(restored["w"], state["w"])


def test_keep_n(tmp_path):
    state = make_state(0)
    with Checkpointer(tmp_path, keep=2, async_save=True) as ckpt:
        for step in range(1, 6):
            assert ckpt.save(step, state, metadata(step), force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5]
    assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [4, 5]


def test_save_every(tmp_path):
    state = make_state(0)
    with Checkpointer(tmp_path, keep=10, async_save=False, save_every=3) as ckpt:
        started = [step for step in range(1, 8) if ckpt.save(step, state, metadata(step))]
        assert started == [3, 6]
        assert ckpt.save(7, state, metadata(7), force=True)  # the trainer's final save
        assert not ckpt.save(7, state, metadata(7), force=True)  # already there: skipped, no error
        assert ckpt.all_steps() == [3, 6, 7]
    with Checkpointer(tmp_path / "only_forced", async_save=False) as ckpt:  # save_every=0
        assert not any(ckpt.save(step, state, metadata(step)) for step in range(1, 5))
        assert ckpt.save(4, state, metadata(4), force=True)


def test_close_stops_threads(tmp_path):
    before = set(threading.enumerate())
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, make_state(1), metadata(1), force=True)
    ckpt.close()
    time.sleep(0.2)
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []


def test_errors_name_the_directory(tmp_path):
    directory = tmp_path / "run7"
    with Checkpointer(directory, async_save=False) as ckpt:
        with pytest.raises(FileNotFoundError, match="run7"):
            ckpt.restore(like=make_state(0))
        ckpt.save(2, make_state(2), metadata(2), force=True)
        with pytest.raises(FileNotFoundError, match="run7.*steps there: \\[2\\]"):
            ckpt.restore(5, like=make_state(0))
        missing = make_state(0)
        del missing["kv_scales"]
        extra = make_state(0)
        extra["fp8_state"]["layer1"] = extra["fp8_state"]["layer0"]
        reshaped = make_state(0)
        reshaped["kv_scales"] = jnp.zeros((3, 2), jnp.float32)
        cases = [
            (missing, "kv_scales: in the checkpoint, not in `like`"),
            (extra, "fp8_state.layer1.grad.scale: in `like`, not in the checkpoint"),
            (reshaped, "kv_scales: shape (2, 2) on disk, (3, 2) in `like`"),
        ]
        for like, problem in cases:
            with pytest.raises(ValueError, match=f"checkpoint {directory}/2 does not match") as info:
                ckpt.restore(like=like)
            assert problem in str(info.value)
        with pytest.raises(TypeError, match="JSON"):
            ckpt.save(3, make_state(3), {"bad": object()}, force=True)
    assert latest_complete_step(tmp_path / "nowhere") is None


# The child saves step 1, then a big step 2 asynchronously, prints a marker and waits to be killed.
CHILD = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp
    import numpy as np
    sys.path.insert(0, {repo!r})
    from fp8rl_jax.checkpoint import Checkpointer
    from tests.test_checkpoint import make_state, metadata

    ckpt = Checkpointer({directory!r}, keep=3, async_save=True)
    ckpt.save(1, make_state(1), metadata(1), force=True)
    ckpt.wait()
    n = {megabytes} * 2**18  # uint32 words; pseudo-random so compression can't shrink the write
    big = (np.arange(n, dtype=np.uint64) * 0x9E3779B97F4A7C15 >> 32).astype(np.uint32)
    state = make_state(2)
    state["big"] = [jnp.asarray(chunk) for chunk in np.split(big, 8)]
    ckpt.save(2, state, metadata(2), force=True)
    print("SAVE2_STARTED", flush=True)
    ckpt.wait()
    print("SAVE2_DONE", flush=True)
    """
)


def _run_and_kill(directory, megabytes: int) -> bool:
    """Runs the child, SIGKILLs it while step 2 is being written. True if it died mid-save."""
    script = CHILD.format(repo=REPO_ROOT, directory=str(directory), megabytes=megabytes)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO_ROOT}
    stderr_path = f"{directory}.stderr"
    with open(stderr_path, "w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=REPO_ROOT, text=True
        )
    try:
        if child.stdout.readline().strip() != "SAVE2_STARTED":
            child.wait(timeout=10)
            with open(stderr_path) as f:
                pytest.fail("child failed before saving step 2:\n" + f.read()[-3000:])
        deadline = time.monotonic() + 5  # wait until step 2's tmp directory exists: bytes are being written
        while not (tmp_dirs := [d for d in os.listdir(directory) if d.startswith("2.") and "tmp" in d]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    finished = os.path.isdir(os.path.join(directory, "2"))
    return bool(tmp_dirs) and not finished


def test_sigkill_during_save_leaves_last_complete_step(tmp_path):
    killed_mid_save = False
    for attempt, megabytes in enumerate((256, 512, 768)):
        directory = tmp_path / f"try{attempt}"
        killed_mid_save = _run_and_kill(directory, megabytes)
        print(f"attempt {attempt} ({megabytes} MB): {'killed mid-save' if killed_mid_save else 'save finished first'}")
        if killed_mid_save:
            break
    assert killed_mid_save, "the child always finished step 2 before SIGKILL; the killed path was never exercised"
    left = sorted(os.listdir(directory))
    print("left on disk after SIGKILL:", left)
    assert any(d.startswith("2.") for d in left) and "2" not in left

    assert latest_complete_step(directory) == 1
    with Checkpointer(directory, keep=3, async_save=True) as ckpt:
        assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
        restored, meta = ckpt.restore(like=make_state(0))
        assert_bit_equal(restored, make_state(1))
        assert meta == metadata(1)
        assert ckpt.save(2, make_state(2), metadata(2), force=True)  # the leftover tmp dir must not block this
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
        restored, meta = ckpt.restore(like=make_state(0))
        assert_bit_equal(restored, make_state(2))
        assert meta["step"] == 2
    assert sorted(os.listdir(directory)) == ["1", "2"]


def test_restore_in_a_new_process_is_quiet_and_checks_shapes(tmp_path, caplog):
    """A fresh Checkpointer (a resumed run) restores without Orbax's "could not be restored" warnings for the items
    it restores, and still names a shape mismatch itself (Orbax knows the items' handlers before the first save)."""
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(2, make_state(2), metadata(2), force=True)
    caplog.set_level(logging.WARNING)
    reshaped = make_state(0)
    reshaped["kv_scales"] = jnp.zeros((3, 2), jnp.float32)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        with pytest.raises(ValueError, match=r"kv_scales: shape \(2, 2\) on disk, \(3, 2\) in `like`"):
            ckpt.restore(like=reshaped)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        restored, meta = ckpt.restore(like=make_state(0))
    assert_bit_equal(restored, make_state(2))
    assert meta == metadata(2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [w for w in warnings if "could not be restored" in w], warnings


# ----------------------------------------------------------------------------------------------------------
# a failed save (disk full, permission): one CheckpointSaveError naming the step, folder, cause and last complete step


def fail_writes_into(monkeypatch, step: int, code: int = errno.ENOSPC) -> None:
    """``OSError(code)`` from every file opened for writing inside step ``step``'s unfinished folder: the JSON items
    and metadata files Orbax writes from Python, in its background threads for async saves (tensorstore writes the
    arrays in C++, out of reach here: a real full disk fails those too, the same way)."""
    real_open = builtins.open
    marker = f"{os.sep}{step}.orbax-checkpoint-tmp{os.sep}"

    def failing_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and marker in os.fspath(file) and set(mode) & set("wax+"):
            raise OSError(code, os.strerror(code), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", failing_open)


def _wait_until_still(folder, quiet_s: float = 1.0, limit_s: float = 60.0) -> None:
    """Until the files under ``folder`` (names and sizes) stop changing for ``quiet_s``. A file or folder removed
    while it is walked (tensorstore's lock files come and go) is a change."""
    import time

    def listing():
        try:
            return sorted((str(p), p.stat().st_size) for p in folder.rglob("*") if p.is_file()) if folder.exists() \
                else []
        except FileNotFoundError:  # removed between the walk and its stat
            return None

    last, since, start = listing(), time.monotonic(), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() - start < limit_s:
        time.sleep(0.2)
        now = listing()
        if now != last:
            last, since = now, time.monotonic()


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_save_is_one_error_and_the_last_complete_step_restores(tmp_path, monkeypatch, caplog, async_save):
    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory, keep=5, async_save=async_save)
    ckpt.save(1, make_state(1), metadata(1), force=True)
    ckpt.wait()
    fail_writes_into(monkeypatch, 2)
    caplog.set_level(logging.WARNING)
    with pytest.raises(CheckpointSaveError) as err:
        ckpt.save(2, make_state(2), metadata(2), force=True)  # a sync save fails here
        ckpt.save(3, make_state(3), metadata(3), force=True)  # an async one here: named as step 2's failure
    e = err.value
    assert (e.step, e.directory, e.last_complete) == (2, str(directory), 1)
    assert re.fullmatch(rf"No space left on device \[ENOSPC\] \({re.escape(str(directory))}/2\.orbax-checkpoint-tmp/"
                        r"\S+\)", e.cause), e.cause
    assert str(e) == (f"checkpoint step 2 could not be saved to {directory}: {e.cause}; the last complete checkpoint "
                      "is step 1: fix the cause and rerun the same command to resume from it")
    # Orbax's own logs of the same exception (one per thread it crossed, with tracebacks) are dropped
    orbax_errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "orbax" in r.pathname]
    assert orbax_errors == [], [r.getMessage()[:200] for r in orbax_errors]
    ckpt.close()  # quiet: the failure was raised already
    monkeypatch.undo()
    # tensorstore's array writes of the failed save may still be landing in its temporary folder (they are C++
    # futures that Orbax does not cancel); a real rerun is a new process, where they are gone: wait for them here
    _wait_until_still(directory / "2.orbax-checkpoint-tmp")

    assert latest_complete_step(directory) == 1
    with Checkpointer(directory, keep=5, async_save=async_save) as again:  # the rerun
        restored, meta = again.restore(like=make_state(0))
        assert_bit_equal(restored, make_state(1))
        assert meta == metadata(1)
        assert again.save(2, make_state(2), metadata(2), force=True)
    assert latest_complete_step(directory) == 2
    assert sorted(os.listdir(directory)) == ["1", "2"]  # step 2's unfinished folder is gone


def test_failed_final_async_save_raises_at_close(tmp_path, monkeypatch, caplog):
    ckpt = Checkpointer(tmp_path, async_save=True)
    fail_writes_into(monkeypatch, 1, errno.EACCES)
    ckpt.save(1, make_state(1), metadata(1), force=True)
    with pytest.raises(CheckpointSaveError) as err:
        ckpt.close()
    assert err.value.step == 1 and err.value.last_complete is None
    assert err.value.cause.startswith("Permission denied [EACCES] (")
    assert str(err.value).endswith("there is no complete checkpoint yet: a rerun starts the run over")


def test_cause_of_a_tensorstore_write_error():
    """The ValueError tensorstore raises on a full disk (this text from a 2 MB tmpfs), in one line."""
    text = ('RESOURCE_EXHAUSTED: Error writing "a1/0" in OCDBT database at local file "/mnt/x/3.orbax-checkpoint-tmp/'
            'train_state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed writing: "/mnt/x/3.orbax-checkpoint-tmp/'
            'train_state.orbax-checkpoint-tmp/ocdbt.process_0/d/8ba5": Failed to write 75496 bytes to file 4: No '
            "space left on device [os_error_code='28']")
    assert _cause(ValueError(text)) == ("No space left on device [ENOSPC] (/mnt/x/3.orbax-checkpoint-tmp/"
                                        "train_state.orbax-checkpoint-tmp/ocdbt.process_0/d/8ba5)")
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded", "/q/f")
    assert _cause(wrapped) == "Disk quota exceeded [EDQUOT] (/q/f)"
    assert _cause(ValueError("first line\nsecond")) == "ValueError: first line"


def test_unraisable_noise_of_a_failed_save_is_dropped_and_the_rest_passes():
    seen = []
    hook = _make_unraisable_hook(seen.append)
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)  # what tensorstore's write callback meets after Orbax closed its loop
    except RuntimeError as e:
        closed = e
    hook(types.SimpleNamespace(exc_value=closed, exc_traceback=closed.__traceback__, object=None))
    other = RuntimeError("Event loop is closed")  # raised elsewhere: not the callback's
    hook(types.SimpleNamespace(exc_value=other, exc_traceback=None, object=None))
    unrelated = ValueError("x")
    hook(types.SimpleNamespace(exc_value=unrelated, exc_traceback=None, object=None))
    assert [u.exc_value for u in seen] == [other, unrelated]


def test_unretrieved_exceptions_of_orbax_writes_are_dropped_and_the_rest_pass():
    """asyncio's "... exception was never retrieved" for the tasks and futures of a failed async save (one per
    array, each with its traceback, after the one CheckpointSaveError) is dropped; any other passes."""
    from fp8rl_jax.checkpoint import _ORBAX_DIR, _OrbaxTaskFilter

    def record(msg, exc=None):
        return logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1771, msg, None,
                                 (type(exc), exc, None) if exc else None)

    full = ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file "/c/1.orbax-'
                      "checkpoint-tmp/train_state.orbax-checkpoint-tmp/ocdbt.process_0/\": No space left on device "
                      "[os_error_code='28']")
    dropped = [
        record("Task exception was never retrieved\nfuture: <Task finished name='Task-75' coro=<async_serialize_"
               f"from_host() done, defined at {_ORBAX_DIR}_src/serialization/serialization.py:126> exception="
               "ValueError('RESOURCE_EXHAUSTED')>", full),
        record("_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished "
               f"exception={full!r}>", full),
        record(f"Future exception was never retrieved\nfuture: <Future finished exception={full!r}>", full),
    ]
    passed = [
        record("Task exception was never retrieved\nfuture: <Task finished name='Task-1' coro=<mine() done, defined "
               "at /app/mine.py:3> exception=KeyError('x')>", KeyError("x")),
        record("Executing <Task pending name='Task-2'> took 0.2 seconds"),
    ]
    quiet = _OrbaxTaskFilter()
    assert [quiet.filter(r) for r in dropped + passed] == [False] * len(dropped) + [True] * len(passed)
