"""FSDP weight gathers in the GEMM's precision: FP8 bytes for an FP8 linear, BF16 for a BF16 one, never f32 masters.

Under a mesh with ``fsdp`` > 1 the f32 master kernels are sharded on their rows or columns (``parallel.rules``) and
each block's kernels must be all-gathered before its GEMMs. Left to itself, XLA gathers the f32 shard and casts or
quantizes the whole kernel after: a ``with_sharding_constraint`` after the cast does not stop it (it moves the gather
before the cast), and XLA:CPU widens a BF16 all-gather to f32 and an FP8 one to f16 (``tests/parallel/test_hlo.py``).
So the training forward casts or quantizes each shard where it is and all-gathers its *bits* (uint16 / uint8) inside
a ``jax.shard_map`` over ``fsdp`` (``gather_bits``); tensor-sharded dimensions stay sharded.

FP8 with delayed scaling: the kernel's scale comes from the amax history (known before the step) and is replicated,
so quantizing each shard and gathering gives the very bits of quantizing the gathered f32 kernel (an elementwise map
commutes with a gather; tested bit for bit). The FP8 contract's observation of the kernel (``fp8/recipe.py``) stays
the global amax of the whole kernel: a local max per shard, then one all-reduce of the scalars, and for a scan over
stacked layers one all-reduce for every layer and linear at once (``kernel_amaxes``), never a gather.

Differentiation. The FP8 linears quantize and gather inside their ``custom_vjp`` forward (``fp8/xla.py``,
``fp8/te.py``); their backward keeps the gathered FP8 kernel for the dgrad and returns the f32 wgrad of the whole
kernel, constrained to the master's sharding, so that XLA sums the devices' partial wgrads with a reduce-scatter
(``reduce_to``). A BF16 linear takes ``gathered_cast``: the cast shard's bits gathered forward, the cotangent brought
back to the master's dtype and reduce-scattered backward. Gradients and optimizer moments stay f32.

On one device, or on a mesh without ``fsdp`` > 1, nothing here runs: the programs are the ones without a mesh.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from fp8rl_jax.parallel.rules import PARAM_AXES, spec

AXIS = "fsdp"
LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")  # the block kernels gathered here (llama.LINEARS)


def fsdp_size() -> int:
    """The ``fsdp`` size of the mesh active at trace time (``jax.set_mesh``), 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        return 1
    return int(dict(mesh.shape)[AXIS])


def active() -> bool:
    """Whether block weights are gathered here: a mesh with ``fsdp`` > 1 is active."""
    return fsdp_size() > 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FsdpKernel:
    """One layer's f32 master kernel [K, N] as it enters a block under FSDP, sharded as ``spec``: ``linear`` gathers
    it in the GEMM's precision (``fp8_matmul(..., gather=spec)`` or ``gathered_cast``). ``amax``: the kernel's global
    amax (f32 scalar) where it was already reduced with the other layers' (``kernel_amaxes``), else None."""

    value: jax.Array
    amax: jax.Array | None
    spec: P = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape


def kernel_spec(name: str, shape) -> P:
    """The ``PartitionSpec`` of the param ``name`` (one layer's slice for a block kernel: [K, N]) on the active
    mesh (``rules.spec``)."""
    mesh = jax.sharding.get_abstract_mesh()
    return spec(PARAM_AXES[name], tuple(shape), dict(mesh.shape))


def fsdp_dim(s: P) -> int | None:
    """The dimension ``s`` shards over ``fsdp`` alone, None if none. A dimension over several axes that include
    ``fsdp`` is refused: gathering ``fsdp`` out of it would reorder the others (the params never have one)."""
    for i, entry in enumerate(s):
        if entry == AXIS:
            return i
        if isinstance(entry, tuple) and AXIS in entry:
            raise ValueError(f"PartitionSpec {s}: dimension {i} is sharded over {entry}; only a dimension over "
                             f"{AXIS!r} alone is gathered")
    return None


def _without_fsdp(s: P) -> P:
    return P(*(None if e == AXIS else e for e in s))


def gather_bits(a: jax.Array, s: P) -> jax.Array:
    """``a`` (sharded as ``s``) all-gathered over ``fsdp`` as its bits (uint8 for FP8, uint16 for BF16: XLA moves
    them as they are), in ``a``'s dtype; other mesh axes stay as they are. ``a`` itself where ``s`` has no fsdp."""
    dim = fsdp_dim(s)
    if dim is None:
        return a
    bits = jnp.dtype(f"uint{8 * jnp.dtype(a.dtype).itemsize}")

    def local(shard):
        b = lax.all_gather(lax.bitcast_convert_type(shard, bits), AXIS, axis=dim, tiled=True)
        return lax.bitcast_convert_type(b, a.dtype)

    # check_vma off: the gathered bits are the same on every fsdp device, which the output spec states
    return jax.shard_map(local, in_specs=s, out_specs=_without_fsdp(s), check_vma=False)(a)


def gather_transposed(a: jax.Array, s: P) -> jax.Array:
    """A [K, N] kernel sharded as ``s`` -> gathered over ``fsdp`` and laid out [N, K] (the FP8 GEMMs' K-major
    operand). Transposed before or after the gather, whichever gathers along the major dimension (contiguous
    pieces): wqkv / w_gate_up [K, N] are fsdp-sharded on K (gather, then transpose), wo / w_down on N."""
    if fsdp_dim(s) == 1:
        padded = tuple(s) + (None,) * (2 - len(s))
        return gather_bits(a.T, P(padded[1], padded[0]))
    return gather_bits(a, s).T


def reduce_to(g: jax.Array, s: P) -> jax.Array:
    """A whole kernel's gradient constrained to its master's sharding ``s``: XLA sums the devices' partial
    gradients with a reduce-scatter (each device receives its shard's sum)."""
    return lax.with_sharding_constraint(g, s)


@functools.cache
def _gathered_cast_fn(master_dtype, dtype, s: P):
    @jax.custom_vjp
    def f(w):
        return gather_bits(w.astype(dtype), s)

    def fwd(w):
        return f(w), None

    def bwd(_, g):
        return (reduce_to(g.astype(master_dtype), s),)

    f.defvjp(fwd, bwd)
    return f


def gathered_cast(w: jax.Array, dtype, s: P) -> jax.Array:
    """The master ``w`` (sharded as ``s``) cast to ``dtype`` shard by shard, then gathered over ``fsdp`` in
    ``dtype`` (its bits). Its gradient: the cotangent in ``w``'s dtype, reduce-scattered onto ``s``."""
    return _gathered_cast_fn(jnp.dtype(w.dtype), jnp.dtype(dtype), s)(w)


def block_kernels(layer: dict, amaxes: dict | None = None) -> dict:
    """One layer's params with every block kernel that the active mesh shards over ``fsdp`` as an ``FsdpKernel``
    (``amaxes``: name -> this layer's global kernel amax, from ``kernel_amaxes``)."""
    out = dict(layer)
    for name in LINEARS:
        w = layer.get(name)
        if w is None or not isinstance(w, jax.Array) or w.ndim != 2:
            continue
        s = kernel_spec(name, w.shape)
        if fsdp_dim(s) is not None:
            out[name] = FsdpKernel(w, None if amaxes is None else amaxes.get(name), s)
    return out


def kernel_amaxes(blocks: dict, names) -> dict:
    """``{name: [L]}``: the global amax of each layer's kernel ``name`` of the stacked ``blocks`` ([L, K, N] each),
    all in one all-reduce: each device's max per layer and kernel, stacked, then one max over the mesh. The FP8
    linears read them instead of reducing each kernel's amax on their own (a collective per linear per layer)."""
    names = [n for n in names if isinstance(blocks.get(n), jax.Array) and blocks[n].ndim == 3]
    if not names:
        return {}
    mesh = jax.sharding.get_abstract_mesh()
    specs = [P(None, *kernel_spec(n, blocks[n].shape[1:])) for n in names]
    axes = tuple(a for a in mesh.axis_names if dict(mesh.shape)[a] > 1)

    def local(*kernels):
        # [names, L]: this device's max of |w| per layer
        m = jnp.stack([jnp.max(jnp.abs(k), axis=(1, 2)).astype(jnp.float32) for k in kernels])
        return lax.pmax(m, axes) if axes else m

    # an observation, not differentiated (and pmax has no derivative)
    stacked = jax.shard_map(local, in_specs=tuple(specs), out_specs=P(), check_vma=False)(
        *(lax.stop_gradient(blocks[n]) for n in names))
    return {n: stacked[i] for i, n in enumerate(names)}
