"""The LM head over the final hidden state: per-token logprobs (and entropies) of given targets under
pi_T = softmax(logits / T), chunk by chunk over the sequence, with custom VJPs. The scoring forward
(``rl.scoring.token_logprobs``) runs one per precision; the exact sampler (``rollout.exact``) computes one chunk of
the same head to draw a token from.

The head runs in chunks of the sequence axis: the [B, T, V] logits are never all live (128k-vocab logits of a
few thousand tokens are gigabytes), and the backward pass recomputes each chunk's logits.

The BF16 head (the default) is ``chunked_head_logprobs``, a ``custom_vjp``. The master kernel (f32, [D, V], or
the tied embedding [V, D] contracted as stored) is cast to the compute dtype once per call, outside the chunk
loop; each chunk's GEMM takes compute-dtype operands and accumulates in f32, and the log-softmax, the target's
logprob and the entropy are f32. The forward keeps per token only the logprob, the entropy and the log-softmax
statistics (max and log-sum-exp); the backward recomputes the chunk's logits, forms the logit gradient in f32,
rounds it to the compute dtype (standard mixed precision: the two backward GEMMs are compute-dtype GEMMs with f32
accumulation, never f32 GEMMs against an upcast kernel) and accumulates the kernel's gradient over the chunks in
an f32 carry. The entropy's gradient is exact (-p (log p + H) / T per logit) and costs nothing when the entropy is
not differentiated (the train step reports it as a metric under ``stop_gradient``: a symbolic zero cotangent). In
f32 compute this is the plain autodiff of the same math.

The FP8 heads (``lm_head_fp8``, ``lm_head_grad_fp8``, ``lm_head_recompute_fp8``) are in ``fp8_heads.py``, built on
this module's chunking and log-softmax statistics.

``autodiff_head_logprobs`` (the reference both heads are tested against, and the FP8 head under ``rowwise``
scaling) runs ``linear`` per chunk under ``jax.checkpoint`` and plain autodiff. Its FP8 state must not be closed
over by the chunk loop: a value closed over by ``lax.map``'s body gets the *sum* of its per-iteration cotangents,
and the state's cotangent is an amax observation (``fp8/recipe.py``), which combines with max. Each chunk gets its
own copy of the state instead (``_per_chunk``), and the copies' cotangents are reduced with max.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import rounded
from fp8rl_jax.model import llama
from fp8rl_jax.parallel import fsdp

HEAD_CHUNK = 256  # sequence positions per chunk of the head: the [B, C, V] logits live at once


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


def _to_chunks(x: jax.Array, c: int) -> jax.Array:
    """[B, n, ...] -> [nC, B, C, ...], zero-padded to a multiple of ``c``, so that a scan walks the chunks."""
    b, n = x.shape[:2]
    x = jnp.pad(x, ((0, 0), (0, -n % c)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(b, -1, c, *x.shape[2:]).swapaxes(0, 1)


def _from_chunks(x: jax.Array, n: int) -> jax.Array:
    """[nC, B, C] -> [B, n]"""
    return x.swapaxes(0, 1).reshape(x.shape[1], -1)[:, :n]



def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy (nats, f32) of softmax(logits) over the last axis; -inf logits (banned tokens) are allowed."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    # 0 * log 0 = 0; the where is on logp itself so the backward pass never multiplies by -inf either
    safe_logp = jnp.where(p > 0, logp, 0.0)
    return -jnp.sum(p * safe_logp, axis=-1)


# ----------------------------------------------------------------------------------------------------------
# the BF16 head: one cast of the kernel per call, a custom VJP over the chunks


@dataclasses.dataclass(frozen=True)
class _HeadSpec:
    temperature: float
    with_entropy: bool
    kernel_nk: bool  # the kernel is stored [V, D] (a tied embedding), else [D, V]
    dtype: jnp.dtype  # the compute dtype: the GEMM operands are rounded to it
    operand_dtype: jnp.dtype  # the dtype the GEMM operands are held in (``dtype``, or f32 on CPU: see _operand)
    kernel_dtype: jnp.dtype  # the master kernel's dtype (its gradient's)
    gather: P | None = None  # under FSDP: the master's PartitionSpec, gathered cast to ``dtype`` (parallel.fsdp)


def _operand(x: jax.Array, spec: _HeadSpec) -> jax.Array:
    """``x`` rounded to the compute dtype, held in ``spec.operand_dtype``.

    On CPU (no BF16 arithmetic on most hosts) BF16 GEMMs are slower than f32 GEMMs over the same BF16 values, which
    give the same result (a product of two BF16 values is exact in f32, and both accumulate in f32). The rounding
    is ``reduce_precision``, which XLA keeps, where it may drop an f32 -> BF16 -> f32 convert pair.
    """
    if spec.operand_dtype == spec.dtype:
        return x.astype(spec.dtype)
    return rounded(x, spec.dtype, spec.operand_dtype)


def _head_operand(kernel: jax.Array, spec: _HeadSpec) -> jax.Array:
    """The master head kernel as the GEMM operand (``_operand``). Under FSDP its shards are cast to the compute
    dtype where they are and gathered in it (``parallel.fsdp``), never as f32: the same values."""
    if spec.gather is None:
        return _operand(kernel, spec)
    return fsdp.gather_bits(kernel.astype(spec.dtype), spec.gather).astype(spec.operand_dtype)


def _scaled_logits(h: jax.Array, w: jax.Array, spec: _HeadSpec) -> jax.Array:
    """[B, C, D] x the cast kernel -> logits / T [B, C, V], f32 (compute-dtype operands, f32 accumulation)."""
    z = lax.dot_general(h, w, (((2,), (1 if spec.kernel_nk else 0,)), ((), ())), preferred_element_type=jnp.float32)
    return z / spec.temperature


def _head_forward(hidden, w, targets, spec: _HeadSpec):
    """Per chunk: ``(logp, entropy, max, lse)``, each [nC, B, C]; ``logp_all = (z - max) - lse``."""

    def chunk(xs):
        h, y = xs
        return _chunk_logprobs(_scaled_logits(h, w, spec), y, spec.with_entropy)  # logits [B, C, V]

    return lax.map(chunk, (hidden, targets))


def _chunk_logprobs(z: jax.Array, y: jax.Array, with_entropy: bool):
    """One chunk's ``(logp, entropy, max, lse)`` [B, C] of targets ``y`` [B, C] under scaled logits ``z`` [B, C, V]."""
    m = jnp.max(z, axis=-1)
    shifted = z - m[..., None]
    e = jnp.exp(shifted)
    lse = jnp.log(jnp.sum(e, axis=-1))
    # the target's logit gathered, then shifted: the same float ops as log_softmax followed by the gather
    logp = (jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0] - m) - lse
    if with_entropy:
        # H = lse - sum(e * shifted) / sum(e): one pass with the normaliser, and no cancellation (lse >= 0 and
        # shifted <= 0); e * shifted is 0 where e underflows, even against a -inf logit
        es = jnp.sum(jnp.where(e > 0, e * shifted, 0.0), axis=-1)
        ent = lse - es / jnp.sum(e, axis=-1)
    else:
        ent = jnp.zeros_like(logp)
    return logp, ent, m, lse


def _head_cotangents(cotangents, with_entropy: bool):
    """``(g_logp, g_ent, entropy_grad)`` from a head's (logp, entropy) cotangents, symbolic zeros made concrete
    (``entropy_grad`` False: the entropy was not differentiated and ``g_ent`` is not read)."""
    g_logp, g_ent = cotangents
    if isinstance(g_logp, SymbolicZero):
        g_logp = jnp.zeros(g_logp.shape, jnp.float32)
    entropy_grad = with_entropy and not isinstance(g_ent, SymbolicZero)
    if not entropy_grad:
        g_ent = jnp.zeros_like(g_logp)
    return g_logp, g_ent, entropy_grad


def _logits_cotangent(z, y, m, lse, g, g_h, ent, entropy_grad: bool) -> jax.Array:
    """The cotangent of one chunk's scaled logits ``z`` [B, C, V] from those of the target logprobs ``g`` and (with
    ``entropy_grad``) the entropies ``g_h`` [B, C], f32; ``m``, ``lse`` the forward's log-softmax statistics."""
    logp_all = (z - m[..., None]) - lse[..., None]
    p = jnp.exp(logp_all)
    onehot = lax.broadcasted_iota(jnp.int32, z.shape, 2) == y[..., None]
    # d logp / d (z / T) = onehot - p
    dz = jnp.where(onehot, g[..., None], 0.0) - p * g[..., None]
    if entropy_grad:
        # d H / d (z / T) = -p (log p + H)
        dz = dz - g_h[..., None] * (p * (jnp.where(p > 0, logp_all, 0.0) + ent[..., None]))
    return dz


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked_head(hidden, kernel, targets, spec: _HeadSpec):
    logp, ent, _, _ = _head_forward(_operand(hidden, spec), _head_operand(kernel, spec), targets, spec)
    return logp, ent


def _chunked_head_fwd(hidden, kernel, targets, spec: _HeadSpec):
    hidden, kernel, targets = hidden.value, kernel.value, targets.value  # symbolic_zeros: CustomVJPPrimal
    # the kernel cast (and laid out) once per call, outside the chunk loop; kept for the backward pass
    hidden, w = _operand(hidden, spec), _head_operand(kernel, spec)
    logp, ent, m, lse = _head_forward(hidden, w, targets, spec)
    return (logp, ent), (hidden, w, targets, m, lse, ent)


def _chunked_head_bwd(spec: _HeadSpec, res, cotangents):
    hidden, w, targets, m, lse, ent = res
    g_logp, g_ent, entropy_grad = _head_cotangents(cotangents, spec.with_entropy)
    tied = spec.kernel_nk

    def chunk(dw, xs):
        h, y, m, lse, g, g_h, ent = xs
        z = _scaled_logits(h, w, spec)  # recomputed: [B, C, V] f32
        dz = _logits_cotangent(z, y, m, lse, g, g_h, ent, entropy_grad)
        dlogits = _operand(dz / spec.temperature, spec)
        # dW in f32, summed over the chunks in f32; dx per chunk (f32 out, rounded once after the loop: XLA:CPU
        # would convert a stacked bf16 buffer to f32 and back at every chunk's write)
        if tied:  # [B, C, V] x [B, C, D] -> [V, D]
            dw = dw + lax.dot_general(dlogits, h, (((0, 1), (0, 1)), ((), ())), preferred_element_type=jnp.float32)
        else:  # [B, C, D] x [B, C, V] -> [D, V]
            dw = dw + lax.dot_general(h, dlogits, (((0, 1), (0, 1)), ((), ())), preferred_element_type=jnp.float32)
        dx = lax.dot_general(dlogits, w, (((2,), (0 if tied else 1,)), ((), ())), preferred_element_type=jnp.float32)
        return dw, dx

    dw, dx = lax.scan(chunk, jnp.zeros(w.shape, jnp.float32), (hidden, targets, m, lse, g_logp, g_ent, ent))
    dw = dw.astype(spec.kernel_dtype)
    if spec.gather is not None:  # the devices' partial gradients summed onto the master's shards
        dw = fsdp.reduce_to(dw, spec.gather)
    return dx.astype(spec.dtype), dw, None


_chunked_head.defvjp(_chunked_head_fwd, _chunked_head_bwd, symbolic_zeros=True)


def _head_spec(kernel: jax.Array, *, temperature: float, with_entropy: bool, kernel_nk: bool, dtype) -> _HeadSpec:
    dtype = jnp.dtype(dtype)
    gather = None
    if fsdp.active():
        gather = fsdp.kernel_spec("embed" if kernel_nk else "lm_head", kernel.shape)
        gather = gather if fsdp.fsdp_dim(gather) is not None else None
    return _HeadSpec(temperature=temperature, with_entropy=with_entropy, kernel_nk=kernel_nk, dtype=dtype,
                     operand_dtype=jnp.dtype(jnp.float32) if jax.default_backend() == "cpu" else dtype,
                     kernel_dtype=jnp.dtype(kernel.dtype), gather=gather)


def chunked_head_logprobs(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, *, temperature: float = 1.0,
                          chunk: int = HEAD_CHUNK, with_entropy: bool = False, kernel_nk: bool = False,
                          dtype=jnp.bfloat16):
    """``log pi_T(targets | hidden)`` and the entropy of pi_T, chunk by chunk over the sequence axis.

    hidden [B, T, D] (the final norm's output), kernel the master head [D, V] or, with ``kernel_nk``, the tied
    embedding [V, D], targets [B, T] int. Returns ``(logp [B, T], entropy [B, T] or None)``, f32. Differentiable
    in ``hidden`` and ``kernel`` (see the module docstring for the backward pass).
    """
    n = targets.shape[1]
    c = min(chunk, n)
    spec = _head_spec(kernel, temperature=temperature, with_entropy=with_entropy, kernel_nk=kernel_nk, dtype=dtype)
    hidden = hidden.astype(spec.dtype)
    logp, ent = _chunked_head(_to_chunks(hidden, c), kernel, _to_chunks(targets, c), spec)
    return _from_chunks(logp, n), (_from_chunks(ent, n) if with_entropy else None)


# ----------------------------------------------------------------------------------------------------------
# the reference the tests compare both heads with: ``linear`` per chunk, autodiff under jax.checkpoint


def autodiff_head_logprobs(params: dict, hidden: jax.Array, targets: jax.Array, *, precision: Precision,
                           head_state: dict | None = None, temperature: float = 1.0, chunk: int = HEAD_CHUNK,
                           with_entropy: bool = False):
    """As ``chunked_head_logprobs``, through ``llama.logits_from_hidden`` per chunk (FP8 with ``head_state``).

    The kernel is cast per chunk, and the backward pass is autodiff's: f32 logit gradient against the upcast
    kernel. Used for ``lm_head_fp8``, whose per-chunk amax observations need ``linear``'s FP8 bookkeeping.
    """
    n = targets.shape[1]
    c = min(chunk, n)
    hidden, targets = _to_chunks(hidden, c), _to_chunks(targets, c)
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
    return _from_chunks(logp, n), (_from_chunks(ent, n) if with_entropy else None)



# ----------------------------------------------------------------------------------------------------------
# one chunk per row, as the heads compute it: what the exact sampler (``rollout.exact``) draws a token from


def chunk_logits(hidden: jax.Array, kernel: jax.Array, k: jax.Array, rows: jax.Array, chunk: int, *,
                 temperature: float, kernel_nk: bool, dtype) -> jax.Array:
    """``chunked_head_logprobs``' scaled logits z = logits / T [B, C, V], f32, of one chunk per row: chunk ``k[b]``
    (of ``chunk`` positions) of row ``rows[b]`` of ``hidden`` [B, N, D], with that head's operands and GEMM."""
    spec = _head_spec(kernel, temperature=temperature, with_entropy=False, kernel_nk=kernel_nk, dtype=dtype)
    h = _operand(_to_chunks(hidden.astype(spec.dtype), chunk)[k, rows], spec)  # [B, C, D]
    return _scaled_logits(h, _operand(kernel, spec), spec)  # [B, C, V]


def autodiff_chunk_logits(params: dict, hidden: jax.Array, k: jax.Array, rows: jax.Array, chunk: int, *,
                          precision: Precision, temperature: float, head_state: dict) -> jax.Array:
    """``autodiff_head_logprobs``' scaled logits [B, C, V] of one chunk per row (as ``chunk_logits``)."""
    h = _to_chunks(hidden, chunk)[k, rows]  # [B, C, D]
    logits = llama.logits_from_hidden(params, h, precision=precision, fp8_state={"lm_head": head_state})
    return logits / temperature  # [B, C, V]


def chunk_token_logprob(z: jax.Array, rows: jax.Array, r: jax.Array, token: jax.Array) -> jax.Array:
    """log pi_T [B] of ``token`` [B] at place ``r[b]`` of row b's chunk of scaled logits ``z`` [B, C, V], by the
    chunked heads' formula (``_chunk_logprobs``: the target's logit, shifted, minus the log-sum-exp)."""
    b, c = z.shape[:2]
    targets = jnp.zeros((b, c), jnp.int32).at[rows, r].set(token)
    logp, _, _, _ = _chunk_logprobs(z, targets, with_entropy=False)
    return logp[rows, r]
