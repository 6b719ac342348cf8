"""The rollout's copy of the trainer's weights, made once per RL step (``Engine.load_params`` on a mesh).

The rollout has a layout of its own (``parallel.mesh.rollout_mesh``): replica groups of ``rollout.tensor_parallel``
devices that each hold the whole model, split only over the group. A refit quantizes the FP8 kernels where the
trainer's masters lie (each device its own shard: a local operation) and moves them to that layout as the bits of
their FP8 values (``weights.as_bits``: one byte a weight, also where the CPU stores the kernels as f32), BF16 tables
as their uint16 bits; with ``tensor_parallel`` > 1 the fused [q|k|v] and [gate|up] columns are laid out per tensor
shard (``weights.interleave_fused``). The FP8 state and KV scales arrive replicated on the rollout mesh.

Two placements, one result bit for bit (tests/parallel/test_split_devices.py):

- Colocated (``mesh.rollout_devices=0``): the rollout mesh spans the trainer's devices in the trainer's order, so
  the refit is ONE jitted program from the train mesh's shardings to the rollout's; sharding constraints pin the
  gather to the FP8 bytes, so XLA neither gathers the masters nor widens the bytes. New weights never leave the
  devices.
- Split (``mesh.rollout_devices`` = k: the rollout on k devices of its own, ``parallel.mesh.split_devices``): a
  program cannot span both groups, so three steps. (1) One jit on the train mesh quantizes, interleaves and writes
  the bits in the rollout's layout over the trainer's devices (``rollout_mesh`` of them: every shard the rollout
  needs then exists as a buffer; the bytes are replicated over the trainer's devices for as long as the refit
  runs). (2) ``jax.device_put`` to the rollout mesh: the one transfer between the groups, of FP8 bytes, device to
  device (each rollout buffer a copy of a train-side buffer of the same slice; where ``tensor_parallel`` does not
  divide the trainer's devices the bits go whole and step 3 slices them). (3) One jit on the rollout mesh turns the
  bits back into the rollout weights (``from_bits``, per-layer arrays), a local operation. ``Refit.last`` records
  what moved: bytes per dtype, against the same weights with BF16 kernels, and the seconds of the transfer.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from fp8rl_jax.fp8.linear import mesh_context
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import with_input_scale_inv
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.distributed import place
from fp8rl_jax.parallel.mesh import rollout_mesh
from fp8rl_jax.rollout.weights import as_bits, from_bits, interleave_fused, is_kernel, per_layer, rollout_params


def _nbytes(x) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def moved_bytes(bits, stacked, precision: Precision, extra=()) -> dict:
    """What a split refit moves, from shapes: ``{"bytes": {dtype: n}, "total_bytes": n, "bf16_equivalent_bytes":
    n}``. ``bits``: ``as_bits``' output (arrays or ``jax.ShapeDtypeStruct``), ``stacked``: ``rollout_params``' (the
    dtype each bit pattern stands for), ``extra``: more trees moved as they are (FP8 state, KV scales). An FP8
    kernel's bits count under its FP8 dtype, a BF16 table's under bfloat16; the BF16 equivalent counts every FP8
    kernel at two bytes a weight (the same refit with BF16 kernels; the scales kept, a few bytes)."""
    counts: dict[str, int] = {}
    kernel_weights = 0

    def add(name: str, n: int) -> None:
        counts[name] = counts.get(name, 0) + n

    leaves = zip(jax.tree.leaves(bits, is_leaf=is_kernel), jax.tree.leaves(stacked, is_leaf=is_kernel),
                 strict=True)
    for b, like in leaves:
        if is_kernel(b):
            add(np.dtype(precision.recipe.fwd_dtype).name, _nbytes(b.data))
            add(np.dtype(b.scale_inv.dtype).name, _nbytes(b.scale_inv))
            kernel_weights += int(np.prod(b.data.shape))
        else:
            add(np.dtype(like.dtype).name, _nbytes(b))
    for leaf in jax.tree.leaves(extra):
        add(np.dtype(leaf.dtype).name, _nbytes(leaf))
    total = sum(counts.values())
    return {"bytes": counts, "total_bytes": total, "bf16_equivalent_bytes": total + kernel_weights}


class Refit:
    """``refit(params, fp8_state, kv_scales) -> {"weights", "fp8_state", "kv_scales"}``: the rollout's copy of a
    policy, on the rollout mesh ``roll`` from the trainer's ``train`` mesh (the module docstring), or on one device
    (both None). ``per_layer``: the weights, the blocks' FP8 state and the KV scales as the unrolled decode step
    reads them, one tree per layer. Its programs are jitted at the first call (they need the params' tree)."""

    def __init__(self, model: LlamaConfig, precision: Precision, train: jax.sharding.Mesh | None,
                 roll: jax.sharding.Mesh | None, *, tensor_parallel: int, per_layer: bool):
        self.model, self.precision, self.train, self.roll = model, precision, train, roll
        self.tensor_parallel, self.per_layer = tensor_parallel, per_layer
        self.disjoint = train is not None and set(train.devices.flat) != set(roll.devices.flat)
        self.load = functools.partial(rollout_params, precision=precision, num_layers=model.num_layers)
        self.program = None  # the weights' one jitted program; across device groups the train mesh's (quantize)
        self.last: dict | None = None  # across device groups: what the last refit moved (moved_bytes), "seconds"
        self._scales = jax.jit(self._layer_scales)

    def __call__(self, params, fp8_state, kv_scales) -> dict:
        if self.train is None:  # one device
            if self.program is None:
                self.program = jax.jit(lambda p, s: self._layout(self.load(p, s)))
            weights = self.program(params, fp8_state)
        else:  # the rollout's layout; FP8 state and KV scales replicated on the rollout mesh
            weights, fp8_state, kv_scales = self._on_mesh(params, fp8_state, kv_scales)
        with mesh_context(self.roll, self.precision.backend):
            fp8_state, kv_scales = self._scales(fp8_state, kv_scales)
        return {"weights": weights, "fp8_state": fp8_state, "kv_scales": kv_scales}

    def _layer_scales(self, fp8_state, kv_scales):
        """With per-layer weights the blocks' FP8 state and the KV scales come per layer too (``llama.forward_hidden``):
        the unrolled layers are then identical computations, compiled once. The input scales' inverses are made here,
        once per RL step: the GEMMs read them, where computed in the step they were a one-thread kernel before every
        GEMM of every decode step (65 a step at llama1b shapes)."""
        if fp8_state and self.per_layer:
            fp8_state = {**fp8_state, "blocks": llama.split_layers(fp8_state["blocks"])}
        if kv_scales and self.per_layer:
            kv_scales = {n: tuple(a[i] for i in range(a.shape[0])) for n, a in kv_scales.items()}
        return fp8_state and with_input_scale_inv(fp8_state), kv_scales

    def _on_mesh(self, params, fp8_state, kv_scales):
        # no-ops for the trainer's params, FP8 state and KV scales, which live there already
        params = place(params, rules.state_shardings(params, self.train))
        fp8_state, kv_scales = place((fp8_state, kv_scales), rules.replicated(self.train))
        if self.program is None:
            self.program = (self._build_split if self.disjoint else self._colocated)(params, fp8_state, kv_scales)
        if self.disjoint:
            return self._transfer(params, fp8_state, kv_scales)
        with mesh_context(self.train, self.precision.backend):
            return self.program(params, fp8_state, kv_scales)

    def _layout(self, weights):
        return per_layer(weights) if self.per_layer else weights

    def _colocated(self, params, fp8_state, kv_scales):
        train, roll, precision, shards, load = self.train, self.roll, self.precision, self.tensor_parallel, self.load
        stacked = jax.eval_shape(load, params, fp8_state)
        bits = jax.eval_shape(functools.partial(as_bits, precision=precision), stacked)
        on_train, on_rollout = rules.state_shardings(bits, train), rules.state_shardings(bits, roll)

        def reshard(params, fp8_state, kv_scales):
            weights = load(params, fp8_state)
            if train.size > 1:
                # quantized where the masters lie (each device its own shard), then moved as FP8 bytes: the
                # constraints pin the gather between them, so XLA neither gathers the masters nor widens the bytes
                moved = jax.lax.with_sharding_constraint(as_bits(weights, precision), on_train)
                moved = jax.lax.with_sharding_constraint(interleave_fused(moved, self.model, shards), on_rollout)
                weights = from_bits(moved, stacked, precision)
            return self._layout(weights), fp8_state, kv_scales

        out = jax.eval_shape(reshard, params, fp8_state, kv_scales)[0]
        rep = rules.replicated(roll)
        return jax.jit(reshard, out_shardings=(rules.state_shardings(out, roll), rep, rep))

    def _build_split(self, params, fp8_state, kv_scales):
        train, roll, precision, shards, load = self.train, self.roll, self.precision, self.tensor_parallel, self.load
        stacked = jax.eval_shape(load, params, fp8_state)

        def quantize(params, fp8_state):
            return interleave_fused(as_bits(load(params, fp8_state), precision), self.model, shards)

        bits = jax.eval_shape(quantize, params, fp8_state)
        whole = train.size % shards != 0  # no rollout layout over the trainer's devices: the bits go whole
        staged = rules.replicated(train) if whole else rules.state_shardings(bits, rollout_mesh(train, shards))
        self._arrival = rules.replicated(roll) if whole else rules.state_shardings(bits, roll)

        def unpack(bits):
            return self._layout(from_bits(bits, stacked, precision))

        out = jax.eval_shape(unpack, bits)
        self._unpack = jax.jit(unpack, out_shardings=rules.state_shardings(out, roll))
        self.moved = moved_bytes(bits, stacked, precision, extra=(fp8_state, kv_scales))
        return jax.jit(quantize, out_shardings=staged)

    def _transfer(self, params, fp8_state, kv_scales):
        with mesh_context(self.train, self.precision.backend):
            bits = jax.block_until_ready(self.program(params, fp8_state))
        start = time.perf_counter()  # the transfer alone: the quantized bits are ready, nothing else is timed
        rep = rules.replicated(self.roll)
        bits = jax.device_put(bits, self._arrival)
        fp8_state, kv_scales = jax.device_put(fp8_state, rep), jax.device_put(kv_scales, rep)
        jax.block_until_ready((bits, fp8_state, kv_scales))
        self.last = {**self.moved, "bytes": dict(self.moved["bytes"]), "seconds": time.perf_counter() - start}
        with mesh_context(self.roll, self.precision.backend):
            return self._unpack(bits), fp8_state, kv_scales
