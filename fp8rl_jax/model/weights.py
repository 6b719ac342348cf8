"""Load and save weights: Hugging Face folders (config.json + safetensors, sharded or not) and GGUF files.

Everything is converted to this project's params layout (``llama.py``): kernels as [in, out], q/k/v fused into
``wqkv``, gate/up fused into ``w_gate_up``, layers stacked on a leading axis.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.errors import InputFileError, MissingTensorError
from fp8rl_jax.model.config import LlamaConfig, RopeScaling

HF_ARCHITECTURES = {"llama", "mistral", "qwen2", "smollm", "smollm2"}


# ----------------------------------------------------------------------------------------------------------
# configs


def config_from_hf(cfg: Mapping, path: str = "config.json") -> LlamaConfig:
    """A ``LlamaConfig`` from a Hugging Face ``config.json`` dict; ``InputFileError`` naming ``path`` for one that is
    not a Llama-family config."""
    if not isinstance(cfg, Mapping):
        raise InputFileError(f"{path}: a JSON {type(cfg).__name__}, not an object of model settings")
    model_type = cfg.get("model_type", "llama")
    if model_type not in HF_ARCHITECTURES:
        raise InputFileError(
            f"{path}: model_type={model_type!r} is not a Llama-family model ({sorted(HF_ARCHITECTURES)})")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in cfg:
            raise InputFileError(f"{path}: missing key {key!r}")
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    scaling = None
    if rope and rope.get("rope_type", rope.get("type")) == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
        raise InputFileError(f"{path}: rope_scaling type {rope.get('rope_type')!r} is not supported (llama3 or none)")
    theta = cfg.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
    )


def config_to_hf(config: LlamaConfig) -> dict:
    c = config
    out = {
        "architectures": ["Qwen2ForCausalLM" if c.qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if c.qkv_bias else "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
    }
    if not c.qkv_bias:
        out["attention_bias"] = False
        out["mlp_bias"] = False
    if c.rope_scaling is not None:
        s = c.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    if c.bos_token_id is not None:
        out["bos_token_id"] = c.bos_token_id
    if c.eos_token_ids:
        out["eos_token_id"] = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_ids[0]
    return out


# ----------------------------------------------------------------------------------------------------------
# tensors by name -> params


def _assemble(get: Callable[[str], np.ndarray], config: LlamaConfig, names: Mapping[str, str], dtype) -> dict:
    """Build params from a ``get(name) -> [out, in] array`` function and a naming scheme.

    ``names`` maps our roles to format strings with ``{i}`` for the layer index.
    """
    c = config

    def kernel(name):  # stored [out, in] -> ours [in, out]
        return np.ascontiguousarray(get(name).T)

    def stack(fn):
        return jnp.asarray(np.stack([fn(i) for i in range(c.num_layers)]), dtype)

    def fmt(role, i):
        return names[role].format(i=i)

    blocks = {
        "attn_norm": stack(lambda i: get(fmt("attn_norm", i))),
        "wqkv": stack(lambda i: np.concatenate([kernel(fmt(r, i)) for r in ("q", "k", "v")], axis=1)),
        "wo": stack(lambda i: kernel(fmt("o", i))),
        "mlp_norm": stack(lambda i: get(fmt("mlp_norm", i))),
        "w_gate_up": stack(lambda i: np.concatenate([kernel(fmt("gate", i)), kernel(fmt("up", i))], axis=1)),
        "w_down": stack(lambda i: kernel(fmt("down", i))),
    }
    if c.qkv_bias:
        blocks["bqkv"] = stack(lambda i: np.concatenate([get(fmt(r + "_bias", i)) for r in ("q", "k", "v")]))
    params = {
        "embed": jnp.asarray(get(names["embed"]), dtype),
        "blocks": blocks,
        "final_norm": jnp.asarray(get(names["final_norm"]), dtype),
    }
    if not c.tie_embeddings:
        params["lm_head"] = jnp.asarray(kernel(names["lm_head"]), dtype)
    return params


HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}

GGUF_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
}


# ----------------------------------------------------------------------------------------------------------
# Hugging Face folders


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise InputFileError(f"{index}: not a safetensors index ({e})") from e
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files and no model.safetensors.index.json")
    return files


class HFCheckpoint:
    """An open Hugging Face folder: the ``LlamaConfig`` from ``config.json`` and the safetensors tensors by name,
    read whole (``get``) or a slice at a time (``read``; the files are memory-mapped, so a slice reads only its
    own bytes)."""

    def __init__(self, folder: str | os.PathLike):
        from safetensors import safe_open

        self.folder = folder = Path(folder)
        cfg_path = folder / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path} not found (a Hugging Face model folder needs config.json)")
        try:
            hf_config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputFileError(f"{cfg_path}: not a JSON config ({type(e).__name__}: {e})") from None
        config = config_from_hf(hf_config, str(cfg_path))
        self._handles = {}
        self._where: dict[str, Path] = {}
        for f in _safetensors_files(folder):
            if not f.exists():
                raise FileNotFoundError(f"{f} is listed in the index but missing")
            try:
                h = safe_open(str(f), framework="numpy")
            except Exception as e:  # safetensors' own errors name no file: "header too large", "invalid JSON"...
                raise InputFileError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
            self._handles[f] = h
            for k in h.keys():
                self._where[k] = f
        if "lm_head.weight" not in self._where and not config.tie_embeddings:
            config = config.replace(tie_embeddings=True)  # some exports drop the duplicate head
        self.config = config

    def file(self, name: str) -> Path:
        if name not in self._where:
            raise MissingTensorError(f"{self.folder}: tensor {name!r} not found in the safetensors files")
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file(name)].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """The whole tensor as float32."""
        return np.asarray(self._handles[self.file(name)].get_tensor(name), np.float32)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` in its stored dtype (bfloat16 through ml_dtypes, which JAX imports)."""
        return _read_slice(self._handles[self.file(name)], name, index)


def _read_slice(handle, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """The one place that reads tensor bytes for the sliced loader (tests wrap it to see what is read)."""
    return handle.get_slice(name)[index]


def load_hf(folder: str | os.PathLike, dtype=jnp.float32) -> tuple[LlamaConfig, dict]:
    """Load ``config.json`` and the safetensors weights of a Hugging Face model folder, whole, on the host
    (``model.sharded.load_hf_sharded`` reads them slice by slice straight onto a mesh)."""
    checkpoint = HFCheckpoint(folder)
    return checkpoint.config, _assemble(checkpoint.get, checkpoint.config, HF_NAMES, dtype)


@dataclasses.dataclass(frozen=True)
class SlicedParam:
    """One param of our layout as pieces of a checkpoint's tensors, readable a slice at a time.

    ``shape`` is ours (with the leading [L] of a stacked param). ``parts`` are concatenated along our last axis, in
    order: ``(tensor name, width)``, the name a format string with ``{i}`` for the layer of a stacked param.
    ``transposed``: the tensors are stored [out, in] and ours is [in, out].
    """

    checkpoint: HFCheckpoint
    shape: tuple[int, ...]
    dtype: np.dtype
    stacked: bool
    transposed: bool
    parts: tuple[tuple[str, int], ...]

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The shape of one layer (of the whole param when not stacked)."""
        return self.shape[1:] if self.stacked else self.shape

    def expected_shape(self, width: int) -> tuple[int, ...]:
        """The stored shape of a part of this width."""
        trailing = self.layer_shape
        return (width, *trailing[:-1][::-1]) if self.transposed else (*trailing[:-1], width)

    def read(self, index: tuple[slice, ...], layer: int | None = None) -> np.ndarray:
        """``param[layer][index]`` (``param[index]`` when not stacked) in ``dtype``, read from the parts that the
        index's last-axis range covers; each piece goes stored dtype -> float32 -> ``dtype``, as ``load_hf``."""
        ranges = [s.indices(d) for s, d in zip(index, self.layer_shape, strict=True)]
        if any(step != 1 for _, _, step in ranges):
            raise ValueError(f"strided index {index} (shards are contiguous blocks)")
        index = tuple(slice(start, stop) for start, stop, _ in ranges)
        out = np.empty(tuple(s.stop - s.start for s in index), self.dtype)
        lo, hi = index[-1].start, index[-1].stop
        offset = 0
        for fmt, width in self.parts:
            a, b = max(lo, offset), min(hi, offset + width)
            if a < b:
                name = fmt.format(i=layer)
                piece_index = (*index[:-1], slice(a - offset, b - offset))
                if self.transposed:
                    piece = self.checkpoint.read(name, piece_index[::-1]).T
                else:
                    piece = self.checkpoint.read(name, piece_index)
                out[..., a - lo : b - lo] = np.asarray(piece, np.float32)
            offset += width
        return out


def hf_sliced_params(folder: str | os.PathLike, dtype=jnp.float32) -> tuple[LlamaConfig, dict]:
    """``(config, tree)``: the params tree of ``load_hf`` with a ``SlicedParam`` for every leaf, nothing read yet
    but the headers. Every tensor is checked up front: present (``MissingTensorError``, a KeyError, naming it, as
    ``load_hf``) and of the shape that ``config.json`` implies (``InputFileError``, a ValueError, naming the file and
    the tensor)."""
    checkpoint = HFCheckpoint(folder)
    c = checkpoint.config
    dtype = np.dtype(jnp.dtype(dtype))
    d, f, L, v = c.hidden_size, c.intermediate_size, c.num_layers, c.vocab_size
    qkv_widths = (c.q_size, c.kv_size, c.kv_size)
    qkv = [(HF_NAMES[r], w) for r, w in zip("qkv", qkv_widths, strict=True)]

    def param(shape, parts, stacked=True, transposed=False):
        shape = (L, *shape) if stacked else tuple(shape)
        return SlicedParam(checkpoint, shape, dtype, stacked, transposed, tuple(parts))

    blocks = {
        "attn_norm": param((d,), [(HF_NAMES["attn_norm"], d)]),
        "wqkv": param((d, c.q_size + 2 * c.kv_size), qkv, transposed=True),
        "wo": param((c.q_size, d), [(HF_NAMES["o"], d)], transposed=True),
        "mlp_norm": param((d,), [(HF_NAMES["mlp_norm"], d)]),
        "w_gate_up": param((d, 2 * f), [(HF_NAMES["gate"], f), (HF_NAMES["up"], f)], transposed=True),
        "w_down": param((f, d), [(HF_NAMES["down"], d)], transposed=True),
    }
    if c.qkv_bias:
        biases = [(HF_NAMES[r + "_bias"], w) for r, w in zip("qkv", qkv_widths, strict=True)]
        blocks["bqkv"] = param((c.q_size + 2 * c.kv_size,), biases)
    params = {
        "embed": param((v, d), [(HF_NAMES["embed"], d)], stacked=False),
        "blocks": blocks,
        "final_norm": param((d,), [(HF_NAMES["final_norm"], d)], stacked=False),
    }
    if not c.tie_embeddings:
        params["lm_head"] = param((d, v), [(HF_NAMES["lm_head"], v)], stacked=False, transposed=True)

    for p in jax.tree.leaves(params):
        for fmt, width in p.parts:
            want = p.expected_shape(width)
            for i in range(L) if p.stacked else [None]:
                name = fmt.format(i=i)
                got = checkpoint.shape(name)
                if got != want:
                    raise InputFileError(f"{checkpoint.file(name)}: tensor {name!r} has shape {list(got)}, "
                                     f"config.json implies {list(want)}")
    return c, params


def to_hf_tensors(params: dict, config: LlamaConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """Our params -> Hugging Face tensor names and [out, in] layouts."""
    c = config
    blocks = {k: np.asarray(v, np.float32) for k, v in params["blocks"].items()}
    out = {HF_NAMES["embed"]: params["embed"], HF_NAMES["final_norm"]: params["final_norm"]}
    if not c.tie_embeddings:
        out[HF_NAMES["lm_head"]] = np.asarray(params["lm_head"], np.float32).T
    split_qkv = [c.q_size, c.q_size + c.kv_size]
    for i in range(c.num_layers):
        def name(role, i=i):
            return HF_NAMES[role].format(i=i)

        out[name("attn_norm")] = blocks["attn_norm"][i]
        out[name("mlp_norm")] = blocks["mlp_norm"][i]
        for role, w in zip("qkv", np.split(blocks["wqkv"][i], split_qkv, axis=1), strict=True):
            out[name(role)] = w.T
        if c.qkv_bias:
            for role, b in zip("qkv", np.split(blocks["bqkv"][i], split_qkv), strict=True):
                out[name(role + "_bias")] = b
        out[name("o")] = blocks["wo"][i].T
        gate, up = np.split(blocks["w_gate_up"][i], 2, axis=1)
        out[name("gate")], out[name("up")] = gate.T, up.T
        out[name("down")] = blocks["w_down"][i].T
    return {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(dtype)) for k, v in out.items()}


HF_SAVE_DTYPES = ("float32", "bfloat16", "float16")


def save_hf(folder: str | os.PathLike, params: dict, config: LlamaConfig, dtype="float32") -> None:
    """Write ``config.json`` and ``model.safetensors`` that ``transformers`` and ``load_hf`` both read, the tensors
    in ``dtype`` (one of ``HF_SAVE_DTYPES``, also named in config.json as ``torch_dtype``)."""
    from safetensors.numpy import save_file

    dtype = jnp.dtype(dtype)
    if dtype.name not in HF_SAVE_DTYPES:
        raise ValueError(f"dtype {dtype.name!r} is not one to save weights in; allowed: {' | '.join(HF_SAVE_DTYPES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config_to_hf(config), "torch_dtype": dtype.name}, indent=2))
    save_file(to_hf_tensors(params, config, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------------------
# GGUF


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def config_from_gguf(reader, path: str = "model.gguf") -> LlamaConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise InputFileError(f"{path}: general.architecture={arch!r}; supported: llama, qwen2")

    def need(key):
        value = _gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise InputFileError(f"{path}: missing metadata key {arch}.{key}")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _gguf_field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_gguf_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        max_position_embeddings=int(_gguf_field(reader, f"{arch}.context_length", 8192)),
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs) back to the rotate-half layout.

    [heads * H, D]: llama.cpp stores rows of each head as (H/2, 2) pairs; Hugging Face as (2, H/2) halves.
    """
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | os.PathLike, dtype=jnp.float32) -> tuple[LlamaConfig, dict]:
    """Load a GGUF file, dequantizing every tensor to f32 with the ``gguf`` package."""
    import gguf

    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file {path} not found")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf's own errors name no file: "GGUF magic invalid", an IndexError on a cut file...
        raise InputFileError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    config = config_from_gguf(reader, path)
    arch = _gguf_field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise MissingTensorError(f"{path}: tensor {name!r} not found")
        t = tensors[name]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        # GGUF lists dims fastest-first; numpy's shape is the reverse: [out, in] like Hugging Face
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if arch == "llama" and ".attn_q." in name:
            w = _unpermute_rope(w, config.num_heads)
        elif arch == "llama" and ".attn_k." in name:
            w = _unpermute_rope(w, config.num_kv_heads)
        return w

    return config, _assemble(get, config, GGUF_NAMES, dtype)
