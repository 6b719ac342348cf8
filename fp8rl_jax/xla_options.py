"""XLA options: the per-program compile options that the rollout's decode programs and the LM head's programs pass
to ``jax.jit(compiler_options=...)`` (``rollout.engine.decode_compiler_options``, ``rl.step.jit_head_program``), and
the XLA:CPU flag that ``python -m fp8rl_jax.main`` sets before JAX starts (so this module imports no JAX at its
top: the CLI sets the flag before anything loads JAX)."""

from __future__ import annotations

import os


def gpu_compiler_options(options: dict, backend: str | None = None) -> dict:
    """XLA:GPU ``options`` for one program's ``jax.jit(compiler_options=...)``, minus any option the user's
    ``XLA_FLAGS`` sets (theirs wins); ``{}`` off the GPU (XLA:CPU refuses GPU options)."""
    import jax

    if (backend or jax.default_backend()) != "gpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    return {k: v for k, v in options.items() if f"--{k}=" not in flags}


# XLA:CPU (jaxlib 0.10): YNNPACK's reduce fusions take other forms in programs of other shapes, which round apart.
# The head's softmax normaliser is summed in a different order in the sampler's program and in the train step's (1
# ulp on a few percent of the logprobs). From 1,024 tokens a call the attention softmax is fused with its normaliser
# (configs/tiny.py: the unpacked step's 64 x 32-token microbatch against the packed step's 8 x 32 and the sampler's
# programs; 1 BF16 ulp on 38% of the attention outputs, 4.8e-3 in a logprob under FP8, mismatch_kl_k3 6.9e-7 against
# 7e-15 packed; tests/test_packing_layouts.py). Without them every program compared agrees (the layouts bit for bit,
# the sampler to 1 f32 ulp). Read when the CPU backend starts, so it goes in the environment before the first JAX
# computation: ``python -m fp8rl_jax.main`` sets it (``use_cpu_xla_flag``), as tests/conftest.py does.
CPU_XLA_FLAG = "--xla_cpu_experimental_ynn_fusion_type=-reduce"


def use_cpu_xla_flag() -> bool:
    """Add ``CPU_XLA_FLAG`` to ``XLA_FLAGS`` unless ``XLA_FLAGS`` names its option already (the user's value wins);
    True where added. It reaches XLA:CPU only before the first JAX computation; GPU programs do not read it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_XLA_FLAG.partition("=")[0] in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_XLA_FLAG}".strip()
    return True
