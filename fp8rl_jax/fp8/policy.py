"""Which matmuls run in FP8, and how: a small static description that the model's forward reads."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fp8rl_jax.fp8.recipe import Fp8Recipe

BACKENDS = ("bf16", "xla", "te")
KV_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")
COMPUTE_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class Precision:
    """Static precision policy of one forward (hashable: a jit static argument).

    backend: ``bf16`` (no FP8; matmuls in ``compute_dtype``), ``xla`` (pure-JAX FP8) or ``te`` (Transformer
      Engine FP8, GPU). Both FP8 backends read the same FP8 state.
    bf16_first_layers / bf16_last_layers: transformer blocks kept out of FP8 at either end of the stack.
    lm_head_fp8: run the output projection in FP8 too (off by default: logits are precision-sensitive).
    kv_cache_dtype: ``float8_e4m3fn`` stores K/V in FP8 with per-layer scales; the full-sequence forward then
      rounds K/V through the same FP8 values, so scoring sees what rollout saw.
    """

    backend: str = "bf16"
    recipe: Fp8Recipe = Fp8Recipe()
    compute_dtype: str = "bfloat16"
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    lm_head_fp8: bool = False
    kv_cache_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"precision backend={self.backend!r}; allowed: {BACKENDS}")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}; allowed: {KV_DTYPES}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r}; allowed: {COMPUTE_DTYPES}")
        if self.bf16_first_layers < 0 or self.bf16_last_layers < 0:
            raise ValueError("bf16_first_layers and bf16_last_layers must be >= 0")

    @property
    def fp8(self) -> bool:
        return self.backend != "bf16"

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def kv_fp8(self) -> bool:
        return self.kv_cache_dtype == "float8_e4m3fn"

    def segments(self, num_layers: int) -> tuple[tuple[int, int, bool], ...]:
        """Runs of consecutive blocks with one precision: ``(start, end, fp8)``, empty runs dropped."""
        if not self.fp8:
            return ((0, num_layers, False),)
        first = min(self.bf16_first_layers, num_layers)
        last = max(first, num_layers - self.bf16_last_layers)
        runs = ((0, first, False), (first, last, True), (last, num_layers, False))
        return tuple(r for r in runs if r[1] > r[0])

    def replace(self, **kw) -> Precision:
        return dataclasses.replace(self, **kw)
