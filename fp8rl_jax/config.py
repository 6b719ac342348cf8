"""The run configuration: one ``ml_collections.ConfigDict`` with every key the trainer reads.

Config files (``configs/*.py``) start from ``base_config()`` and change what they need; the command line
overrides any key (``--config.rollout.temperature=0.7``). The dict is locked, so a misspelt key fails at once,
and ``validate`` checks values before anything is built, naming the key, the value and what is allowed.

List keys (``reward.fns``, ``reward.weights``, ``precision.bf16_layers``, ``precision.bf16_linears``) are tuples:
``c.reward.fns = ("gsm8k_answer", "gsm8k_format")`` in a file, ``--config.reward.fns=gsm8k_answer,gsm8k_format``
on the command line; read them with ``config_values.config_list``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import ml_collections

from fp8rl_jax.config_values import all_finite, check, get, listed, one_of, positive
from fp8rl_jax.errors import ConfigError  # defined there for the lower layers; still importable from here
from fp8rl_jax.rl import names  # the allowed values of the RL keys, without JAX (the CLI starts sooner)
from fp8rl_jax.rl.microbatch import DEFAULT_MICROBATCH_TOKENS, longest_row_tokens

PRECISION_MODES = ("bf16", "fp8_rollout", "fp8_e2e")
ADVANTAGES = names.ADVANTAGE_KINDS
LOSS_AGGS = names.LOSS_AGGREGATIONS
KL_ESTIMATORS = names.KL_ESTIMATORS
IS_CORRECTIONS = names.IS_CORRECTIONS
SCHEDULES = ("constant", "cosine", "linear")


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 100  # RL steps (one rollout batch each)
    c.workdir = "runs/default"  # checkpoints, metrics.jsonl, TensorBoard events, plots

    c.model = ml_collections.ConfigDict()
    c.model.source = "smollm2"  # "smollm2" (embedded GGUF) | "preset" (random init) | HF folder | .gguf file
    c.model.preset = ""  # with source="preset": a name from fp8rl_jax.model.config.PRESETS
    c.model.tokenizer = ""  # "" = from the model source | "char" (the synthetic tasks') | "smollm2" | a folder
    c.model.param_dtype = "float32"  # master weights
    c.model.init_std = 0.02  # random init only
    c.model.preset_vocab = "tokenizer"  # random init: cut the vocab to the tokenizer's | "preset": keep its shape
    # random init: the preset's blocks cut to this many (0 = all), e.g. the Llama-3.1-8B width trained on one GPU
    c.model.num_layers = 0
    # recompute in the backward pass: none | full (keep only each block's input) | dots_saveable |
    # dots_with_no_batch_dims_saveable (keep the weight matmuls' outputs, recompute attention and elementwise)
    c.model.remat = "none"

    c.precision = ml_collections.ConfigDict()
    c.precision.mode = "fp8_e2e"  # bf16 | fp8_rollout (BF16 train, FP8 rollout) | fp8_e2e
    c.precision.backend = "auto"  # auto (te on a GPU with Transformer Engine, else xla) | xla | te
    c.precision.compute_dtype = "bfloat16"
    c.precision.margin = 0
    c.precision.amax_history_len = 16
    c.precision.amax_compute_algo = "max"  # max | most_recent
    c.precision.fp8_format = "hybrid"  # hybrid (E4M3 fwd, E5M2 grads) | e4m3
    # tensor (delayed, per tensor) | rowwise (the forward per token x per output channel, current; xla) | block (1 x 128
    # tiles, 128 x 128 weight blocks, current, all three GEMMs; xla; DeepSeek-V3's with fp8_format=e4m3; docs/accuracy)
    c.precision.scaling = "tensor"
    # block scaling's GEMMs on a Hopper GPU: mosaic (kernels.block_gemm) | cublaslt (cuBLAS's block-scaled FP8, an XLA
    # FFI call built on first use into $FP8RL_CACHE/kernels: a C++ compiler, cuBLAS's headers; or $FP8RL_CUBLASLT_LIB)
    # | auto (cublaslt above a decode step's 256 rows, else mosaic; mosaic alone, warned, where cuBLASLt can neither
    # build nor load). Speed: benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper"
    c.precision.block_gemm = "auto"
    # block scaling's forward operands, an ablation: tiles_blocks (DeepSeek-V3's: input tiles, weight blocks) |
    # tiles_channels (the weight one scale per output channel) | tokens_blocks (the input one scale per token)
    c.precision.block_forward = "tiles_blocks"
    # block scaling's weight gradient: grad_blocks (the output gradient in 128 x 128 blocks: a faster GEMM on Hopper,
    # the same learning) | tiles (DeepSeek-V3's 128 x 1 tiles). docs/accuracy.md and RESULTS: "Block-scaled FP8"
    c.precision.block_wgrad = "grad_blocks"
    # the GEMMs of each FP8 linear that run in FP8, the others in BF16 with f32 sums: fprop (the forward), dgrad (the
    # input's gradient), wgrad (the weight's); fewer than three need backend=xla; without fprop both forwards stay
    # BF16, the rollout's too (fp8_e2e: the same forward in both). For ablations: docs/accuracy.md, "Where FP8 loses"
    c.precision.fp8_gemms = ("fprop", "dgrad", "wgrad")
    c.precision.bf16_first_layers = 0
    c.precision.bf16_last_layers = 0
    c.precision.bf16_layers = ()  # more blocks kept in BF16, by index: (11, 28, 29)
    c.precision.bf16_linears = ()  # linears kept in BF16 in every block: ("w_down",)
    c.precision.lm_head_fp8 = False
    # the BF16 head's two backward GEMMs in FP8 (E5M2 logit gradient; lm_head_fp8 wins where both are set): a faster
    # train phase, the same accuracy (benchmarks/RESULTS.md, "The LM head's backward in FP8")
    c.precision.lm_head_grad_fp8 = True
    # with lm_head_grad_fp8: the backward's logit recompute in FP8 too, the forward and its logprobs still BF16 (ibid.)
    c.precision.lm_head_recompute_fp8 = True
    c.precision.kv_cache_dtype = "bfloat16"  # bfloat16 | float8_e4m3fn
    # wo's and w_down's residual adds in their FP8 GEMMs (cuBLASLt's C operand): a faster rollout (RESULTS, "Rollout")
    c.precision.residual_in_gemm = True
    # training's MLP as one custom VJP whose backward makes the SwiGLU's gradient and its FP8 operands in one kernel
    # (the te backend with per-tensor scaling; the xla backend with block scaling); off: the two linears' autodiff
    c.precision.fused_mlp = True
    c.precision.kv_margin = 0
    # scoring and training attention: auto (GPU: cuDNN flash attention, Pallas' beside a Transformer Engine on
    # another cuDNN; else xla) | cudnn | pallas | xla (the masked einsum: [T, T] scores in memory)
    c.precision.attention = "auto"
    c.precision.kv_calibration_sequences = 8  # sequences of the last rollout used to recalibrate KV scales

    c.data = ml_collections.ConfigDict()
    c.data.dataset = "gsm8k"  # gsm8k | arithmetic | arithmetic_qa | pattern
    c.data.digits = 2  # arithmetic tasks: operands below 10**digits
    c.data.train_path = ""  # "" = the dataset's default location
    c.data.eval_path = ""
    c.data.prompt_format = "chat"  # chat (the tokenizer's template) | plain
    c.data.system_prompt = ""
    c.data.max_prompt_tokens = 256  # longer prompts are dropped (and counted)
    c.data.shuffle = True
    c.data.num_eval = 0  # eval problems per evaluation (0 = no eval)
    c.data.eval_every = 0

    c.reward = ml_collections.ConfigDict()
    c.reward.fns = ("gsm8k_answer",)  # names from the reward registry
    c.reward.weights = ()  # one float per reward fn, () = all 1

    c.rollout = ml_collections.ConfigDict()
    c.rollout.prompts_per_step = 8
    c.rollout.samples_per_prompt = 4  # the GRPO group size
    c.rollout.max_new_tokens = 256
    c.rollout.temperature = 1.0
    # RL scores the untruncated pi_T = softmax(logits / T): training refuses top_p < 1 and top_k > 0 (the IS
    # weights and the surrogate would be off); Trainer.sample(top_k=, top_p=) may truncate for display
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0  # 0 = off
    # concurrent sequences in the decode batch. 0 = automatic: every sequence of a step, up to what the device's
    # memory holds beside the train state and the rollout weights (rollout/slots.py); the trainer prints the number
    # and the memory it assumed. Fewer slots than sequences run the decode batch in waves, each reading the weights
    c.rollout.decode_slots = 0
    # decode attention: pallas (length-aware kernel over the filled cache, GPU) | xla (whole-cache einsum) | auto
    c.rollout.decode_attention = "auto"
    # devices of one rollout replica group: the rollout weights (FP8 kernels) whole on each group, split over its
    # devices Megatron-style; the decode batch split over the groups. 1: whole on every device (no weight traffic
    # while decoding); larger where the FP8 weights do not fit one device. Must divide the devices and kv heads
    c.rollout.tensor_parallel = 1
    # True: draw the RL rollouts with the trainer's own scoring forward (no KV cache: a full forward of the
    # microbatch per token), so the sampler's logprobs equal the scoring program's bit for bit (rollout/exact.py);
    # precision.mode bf16 or fp8_e2e, one device
    c.rollout.exact = False
    # asynchronous GRPO (rollout/stream.py): the rollout samples the next steps' batches while the trainer trains,
    # with every token at most this many updates old when trained on (0 = the synchronous step, bit for bit);
    # in-flight weight updates at fixed points of the schedule, so a run stays reproducible from its seed
    c.rollout.max_staleness = 0
    # load a new version between decode chunks while sequences are live (True), or only once none is (False: the
    # live rows never wait for the trainer, a batch's tail is not filled by the next batch)
    c.rollout.inflight_updates = True
    # an in-flight load of version v waits this many decode chunks after batch v - 1 completes, the live rows
    # decoding on meanwhile; about the trainer's step time over a chunk's keeps them from waiting at the load
    c.rollout.load_delay_chunks = 0

    c.rl = ml_collections.ConfigDict()
    # DAPO's dynamic sampling: drop prompt groups whose rewards are all equal (no advantage, no gradient) and sample
    # more prompts until the batch is full, up to dynamic_sampling_max_rounds x rollout.prompts_per_step prompts
    c.rl.dynamic_sampling = False
    c.rl.dynamic_sampling_max_rounds = 4
    c.rl.advantage = "grpo"  # grpo (std-normalised) | drgrpo (mean only) | rloo
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.2  # > clip_low = DAPO's clip-higher
    # dual-clip PPO (arXiv 1912.09729): for A < 0 the clipped surrogate's per-token loss is at most -A * c. 0 = off
    # (today's loss, bit for bit); else > 1. veRL's vanilla loss applies c = 3.0 by default
    c.rl.clip_ratio_c = 0.0
    # token_mean (DAPO) | seq_mean_token_mean (GRPO) | seq_mean_token_sum | seq_mean_token_sum_norm (Dr. GRPO: each
    # sequence's token sum / rl.loss_agg_norm, averaged over sequences); every one is a sum over the minibatch's
    # sequences over global constants, so microbatching and packing do not change it (rl/losses.py, aggregate)
    c.rl.loss_agg = "token_mean"
    c.rl.loss_agg_norm = 0.0  # seq_mean_token_sum_norm's constant; 0 = rollout.max_new_tokens (Dr. GRPO's, TRL's)
    c.rl.kl_coef = 0.0
    c.rl.kl_estimator = "k3"
    c.rl.is_correction = "tis"  # none | tis | seq_tis | mis | icepop
    c.rl.is_cap = 2.0  # TIS / sequence-TIS / MIS token-weight cap C
    # MIS keeps a sequence whose geometric-mean ratio exp(mean_t log r_t) is in [mis_low, mis_high]: a per-token
    # band, so it must be tight (NeMo RL's seq-mask-tis uses [0.999, 1.002], veRL's geometric RS 1.001 and its
    # reciprocal); FP8 mismatch is ~1e-3 nats/token, which a [0.5, 2] band never rejects
    c.rl.mis_low = 0.999
    c.rl.mis_high = 1.002
    # IcePop keeps a token whose ratio r_t is in [icepop_low, icepop_high] (Ring-1T's IcePop, NeMo RL's ICE-POP)
    c.rl.icepop_low = 0.5
    c.rl.icepop_high = 5.0
    c.rl.minibatches = 1  # optimizer updates per RL step
    # gradient accumulation (and the scoring, calibration and exact-sampler passes): a microbatch's rows fit a
    # budget of tokens (sequences x the longest possible row, data.max_prompt_tokens + rollout.max_new_tokens padded
    # to 32; 0 = no budget), fixed at start-up; the default keeps a train step near half of one 80 GB H100
    # (fp8rl_jax/rl/microbatch.py has the arithmetic). microbatch_sequences > 0 sets the count instead and wins
    c.rl.microbatch_tokens = DEFAULT_MICROBATCH_TOKENS
    c.rl.microbatch_sequences = 0  # sequences per microbatch (0 = from microbatch_tokens)
    # pack prompt + completion rows into fixed-width rows (rl/packing.py) for scoring and training, in place of
    # right-padding each minibatch to its longest row; a microbatch of rl.microbatch_sequences rows where set, else
    # rl.microbatch_tokens // width, or fewer where that runs fewer rows (PackingPlan). Off: today's layout, bit for bit
    c.rl.packing = False

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.clip_norm = 1.0

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 0  # steps between saves (0 = only at the end)
    c.checkpoint.keep = 3
    c.checkpoint.save_final = True  # save when run() ends (off only for throwaway benchmark runs)
    # auto: continue the run in workdir, if any | never: start a run, refuse a workdir that holds one |
    # overwrite: delete the run in workdir (checkpoints, metrics, plots, TensorBoard events), then start one
    c.checkpoint.resume = "auto"
    c.checkpoint.async_save = True

    c.logging = ml_collections.ConfigDict()
    c.logging.tensorboard = True
    c.logging.plots = True
    c.logging.progress = True

    c.faults = ml_collections.ConfigDict()
    c.faults.max_consecutive_bad_steps = 3  # NaN/inf losses in a row before the run aborts

    c.mesh = ml_collections.ConfigDict()  # the device mesh (fp8rl_jax.parallel.mesh); data * fsdp * tensor devices
    c.mesh.data = 1  # params replicated, batch split
    c.mesh.fsdp = -1  # params and optimizer state sharded, batch split; -1: all remaining devices
    c.mesh.tensor = 1  # heads / MLP columns / vocabulary split (Megatron-style)
    # the first k devices run the rollout alone and the mesh above is made over the rest; the weights cross as FP8
    # bytes once per RL step (rollout/refit.py). 0: the rollout on the trainer's devices. One process only
    c.mesh.rollout_devices = 0
    return c


# ----------------------------------------------------------------------------------------------------------
# validation


def check_fits_model(c: ml_collections.ConfigDict, max_positions: int, model: str) -> None:
    """A prompt plus its completion must fit the model's positions (the KV cache is sized by the two keys)."""
    total = c.data.max_prompt_tokens + c.rollout.max_new_tokens
    if total > max_positions:
        raise ConfigError(
            f"config.data.max_prompt_tokens={c.data.max_prompt_tokens} + config.rollout.max_new_tokens="
            f"{c.rollout.max_new_tokens} = {total} exceeds the {max_positions} positions of the model ({model}); "
            "lower one of them")


def missing_model_message(c: ml_collections.ConfigDict, config_file: str | None = None) -> str:
    """What to do when ``config.model.source`` is empty (``configs/llama8b.py`` run without its model folder)."""
    from fp8rl_jax.model.config import PRESETS

    file = config_file or "<config file>"
    if c.model.preset in PRESETS:
        shape, preset = f" (preset {c.model.preset})", ""
    else:
        shape, preset = "", f" --config.model.preset=<{' | '.join(sorted(PRESETS))}>"
    return (f"config.model.source is empty: {config_file or 'the config'} needs a model. Pass a Hugging Face folder "
            f"(config.json, *.safetensors, tokenizer.json) as the config's argument, "
            f"--config={file}:/path/to/model-folder, or as --config.model.source=/path/to/model-folder; or train "
            f"random weights of its architecture{shape} with the demo model's tokenizer: "
            f"--config.model.source=preset{preset} --config.model.tokenizer=smollm2")


def missing_keys(c: ml_collections.ConfigDict) -> str | None:
    """What ``c`` lacks of ``base_config()`` in words (``"the sections data, rl and the keys seed"``), or None. Every
    key is read somewhere, so a config that does not start from ``base_config()`` (a ``get_config`` returning a bare
    ``ConfigDict()``) would fail later as a ``KeyError`` naming one of them."""
    sections, keys = [], []

    def walk(base: ml_collections.ConfigDict, node: ml_collections.ConfigDict, prefix: str) -> None:
        for name, value in base.items():
            if not isinstance(value, ml_collections.ConfigDict):
                if name not in node:
                    keys.append(prefix + name)
            elif name not in node:
                sections.append(prefix + name)
            elif not isinstance(node[name], ml_collections.ConfigDict):
                sections.append(f"{prefix}{name} (a {type(node[name]).__name__} here)")
            else:
                walk(value, node[name], f"{prefix}{name}.")

    walk(base_config(), c, "")
    parts = ([f"the section{'s' * (len(sections) > 1)} {', '.join(sections)}"] if sections else []) + (
        [f"the key{'s' * (len(keys) > 1)} {', '.join(keys)}"] if keys else [])
    return " and ".join(parts) or None


def validate(c: ml_collections.ConfigDict, known_rewards: Callable[[], Sequence[str]] | None = None, *,
             training: bool = True, config_file: str | None = None) -> None:
    """Raise ``ConfigError`` naming the first bad key. ``training=False`` (serving, sampling) allows truncated
    sampling (``rollout.top_p`` / ``rollout.top_k``), which RL training refuses. ``config_file``: the ``--config``
    path, for messages that show a command line."""
    from fp8rl_jax.model.config import PRESETS

    if (missing := missing_keys(c)) is not None:
        raise ConfigError(f"{config_file or 'the config'} lacks {missing} of base_config(); a config starts from "
                          "fp8rl_jax.config.base_config() and changes what it needs")
    all_finite(c)
    one_of(c, "precision.mode", PRECISION_MODES)
    one_of(c, "precision.backend", ("auto", "xla", "te"))
    one_of(c, "precision.compute_dtype", ("bfloat16", "float32"))
    one_of(c, "precision.amax_compute_algo", ("max", "most_recent"))
    one_of(c, "precision.fp8_format", ("hybrid", "e4m3"))
    one_of(c, "precision.scaling", ("tensor", "rowwise", "block"))
    one_of(c, "precision.block_gemm", ("mosaic", "cublaslt", "auto"))
    one_of(c, "precision.block_forward", ("tiles_blocks", "tiles_channels", "tokens_blocks"))
    check(c.precision.block_forward == "tiles_blocks" or c.precision.scaling == "block", "precision.block_forward",
          c.precision.block_forward, "tiles_blocks, or another form with precision.scaling=block")
    one_of(c, "precision.block_wgrad", ("grad_blocks", "tiles"))
    check(c.precision.block_wgrad == "grad_blocks" or c.precision.scaling == "block", "precision.block_wgrad",
          c.precision.block_wgrad, "grad_blocks, or tiles with precision.scaling=block")
    check(c.precision.scaling == "tensor" or c.precision.backend == "xla", "precision.scaling", c.precision.scaling,
          f"tensor, or {c.precision.scaling} with precision.backend=xla (Transformer Engine scales per tensor here)")
    gemms = listed(c, "precision.fp8_gemms", str, "a non-empty subset of fprop, dgrad, wgrad")
    check(gemms and len(set(gemms)) == len(gemms) and set(gemms) <= {"fprop", "dgrad", "wgrad"},
          "precision.fp8_gemms", c.precision.fp8_gemms, "a non-empty subset of fprop, dgrad, wgrad, each once")
    check(len(gemms) == 3 or c.precision.backend == "xla", "precision.fp8_gemms", c.precision.fp8_gemms,
          "all three, or fewer with precision.backend=xla (Transformer Engine runs all three in FP8)")
    check("fprop" in gemms or c.precision.mode != "fp8_rollout", "precision.fp8_gemms", c.precision.fp8_gemms,
          "with fprop under precision.mode=fp8_rollout (its rollout's FP8 is the forward's)")
    one_of(c, "precision.kv_cache_dtype", ("bfloat16", "float8_e4m3fn"))
    one_of(c, "precision.attention", ("auto", "cudnn", "pallas", "xla"))
    positive(c, "precision.amax_history_len")
    positive(c, "precision.kv_calibration_sequences")
    for key in ("precision.margin", "precision.kv_margin", "precision.bf16_first_layers",
                "precision.bf16_last_layers"):
        positive(c, key, allow_zero=True)
    layers = listed(c, "precision.bf16_layers", int, "block indices, e.g. 11,28,29")
    check(all(i >= 0 for i in layers), "precision.bf16_layers", c.precision.bf16_layers, "block indices >= 0")
    linears = ("wqkv", "wo", "w_gate_up", "w_down")
    for name in listed(c, "precision.bf16_linears", str, f"names from {', '.join(linears)}"):
        check(name in linears, "precision.bf16_linears", name, f"names from {', '.join(linears)}")
    one_of(c, "model.param_dtype", ("float32", "bfloat16"))
    one_of(c, "model.preset_vocab", ("tokenizer", "preset"))
    one_of(c, "rollout.decode_attention", ("auto", "pallas", "xla"))
    check(isinstance(c.rollout.exact, bool), "rollout.exact", c.rollout.exact, "True or False")
    staleness = c.rollout.max_staleness
    check(isinstance(staleness, int) and not isinstance(staleness, bool) and staleness >= 0,
          "rollout.max_staleness", staleness, "an int >= 0 (0: synchronous)")
    check(isinstance(c.rl.dynamic_sampling, bool), "rl.dynamic_sampling", c.rl.dynamic_sampling, "True or False")
    check(isinstance(c.rollout.inflight_updates, bool), "rollout.inflight_updates", c.rollout.inflight_updates,
          "True or False")
    delay = c.rollout.load_delay_chunks
    check(isinstance(delay, int) and not isinstance(delay, bool) and delay >= 0, "rollout.load_delay_chunks",
          delay, "an int >= 0")
    check(not delay or c.rollout.inflight_updates, "rollout.load_delay_chunks", delay,
          "0 with rollout.inflight_updates=False (drained loads wait for no chunk count)")
    rounds = c.rl.dynamic_sampling_max_rounds
    check(isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1,
          "rl.dynamic_sampling_max_rounds", rounds, "an int >= 1")
    if staleness or c.rl.dynamic_sampling:
        key, value = (("rollout.max_staleness", staleness) if staleness
                      else ("rl.dynamic_sampling", c.rl.dynamic_sampling))
        check(not c.rollout.exact, key, value, "off with rollout.exact=True (the exact sampler draws one step's "
              "batch with the trainer's own forward)")
        check(not staleness or c.precision.kv_cache_dtype == "bfloat16", key, value,
              "0 with precision.kv_cache_dtype=float8_e4m3fn: a weight update mid-sequence brings new KV scales, "
              "which would read the cache written under the old ones")
    check(isinstance(c.precision.residual_in_gemm, bool), "precision.residual_in_gemm", c.precision.residual_in_gemm,
          "True or False")
    check(isinstance(c.precision.fused_mlp, bool), "precision.fused_mlp", c.precision.fused_mlp, "True or False")
    check(not c.rollout.exact or c.precision.mode in ("bf16", "fp8_e2e"), "rollout.exact", c.rollout.exact,
          f"False with precision.mode={c.precision.mode!r}: the exact sampler is the trainer's forward, so the "
          f"rollout and training precisions must be one (bf16 or fp8_e2e)")
    one_of(c, "model.remat", ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"))

    src = c.model.source
    positive(c, "model.num_layers", allow_zero=True)
    if src == "":
        raise ConfigError(missing_model_message(c, config_file))
    if src == "preset":
        check(c.model.preset in PRESETS, "model.preset", c.model.preset, ", ".join(sorted(PRESETS)))
        check(c.model.tokenizer != "", "model.tokenizer", c.model.tokenizer,
              "smollm2 (the demo model's tokenizer), char (the synthetic tasks' characters) or a folder with "
              "tokenizer.json: random weights (model.source=preset) bring no tokenizer")
    elif src != "smollm2":
        check(os.path.exists(src), "model.source", src,
              "smollm2 | preset | an existing Hugging Face folder or .gguf file")
    check(c.model.num_layers == 0 or src == "preset", "model.num_layers", c.model.num_layers,
          f"0 with model.source={src!r}: only a random-init preset (model.source=preset) can be cut to fewer blocks")

    one_of(c, "data.dataset", ("gsm8k", "arithmetic", "arithmetic_qa", "pattern"))
    one_of(c, "data.prompt_format", ("chat", "plain"))
    for key in ("data.train_path", "data.eval_path"):
        path = get(c, key)
        check(not path or os.path.exists(path), key, path, "an existing file, or '' for the default")
    positive(c, "data.max_prompt_tokens")
    positive(c, "data.digits")

    names = listed(c, "reward.fns", str, "reward names")
    check(bool(names), "reward.fns", c.reward.fns, "at least one reward name")
    if known_rewards is not None:
        known = set(known_rewards())
        for n in names:
            check(n in known, "reward.fns", n, ", ".join(sorted(known)))
    weights = listed(c, "reward.weights", float, "floats, one per reward fn")
    check(all(math.isfinite(w) for w in weights), "reward.weights", c.reward.weights, "finite numbers")
    check(not weights or len(weights) == len(names), "reward.weights", c.reward.weights,
          f"{len(names)} floats (one per reward fn) or () for all 1")

    for key in ("rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.max_new_tokens",
                "steps", "rl.minibatches", "optim.clip_norm"):
        positive(c, key)
    check(isinstance(c.rollout.decode_slots, int) and c.rollout.decode_slots >= 0, "rollout.decode_slots",
          c.rollout.decode_slots, "0 (automatic: as many as the device memory holds, up to a step's sequences) or a "
          "positive number of slots")
    tp = c.rollout.tensor_parallel
    check(isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1, "rollout.tensor_parallel", tp,
          "a positive int dividing the device count, the model's kv heads and its intermediate size")
    positive(c, "rollout.temperature")
    check(0 < c.rollout.top_p <= 1, "rollout.top_p", c.rollout.top_p, "0 < top_p <= 1")
    positive(c, "rollout.top_k", allow_zero=True)
    if src == "preset":  # a model from a file is checked once its config.json / GGUF header is read
        check_fits_model(c, PRESETS[c.model.preset].max_position_embeddings, f"preset {c.model.preset!r}")
    if training:
        why = ("the trainer scores the untruncated policy softmax(logits / T), so importance weights and ratios "
               "against a top-p/top-k sampler would be wrong (Trainer.sample(top_p=..., top_k=...) may truncate)")
        check(c.rollout.top_p == 1, "rollout.top_p", c.rollout.top_p, f"1.0 for RL training: {why}")
        check(c.rollout.top_k == 0, "rollout.top_k", c.rollout.top_k, f"0 for RL training: {why}")

    one_of(c, "rl.advantage", ADVANTAGES)
    one_of(c, "rl.loss_agg", LOSS_AGGS)
    one_of(c, "rl.kl_estimator", KL_ESTIMATORS)
    one_of(c, "rl.is_correction", IS_CORRECTIONS)
    for key in ("rl.clip_low", "rl.clip_high", "rl.kl_coef", "rl.microbatch_sequences", "rl.microbatch_tokens",
                "rl.loss_agg_norm"):
        positive(c, key, allow_zero=True)
    positive(c, "rl.is_cap")
    dual = c.rl.clip_ratio_c
    check(isinstance(dual, (int, float)) and not isinstance(dual, bool) and (dual == 0 or dual > 1),
          "rl.clip_ratio_c", dual, "0 (off) or > 1 (dual-clip PPO's bound on the loss for A < 0; veRL uses 3.0)")
    for band in ("mis", "icepop"):
        low, high = c.rl[f"{band}_low"], c.rl[f"{band}_high"]
        check(isinstance(low, (int, float)) and isinstance(high, (int, float)) and 0 <= low < 1 < high,
              f"rl.{band}_low/rl.{band}_high", (low, high), f"0 <= {band}_low < 1 < {band}_high")
    seqs = c.rollout.prompts_per_step * c.rollout.samples_per_prompt
    check(seqs % c.rl.minibatches == 0, "rl.minibatches", c.rl.minibatches,
          f"a divisor of prompts_per_step * samples_per_prompt = {seqs}")
    mb = c.rl.microbatch_sequences
    check(mb == 0 or (seqs // c.rl.minibatches) % mb == 0, "rl.microbatch_sequences", mb,
          f"0 (from rl.microbatch_tokens) or a divisor of the minibatch size {seqs // c.rl.minibatches}")
    check(isinstance(c.rl.packing, bool), "rl.packing", c.rl.packing, "True or False")
    if c.rl.packing:
        row = longest_row_tokens(c.data.max_prompt_tokens, c.rollout.max_new_tokens)  # one packed row's width
        check(c.rl.microbatch_sequences > 0 or c.rl.microbatch_tokens == 0 or c.rl.microbatch_tokens >= row,
              "rl.microbatch_tokens", c.rl.microbatch_tokens,
              f">= {row} with rl.packing: one packed row holds data.max_prompt_tokens + rollout.max_new_tokens, "
              "rounded up to 32")
        check(not c.rollout.exact, "rl.packing", c.rl.packing,
              "False with rollout.exact=True: the exact sampler's bitwise agreement needs the scoring forward at "
              "its own [microbatch, T] shape")

    one_of(c, "optim.schedule", SCHEDULES)
    positive(c, "optim.lr", allow_zero=True)
    positive(c, "optim.warmup_steps", allow_zero=True)
    one_of(c, "checkpoint.resume", ("auto", "never", "overwrite"))
    positive(c, "checkpoint.keep")
    positive(c, "checkpoint.every", allow_zero=True)
    positive(c, "faults.max_consecutive_bad_steps")
    for key in ("mesh.data", "mesh.fsdp", "mesh.tensor"):
        value = get(c, key)
        check(isinstance(value, int) and (value >= 1 or value == -1), key, value, "a positive int or -1")
    check([c.mesh.data, c.mesh.fsdp, c.mesh.tensor].count(-1) <= 1, "mesh", c.mesh.to_dict(),
          "at most one of data / fsdp / tensor set to -1")
    k = c.mesh.rollout_devices
    check(isinstance(k, int) and not isinstance(k, bool) and k >= 0, "mesh.rollout_devices", k,
          "0 (the rollout on the trainer's devices) or a number of devices for the rollout alone")
    check(k % tp == 0, "mesh.rollout_devices", k,
          f"a multiple of rollout.tensor_parallel={tp} (the rollout's devices form groups of that many)")
    check(not (k and c.rollout.exact), "mesh.rollout_devices", k,
          "0 with rollout.exact=True: the exact sampler is the trainer's own forward, on the trainer's devices")


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """Load ``get_config(arg)`` from a config file (what ``--config=path.py:arg`` does), for notebooks.

    Whatever the file raises comes back as one ``ConfigError`` line naming the file (the original is chained), as
    does a config that lacks keys of ``base_config()`` (``missing_keys``).
    """
    import importlib.util

    def one_line(e: BaseException) -> str:
        return f"{type(e).__name__}: {' '.join(str(e).split())}"

    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path} not found")
    spec = importlib.util.spec_from_file_location("fp8rl_user_config", path)
    if spec is None:
        raise ConfigError(f"{path}: not a Python file (a config is a .py file with get_config(arg=None))")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{path}: importing it raised {one_line(e)}") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config(arg=None)")
    try:
        config = module.get_config(arg) if arg is not None else module.get_config()
    except Exception as e:
        raise ConfigError(f"{path}: get_config raised {one_line(e)}") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: get_config returned {type(config).__name__}, not an ml_collections.ConfigDict")
    if (missing := missing_keys(config)) is not None:
        raise ConfigError(f"{path}: get_config returned a config without {missing} of base_config(); start it from "
                          "fp8rl_jax.config.base_config() and change what it needs (as configs/*.py do)")
    config.lock()
    return config
