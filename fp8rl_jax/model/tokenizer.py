"""Tokenizer: a Hugging Face ``tokenizers`` object plus special ids and the model's chat template.

Loaded from ``tokenizer.json`` (+ ``tokenizer_config.json``) of a model folder, or from a GGUF file's metadata.
A GGUF tokenizer is rebuilt from that metadata with ``gguf`` and ``tokenizers`` alone (``gguf_tokenizer.py``; no
torch, no transformers) once, and cached beside the GGUF file as ``tokenizer.json`` + ``tokenizer_config.json``
(``gguf_tokenizer_cache``). ``char_tokenizer`` is the synthetic tasks' one-token-per-character vocabulary
(``config.model.tokenizer="char"``).
"""

from __future__ import annotations

import json
import os
import shutil
import string
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fp8rl_jax.errors import InputFileError


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # tokenizer_config.json may hold AddedToken dicts
        return value.get("content")
    return value


class Tokenizer:
    def __init__(
        self,
        backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_eos_tokens: Sequence[str] = (),
    ):
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.bos_id = self._id(bos_token)
        self.eos_id = self._id(eos_token)
        self.pad_id = self._id(pad_token) if pad_token else self.eos_id
        self.stop_ids = tuple(i for i in [self.eos_id, *map(self._id, extra_eos_tokens)] if i is not None)
        self._template = None

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        i = self.backend.token_to_id(token)
        if i is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary")
        return i

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's own chat template (Jinja, sandboxed, as transformers does)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; use a plain-text prompt template")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # the template writes any BOS itself
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)

    # ------------------------------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> Tokenizer:
        """``tokenizer.json`` and, when present, ``tokenizer_config.json`` of a Hugging Face model folder."""
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # the tokenizers library's own errors (a bare Exception) name no file
            raise InputFileError(f"{path}: not a readable tokenizer.json ({' '.join(str(e).split())})") from None
        meta = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            try:
                meta = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise InputFileError(f"{cfg_path}: invalid JSON ({type(e).__name__}: {e})") from None
            if not isinstance(meta, dict):
                raise InputFileError(f"{cfg_path}: a JSON {type(meta).__name__}, not an object of tokenizer settings")
        template = meta.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(
            backend,
            bos_token=_token_text(meta.get("bos_token")),
            eos_token=_token_text(meta.get("eos_token")),
            pad_token=_token_text(meta.get("pad_token")),
            add_bos=bool(meta.get("add_bos_token", False)),
            chat_template=template,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata (converted once into ``cache_dir``, by default
        ``gguf_tokenizer_cache(path)``, then loaded from there)."""
        path = Path(path)
        cache = Path(cache_dir) if cache_dir else gguf_tokenizer_cache(path)
        if not (cache / "tokenizer.json").exists():
            _convert_gguf_tokenizer(path, cache)
        return cls.from_folder(cache)

    def save(self, folder: str | os.PathLike) -> None:
        """``tokenizer.json`` and ``tokenizer_config.json`` that ``from_folder`` and transformers' ``AutoTokenizer``
        both load and that encode like this tokenizer: transformers' ``tokenizer(text)`` adds BOS exactly when
        ``encode(text)`` does (a post-processor written into ``tokenizer.json``), ``apply_chat_template`` renders
        the same template. (A character tokenizer's out-of-vocabulary error is the backend's own there.)"""
        from tokenizers import Tokenizer as Backend
        from tokenizers import processors

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        backend = Backend.from_str(self.backend.to_str())  # a copy: the post-processor changes for transformers
        if self.add_bos and self.bos_id is not None:
            bos = (self.bos_token, self.bos_id)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B:1", special_tokens=[bos])
        elif backend.post_processor is not None and backend.post_processor.num_special_tokens_to_add(False):
            backend.post_processor = None  # it would add tokens that ``encode`` never adds
        backend.save(str(folder / "tokenizer.json"))
        meta = {
            "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as it is, whatever the architecture
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": False,  # decode as the backend does, like ``decode``
        }
        meta = {key: value for key, value in meta.items() if value is not None}
        if self.chat_template:
            meta["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(meta, indent=2))


# ----------------------------------------------------------------------------------------------------------
# the synthetic tasks' character tokenizer (``config.model.tokenizer="char"``)

CHAR_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
CHAR_VOCABULARY = string.digits + string.ascii_lowercase + "+-=*: ?.,#\n"
_CHAR_SET = frozenset(CHAR_VOCABULARY)


def char_tokenizer() -> Tokenizer:
    """One token per character over ``<pad> <bos> <eos>``, digits, lowercase letters and ``+-=*: ?.,#\\n``.

    A real ``tokenizers`` WordLevel model (so it saves, loads and batch-encodes like any other). A character
    outside the vocabulary raises ValueError naming it (there is no ``<unk>``: the synthetic tasks never produce
    one, and a silent unknown token would hide a prompt bug). Prompts start with ``<bos>``, an attention sink for
    the tiny model. Ids past the vocabulary (a model head wider than 50) decode to nothing.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {token: i for i, token in enumerate([*CHAR_SPECIAL_TOKENS, *CHAR_VOCABULARY])}
    backend = Backend(models.WordLevel(vocab))
    # every character its own word, newlines included ("[\s\S]", not "."); Fuse joins them back with no spaces
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(CHAR_SPECIAL_TOKENS))
    return CharTokenizer(backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", add_bos=True)


class CharTokenizer(Tokenizer):
    """``Tokenizer`` whose ``encode`` names any character outside the vocabulary (the backend's own error,
    "Missing [UNK] token", does not say which)."""

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        if not set(text) <= _CHAR_SET:
            plain = text
            for token in CHAR_SPECIAL_TOKENS:
                plain = plain.replace(token, "")
            unknown = sorted(set(plain) - _CHAR_SET)
            if unknown:
                raise ValueError(f"characters {unknown} are not in the char tokenizer's vocabulary "
                                 f"{CHAR_VOCABULARY!r}")
        return super().encode(text, add_bos)


# the cache folder's suffix; its version changes whenever the conversion does, so that a cache written by an
# older conversion (v1: transformers' AutoTokenizer) is never loaded in its place
GGUF_TOKENIZER_CACHE_SUFFIX = ".tokenizer-v2"


def gguf_tokenizer_cache(path: str | os.PathLike) -> Path:
    """Where ``Tokenizer.from_gguf`` caches a GGUF file's converted tokenizer by default: beside the file,
    ``model.gguf`` -> ``model.tokenizer-v2/`` (a folder that ``Tokenizer.from_folder`` loads)."""
    return Path(path).with_suffix(GGUF_TOKENIZER_CACHE_SUFFIX)


def _convert_gguf_tokenizer(path: Path, out: Path) -> None:
    from fp8rl_jax.model import gguf_tokenizer

    backend, meta = gguf_tokenizer.convert(path)  # raises, naming the file, before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    # a folder of this process's own beside the target: several processes sharing a cache may convert at once
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))
    try:
        backend.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(meta, indent=2))
        try:
            os.replace(tmp, out)  # atomic: a half-written cache never looks complete
        except OSError:
            if not (out / "tokenizer.json").exists():  # not another process's finished conversion: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename; else what is left of it
