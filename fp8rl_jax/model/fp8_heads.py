"""The LM heads with FP8 GEMMs: ``fp8_chunked_head_logprobs`` (``lm_head_fp8``) and ``fp8_grad_head_logprobs``
(``lm_head_grad_fp8``, with ``lm_head_recompute_fp8``), chunked custom VJPs as the BF16 head of ``heads.py`` is.

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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, amax, observations, quantize, rounded
from fp8rl_jax.kernels.head_grad import logit_grad_fp8
from fp8rl_jax.kernels.transpose import transpose_bytes
from fp8rl_jax.model.heads import (
    HEAD_CHUNK,
    _chunk_logprobs,
    _chunked_head,
    _chunked_head_fwd,
    _from_chunks,
    _head_cotangents,
    _head_spec,
    _HeadSpec,
    _logits_cotangent,
    _scaled_logits,
    _to_chunks,
)
from fp8rl_jax.parallel import fsdp

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



def chunk_logits(hidden: jax.Array, kernel: jax.Array, head_state, k: jax.Array, rows: jax.Array, chunk: int, *,
                 precision: Precision, temperature: float, kernel_nk: bool) -> jax.Array:
    """``fp8_chunked_head_logprobs``' scaled logits z = logits / T [B, C, V], f32, of one chunk per row: chunk
    ``k[b]`` (of ``chunk`` positions) of row ``rows[b]`` of ``hidden`` [B, N, D], with that head's FP8 operands
    (quantized with ``head_state``'s scales) and GEMM; what the exact sampler (``rollout.exact``) draws from."""
    spec = _fp8_head_spec(kernel, precision, temperature=temperature, with_entropy=False, kernel_nk=kernel_nk)
    h, inv_scale = _fp8_hidden(_to_chunks(hidden, chunk)[k, rows], head_state, spec)  # [B, C, D]
    w_vd, _ = _fp8_head_kernels(kernel, head_state, spec)
    return _fp8_scaled_logits(h, w_vd, inv_scale, spec)  # [B, C, V]
