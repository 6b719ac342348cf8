"""The device mesh of a run: axes ``data``, ``fsdp``, ``tensor`` from ``config.mesh``; one mesh per program.

    data     pure data parallelism: params replicated, batch split
    fsdp     params and optimizer state sharded, all-gathered per layer in the forward; batch split too
    tensor   attention heads and MLP columns split (Megatron-style), vocabulary split in the embedding and head

``-1`` on one axis means "the devices the other two leave". The jitted RL-step functions and the rollout engine
trace and run inside ``mesh_context`` (``jax.set_mesh``), so ``with_sharding_constraint`` inside the model sees the
mesh; ``fp8.linear.mesh_context`` is that context for a precision's backend (with ``te`` it also names the axes for
Transformer Engine's primitives).

The rollout has a mesh of its own (``rollout_mesh``): over the trainer's devices, or with ``mesh.rollout_devices`` = k
over the first k devices, the trainer's mesh then over the rest (``split_devices``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")


def mesh_shape(sizes: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Resolve ``(data, fsdp, tensor)`` sizes against ``num_devices``: one ``-1`` takes the devices left over.

    The product must divide ``num_devices``; a mesh smaller than the device count runs on the first devices
    (one process only: ``make_mesh`` checks).
    """
    sizes = tuple(int(s) for s in sizes)
    named = ", ".join(f"mesh.{a}={s}" for a, s in zip(AXES, sizes, strict=True))
    if len(sizes) != len(AXES) or any(s < 1 and s != -1 for s in sizes):
        raise ValueError(f"config {named}: each axis must be a positive int or -1")
    if sizes.count(-1) > 1:
        raise ValueError(f"config {named}: at most one axis may be -1 (the remaining devices)")
    fixed = math.prod(s for s in sizes if s != -1)
    if num_devices % fixed:
        raise ValueError(f"config {named}: the fixed axes hold {fixed} devices, which does not divide the "
                         f"{num_devices} devices present")
    return tuple(num_devices // fixed if s == -1 else s for s in sizes)


def make_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of ``config.mesh`` (``data``, ``fsdp``, ``tensor``; -1 = the rest) over ``devices``
    (default ``jax.devices()``: every device of every process).

    Axes are ``AxisType.Auto``: shardings are propagated by the XLA partitioner (GSPMD / Shardy) from the jit
    in/out shardings and the constraints inside, and ``jnp`` code stays oblivious of the mesh.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape((mesh_config.data, mesh_config.fsdp, mesh_config.tensor), len(devices))
    used = math.prod(shape)
    if used < len(devices) and jax.process_count() > 1:
        raise ValueError(f"config.mesh {dict(zip(AXES, shape, strict=True))} uses {used} of the {len(devices)} "
                         "devices; with several processes the mesh must span all of them (mesh.fsdp=-1: FSDP over all)")
    devices = devices[:used]
    try:  # topology-aware order (NVLink islands, TPU torus) where JAX knows the hardware
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def split_devices(rollout_devices: int, devices: Sequence[jax.Device] | None = None
                  ) -> tuple[list[jax.Device], list[jax.Device] | None]:
    """``(train_devices, rollout_devices)`` of ``config.mesh.rollout_devices`` = k over ``devices`` (default
    ``jax.devices()``): k = 0, the rollout on the trainer's devices (``(devices, None)``); k > 0, the first k devices
    run the rollout alone and the rest train. One process only: the weights cross from one group to the other with
    ``jax.device_put`` (``rollout.refit``), which multi-controller JAX does not do between disjoint device sets."""
    devices = list(jax.devices() if devices is None else devices)
    k = rollout_devices
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"config mesh.rollout_devices={k!r} must be an int >= 0 (0: the rollout on the trainer's "
                         "devices)")
    if k == 0:
        return devices, None
    if jax.process_count() > 1:
        raise ValueError(f"config mesh.rollout_devices={k} needs one process; this run has {jax.process_count()} "
                         "(0: the rollout on the trainer's devices)")
    if k >= len(devices):
        raise ValueError(f"config mesh.rollout_devices={k} leaves no device for training: {len(devices)} devices "
                         "present")
    return devices[k:], devices[:k]


def rollout_mesh(mesh: Mesh | Sequence[jax.Device], tensor_parallel: int = 1) -> Mesh:
    """The rollout's mesh over the devices of ``mesh`` (the trainer's, colocated) or over a list of devices of its
    own (``mesh.rollout_devices``): axes ``data``, ``fsdp``, ``tensor`` of sizes (devices / ``tensor_parallel``, 1,
    ``tensor_parallel``), in the given device order.

    Each ``data`` index is a replica group of ``tensor_parallel`` consecutive devices holding the whole rollout
    model, split only over its ``tensor`` axis; the decode batch and its KV cache split over ``data``. The
    sharding rules (``parallel.rules``) then read as they do for training, with ``fsdp`` of size 1: the weights
    are replicated over the groups, so a decode step gathers no weight. The device order is the trainer mesh's
    (flattened), which one jitted program with inputs on one mesh and outputs on the other needs, and which makes
    a rollout tensor group of the trainer's ``tensor`` size the trainer's own tensor group (the innermost axis).
    """
    devices = np.asarray(mesh.devices if isinstance(mesh, Mesh) else list(mesh), dtype=object).reshape(-1)
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1 or devices.size % tensor_parallel:
        raise ValueError(f"config rollout.tensor_parallel={tensor_parallel!r} must be a positive int dividing the "
                         f"{devices.size} devices of the {'mesh' if isinstance(mesh, Mesh) else 'rollout'}")
    devices = devices.reshape(devices.size // tensor_parallel, 1, tensor_parallel)
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None) -> Iterator[None]:
    """Trace and run under ``mesh`` (``jax.set_mesh``); nothing when ``mesh`` is None. The programs of an FP8
    backend run under ``fp8.linear.mesh_context``, which adds what that backend needs (TE's mesh axes)."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def peak_memory_gib(devices: Sequence[jax.Device] | None = None) -> float | None:
    """The largest ``peak_bytes_in_use`` over this process's devices, in GiB; None where the backend keeps no
    allocator statistics (CPU).

    XLA never resets the counter: the value read after a phase is the high-water mark of everything so far, and
    the phase where it first jumps is the one that set it.
    """
    peaks = []
    for d in devices if devices is not None else jax.local_devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) / 2**30 if peaks else None
