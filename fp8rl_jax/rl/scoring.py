"""The scoring forward: per-token logprobs of given sequences under pi_T = softmax(logits / T).

One function serves the old-policy logprobs, the reference logprobs (KL) and the loss under ``jax.grad``, with
the same FP8 state and KV scales the sampler used, so rollout and trainer differ only by kernel numerics.

The LM head runs in chunks of the sequence axis, with its own custom VJP per precision: the BF16 head and the
autodiff reference in ``model/heads.py``, the FP8 heads (``lm_head_fp8``, ``lm_head_grad_fp8``) in
``model/fp8_heads.py``; ``token_logprobs`` picks one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.model.fp8_heads import fp8_chunked_head_logprobs, fp8_grad_head_logprobs
from fp8rl_jax.model.heads import HEAD_CHUNK, autodiff_head_logprobs, chunked_head_logprobs


def token_logprobs(
    params: dict,
    tokens: jax.Array,
    *,
    config: LlamaConfig,
    precision: Precision,
    temperature: float = 1.0,
    fp8_state: dict | None = None,
    kv_scales: dict | None = None,
    chunk: int = HEAD_CHUNK,
    with_entropy: bool = False,
    remat: str = "none",
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    update_kernels: dict | None = None,
):
    """``logp[b, t] = log pi_T(tokens[b, t] | tokens[b, :t])`` for t >= 1 (0 at t = 0).

    tokens: [B, T] right-padded sequences (prompt then completion). Returns ``(logp [B, T], entropy [B, T] or
    None, kv_amax)``; ``entropy[b, t]`` is the entropy of pi_T at the step that produced token t. ``remat``: the
    blocks' rematerialization policy (``llama.REMAT_POLICIES``), for the loss under ``jax.grad``.
    ``update_kernels``: the FP8 block kernels quantized once for the optimizer update (``llama.update_kernels``).

    Packed rows (``fp8rl_jax.rl.packing``): ``segment_ids`` and ``positions`` [B, T] (``llama.forward_hidden``);
    a token's logprob is then conditioned on the earlier tokens of its own segment, and a segment's first token
    (position 0) gets 0, as t = 0 of an unpacked row.
    """
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _, kv_amax = llama.forward_hidden(
        params, tokens, positions, config=config, precision=precision, fp8_state=fp8_state, kv_scales=kv_scales,
        remat=remat, segment_ids=segment_ids, update_kernels=update_kernels,
    )
    # position t - 1 predicts token t: [B, T - 1, D] against targets [B, T - 1]
    hidden, targets = hidden[:, :-1], tokens[:, 1:]
    head_state = fp8_state.get("lm_head") if (fp8_state is not None and precision.lm_head_fp8) else None
    # lm_head_grad_fp8 (lm_head_fp8 wins where both are set): the BF16 head, its backward GEMMs in FP8 (and its
    # logit recompute, with lm_head_recompute_fp8: fp8_grad_head_logprobs reads it)
    grad_state = fp8_state.get("lm_head") if (fp8_state is not None and precision.lm_head_grad_fp8) else None
    tied = "lm_head" not in params
    kernel = params["embed"] if tied else params["lm_head"]
    if head_state is not None and precision.recipe.scaling == "tensor":
        logp, ent = fp8_chunked_head_logprobs(hidden, kernel, targets, head_state, precision=precision,
                                              temperature=temperature, chunk=chunk, with_entropy=with_entropy,
                                              kernel_nk=tied)
    elif head_state is not None:  # rowwise scaling: each token's row and each channel scaled by its own amax
        logp, ent = autodiff_head_logprobs(params, hidden, targets, precision=precision, head_state=head_state,
                                           temperature=temperature, chunk=chunk, with_entropy=with_entropy)
    elif grad_state is not None:  # either scaling: the backward is per tensor (the forward is not FP8)
        logp, ent = fp8_grad_head_logprobs(hidden, kernel, targets, grad_state, precision=precision,
                                           temperature=temperature, chunk=chunk, with_entropy=with_entropy,
                                           kernel_nk=tied)
    else:
        logp, ent = chunked_head_logprobs(hidden, kernel, targets, temperature=temperature, chunk=chunk,
                                          with_entropy=with_entropy, kernel_nk=tied, dtype=precision.dtype)
    zero = jnp.zeros((b, 1), jnp.float32)
    logp = jnp.concatenate([zero, logp], axis=1)
    entropy = jnp.concatenate([zero, ent], axis=1) if with_entropy else None
    if segment_ids is not None:  # a segment's first token was "predicted" from the segment before it: no logprob
        first = positions == 0
        logp = jnp.where(first, 0.0, logp)
        entropy = jnp.where(first, 0.0, entropy) if with_entropy else None
    return logp, entropy, kv_amax

