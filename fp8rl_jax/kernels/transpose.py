"""The transpose of a 2-D one-byte (FP8) array: the second layout the FP8 weight gradient needs.

Why. Hopper's FP8 GEMMs take both operands K-major. The weight gradient ``dw = x^T g`` contracts over the tokens,
so it needs ``q(x)`` and ``q(g)`` with the tokens as the minor axis: a transposed copy of each, made once per
linear and microbatch. XLA's transpose of a one-byte array ran at ~0.6 TB/s on the H100 (a llama1b train minibatch:
180 ms of transposes, benchmarks/RESULTS.md, "Train-step kernels"), a fifth of the copy rate.

The kernel (Pallas, Triton backend). Grid ``(R / block_rows, C / block_cols)``: a program loads one
``[block_rows, block_cols]`` tile as bytes and stores its transpose at the mirrored tile of the ``[C, R]`` output;
Triton moves the tile through shared memory. Nothing is computed, so it reads and writes each byte once.

On a mesh. A ``pallas_call`` is opaque to XLA's partitioner. Under a mesh of several devices with the tensor axis
of size 1 (FSDP and data parallelism, the trainer's layouts), the tokens (rows) are split over data+fsdp, and the
kernel runs under ``jax.shard_map`` on each device's rows (a local transpose: the output's columns are split the
same way). Other meshes, shapes that the blocks do not divide, and backends other than a GPU get XLA's transpose.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

IMPLS = ("auto", "pallas", "pallas_interpret", "xla")
BLOCK = (128, 128)  # rows, columns per program (H100 sweep: benchmarks/transpose_fp8.py)
NUM_WARPS = 4


def transpose_bytes(q: jax.Array, *, tokens: bool = True, impl: str = "auto", block: tuple[int, int] = BLOCK,
                    num_warps: int = NUM_WARPS) -> jax.Array:
    """``q`` [R, C] (a one-byte dtype) -> [C, R]. ``tokens``: the rows are tokens (an activation or its gradient,
    split over data+fsdp under a mesh); otherwise (a kernel) a mesh of several devices gets XLA's transpose.
    ``impl``: ``pallas`` (the kernel, GPU), ``pallas_interpret`` (the same through Pallas' interpreter, any backend,
    for tests), ``xla`` (``jnp.swapaxes``), ``auto`` (pallas on a GPU where the shape and the mesh allow it, else
    xla)."""
    if impl not in IMPLS:
        raise ValueError(f"transpose impl={impl!r}; allowed: {IMPLS}")
    if q.ndim != 2 or jnp.dtype(q.dtype).itemsize != 1:
        raise ValueError(f"transpose_bytes takes a 2-D one-byte array, not {q.dtype}{list(q.shape)}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl == "xla":
        return jnp.swapaxes(q, 0, 1)
    from fp8rl_jax.parallel import rules

    kernel = functools.partial(_transpose_pallas, block=block, num_warps=num_warps,
                               interpret=impl == "pallas_interpret")
    mesh = rules.active_mesh()
    rows_split = 1
    if mesh is not None:
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        if sizes.get("tensor", 1) > 1 or not tokens:
            return jnp.swapaxes(q, 0, 1)
        batch = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
        rows_split = math.prod(sizes[a] for a in batch)
    r, c = q.shape
    if r % (rows_split * block[0]) or c % block[1]:
        return jnp.swapaxes(q, 0, 1)
    if rows_split == 1:
        return kernel(q)
    spec = batch if len(batch) > 1 else batch[0]
    return jax.shard_map(kernel, mesh=mesh, in_specs=P(spec, None), out_specs=P(None, spec), check_vma=False)(q)


def _transpose_pallas(q: jax.Array, *, block: tuple[int, int], num_warps: int, interpret: bool) -> jax.Array:
    r, c = q.shape
    br, bc = block
    bits = lax.bitcast_convert_type(q, jnp.uint8)  # Triton moves bytes; no float8 type needed

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...].T

    out = pl.pallas_call(
        body,
        grid=(r // br, c // bc),
        in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((bc, br), lambda i, j: (j, i)),
        out_shape=jax.ShapeDtypeStruct((c, r), jnp.uint8),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="fp8_transpose",
    )(bits)
    return lax.bitcast_convert_type(out, q.dtype)
