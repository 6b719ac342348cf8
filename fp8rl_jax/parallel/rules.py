"""Logical-axis sharding rules: where every array of the run lives on the ``(data, fsdp, tensor)`` mesh.

Each array dimension gets a *logical* name (``embed``, ``mlp``, ``batch``, ...); ``RULES`` maps logical names to
mesh axes (the ``logical_axis_rules`` convention of MaxText / flax). Our state is a dict pytree of plain arrays,
so a leaf's logical axes follow from its key path: its last dict key names the parameter. The same function
therefore places the params, the optimizer state (optax's moments mirror the params tree, so ``mu/blocks/wqkv``
shards like ``blocks/wqkv``), the rollout weights and anything else keyed like the params.

Parameters (trailing dims; the leading stacked-layer axis [L, ...] of ``blocks`` is never sharded, so the scan
over layers slices a local array):

    embed      [V, D]            vocab over tensor, D over fsdp
    lm_head    [D, V]            D over fsdp, vocab over tensor (a vocab-parallel head: logits split over tensor)
    wqkv       [D, (N+2K)H]      rows over fsdp, columns over tensor           (column-parallel)
    bqkv       [(N+2K)H]         over tensor, like wqkv's columns
    wo         [N H, D]          rows over tensor, columns over fsdp           (row-parallel: one all-reduce)
    w_gate_up  [D, 2F]           rows over fsdp, columns over tensor           (column-parallel)
    w_down     [F, D]            rows over tensor, columns over fsdp           (row-parallel)
    *_norm     [D]               replicated (a few KB; sharding them would buy nothing and cost a gather each)

The fused column axes. ``wqkv`` is ``[q | k | v]`` and ``w_gate_up`` is ``[gate | up]`` along their last axis, and
the model splits them right after the GEMM. Sharding that axis over ``tensor`` in contiguous blocks does not put
matching q/k/v heads (or matching gate/up columns) on one device: with tensor=2, device 0 holds q and device 1
holds k and v. This is still *correct* (the partitioner inserts the collective-permutes / all-to-alls that the
split and the following head-sharded attention need), it only costs activation traffic at the split. We keep it:
correct first, and the alternative that avoids it, a per-shard interleaved layout ([q_i | k_i | v_i] per tensor
shard), would change the parameter layout that the weight loaders, the FP8 state and the checkpoints share.
With ``tensor=1`` (the default, FSDP only) the question does not arise. The rollout, whose weights are a copy made
once per RL step, does take the interleaved layout (``rollout.weights.interleave_fused``): its compiled decode step
with a tensor axis of 2 has no collective at the split (``tests/parallel/test_sharded_rollout.py``).

Not sharded: FP8 state (``scale`` / ``amax_history`` per role: every device must quantize with the same scales),
KV scales, the RNG key, the step counter, optimizer counters, ``QuantizedKernel.scale_inv``.

Rollout weights: a pre-quantized kernel is stored transposed (``QuantizedKernel.data`` [..., N, K]); it is sharded
like its master with the two trailing axes swapped, so quantizing a sharded master is a local operation. The rollout
places its weights by the same rules on its own mesh (``parallel.mesh.rollout_mesh``: the same devices and axis names,
``data`` = replica groups, ``fsdp`` = 1, ``tensor`` = ``rollout.tensor_parallel``): whole on every device of a
replica group, split over ``tensor`` only, the decode batch and KV cache split over the groups; the engine reshards
them once per RL step (``rollout.engine``), so a decode step gathers no weight. No rollout-specific rule is needed.

KV cache [L, B, K, S, H]: batch over data+fsdp, kv heads over tensor. Token batches: batch over data+fsdp.
Activations at block boundaries (the residual stream [B, T, D]): batch over data+fsdp, the rest replicated.

Divisibility: a dimension that its mesh axes do not divide stays replicated over the axes that do not fit
(``spec`` keeps the longest prefix of the rule's axes whose product divides it), e.g. the single sequence of a
prefill, or 2 kv heads on ``tensor=4``. jit refuses uneven shardings, and replication is always correct.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Logical = tuple[str | None, ...]

# logical axis -> mesh axes, in order (a dimension may be split over several mesh axes)
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "qkv": ("tensor",),
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "kv_heads": ("tensor",),
}

# logical axes of each parameter's trailing dims, by its name in the params tree
PARAM_AXES: dict[str, Logical] = {
    "embed": ("vocab", "embed"),
    "embed_bits": ("vocab", "embed"),  # the rollout's table as its bits (CPU, rollout.weights.per_layer)
    "lm_head": ("embed", "vocab"),
    "wqkv": ("embed", "qkv"),
    "bqkv": ("qkv",),
    "wo": ("heads", "embed"),
    "w_gate_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "attn_norm": (None,),
    "mlp_norm": (None,),
    "final_norm": (None,),
}

# subtrees that are replicated whatever their leaves are called (every device quantizes with the same scales)
REPLICATED = ("fp8_state", "kv_scales")

CACHE_AXES: Logical = (None, "batch", "kv_heads", None, None)  # [L, B, K, S, H]
LAYER_CACHE_AXES: Logical = CACHE_AXES[1:]  # one layer's [B, K, S, H] (the unrolled decode step's cache)
RESIDUAL_AXES: Logical = ("batch", None, None)  # [B, T, D]


def spec(logical: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int],
         rules: Mapping[str, Sequence[str]] = RULES) -> P:
    """The ``PartitionSpec`` of an array with these logical axes on a mesh of ``mesh_shape`` (name -> size).

    Mesh axes of size 1 are left out (they shard nothing), a mesh axis is used once per array (first come), and
    a dimension keeps the longest prefix of its mesh axes whose product divides it: what does not divide stays
    replicated.
    """
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    out: list[str | tuple[str, ...] | None] = []
    for name, dim in zip(logical, shape, strict=True):
        axes = [a for a in (rules.get(name, ()) if name else ()) if mesh_shape.get(a, 1) > 1 and a not in used]
        while axes and dim % math.prod(mesh_shape[a] for a in axes):
            axes.pop()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while out and out[-1] is None:  # P('fsdp') rather than P('fsdp', None): one spelling per placement
        out.pop()
    return P(*out)


def _names(path) -> list:
    """The key names along a pytree key path (dict keys, attribute names, sequence indices)."""
    return [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]


def leaf_axes(path, ndim: int) -> Logical:
    """Logical axes of one leaf of a params-like tree (params, optimizer state, train state, rollout weights)."""
    names = _names(path)
    replicated = (None,) * ndim
    if any(n in REPLICATED for n in names if isinstance(n, str)):
        return replicated
    last = names[-1] if names else None
    if last == "data" and len(names) >= 2 and names[-2] in PARAM_AXES:
        # QuantizedKernel.data: the master's [..., K, N] stored as [..., N, K]
        trailing = PARAM_AXES[names[-2]][::-1]
    elif isinstance(last, str) and last in PARAM_AXES:
        trailing = PARAM_AXES[last]
    else:  # scales, histories, counters, keys: small, replicated
        return replicated
    if ndim < len(trailing):
        return replicated
    return (None,) * (ndim - len(trailing)) + trailing  # leading axes (stacked layers) unsharded


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """A ``NamedSharding`` for every leaf of a params-like tree (concrete arrays or ``jax.ShapeDtypeStruct``)."""
    shape = dict(mesh.shape)

    def one(path, leaf):
        dims = getattr(leaf, "shape", ())
        return NamedSharding(mesh, spec(leaf_axes(path, len(dims)), dims, shape))

    return jax.tree_util.tree_map_with_path(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, shape: Sequence[int], batch_axis: int = 0) -> NamedSharding:
    """Token batches: ``batch_axis`` over data+fsdp (e.g. 1 for the train step's [microbatches, B, T] arrays)."""
    logical = [None] * len(shape)
    logical[batch_axis] = "batch"
    return NamedSharding(mesh, spec(logical, shape, dict(mesh.shape)))


def cache_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """The KV cache [L, B, K, S, H]: batch over data+fsdp, kv heads over tensor."""
    return NamedSharding(mesh, spec(CACHE_AXES, shape, dict(mesh.shape)))


def decode_state_shardings(state: Any, mesh: Mesh) -> Any:
    """The engine's decode state: the KV cache as ``cache_sharding`` (stacked [L, B, K, S, H] or one [B, K, S, H]
    per layer), every per-slot array over the batch."""

    def one(path, leaf):
        if "cache" in _names(path) and len(leaf.shape) == len(CACHE_AXES):
            return cache_sharding(mesh, leaf.shape)
        if "cache" in _names(path) and len(leaf.shape) == len(LAYER_CACHE_AXES):
            return NamedSharding(mesh, spec(LAYER_CACHE_AXES, leaf.shape, dict(mesh.shape)))
        return batch_sharding(mesh, leaf.shape) if leaf.shape else replicated(mesh)

    return jax.tree_util.tree_map_with_path(one, state)


def active_mesh():
    """The mesh set by ``jax.set_mesh`` (``parallel.mesh.mesh_context``) when it has our axes and several devices,
    else None: what code that partitions by hand (``jax.shard_map``) asks before it does."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or not any(a in mesh.axis_names for a in ("data", "fsdp", "tensor")):
        return None
    return mesh


def cache_local_specs(mesh, cache_shape: Sequence[int]) -> tuple[P, P, P]:
    """For a ``jax.shard_map`` over a KV cache's sequences and kv heads, the cache [L, B, K, S, H] or [B, K, S, H]
    split as ``cache_sharding`` splits it: (the cache's spec, the spec of a [B, K, ...] array, of a [B, ...] one)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    batch, heads = (*spec(LAYER_CACHE_AXES, cache_shape[-4:], sizes), None, None)[:2]
    return (P(batch, heads) if len(cache_shape) == 4 else P(None, batch, heads)), P(batch, heads), P(batch)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical axes when a mesh with our axes is active (``jax.set_mesh``,
    see ``parallel.mesh.mesh_context``); the identity otherwise, so unsharded callers are untouched."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(a in mesh.axis_names for a in ("data", "fsdp", "tensor")):
        return x
    return jax.lax.with_sharding_constraint(x, spec(logical, x.shape, dict(mesh.shape)))
