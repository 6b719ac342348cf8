"""Run N processes of ``fp8rl_jax.main`` on this machine as one multi-host job.

    python launch/local.py --num_processes=2 --devices_per_process=2 -- --config=configs/tiny.py \
        --config.mesh.fsdp=-1 --steps=2 --config.workdir=/tmp/tiny_2proc
    python launch/local.py --platform=gpu --num_processes=2 --devices_per_process=2 -- ...   # 4 GPUs of one host

On CPU (the default) each process gets ``devices_per_process`` virtual CPU devices, so a 2 x 2 run exercises the
same multi-controller path (coordinator, one global mesh over 4 devices, Gloo collectives between processes) that
a cluster of GPU hosts runs. With ``--platform=gpu`` process ``i`` sees GPUs ``i*d .. i*d+d-1`` of this host
(``CUDA_VISIBLE_DEVICES``; d = ``devices_per_process``) and the processes talk over NCCL, as ``d``-GPU hosts of a
cluster would. The mesh must span all devices (``mesh.fsdp=-1``). Run from the repository root.
Output lines are prefixed with the process id; the launcher exits with the first non-zero exit code, and stops
the others as soon as one fails (they would wait at their next collective).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"[{prefix}] {line}")
        sys.stdout.flush()


def process_env(base: Mapping[str, str], pid: int, num_processes: int, devices_per_process: int, address: str,
                platform: str = "cpu") -> dict[str, str]:
    """Process ``pid``'s environment: the coordinator and its place in the job, and its devices (``platform``
    cpu: that many virtual CPU devices; gpu: its own block of this host's GPUs)."""
    env = dict(base)
    env.update({"FP8RL_COORDINATOR": address, "FP8RL_NUM_PROCESSES": str(num_processes),
                "FP8RL_PROCESS_ID": str(pid), "PYTHONUNBUFFERED": "1"})
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_process}"
        env.setdefault("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")  # JAX's default; named, since the job needs it
    elif platform == "gpu":
        visible = [d.strip() for d in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and len(visible) < num_processes * devices_per_process:
            raise ValueError(f"CUDA_VISIBLE_DEVICES={base['CUDA_VISIBLE_DEVICES']!r} names {len(visible)} GPU(s); "
                             f"{num_processes} processes x {devices_per_process} need "
                             f"{num_processes * devices_per_process}")
        ids = visible or [str(i) for i in range(num_processes * devices_per_process)]
        first = pid * devices_per_process
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[first:first + devices_per_process])
        env["JAX_PLATFORMS"] = "cuda"
        # NVLink multicast (NVLS) off unless asked for: it needs NVSwitch multicast that a host or VM may not give
        env.setdefault("NCCL_NVLS_ENABLE", "0")
    else:
        raise ValueError(f"platform={platform!r}; allowed: cpu, gpu")
    return env


def launch(num_processes: int, devices_per_process: int, main_args: list[str], module: str = "fp8rl_jax.main",
           timeout: float | None = None, platform: str = "cpu") -> int:
    """Start the processes, stream their output, return the job's exit code (0 when all succeeded)."""
    address = f"127.0.0.1:{free_port()}"
    procs, pumps = [], []
    for pid in range(num_processes):
        env = process_env(os.environ, pid, num_processes, devices_per_process, address, platform)
        p = subprocess.Popen([sys.executable, "-m", module, *main_args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        pump = threading.Thread(target=_pump, args=(p.stdout, f"p{pid}"), daemon=True)
        pump.start()
        procs.append(p)
        pumps.append(pump)
    code = _wait(procs, timeout)
    for t in pumps:  # the rest of their output
        t.join(timeout=5)
    return code


def _wait(procs: list[subprocess.Popen], timeout: float | None, grace: float = 10.0) -> int:
    """Wait for all; on the first failure stop the others (they would wait forever at their next collective):
    SIGTERM, then SIGKILL after ``grace`` seconds. 124 when ``timeout`` passes first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    try:
        while None in [p.poll() for p in procs]:  # a list: every process polled, each returncode set
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = _exit_code(failed[0])
                break
            if deadline is not None and time.monotonic() > deadline:
                code = 124
                break
            time.sleep(0.2)
        else:
            code = next((_exit_code(p.returncode) for p in procs if p.returncode != 0), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        stop = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(stop - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return code


def _exit_code(returncode: int) -> int:
    """A shell's exit code: 128 + N for a process killed by signal N (Popen reports -N)."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, main_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=4)
    parser.add_argument("--module", default="fp8rl_jax.main", help="python -m target run by every process")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: virtual CPU devices per process; gpu: a block of this host's GPUs per process")
    args = parser.parse_args(own)
    if args.num_processes < 1 or args.devices_per_process < 1:
        parser.error("--num_processes and --devices_per_process must be >= 1")
    # killed itself (a test's timeout, a scheduler): SystemExit unwinds through _wait, which stops the processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:  # the device assignment checked before any process starts
        process_env(os.environ, 0, args.num_processes, args.devices_per_process, "", args.platform)
    except ValueError as e:
        parser.error(str(e))
    return launch(args.num_processes, args.devices_per_process, main_args, args.module, args.timeout, args.platform)


if __name__ == "__main__":
    sys.exit(main())
