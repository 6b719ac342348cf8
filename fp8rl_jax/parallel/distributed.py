"""Multi-host start-up: JAX's multi-controller runtime, initialised from flags or the cluster's environment.

Every host runs the same program (``python -m fp8rl_jax.main ...``); ``jax.distributed.initialize`` connects
them, after which ``jax.devices()`` lists every device of every host and one mesh spans them all. Where the
settings come from, first match wins:

1. explicit values (``--coordinator_address``, ``--num_processes``, ``--process_id`` of ``main``);
2. ``FP8RL_COORDINATOR``, ``FP8RL_NUM_PROCESSES`` and ``FP8RL_PROCESS_ID`` (``launch/local.py`` and the Kubernetes
   example set these; on an indexed Job the process id defaults to ``JOB_COMPLETION_INDEX``);
3. JAX's own cluster detection (SLURM, Open MPI, ...), when such an environment is present;
4. nothing: a single process, no initialisation.

Call it before anything touches a device (it must run before JAX starts its backends). Only process 0 writes
metrics, plots and logs (``is_primary``); Orbax writes checkpoints collectively from every process.
"""

from __future__ import annotations

import dataclasses
import os

import jax

ENV_COORDINATOR = "FP8RL_COORDINATOR"
ENV_NUM_PROCESSES = "FP8RL_NUM_PROCESSES"
ENV_PROCESS_ID = "FP8RL_PROCESS_ID"
K8S_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes on the pods of an indexed Job
_AUTO_DETECTED = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")  # environments jax.distributed recognises itself


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Where the coordinator is and who this process is; all None means "let JAX detect it"."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    source: str = "single"  # flags | env | auto | single


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def cluster_spec(coordinator_address: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None) -> ClusterSpec:
    """Resolve the multi-host settings (see the module docstring for the order)."""
    if coordinator_address or num_processes is not None or process_id is not None:
        spec = ClusterSpec(coordinator_address, num_processes, process_id, "flags")
    elif os.environ.get(ENV_COORDINATOR):
        pid = _int_env(ENV_PROCESS_ID)
        spec = ClusterSpec(os.environ[ENV_COORDINATOR], _int_env(ENV_NUM_PROCESSES),
                           pid if pid is not None else _int_env(K8S_INDEX), "env")
    elif any(v in os.environ for v in _AUTO_DETECTED):
        return ClusterSpec(source="auto")
    else:
        return ClusterSpec()
    missing = [name for name, v in (("coordinator address", spec.coordinator_address),
                                    ("number of processes", spec.num_processes),
                                    ("process id", spec.process_id)) if v is None]
    if missing:
        raise ValueError(f"multi-host settings from {spec.source} lack the {', '.join(missing)} "
                         f"(flags --coordinator_address/--num_processes/--process_id, or ${ENV_COORDINATOR}, "
                         f"${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID})")
    if spec.num_processes < 1 or not 0 <= spec.process_id < spec.num_processes:
        raise ValueError(f"process id {spec.process_id} is outside 0..{spec.num_processes - 1} "
                         f"(num_processes={spec.num_processes}, from {spec.source})")
    return spec


def initialize(spec: ClusterSpec) -> bool:
    """Connect this process to the others; True when running multi-process afterwards."""
    if spec.source == "single":
        return False
    if spec.source == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(spec.coordinator_address, spec.num_processes, spec.process_id)
    return jax.process_count() > 1


def is_primary() -> bool:
    """Process 0: the one that writes metrics, plots and messages."""
    return jax.process_index() == 0
