"""``python -m fp8rl_jax.eval``: see ``fp8rl_jax.eval.cli``."""

from fp8rl_jax.eval.cli import run

if __name__ == "__main__":
    run()
