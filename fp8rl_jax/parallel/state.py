"""The model and the train state created directly on the mesh.

Random init never exists whole on one device: ``jax.eval_shape`` gives the params' shapes, the rules give their
shardings, and the init runs jitted with those ``out_shardings``, so each device computes only its shard (the
threefry RNG is partitionable, so the values are the ones an unsharded init draws). Loaded weights (GGUF, Hugging
Face) are read on the host as before and ``jax.device_put`` onto their shardings.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from fp8rl_jax.parallel import rules


def load_model_sharded(config, mesh: Mesh):
    """``fp8rl_jax.model.loading.load_model`` with the params placed by the rules on ``mesh``:
    ``(architecture, params, tokenizer)``."""
    from fp8rl_jax.model.loading import load_model

    if config.model.source != "preset":
        arch, params, tokenizer = load_model(config)
        return arch, jax.device_put(params, rules.state_shardings(params, mesh)), tokenizer

    found = {}

    def init():
        # the architecture and tokenizer come out on the side (not arrays); only the params are traced
        arch, params, tokenizer = load_model(config)
        found.update(arch=arch, tokenizer=tokenizer)
        return params

    shardings = rules.state_shardings(jax.eval_shape(init), mesh)
    params = jax.jit(init, out_shardings=shardings)()
    return found["arch"], params, found["tokenizer"]


def init_sharded(fn, *args, mesh: Mesh) -> Any:
    """``fn(*args)`` (e.g. ``optimizer.init``) jitted with out_shardings from the rules: a params-like result
    (optimizer moments) is created in place, shard by shard."""
    shardings = rules.state_shardings(jax.eval_shape(fn, *args), mesh)
    return jax.jit(fn, out_shardings=shardings)(*args)
