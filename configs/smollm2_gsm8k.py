"""The embedded default: SmolLM2-135M-Instruct (GGUF, fetched on first use) doing GRPO on GSM8K, on CPU.

    python -m fp8rl_jax.main --config=configs/smollm2_gsm8k.py
    python -m fp8rl_jax.main --config=configs/smollm2_gsm8k.py --config.steps=50 --config.precision.mode=bf16
"""

from fp8rl_jax.config import base_config


def get_config(arg=None):
    c = base_config()
    c.steps = int(arg) if arg else 3
    c.workdir = "runs/smollm2_gsm8k"
    c.model.source = "smollm2"
    c.precision.mode = "fp8_e2e"
    c.precision.backend = "auto"
    c.data.dataset = "gsm8k"
    c.data.prompt_format = "chat"
    c.data.system_prompt = (
        "Solve the math problem step by step. Put the final answer after '####', e.g. '#### 42'."
    )
    c.data.max_prompt_tokens = 256
    c.reward.fns = ("gsm8k_answer", "gsm8k_format")
    c.reward.weights = (1.0, 0.1)
    c.rollout.prompts_per_step = 2
    c.rollout.samples_per_prompt = 4
    c.rollout.max_new_tokens = 128  # room to finish with "#### <n>": nonzero stop fraction and format reward
    c.rollout.temperature = 1.0
    c.optim.lr = 1e-6
    c.checkpoint.every = 0
    c.logging.tensorboard = True
    c.mesh.fsdp = 1  # one device (CPU); -1 spreads the run over all devices
    return c
