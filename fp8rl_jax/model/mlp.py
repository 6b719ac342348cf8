"""The Llama block's MLP, ``down(silu(gate) * up)``, in whichever form its precision and weights take.

``swiglu_mlp`` picks one of three:
  one custom VJP (``fused_mlp``): training's and scoring's MLP under FP8 with whole kernels, whose backward makes the
      SwiGLU's gradient and its FP8 operands in one kernel (``te.fp8_swiglu_mlp``, ``block_mlp.block_swiglu_mlp``)
  block scaling's rollout MLP (``swiglu_tiles_applies``): the gate/up linear, then ``block_mlp.swiglu_down``, whose
      kernel makes h's 1 x 128 tiles from the gate/up output, as the fused MLP's forward does
  two ``linear`` calls: everything else (BF16, FSDP shards, tensor-parallel shards of gate/up)
Under block scaling h is ``block_mlp.swiglu_h`` in every form, so that a rollout and a trainer agree bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fp8 import block_mlp, te
from fp8rl_jax.fp8.linear import linear
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.train_kernel import TrainKernel
from fp8rl_jax.fp8.xla import QuantizedKernel
from fp8rl_jax.model.config import LlamaConfig


def split_fused(y: jax.Array, sizes: tuple[int, ...], shards: int) -> list[jax.Array]:
    """A fused GEMM output [..., sum(sizes)] (q|k|v, gate|up) split into its parts. ``shards`` > 1: its columns come
    interleaved per tensor shard (``rollout.weights.interleave_fused``: block s = [part 0's s-th slice | part 1's |
    ...]), so that with the columns split contiguously over ``shards`` devices every part is split alike and the
    split is local."""
    if shards == 1:
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    lead = y.shape[:-1]
    # [..., S * W] -> [..., S, W]: one block per shard
    blocks = y.reshape(*lead, shards, -1)
    parts = jnp.split(blocks, np.cumsum([s // shards for s in sizes])[:-1].tolist(), axis=-1)
    # [..., S, size / S] -> [..., size]
    return [p.reshape(*lead, -1) for p in parts]


def swiglu_mlp(x: jax.Array, h: jax.Array, layer: dict, fp8: dict, config: LlamaConfig, precision: Precision,
               fused_shards: int = 1) -> jax.Array:
    """The residual stream ``x`` [B, T, D] plus the MLP of its normed ``h`` [B, T, D] with ``layer``'s ``w_gate_up``
    and ``w_down`` and their FP8 states in ``fp8`` (absent: BF16). ``fused_shards``: see ``split_fused``."""
    fused = fused_mlp(layer, fp8, precision, fused_shards)
    if fused:  # the MLP in one custom VJP, whose forward is the rollout's
        mlp = te.fp8_swiglu_mlp if fused == "te" else block_mlp.block_swiglu_mlp  # [B, T, D] -> [B T, D] -> [B, T, D]
        y = mlp(h.reshape(-1, config.hidden_size).astype(precision.dtype), layer["w_gate_up"], layer["w_down"],
                fp8["w_gate_up"], fp8["w_down"], precision.recipe, x.dtype)
        return x + y.reshape(x.shape)
    # [B, T, D] -> [B, T, 2F]
    gate_up = linear(h, layer["w_gate_up"], fp8.get("w_gate_up"), precision)
    if swiglu_tiles_applies(layer, fp8, precision, fused_shards):  # [B T, 2F] -> [B T, D]: h's tiles from one kernel
        y = block_mlp.swiglu_down(gate_up.reshape(-1, gate_up.shape[-1]), layer["w_down"], fp8["w_down"]["x"]["scale"],
                                  precision.recipe, out_dtype=x.dtype)
        return x + y.reshape(x.shape)
    gate, up = split_fused(gate_up, (config.intermediate_size,) * 2, fused_shards)
    h = block_mlp.swiglu_h(gate, up, precision.dtype) if _block_scaled(precision) else jax.nn.silu(gate) * up
    return linear(h, layer["w_down"], fp8.get("w_down"), precision, residual=x)


def fused_mlp(layer, fp8, precision: Precision, fused_shards: int) -> str | None:
    """The MLP in one custom VJP whose backward makes the SwiGLU's gradient and its FP8 operands in one kernel:
    ``te`` (``te.fp8_swiglu_mlp``: both kernels made once for the update, ``TrainKernel``), ``block``
    (``block_mlp.block_swiglu_mlp``: block scaling on the xla backend, whole kernels); None (two ``linear`` calls)
    for the rollout's pre-quantized kernels, BF16, FSDP and tensor-parallel shards of the fused gate/up."""
    names = ("w_gate_up", "w_down")
    if not (precision.fp8 and precision.fused_mlp and fused_shards == 1 and all(fp8.get(n) is not None for n in names)):
        return None
    if precision.backend == "te" and all(isinstance(layer.get(n), TrainKernel) for n in names):
        return "te"
    whole = all(isinstance(layer.get(n), (jax.Array, TrainKernel)) for n in names)
    return "block" if precision.backend == "xla" and block_mlp.fused(precision.recipe) and whole else None


def _block_scaled(precision: Precision) -> bool:
    """FP8 with block scaling (the xla backend's ``Fp8Recipe.scaling='block'``)."""
    return precision.fp8 and precision.recipe.scaling == "block"


def swiglu_tiles_applies(layer, fp8, precision: Precision, fused_shards: int) -> bool:
    """Whether the two linears' MLP (the rollout's pre-quantized kernels) takes ``block_mlp.swiglu_down``: block
    scaling with its forward in FP8 and w_down's state, gate/up whole on this device (not interleaved per shard)."""
    return (_block_scaled(precision) and "fprop" in precision.recipe.fp8_gemms and fused_shards == 1
            and fp8.get("w_down") is not None and isinstance(layer["w_down"], QuantizedKernel))
