"""Tokenizer from GGUF metadata against transformers' own GGUF tokenizer."""

import pytest

from fp8rl_jax.model import assets


def test_gguf_tokenizer_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    _, _, tok = smollm2
    path = assets.smollm2_gguf()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends. How many?"}]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert tok.encode_chat(messages) == list(expected)
    text = "The answer is 72.\n#### 72"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == text
    assert tok.stop_ids == (ref.eos_token_id,)


def test_missing_tokenizer_file_is_named(tmp_path):
    from fp8rl_jax.model.tokenizer import Tokenizer

    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
