"""Two processes on localhost: ``launch/local.py`` runs ``configs/tiny.py`` as one multi-controller job (one mesh
over both processes' CPU devices, Gloo collectives between them), checkpoints, resumes, and matches a single
process on a mesh of the same size; the launcher stops the job when one process fails.

The runs are shrunk by config overrides (4 prompts x 2 samples, 4 new tokens): most of their time is compiling.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from fp8rl_jax.checkpoint import latest_complete_step

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(REPO, "launch", "local.py")
PROCESSES, DEVICES_PER_PROCESS = 2, 2
SMALL = [
    "--config=configs/tiny.py", "--config.mesh.fsdp=-1",  # the mesh spans all 4 devices of both processes
    "--config.rollout.prompts_per_step=4", "--config.rollout.samples_per_prompt=2",
    "--config.rollout.max_new_tokens=4", "--config.rollout.decode_slots=8",
    "--config.logging.plots=False", "--config.logging.progress=False",
]
JOB_TIMEOUT = 400  # seconds; the launcher kills its processes after this (a hang fails the test, never stalls it)


def _env(devices: int | None = None, **extra) -> dict:
    """The processes' environment: conftest's XLA flags for a subprocess (XLA:CPU's code generation at -O0, as for
    every test's programs; not its 8 devices); each process gets its own count from the launcher, or ``devices``
    here."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    env["XLA_FLAGS"] = os.environ["FP8RL_TEST_CHILD_XLA_FLAGS"]
    if devices is not None:
        env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} --xla_force_host_platform_device_count={devices}".strip()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def _launch(*args, launcher=(), timeout=JOB_TIMEOUT, env=None):
    """``launch/local.py`` with ``launcher`` flags and ``args`` for each process: (result, seconds)."""
    cmd = [sys.executable, LAUNCHER, f"--num_processes={PROCESSES}",
           f"--devices_per_process={DEVICES_PER_PROCESS}", f"--timeout={timeout}", *launcher, "--", *args]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=timeout + 60)
    return result, time.monotonic() - start


def _records(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _failed(result) -> str:
    return f"exit {result.returncode}; last output:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """2 RL steps of the two-process job: (workdir, its output, its step records as written then)."""
    workdir = str(tmp_path_factory.mktemp("multiprocess") / "run")
    result, seconds = _launch(*SMALL, "--steps=2", f"--config.workdir={workdir}")
    assert result.returncode == 0, _failed(result)
    print(f"two processes x {DEVICES_PER_PROCESS} devices, 2 steps: {seconds:.0f} s")
    return workdir, result.stdout, _records(workdir)


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume(two_step_run):
    workdir, output, records = two_step_run
    assert latest_complete_step(os.path.join(workdir, "checkpoints")) == 2
    assert [r["step"] for r in records] == [1, 2]  # each step once: only process 0 writes
    # only process 0 prints (its lines are prefixed [p0]); process 1 says nothing of its own
    assert "[p0] precision: fp8_e2e" in output and "[p1] precision" not in output

    result, seconds = _launch(*SMALL, "--steps=3", f"--config.workdir={workdir}")
    assert result.returncode == 0, _failed(result)
    print(f"resume to step 3: {seconds:.0f} s")
    assert f"[p0] resumed from {os.path.join(workdir, 'checkpoints')} at step 2" in result.stdout
    assert "[p1] resumed" not in result.stdout
    assert latest_complete_step(os.path.join(workdir, "checkpoints")) == 3
    resumed = _records(workdir)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[:2] == records  # the first run's records are kept, not rewritten by either process
    with open(os.path.join(workdir, "run.json")) as f:
        assert [start["step"] for start in json.load(f)["starts"]] == [0, 2]


# the same sampled tokens (same seed, data order and rollout keys on every process) give identical rewards;
# losses and gradients differ only by the order of float reductions (Gloo's all-reduce vs one process's)
EXACT = ("reward_mean", "reward_std", "accuracy", "response_length_mean", "response_length_max", "stop_fraction")
TOLERANCE = dict(rel=1e-4, abs=1e-6)


def _compared(record: dict) -> dict:
    """The metrics that must agree: all but times, throughputs and the memory high-water marks."""
    return {k: v for k, v in record.items()
            if isinstance(v, float) and not k.startswith(("time/", "memory/")) and not k.endswith("_per_s")}


@pytest.mark.slow
def test_two_processes_match_one_process_on_as_many_devices(two_step_run, tmp_path):
    _, _, records = two_step_run
    workdir = str(tmp_path / "single")
    env = _env(devices=PROCESSES * DEVICES_PER_PROCESS)
    result = subprocess.run([sys.executable, "-m", "fp8rl_jax.main", *SMALL, "--steps=2",
                             f"--config.workdir={workdir}"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=JOB_TIMEOUT)
    assert result.returncode == 0, _failed(result)
    single = _records(workdir)
    assert [r["step"] for r in single] == [1, 2]
    for two, one in zip(records, single, strict=True):
        two, one = _compared(two), _compared(one)
        assert two.keys() == one.keys()
        assert {k: two[k] for k in EXACT} == {k: one[k] for k in EXACT}
        assert two == pytest.approx(one, **TOLERANCE)


# every process: place host values (the same on each) onto a mesh over both processes, read sharded arrays back
_PLACE_AND_READ = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from fp8rl_jax.parallel import distributed

assert distributed.initialize(distributed.cluster_spec())
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("fsdp"))
values = {"step": jnp.int32(7), "key": jax.random.PRNGKey(3), "typed": jax.random.key(3),
          "rows": jnp.arange(8.0), "host": np.arange(4)}
placed = distributed.place(values, replicated)
for name, x in placed.items():
    assert not x.sharding.is_fully_addressable, name
    x.addressable_shards[0].data.block_until_ready()  # what Orbax reads; broken for "step" by a plain device_put
rows = distributed.place(jnp.arange(8.0), split)
assert len(rows.addressable_shards) == 1 and rows.addressable_shards[0].data.shape == (4,)
got = distributed.host_get({"rows": rows * 2, "step": placed["step"], "key": placed["key"]})
np.testing.assert_array_equal(got["rows"], np.arange(8.0) * 2)
assert int(got["step"]) == 7 and np.array_equal(got["key"], jax.random.PRNGKey(3))
print("ok", jax.process_index())
"""


def test_place_and_host_get_across_two_processes_of_one_device_each(tmp_path):
    (tmp_path / "place_and_read.py").write_text(_PLACE_AND_READ)
    env = _env()
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    result, _ = _launch(launcher=["--module=place_and_read", "--devices_per_process=1"], timeout=120, env=env)
    assert result.returncode == 0, _failed(result)
    assert "[p0] ok 0" in result.stdout and "[p1] ok 1" in result.stdout


# a stand-in for fp8rl_jax.main: process 1 fails at once, process 0 would wait (as at a collective) for 10 minutes
_ONE_FAILS = """
import os, sys, time
with open(os.path.join(os.environ["PIDS_DIR"], os.environ["FP8RL_PROCESS_ID"]), "w") as f:
    f.write(str(os.getpid()))
if os.environ["FP8RL_PROCESS_ID"] == "1":
    sys.exit(3)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launcher_stops_the_job_when_one_process_fails(tmp_path):
    (tmp_path / "one_fails.py").write_text(_ONE_FAILS)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = _env(PIDS_DIR=str(pids))
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    result, seconds = _launch(launcher=["--module=one_fails"], timeout=120, env=env)
    assert result.returncode == 3, _failed(result)  # the failing process's exit code
    assert seconds < 60  # not the sleeping process's 10 minutes, nor the launcher's timeout
    waiting = int((pids / "0").read_text())
    assert not _alive(waiting)  # process 0 was stopped, not left behind


def test_launcher_times_out_with_124(tmp_path):
    (tmp_path / "sleeps.py").write_text("import time\ntime.sleep(600)\n")
    env = _env()
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    result, seconds = _launch(launcher=["--module=sleeps"], timeout=1, env=env)  # the job would sleep 600 s
    assert result.returncode == 124, _failed(result)
    assert seconds < 30


def test_bad_config_key_fails_the_job_fast(tmp_path):
    result, seconds = _launch("--config=configs/tiny.py", "--config.rollout.no_such_key=1",
                              f"--config.workdir={tmp_path / 'run'}", timeout=120)
    assert result.returncode != 0
    assert "unknown key 'no_such_key'" in result.stdout  # the processes' stderr comes through the launcher's stdout
    assert seconds < 90
    assert not (tmp_path / "run").exists()


def test_a_mesh_that_leaves_devices_out_is_refused_in_one_line(tmp_path):
    # tiny's own mesh (fsdp=1: one device) cannot hold a job of two processes
    result, _ = _launch("--config=configs/tiny.py", "--steps=1", f"--config.workdir={tmp_path / 'run'}", timeout=120)
    assert result.returncode == 2, _failed(result)
    assert "[p0] error: config.mesh {'data': 1, 'fsdp': 1, 'tensor': 1} uses 1 of the 4 devices" in result.stdout
    assert "mesh.fsdp=-1" in result.stdout and "Traceback" not in result.stdout


def test_gpu_platform_gives_each_process_its_own_block_of_gpus():
    """``--platform=gpu``: process i sees GPUs i*d .. i*d+d-1 (of CUDA_VISIBLE_DEVICES where set), on CUDA, with
    NVLink multicast off; too few GPUs is refused before anything starts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("local_launcher", LAUNCHER)
    local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(local)
    env = local.process_env({}, 1, 2, 2, "127.0.0.1:1234", "gpu")
    assert (env["CUDA_VISIBLE_DEVICES"], env["JAX_PLATFORMS"], env["NCCL_NVLS_ENABLE"]) == ("2,3", "cuda", "0")
    assert (env["FP8RL_PROCESS_ID"], env["FP8RL_NUM_PROCESSES"], env["FP8RL_COORDINATOR"]) == ("1", "2",
                                                                                             "127.0.0.1:1234")
    assert "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", "")
    env = local.process_env({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 1, 2, 2, "a:1", "gpu")
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    with pytest.raises(ValueError, match="names 2 GPU"):
        local.process_env({"CUDA_VISIBLE_DEVICES": "0,1"}, 0, 2, 2, "a:1", "gpu")
    result = subprocess.run([sys.executable, LAUNCHER, "--platform=gpu", "--num_processes=2",
                             "--devices_per_process=2", "--", "--steps=1"], cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"), timeout=60)
    assert result.returncode == 2 and "names 1 GPU(s)" in result.stderr
