"""A GGUF file's tokenizer rebuilt as a Hugging Face ``tokenizers`` object from the file's metadata alone.

Needs only ``gguf`` and ``tokenizers``: no torch (a test-only dependency) and no transformers, whose GGUF reader
imports torch. A GGUF written by llama.cpp's converter carries the vocabulary (``tokenizer.ggml.tokens``, id order), the
BPE merges, one type per token (normal, control, user-defined, ...), the special token ids, ``add_bos_token``,
the chat template, and two names that stand for the rest: ``tokenizer.ggml.model`` (the algorithm) and
``tokenizer.ggml.pre`` (how text is split into words before BPE). We map those names to the same splitting,
merging and decoding that llama.cpp applies for them (``llama-vocab.cpp``), which are also what the model's own
``tokenizer.json`` held before conversion:

- ``model="gpt2"``: byte-level BPE. Tokens are spelled in GPT-2's byte alphabet (one printable character per
  byte), merges are "left right" pairs, decoding maps the characters back to bytes.
- ``pre`` picks the word split: ``smollm``/``starcoder``/``refact`` isolate every digit, then GPT-2's split
  (transformers 5.23 drops the digit step, so "and  2" tokenizes differently there: "Ġ" "Ġ" "2", not "ĠĠ" "2");
  ``gpt2`` is GPT-2's split alone; ``llama-bpe``/``llama3``/``llama-v3`` use Llama 3's split (digits in runs of up to
  three, case-insensitive contractions, newlines kept apart), take a word that is itself a token whole before
  merging (``ignore_merges``) and add BOS unless the file says otherwise.
- control tokens (``<|im_start|>``...) become special added tokens, user-defined ones plain added tokens: both are
  matched whole in text, never split by BPE; control tokens are dropped by ``decode(skip_special_tokens=True)``.
  An "unknown" token is special as well (llama.cpp treats it like a control token); normal, unused and byte
  tokens are plain vocabulary entries.

Anything else (a SentencePiece ``model="llama"`` vocabulary, another ``pre``) raises an ``InputFileError`` (a
ValueError) naming the file and the value: a guessed split would tokenize differently from what the model was
trained on, silently.
``tokenizer.ggml.add_eos_token`` is not used: prompts never end in EOS here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fp8rl_jax.errors import InputFileError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Llama 3's word split (as its tokenizer.json and llama.cpp's LLAMA3 pre-tokenizer write it): contractions in any
# case, letters with at most one leading non-letter, digits in runs of up to three, punctuation with its trailing
# newlines, newline runs, then the other whitespace
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How one ``tokenizer.ggml.pre`` value splits text and merges."""

    split: str  # "gpt2": GPT-2's regex (ByteLevel's own); "digits+gpt2": each digit alone first; "llama3"
    ignore_merges: bool = False  # a word that is a token is taken whole, not merged up from bytes
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


PRE_TOKENIZERS = {
    "gpt2": PreTokenizer("gpt2"),
    "smollm": PreTokenizer("digits+gpt2"),
    "starcoder": PreTokenizer("digits+gpt2"),
    "refact": PreTokenizer("digits+gpt2"),
    "llama-bpe": PreTokenizer("llama3", ignore_merges=True, add_bos=True),
    "llama3": PreTokenizer("llama3", ignore_merges=True, add_bos=True),
    "llama-v3": PreTokenizer("llama3", ignore_merges=True, add_bos=True),
}

_SPECIAL_IDS = {  # tokenizer_config.json name: GGUF key
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


def _pre_tokenizer(split: str):
    from tokenizers import Regex, pre_tokenizers

    # the byte-level step: use_regex=True is GPT-2's split; after our own split it must only map bytes to characters
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if split == "llama3":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"unknown split {split!r}")


def read_metadata(path: str | os.PathLike) -> dict:
    """The ``tokenizer.*`` metadata of a GGUF file, as Python values (lists of str/int for the arrays)."""
    import gguf

    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file {path} not found")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf's own errors name no file
        raise InputFileError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def convert(path: str | os.PathLike, metadata: dict | None = None):
    """``(backend, config)``: the ``tokenizers.Tokenizer`` and the ``tokenizer_config.json`` dict (special tokens,
    ``add_bos_token``, ``chat_template``) of the GGUF file at ``path`` (``metadata``: its ``read_metadata``, if
    already read)."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as Backend

    path = str(path)
    meta = read_metadata(path) if metadata is None else metadata
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise InputFileError(f"{path}: no tokenizer in this GGUF file (metadata key tokenizer.ggml.model is missing)")
    if model != "gpt2":
        raise InputFileError(f"{path}: tokenizer.ggml.model={model!r} is not supported; supported: 'gpt2' (byte-level "
                         f"BPE) with tokenizer.ggml.pre in {sorted(PRE_TOKENIZERS)}")
    pre_name = meta.get("tokenizer.ggml.pre")
    if pre_name not in PRE_TOKENIZERS:
        raise InputFileError(f"{path}: tokenizer.ggml.pre={pre_name!r} (tokenizer.ggml.model='gpt2') is not supported; "
                         f"supported: {sorted(PRE_TOKENIZERS)}")
    pre = PRE_TOKENIZERS[pre_name]

    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise InputFileError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing or empty")
    types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise InputFileError(f"{path}: {len(types)} tokenizer.ggml.token_type entries for {len(tokens)} tokens")
    vocab = {}
    for i, token in enumerate(tokens):
        if vocab.setdefault(token, i) != i:  # a second id for one text could never be produced or told apart
            raise InputFileError(f"{path}: token {token!r} appears twice in tokenizer.ggml.tokens "
                             f"(ids {vocab[token]} and {i})")
    pairs = []
    for i, merge in enumerate(merges):
        pair = tuple(merge.split(" "))  # byte-level tokens never hold a space (it is spelled "Ġ")
        if len(pair) != 2 or not all(pair):
            raise InputFileError(f"{path}: tokenizer.ggml.merges[{i}]={merge!r} is not two tokens joined by one space")
        pairs.append(pair)
    try:
        bpe = models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges, fuse_unk=False, byte_fallback=False)
    except Exception as e:  # a merge of tokens that are not in the vocabulary, ...
        raise InputFileError(f"{path}: the vocabulary and merges do not make a BPE model ({e})") from None
    backend = Backend(bpe)
    backend.pre_tokenizer = _pre_tokenizer(pre.split)
    backend.decoder = decoders.ByteLevel()

    # Control and user-defined tokens are matched whole in the text before the split (llama.cpp does the same);
    # each is already in the vocabulary under its own text, so adding it keeps its id and the vocabulary's size.
    # normalized=False: the text is matched as it is written, not after normalization.
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token, kind in zip(tokens, types, strict=True)
                                if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN)])
    backend.add_tokens([AddedToken(token, special=False, normalized=False)
                        for token, kind in zip(tokens, types, strict=True) if kind == TOKEN_USER_DEFINED])
    if backend.get_vocab_size() != len(tokens):
        raise InputFileError(f"{path}: adding the control/user-defined tokens changed the vocabulary size "
                         f"({len(tokens)} -> {backend.get_vocab_size()})")

    config: dict = {}
    for name, key in _SPECIAL_IDS.items():
        token_id = meta.get(key)
        if token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokens):
            raise InputFileError(f"{path}: {key}={token_id} is outside the vocabulary (0..{len(tokens) - 1})")
        config[name] = tokens[int(token_id)]
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    config["add_bos_token"] = pre.add_bos if add_bos is None else bool(add_bos)
    if meta.get("tokenizer.chat_template") is not None:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return backend, config
