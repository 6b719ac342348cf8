"""Per-program XLA compile options: what the rollout's decode programs and the LM head's programs pass to
``jax.jit(compiler_options=...)`` (``rollout.engine.decode_compiler_options``, ``rl.step.jit_head_program``)."""

from __future__ import annotations

import os

import jax


def gpu_compiler_options(options: dict, backend: str | None = None) -> dict:
    """XLA:GPU ``options`` for one program's ``jax.jit(compiler_options=...)``, minus any option the user's
    ``XLA_FLAGS`` sets (theirs wins); ``{}`` off the GPU (XLA:CPU refuses GPU options)."""
    if (backend or jax.default_backend()) != "gpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    return {k: v for k, v in options.items() if f"--{k}=" not in flags}
