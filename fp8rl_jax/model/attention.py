"""Full-sequence attention (scoring, training, prefill): the masked einsum reference, the flash kernels (cuDNN,
Pallas) and the packed rows' segment tables; ``llama.forward_hidden`` picks one with ``resolve_attention``.

Letters as in ``fp8rl_jax.model.llama``: B batch, T query tokens, S key positions, N query heads, K kv heads,
G = N / K, H head dim, M segments per packed row.
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def attention(q, k, v, q_pos, k_pos, q_segments=None, k_segments=None) -> jax.Array:
    """Causal GQA attention, softmax in f32. Key s is visible to query t iff 0 <= k_pos[s] <= q_pos[t] and, with
    segment ids (packed rows, ``forward_hidden``), q_segments[t] == k_segments[s].

    q [B, T, N, H]; k, v [B, K, S, H]; q_pos, q_segments [B, T]; k_pos, k_segments [B, S]  ->  [B, T, N, H]
    """
    b, t, n, h = q.shape
    kh = k.shape[1]
    # [B, T, N, H] -> [B, T, K, G, H]
    q = q.reshape(b, t, kh, n // kh, h)
    # [B, K, G, T, S]
    scores = jnp.einsum("btkgh,bksh->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(h)
    # [B, T, S]
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)
    if q_segments is not None:  # a packed row: positions restart per segment, so the segment decides too
        visible = visible & (q_segments[:, :, None] == k_segments[:, None, :])
    scores = jnp.where(visible[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # [B, K, G, T, S] x [B, K, S, H] -> [B, T, K, G, H]; accumulated in f32, rounded once to the compute dtype
    # (an f32 output here would be rounded right after anyway, and XLA:CPU has no bf16 x bf16 -> f32 form of it)
    out = jnp.einsum("bkgts,bksh->btkgh", probs, v, preferred_element_type=v.dtype)
    return out.reshape(b, t, n, h).astype(q.dtype)


ATTENTION_BLOCK = 64  # the Pallas flash attention's tile along T (T is padded up to a multiple of it)


def resolve_attention(impl: str, dtype, head_dim: int, backend: str | None = None,
                      cudnn_clash: bool | None = None, mesh_devices: int | None = None) -> str:
    """The full-sequence attention ``Precision.attention=impl`` runs. ``auto`` on a GPU backend, for a BF16 / F16
    compute dtype and a head dim of at most 128 (a multiple of 8; a power of two >= 16 for Pallas): ``cudnn``;
    ``pallas`` where Transformer Engine loaded another cuDNN than JAX's (``cudnn_clash``, default: TE imported
    without ``fp8.te.shares_jax_cudnn()``), except under a mesh of several devices (``mesh_devices``, default: the
    mesh active at trace time), where the Pallas kernel would run unpartitioned (XLA gathers its operands): ``xla``
    there. ``xla`` elsewhere. The others as asked.

    Why not cuDNN beside a TE on another cuDNN: JAX's cuDNN front then runs on the other's sub-libraries. On the
    H100 image (TE built on the system's cuDNN 9.14, JAX's wheel 9.19) the flash attention's forward ran and its
    backward failed to load ("cudaErrorInvalidValue ... before calling cuModuleGetFunction", which poisons the
    process). ``fp8.te`` loads JAX's cuDNN before TE to avoid it (``benchmarks/cudnn_te_check.py``).
    """
    if impl != "auto":
        return impl
    if cudnn_clash is None:
        te = sys.modules.get("fp8rl_jax.fp8.te")
        cudnn_clash = "transformer_engine" in sys.modules and not (te is not None and te.shares_jax_cudnn())
    if (backend or jax.default_backend()) != "gpu" or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "xla"
    if not cudnn_clash:  # cuDNN's call carries partitioning rules (batch and heads)
        return "cudnn" if head_dim % 8 == 0 and head_dim <= 128 else "xla"
    if mesh_devices is None:
        mesh = jax.sharding.get_abstract_mesh()
        mesh_devices = 1 if mesh.empty else mesh.size
    if mesh_devices > 1:  # a shard_map over batch and heads would partition it: not built yet
        return "xla"
    return "pallas" if 16 <= head_dim <= 128 and not head_dim & (head_dim - 1) else "xla"


# the most sequences a packed row of T tokens may hold is T // SEGMENT_TOKENS, at least 1 and at most
# MAX_ROW_SEGMENTS: cuDNN's packed layout takes the segments of a row as a static [B, M] table, M = row_segments(T) + 1
# (the row's padding tail is one more), and sizes its buffers by B x M. Measured on the H100 (JAX 0.11.2, llama1b's
# heads, 14 rows of 2,304 tokens, benchmarks/RESULTS.md, "Sequence packing"): one layer's forward + backward
# takes 0.75 GiB of temp memory unpacked and about 0.75 + 0.5 (M - 1) GiB packed (16.7 GiB at M = 33, out of memory at
# 145), about 8 bytes x tokens x N x H per segment, while its time barely moves (3 ms at M <= 8, 4 ms at 32).
SEGMENT_TOKENS = 16
MAX_ROW_SEGMENTS = 8
# jax's cuDNN packed layout scaled the key offsets by the *query* heads' stride, wrong under GQA (jax-ml/jax#39521;
# 0.10.2's source has it). JAX 0.11.2 gave the segment-masked einsum's numbers with GQA kv heads as they are on the
# H100 (a standalone probe, 2026-11-24); before it the kv heads are repeated to the query heads.
CUDNN_PACKED_GQA = jax.__version_info__ >= (0, 11, 2)


def row_segments(width: int) -> int:
    """The most sequences (segments) a packed row of ``width`` tokens may hold (``fp8rl_jax.rl.packing``)."""
    return max(1, min(width // SEGMENT_TOKENS, MAX_ROW_SEGMENTS))


def segment_table(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """The runs of equal ids in each row of ``segment_ids`` [B, T] as cuDNN's packed layout wants them: ``(lengths
    [B, M], starts [B, M + 1])``, int32, -1 past a row's last run (M = ``max_segments``; a row with more runs than
    M is cut short, so the packer never makes one: ``row_segments``). A packed row's padding tail is one run of its
    own: every position is in some run, so the kernel leaves no output undefined."""
    b, t = segment_ids.shape
    # [B, T]: True where a run begins
    begins = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    # [B, M]: the first M run starts of each row in order, T where the row has fewer runs
    starts = jax.vmap(lambda row: jnp.nonzero(row, size=max_segments, fill_value=t)[0])(begins).astype(jnp.int32)
    ends = jnp.concatenate([starts[:, 1:], jnp.full((b, 1), t, jnp.int32)], axis=1)
    present = starts < t
    lengths = jnp.where(present, ends - starts, -1)
    starts = jnp.concatenate([jnp.where(present, starts, -1), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return lengths, starts


def flash_attention(q, k, v, implementation: str = "cudnn", segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal GQA self-attention of sequences at positions 0..T-1 without the [T, S] scores in memory (softmax in
    f32 inside the kernel). Right padding needs no mask: a padding position attends only to what precedes it, and
    nothing reads its output.

    ``segment_ids`` [B, T] int (packed rows, ``forward_hidden``): a query sees only the keys of its own segment,
    causally by index. A row's segments are contiguous runs of one id (its padding tail one more run).

    ``cudnn``: cuDNN's fused flash attention (``jax.nn.dot_product_attention``; GPU). With segments its packed
    (THD) layout, which ``jax.nn.dot_product_attention`` does not expose in JAX 0.10 / 0.11: jax's own cuDNN call
    with per-row run starts and lengths (``segment_table``) and a padding-causal mask (Hopper or newer, cuDNN >=
    9.6); before JAX 0.11.2 the kv heads are repeated to the query heads first (``CUDNN_PACKED_GQA``). Measured on
    the H100 (JAX 0.11.2, cuDNN 9.19; rows of 256 with 1-3 sequences and padding tails, GQA 8/2, head dim 64): the
    BF16 output and gradients within BF16 rounding of the f32 segment-masked einsum, as Pallas'. ``pallas``: JAX's
    Pallas (Triton) flash
    attention with its Triton backward (``jax.experimental.pallas.ops.gpu.attention``; GPU; takes segment ids): the
    kv heads repeated to the query heads, T padded to a multiple of ``ATTENTION_BLOCK``. ``xla`` and
    ``pallas_interpret``: the same two calls on any backend, as references (tests); ``xla`` with segments passes
    the segment mask to ``jax.nn.dot_product_attention``.

    q [B, T, N, H]; k, v [B, T, K, H] (q's dtype)  ->  [B, T, N, H]
    """
    b, t, n, h = q.shape
    groups = n // k.shape[2]
    if implementation == "xla" or (implementation == "cudnn" and segment_ids is None):
        mask = None
        if segment_ids is not None:
            # [B, 1, T, S]: same segment (the causal part is is_causal's)
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)
    if implementation == "cudnn":
        from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

        lengths, starts = segment_table(segment_ids, row_segments(t) + 1)
        if groups > 1 and not CUDNN_PACKED_GQA:  # [B, T, K, H] -> [B, T, N, H]: query head i reads kv head i // G
            k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        return cudnn_attention.dot_product_attention(
            q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts, kv_offsets=starts,
            scale=1.0 / math.sqrt(h), mask_type=cudnn_attention.MaskType.PADDING_CAUSAL)
    if implementation not in ("pallas", "pallas_interpret"):
        raise ValueError(f"flash attention implementation={implementation!r}; allowed: cudnn | xla | pallas | "
                         "pallas_interpret")
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    # [B, T, K, H] -> [B, T, N, H]: query head i reads kv head i // G (the kernel takes one kv head per query head)
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    pad = -t % ATTENTION_BLOCK
    if pad:  # zero positions at the end: causal, so only the (discarded) padding queries see them
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)
    blocks = pallas_attention.BlockSizes(block_q=ATTENTION_BLOCK, block_k=ATTENTION_BLOCK, block_q_dkv=32,
                                         block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
    out = pallas_attention.mha(q, k, v, segment_ids, sm_scale=1.0 / math.sqrt(h), causal=True, block_sizes=blocks,
                               interpret=implementation == "pallas_interpret")
    return out[:, :t]
