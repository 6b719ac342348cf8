"""A Llama-family decoder as pure functions over a params pytree.

One forward serves every caller: scoring and training (full sequences, no cache), prefill (a prompt written
into a cache) and decode (one token per sequence against the cache). Only the cache and the weight format
differ. Every matmul of the blocks goes through ``fp8rl_jax.fp8.linear.linear``.

Params (master weights, f32 by default)::

    embed        [V, D]
    blocks       stacked over layers (leading axis L):
      attn_norm  [L, D]
      wqkv       [L, D, (N + 2K) H]     q, k, v projections fused: one GEMM, one FP8 scale
      bqkv       [L, (N + 2K) H]        only with ``qkv_bias`` (Qwen2)
      wo         [L, N H, D]
      mlp_norm   [L, D]
      w_gate_up  [L, D, 2F]             gate then up, fused
      w_down     [L, F, D]
    final_norm   [D]
    lm_head      [D, V]                 only when embeddings are untied

Rollout params may carry ``blocks`` already split into precision segments (a tuple of stacks) with FP8
kernels pre-quantized; see ``fp8rl_jax.rollout.weights``.

Letters: B batch, T query tokens, S key positions (cache length), D model, N query heads, K kv heads,
G = N / K, H head dim, F mlp hidden, V vocab, L layers.
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.linear import linear
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import init_linear_state
from fp8rl_jax.fp8.xla import QuantizedKernel, TrainKernel
from fp8rl_jax.kernels import decode_attention as decode_kernel
from fp8rl_jax.kernels.decode_attention import DEFAULT_TUNING, DecodeTuning
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.parallel import fsdp, rules
from fp8rl_jax.parallel.rules import RESIDUAL_AXES, constrain

LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
NEG_INF = -1e30
# what the backward pass of a block keeps from its forward (``jax.checkpoint`` policies, ``config.model.remat``):
# none = everything the autodiff saves; full = only the block's inputs (the forward runs twice); the
# ``*_saveable`` ones keep the matmul outputs and recompute the elementwise work
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")

Params = dict
Cache = dict  # {"k": [L, B, K, S, H], "v": [L, B, K, S, H]}: (B, K) lead, as the attention dots batch them


# ----------------------------------------------------------------------------------------------------------
# init


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random weights (normal, ``std``; output projections scaled by 1/sqrt(2L)); norms at 1."""
    c = config
    d, f, L = c.hidden_size, c.intermediate_size, c.num_layers
    qkv = c.q_size + 2 * c.kv_size
    keys = jax.random.split(key, 7)
    out_std = std / math.sqrt(2 * L)

    def normal(k, shape, s):
        return (s * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    blocks = {
        "attn_norm": jnp.ones((L, d), dtype),
        "wqkv": normal(keys[0], (L, d, qkv), std),
        "wo": normal(keys[1], (L, c.q_size, d), out_std),
        "mlp_norm": jnp.ones((L, d), dtype),
        "w_gate_up": normal(keys[2], (L, d, 2 * f), std),
        "w_down": normal(keys[3], (L, f, d), out_std),
    }
    if c.qkv_bias:
        blocks["bqkv"] = normal(keys[4], (L, qkv), std)
    params = {"embed": normal(keys[5], (c.vocab_size, d), std), "blocks": blocks, "final_norm": jnp.ones((d,), dtype)}
    if not c.tie_embeddings:
        params["lm_head"] = normal(keys[6], (d, c.vocab_size), std)
    return params


def init_fp8_state(config: LlamaConfig, precision: Precision) -> dict:
    """FP8 state for every linear of every block and for the LM head (used or not, so the layout never depends on
    the knobs: a checkpoint restores whatever the head's precision; ``lm_head_fp8`` and ``lm_head_grad_fp8`` use
    the head's)."""
    L = config.num_layers
    return {"blocks": {name: init_linear_state(precision.recipe, (L,)) for name in LINEARS},
            "lm_head": init_linear_state(precision.recipe)}


def init_cache(config: LlamaConfig, batch: int, max_len: int, dtype) -> Cache:
    """Zeroed K/V cache [L, B, K, S, H]: per (sequence, kv head) a contiguous [S, H] matrix, so the decode
    step's attention dots read it in place (no transpose of the cache inside the loop)."""
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def cache_dtype(precision: Precision):
    return jnp.dtype(precision.kv_cache_dtype if precision.kv_fp8 else precision.compute_dtype)


# ----------------------------------------------------------------------------------------------------------
# pieces


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype=None) -> jax.Array:
    """RMSNorm in f32, output in ``dtype`` (default ``x.dtype``)."""
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(dtype or x.dtype)


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [H/2], with Llama-3.1 scaling when the config has it (computed once, in numpy)."""
    h = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    s = config.rope_scaling
    if s is None:
        return inv.astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """RoPE's cos and sin at ``positions`` [...]: [..., H/2] f32 each (``apply_rope``'s, and the decode kernel's)."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout). x [B, T, heads, H], positions [B, T]."""
    # [B, T, H/2] -> [B, T, 1, H/2]
    cos, sin = (a[:, :, None, :] for a in rope_cos_sin(positions, inv_freq))
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


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


# ----------------------------------------------------------------------------------------------------------
# blocks


def slice_layers(tree, start: int, end: int, total: int):
    """Layers ``start:end`` of a stacked tree (the tree itself when that is all of it: no copy)."""
    if start == 0 and end == total:
        return tree
    return jax.tree.map(lambda a: a[start:end], tree)


def block_segments(params: Params, precision: Precision, num_layers: int):
    """``blocks`` as one stack per precision segment (rollout params arrive already split)."""
    segs = precision.segments(num_layers)
    blocks = params["blocks"]
    if isinstance(blocks, (tuple, list)):
        if len(blocks) != len(segs):
            raise ValueError(f"params hold {len(blocks)} block segments, precision wants {len(segs)}: {segs}")
        return segs, tuple(blocks)
    return segs, tuple(slice_layers(blocks, s, e, num_layers) for s, e, _ in segs)


def update_kernels(params: Params, fp8_state: dict | None, config: LlamaConfig, precision: Precision) -> dict | None:
    """The FP8 block kernels of all layers quantized once for an optimizer update (``te.quantize_for_update``):
    ``{name: {"kn", "nk", "amax"}}`` stacked over the layers (``forward_hidden`` makes each layer's ``TrainKernel``
    with its master from ``params``, so that gradients flow into ``params``). None where it does not apply: not the
    te backend, no FP8 blocks, per-layer (rollout) params, or FSDP (sharded kernels are quantized and gathered per
    layer)."""
    blocks = params.get("blocks")
    if (precision.backend != "te" or fp8_state is None or "blocks" not in fp8_state or fsdp.active()
            or not isinstance(blocks, dict) or not any(fp8 for _, _, fp8 in precision.segments(config.num_layers))):
        return None
    from fp8rl_jax.fp8 import te

    out = {}
    for name in LINEARS:
        if name in precision.bf16_linears or name not in blocks:
            continue
        q = te.quantize_for_update(lax.stop_gradient(blocks[name]), fp8_state["blocks"][name]["kernel"]["scale"],
                                   precision.recipe)
        out[name] = {"kn": q.kn, "nk": q.nk, "amax": q.amax}
    return out


def _as_bits(a: jax.Array) -> jax.Array:
    """The same bits as unsigned integers of the same width (bf16 -> uint16, f8 -> uint8)."""
    return lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))


def _cache_write(cache_bits: jax.Array, idx, rows: jax.Array, positions: jax.Array, update: jax.Array):
    """``update`` [B, T, K, H] written into layer ``idx`` of the cache [L, B, K, S, H] (held as its bits, see
    ``forward_hidden``) at (row, :, position); positions outside the cache are dropped. Returns the cache bits and
    its layer ``idx`` [B, K, S, H] in ``update``'s dtype. A cache of one array per layer (a tuple, ``cache_layers``;
    ``idx`` static) is written by ``_layer_write``.

    On CPU a decode step (T = 1) writes with a select over the layer's slice; otherwise a scatter.
    """
    if isinstance(cache_bits, tuple):
        layers = list(cache_bits)
        layers[idx], layer = _row_local(lambda c, i, r, p, u: _layer_write(c, r, p, u), layers[idx], 0, rows,
                                        positions, update)
        return tuple(layers), layer
    as_bits = cache_bits.dtype != update.dtype  # the CPU form (see forward_hidden)
    update_bits = _as_bits(update) if as_bits else update
    if update.shape[1] == 1 and as_bits:
        # CPU: a select over the layer's slice beats XLA:CPU's scatter; on GPU it would read and write the whole
        # layer every step, so the GPU keeps the scatter below (one [K, H] row per sequence)
        # [B, S]: the one position each row writes
        hit = jnp.arange(cache_bits.shape[3], dtype=positions.dtype)[None, :] == positions
        # [B, 1, K, H] -> [B, K, 1, H], broadcast along S
        layer = jnp.where(hit[:, None, :, None], update_bits.transpose(0, 2, 1, 3), cache_bits[idx])
        cache_bits = lax.dynamic_update_index_in_dim(cache_bits, layer, idx, 0)
        # read back from the updated cache: nothing reads the old cache after the in-place update (XLA would
        # otherwise copy the whole cache to keep the old value for the attention's reads)
        layer = cache_bits[idx]
    else:
        def scatter(cache_bits, idx, rows, positions, update_bits):
            # the index arrays are split by a slice, so (numpy rules) the indexed view is [B, T, K, H], update's layout
            cache_bits = cache_bits.at[idx, rows, :, positions].set(update_bits, mode="drop")
            return cache_bits, cache_bits[idx]

        cache_bits, layer = _row_local(scatter, cache_bits, idx, rows, positions, update_bits)
    return cache_bits, layer if layer.dtype == update.dtype else lax.bitcast_convert_type(layer, update.dtype)


def _row_local(write, cache, idx, rows, positions, update):
    """``write(cache, idx, rows, positions, update) -> (cache, layer)``, a scatter of each sequence's rows into its
    own part of the cache. Under a mesh of several devices (``rules.active_mesh``) it runs under ``jax.shard_map``
    over the sequences and kv heads, split as the cache is (``rules.cache_local_specs``), each device writing its
    own sequences with local row indices: XLA's partitioner cannot tell that a scatter by row stays in its row, and
    would gather the indices and updates onto every device (in every layer of every decode step)."""
    mesh = rules.active_mesh()
    if mesh is None:
        return write(cache, idx, rows, positions, update)
    cache_spec, heads_spec, rows_spec = rules.cache_local_specs(mesh, cache.shape)

    def local(cache, idx, positions, update):
        rows = jnp.broadcast_to(jnp.arange(cache.shape[-4])[:, None], positions.shape)  # [B_local, T]
        return write(cache, idx, rows, positions, update)

    # update [B, T, K, H] split as the cache's B and K; the layer returned [B, K, S, H] as well
    update_spec = P(heads_spec[0], None, heads_spec[1])
    return jax.shard_map(local, mesh=mesh, in_specs=(cache_spec, P(), rows_spec, update_spec),
                         out_specs=(cache_spec, heads_spec), check_vma=False)(
        cache, jnp.asarray(idx, jnp.int32), positions, update)


def _layer_write(layer_bits: jax.Array, rows, positions, update: jax.Array):
    """``_cache_write`` into one layer's own array [B, K, S, H] (held as its bits where its dtype differs from
    ``update``'s): a scatter, in place. Returns the new layer and the layer in ``update``'s dtype."""
    as_bits = layer_bits.dtype != update.dtype
    # the index arrays are split by a slice, so (numpy rules) the indexed view is [B, T, K, H], update's layout
    layer_bits = layer_bits.at[rows, :, positions].set(_as_bits(update) if as_bits else update, mode="drop")
    return layer_bits, lax.bitcast_convert_type(layer_bits, update.dtype) if as_bits else layer_bits


def cache_layers(cache: Cache, as_bits: bool) -> Cache:
    """[L, B, K, S, H] -> one [B, K, S, H] array per layer (a tuple), as its bits with ``as_bits`` (see
    ``forward_hidden``). Convert once around a loop of decode steps, not in every step."""
    # the bits of the whole stack, then its layers: XLA:CPU slices a bf16 array through f32, element by element
    cache = {name: _as_bits(a) if as_bits else a for name, a in cache.items()}
    return {name: tuple(a[i] for i in range(a.shape[0])) for name, a in cache.items()}


def cache_stack(layers: Cache, dtype) -> Cache:
    """``cache_layers``' inverse: the per-layer arrays (or their bits) stacked into [L, B, K, S, H] ``dtype``."""
    def stack(arrays):
        a = jnp.stack(arrays)
        return a if a.dtype == dtype else lax.bitcast_convert_type(a, dtype)
    return {name: stack(arrays) for name, arrays in layers.items()}


def split_layers(blocks) -> tuple:
    """A stacked block tree (leading axis L) as a tuple of L per-layer trees (see ``forward_hidden``)."""
    n = jax.tree.leaves(blocks)[0].shape[0]
    return tuple(jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(n))


def _split_fused(y: jax.Array, sizes: tuple[int, ...], shards: int) -> list[jax.Array]:
    """A fused GEMM output [..., sum(sizes)] split into its parts. ``shards`` > 1: its columns come interleaved per
    tensor shard (``rollout.weights.interleave_fused``: block s = [part 0's s-th slice | part 1's | ...]), so that
    with the columns split contiguously over ``shards`` devices every part is split alike and the split is local."""
    if shards == 1:
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    lead = y.shape[:-1]
    # [..., S * W] -> [..., S, W]: one block per shard
    blocks = y.reshape(*lead, shards, -1)
    parts = jnp.split(blocks, np.cumsum([s // shards for s in sizes])[:-1].tolist(), axis=-1)
    # [..., S, size / S] -> [..., size]
    return [p.reshape(*lead, -1) for p in parts]


def _block(x, layer, fp8, idx, positions, cache, kv_scales, config: LlamaConfig, precision: Precision, inv_freq,
           decode_impl: str = "xla", cache_dtype=None, attention_impl: str = "xla", fused_shards: int = 1,
           segment_ids=None, decode_tuning: DecodeTuning = DEFAULT_TUNING):
    """One transformer block. Returns the new residual stream, the updated cache and this layer's K/V amax.

    ``cache`` holds a ``cache_dtype`` cache, on CPU as its bits (see ``forward_hidden``). ``fused_shards``: see
    ``_split_fused``. ``segment_ids`` (packed rows, no cache) confine attention to each segment. ``decode_tuning``:
    the decode kernel's launch."""
    c = config
    b, t, _ = x.shape
    eps = c.rms_norm_eps
    fp8 = {k: v for k, v in (fp8 or {}).items() if k not in precision.bf16_linears}

    h = rms_norm(x, layer["attn_norm"], eps, precision.dtype)
    # [B, T, D] -> [B, T, (N + 2K) H]
    qkv = linear(h, layer["wqkv"], fp8.get("wqkv"), precision)
    if "bqkv" in layer:
        qkv = qkv + layer["bqkv"].astype(qkv.dtype)
    q, k, v = _split_fused(qkv, (c.q_size, c.kv_size, c.kv_size), fused_shards)
    # [B, T, N H] -> [B, T, N, H];  [B, T, K H] -> [B, T, K, H]
    q = apply_rope(q.reshape(b, t, c.num_heads, c.head_dim), positions, inv_freq)
    k = apply_rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), positions, inv_freq)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    kv_amax = (jnp.max(jnp.abs(k)).astype(jnp.float32), jnp.max(jnp.abs(v)).astype(jnp.float32))

    k_scale = v_scale = None
    if precision.kv_fp8:
        k_scale, v_scale = kv_scales["k"][idx], kv_scales["v"][idx]
    if cache is not None and t == 1 and decode_impl != "xla":
        # decode: the kernel writes this token's K/V into the (FP8) cache and reads each sequence's filled
        # positions 0..position only, in place
        attn, cache = _decode_attention(qkv if fused_shards == 1 else None, q, k, v, layer, fp8, idx, positions, cache,
                                        kv_scales, k_scale, v_scale, c, precision, inv_freq, decode_impl, cache_dtype,
                                        decode_tuning)
    elif cache is None:
        if precision.kv_fp8:
            k, v = kvq.round_trip(k, k_scale), kvq.round_trip(v, v_scale)
        if attention_impl != "xla":
            attn = flash_attention(q, k.astype(q.dtype), v.astype(q.dtype), attention_impl, segment_ids=segment_ids)
        else:  # [B, T, K, H] -> [B, K, T, H]
            keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            attn = attention(q, keys.astype(q.dtype), values.astype(q.dtype), positions, positions, segment_ids,
                             segment_ids)
    else:
        ck, cv = cache["k"], cache["v"]
        k_store, v_store = _kv_stored(k, v, k_scale, v_scale, precision)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], positions.shape)
        ck, keys = _cache_write(ck, idx, rows, positions, k_store.astype(cache_dtype))
        cv, values = _cache_write(cv, idx, rows, positions, v_store.astype(cache_dtype))
        cache = {"k": ck, "v": cv}
        if precision.kv_fp8:
            keys = kvq.dequantize_kv(keys, k_scale, precision.dtype)
            values = kvq.dequantize_kv(values, v_scale, precision.dtype)
        s = keys.shape[2]
        k_pos = jnp.broadcast_to(jnp.arange(s, dtype=positions.dtype)[None], (b, s))
        attn = attention(q, keys.astype(q.dtype), values.astype(q.dtype), positions, k_pos, segment_ids, segment_ids)
    # [B, T, N, H] -> [B, T, N H]
    x = linear(attn.reshape(b, t, c.q_size), layer["wo"], fp8.get("wo"), precision, residual=x)

    h = rms_norm(x, layer["mlp_norm"], eps, precision.dtype)
    if _fused_mlp(layer, fp8, precision, fused_shards):
        from fp8rl_jax.fp8 import te  # the te backend's MLP in one custom VJP: its forward is the two linears'

        # [B, T, D] -> [B T, D] -> [B, T, D]
        y = te.fp8_swiglu_mlp(h.reshape(-1, c.hidden_size).astype(precision.dtype), layer["w_gate_up"],
                              layer["w_down"], fp8["w_gate_up"], fp8["w_down"], precision.recipe, x.dtype)
        return x + y.reshape(x.shape), cache, kv_amax
    # [B, T, D] -> [B, T, 2F]
    gate, up = _split_fused(linear(h, layer["w_gate_up"], fp8.get("w_gate_up"), precision),
                            (c.intermediate_size,) * 2, fused_shards)
    x = linear(jax.nn.silu(gate) * up, layer["w_down"], fp8.get("w_down"), precision, residual=x)
    return x, cache, kv_amax


def _kv_stored(k, v, k_scale, v_scale, precision: Precision):
    """K and V as the cache stores them: quantized with their layer's scales for an FP8 cache, else as they are."""
    if precision.kv_fp8:
        return kvq.quantize_kv(k, k_scale), kvq.quantize_kv(v, v_scale)
    return k, v


def _decode_attention(qkv, q, k, v, layer, fp8, idx, positions, cache, kv_scales, k_scale, v_scale,
                      config: LlamaConfig, precision: Precision, inv_freq, decode_impl: str, cache_dtype,
                      tuning: DecodeTuning):
    """``_block``'s decode attention through ``kernels.decode_attention`` (T = 1), launched as ``tuning`` says: q
    [B, 1, N, H], this token's k, v [B, 1, K, H] (BF16, after RoPE), or ``qkv`` [B, 1, (N+2K) H] before them (None
    where its columns are laid out per tensor shard: then q, k, v as XLA split and rotated them) -> (attn [B, 1, N,
    H], the cache with k, v written at ``positions``). The kernel quantizes and stores k, v itself (no scatter per
    layer and step), from the projection also splits and rotates them (no XLA kernel per layer and step for that
    either), and reads each sequence's positions 0..position only, from the cache in place; the cache comes back in
    the form it came in (per layer or stacked, as its bits or not)."""
    c = config
    b = q.shape[0]
    layered = isinstance(cache["k"], tuple)  # one array per layer: this layer's, [B, K, S, H]
    held = {n: (a[idx] if layered else a) for n, a in cache.items()}
    native = {n: a if a.dtype == cache_dtype else lax.bitcast_convert_type(a, cache_dtype) for n, a in held.items()}
    given = dict(layer=None if layered else idx, impl=decode_impl, tuning=tuning,
                 **_decode_scales(kv_scales, k_scale, v_scale, layered, precision),
                 **_decode_output(layer["wo"], fp8.get("wo"), precision))
    if qkv is not None:
        # [B, 1, (N+2K) H] -> [B, N+2K, H]; cos, sin [B, H/2] at each sequence's position (one XLA kernel a step for
        # all layers)
        attn, k_cache, v_cache = decode_kernel.decode_attention_qkv(
            qkv.reshape(b, -1, c.head_dim), native["k"], native["v"], positions[:, 0] + 1,
            rope_cos_sin(positions[:, 0], inv_freq), **given)
    else:  # [B, 1, N, H] -> [B, K, G, H]
        q_heads = q.reshape(b, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
        attn, k_cache, v_cache = decode_kernel.decode_attention(q_heads, native["k"], native["v"], positions[:, 0] + 1,
                                                                new_kv=(k[:, 0], v[:, 0]), **given)
    written = {}
    for name, new in (("k", k_cache), ("v", v_cache)):
        if new.dtype != held[name].dtype:  # back to the bits it was held as
            new = lax.bitcast_convert_type(new, held[name].dtype)
        written[name] = (*cache[name][:idx], new, *cache[name][idx + 1:]) if layered else new
    # [B, K, G, H] -> [B, 1, N, H]
    return attn.reshape(b, 1, c.num_heads, c.head_dim), written


def _decode_scales(kv_scales, k_scale, v_scale, layered: bool, precision: Precision) -> dict:
    """The decode kernel's KV scales: with a stacked cache and stacked scales all layers' [L] (the kernel reads
    its layer's: the scan's per-layer slices would each be gathered into a buffer of their own, a kernel per layer
    and step), else this layer's (per-layer scalars, each a buffer already)."""
    if not precision.kv_fp8:
        return {}
    if not layered and not isinstance(kv_scales["k"], (tuple, list)):
        return {"k_scale": kv_scales["k"], "v_scale": kv_scales["v"]}
    return {"k_scale": k_scale, "v_scale": v_scale}


def _decode_output(wo, wo_state, precision: Precision) -> dict:
    """With the rollout's pre-quantized ``wo`` (per-tensor scaling) the decode kernel writes the attention output
    already quantized with ``wo``'s input scale, as ``linear`` would quantize it (no XLA kernel does it in the
    decode step); else the output stays in the compute dtype."""
    per_tensor = precision.fp8 and precision.recipe.scaling == "tensor"
    if wo_state is None or not per_tensor or not isinstance(wo, QuantizedKernel):
        return {}
    return {"out_scale": wo_state["x"]["scale"], "out_dtype": precision.recipe.fwd_dtype}


def _fused_mlp(layer, fp8, precision: Precision, fused_shards: int) -> bool:
    """The te backend's training forward with both MLP kernels made once for the update (``TrainKernel``: one
    device) takes ``te.fp8_swiglu_mlp``, whose backward makes the SwiGLU's gradient and its FP8 operands in one
    kernel; everything else (the rollout, BF16, the xla backend, FSDP) runs the two ``linear`` calls."""
    return (precision.fp8 and precision.backend == "te" and fused_shards == 1
            and all(isinstance(layer.get(n), TrainKernel) and fp8.get(n) is not None for n in ("w_gate_up", "w_down")))


def _remat(body, remat: str):
    """The scanned block body under ``jax.checkpoint`` with the named policy (``REMAT_POLICIES``)."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}; allowed: {REMAT_POLICIES}")
    if remat == "none":
        return body
    policy = None if remat == "full" else getattr(jax.checkpoint_policies, remat)
    # prevent_cse=False: scan already keeps XLA from CSE-ing the recomputation away; the extra guard only costs speed
    return jax.checkpoint(body, policy=policy, prevent_cse=False)


def forward_hidden(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: LlamaConfig,
    precision: Precision,
    fp8_state: dict | None = None,
    kv_scales: dict | None = None,
    cache: Cache | None = None,
    decode_attention: str = "auto",
    decode_tuning: DecodeTuning = DEFAULT_TUNING,
    remat: str = "none",
    cache_dtype=None,
    fused_shards: int = 1,
    segment_ids: jax.Array | None = None,
    update_kernels: dict | None = None,
):
    """Run the blocks and the final norm.

    tokens, positions: [B, T] int32. Sequences are right-padded; positions count from 0 at each sequence's
    first token (without a cache they must be 0..T-1 in every row: ``precision.attention`` ``cudnn``, or ``auto``
    on a GPU, masks causally by index, not by position).

    ``segment_ids`` [B, T] int32 (no cache): packed rows (``fp8rl_jax.rl.packing``), several sequences per row, each
    a contiguous run of one id with its own ``positions`` from 0 (RoPE restarts), the row's padding tail a run of
    its own; a token attends to the earlier tokens of its own run only, in every attention implementation. A row
    holds at most ``row_segments(T)`` sequences (cuDNN's packed layout takes a static table of them).

    With ``cache`` the new K/V are written at ``positions`` and attention reads the whole cache, except in decode
    (T == 1) with ``decode_attention`` ``pallas`` / ``pallas_interpret`` (``auto``: pallas on a GPU backend), which
    reads positions 0..position of each sequence only (``fp8rl_jax.kernels.decode_attention``), launched as
    ``decode_tuning`` says (a static ``DecodeTuning``).

    A precision segment of ``blocks`` may come as a tuple of per-layer trees (``split_layers``: the CPU's rollout
    weights, see ``Engine``): its layers then run as an unrolled loop that reads each layer's weights in place, where a
    scan over stacked weights has XLA:CPU copy every layer's slice before its GEMM. With every segment so split the
    cache may also come as one array per layer (``cache_layers``), held as its bits where ``cache_dtype`` (the dtype
    they stand for) differs from theirs; it is returned in the form it came in. ``fp8_state["blocks"]`` and
    ``kv_scales`` may come per layer as well (a tuple of per-layer trees; a tuple of scalars each).

    Returns ``(hidden [B, T, D], cache, kv_amax)``; ``kv_amax = {"k": [L], "v": [L]}`` feeds KV calibration.
    ``remat`` (one of ``REMAT_POLICIES``) rematerializes each scanned block in the backward pass. Under a mesh
    (``fp8rl_jax.parallel``) the residual stream is constrained at block boundaries to batch over data+fsdp.
    ``fused_shards`` > 1: the fused q|k|v and gate|up columns of ``params`` come interleaved per tensor shard (the
    rollout's layout, ``rollout.weights.interleave_fused``), split by ``_split_fused``.
    ``update_kernels`` (``update_kernels()``): the FP8 blocks' kernels quantized once for an optimizer update; the
    linears use them, and their gradients still go to ``params``.
    """
    if precision.fp8 and fp8_state is None:
        raise ValueError(f"precision backend {precision.backend!r} needs fp8_state")
    if precision.kv_fp8 and kv_scales is None:
        raise ValueError("an FP8 KV cache needs kv_scales")
    if segment_ids is not None and cache is not None:
        raise ValueError("segment_ids (packed rows) are for the full-sequence forward, without a cache")
    c = config
    decode_impl = decode_kernel.resolve_impl(decode_attention)
    attention_impl = resolve_attention(precision.attention, precision.dtype, c.head_dim)
    inv_freq = rope_inv_freq(c)
    # the residual stream stays in f32: only the GEMM inputs are rounded to the compute dtype, so the rounding
    # is the same whatever the batch and sequence shapes (decode vs full sequence) and errors do not pile up
    # across layers in the stream itself
    if "embed_bits" in params:  # the table's bits too (CPU rollout weights, see rollout.weights.per_layer)
        x = lax.bitcast_convert_type(params["embed_bits"][tokens], params["embed"].dtype)
    else:
        x = params["embed"][tokens]
    x = x.astype(precision.dtype).astype(jnp.float32)
    x = constrain(x, RESIDUAL_AXES)
    segs, seg_blocks = block_segments(params, precision, c.num_layers)
    # the layers write the cache as its bits (uint16 for bf16, uint8 for f8): XLA:CPU supports no bf16 / f8
    # scatter or dynamic-update-slice and would convert the whole [L, B, K, S, H] cache to f32 and back around
    # every write, in every layer of every decode step
    layered = cache is not None and isinstance(cache["k"], (tuple, list))
    if layered:
        if not all(isinstance(b, (tuple, list)) for b in seg_blocks):
            raise ValueError("a per-layer cache (cache_layers) needs per-layer blocks (split_layers)")
        cache = {name: tuple(a) for name, a in cache.items()}
        cache_dtype = jnp.dtype(cache_dtype or cache["k"][0].dtype)
    else:
        cache_dtype = None if cache is None else cache["k"].dtype
        if cache is not None and jax.default_backend() == "cpu":  # a free view on GPU, where none is needed
            cache = {name: _as_bits(a) for name, a in cache.items()}
    # the blocks' FP8 state may come per layer too (a tuple of per-layer trees, as the CPU engine passes it): the
    # unrolled layers then read one array each and are identical computations, which XLA compiles once (slices of
    # a stacked state differ from layer to layer: 30 layers then take several times as long to compile)
    fp8_blocks = fp8_state.get("blocks") if fp8_state is not None else None  # absent without FP8 blocks
    fp8_per_layer = isinstance(fp8_blocks, (tuple, list))
    amax_k, amax_v = [], []
    for (start, end, is_fp8), blocks in zip(segs, seg_blocks, strict=True):
        fp8 = None
        if is_fp8:
            fp8 = tuple(fp8_blocks[start:end]) if fp8_per_layer else slice_layers(fp8_blocks, start, end, c.num_layers)
        if isinstance(blocks, (tuple, list)):
            # per-layer weights: an unrolled loop, each layer's arrays read where they are (no slice, no copy)
            for i, layer in enumerate(blocks):
                fp8_layer = None
                if fp8 is not None:
                    fp8_layer = fp8[i] if fp8_per_layer else jax.tree.map(lambda a, i=i: a[i], fp8)
                x, cache, (ak, av) = _block(x, layer, fp8_layer, start + i, positions, cache, kv_scales, c,
                                            precision, inv_freq, decode_impl, cache_dtype, attention_impl,
                                            fused_shards, segment_ids, decode_tuning)
                x = constrain(x, RESIDUAL_AXES)
                amax_k.append(ak[None])
                amax_v.append(av[None])
            continue
        if fp8 is not None and fp8_per_layer:  # a scan: stacked again
            fp8 = jax.tree.map(lambda *a: jnp.stack(a), *fp8)
        # FSDP (a mesh with fsdp > 1, no cache: scoring and training): the block kernels are gathered in their GEMM's
        # precision, FP8 bytes or BF16, never the f32 masters; the FP8 kernels' amaxes of all layers in one
        # all-reduce (parallel.fsdp)
        gather = cache is None and fsdp.active()
        amaxes = None
        if gather and fp8 is not None:
            amaxes = fsdp.kernel_amaxes(blocks, [n for n in LINEARS if n not in precision.bf16_linears])

        hoisted = None
        if update_kernels is not None and is_fp8 and not gather:
            hoisted = slice_layers(update_kernels, start, end, c.num_layers)

        def body(carry, xs, is_fp8=is_fp8, gather=gather):
            x, cache = carry
            layer, fp8_layer, idx, kernel_amax, hoisted = xs
            if gather:
                layer = fsdp.block_kernels(layer, kernel_amax)
            if hoisted is not None:  # the masters beside their FP8 operands (``update_kernels``)
                layer = {**layer, **{name: TrainKernel(layer[name], **q) for name, q in hoisted.items()}}
            x, cache, amax = _block(x, layer, fp8_layer, idx, positions, cache, kv_scales, c, precision, inv_freq,
                                    decode_impl, cache_dtype, attention_impl, fused_shards, segment_ids, decode_tuning)
            return (constrain(x, RESIDUAL_AXES), cache), amax

        body = _remat(body, remat)
        if remat == "none" and cache is None and jax.default_backend() == "cpu":
            # under jax.grad the scan stacks each block's bf16 / f8 residuals layer by layer, and XLA:CPU updates a
            # bf16 / f8 buffer by converting all of it to f32 and back (every layer: quadratic in depth, most of a
            # CPU train step). Recomputed in the backward pass, a block leaves only its f32 input to stack. No
            # effect without a gradient (scoring); numerics unchanged (the same forward, computed again).
            body = jax.checkpoint(body, prevent_cse=False)
        xs = (blocks, fp8, jnp.arange(start, end), amaxes, hoisted)
        (x, cache), (ak, av) = lax.scan(body, (x, cache), xs)
        amax_k.append(ak)
        amax_v.append(av)
    if cache is not None and not layered and cache["k"].dtype != cache_dtype:
        cache = {name: lax.bitcast_convert_type(a, cache_dtype) for name, a in cache.items()}
    x = constrain(rms_norm(x, params["final_norm"], c.rms_norm_eps, precision.dtype), RESIDUAL_AXES)
    return x, cache, {"k": jnp.concatenate(amax_k), "v": jnp.concatenate(amax_v)}


def lm_head_kernel(params: Params):
    """[D, V]: the untied head, or the embedding table transposed."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T


def logits_from_hidden(params: Params, hidden: jax.Array, *, precision: Precision, fp8_state=None) -> jax.Array:
    """f32 logits [..., V] (the head runs in BF16 unless ``precision.lm_head_fp8``)."""
    state = fp8_state.get("lm_head") if (fp8_state is not None and precision.lm_head_fp8) else None
    if "lm_head" in params:
        return linear(hidden, params["lm_head"], state, precision, out_dtype=jnp.float32)
    # tied: the embedding table [V, D] is the head's [N, K] kernel, contracted as it is stored
    return linear(hidden, params["embed"], state, precision, out_dtype=jnp.float32, kernel_nk=True)


def forward(params: Params, tokens: jax.Array, positions: jax.Array | None = None, **kw):
    """``forward_hidden`` then the head: ``(logits [B, T, V] f32, cache, kv_amax)``."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden, cache, kv_amax = forward_hidden(params, tokens, positions, **kw)
    logits = logits_from_hidden(params, hidden, precision=kw["precision"], fp8_state=kw.get("fp8_state"))
    return logits, cache, kv_amax
