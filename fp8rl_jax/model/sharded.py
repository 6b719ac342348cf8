"""The model read or created directly on the mesh.

Random init never exists whole on one device: ``jax.eval_shape`` gives the params' shapes, the rules give their
shardings (``parallel.rules``), and the init runs jitted with those ``out_shardings``, so each device computes only
its shard (the threefry RNG is partitionable, so the values are the ones an unsharded init draws).

Hugging Face weights (a folder of safetensors, one file or an index) are read straight onto their shards
(``load_hf_sharded``): each device gets only the slice of each tensor that its shard covers, one layer at a time,
so the host never holds the model, nor one whole parameter of it beyond a single layer's slices. GGUF files (the
135M SmolLM2 demo model, quantized and small) are still read whole on the host and ``jax.device_put`` onto their
shardings.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.model import llama, weights
from fp8rl_jax.model.loading import ModelSpec, load_model, load_tokenizer
from fp8rl_jax.parallel import rules


def load_model_sharded(spec: ModelSpec, mesh: Mesh):
    """``loading.load_model`` with the params placed by the rules on ``mesh``:
    ``(architecture, params, tokenizer)``."""
    source = spec.source
    if source not in ("preset", "smollm2") and not source.endswith(".gguf") and os.path.isdir(source):
        arch, params = load_hf_sharded(source, mesh, dtype=spec.param_dtype)
        return arch, params, load_tokenizer(spec, source)
    if source != "preset":
        arch, params, tokenizer = load_model(spec)
        return arch, jax.device_put(params, rules.state_shardings(params, mesh)), tokenizer

    found = {}

    def init():
        # the architecture and tokenizer come out on the side (not arrays); only the params are traced
        arch, params, tokenizer = load_model(spec)
        found.update(arch=arch, tokenizer=tokenizer)
        return params

    shardings = rules.state_shardings(jax.eval_shape(init), mesh)
    params = jax.jit(init, out_shardings=shardings)()
    return found["arch"], params, found["tokenizer"]


def load_hf_sharded(folder, mesh: Mesh, dtype="float32") -> tuple[Any, dict]:
    """``weights.load_hf(folder, dtype)`` read straight onto ``mesh``: ``(architecture, params)``, every param in
    the rules' sharding (``rules.state_shardings`` of the params' ``jax.eval_shape``) and equal to what
    ``load_hf`` reads.

    Each addressable device gets only the slice of each tensor that its shard covers (``SlicedParam.read``: the
    safetensors files are memory-mapped and sliced, q/k/v and gate/up pieces are read from the tensors that the
    shard's columns cover, a transposed kernel is read as the transposed index range and the small piece
    transposed). A stacked [L, ...] param is built layer by layer into a buffer created on its sharding, so
    beyond the final device buffers at most one layer's slice for one device is on the host and one layer's
    shards on the devices at a time. A slice that several devices share (replication over ``data``, or the
    norms) is read once. Missing or misshapen tensors are named before anything is placed.

    Not ``jax.make_array_from_callback``: (JAX 0.10) it calls back for every addressable shard before it transfers
    any, so on a host whose 8 devices split a tensor the whole tensor sits on the host at once.
    """
    dtype = jnp.dtype(dtype)
    config, sliced = weights.hf_sliced_params(folder, dtype)
    shapes = jax.eval_shape(lambda key: llama.init_params(config, key, dtype=dtype), jax.random.PRNGKey(0))
    ours = jax.tree.map(lambda p: (p.shape, jnp.dtype(p.dtype)), sliced)
    if ours != jax.tree.map(lambda s: (s.shape, s.dtype), shapes):  # a bug here, not in the files
        raise AssertionError(f"the Hugging Face layout {ours} is not the model's {shapes}")
    shardings = rules.state_shardings(shapes, mesh)
    return config, jax.tree.map(_place, sliced, shardings)


def _place(param, sharding: NamedSharding) -> jax.Array:
    """One ``weights.SlicedParam`` read onto ``sharding``; a stacked one a layer at a time."""
    if not param.stacked:
        return _from_slices(param.shape, param.dtype, sharding, param.read)
    spec = tuple(sharding.spec)
    if spec and spec[0] is not None:
        raise ValueError(f"{sharding.spec}: the stacked-layer axis is never sharded (rules)")
    layer_sharding = NamedSharding(sharding.mesh, P(*spec[1:]))
    zeros, put = _stack_fns(param.shape, jnp.dtype(param.dtype), sharding)
    stack = zeros()
    for i in range(param.shape[0]):
        layer = _from_slices(param.layer_shape, param.dtype, layer_sharding, lambda index, i=i: param.read(index, i))
        stack = put(stack, layer, i)
        del layer
        stack.block_until_ready()  # the layer's host slices and device shards are freed before the next is read
    return stack


@functools.lru_cache(maxsize=64)
def _stack_fns(shape, dtype, sharding: NamedSharding):
    """Jitted ``zeros()`` on ``sharding`` and ``put(stack, layer, i)`` (the stack donated, updated in place), cached
    so that params of one shape (the two norms; every load after the first) share the compiled code."""
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    put = jax.jit(lambda stack, layer, i: jax.lax.dynamic_update_index_in_dim(stack, layer, i, 0),
                  out_shardings=sharding, donate_argnums=0)
    return zeros, put


def _from_slices(shape, dtype, sharding: NamedSharding, read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
    """A global array from ``read(index)`` of each addressable shard, one host slice alive at a time, each distinct
    slice read once however many devices hold it."""
    groups: dict[tuple, tuple[tuple[slice, ...], list]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))
        groups.setdefault(key, (index, []))[1].append(device)
    arrays = []
    for index, devices in groups.values():
        host = read(index)
        placed = [jax.device_put(host, d) for d in devices]
        jax.block_until_ready(placed)
        arrays += placed
        del host
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)
