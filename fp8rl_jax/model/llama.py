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

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8 import te, train_kernel
from fp8rl_jax.fp8.block import BLOCK, Tiles
from fp8rl_jax.fp8.linear import linear
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import init_linear_state
from fp8rl_jax.fp8.train_kernel import TrainKernel
from fp8rl_jax.fp8.xla import QuantizedKernel
from fp8rl_jax.kernels import decode_attention as decode_kernel
from fp8rl_jax.kernels.decode_attention import DEFAULT_TUNING, DecodeTuning
from fp8rl_jax.model import mlp
from fp8rl_jax.model.attention import attention, flash_attention, resolve_attention
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.model.kv_cache import Cache, _as_bits, _cache_write, _kv_stored
from fp8rl_jax.model.norm import norm_tiles_apply, normed, rms_norm
from fp8rl_jax.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from fp8rl_jax.parallel import fsdp, rules
from fp8rl_jax.parallel.rules import RESIDUAL_AXES, constrain

LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
# what the backward pass of a block keeps from its forward (``jax.checkpoint`` policies, ``config.model.remat``):
# none = everything the autodiff saves; full = only the block's inputs (the forward runs twice); the
# ``*_saveable`` ones keep the matmul outputs and recompute the elementwise work
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")

Params = dict


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
    """The FP8 block kernels of all layers quantized once for an optimizer update (``fp8.train_kernel``): ``{name:
    {"kn", "nk", "amax", "scale_inv"}}`` stacked over the layers (``forward_hidden`` makes each layer's
    ``TrainKernel`` with its master from ``params``, so that gradients flow into ``params``). None where it does not
    apply: neither the te backend nor block scaling (``hoists_block_kernels``), no FP8 blocks, per-layer (rollout)
    params, or FSDP (sharded kernels are quantized and gathered per layer)."""
    blocks, te_backend, recipe = params.get("blocks"), precision.backend == "te", precision.recipe
    if (not (te_backend or precision.fp8 and train_kernel.hoists_block_kernels(recipe)) or fp8_state is None
            or "blocks" not in fp8_state or fsdp.active() or not isinstance(blocks, dict)
            or not any(fp8 for _, _, fp8 in precision.segments(config.num_layers))):
        return None
    out = {}
    for name in (n for n in LINEARS if n not in precision.bf16_linears and n in blocks):
        kernel = lax.stop_gradient(blocks[name])
        q = (te.quantize_for_update(kernel, fp8_state["blocks"][name]["kernel"]["scale"], recipe) if te_backend
             else train_kernel.block_kernel_for_update(kernel, recipe))
        out[name] = {"kn": q.kn, "nk": q.nk, "amax": q.amax, "scale_inv": q.scale_inv}
    return out


def split_layers(blocks) -> tuple:
    """A stacked block tree (leading axis L) as a tuple of L per-layer trees (see ``forward_hidden``)."""
    n = jax.tree.leaves(blocks)[0].shape[0]
    return tuple(jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(n))


def _block(x, layer, fp8, idx, positions, cache, kv_scales, config: LlamaConfig, precision: Precision, inv_freq,
           decode_impl: str = "xla", cache_dtype=None, attention_impl: str = "xla", fused_shards: int = 1,
           segment_ids=None, decode_tuning: DecodeTuning = DEFAULT_TUNING):
    """One transformer block. Returns the new residual stream, the updated cache and this layer's K/V amax.

    ``cache`` holds a ``cache_dtype`` cache, on CPU as its bits (see ``forward_hidden``). ``fused_shards``: see
    ``mlp.split_fused``. ``segment_ids`` (packed rows, no cache) confine attention to each segment. ``decode_tuning``:
    the decode kernel's launch."""
    c = config
    b, t, _ = x.shape
    eps = c.rms_norm_eps
    fp8 = {k: v for k, v in (fp8 or {}).items() if k not in precision.bf16_linears}

    _, h = normed(x, None, layer["attn_norm"], eps, layer["wqkv"], fp8.get("wqkv"), precision)
    # [B, T, D] -> [B, T, (N + 2K) H]
    qkv = linear(h, layer["wqkv"], fp8.get("wqkv"), precision)
    if "bqkv" in layer:
        qkv = qkv + layer["bqkv"].astype(qkv.dtype)
    q, k, v = mlp.split_fused(qkv, (c.q_size, c.kv_size, c.kv_size), fused_shards)
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
    attn = attn if isinstance(attn, Tiles) else attn.reshape(b, t, c.q_size)
    if norm_tiles_apply(x, layer["w_gate_up"], fp8.get("w_gate_up"), precision):  # the add in the norm's kernel
        x, h = normed(x, linear(attn, layer["wo"], fp8.get("wo"), precision, x.dtype), layer["mlp_norm"], eps,
                      layer["w_gate_up"], fp8.get("w_gate_up"), precision)
    else:
        x = linear(attn, layer["wo"], fp8.get("wo"), precision, residual=x)
        h = rms_norm(x, layer["mlp_norm"], eps, precision.dtype)
    return mlp.swiglu_mlp(x, h, layer, fp8, c, precision, fused_shards), cache, kv_amax


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
                 **_decode_output(layer["wo"], fp8.get("wo"), precision, c.q_size))
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
    if isinstance(attn, tuple):  # its tiles: [B, K, G, H] -> [B, 1, N H]; inverse scales [N H / 128, B] -> [B, 1, .]
        q_tiles, inv_t = attn
        return Tiles(q_tiles.reshape(b, 1, c.q_size), inv_t.T.reshape(b, 1, -1)), written
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


def _decode_output(wo, wo_state, precision: Precision, q_size: int) -> dict:
    """With the rollout's pre-quantized ``wo`` the decode kernel writes the attention output as ``linear`` would
    quantize it (no XLA kernel does it in the decode step): per-tensor scaling with ``wo``'s input scale; block
    scaling in its 1 x 128 tiles (``out_tiles``, outside a mesh, with 128 dividing N H: ``linear`` takes them as a
    ``block.Tiles``). Else the output stays in the compute dtype."""
    recipe = precision.recipe
    if wo_state is None or not precision.fp8 or not isinstance(wo, QuantizedKernel):
        return {}
    if recipe.scaling == "tensor":
        return {"out_scale": wo_state["x"]["scale"], "out_dtype": recipe.fwd_dtype}
    if recipe.tiles_forward and q_size % BLOCK == 0 and rules.active_mesh() is None:
        return {"out_tiles": recipe.fwd_dtype}
    return {}


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
    rollout's layout, ``rollout.weights.interleave_fused``), split by ``mlp.split_fused``.
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
        # all-reduce (parallel.fsdp), where the recipe's delayed scales read them (Fp8Recipe.delayed)
        gather = cache is None and fsdp.active()
        amaxes = None
        if gather and fp8 is not None and precision.recipe.delayed:
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
