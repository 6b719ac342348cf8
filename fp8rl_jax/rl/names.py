"""The names the RL math accepts, without JAX: ``fp8rl_jax.config`` validates against them at CLI start, and the
modules that implement them (each named below) import their tuple from here."""

ADVANTAGE_KINDS = ("grpo", "drgrpo", "rloo")  # advantages.group_advantages (advantages.KINDS)
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                     "seq_mean_token_sum_norm")  # losses.aggregate (losses.AGGREGATIONS)
KL_ESTIMATORS = ("k1", "k3")  # losses.kl_penalty (losses.KL_ESTIMATORS)
IS_CORRECTIONS = ("none", "tis", "seq_tis", "mis", "icepop")  # importance.is_weights (importance.KINDS)
