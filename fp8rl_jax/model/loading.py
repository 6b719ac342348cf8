"""From a run's model settings (``ModelSpec``, which ``fp8rl_jax.plan.model_spec`` reads from ``config.model``) to a
model: architecture, weights and tokenizer from any of the supported sources."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from fp8rl_jax.model import assets, llama, weights
from fp8rl_jax.model.config import LlamaConfig, preset
from fp8rl_jax.model.tokenizer import Tokenizer, char_tokenizer


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The run's model settings (``config.model``, and ``config.seed`` for a random init)."""

    source: str  # model.source: smollm2 | preset | a Hugging Face folder | a .gguf file
    tokenizer: str  # model.tokenizer ("" = the one that comes with source)
    param_dtype: str  # model.param_dtype
    preset: str  # model.preset (source=preset)
    num_layers: int  # model.num_layers (0 = the preset's)
    preset_vocab: str  # model.preset_vocab: tokenizer | preset
    init_std: float  # model.init_std
    seed: int  # config.seed


def load_tokenizer(model_config: ModelSpec, source: str) -> Tokenizer:
    """``config.model.tokenizer`` if set ("char", "smollm2": the embedded model's, or a folder), else the tokenizer
    that comes with ``source``."""
    name = model_config.tokenizer
    if name == "char":
        return char_tokenizer()
    if name == "smollm2":  # e.g. random weights of a Llama preset (model.source=preset) on GSM8K, nothing to download
        return Tokenizer.from_gguf(assets.smollm2_gguf())
    if name:
        return Tokenizer.from_folder(name)
    if source.endswith(".gguf"):
        return Tokenizer.from_gguf(source)
    if os.path.isdir(source):
        return Tokenizer.from_folder(source)
    raise ValueError(f"config.model.tokenizer is empty and model.source={source!r} brings no tokenizer; "
                     "set config.model.tokenizer (a folder with tokenizer.json, 'smollm2' or 'char')")


def load_model(spec: ModelSpec, key: jax.Array | None = None) -> tuple[LlamaConfig, dict, Tokenizer]:
    """``(architecture, params, tokenizer)`` for ``spec`` (``config.model``).

    source: ``smollm2`` (the embedded GGUF, fetched on first use), ``preset`` (random init of
    ``config.model.preset``; its vocabulary is cut to the tokenizer's, so no logit is left without a token, unless
    ``model.preset_vocab="preset"`` keeps the preset's shapes for benchmarks: ids past the tokenizer decode to "";
    ``model.num_layers`` cuts its blocks), a Hugging Face folder, or a ``.gguf`` file.
    """
    m = spec
    dtype = jnp.dtype(m.param_dtype)
    source = m.source
    if source == "smollm2":
        source = str(assets.smollm2_gguf())
    if source == "preset":
        tokenizer = load_tokenizer(m, source)
        arch = preset(m.preset)
        if m.num_layers:
            arch = arch.replace(num_layers=m.num_layers)
        if tokenizer.vocab_size < arch.vocab_size and m.preset_vocab == "tokenizer":
            arch = arch.replace(vocab_size=tokenizer.vocab_size)
        eos = tuple(tokenizer.stop_ids)
        arch = arch.replace(eos_token_ids=eos, bos_token_id=tokenizer.bos_id)
        key = jax.random.PRNGKey(spec.seed) if key is None else key
        return arch, llama.init_params(arch, key, dtype=dtype, std=m.init_std), tokenizer
    if source.endswith(".gguf"):
        arch, params = weights.load_gguf(source, dtype=dtype)
    elif os.path.isdir(source):
        arch, params = weights.load_hf(Path(source), dtype=dtype)
    else:
        raise FileNotFoundError(f"config.model.source={source!r}: not smollm2, preset, a folder or a .gguf file")
    return arch, params, load_tokenizer(m, source)
