"""The run's typed plan: where the upper layers (trainer, policy_io, eval, serve) turn the ``ConfigDict`` into
what the lower layers take.

The lower layers (data, fp8, kernels, model, parallel, rl, rollout) take plain values or small frozen dataclasses
(``LossConfig``, ``PackingPlan``, ``SamplerSpec``, ``DataSpec``, ``ModelSpec``, ...); the functions here build
those from a run's config (``run_precision``: the ``Precision`` of the train or rollout forward), so a key's meaning is
read in one place; nothing below the trainer reads the config.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax

from fp8rl_jax.config_values import config_list
from fp8rl_jax.data.prompts import DataSpec
from fp8rl_jax.errors import ConfigError
from fp8rl_jax.fp8.policy import Precision, resolve_backend
from fp8rl_jax.fp8.recipe import Fp8Recipe
from fp8rl_jax.model.loading import ModelSpec
from fp8rl_jax.parallel.mesh import make_mesh, split_devices
from fp8rl_jax.rl import microbatch
from fp8rl_jax.rl.packing import PackingPlan
from fp8rl_jax.rl.step import LossConfig
from fp8rl_jax.rollout.sampler import SamplerSpec
from fp8rl_jax.rollout.stream import StreamPlan


def meshes(config, devices: list[jax.Device] | None = None) -> tuple[jax.sharding.Mesh, list[jax.Device] | None]:
    """``(train_mesh, rollout_devices)``: ``mesh.rollout_devices`` = k > 0 puts the rollout on the first k of
    ``devices`` (default ``jax.devices()``) and the trainer's mesh (``mesh.data`` / ``fsdp`` / ``tensor``, -1 = the
    rest) over the others; k = 0, the mesh over all and None (the rollout on the trainer's devices). Devices that
    cannot hold it: one ``ConfigError`` line naming the key."""
    try:
        train, rollout = split_devices(config.mesh.rollout_devices, devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return make_mesh(config.mesh, train), rollout
    except ValueError as e:
        left = f" (mesh.rollout_devices={len(rollout)} leaves {len(train)} devices to train on)" if rollout else ""
        raise ConfigError(f"{e}{left}") from None


def loss_config(config) -> LossConfig:
    """The static options of the loss, from ``config.rl`` (and ``rollout.temperature``; ``rl.loss_agg_norm`` 0
    falls back to ``rollout.max_new_tokens``)."""
    rl = config.rl
    return LossConfig(temperature=config.rollout.temperature, clip_low=rl.clip_low, clip_high=rl.clip_high,
                      clip_ratio_c=rl.clip_ratio_c, loss_agg=rl.loss_agg,
                      loss_agg_norm=float(rl.loss_agg_norm or config.rollout.max_new_tokens), kl_coef=rl.kl_coef,
                      kl_estimator=rl.kl_estimator, is_correction=rl.is_correction, is_cap=rl.is_cap,
                      mis_band=(rl.mis_low, rl.mis_high), icepop_band=(rl.icepop_low, rl.icepop_high))


def longest_row_tokens(config) -> int:
    """``rl.microbatch.longest_row_tokens`` of ``data.max_prompt_tokens`` and ``rollout.max_new_tokens``."""
    return microbatch.longest_row_tokens(config.data.max_prompt_tokens, config.rollout.max_new_tokens)


def microbatch_sequences(config, minibatch: int, row_tokens: int) -> int:
    """``rl.microbatch.microbatch_sequences`` with ``rl.microbatch_tokens`` and ``rl.microbatch_sequences``."""
    return microbatch.microbatch_sequences(minibatch, row_tokens, budget_tokens=config.rl.microbatch_tokens,
                                           sequences=config.rl.microbatch_sequences)


def microbatch_source(config) -> str:
    """Which key set the microbatch, for messages (``rl.microbatch.microbatch_source``)."""
    return microbatch.microbatch_source(budget_tokens=config.rl.microbatch_tokens,
                                        sequences=config.rl.microbatch_sequences)


def packing_plan(config, batch_devices: int = 1) -> PackingPlan:
    """The packed layout's plan (``PackingPlan.build``): every row the longest a step can make
    (``longest_row_tokens``), a minibatch's sequences, ``rl.microbatch_tokens`` and ``rl.microbatch_sequences``."""
    rollout = config.rollout
    return PackingPlan.build(width=longest_row_tokens(config),
                             sequences=rollout.prompts_per_step * rollout.samples_per_prompt // config.rl.minibatches,
                             budget_tokens=config.rl.microbatch_tokens,
                             microbatch_sequences=config.rl.microbatch_sequences, batch_devices=batch_devices)


def sampler_spec(config, *, rl: bool = False) -> SamplerSpec:
    """What a ``rollout.sampler.Sampler`` (and ``plan_decode_slots``) uses of ``config.rollout`` and ``config.data``;
    ``rl``: the trainer's RL sampler, whose stream (``streaming``) may hold ``rollout.max_staleness`` + 2 weight
    versions at once (``SamplerSpec.weight_versions``)."""
    r = config.rollout
    return SamplerSpec(decode_slots=r.decode_slots, tensor_parallel=r.tensor_parallel,
                       max_prompt_tokens=config.data.max_prompt_tokens, max_new_tokens=r.max_new_tokens,
                       decode_attention=r.decode_attention, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                       weight_versions=2 + r.max_staleness if rl and streaming(config) else 1)


def data_spec(config) -> DataSpec:
    """What ``data.prompts`` uses of ``config.data`` (and ``config.seed``)."""
    d = config.data
    return DataSpec(dataset=d.dataset, max_prompt_tokens=d.max_prompt_tokens, prompt_format=d.prompt_format,
                    system_prompt=d.system_prompt, train_path=d.train_path, eval_path=d.eval_path, digits=d.digits,
                    seed=config.seed, shuffle=d.shuffle, num_eval=d.num_eval)


def model_spec(config) -> ModelSpec:
    """What ``model.loading`` and ``model.sharded`` use of ``config.model`` (and ``config.seed``)."""
    m = config.model
    return ModelSpec(source=m.source, tokenizer=m.tokenizer, param_dtype=m.param_dtype, preset=m.preset,
                     num_layers=m.num_layers, preset_vocab=m.preset_vocab, init_std=m.init_std, seed=config.seed)


def run_precision(config, role: str) -> Precision:
    """The precision of the ``train`` (scoring and gradient) or ``rollout`` (sampling) forward.

    ``precision.mode``: ``bf16`` -> BF16 both; ``fp8_rollout`` -> BF16 train, FP8 rollout (the common practice,
    kept for comparison); ``fp8_e2e`` -> the same FP8 linears and scales, and the same KV-cache format, in both.
    ``precision.fp8_gemms`` without ``fprop``: the rollout BF16, as the training forward is.
    """
    if role not in ("train", "rollout"):
        raise ValueError(f"role={role!r}; allowed: train | rollout")
    p = config.precision
    gemms = config_list(p.fp8_gemms, str)
    fp8 = p.mode == "fp8_e2e" or (p.mode == "fp8_rollout" and role == "rollout")
    fp8 = fp8 and (role == "train" or "fprop" in gemms)  # a rollout is forwards only
    recipe = Fp8Recipe(margin=p.margin, amax_history_len=p.amax_history_len,
                       amax_compute_algo=p.amax_compute_algo, fp8_format=p.fp8_format, scaling=p.scaling,
                       fp8_gemms=gemms, block_gemm=p.block_gemm, block_forward=p.block_forward,
                       block_wgrad=p.block_wgrad)
    if fp8 and recipe.scaling == "block" and recipe.block_gemm != "mosaic" and jax.default_backend() == "gpu":
        _register_cublaslt(required=recipe.block_gemm == "cublaslt")
    return Precision(
        backend=resolve_backend(p.backend) if fp8 else "bf16",
        recipe=recipe,
        compute_dtype=p.compute_dtype,
        bf16_first_layers=p.bf16_first_layers,
        bf16_last_layers=p.bf16_last_layers,
        bf16_layers=config_list(p.bf16_layers, int),
        bf16_linears=config_list(p.bf16_linears, str),
        lm_head_fp8=p.lm_head_fp8 and fp8,
        lm_head_grad_fp8=p.lm_head_grad_fp8 and fp8,
        lm_head_recompute_fp8=p.lm_head_recompute_fp8 and fp8,
        kv_cache_dtype=p.kv_cache_dtype if fp8 else p.compute_dtype,
        residual_in_gemm=p.residual_in_gemm,
        fused_mlp=p.fused_mlp,
        attention=p.attention,
    )


def _register_cublaslt(required: bool) -> None:
    """The cuBLASLt block GEMM's FFI target, once a process: ``$FP8RL_CUBLASLT_LIB``, or the library in the model
    cache's ``kernels`` folder, built there on first use (a C++ compiler and cuBLAS's headers: kernels.cublaslt).
    Where it can neither build nor load: a ConfigError for ``block_gemm=cublaslt`` (``required``), a warning for
    ``auto``, whose GEMMs then all run on the Mosaic kernel (``fp8.xla.block_gemm`` asks ``cublaslt.runs_here``)."""
    from fp8rl_jax.kernels import cublaslt

    e = _cublaslt_failure(os.environ.get(cublaslt.ENV_LIB))
    if e is None:
        return
    way_out = ("build it where a compiler is (python -m fp8rl_jax.kernels.cublaslt --out DIR) and set "
               "$FP8RL_CUBLASLT_LIB to the path it prints")
    if required:
        raise ConfigError(f"precision.block_gemm=cublaslt: {e}. Or {way_out}") from e
    warnings.warn(f"precision.block_gemm=auto: no cuBLASLt block GEMM ({e}); every block GEMM runs on the Mosaic "
                  f"kernel. To have it, {way_out}", stacklevel=2)


@functools.cache
def _cublaslt_failure(library: str | None) -> Exception | None:
    """What stopped ``cublaslt.register``, or None: tried once a process for each ``$FP8RL_CUBLASLT_LIB``
    (``library``), so the rollout's and the trainer's precisions do not build or load it twice."""
    from fp8rl_jax.kernels import cublaslt
    from fp8rl_jax.model.assets import cache_dir

    try:
        cublaslt.register(cache_dir() / "kernels")
    except (RuntimeError, OSError, ValueError) as e:  # OSError: FileNotFoundError, a library that will not load
        return e
    return None


def streaming(config) -> bool:
    """Whether the RL batches come from a rollout stream (``rollout.stream``): asynchronous (``rollout.max_staleness``
    > 0) or dynamically sampled (``rl.dynamic_sampling``) runs; otherwise the synchronous step."""
    return config.rollout.max_staleness > 0 or config.rl.dynamic_sampling


def stream_plan(config, first: int, end: int, barriers=()) -> StreamPlan:
    """The ``StreamPlan`` of batches ``first`` .. ``end - 1`` with checkpoint ``barriers``."""
    return StreamPlan(prompts=config.rollout.prompts_per_step, samples=config.rollout.samples_per_prompt,
                      max_staleness=config.rollout.max_staleness, first=first, end=end,
                      dynamic_sampling=config.rl.dynamic_sampling,
                      max_rounds=config.rl.dynamic_sampling_max_rounds if config.rl.dynamic_sampling else 1,
                      barriers=frozenset(barriers), inflight_updates=config.rollout.inflight_updates,
                      load_delay=config.rollout.load_delay_chunks)
