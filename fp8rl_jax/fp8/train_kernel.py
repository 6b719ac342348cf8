"""A block kernel's FP8 operands made once for an optimizer update (``TrainKernel``): the te backend's per-tensor
ones (``te.quantize_for_update``) and block scaling's on the xla backend (``block_kernel_for_update``), which
``llama.update_kernels`` makes for the training step and ``fp8_matmul`` (either backend) and the fused MLPs read."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8 import block
from fp8rl_jax.fp8.recipe import Fp8Recipe


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainKernel:
    """A block kernel for one optimizer update: the f32 master [K, N], whose gradient training wants, and its FP8
    operands made once for all the update's microbatches: ``kn`` [K, N] for the dgrad, ``nk`` [N, K] for the
    forward, and the master's ``amax``. The weights do not change between an update's microbatches; quantizing,
    transposing and reducing them in every microbatch (twice under remat) repeats that work. The te backend's
    (``te.quantize_for_update``: per-tensor delayed scaling, ``scale_inv`` None) or block scaling's on the xla
    backend (``block_kernel_for_update``: ``scale_inv`` nk's inverse block scales [Nb, Kb], kn's their transpose)."""

    master: jax.Array
    kn: jax.Array
    nk: jax.Array
    amax: jax.Array
    scale_inv: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.master.shape


def hoists_block_kernels(recipe: Fp8Recipe) -> bool:
    """Whether a recipe's block kernels are made once per optimizer update (``block_kernel_for_update``): block
    scaling with the weight in 128 x 128 blocks for the forward and the dgrad (``block_forward='tiles_blocks'``)."""
    return (recipe.scaling == "block" and recipe.block_forward == "tiles_blocks"
            and {"fprop", "dgrad"} <= set(recipe.fp8_gemms))


def block_forms(kernel) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """A ``block_kernel_for_update`` kernel's ``(kn, nk, scale_inv)``, the FP8 operands the block GEMMs take in its
    master's place; None for anything else (a master, the te backend's ``TrainKernel``)."""
    if isinstance(kernel, TrainKernel) and kernel.scale_inv is not None:
        return kernel.kn, kernel.nk, kernel.scale_inv
    return None


def block_kernel_for_update(kernel: jax.Array, recipe: Fp8Recipe) -> TrainKernel:
    """``kernel`` [K, N] (or stacked [L, K, N]) with block scaling's FP8 operands made once for an optimizer update
    (``hoists_block_kernels``): ``nk`` [N, K] the forward's, the bits ``xla.quantize_kernel`` makes, and ``kn`` [K, N]
    the dgrad's, the bits ``block.block_quantize(kernel)`` makes (the same blocks, transposed), both in FP8;
    ``scale_inv`` nk's [Nb, Kb]; ``amax`` 0, nothing observed (block scaling reads no delayed scale)."""
    if not hoists_block_kernels(recipe):
        raise ValueError(f"block kernels are made once per update for block scaling's tiles_blocks forward with an "
                         f"FP8 dgrad, not for {recipe}")
    if kernel.ndim == 3:
        return jax.vmap(lambda k: block_kernel_for_update(k, recipe))(kernel)
    nk, scale_inv = block.block_quantize(jnp.swapaxes(kernel, -1, -2), recipe.fwd_dtype)
    return TrainKernel(kernel, jnp.swapaxes(nk, -1, -2), nk, jnp.zeros((), jnp.float32), scale_inv)
