"""How many sequences the rollout decodes at once: ``rollout.decode_slots``, given or sized to the device.

A decode slot is one sequence's room in the decode batch: its KV cache for every position it can reach
(``data.max_prompt_tokens + rollout.max_new_tokens``) in every layer, the prompt's own cache while its prefill waits
to be inserted, and the step's f32 logits and sampling temporaries. The decode step is bound by reading the weights
once for the whole batch, so a rollout of N sequences through fewer than N slots runs ceil(N / slots) waves of
the same weight reads (benchmarks/RESULTS.md, "The scaled demo").

``decode_slots = 0`` (automatic, the default) takes every sequence of the step into the batch, up to what the
device's memory holds for slots beside what stays there during the rollout: the train state (params, optimizer
moments, FP8 state) and the rollout's copy of the weights. The device's limit is its allocator's ``bytes_limit``
(XLA:GPU takes 75% of the card by default); a backend that keeps no allocator statistics (CPU) is taken to have
a quarter of the host's physical memory (the host holds everything else of the run too). Of what is left,
``HEADROOM`` goes to slots: the rest covers the decode programs' own workspace and the allocator's fragmentation.
``decode_slots > 0`` is used as given.

With ``mesh.rollout_devices`` the rollout runs on devices of its own: what stays there is the rollout's weights alone,
and the limit is read on those devices.

On a mesh the decode batch splits over the rollout's replica groups (``parallel.mesh.rollout_mesh``) and the KV
heads and vocabulary over each group's ``rollout.tensor_parallel`` devices: the per-device cost of a slot is divided
accordingly, and an automatic count is a multiple of the replica groups.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import jax
import numpy as np

from fp8rl_jax.model.config import LlamaConfig

HEADROOM = 0.9  # the share of the device memory left beside the held state that automatic slots may take
HOST_SHARE = 0.25  # without allocator statistics (CPU): the share of physical memory taken as the device's limit
LOGIT_COPIES = 4  # f32 [vocab] arrays a slot holds in a decode step: the logits and the sampler's temporaries


def tree_device_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays on the fullest device: each leaf's shard (``jax.Array`` or a
    ``jax.ShapeDtypeStruct`` with a sharding) or, unsharded, all of it."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = getattr(leaf, "shape", None)
        if shape is None:
            continue
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def slot_bytes(model: LlamaConfig, *, max_prompt_tokens: int, max_new_tokens: int, cache_dtype,
               tensor_parallel: int = 1) -> int:
    """Device bytes one decode slot takes on each device of its replica group (the module docstring says what)."""
    positions = 2 * max_prompt_tokens + max_new_tokens  # the slot's cache, and its prompt's cache before insertion
    kv = 2 * model.num_layers * model.num_kv_heads * model.head_dim * positions * np.dtype(cache_dtype).itemsize
    logits = LOGIT_COPIES * model.vocab_size * 4
    return -(-(kv + logits) // tensor_parallel)


def device_limit(devices: Sequence[jax.Device] | None = None) -> tuple[int, str]:
    """``(bytes, source)``: the memory one device may hold, the smallest over ``devices`` (default: this
    process's), and where that figure comes from, in words."""
    devices = list(devices if devices is not None else jax.local_devices())
    limits = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    if limits:
        return min(limits), f"the {devices[0].platform.upper()} allocator's limit"
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        physical = 16 * 2**30
    source = f"{HOST_SHARE:.0%} of the host's memory: {devices[0].platform} keeps no allocator limit"
    return int(HOST_SHARE * physical), source


def _size(n: float) -> str:
    """Bytes in words: ``1.5 GiB``, ``11.8 MiB``, ``96 KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.0f} KiB"


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """The decode slots of a rollout and how they were chosen (``plan_slots``)."""

    slots: int
    sequences: int  # the sequences one rollout decodes (an RL step's prompts x samples)
    automatic: bool  # rollout.decode_slots = 0
    slot_bytes: int  # device bytes of one slot (per device of its replica group)
    limit_bytes: int  # the device's memory limit
    held_bytes: int  # device bytes held during the rollout besides the slots (train state, rollout weights)
    limit_source: str = ""
    held_what: str = "train state and rollout weights"  # what ``held_bytes`` counts, in words

    @property
    def waves(self) -> int:
        """Rounds of ``slots`` sequences a rollout of ``sequences`` takes (continuous batching overlaps them)."""
        return -(-self.sequences // self.slots)

    def describe(self) -> str:
        """One line: the slots, how chosen, and the memory assumed."""
        gib = _size
        how = ("automatic (rollout.decode_slots=0)" if self.automatic else f"rollout.decode_slots={self.slots}")
        return (f"decode slots: {self.slots} for {self.sequences} sequences a step, {how}; a slot "
                f"{_size(self.slot_bytes)} of KV cache and logits, {gib(self.slots * self.slot_bytes)} "
                f"in all, "
                f"beside {gib(self.held_bytes)} of {self.held_what}, of {gib(self.limit_bytes)} "
                f"({self.limit_source})")

    def waves_message(self) -> str | None:
        """What a rollout of more sequences than slots costs and which key changes it; None when one wave runs."""
        if self.waves <= 1:
            return None
        if self.automatic:
            fix = ("device memory holds no more: lower rollout.max_new_tokens or data.max_prompt_tokens, store the KV "
                   "cache in FP8 (precision.kv_cache_dtype=float8_e4m3fn), or spread the run over more devices")
        else:
            fix = (f"rollout.decode_slots={self.sequences} (or 0, automatic: as many as memory holds) runs them in "
                   "one")
        return (f"rollout: {self.sequences} sequences a step through {self.slots} decode slots, {self.waves} waves of "
                f"the decode batch; {fix}")


def plan_slots(requested: int, sequences: int, *, slot_bytes: int, held_bytes: int, replicas: int = 1,
               limit: tuple[int, str] | None = None, held_what: str = SlotPlan.held_what) -> SlotPlan:
    """The decode slots for rollouts of ``sequences`` sequences: ``requested`` where > 0, else automatic (the
    module docstring): all ``sequences``, rounded up to a multiple of ``replicas``, or the most that fit
    ``HEADROOM`` of the device memory left beside ``held_bytes`` (``held_what``, in words), at least ``replicas``.
    ``limit``: ``device_limit()`` unless given."""
    if requested < 0 or sequences < 1 or replicas < 1:
        raise ValueError(f"plan_slots: requested={requested} must be >= 0, sequences={sequences} and "
                         f"replicas={replicas} positive")
    limit_bytes, source = limit if limit is not None else device_limit()
    slots = requested
    if not requested:
        fits = int(HEADROOM * max(limit_bytes - held_bytes, 0) // max(slot_bytes, 1)) * replicas
        want = -(-sequences // replicas) * replicas
        slots = max(replicas, min(want, fits // replicas * replicas))
    return SlotPlan(slots=slots, sequences=sequences, automatic=not requested, slot_bytes=slot_bytes,
                    limit_bytes=limit_bytes, held_bytes=held_bytes, limit_source=source, held_what=held_what)
