"""``linear``: the one entry point every matmul of the model goes through."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.block import Tiles
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8LinearState
from fp8rl_jax.fp8.train_kernel import TrainKernel
from fp8rl_jax.fp8.xla import QuantizedKernel
from fp8rl_jax.parallel import fsdp, mesh
from fp8rl_jax.parallel.fsdp import FsdpKernel


def _te():
    from fp8rl_jax.fp8 import te  # lazy: Transformer Engine is optional and GPU-only

    return te


@contextlib.contextmanager
def mesh_context(device_mesh: jax.sharding.Mesh | None, backend: str = "xla") -> Iterator[None]:
    """Trace and run the programs of ``backend``'s matmuls under ``device_mesh`` (``parallel.mesh.mesh_context``);
    nothing when it is None. With ``backend='te'``, Transformer Engine's primitives are also told which mesh axes
    mean what (``te.mesh_resource``). TE is imported only here and only for that backend, so CPU runs never
    import it."""
    if device_mesh is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(mesh.mesh_context(device_mesh))
        if backend == "te":
            stack.enter_context(_te().mesh_resource())
        yield


def linear(
    x: jax.Array,
    kernel: jax.Array | QuantizedKernel | FsdpKernel | TrainKernel,
    fp8_state: Fp8LinearState | None,
    precision: Precision,
    out_dtype=None,
    *,
    kernel_nk: bool = False,
    residual: jax.Array | None = None,
) -> jax.Array:
    """``x [..., K] @ kernel [K, N]`` -> [..., N] in ``out_dtype`` (default: the compute dtype), plus ``residual``
    [..., N] where given (in ``residual``'s dtype).

    ``fp8_state`` None means this matmul is outside FP8 (a BF16 block, the lm_head, or the ``bf16`` backend).
    A ``QuantizedKernel`` (rollout weights quantized once per RL step) needs only the input's scale.
    An ``FsdpKernel`` (a block's FSDP-sharded master, ``parallel.fsdp``) is gathered in the GEMM's precision: its
    shards quantized (FP8) or cast (BF16) where they are, then their bits gathered.
    A ``TrainKernel`` (the master and its FP8 operands made once per optimizer update: the te backend's, or block
    scaling's on the xla backend) differentiates into its master.
    ``kernel_nk``: ``kernel`` is stored [N, K] (a tied embedding table used as the head) and is contracted as it
    is: handed over as a transposed [K, N] view, a BF16 table is converted whole to f32 by XLA:CPU at every call.
    An FP8 ``x`` is the input already quantized with this linear's input scale (the decode attention kernel
    writes it so): it takes a ``QuantizedKernel`` and goes to the GEMM as it is. A ``block.Tiles`` ``x`` is the input
    already in block scaling's 1 x 128 tiles (``model.norm.normed`` makes it so): it takes a ``QuantizedKernel`` too.
    ``residual``: with ``precision.residual_in_gemm`` and a ``QuantizedKernel`` on the GPU (per-tensor scaling) the
    add is the FP8 GEMM's own (``xla.prequantized_matmul_into``), as XLA makes it for a BF16 GEMM; else an XLA add.
    """
    if isinstance(x, Tiles):
        return _tiles_linear(x, kernel, fp8_state, precision, out_dtype, residual)
    if residual is not None and not _residual_in_gemm(kernel, fp8_state, precision):
        return residual + linear(x, kernel, fp8_state, precision, residual.dtype, kernel_nk=kernel_nk)
    dtype = precision.dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    if jnp.dtype(x.dtype).itemsize == 1:
        if not (isinstance(kernel, QuantizedKernel) and fp8_state is not None and precision.fp8):
            raise TypeError(f"an {x.dtype} input is pre-quantized: it needs a QuantizedKernel and its FP8 state")
    else:
        x = x.astype(dtype)
    gather = None
    if isinstance(kernel, TrainKernel) and not (fp8_state is not None and precision.fp8 and (
            precision.backend == "te" if kernel.scale_inv is None else precision.backend == "xla")):
        kernel = kernel.master  # its FP8 operands are for the FP8 GEMMs of the backend that made them
    if isinstance(kernel, FsdpKernel):
        if kernel_nk:
            raise TypeError("an FsdpKernel is a block's [K, N] kernel; kernel_nk does not apply")
        if fp8_state is None or not precision.fp8:  # BF16: the cast shards gathered
            kernel = fsdp.gathered_cast(kernel.value, dtype, kernel.spec)
        else:  # FP8: the FP8 linear quantizes the shards and gathers them itself (its backward needs the master)
            gather, kernel_amax, kernel = kernel.spec, kernel.amax, kernel.value
    if fp8_state is None or not precision.fp8:
        if isinstance(kernel, QuantizedKernel):
            raise TypeError("a pre-quantized kernel needs its FP8 state (the input scale)")
        dims = (((x.ndim - 1,), (1 if kernel_nk else 0,)), ((), ()))
        if out_dtype.itemsize > jnp.dtype(dtype).itemsize:
            return _wide_dot(x, kernel.astype(dtype), dims, out_dtype)
        return lax.dot_general(x, kernel.astype(dtype), dims, preferred_element_type=out_dtype)
    if kernel_nk and not isinstance(kernel, QuantizedKernel):
        kernel = kernel.T  # [N, K] -> [K, N]: the FP8 path quantizes (and lays out) the kernel itself
    k, n = kernel.shape
    # [..., K] -> [M, K]: the FP8 GEMMs take 2-D operands
    x2 = x.reshape(-1, k)
    if residual is not None:  # [..., N] + [M, K] @ kernel in one GEMM
        y = xla.prequantized_matmul_into(residual.reshape(-1, n), x2, kernel, fp8_state["x"]["scale"], precision.recipe,
                                         x_scale_inv=fp8_state["x"].get("scale_inv"))
        return y.reshape(residual.shape)
    backend = _te() if precision.backend == "te" else xla
    if isinstance(kernel, QuantizedKernel):
        y = backend.prequantized_matmul(x2, kernel, fp8_state["x"]["scale"], precision.recipe, out_dtype=out_dtype,
                                        x_scale_inv=fp8_state["x"].get("scale_inv"))
    elif gather is not None:
        y = backend.fp8_matmul(x2, kernel, fp8_state, precision.recipe, out_dtype, gather=gather,
                               kernel_amax=kernel_amax)
    else:
        y = backend.fp8_matmul(x2, kernel, fp8_state, precision.recipe, out_dtype)
    # [M, N] -> [..., N]
    return y.reshape(*x.shape[:-1], n)


def _tiles_linear(x: Tiles, kernel, fp8_state, precision: Precision, out_dtype, residual) -> jax.Array:
    """``linear`` of an input already in its 1 x 128 tiles: block scaling's forward GEMM (``xla.tiles_matmul``)."""
    if not (isinstance(kernel, QuantizedKernel) and fp8_state is not None and precision.fp8
            and precision.recipe.scaling == "block"):
        raise TypeError("an input in 1 x 128 tiles takes block scaling's pre-quantized kernel and its FP8 state")
    k = x.q.shape[-1]
    out_dtype = jnp.dtype(residual.dtype if residual is not None else out_dtype or precision.dtype)
    # [..., K] -> [M, K]; [..., Kb] -> [M, Kb]
    y = xla.tiles_matmul(x.q.reshape(-1, k), x.scale_inv.reshape(-1, x.scale_inv.shape[-1]), kernel, precision.recipe,
                         out_dtype=out_dtype)
    y = y.reshape(*x.q.shape[:-1], y.shape[-1])
    return y if residual is None else residual + y


def _residual_in_gemm(kernel, fp8_state, precision: Precision) -> bool:
    """Whether ``residual + x @ kernel`` is one FP8 GEMM with a C operand (``precision.residual_in_gemm``): a
    pre-quantized kernel (the rollout's) in float8 (the GPU's GEMM form; the CPU's ``f32`` form keeps the add
    separate), per-tensor scaling. Scoring and training keep TE's GEMM and the add (measured: see the option)."""
    return (precision.residual_in_gemm and isinstance(kernel, QuantizedKernel) and fp8_state is not None
            and precision.fp8 and precision.recipe.scaling == "tensor" and jnp.dtype(kernel.data.dtype).itemsize == 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _wide_dot(x: jax.Array, kernel: jax.Array, dims, out_dtype) -> jax.Array:
    """A BF16 GEMM with a wider (f32) output, whose backward GEMMs stay BF16.

    Differentiated as it is, the f32 output's cotangent would make both backward GEMMs f32 x f32 (TF32 on a GPU, half
    BF16's rate on twice the bytes: 0.32 s of a 1.67 s BF16 train minibatch at llama1b shapes, benchmarks/RESULTS.md,
    "End-to-end step, llama1b shapes"). The cotangent is rounded to the operands' dtype instead, as an autocast BF16
    matmul (whose output is BF16) or TE's BF16 GEMM would have it; the FP8 GEMMs round theirs to E5M2.
    """
    return lax.dot_general(x, kernel, dims, preferred_element_type=out_dtype)


def _wide_dot_fwd(x, kernel, dims, out_dtype):
    return _wide_dot(x, kernel, dims, out_dtype), (x, kernel)


def _wide_dot_bwd(dims, out_dtype, residuals, g):
    x, kernel = residuals
    _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=x.dtype), x, kernel)
    return vjp(g.astype(x.dtype))


_wide_dot.defvjp(_wide_dot_fwd, _wide_dot_bwd)


def quantize_kernel(kernel: jax.Array, fp8_state: Fp8LinearState, precision: Precision) -> QuantizedKernel:
    backend = _te() if precision.backend == "te" else xla
    return backend.quantize_kernel(kernel, fp8_state["kernel"], precision.recipe)
