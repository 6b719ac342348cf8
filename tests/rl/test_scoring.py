"""The chunked LM head of the scoring forward: the BF16 head's custom VJP against autodiff of the per-chunk
``linear`` head (the implementation it replaced, kept for ``lm_head_fp8``), and the FP8 head's amax bookkeeping.

Tolerances of the custom-VJP head (``chunked_head_logprobs``) against autodiff (``autodiff_head_logprobs``), tiny
preset, T = 0.7, chunks 256 / 8 / 7 of the 20 predicted positions (1 chunk; 3 with padding), tied and untied:
  f32 compute: logp, entropy, and every gradient (all params; the hidden state) agree to f32 rounding:
    |new - old| <= 1e-5 |old| + 1e-6 max|old| (measured: logp <= 4.8e-7 abs, entropy <= 1.9e-6 abs (its one-pass
    form), gradients <= 1.7e-7 max|old| at the head, <= 4.7e-7 max|old| per parameter through the model)
  bf16 compute: the forward is the same f32 math over the same BF16-valued GEMM operands (on CPU the new head
    runs them as f32 GEMMs, see ``heads._operand``): logp within 1e-6 abs (f32 rounding; measured <= 4.8e-7,
    1 ulp at |logp| ~ 6; not bitwise through XLA's fusion choices), entropy within 1e-5 abs. The gradients differ
    by design: the logit gradient is rounded to BF16 before the backward GEMMs (the old path ran them in f32
    against the upcast kernel), and the kernel's gradient is summed over the chunks in f32 (the old path rounded
    each chunk's to BF16 first). Bounds: |new - old| <= 2e-2 max|old| per element (measured <= 7.4e-3 at the head,
    the BF16 rounding of the hidden-state gradient itself; <= 7.6e-3 per parameter through the model); against
    the f32-compute gradient, the new head's relative (norm) error stays within 2x the old BF16 head's (measured
    0.29% vs 0.22% at most).
"""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.model.heads import autodiff_head_logprobs, chunked_head_logprobs
from fp8rl_jax.rl.scoring import token_logprobs

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def head_setup():
    config = preset("tiny")
    params = llama.init_params(config, jax.random.PRNGKey(0))
    # f32 compute: the head's input is the hidden state itself, no rounding to compare through
    precision = Precision(backend="xla", compute_dtype="float32", lm_head_fp8=True)
    fp8_state = llama.init_fp8_state(config, precision)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, config.vocab_size)
    return config, params, precision, fp8_state, tokens


def _head_observations(setup, chunk):
    config, params, precision, fp8_state, tokens = setup

    def total_logp(state):
        logp, _, _ = token_logprobs(params, tokens, config=config, precision=precision, temperature=TEMPERATURE,
                                    fp8_state=state, chunk=chunk)
        return jnp.sum(logp)

    observed = jax.jit(jax.grad(total_logp))(fp8_state)["lm_head"]
    return {role: float(observed[role]["amax_history"][0]) for role in ("x", "kernel", "grad")}


def test_lm_head_amaxes_do_not_depend_on_the_chunk_size(head_setup):
    """Each role's observation is a max over the whole sequence: a sum over the chunks made the kernel amax 4x
    the true one with chunk 5 (4 chunks of the 20 predicted positions), the scales 4x too small."""
    config, params, precision, fp8_state, tokens = head_setup
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _, _ = llama.forward_hidden(params, tokens, positions, config=config, precision=precision,
                                        fp8_state=fp8_state)
    hidden = np.asarray(hidden[:, :-1], np.float64)  # [B, T - 1, D]: the positions that predict a token
    kernel = np.asarray(llama.lm_head_kernel(params), np.float64)  # [D, V]
    # d sum(logp) / d logits = (onehot(target) - softmax(logits / T)) / T; the logits are the FP8 head's, taken
    # from the unchunked forward
    logits = np.asarray(llama.forward(params, tokens, config=config, precision=precision,
                                      fp8_state=fp8_state)[0][:, :-1], np.float64)  # [B, T - 1, V]
    p = np.exp(logits / TEMPERATURE - logits.max(-1, keepdims=True) / TEMPERATURE)
    p /= p.sum(-1, keepdims=True)
    onehot = np.eye(config.vocab_size)[np.asarray(tokens[:, 1:])]
    want = {"x": np.abs(hidden).max(), "kernel": np.abs(kernel).max(),
            "grad": np.abs((onehot - p) / TEMPERATURE).max()}

    for chunk in (256, 8, 5, 3):  # 1, 3, 4 and 7 chunks of the 20 predicted positions
        got = _head_observations(head_setup, chunk)
        for role in ("x", "kernel", "grad"):
            np.testing.assert_allclose(got[role], want[role], rtol=1e-5, err_msg=f"chunk={chunk} role={role}")


# ----------------------------------------------------------------------------------------------------------
# the BF16 (default) head: custom VJP vs autodiff

CHUNKS = (256, 8, 7)  # of the 20 predicted positions: 1 chunk; 3 chunks padded by 4; 3 chunks padded by 1
F32_RTOL, F32_ATOL = 1e-5, 1e-6  # f32 rounding; the atol is relative to the largest |value| of the array


def _tiny(tied):
    config = dataclasses.replace(preset("tiny"), tie_embeddings=tied)
    return config, llama.init_params(config, jax.random.PRNGKey(0))


def _head_kernel(params):
    return (params["embed"], True) if "lm_head" not in params else (params["lm_head"], False)


def _weights(shape):
    """Random cotangents for logp and entropy: a loss that depends on every token of both."""
    return jax.random.normal(jax.random.PRNGKey(4), shape), jax.random.normal(jax.random.PRNGKey(5), shape)


def _close(new, old, rtol, atol_of_max, what):
    new, old = np.asarray(new, np.float64), np.asarray(old, np.float64)
    np.testing.assert_allclose(new, old, rtol=rtol, atol=atol_of_max * np.abs(old).max(), err_msg=what)


def _norm_error(got, ref) -> float:
    """|got - ref| / |ref| over the whole array (Frobenius norms, float64)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _head_grads(which, params, hidden, targets, dtype, chunk, entropy_weight=True):
    """(logp, entropy), d/d(hidden, head kernel) of sum(logp * a) + sum(entropy * b)."""
    kernel, tied = _head_kernel(params)
    a, b = _weights(targets.shape)

    def loss(h, k):
        if which == "new":
            logp, ent = chunked_head_logprobs(h, k, targets, temperature=TEMPERATURE, chunk=chunk, with_entropy=True,
                                              kernel_nk=tied, dtype=dtype)
        else:
            p = dict(params, **{"embed" if tied else "lm_head": k})
            logp, ent = autodiff_head_logprobs(p, h, targets, precision=Precision(compute_dtype=dtype),
                                               temperature=TEMPERATURE, chunk=chunk, with_entropy=True)
        ent_term = ent if entropy_weight else jax.lax.stop_gradient(ent)
        return jnp.sum(logp * a) + jnp.sum(ent_term * b), (logp, ent)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(hidden, kernel)
    return out, grads


def _head_inputs(config, dtype):
    hidden = jax.random.normal(jax.random.PRNGKey(2), (2, 20, config.hidden_size)).astype(dtype)
    targets = jax.random.randint(jax.random.PRNGKey(3), (2, 20), 0, config.vocab_size)
    return hidden, targets


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_head_custom_vjp_equals_autodiff_in_f32(tied, chunk):
    config, params = _tiny(tied)
    hidden, targets = _head_inputs(config, jnp.float32)
    (logp, ent), (gh, gk) = _head_grads("new", params, hidden, targets, "float32", chunk)
    (logp0, ent0), (gh0, gk0) = _head_grads("old", params, hidden, targets, "float32", chunk)
    _close(logp, logp0, F32_RTOL, F32_ATOL, "logp")
    _close(ent, ent0, F32_RTOL, F32_ATOL, "entropy")
    _close(gh, gh0, F32_RTOL, F32_ATOL, "d hidden")
    _close(gk, gk0, F32_RTOL, F32_ATOL, "d kernel")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_head_custom_vjp_in_bf16_within_bf16_rounding(tied, chunk):
    config, params = _tiny(tied)
    hidden, targets = _head_inputs(config, jnp.bfloat16)
    (logp, ent), (gh, gk) = _head_grads("new", params, hidden, targets, "bfloat16", chunk)
    (logp0, ent0), (gh0, gk0) = _head_grads("old", params, hidden, targets, "bfloat16", chunk)
    assert gh.dtype == jnp.bfloat16 and gk.dtype == jnp.float32  # cotangents in the inputs' dtypes
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp0), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(ent0), rtol=0, atol=1e-5)
    _close(gh, gh0, 0, 2e-2, "d hidden")
    _close(gk, gk0, 0, 2e-2, "d kernel")
    # against the f32-compute gradient (the same BF16-valued inputs), no worse than 2x the old BF16 head
    _, exact = _head_grads("old", params, hidden.astype(jnp.float32), targets, "float32", chunk)
    for new, old, ref, what in zip((gh, gk), (gh0, gk0), exact, ("d hidden", "d kernel"), strict=True):
        err = lambda g: float(jnp.linalg.norm(g.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))  # noqa: B023
        assert err(new) <= max(2 * err(old), 1e-3), (what, err(new), err(old))
        assert err(new) < 1e-2, (what, err(new))


def test_undifferentiated_entropy_adds_nothing_to_the_gradient():
    """The train step reports the entropy under stop_gradient: its cotangent is a symbolic zero, and the backward
    pass is the one without entropy (bitwise); the entropy term is there when it is differentiated."""
    config, params = _tiny(True)
    hidden, targets = _head_inputs(config, jnp.float32)
    kernel, tied = _head_kernel(params)
    a, _ = _weights(targets.shape)

    def grads(with_entropy):
        def loss(h, k):
            logp, ent = chunked_head_logprobs(h, k, targets, temperature=TEMPERATURE, chunk=8,
                                              with_entropy=with_entropy, kernel_nk=tied, dtype="float32")
            extra = 0.0 if ent is None else 0.0 * jnp.sum(jax.lax.stop_gradient(ent))
            return jnp.sum(logp * a) + extra
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(hidden, kernel)

    for got, want in zip(grads(True), grads(False), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    _, (gh_stop, _) = _head_grads("new", params, hidden, targets, "float32", 8, entropy_weight=False)
    _, (gh_ent, _) = _head_grads("new", params, hidden, targets, "float32", 8)
    assert np.abs(np.asarray(gh_ent) - np.asarray(gh_stop)).max() > 1e-3 * np.abs(np.asarray(gh_stop)).max()


def _reference_token_logprobs(params, tokens, config, precision, chunk):
    """token_logprobs as it was: the blocks, then autodiff through the per-chunk ``linear`` head."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _, _ = llama.forward_hidden(params, tokens, positions, config=config, precision=precision)
    logp, ent = autodiff_head_logprobs(params, hidden[:, :-1], tokens[:, 1:], precision=precision,
                                       temperature=TEMPERATURE, chunk=chunk, with_entropy=True)
    return logp, ent


@pytest.mark.parametrize(("tied", "dtype"), [(True, "float32"), (False, "bfloat16")], ids=["tied-f32", "untied-bf16"])
def test_token_logprobs_parameter_gradients_match_autodiff(tied, dtype):
    """Every parameter's gradient through the whole model (the head's dx flows into the blocks); the head-level
    tests above cover the other dtype of each head."""
    config, params = _tiny(tied)
    precision = Precision(compute_dtype=dtype)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, config.vocab_size)
    a, b = _weights((2, 20))

    def loss(params, which):
        if which == "new":
            logp, ent, _ = token_logprobs(params, tokens, config=config, precision=precision, temperature=TEMPERATURE,
                                          chunk=8, with_entropy=True)
            logp, ent = logp[:, 1:], ent[:, 1:]
        else:
            logp, ent = _reference_token_logprobs(params, tokens, config, precision, 8)
        return jnp.sum(logp * a) + jnp.sum(ent * b), logp

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)
    (new, logp), (old, logp0) = grad(params, "new"), grad(params, "old")
    if dtype == "float32":
        _close(logp, logp0, F32_RTOL, F32_ATOL, "logp")
    else:
        np.testing.assert_allclose(np.asarray(logp), np.asarray(logp0), rtol=0, atol=1e-6)
    rtol, atol = (F32_RTOL, F32_ATOL) if dtype == "float32" else (0, 2e-2)
    for (path, g), g0 in zip(jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(old), strict=True):
        _close(g, g0, rtol, atol, jax.tree_util.keystr(path))


def _loop_bodies(jaxpr, inside=False):
    """(eqn, inside a loop body) for every equation of a jaxpr and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _loop_bodies(sub, inside or eqn.primitive.name in ("scan", "while"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_head_kernel_is_cast_once_per_call_not_per_chunk(tied):
    """The profiled cost (issue #9): the f32 master table cast to BF16 (and laid out) in every chunk, forward and
    backward. Now no loop body converts an array of the kernel's size; the one cast is outside the loops."""
    config, params = _tiny(tied)
    precision = Precision(compute_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, config.vocab_size)
    kernel, _ = _head_kernel(params)

    def loss(params):
        logp, ent, _ = token_logprobs(params, tokens, config=config, precision=precision, chunk=8, with_entropy=True)
        return jnp.sum(logp) + jnp.sum(jax.lax.stop_gradient(ent))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    casts = [inside for eqn, inside in _loop_bodies(jaxpr)
             if eqn.primitive.name in ("convert_element_type", "reduce_precision", "transpose")
             and any(getattr(v.aval, "size", 0) == kernel.size for v in eqn.outvars)]
    assert casts and not any(casts), casts


# ----------------------------------------------------------------------------------------------------------
# the FP8 head (lm_head_fp8): custom VJP vs autodiff of the per-chunk FP8 ``linear``


def _fp8_head_state(config, precision):
    """The head's FP8 state with scales that quantize visibly (not the initial 1.0): x, kernel and grad scaled to
    amaxes of about 4, 0.1 and 0.05."""
    state = llama.init_fp8_state(config, precision)["lm_head"]
    for role, scale in (("x", 448 / 4.0), ("kernel", 448 / 0.1), ("grad", 57344 / 0.05)):
        state[role] = dict(state[role], scale=jnp.float32(scale))
    return state


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_fp8_head_custom_vjp_equals_autodiff(tied, dtype, chunk):
    """The FP8 head's custom VJP (the kernel quantized once per call in both layouts, the logit gradient quantized
    per chunk) against autodiff of ``linear``'s FP8 GEMM per chunk: the same FP8 operands and GEMMs, so the same
    numbers up to f32 rounding of the softmax. Bounds: logp 1e-6 abs (measured <= 4.8e-7), entropy 1e-5 abs
    (its one-pass form: <= 1.9e-6), the three observed amaxes 1e-6 relative (the grad's differs in the last bit
    in BF16). Gradients: 1e-3 of their largest value. Most cases agree to f32 rounding (the kernel's is summed over
    the chunks and scaled once, not per chunk), but a logit-gradient element on an E5M2 rounding boundary may
    round the other way after a 1-ulp difference in its softmax, which moves that token's hidden-state gradient
    row by one E5M2 step of that element times the kernel (measured: 8.5e-5 of the largest value, one row of 40,
    f32 tied with 3 chunks)."""
    from fp8rl_jax.model.fp8_heads import fp8_chunked_head_logprobs

    config, params = _tiny(tied)
    precision = Precision(backend="xla", compute_dtype=dtype, lm_head_fp8=True)
    state = _fp8_head_state(config, precision)
    hidden, targets = _head_inputs(config, dtype)
    kernel, _ = _head_kernel(params)
    a, b = _weights(targets.shape)

    def loss(which, h, k, st):
        if which == "new":
            logp, ent = fp8_chunked_head_logprobs(h, k, targets, st, precision=precision, temperature=TEMPERATURE,
                                                  chunk=chunk, with_entropy=True, kernel_nk=tied)
        else:
            p = dict(params, **{"embed" if tied else "lm_head": k})
            logp, ent = autodiff_head_logprobs(p, h, targets, precision=precision, head_state=st,
                                               temperature=TEMPERATURE, chunk=chunk, with_entropy=True)
        return jnp.sum(logp * a) + jnp.sum(ent * b), (logp, ent)

    results = {w: jax.jit(jax.value_and_grad(functools.partial(loss, w), argnums=(0, 1, 2), has_aux=True))(
        hidden, kernel, state) for w in ("new", "old")}
    (_, (logp, ent)), (d_h, d_k, observed) = results["new"]
    (_, (logp_ref, ent_ref)), (d_h_ref, d_k_ref, observed_ref) = results["old"]
    np.testing.assert_allclose(logp, logp_ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ent, ent_ref, rtol=0, atol=1e-5)
    assert d_h.dtype == d_h_ref.dtype and d_k.dtype == d_k_ref.dtype
    _close(d_h, d_h_ref, 0, 1e-3, "d hidden")
    _close(d_k, d_k_ref, 0, 1e-3, "d kernel")
    for role in ("x", "kernel", "grad"):
        got, want = observed[role]["amax_history"], observed_ref[role]["amax_history"]
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=role)
        assert float(got[0]) > 0 and not np.any(np.asarray(got[1:])), role  # one observation, in row 0


@pytest.mark.parametrize("heads", [("lm_head_fp8",), ("lm_head_grad_fp8",),
                                   ("lm_head_grad_fp8", "lm_head_recompute_fp8")], ids=["fp8", "grad", "recompute"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp8_head_kernel_is_quantized_once_per_call(tied, heads):
    """The FP8 head's kernel is quantized (a saturating cast of the master) and laid out outside the chunk loops,
    forward and backward: no loop body makes an array of the kernel's size from another (a per-chunk quantize
    and transpose of the 128k-vocabulary table was the autodiff head's cost). The same for the BF16 head with FP8
    backward GEMMs (``lm_head_grad_fp8``): its BF16 cast and its quantized kernel are both made once, in both
    layouts with its logit recompute in FP8 too (``lm_head_recompute_fp8``)."""
    config, params = _tiny(tied)
    precision = Precision(backend="xla", compute_dtype="bfloat16", **dict.fromkeys(heads, True))
    fp8_state = llama.init_fp8_state(config, precision)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, config.vocab_size)
    kernel, _ = _head_kernel(params)

    def loss(params, fp8_state):
        logp, ent, _ = token_logprobs(params, tokens, config=config, precision=precision, chunk=8,
                                      with_entropy=True, fp8_state=fp8_state)
        return jnp.sum(logp) + jnp.sum(jax.lax.stop_gradient(ent))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, fp8_state).jaxpr
    made = [(str(eqn.outvars[0].aval.dtype), inside) for eqn, inside in _loop_bodies(jaxpr)
            if eqn.primitive.name in ("convert_element_type", "reduce_precision", "transpose", "clamp", "mul")
            and any(getattr(v.aval, "size", 0) == kernel.size for v in eqn.outvars)]
    assert ("float8_e4m3fn", False) in made and not any(inside for _, inside in made), made  # quantized, once


# ----------------------------------------------------------------------------------------------------------
# the BF16 head with FP8 backward GEMMs (lm_head_grad_fp8)


def _fp8_grad_head_state(config, precision):
    """``_fp8_head_state``'s scales, with the grad scale fitted to this loss's logit gradient (|dz / T| <= 3.8:
    random weights on every logprob and entropy), so that E5M2 rounds it and does not saturate it."""
    state = _fp8_head_state(config, precision)
    state["grad"] = dict(state["grad"], scale=jnp.float32(57344 / 4.0))
    return state


def _fp8_grad_head_grads(which, tied, chunk, dtype="bfloat16", recompute_dtype=None):
    """(logp, entropy), d/d(hidden, kernel, state) of sum(logp * a) + sum(entropy * b) under the BF16 head
    (``bf16``), the BF16 head with FP8 backward GEMMs (``fp8_grad``), that head with its logit recompute in FP8
    too (``fp8_recompute``, its logits written in ``recompute_dtype``, default the package's) or the FP8 head
    (``fp8``), all under the same state, jitted; and the inputs."""
    from fp8rl_jax.model.fp8_heads import fp8_chunked_head_logprobs, fp8_grad_head_logprobs

    config, params = _tiny(tied)
    precision = Precision(backend="xla", compute_dtype=dtype, lm_head_grad_fp8=True,
                          lm_head_recompute_fp8=which == "fp8_recompute")
    state = _fp8_grad_head_state(config, precision)
    hidden, targets = _head_inputs(config, dtype)
    kernel, _ = _head_kernel(params)
    a, b = _weights(targets.shape)

    def loss(h, k, st):
        kw = dict(temperature=TEMPERATURE, chunk=chunk, with_entropy=True, kernel_nk=tied)
        if which in ("fp8_grad", "fp8_recompute"):
            logp, ent = fp8_grad_head_logprobs(h, k, targets, st, precision=precision, recompute_dtype=recompute_dtype,
                                               **kw)
        elif which == "fp8":
            logp, ent = fp8_chunked_head_logprobs(h, k, targets, st, precision=precision.replace(lm_head_fp8=True),
                                                  **kw)
        else:
            logp, ent = chunked_head_logprobs(h, k, targets, dtype=dtype, **kw)
        return jnp.sum(logp * a) + jnp.sum(ent * b), (logp, ent)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(hidden, kernel, state)
    return out, grads, (hidden, kernel, targets, state, a, b)


@pytest.mark.parametrize("which", ["fp8_grad", "fp8_recompute"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_fp8_grad_head_forward_is_the_bf16_heads_bit_for_bit(tied, chunk, which):
    """The forward of ``lm_head_grad_fp8`` (with ``lm_head_recompute_fp8`` too) is the BF16 head's, so its logprobs
    (and the rollout's agreement with them) do not move: logprobs and entropies bitwise equal, differentiated or
    not (scoring runs the primal)."""
    from fp8rl_jax.model.fp8_heads import fp8_grad_head_logprobs

    (logp, ent), _, (hidden, kernel, targets, state, _, _) = _fp8_grad_head_grads(which, tied, chunk)
    (logp0, ent0), _, _ = _fp8_grad_head_grads("bf16", tied, chunk)
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(logp0))
    np.testing.assert_array_equal(np.asarray(ent), np.asarray(ent0))
    precision = Precision(backend="xla", lm_head_grad_fp8=True, lm_head_recompute_fp8=which == "fp8_recompute")
    kw = dict(temperature=TEMPERATURE, chunk=chunk, with_entropy=True, kernel_nk=tied)
    scored = jax.jit(lambda h, k: fp8_grad_head_logprobs(h, k, targets, state, precision=precision, **kw))(
        hidden, kernel)
    scored0 = jax.jit(lambda h, k: chunked_head_logprobs(h, k, targets, **kw))(hidden, kernel)
    for got, want in zip(scored, scored0, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _fp8_roundtrip(x, scale, dtype):
    """``x`` (float64) quantized as ``recipe.quantize`` does (saturating, the product rounded to f32 first) and
    scaled back, in numpy: the value an FP8 GEMM operand stands for."""
    limit = float(ml_dtypes.finfo(dtype).max)
    y = np.clip(np.float32(x) * np.float32(scale), -limit, limit)
    return y.astype(dtype).astype(np.float64) / np.float64(np.float32(scale))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", (256, 7))
def test_fp8_grad_head_backward_is_the_bf16_backward_on_fp8_operands(tied, chunk):
    """The backward of ``lm_head_grad_fp8`` against an independent numpy (float64) reference: the BF16 head's
    backward (logits from the BF16 hidden state and kernel, the exact logit gradient of the log-softmax and the
    entropy) with the logit gradient, the master kernel and the hidden state rounded through FP8 with the state's
    scales (E5M2, E4M3, E4M3). Bounds: 1e-5 of the largest value (measured <= 9.7e-7: f32 sums against float64
    ones, and dx's BF16 rounding where the two straddle a BF16 rounding boundary; no logit gradient here lies
    within 4.9e-6 (relative) of an E5M2 rounding boundary, where a 1-ulp difference in the softmax would round
    it the other way and move its row by an E5M2 step). Against the BF16 head's gradients: relative (norm) error
    < 15% (E5M2's 2 mantissa bits; measured 6.3% - 7.0%). The state's cotangent: the three amaxes observed over
    the call, in history row 0."""
    _, (d_h, d_k, observed), (hidden, kernel, targets, state, a, b) = _fp8_grad_head_grads("fp8_grad", tied, chunk)
    _, (d_h0, d_k0, _), _ = _fp8_grad_head_grads("bf16", tied, chunk)
    assert d_h.dtype == d_h0.dtype == jnp.bfloat16 and d_k.dtype == d_k0.dtype == jnp.float32

    h = np.asarray(hidden, np.float64)  # [B, T, D], BF16 values
    master = np.asarray(kernel, np.float64)
    w_dv = master.T if tied else master  # [D, V]
    z = h @ np.asarray(jnp.asarray(w_dv, jnp.float32).astype(jnp.bfloat16), np.float64) / TEMPERATURE
    logp_all = z - z.max(-1, keepdims=True)
    logp_all -= np.log(np.exp(logp_all).sum(-1, keepdims=True))
    p = np.exp(logp_all)
    entropy = -(p * logp_all).sum(-1, keepdims=True)
    onehot = np.eye(z.shape[-1])[np.asarray(targets)]
    a, b = np.asarray(a, np.float64)[..., None], np.asarray(b, np.float64)[..., None]
    # d/dz of sum(a logp) + sum(b H), z the scaled logits; the logits' own gradient is that over T
    dlogits = (a * (onehot - p) - b * p * (logp_all + entropy)) / TEMPERATURE
    scale = {role: float(state[role]["scale"]) for role in ("x", "kernel", "grad")}
    q_g = _fp8_roundtrip(dlogits, scale["grad"], ml_dtypes.float8_e5m2)
    q_w = _fp8_roundtrip(w_dv, scale["kernel"], ml_dtypes.float8_e4m3fn)
    q_h = _fp8_roundtrip(h, scale["x"], ml_dtypes.float8_e4m3fn)
    want_h = q_g @ q_w.T  # [B, T, D]
    want_k = np.einsum("btd,btv->dv", q_h, q_g)
    want_k = want_k.T if tied else want_k
    # dx leaves the head in the compute dtype (BF16): compared at that rounding
    want_h = np.asarray(jnp.asarray(want_h, jnp.float32).astype(jnp.bfloat16), np.float64)
    _close(d_h, want_h, 0, 1e-5, "d hidden")
    _close(d_k, want_k, 0, 1e-5, "d kernel")

    for got, ref, what in ((d_h, d_h0, "d hidden"), (d_k, d_k0, "d kernel")):
        err = _norm_error(got, ref)
        assert err < 0.15, (what, err)

    want = {"x": np.abs(h).max(), "kernel": np.abs(master).max(), "grad": np.abs(dlogits).max()}
    for role in ("x", "kernel", "grad"):
        history = np.asarray(observed[role]["amax_history"])
        np.testing.assert_allclose(history[0], want[role], rtol=1e-5, err_msg=role)
        assert not np.any(history[1:]), role  # one observation, in row 0
        assert not np.any(np.asarray(observed[role]["scale"])), role


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", (256, 7))
def test_fp8_recompute_head_backward_is_the_fp8_heads(tied, chunk):
    """With ``lm_head_recompute_fp8`` the backward recomputes the logits by the FP8 head's GEMM and normalises them
    on their own statistics: with those logits written in f32 its gradients and observations are the FP8 head's
    (``fp8_chunked_head_logprobs``) under the same state, though its forward is the BF16 head's. Bounds: 1e-4 of
    the largest value (measured: bitwise equal in every case on CPU; the bound leaves a logit gradient on an E5M2
    rounding boundary room to round the other way, see ``test_fp8_head_custom_vjp_equals_autodiff``), where the
    BF16 recompute (``lm_head_grad_fp8`` alone) is 6e-4 - 4e-3 of it away from the FP8 head's. Written in BF16
    (the default, ``fp8_heads.RECOMPUTE_LOGITS_DTYPE``) the gradients move by < 2e-3 of their norm (measured 3e-4).
    Against the BF16 head's gradients: relative (norm) error < 15%, as ``lm_head_grad_fp8`` alone (measured 6.3% -
    7.0%, the same E5M2 rounding)."""
    _, (d_h, d_k, observed), _ = _fp8_grad_head_grads("fp8_recompute", tied, chunk, recompute_dtype=jnp.float32)
    _, (d_h16, d_k16, observed16), _ = _fp8_grad_head_grads("fp8_recompute", tied, chunk)
    _, (d_h8, d_k8, observed8), _ = _fp8_grad_head_grads("fp8", tied, chunk)
    _, (d_h0, d_k0, _), _ = _fp8_grad_head_grads("bf16", tied, chunk)
    assert d_h.dtype == d_h8.dtype == jnp.bfloat16 and d_k.dtype == d_k8.dtype == jnp.float32
    _close(d_h, d_h8, 0, 1e-4, "d hidden")
    _close(d_k, d_k8, 0, 1e-4, "d kernel")
    for role in ("x", "kernel", "grad"):
        np.testing.assert_allclose(observed[role]["amax_history"], observed8[role]["amax_history"], rtol=1e-6,
                                   err_msg=role)
    for got, ref, what in ((d_h, d_h0, "d hidden"), (d_k, d_k0, "d kernel"), (d_h16, d_h0, "d hidden, BF16 logits"),
                           (d_k16, d_k0, "d kernel, BF16 logits")):
        err = _norm_error(got, ref)
        assert err < 0.15, (what, err)
    for got, ref, what in ((d_h16, d_h, "d hidden"), (d_k16, d_k, "d kernel")):
        err = _norm_error(got, ref)
        assert 0 < err < 2e-3, (what, err)  # rounded (not folded away by XLA) and close
    for role in ("x", "kernel", "grad"):
        np.testing.assert_allclose(observed16[role]["amax_history"], observed[role]["amax_history"], rtol=2e-3,
                                   err_msg=role)


@pytest.mark.parametrize("scaling", ["tensor", "rowwise"])
def test_token_logprobs_with_head_grad_fp8_scores_as_the_bf16_head(scaling):
    """Through ``token_logprobs`` (FP8 blocks, either scaling): ``lm_head_grad_fp8`` scores exactly as the BF16 head
    (same blocks, same head forward), and its gradient observes the head's three roles; under ``rowwise`` the
    head's backward is per tensor with the delayed scales, as every rowwise linear's."""
    from fp8rl_jax.fp8.recipe import Fp8Recipe

    config, params = _tiny(False)
    recipe = Fp8Recipe(scaling=scaling)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, config.vocab_size)
    precisions = {grad: Precision(backend="xla", recipe=recipe, lm_head_grad_fp8=grad) for grad in (False, True)}
    states = {grad: llama.init_fp8_state(config, p) for grad, p in precisions.items()}

    def total_logp(state, grad):
        logp, _, _ = token_logprobs(params, tokens, config=config, precision=precisions[grad],
                                    temperature=TEMPERATURE, fp8_state=state, chunk=8)
        return jnp.sum(logp), logp

    scored = {grad: jax.jit(total_logp, static_argnums=1)(states[grad], grad)[1] for grad in (False, True)}
    np.testing.assert_array_equal(np.asarray(scored[True]), np.asarray(scored[False]))
    observed, logp = jax.jit(jax.grad(total_logp, has_aux=True), static_argnums=1)(states[True], True)
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(scored[False]))
    for role in ("x", "kernel", "grad"):
        assert float(observed["lm_head"][role]["amax_history"][0]) > 0, role
    # the BF16 head leaves the head's state (present whatever the knobs) unobserved
    unobserved, _ = jax.jit(jax.grad(total_logp, has_aux=True), static_argnums=1)(states[False], False)
    assert not any(float(unobserved["lm_head"][role]["amax_history"][0]) for role in ("x", "kernel", "grad"))
