"""A trainer's policy outside the training loop: restored from a checkpoint (``restore_policy``, ``load_policy``),
its first FP8 and KV scales (``initial_calibration``, ``calibrate_state``) and the right-padded token rows they and
the trainer score (``right_pad``, ``padded_width``). The trainer, ``python -m fp8rl_jax.eval``, the server and the
export use them."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.checkpoint import Checkpointer
from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import update_state
from fp8rl_jax.model import llama
from fp8rl_jax.model.loading import load_model
from fp8rl_jax.plan import microbatch_sequences, model_spec, run_precision
from fp8rl_jax.rl.microbatch import ROW_MULTIPLE, bucket_width, row_width
from fp8rl_jax.rl.step import build_optimizer, make_calibrate

# train state that checkpoints of earlier versions may lack (``Checkpointer.restore``'s ``absent_ok``): the LM head's
# FP8 state, always in the state since ``precision.lm_head_grad_fp8`` (on by default) came; before, only with
# ``lm_head_fp8``
ADDED_STATE = ("fp8_state.lm_head",)


def restore_policy(config, directory: str | Path | None = None, step: int | None = None):
    """``(model, policy, tokenizer, metadata)`` of a trainer checkpoint: ``policy`` holds its ``params``,
    ``fp8_state`` and ``kv_scales``, ``metadata`` what the trainer saved beside them (``step``, ``config`` as JSON,
    ``precision_backend``, ...).

    ``directory`` defaults to ``<config.workdir>/checkpoints``; ``step`` to the latest complete one. The train
    state is restored whole against an abstract template (no second copy of the model is built first).
    """
    directory = Path(directory) if directory else Path(config.workdir) / "checkpoints"
    model, params, tokenizer = load_model(model_spec(config))
    optimizer, _ = build_optimizer(config.optim, max(config.steps * config.rl.minibatches, 1))
    rollout = run_precision(config, "rollout")
    like = {
        "params": params,
        "opt_state": jax.eval_shape(optimizer.init, params),
        "fp8_state": llama.init_fp8_state(model, rollout.replace(lm_head_fp8=config.precision.lm_head_fp8)),
        "kv_scales": kvq.init_kv_scales(model.num_layers),
        "rng": jax.random.PRNGKey(0),
        "step": jnp.int32(0),
    }
    checkpointer = Checkpointer(directory, async_save=False)
    try:
        state, meta = checkpointer.restore(step, like=like, absent_ok=ADDED_STATE)
    finally:
        checkpointer.close()
    policy = {name: state[name] for name in ("params", "fp8_state", "kv_scales")}
    return model, policy, tokenizer, meta


def load_policy(config, directory: str | Path | None = None, step: int | None = None):
    """``(model, params, fp8_state, kv_scales, tokenizer)`` of a trainer checkpoint, for serving or evaluation
    (``restore_policy``)."""
    model, policy, tokenizer, _ = restore_policy(config, directory, step)
    return model, policy["params"], policy["fp8_state"], policy["kv_scales"], tokenizer


def padded_width(rows: list, multiple: int = ROW_MULTIPLE, width: int = 0, bucket: int = 0) -> int:
    """The width ``right_pad`` pads ``rows`` to: ``width`` where given; else with ``bucket`` (the longest row the run
    can make) the smallest of its ``row_buckets`` holding the longest row; else the longest row up to ``multiple``."""
    longest = max(len(r) for r in rows)
    if width:
        return width
    return bucket_width(longest, bucket, multiple) if bucket else row_width(longest, multiple)


def right_pad(rows: list, pad_id: int, multiple: int = ROW_MULTIPLE, width: int = 0, bucket: int = 0) -> np.ndarray:
    """Token rows right-padded into [len(rows), T]: T as ``padded_width`` says (a few widths to compile for); a
    given ``width`` must hold every row."""
    longest = max(len(r) for r in rows)
    t = padded_width(rows, multiple, width, bucket)
    if longest > t:
        raise ValueError(f"a row of {longest} tokens does not fit width {t}")
    out = np.full((len(rows), t), pad_id, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def calibrate_state(state: dict, calibrate, tokens: np.ndarray, precision: Precision, *, fp8: bool,
                    kv: bool) -> dict:
    """``state`` (``params``, ``fp8_state``, ``kv_scales``, ...) after one ``calibrate`` (``make_calibrate``) over
    ``tokens``: with ``kv`` its new KV scales, with ``fp8`` the FP8 observations rolled into its FP8 state."""
    if not (kv or fp8):
        return state
    observed, kv_scales = calibrate(state["params"], state["fp8_state"], state["kv_scales"], jnp.asarray(tokens))
    state = dict(state)
    if kv:
        state["kv_scales"] = kv_scales
    if fp8:
        state["fp8_state"] = update_state(state["fp8_state"], observed, precision.recipe)
    return state


def initial_calibration(config, model, precision: Precision, state: dict, tokens: np.ndarray, *,
                        fp8: bool | None = None, kv: bool | None = None, gradients: bool = False,
                        state_sharding=None) -> dict:
    """The scales a policy samples with before its first update, from ``tokens`` (the first training prompts): two
    passes, the second with the first one's scales; with ``gradients`` (FP8 training) a real backward pass, so that
    the first update's gradients are quantized with an observed scale, not 1 (``make_calibrate``). ``fp8`` / ``kv``
    (default: what ``precision`` uses) say which scales to set: the FP8 state's, the KV cache's. The rows go
    ``microbatch_sequences(config, rows, width)`` at a time (``rl.microbatch_tokens``), like the train step's."""
    fp8 = precision.fp8 if fp8 is None else fp8
    kv = precision.kv_fp8 if kv is None else kv
    if not (fp8 or kv):
        return state
    calibrate = make_calibrate(model, precision, config.precision.kv_margin, gradients=gradients,
                               temperature=config.rollout.temperature, passes=2, remat=config.model.remat,
                               microbatch=microbatch_sequences(config, *np.shape(tokens)),
                               state_sharding=state_sharding)
    return calibrate_state(state, calibrate, tokens, precision, fp8=fp8, kv=kv)
