"""The GGUF tokenizer's cache and folder loading; the synthetic tasks' char tokenizer (GGUF conversion itself:
test_gguf_tokenizer.py)."""

import string

import pytest

from fp8rl_jax.model import assets
from fp8rl_jax.model.config import PRESETS
from fp8rl_jax.model.tokenizer import char_tokenizer


def test_gguf_conversion_that_loses_the_race_keeps_the_finished_cache(smollm2, tmp_path):
    """Two processes sharing a cache may convert at once: the one that finishes second finds the folder there,
    keeps it, and leaves no temporary folder behind."""
    from fp8rl_jax.model.tokenizer import Tokenizer, _convert_gguf_tokenizer

    path, out = assets.smollm2_gguf(), tmp_path / "tok"
    _convert_gguf_tokenizer(path, out)
    first = (out / "tokenizer.json").read_bytes()
    _convert_gguf_tokenizer(path, out)  # as if another process had finished first
    assert (out / "tokenizer.json").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
    assert Tokenizer.from_folder(out).encode("72") == smollm2[2].encode("72")


def test_missing_tokenizer_file_is_named(tmp_path):
    from fp8rl_jax.model.tokenizer import Tokenizer

    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_char_tokenizer_vocabulary():
    tok = char_tokenizer()
    expected = ["<pad>", "<bos>", "<eos>", *string.digits, *string.ascii_lowercase, *"+-=*: ?.,#\n"]
    assert [tok.backend.id_to_token(i) for i in range(tok.vocab_size)] == expected
    assert tok.vocab_size == 50 <= PRESETS["tiny"].vocab_size
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.stop_ids) == (0, 1, 2, (2,))


@pytest.mark.parametrize("text", ["a b:12", "37+48=85", "kqz:\n\nx  y", "#### -3.5, ok?", "a*b=c"])
def test_char_tokenizer_round_trip(text):
    tok = char_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and len(ids) == len(text) + 1  # one token per character, after <bos>
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text
    assert tok.encode(text, add_bos=False) == ids[1:]


def test_char_tokenizer_rejects_unknown_chars():
    tok = char_tokenizer()
    with pytest.raises(ValueError, match=r"\['A', 'Q'\] are not in the char tokenizer"):
        tok.encode("Q: 2A")
    assert tok.encode("<bos>ab<eos>", add_bos=False) == [1, 13, 14, 2]  # special tokens are not unknown
