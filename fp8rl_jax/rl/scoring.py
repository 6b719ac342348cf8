"""The scoring forward: per-token logprobs of given sequences under pi_T = softmax(logits / T).

One function serves the old-policy logprobs, the reference logprobs (KL) and the loss under ``jax.grad``, with
the same FP8 state and KV scales the sampler used, so rollout and trainer differ only by kernel numerics.

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

With ``lm_head_fp8`` (per-tensor scaling) the head is ``fp8_chunked_head_logprobs``, the same custom VJP in FP8:
the master kernel is quantized with the head's delayed kernel scale once per call and laid out twice ([V, D] for
the logits, [D, V] for the hidden state's gradient: both FP8 GEMMs read K-major operands), the hidden state is
quantized once with the x scale (and kept, one byte a value, for the kernel's gradient), and each chunk's logit
gradient is quantized with the grad scale (E5M2 in ``hybrid``) for the two backward GEMMs. The state's cotangent
carries the amaxes observed over the whole call: the hidden state's, the kernel's and the largest logit gradient
of any chunk. These are the operands and GEMMs of the autodiff head below, so the two agree to f32 rounding (up
to a logit gradient on an E5M2 rounding boundary: ``tests/rl/test_scoring.py``); the autodiff head quantized and
transposed the 128k-vocabulary kernel in every chunk, forward and backward, and lost to the BF16 head in the H100's
train step.

With ``lm_head_grad_fp8`` alone the head is ``fp8_grad_head_logprobs``: the BF16 head's forward as it is (the custom
VJP's primal and forward are ``_chunked_head``'s, so the logprobs, the entropies and the rollout's agreement with them
do not move) and the FP8 head's two backward GEMMs (``_fp8_head_backward``, shared with it). Each chunk's logits are
recomputed in BF16 as the BF16 head's backward does; the logit gradient is quantized with the grad scale (E5M2), and the
master kernel and the hidden state are quantized once per call with the kernel and x scales, in the backward pass
(nothing FP8 lives between the two passes). Those are two of the head's four GEMMs per chunk (the logits, their
recompute, dx, dW), the two whose rounding never reaches a logprob: the gradients carry E5M2 rounding as every other FP8
linear's do (what it gains and costs: benchmarks/RESULTS.md, "The LM head's backward in FP8"). Its forward observes
nothing, so the calibration observes the head's three operands itself (``rl.step.make_calibrate``). It serves
``rowwise`` scaling as it is: a rowwise linear's backward is per tensor with the delayed scales too.

With ``lm_head_recompute_fp8`` too, the backward's logit recompute is the FP8 head's GEMM as well
(``_fp8_scaled_logits``: the kernel quantized once per call in both layouts, the hidden state once), so three of the
four GEMMs per chunk are FP8 and only the forward's logits are BF16; the forward, and with it every logprob and entropy,
is still the BF16 head's bit for bit. The recomputed logits are normalised on their own log-sum-exp, not on the
forward's: exp(z8 - max - lse) with the BF16 logits' lse does not sum to 1, and the gradient 1 - p of a confident target
(p ~ 0.99) could change sign. The gradient is then the FP8 head's (the softmax of the FP8 logits, the same operands and
GEMMs: ``tests/rl/test_scoring.py``) while the loss's logprobs are the BF16 head's (the first update's block gradients
against f32's: ``tests/test_trainer.py`` and the RESULTS section above). Renormalising costs one reduction over each
chunk's logits, the sum of their exponentials shifted by the forward's max (the entropy's gradient, where it is taken,
recomputes all their statistics). That GEMM writes the logits in BF16 (``RECOMPUTE_LOGITS_DTYPE``: half the bytes the
two passes over them read; their own normalisation keeps the softmax summing to 1, and the gradient is rounded to E5M2
next): the head's gradients move by 3e-4 of their norm against f32 logits on the tiny config. On one GPU the sum of
their exponentials, the gradient, its E5M2 quantize and amax, and its token-minor copy for dW come from two Pallas
kernels (``kernels/head_grad.py``; XLA's ops on CPU and under a mesh of several devices, the same arithmetic). The
observations are the same three operands'.

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
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, amax, observations, quantize, rounded
from fp8rl_jax.kernels.head_grad import logit_grad_fp8
from fp8rl_jax.kernels.transpose import transpose_bytes
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.parallel import fsdp
from fp8rl_jax.rl.losses import entropy_from_logits
from fp8rl_jax.rollout.sampling import SamplingParams, sample

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
# the FP8 head: the kernel quantized once per call (both layouts), a custom VJP over the chunks


@dataclasses.dataclass(frozen=True)
class _Fp8HeadSpec:
    temperature: float
    with_entropy: bool
    kernel_nk: bool  # the kernel is stored [V, D] (a tied embedding), else [D, V]
    recipe: Fp8Recipe
    form: str  # the FP8 GEMM form (``xla.gemm_form``): float8 operands on GPU, their exact f32 values on CPU
    dtype: jnp.dtype  # the compute dtype: the hidden state is rounded to it before it is quantized (as ``linear``)
    kernel_dtype: jnp.dtype
    gather: P | None = None  # under FSDP: the master's PartitionSpec, its FP8 bits gathered (parallel.fsdp)


def _fp8_head_kernels(kernel: jax.Array, state, spec: _Fp8HeadSpec):
    """The master head kernel quantized with its delayed scale, in both layouts the GEMMs read K-major: ``w_vd``
    [V, D] (the logits contract D) and ``w_dv`` [D, V] (the hidden state's gradient contracts V). One quantize
    and one transpose per call, never per chunk; under FSDP the shards are quantized where they are and their FP8
    bits gathered."""
    q = quantize(kernel, state["kernel"]["scale"], spec.recipe.fwd_dtype)
    if spec.gather is not None:
        q = fsdp.gather_bits(q, spec.gather)
    q_t = transpose_bytes(q, tokens=False)
    w_vd, w_dv = (q, q_t) if spec.kernel_nk else (q_t, q)
    return (xla.gemm_operand(w_vd, spec.recipe.fwd_dtype, spec.form),
            xla.gemm_operand(w_dv, spec.recipe.fwd_dtype, spec.form))


def _tokens_minor(q: jax.Array) -> jax.Array:
    """[M, N] -> [N, M]: the byte transpose kernel for FP8 operands (``kernels.transpose``), else XLA's."""
    return transpose_bytes(q) if jnp.dtype(q.dtype).itemsize == 1 else q.T


# The dtype ``lm_head_recompute_fp8``'s recomputed logits are written in: BF16 halves the bytes of the [M, V] logits
# that the GEMM writes and two passes read (the renormalisation's sum and the logit gradient). Its rounding (2^-9 of
# each logit) is below that of the FP8 GEMM that makes them, the softmax is taken on their own log-sum-exp (so it
# still sums to 1: no sign flip of 1 - p), and the gradient formed from them is rounded to E5M2 (2 mantissa bits)
# next. The forward's logits, which give every logprob, stay f32, as do the FP8 head's recomputed ones (its backward
# normalises them on the forward's statistics, which BF16 logits would not sum to 1 under).
RECOMPUTE_LOGITS_DTYPE = jnp.bfloat16


def _fp8_logits(h: jax.Array, w_vd: jax.Array, dtype=jnp.float32) -> jax.Array:
    """FP8 [B, C, D] x FP8 [V, D] -> the unscaled logits [B * C, V] in ``dtype``: the GEMM as
    ``xla.prequantized_matmul`` runs it (2-D operands, f32 accumulation, rounded to ``dtype``)."""
    b, c, d = h.shape
    return lax.dot_general(h.reshape(b * c, d), w_vd, (((1,), (1,)), ((), ())), preferred_element_type=dtype)


def _fp8_scaled_logits(h: jax.Array, w_vd: jax.Array, inv_scale: jax.Array, spec: _Fp8HeadSpec,
                       dtype=jnp.float32) -> jax.Array:
    """FP8 [B, C, D] x FP8 [V, D] -> logits / T [B, C, V], f32: ``_fp8_logits``, then the inverse scales, so
    rollout and scoring round alike. ``dtype``: the GEMM's output (the f32 accumulator rounded to it before the
    scales; ``RECOMPUTE_LOGITS_DTYPE`` in ``lm_head_recompute_fp8``'s recompute)."""
    b, c, _ = h.shape
    z = _fp8_logits(h, w_vd, dtype).astype(jnp.float32)
    if jnp.dtype(dtype) != jnp.float32:  # the rounding made explicit: XLA may fold a dot's f32 -> dtype -> f32 away
        z = rounded(z, dtype)
    return (z * inv_scale).reshape(b, c, -1) / spec.temperature


def _fp8_scales(state):
    return tuple(state[role]["scale"].astype(jnp.float32) for role in ("x", "kernel", "grad"))


def _fp8_hidden(hidden: jax.Array, state, spec: _Fp8HeadSpec) -> tuple[jax.Array, jax.Array]:
    """The head's input rounded to the compute dtype and quantized with the state's x scale (the GEMM operand,
    one byte a value in the ``f8`` form), and the logits' inverse scale ``1 / (s_x s_w)``."""
    s_x, s_w, _ = _fp8_scales(state)
    fwd_dtype = spec.recipe.fwd_dtype
    h = xla.gemm_operand(quantize(hidden.astype(spec.dtype), s_x, fwd_dtype), fwd_dtype, spec.form)
    return h, (1.0 / s_x) * (1.0 / s_w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_chunked_head(hidden, kernel, targets, state, spec: _Fp8HeadSpec):
    (logp, ent), _ = _fp8_chunked_head_fwd_impl(hidden, kernel, targets, state, spec)
    return logp, ent


def _fp8_chunked_head_fwd_impl(hidden, kernel, targets, state, spec: _Fp8HeadSpec):
    hidden = hidden.astype(spec.dtype)
    h, inv_scale = _fp8_hidden(hidden, state, spec)  # quantized once: also the weight gradient's residual
    w_vd, w_dv = _fp8_head_kernels(kernel, state, spec)

    def chunk(xs):
        h_c, y = xs
        return _chunk_logprobs(_fp8_scaled_logits(h_c, w_vd, inv_scale, spec), y, spec.with_entropy)

    logp, ent, m, lse = lax.map(chunk, (h, targets))
    residuals = (h, w_vd, w_dv, targets, m, lse, ent, state, amax(hidden), amax(kernel))
    return (logp, ent), residuals


def _fp8_chunked_head_fwd(hidden, kernel, targets, state, spec: _Fp8HeadSpec):
    hidden, kernel, targets, state = jax.tree.map(  # symbolic_zeros: each primal leaf is a CustomVJPPrimal
        lambda p: p.value, (hidden, kernel, targets, state), is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
    return _fp8_chunked_head_fwd_impl(hidden, kernel, targets, state, spec)


def _quantized_logit_grad(dz: jax.Array, state, spec: _Fp8HeadSpec) -> tuple[jax.Array, None, jax.Array]:
    """The cotangent ``dz`` [B, C, V] (f32) of a chunk's scaled logits as the backward GEMMs take it: the logit
    gradient ``dz / T`` [B * C, V] quantized with the grad scale (E5M2 in ``hybrid``), no transpose of it (the
    backward makes one), and its amax."""
    dlogits = (dz / spec.temperature).reshape(-1, dz.shape[-1])  # the cotangent of the unscaled logits
    return quantize(dlogits, _fp8_scales(state)[2], spec.recipe.bwd_dtype), None, amax(dlogits)


def _fp8_head_backward(chunk_cotangent, xs, w_dv: jax.Array, state, spec: _Fp8HeadSpec):
    """The head's two backward GEMMs in FP8, chunk by chunk over ``xs`` (a scan): ``chunk_cotangent(x)`` gives one
    chunk's logit gradient quantized with the grad scale (E5M2 in ``hybrid``) [B * C, V] (``_quantized_logit_grad``
    or the ``kernels.head_grad`` kernels), its transpose [V, B * C] or None (made here), its amax and the chunk's
    hidden state quantized with the x scale [B, C, D]; ``w_dv`` is the quantized kernel [D, V]
    (``_fp8_head_kernels``). Returns ``(dx [nC, B, C, D] f32, dW in the master's dtype and layout, reduced onto its
    shards under FSDP, the largest |dz / T| of any chunk)``."""
    s_x, s_w, s_g = _fp8_scales(state)
    bwd_dtype, tied = spec.recipe.bwd_dtype, spec.kernel_nk

    def chunk(carry, xs):
        dw, amax_g = carry
        q, q_t, amax_c, h_c = chunk_cotangent(xs)
        b, c, d = h_c.shape
        g8 = xla.gemm_operand(q, bwd_dtype, spec.form)
        g8_t = _tokens_minor(g8) if q_t is None else xla.gemm_operand(q_t, bwd_dtype, spec.form)
        h2 = h_c.reshape(b * c, d)
        # [M, V] . [D, V] -> dx [M, D]
        dx = lax.dot_general(g8, w_dv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        dx = dx * ((1.0 / s_g) * (1.0 / s_w))
        # [D, M] . [V, M] -> dW [D, V] (tied: [V, M] . [D, M] -> [V, D]): both token-minor, as Hopper's FP8 GEMMs read
        # them; XLA would otherwise transpose the [M, V] gradient inside the fusion that computes it, at a fifth of
        # the copy rate (42 ms of a llama1b train minibatch on the H100)
        a, bb = (g8_t, _tokens_minor(h2)) if tied else (_tokens_minor(h2), g8_t)
        dw = dw + lax.dot_general(a, bb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return (dw, jnp.maximum(amax_g, amax_c)), dx.reshape(b, c, d)

    shape = w_dv.shape[::-1] if tied else w_dv.shape  # the master's layout: [V, D] tied, else [D, V]
    (dw, amax_g), dx = lax.scan(chunk, (jnp.zeros(shape, jnp.float32), jnp.float32(0.0)), xs)
    dw = (dw * ((1.0 / s_x) * (1.0 / s_g))).astype(spec.kernel_dtype)  # the scales are the same in every chunk
    if spec.gather is not None:  # the devices' partial gradients summed onto the master's shards
        dw = fsdp.reduce_to(dw, spec.gather)
    return dx, dw, amax_g


def _fp8_chunked_head_bwd(spec: _Fp8HeadSpec, res, cotangents):
    h, w_vd, w_dv, targets, m, lse, ent, state, amax_x, amax_w = res
    s_x, s_w, _ = _fp8_scales(state)
    g_logp, g_ent, entropy_grad = _head_cotangents(cotangents, spec.with_entropy)
    inv_scale = (1.0 / s_x) * (1.0 / s_w)

    def chunk_cotangent(xs):
        h_c, y, m, lse, g, g_h, ent = xs
        z = _fp8_scaled_logits(h_c, w_vd, inv_scale, spec)  # recomputed: [B, C, V] f32
        return *_quantized_logit_grad(_logits_cotangent(z, y, m, lse, g, g_h, ent, entropy_grad), state, spec), h_c

    dx, dw, amax_g = _fp8_head_backward(chunk_cotangent, (h, targets, m, lse, g_logp, g_ent, ent), w_dv, state, spec)
    return dx.astype(spec.dtype), dw, None, observations(state, amax_x, amax_w, amax_g)


_fp8_chunked_head.defvjp(_fp8_chunked_head_fwd, _fp8_chunked_head_bwd, symbolic_zeros=True)


def _fp8_head_spec(kernel: jax.Array, precision: Precision, *, temperature: float, with_entropy: bool,
                   kernel_nk: bool) -> _Fp8HeadSpec:
    base = _head_spec(kernel, temperature=temperature, with_entropy=with_entropy, kernel_nk=kernel_nk,
                      dtype=precision.dtype)
    return _Fp8HeadSpec(temperature=temperature, with_entropy=with_entropy, kernel_nk=kernel_nk,
                        recipe=precision.recipe, form=xla.gemm_form(), dtype=base.dtype,
                        kernel_dtype=base.kernel_dtype, gather=base.gather)


def fp8_chunked_head_logprobs(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, head_state, *,
                              precision: Precision, temperature: float = 1.0, chunk: int = HEAD_CHUNK,
                              with_entropy: bool = False, kernel_nk: bool = False):
    """As ``chunked_head_logprobs``, with the head's GEMMs in FP8 under ``head_state`` (``precision.lm_head_fp8``,
    per-tensor delayed scaling): the forward's operands are the rollout's (the kernel quantized with the state's
    kernel scale, the hidden state with its x scale), the logit gradient is quantized with the grad scale (E5M2 in
    ``hybrid``), and the state's cotangent carries the three amaxes observed over the whole call (``recipe``).
    The GEMMs are XLA's FP8 ``dot_general`` (cuBLASLt on Hopper) under either backend."""
    n = targets.shape[1]
    c = min(chunk, n)
    spec = _fp8_head_spec(kernel, precision, temperature=temperature, with_entropy=with_entropy, kernel_nk=kernel_nk)
    logp, ent = _fp8_chunked_head(_to_chunks(hidden, c), kernel, _to_chunks(targets, c), head_state, spec)
    return _from_chunks(logp, n), (_from_chunks(ent, n) if with_entropy else None)


# ----------------------------------------------------------------------------------------------------------
# the BF16 head with its two backward GEMMs in FP8 (``lm_head_grad_fp8``): ``_chunked_head``'s forward,
# ``_fp8_head_backward``'s GEMMs; with ``lm_head_recompute_fp8`` the FP8 head's logit recompute too


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_grad_head(hidden, kernel, targets, state, spec: _HeadSpec, fp8: _Fp8HeadSpec,
                   recompute: tuple[str, str] | None):
    del state, fp8, recompute  # they shape the backward pass only: the primal is the BF16 head's
    return _chunked_head(hidden, kernel, targets, spec)


def _fp8_grad_head_fwd(hidden, kernel, targets, state, spec: _HeadSpec, fp8: _Fp8HeadSpec,
                       recompute: tuple[str, str] | None):
    del fp8, recompute
    out, residuals = _chunked_head_fwd(hidden, kernel, targets, spec)  # the BF16 head's forward, as it is
    kernel, state = jax.tree.map(  # symbolic_zeros: each primal leaf is a CustomVJPPrimal
        lambda p: p.value, (kernel, state), is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
    # the master kernel, not an FP8 copy: the backward quantizes it, so nothing FP8 lives between the two passes
    return out, (residuals, kernel, state)


def _fp8_grad_head_bwd(spec: _HeadSpec, fp8: _Fp8HeadSpec, recompute: tuple[str, str] | None, res, cotangents):
    """``recompute``: None, the logits recomputed in the compute dtype; else ``(dtype, impl)``: by the FP8 head's
    GEMM, written in that dtype (``lm_head_recompute_fp8``), their gradient formed by ``kernels.head_grad`` with
    that ``impl``."""
    (hidden, w, targets, m, lse, ent), kernel, state = res
    g_logp, g_ent, entropy_grad = _head_cotangents(cotangents, spec.with_entropy)
    # once per call: the kernel quantized with its delayed scale in the [D, V] layout the hidden state's gradient
    # reads (and the [V, D] one the FP8 logits read: dead code without the FP8 recompute), the hidden state (the
    # forward's compute-dtype operand) with the x scale for the kernel's gradient: the FP8 head's backward operands
    w_vd, w_dv = _fp8_head_kernels(kernel, state, fp8)
    h8, inv_scale = _fp8_hidden(hidden, state, fp8)

    if recompute is not None:
        logits_dtype, grad_impl = recompute

        def chunk_cotangent(xs):
            h8_c, y, m, g, g_h = xs
            # the FP8 head's logits, normalised on their own log-sum-exp: the softmax of the FP8 logits, the FP8
            # head's gradient. The forward's (BF16) lse would not normalise them: sum(p) != 1, and 1 - p of a
            # confident target (p ~ 0.99) can change sign. Shifted by the forward's max (any shift gives the same
            # softmax, and the FP8 logits sit within FP8's rounding of the BF16 ones, so nothing overflows)
            if entropy_grad:  # the entropy's gradient needs the FP8 logits' own entropy: their full statistics
                z = _fp8_scaled_logits(h8_c, w_vd, inv_scale, fp8, logits_dtype)  # [B, C, V]
                _, ent, m, lse = _chunk_logprobs(z, y, True)
                return *_quantized_logit_grad(_logits_cotangent(z, y, m, lse, g, g_h, ent, True), state, fp8), h8_c
            # the sum of the exponentials, then the gradient, its quantize, transpose and amax: two kernels (on
            # the GPU; XLA's ops elsewhere) where XLA ran two slower passes and a byte transpose
            q, q_t, amax_c = logit_grad_fp8(_fp8_logits(h8_c, w_vd, logits_dtype), m.reshape(-1), g.reshape(-1),
                                            y.reshape(-1), inv_scale, _fp8_scales(state)[2], fp8.recipe.bwd_dtype,
                                            temperature=fp8.temperature, transposed=True, impl=grad_impl)
            return q, q_t, amax_c, h8_c

        xs = (h8, targets, m, g_logp, g_ent)
    else:
        def chunk_cotangent(xs):
            h, h8_c, y, m, lse, g, g_h, ent = xs
            z = _scaled_logits(h, w, spec)  # recomputed in the compute dtype, as _chunked_head_bwd does: f32
            return *_quantized_logit_grad(_logits_cotangent(z, y, m, lse, g, g_h, ent, entropy_grad), state, fp8), h8_c

        xs = (hidden, h8, targets, m, lse, g_logp, g_ent, ent)
    dx, dw, amax_g = _fp8_head_backward(chunk_cotangent, xs, w_dv, state, fp8)
    return dx.astype(spec.dtype), dw, None, observations(state, amax(hidden), amax(kernel), amax_g)


_fp8_grad_head.defvjp(_fp8_grad_head_fwd, _fp8_grad_head_bwd, symbolic_zeros=True)


def fp8_grad_head_logprobs(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, head_state, *,
                           precision: Precision, temperature: float = 1.0, chunk: int = HEAD_CHUNK,
                           with_entropy: bool = False, kernel_nk: bool = False, recompute_dtype=None,
                           grad_impl: str = "auto"):
    """As ``chunked_head_logprobs`` (the same forward: logprobs and entropies bit for bit), with the backward's
    two GEMMs in FP8 under ``head_state`` (``precision.lm_head_grad_fp8``), as ``fp8_chunked_head_logprobs``
    runs them: the logit gradient quantized with the grad scale (E5M2 in ``hybrid``), the kernel with its
    delayed kernel scale, the hidden state with its x scale; the state's cotangent carries the three amaxes
    observed over the whole call. The logits the backward differentiates are recomputed in the compute dtype, or
    with ``precision.lm_head_recompute_fp8`` by the FP8 head's GEMM (the kernel and the hidden state quantized as
    above) and normalised on their own log-softmax statistics: the FP8 head's backward under the BF16 forward;
    that GEMM writes them in ``recompute_dtype`` (default ``RECOMPUTE_LOGITS_DTYPE``) and ``kernels.head_grad``
    forms their quantized gradient (``grad_impl``: its ``impl``; ``auto`` is the kernel on a GPU). Under
    ``rowwise`` scaling the backward is per tensor with the delayed scales, as every rowwise linear's."""
    n = targets.shape[1]
    c = min(chunk, n)
    spec = _head_spec(kernel, temperature=temperature, with_entropy=with_entropy, kernel_nk=kernel_nk,
                      dtype=precision.dtype)
    fp8 = _fp8_head_spec(kernel, precision, temperature=temperature, with_entropy=with_entropy, kernel_nk=kernel_nk)
    hidden = hidden.astype(spec.dtype)
    recompute = None
    if precision.lm_head_recompute_fp8:
        recompute = (jnp.dtype(recompute_dtype or RECOMPUTE_LOGITS_DTYPE).name, grad_impl)
    logp, ent = _fp8_grad_head(_to_chunks(hidden, c), kernel, _to_chunks(targets, c), head_state, spec, fp8,
                               recompute)
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


def sample_next_token(
    params: dict,
    tokens: jax.Array,
    at: jax.Array,
    keys: jax.Array,
    *,
    config: LlamaConfig,
    precision: Precision,
    sampling: SamplingParams,
    fp8_state: dict | None = None,
    kv_scales: dict | None = None,
    chunk: int = HEAD_CHUNK,
    forced: jax.Array | None = None,
):
    """Draw ``tokens[b, at[b]]`` from pi_T given ``tokens[b, :at[b]]``, with ``token_logprobs``'s own arithmetic.

    tokens [B, T] right-padded (what stands at ``at`` and after it does not matter), at [B] in [1, T), keys [B]
    (one PRNG key per row). The whole [B, T] batch runs through the scoring forward, and the head's GEMM is the
    [B, C, V] GEMM of the chunk that holds position ``at - 1``, exactly as ``token_logprobs`` computes them for a
    [B, T] batch. Causal attention gives a position nothing from the ones after it (their weights are exact
    zeros), so ``token_logprobs`` of the finished sequences, at this shape, sees the same logits at ``at - 1``:
    the sampler's distribution and logprob are the scorer's, bit for bit, as long as the two XLA programs round
    alike (``rollout.exact``; ``tests/rollout/test_exact.py`` checks it: they do, on CPU and GPU).

    Returns ``(token [B] int32, logp [B] f32)``; ``logp`` is the token's ``log pi_T`` by the scoring head's
    formula. ``sampling.temperature`` is pi_T's T; top-k / top-p / greedy choose the token as ``sample`` does.
    ``forced`` [B]: take these tokens instead of drawing (teacher forcing, ``bench agreement``); ``keys`` unused.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _, _ = llama.forward_hidden(params, tokens, positions, config=config, precision=precision,
                                        fp8_state=fp8_state, kv_scales=kv_scales)
    hidden = hidden[:, :-1]  # position t - 1 predicts token t, as in token_logprobs
    c = min(chunk, t - 1)
    rows = jnp.arange(b)
    k, r = (at - 1) // c, (at - 1) % c  # the chunk that holds position at - 1, and its place in it
    head_state = fp8_state.get("lm_head") if (fp8_state is not None and precision.lm_head_fp8) else None
    draw = dataclasses.replace(sampling, temperature=1.0)  # z below is already logits / T
    tied = "lm_head" not in params
    kernel = params["embed"] if tied else params["lm_head"]
    if head_state is not None and precision.recipe.scaling == "tensor":  # fp8_chunked_head_logprobs' chunk
        spec = _fp8_head_spec(kernel, precision, temperature=sampling.temperature, with_entropy=False,
                              kernel_nk=tied)
        h, inv_scale = _fp8_hidden(_to_chunks(hidden, c)[k, rows], head_state, spec)  # [B, C, D]
        w_vd, _ = _fp8_head_kernels(kernel, head_state, spec)
        z = _fp8_scaled_logits(h, w_vd, inv_scale, spec)  # [B, C, V]
    elif head_state is not None:  # autodiff_head_logprobs' chunk (rowwise scaling)
        h = _to_chunks(hidden, c)[k, rows]  # [B, C, D]
        logits = llama.logits_from_hidden(params, h, precision=precision, fp8_state={"lm_head": head_state})
        z = logits / sampling.temperature  # [B, C, V]
        token = sample(z[rows, r], keys, draw)[0] if forced is None else forced
        return token, jax.nn.log_softmax(z, axis=-1)[rows, r, token]
    else:  # chunked_head_logprobs' chunk
        spec = _head_spec(kernel, temperature=sampling.temperature, with_entropy=False, kernel_nk=tied,
                          dtype=precision.dtype)
        h = _operand(_to_chunks(hidden.astype(spec.dtype), c)[k, rows], spec)  # [B, C, D]
        z = _scaled_logits(h, _operand(kernel, spec), spec)  # [B, C, V]
    token = sample(z[rows, r], keys, draw)[0] if forced is None else forced
    targets = jnp.zeros((b, c), jnp.int32).at[rows, r].set(token)
    logp, _, _, _ = _chunk_logprobs(z, targets, with_entropy=False)
    return token, logp[rows, r]
