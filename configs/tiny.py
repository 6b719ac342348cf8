"""CI smoke run: a tiny random-init Llama learns a synthetic pattern task from reward alone, on CPU in minutes.

    python -m fp8rl_jax.main --config=configs/tiny.py              # fp8_e2e
    python -m fp8rl_jax.main --config=configs/tiny.py:bf16         # or fp8_rollout
"""

from fp8rl_jax.config import base_config


def get_config(arg=None):
    c = base_config()
    c.steps = 30
    c.workdir = "runs/tiny"
    c.model.source = "preset"
    c.model.preset = "tiny"
    c.model.tokenizer = "char"
    c.precision.mode = arg or "fp8_e2e"
    c.precision.backend = "xla"
    c.data.dataset = "pattern"
    c.data.prompt_format = "plain"
    c.data.max_prompt_tokens = 16
    c.reward.fns = ("pattern",)
    c.rollout.prompts_per_step = 8
    c.rollout.samples_per_prompt = 8
    c.rollout.max_new_tokens = 12
    c.rl.is_correction = "tis"
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 2
    c.optim.clip_norm = 1.0
    c.logging.tensorboard = False
    c.mesh.fsdp = 1  # one device: the smoke run is smaller than any sharding overhead (-1 spreads it over all)
    return c
