"""The train state created directly on the mesh: ``init_sharded`` jits a params-like initialiser (the optimizer's
moments) with the rules' shardings as ``out_shardings``, so each device computes only its shard. The model itself
is read or created on the mesh by ``model.sharded``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from fp8rl_jax.parallel import rules


def init_sharded(fn, *args, mesh: Mesh) -> Any:
    """``fn(*args)`` (e.g. ``optimizer.init``) jitted with out_shardings from the rules: a params-like result
    (optimizer moments) is created in place, shard by shard."""
    shardings = rules.state_shardings(jax.eval_shape(fn, *args), mesh)
    return jax.jit(fn, out_shardings=shardings)(*args)
