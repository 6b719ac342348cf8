"""Run N processes of ``fp8rl_jax.main`` on this machine as one multi-host job (CPU collectives).

    python launch/local.py --num_processes=2 --devices_per_process=4 -- --config=configs/tiny.py --steps=2

Each process gets ``devices_per_process`` virtual CPU devices, so a 2 x 4 run exercises the same
multi-controller path (coordinator, one global mesh over 8 devices, collectives between processes) that a
cluster of GPU hosts runs. Output lines are prefixed with the process id; the launcher exits with the first
non-zero exit code, and stops the others when one fails.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"[{prefix}] {line}")
        sys.stdout.flush()


def launch(num_processes: int, devices_per_process: int, main_args: list[str], module: str = "fp8rl_jax.main",
           timeout: float | None = None) -> int:
    """Start the processes, stream their output, return the job's exit code (0 when all succeeded)."""
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for pid in range(num_processes):
        env = dict(os.environ)
        env.update({
            "FP8RL_COORDINATOR": address,
            "FP8RL_NUM_PROCESSES": str(num_processes),
            "FP8RL_PROCESS_ID": str(pid),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_process}",
            "PYTHONUNBUFFERED": "1",
        })
        p = subprocess.Popen([sys.executable, "-m", module, *main_args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=_pump, args=(p.stdout, f"p{pid}"), daemon=True).start()
        procs.append(p)
    code = 0
    try:
        for p in procs:
            rc = p.wait(timeout=timeout)
            if rc != 0 and code == 0:
                code = rc
                for other in procs:  # one process failing leaves the others waiting at a collective
                    if other.poll() is None:
                        other.terminate()
    except subprocess.TimeoutExpired:
        code = 124
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, main_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=4)
    parser.add_argument("--module", default="fp8rl_jax.main", help="python -m target run by every process")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
    args = parser.parse_args(own)
    if args.num_processes < 1 or args.devices_per_process < 1:
        parser.error("--num_processes and --devices_per_process must be >= 1")
    return launch(args.num_processes, args.devices_per_process, main_args, args.module, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
