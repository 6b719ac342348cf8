"""Llama-3.1-8B(-Instruct) GRPO on GSM8K with end-to-end FP8, multi-GPU (FSDP over all local devices).

    python -m fp8rl_jax.main --config=configs/llama8b.py:/path/to/Llama-3.1-8B-Instruct
"""

from fp8rl_jax.config import base_config


def get_config(arg=None):
    c = base_config()
    c.steps = 500
    c.workdir = "runs/llama8b_gsm8k"
    c.model.source = arg or ""  # a Hugging Face folder (config.json + safetensors + tokenizer.json)
    c.model.preset = "llama3_8b"  # its shape, for random weights: --config.model.source=preset
    c.model.param_dtype = "float32"
    c.precision.mode = "fp8_e2e"
    c.precision.backend = "auto"
    c.precision.kv_cache_dtype = "float8_e4m3fn"
    c.precision.bf16_first_layers = 1
    c.precision.bf16_last_layers = 1
    c.data.dataset = "gsm8k"
    c.data.system_prompt = "Solve the problem step by step and end with '#### <answer>'."
    c.reward.fns = ("gsm8k_answer", "gsm8k_format")
    c.reward.weights = (1.0, 0.1)
    c.rollout.prompts_per_step = 128
    c.rollout.samples_per_prompt = 8
    c.rollout.max_new_tokens = 2048
    # fixed: two waves of 512 over the 4 GPUs, as its 4 x H200 runs were measured (benchmarks/RESULTS.md, "Llama-3.1-8B
    # at its shipped sizes on 4 x H200"); 0 (automatic) would decode all 1024 sequences at once, twice the FP8 KV cache,
    # which was not measured
    c.rollout.decode_slots = 512
    c.rl.minibatches = 8
    c.rl.microbatch_sequences = 16
    c.rl.is_correction = "tis"
    c.optim.lr = 1e-6
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.01
    c.checkpoint.every = 25
    # FSDP over all local GPUs (fsdp=4 on a 4-GPU host: 8B f32 master weights + Adam moments are 96 GB, 24 per
    # GPU). A tensor-parallel variant: --config.mesh.fsdp=2 --config.mesh.tensor=2 (8 kv heads, 32 heads, F=14336
    # and the 128256 vocabulary all split evenly over tensor=2 or 4)
    # training recomputes each block in the backward pass: only the blocks' inputs stay live, not the
    # [B, heads, T, T] attention scores of every layer (what made the first train step ask for 82 GiB)
    c.model.remat = "full"
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    return c
