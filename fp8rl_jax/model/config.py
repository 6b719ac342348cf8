"""Llama-family architecture hyper-parameters and the presets this project ships."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (``rope_type: llama3`` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A decoder-only Llama-family transformer (Llama 2/3, SmolLM, Qwen2 with ``qkv_bias``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        block = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        if self.qkv_bias:
            block += self.q_size + 2 * self.kv_size
        return v * d * (1 if self.tie_embeddings else 2) + self.num_layers * block + d

    def replace(self, **kw: Any) -> LlamaConfig:
        return dataclasses.replace(self, **kw)


PRESETS: dict[str, LlamaConfig] = {
    # Llama-3.1-8B
    "llama3_8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0),
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    # Llama-3.2-1B
    "llama3_1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0),
        tie_embeddings=True, max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    # SmolLM2-135M(-Instruct): the embedded default
    "smollm2_135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    # tests and CI: a few hundred thousand parameters
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
    ),
    # Qwen2-style tiny: q/k/v bias, untied, rope scaling off
    "tiny_qwen2": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True, max_position_embeddings=512,
    ),
}


def preset(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]
