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

Host reads. With several processes an array sharded over the mesh is not readable by any one host
(``jax.device_get`` refuses it); ``host_get`` gathers such arrays first (one jitted identity with replicated
outputs, run by every process at the same point of the program), so that every process reads the same values.

Host values onto the mesh. Every process computes the same host data (same seed, same data order, same
rollout), and ``place`` puts it onto a sharding that spans all processes: each process supplies its own
devices' part. Process-local ``jax.Array`` values go through NumPy first: with one device per process, JAX 0.10.2
``device_put`` of such an array builds a global array whose shards cannot be read (Orbax's save fails on it).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

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


def place(tree, shardings):
    """``jax.device_put(tree, shardings)`` where the value of each process-local leaf is the same on every
    process (see the module docstring). ``shardings``: one sharding, or a tree of them like ``tree``'s."""
    if not any(not s.is_fully_addressable for s in jax.tree.leaves(shardings)):
        return jax.device_put(tree, shardings)

    def one(x, sharding):
        if sharding.is_fully_addressable or not (isinstance(x, jax.Array) and x.is_fully_addressable):
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.device_put(np.asarray(x), sharding)

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)


def _needs_gather(x) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated


def _gather(*arrays):
    return arrays


@functools.lru_cache(maxsize=64)
def _gatherer(shardings: tuple):
    return jax.jit(_gather, out_shardings=shardings)


def host_get(tree):
    """``jax.device_get(tree)`` that also reads arrays sharded over other processes' devices.

    Those are gathered to every device first, in one jitted call that every process must make (collective); the
    rest are read as they are. In a single process it is ``jax.device_get``."""
    leaves, treedef = jax.tree.flatten(tree)
    named = [i for i, x in enumerate(leaves) if _needs_gather(x) and isinstance(x.sharding, NamedSharding)]
    if named:  # one call for all of them
        shardings = tuple(NamedSharding(leaves[i].sharding.mesh, PartitionSpec()) for i in named)
        gathered = _gatherer(shardings)(*(leaves[i] for i in named))
        for i, g in zip(named, gathered, strict=True):
            leaves[i] = g
    for i, x in enumerate(leaves):
        if _needs_gather(x):  # another kind of sharding: JAX's own gather
            from jax.experimental import multihost_utils

            leaves[i] = multihost_utils.process_allgather(x, tiled=True)
    return jax.device_get(jax.tree.unflatten(treedef, leaves))
