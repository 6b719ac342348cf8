"""The jitted pieces of one RL step, each a pure function of explicit state.

    calibrate   FP8 amaxes and K/V amaxes of a forward pass (no update): the scales before the first rollout,
                the rollout's scales in ``fp8_rollout`` mode, and the FP8 KV-cache scales after every update
    score       per-token logprobs under pi_T: old-policy and reference logprobs (the loss calls the same
                ``token_logprobs`` under ``jax.grad``; with one minibatch per step the old-policy logprobs are
                the loss's own forward instead, ``old_logp_from_forward``)
    train_step  one optimizer update over a minibatch: gradient accumulation over microbatches (parameter
                gradients summed against global normalisers, FP8 observations combined with max), the
                IS-corrected clipped surrogate, a non-finite loss or gradient skips the update (parameters,
                optimizer and FP8 state all stay), FP8 histories rolled on success

The train state is a dict: ``params``, ``opt_state``, ``fp8_state``, ``kv_scales``, ``rng`` (the run's base key:
step t samples with ``fold_in(rng, t)``) and ``step``.

On a mesh (``state_sharding``: a ``NamedSharding`` per leaf of the train state, from
``fp8rl_jax.parallel.rules.state_shardings``) each function is jitted with those in/out shardings, token batches
are placed over data+fsdp by their shape at each call, and tracing and running happen under the mesh
(``fp8.linear.mesh_context``). Under jit the arrays are global views, so an FP8 amax (``jnp.max`` over a
sharded tensor) is already the max over every device: the FP8 state comes out replicated and identical.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.linear import mesh_context
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import amax, combine_observations, observations, update_state
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.distributed import place
from fp8rl_jax.rl.importance import ICEPOP_BAND, MIS_BAND, is_weights
from fp8rl_jax.rl.losses import policy_loss
from fp8rl_jax.rl.metrics import masked_mean, reduce_metric
from fp8rl_jax.rl.packing import sequence_keys
from fp8rl_jax.rl.scoring import token_logprobs
from fp8rl_jax.xla_options import gpu_compiler_options


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The static options of the loss (built from ``config.rl`` by ``fp8rl_jax.plan.loss_config``)."""

    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float = 0.0  # dual-clip PPO's c (0 = off)
    loss_agg: str = "token_mean"
    # seq_mean_token_sum_norm's constant (plan.loss_config: rl.loss_agg_norm, or rollout.max_new_tokens where it is 0);
    # the train step refuses None with that aggregation (the fallback, the row width, differs between layouts)
    loss_agg_norm: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    is_correction: str = "tis"
    is_cap: float = 2.0
    mis_band: tuple[float, float] = MIS_BAND
    icepop_band: tuple[float, float] = ICEPOP_BAND

    @property
    def is_band(self) -> tuple[float, float]:
        """The masking band of the chosen correction (MIS and IcePop mask different quantities)."""
        return self.mis_band if self.is_correction == "mis" else self.icepop_band


def build_optimizer(optim, total_updates: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW behind global-norm clipping, with linear warmup then constant / cosine / linear decay; also returns
    the learning-rate schedule (for logging)."""
    warmup = min(optim.warmup_steps, max(total_updates - 1, 0))
    decay_steps = max(total_updates - warmup, 1)
    if optim.schedule == "constant":
        after = optax.constant_schedule(optim.lr)
    elif optim.schedule == "cosine":
        after = optax.cosine_decay_schedule(optim.lr, decay_steps)
    else:
        after = optax.linear_schedule(optim.lr, 0.0, decay_steps)
    schedule = after if warmup == 0 else optax.join_schedules(
        [optax.linear_schedule(0.0, optim.lr, warmup), after], [warmup])
    return optax.chain(
        optax.clip_by_global_norm(optim.clip_norm),
        optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay),
    ), schedule


# XLA:GPU options for the programs that run the LM head's training or scoring forward (scoring, the train step, the
# calibration) when that head is FP8: its GEMMs are XLA's FP8 dots (``fp8_heads.fp8_chunked_head_logprobs``), and with
# XLA's Triton GEMMs the head's forward + backward at llama1b shapes had not finished compiling and running after
# 90 s on the H100; on cuBLAS it compiled in 1.4 s (benchmarks/head_step.py; benchmarks/RESULTS.md, "The LM head's
# backward in FP8"). The same options for a head with FP8 backward GEMMs only (``lm_head_grad_fp8``), whose XLA FP8
# dots are the same: without Triton GEMMs its forward + backward compiles in 0.7 s.
# Every program of such a run gets the options, the scoring and the exact sampler's too, so the BF16 forward of the
# head compiles alike in all of them.
FP8_HEAD_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def jit_head_program(fn, precision: Precision, **kwargs):
    """``jax.jit`` of a program that runs the LM head, with ``FP8_HEAD_GPU_OPTIONS`` where that head has FP8 GEMMs
    (``lm_head_fp8`` or ``lm_head_grad_fp8``) on a GPU (``gpu_compiler_options``: the user's ``XLA_FLAGS`` win)."""
    fp8_head = precision.lm_head_fp8 or precision.lm_head_grad_fp8
    options = gpu_compiler_options(FP8_HEAD_GPU_OPTIONS) if fp8_head else {}
    return jax.jit(fn, compiler_options=options or None, **kwargs)


def _jit_on_mesh(fn, precision: Precision, in_shardings: tuple, out_shardings, batch_axes: dict[int, int],
                 donate_argnums: tuple[int, ...] = ()):
    """``jax.jit`` with state in/out shardings, for a mesh. Arguments listed in ``batch_axes`` (index -> batch
    axis) are token batches: their in_sharding is left to the argument, which is placed over data+fsdp by its
    shape at each call (a batch the mesh does not divide stays replicated, see ``rules.spec``). Other arguments
    are ``device_put`` onto their shardings first (a no-op when they are there already, as in the RL loop)."""
    mesh = jax.tree.leaves(in_shardings)[0].mesh
    placement = {"out_shardings": out_shardings} if out_shardings is not None else {}  # else: as computed
    jitted = jit_head_program(fn, precision, in_shardings=in_shardings, donate_argnums=donate_argnums,
                              **placement)

    def call(*args):
        placed = []
        for i, (arg, sharding) in enumerate(zip(args, in_shardings, strict=True)):
            if i in batch_axes:
                arg = jax.tree.map(
                    lambda x, axis=batch_axes[i]: place(x, rules.batch_sharding(mesh, np.shape(x), axis)), arg)
            elif sharding is not None:
                arg = place(arg, sharding)
            placed.append(arg)
        with mesh_context(mesh, precision.backend):
            return jitted(*placed)

    call.jitted = jitted
    return call


def make_calibrate(model: LlamaConfig, precision: Precision, kv_margin: int = 0, *, gradients: bool = False,
                   temperature: float = 1.0, passes: int = 1, observe_fp8: bool = True, remat: str = "none",
                   microbatch: int | None = None, state_sharding=None):
    """``(params, fp8_state, kv_scales, tokens) -> (fp8_observations, new_kv_scales)``.

    The FP8 amaxes come out of the linears' cotangent (``recipe`` design note). Without ``gradients`` the forward
    is pulled back with a zero cotangent: the dgrad/wgrad GEMMs are dead code and only the forward's amaxes
    remain (the gradient role observes 0, which keeps its scale). With ``gradients`` (FP8 training) it is pulled
    back with the cotangent of the mean token log-likelihood of ``tokens`` under pi_T, (onehot - p) / (T * n),
    the size of a GRPO loss's logit gradient with unit advantages, so the gradient role is calibrated too and
    the first update does not quantize its gradients with scale 1 (E5M2 at scale 1 flushes everything below
    2**-16 to 0: half the weight-gradient entries of the tiny model).

    ``observe_fp8=False`` (the KV-scale recalibration of ``fp8_e2e``, whose FP8 scales the train step observes)
    runs the blocks' forward only. ``remat`` as in the train step: the pullback otherwise keeps every layer's
    attention scores alive (70 GiB for 8 sequences of 1.2k tokens of Llama-3.2-1B).

    ``microbatch``: rows per device call (None: all of ``tokens`` at once; it must divide their rows). A pass then
    observes what one call over all rows would: amaxes combine with max, and the cotangent's mean is over all
    rows (n counts every row), as the train step's microbatches share the minibatch's normalisers.

    ``passes`` > 1 repeats the pass with the scales of the one before (not rolled into ``fp8_state``; only the
    last pass's observations are returned). From scale 1 every FP8 GEMM of the first pass rounds badly (weights
    of std 0.02 are E4M3 subnormals at scale 1; small gradients underflow), so the activations, gradients and
    K/V that reach later linears, and with them their observed amaxes, are off; the second pass sees what the
    calibrated model computes. One pass is enough once the scales are set (the recalibration after an update).
    """

    # lm_head_grad_fp8: the head's state scales its backward's operands, which the train step's head observes
    head_grad_fp8 = precision.lm_head_grad_fp8 and not precision.lm_head_fp8

    def observe(params, fp8_state, kv_scales, tokens, rows):
        """One microbatch of a pass: its FP8 observations and per-layer K/V amaxes; ``rows`` (f32) the pass's."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

        def forward(state):
            hidden, _, kv_amax = llama.forward_hidden(params, tokens, positions, config=model, precision=precision,
                                                      fp8_state=state, kv_scales=kv_scales, remat=remat)
            logits = llama.logits_from_hidden(params, hidden, precision=precision, fp8_state=state)
            return logits, (kv_amax, hidden)

        def mean_loglik(logits):
            # position t - 1 predicts token t: [B, T - 1, V] against [B, T - 1]; the mean over all the pass's rows
            logp = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
            return jnp.sum(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)) / (rows * (tokens.shape[1] - 1))

        if precision.fp8 and observe_fp8:
            logits, pullback, (kv_amax, hidden) = jax.vjp(forward, fp8_state, has_aux=True)
            cotangent = jax.grad(mean_loglik)(logits) if gradients else jnp.zeros_like(logits)
            (observations,) = pullback(cotangent)
            # a BF16 head observes nothing in its forward: the operands of its FP8 backward, observed here
            if head_grad_fp8:
                observations["lm_head"] = _head_grad_observations(params, fp8_state["lm_head"], hidden, cotangent)
        else:  # K/V amaxes only: the blocks' forward, no head, nothing kept for a backward pass
            _, _, kv_amax = llama.forward_hidden(params, tokens, positions, config=model, precision=precision,
                                                 fp8_state=fp8_state, kv_scales=kv_scales)
            observations = None
        return observations, kv_amax

    def scales(kv_amax, kv_scales):
        return kvq.scales_from_amax(kv_amax, kv_margin, old=kv_scales)

    if state_sharding is not None:  # observations and amaxes are replicated, like the FP8 state and KV scales
        s = state_sharding
        replicated = rules.replicated(jax.tree.leaves(s)[0].mesh)
        observe_call = _jit_on_mesh(observe, precision, (s["params"], s["fp8_state"], s["kv_scales"], None, None),
                                    replicated, batch_axes={3: 0})
        scales_call = jax.jit(scales, out_shardings=replicated)
    else:
        observe_call, scales_call = jit_head_program(observe, precision), jax.jit(scales)

    def one_pass(params, fp8_state, kv_scales, tokens):
        n = len(tokens)
        step = microbatch or n
        if n % step:
            raise ValueError(f"calibration: {n} rows are not a whole number of {step}-row microbatches")
        observed = amax = None
        for i in range(0, n, step):
            obs, mb_amax = observe_call(params, fp8_state, kv_scales, tokens[i : i + step], np.float32(n))
            observed = obs if observed is None else combine_observations(observed, obs)  # both None: K/V only
            amax = mb_amax if amax is None else jax.tree.map(jnp.maximum, amax, mb_amax)
        return observed, scales_call(amax, kv_scales)

    one_pass.observe = observe_call  # one microbatch's program (``(params, fp8_state, kv_scales, tokens, rows)``)
    if passes == 1:
        return one_pass
    roll = jax.jit(functools.partial(update_state, recipe=precision.recipe))

    def calibrate_passes(params, fp8_state, kv_scales, tokens):
        for _ in range(passes - 1):
            observations, new_kv_scales = one_pass(params, fp8_state, kv_scales, tokens)
            fp8_state = roll(fp8_state, observations) if precision.fp8 else fp8_state
            kv_scales = new_kv_scales if precision.kv_fp8 else kv_scales
        return one_pass(params, fp8_state, kv_scales, tokens)

    calibrate_passes.observe = observe_call
    return calibrate_passes


def _head_grad_observations(params, head_state, hidden: jax.Array, dlogits: jax.Array):
    """The LM head's FP8 observations where its forward is BF16 and its backward GEMMs FP8 (``lm_head_grad_fp8``,
    ``fp8_heads.fp8_grad_head_logprobs``): the amaxes of the hidden state [B, T, D] at the positions that predict a
    token (all but the last, as ``token_logprobs`` feeds the head), of the master kernel, and of the cotangent of
    the logits ``dlogits`` [B, T, V] (zeros: the gradient role observes 0 and keeps its scale)."""
    return observations(head_state, amax(hidden[:, :-1]), amax(llama.lm_head_kernel(params)), amax(dlogits))


def make_score(model: LlamaConfig, precision: Precision, temperature: float, *, state_sharding=None):
    """``(params, fp8_state, kv_scales, tokens [B, T]) -> logp [B, T]``, jitted (no gradient). ``tokens`` may be a
    packed microbatch instead (``rl.packing``): ``{"tokens", "segment_ids", "positions"}``, each [B, T]."""

    def score(params, fp8_state, kv_scales, tokens):
        packed = tokens if isinstance(tokens, dict) else {"tokens": tokens}
        logp, _, _ = token_logprobs(params, packed["tokens"], config=model, precision=precision,
                                    temperature=temperature, fp8_state=fp8_state, kv_scales=kv_scales,
                                    positions=packed.get("positions"), segment_ids=packed.get("segment_ids"))
        return logp

    if state_sharding is not None:  # logp comes out sharded like the tokens
        s = state_sharding
        return _jit_on_mesh(score, precision, (s["params"], s["fp8_state"], s["kv_scales"], None), None,
                            batch_axes={3: 0})
    return jit_head_program(score, precision)


def _microbatch_tokens(minibatch: dict) -> jax.Array:
    """[microbatches]: the completion tokens of each microbatch of ``minibatch`` (``mask`` [microbatches, rows, T]),
    the tokens its masked means are over."""
    return jnp.sum(minibatch["mask"] > 0, axis=(1, 2)).astype(jnp.float32)


def _combine_microbatch_metric(name: str, values: jax.Array, tokens: jax.Array) -> jax.Array:
    """One metric over a minibatch's microbatches (``values`` and ``tokens`` stacked ``[microbatches]``): a masked
    mean weighted by each microbatch's tokens, a ``*_max``/``*_min`` over the microbatches that hold tokens (0 if
    none does, as ``masked_max`` says)."""
    values = values.astype(jnp.float32)
    held = tokens > 0
    if name.endswith(("_max", "_min")):
        fill = -jnp.inf if name.endswith("_max") else jnp.inf
        picked = reduce_metric(name, jnp.where(held, values, fill))
        return jnp.where(jnp.any(held), picked, 0.0)
    return jnp.sum(values * tokens) / jnp.maximum(jnp.sum(tokens), 1.0)


def make_train_step(model: LlamaConfig, precision: Precision, optimizer: optax.GradientTransformation,
                    loss_cfg: LossConfig, *, old_logp_from_forward: bool = False, remat: str = "none",
                    state_sharding=None, packed_sequences: int | None = None):
    """``(state, minibatch) -> (state, metrics)``, jitted, state donated.

    ``minibatch`` arrays are [microbatches, sequences, T] (``advantages`` [microbatches, sequences]):
    ``tokens``, ``mask`` (completion tokens), ``old_logp``, ``rollout_logp``, optional ``ref_logp``.

    ``old_logp_from_forward`` (one minibatch per RL step, so the update's parameters *are* the old policy): the
    old-policy logprobs are ``stop_gradient`` of the loss's own forward, not a separate scoring program's, so the
    surrogate's ratio is exactly 1 (two XLA programs of one function differ by BF16 rounding) and no scoring
    pass is needed. ``minibatch`` then needs no ``old_logp``, and the step returns ``(state, metrics,
    old_logp [microbatches, sequences, T])`` for the IS weights' and the mismatch metrics' record.
    ``remat``: the blocks' rematerialization policy in the backward pass (``llama.REMAT_POLICIES``).

    ``packed_sequences`` (``rl.packing``): the minibatch is packed (``rl.packing.pack``), [microbatches, rows, W]
    arrays with ``segment_ids``, ``positions`` and per-token ``advantages``, holding this many sequences. The
    microbatches that hold rows come first; the step runs only those (a loop whose trip count is read from
    ``segment_ids``, so one program serves every step), and per-sequence reductions go by segment. Its metrics are
    the minibatch's own: means weighted by each microbatch's completion tokens (the masked mean over the whole
    minibatch, as one unpacked microbatch reports it), maxima and minima over the microbatches with tokens.
    """
    c = loss_cfg
    packed = packed_sequences is not None
    if c.loss_agg == "seq_mean_token_sum_norm" and c.loss_agg_norm is None:
        raise ValueError("loss_agg='seq_mean_token_sum_norm' needs LossConfig.loss_agg_norm, the constant that divides "
                         "each sequence's token sum (plan.loss_config sets rl.loss_agg_norm or "
                         "rollout.max_new_tokens)")

    def loss_fn(params, fp8_state, kv_scales, mb, num_tokens, num_sequences, hoisted):
        logp, entropy, _ = token_logprobs(params, mb["tokens"], config=model, precision=precision,
                                          temperature=c.temperature, fp8_state=fp8_state, kv_scales=kv_scales,
                                          with_entropy=True, remat=remat, positions=mb.get("positions"),
                                          segment_ids=mb.get("segment_ids"), update_kernels=hoisted)
        segments = sequence_keys(mb["segment_ids"]) if packed else None
        old_logp = jax.lax.stop_gradient(logp) if old_logp_from_forward else mb["old_logp"]
        weights, is_metrics = is_weights(old_logp, mb["rollout_logp"], mb["mask"], c.is_correction,
                                         cap=c.is_cap, low=c.is_band[0], high=c.is_band[1], segments=segments)
        loss, metrics = policy_loss(
            logp, old_logp, mb["advantages"], mb["mask"], clip_low=c.clip_low, clip_high=c.clip_high,
            clip_ratio_c=c.clip_ratio_c, loss_agg=c.loss_agg, is_weights=weights, ref_logp=mb.get("ref_logp"),
            kl_coef=c.kl_coef, kl_estimator=c.kl_estimator, loss_agg_norm=c.loss_agg_norm, num_tokens=num_tokens,
            num_sequences=num_sequences, segments=segments,
        )
        metrics = {**metrics, **is_metrics, "entropy": masked_mean(jax.lax.stop_gradient(entropy), mb["mask"])}
        return loss, (metrics, old_logp)

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def accumulate(minibatch, params, fp8_state, kv_scales, num_tokens, num_sequences, hoisted):
        """Over the unpacked minibatch's microbatches (a scan): summed gradients, combined FP8 observations, summed
        loss, metrics (token-weighted means, max of maxima, min of minima), the loss's own logprobs (or None)."""

        def micro(carry, mb):
            grads, observed, loss = carry
            (mb_loss, (metrics, old_logp)), (g, obs) = grad_fn(params, fp8_state, kv_scales, mb, num_tokens,
                                                               num_sequences, hoisted)
            grads = jax.tree.map(jnp.add, grads, g)
            observed = combine_observations(observed, obs) if precision.fp8 else observed
            return (grads, observed, loss + mb_loss), (metrics, old_logp if old_logp_from_forward else None)

        zeros = jax.tree.map(jnp.zeros_like, (params, fp8_state))
        (grads, observed, loss), (metrics, old_logp) = jax.lax.scan(micro, (*zeros, jnp.float32(0)), minibatch)
        # over microbatches: token-weighted means (the minibatch's masked means, whatever the microbatch size, as
        # the packed step's), max of maxima and min of minima over the microbatches that hold tokens
        tokens = _microbatch_tokens(minibatch)
        metrics = {name: _combine_microbatch_metric(name, values, tokens) for name, values in metrics.items()}
        return grads, observed, loss, metrics, old_logp

    def accumulate_packed(minibatch, params, fp8_state, kv_scales, num_tokens, num_sequences, hoisted):
        """As ``accumulate`` over a packed minibatch: a loop over the microbatches that hold rows only."""
        # rows are filled from the first microbatch on: those with a segment id > 0 are the ones to run
        active = jnp.sum(jnp.any(minibatch["segment_ids"] > 0, axis=(1, 2))).astype(jnp.int32)
        first = jax.tree.map(lambda a: a[0], minibatch)
        metric_shapes = jax.eval_shape(grad_fn, params, fp8_state, kv_scales, first, num_tokens, num_sequences,
                                       hoisted)
        names = tuple(metric_shapes[0][1][0])
        tokens = _microbatch_tokens(minibatch)  # 0 in the microbatches the loop skips

        def micro(i, carry):
            grads, observed, loss, stacked, old = carry
            mb = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), minibatch)
            (mb_loss, (metrics, old_logp)), (g, obs) = grad_fn(params, fp8_state, kv_scales, mb, num_tokens,
                                                               num_sequences, hoisted)
            grads = jax.tree.map(jnp.add, grads, g)
            observed = combine_observations(observed, obs) if precision.fp8 else observed
            stacked = {name: stacked[name].at[i].set(metrics[name].astype(jnp.float32)) for name in names}
            if old_logp_from_forward:
                old = jax.lax.dynamic_update_index_in_dim(old, old_logp, i, 0)
            return grads, observed, loss + mb_loss, stacked, old

        zeros = jax.tree.map(jnp.zeros_like, (params, fp8_state))
        old = jnp.zeros(minibatch["tokens"].shape, jnp.float32) if old_logp_from_forward else None
        stacked = {name: jnp.zeros(tokens.shape, jnp.float32) for name in names}
        grads, observed, loss, stacked, old = jax.lax.fori_loop(0, active, micro, (*zeros, jnp.float32(0), stacked,
                                                                                   old))
        metrics = {name: _combine_microbatch_metric(name, stacked[name], tokens) for name in names}
        return grads, observed, loss, metrics, old

    def train_step(state, minibatch):
        num_tokens = jnp.maximum(jnp.sum(minibatch["mask"]), 1).astype(jnp.float32)
        if packed:
            num_sequences = jnp.float32(packed_sequences)
        else:
            num_sequences = jnp.float32(minibatch["tokens"].shape[0] * minibatch["tokens"].shape[1])
        params, fp8_state, kv_scales = state["params"], state["fp8_state"], state["kv_scales"]
        # the FP8 block kernels quantized once for this update, not in every microbatch (te backend or block scaling,
        # no FSDP)
        hoisted = llama.update_kernels(params, fp8_state, model, precision)
        grads, observed, loss, metrics, old_logp = (accumulate_packed if packed else accumulate)(
            minibatch, params, fp8_state, kv_scales, num_tokens, num_sequences, hoisted)
        grad_norm = optax.tree.norm(grads) if hasattr(optax, "tree") else optax.global_norm(grads)

        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new = dict(state, params=optax.apply_updates(params, updates), opt_state=opt_state)
        if precision.fp8:
            new["fp8_state"] = update_state(fp8_state, observed, precision.recipe)
        # A finite loss and gradient can still give a non-finite update (an overflowing learning rate or moment):
        # the step is good only if the new params and optimizer state are finite too.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.all(jnp.asarray(
            [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((new["params"], new["opt_state"]))]))
        # a non-finite step changes nothing (params, optimizer moments, FP8 histories)
        new = jax.tree.map(functools.partial(jnp.where, finite), new, state)
        new["step"] = state["step"]
        metrics.update(loss=loss, grad_norm=grad_norm, finite=finite)
        return (new, metrics, old_logp) if old_logp_from_forward else (new, metrics)

    if state_sharding is not None:  # sequences (axis 1 of the minibatch arrays) over data+fsdp
        replicated = rules.replicated(jax.tree.leaves(state_sharding)[0].mesh)
        # metrics, and the old logprobs the host reads back, replicated: every process can read them
        outs = (state_sharding, replicated, replicated) if old_logp_from_forward else (state_sharding, replicated)
        return _jit_on_mesh(train_step, precision, (state_sharding, None), outs, batch_axes={1: 1},
                            donate_argnums=(0,))
    return jit_head_program(train_step, precision, donate_argnums=(0,))
