"""Llama-3.2-1B(-Instruct) GRPO on GSM8K, one GPU.

    python -m fp8rl_jax.main --config=configs/llama1b.py:/path/to/Llama-3.2-1B-Instruct
"""

from fp8rl_jax.config import base_config


def get_config(arg=None):
    c = base_config()
    c.steps = 200
    c.workdir = "runs/llama1b_gsm8k"
    c.model.source = arg or ""  # a Hugging Face folder (config.json + safetensors + tokenizer.json)
    c.model.preset = "llama3_1b"  # its shape, for random weights: --config.model.source=preset
    c.precision.mode = "fp8_e2e"
    c.precision.backend = "auto"
    c.precision.kv_cache_dtype = "float8_e4m3fn"
    c.data.dataset = "gsm8k"
    c.data.system_prompt = "Solve the problem step by step and end with '#### <answer>'."
    c.reward.fns = ("gsm8k_answer", "gsm8k_format")
    c.reward.weights = (1.0, 0.1)
    c.rollout.prompts_per_step = 64
    c.rollout.samples_per_prompt = 8
    c.rollout.max_new_tokens = 1024
    # fixed: two waves of 256, the batch its H100 rollout and e2e figures were measured at (benchmarks/RESULTS.md,
    # "Rollout throughput", "End-to-end step, llama1b shapes"); 0 (automatic) would decode all 512 sequences at once,
    # which was not measured
    c.rollout.decode_slots = 256
    c.rl.minibatches = 4
    c.rl.microbatch_sequences = 32
    c.optim.lr = 1e-6
    c.optim.warmup_steps = 10
    c.checkpoint.every = 20
    # one GPU; on more, FSDP over all of them (params and optimizer state sharded, batch split)
    # training recomputes each block in the backward pass: only the blocks' inputs stay live, not the
    # [B, heads, T, T] attention scores of every layer (what made the first train step ask for 82 GiB)
    c.model.remat = "full"
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    return c
