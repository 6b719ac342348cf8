"""The fidelity study's task: SmolLM2-135M-Instruct doing GRPO on one-digit sums asked in words (GPU).

    python -m fp8rl_jax.main --config=configs/smollm2_arith.py --config.precision.mode=bf16
    python benchmarks/accuracy_study.py          # every precision mode, with and without TIS

"What is 7 - 9?" with the GSM8K system prompt, judged like GSM8K (the number after '####', else the last number;
0.1 for the '####' line). Greedy accuracy starts near 28% (benchmarks/RESULTS.md, "Accuracy study"), so a GRPO
run has room to move it within a few dozen steps, which GSM8K (3% for this model) does not give.
"""

import os

from fp8rl_jax.config import load_config_file

# the embedded default's model, precision, GSM8K system prompt and rewards; read by path, so that this file loads
# from any working directory (an import of configs.smollm2_gsm8k needs the repository on sys.path)
GSM8K = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_gsm8k.py")


def get_config(arg=None):
    c = load_config_file(GSM8K)  # locked: keys are set here, none added
    c.steps = int(arg) if arg else 40
    c.workdir = "runs/smollm2_arith"
    c.data.dataset = "arithmetic_qa"
    c.data.digits = 1
    c.data.max_prompt_tokens = 128
    c.data.num_eval = 256  # greedy accuracy on the first 256 test problems
    c.data.eval_every = 10
    c.rollout.prompts_per_step = 16
    c.rollout.samples_per_prompt = 8
    c.rollout.max_new_tokens = 64
    c.rl.microbatch_sequences = 32  # 4 microbatches: the train step fits a fifth of an H100 (5 modes at once)
    c.optim.lr = 5e-6
    c.logging.tensorboard = False
    return c
