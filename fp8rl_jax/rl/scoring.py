"""The scoring forward: per-token logprobs of given sequences under pi_T = softmax(logits / T).

One function serves the old-policy logprobs, the reference logprobs (KL) and the loss under ``jax.grad``, with
the same FP8 state and KV scales the sampler used, so rollout and trainer differ only by kernel numerics.

The head runs in chunks of the sequence axis under ``jax.checkpoint``: the [B, T, V] logits are never all live
(128k-vocab logits of a few thousand tokens are gigabytes), and the backward pass recomputes each chunk.

With ``lm_head_fp8`` the head's FP8 state must not be closed over by the chunk loop: a value closed over by
``lax.map``'s body gets the *sum* of its per-iteration cotangents, and the state's cotangent is an amax
observation (``fp8/recipe.py``), which combines with max. Each chunk gets its own copy of the state instead
(``_per_chunk``), and the copies' cotangents are reduced with max.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.rl.losses import entropy_from_logits


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _per_chunk(state, n: int):
    """``state`` repeated along a new leading axis of size ``n``, one copy per chunk; the backward pass takes the
    max of the copies' cotangents (amax observations, >= 0) where a broadcast would sum them."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), state)


def _per_chunk_fwd(state, n: int):
    return _per_chunk(state, n), None


def _per_chunk_bwd(n: int, _, cotangent):
    return (jax.tree.map(lambda c: jnp.max(c, axis=0), cotangent),)


_per_chunk.defvjp(_per_chunk_fwd, _per_chunk_bwd)


def token_logprobs(
    params: dict,
    tokens: jax.Array,
    *,
    config: LlamaConfig,
    precision: Precision,
    temperature: float = 1.0,
    fp8_state: dict | None = None,
    kv_scales: dict | None = None,
    chunk: int = 256,
    with_entropy: bool = False,
    remat: str = "none",
):
    """``logp[b, t] = log pi_T(tokens[b, t] | tokens[b, :t])`` for t >= 1 (0 at t = 0).

    tokens: [B, T] right-padded sequences (prompt then completion). Returns ``(logp [B, T], entropy [B, T] or
    None, kv_amax)``; ``entropy[b, t]`` is the entropy of pi_T at the step that produced token t. ``remat``: the
    blocks' rematerialization policy (``llama.REMAT_POLICIES``), for the loss under ``jax.grad``.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _, kv_amax = llama.forward_hidden(
        params, tokens, positions, config=config, precision=precision, fp8_state=fp8_state, kv_scales=kv_scales,
        remat=remat,
    )
    # position t - 1 predicts token t: [B, T - 1, D] against targets [B, T - 1]
    hidden, targets = hidden[:, :-1], tokens[:, 1:]
    n = t - 1
    c = min(chunk, n)
    pad = -n % c
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [B, nC * C, D] -> [nC, B, C, D] so that scan walks the chunks
    hidden = hidden.reshape(b, -1, c, hidden.shape[-1]).swapaxes(0, 1)
    targets = targets.reshape(b, -1, c).swapaxes(0, 1)

    head_state = fp8_state.get("lm_head") if (fp8_state is not None and precision.lm_head_fp8) else None
    if head_state is not None:
        head_state = _per_chunk(head_state, hidden.shape[0])  # [nC, ...] per leaf

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def head(h, y, state):
        state = None if state is None else {"lm_head": state}
        logits = llama.logits_from_hidden(params, h, precision=precision, fp8_state=state)
        logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)  # [B, C, V]
        logp = jnp.take_along_axis(logp_all, y[..., None], axis=-1)[..., 0]
        ent = entropy_from_logits(logits / temperature) if with_entropy else jnp.zeros_like(logp)
        return logp, ent

    logp, ent = jax.lax.map(lambda xs: head(*xs), (hidden, targets, head_state))
    # [nC, B, C] -> [B, T - 1]
    unchunk = lambda a: a.swapaxes(0, 1).reshape(b, -1)[:, :n]
    zero = jnp.zeros((b, 1), jnp.float32)
    logp = jnp.concatenate([zero, unchunk(logp)], axis=1)
    entropy = jnp.concatenate([zero, unchunk(ent)], axis=1) if with_entropy else None
    return logp, entropy, kv_amax
