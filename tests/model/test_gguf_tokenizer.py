"""GGUF tokenizers rebuilt from metadata (``model/gguf_tokenizer.py``), with neither torch nor transformers.

References: transformers' own GGUF conversion (torch is importable in the test environment) on the embedded
SmolLM2 and on small GGUF files written here; the tokenizer a small GGUF file was written from (trained here, with
the pre-tokenizer its model family's ``tokenizer.json`` has); hand-worked ids for the splits that tell the
families apart; and a process where ``import torch`` / ``import transformers`` fail.
"""

import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fp8rl_jax.model import assets
from fp8rl_jax.model.tokenizer import Tokenizer, gguf_tokenizer_cache

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[2]
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?\n\n#### 72",
    "Weng earns $12 an hour; yesterday she did 50 minutes. 1234567 + 0.5 = ?",
    "IT'S they've WE'D I'll  two  spaces\ttab\r\nCRLF\n\n\nthree newlines   ",
    "naïve café — 東京 🙂 ½",
    "<|im_start|>user\nhi <think>98 76</think><|im_end|>\n<|im_start|>assistant\n",
]


def _question_texts(n: int) -> list[str]:
    from fp8rl_jax.data.gsm8k import default_gsm8k_path, load_gsm8k

    return [p.question for p in load_gsm8k(default_gsm8k_path("test"))[:n]]


def _transformers_ids(ref, text: str) -> list[int]:
    return ref.encode(text, add_special_tokens=False)


def _chat_ids(ref, messages) -> list[int]:
    ids = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ----------------------------------------------------------------------------------------------------------
# the embedded SmolLM2 (gpt2 BPE, pre "smollm") against transformers


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    """(ours, converted now into an empty cache; transformers' GGUF tokenizer with SmolLM2's own word split).

    transformers 5.23 builds "smollm" files with GPT-2's split alone; SmolLM2's tokenizer.json (and llama.cpp's
    "smollm" pre-tokenizer) isolate every digit first. The two differ only where two or more whitespace characters
    come before a digit ("and  2/5": "ĠĠ" "2" against "Ġ" "Ġ" "2"), which ``test_smollm2_matches_transformers``
    checks; everything else (vocabulary, merges, special tokens, template, decoding) is transformers' own."""
    import copy

    from tokenizers import Tokenizer as Backend
    from transformers import AutoTokenizer

    path = assets.smollm2_gguf()
    ours = Tokenizer.from_gguf(path, cache_dir=tmp_path_factory.mktemp("tok") / "smollm2")
    raw = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = copy.deepcopy(raw)
    ref.backend_tokenizer.pre_tokenizer = Backend.from_str(_family_json("smollm")).pre_tokenizer
    return ours, ref, raw


def test_smollm2_matches_transformers_on_gsm8k(smollm2_pair):
    from fp8rl_jax.data.gsm8k import default_gsm8k_path, load_gsm8k

    ours, ref, raw = smollm2_pair
    problems = load_gsm8k(default_gsm8k_path("test"))[:300]
    texts = [t for p in problems for t in (p.question, p.solution)] + TEXTS
    unlike_raw = []
    for text in texts:
        ids = ours.encode(text)
        assert ids == _transformers_ids(ref, text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
        if ids != _transformers_ids(raw, text):
            unlike_raw.append(text)
    # only where the digit split acts: GPT-2's split alone keeps one space with the number that follows it
    assert all(any(a.isspace() and b.isnumeric() for a, b in itertools.pairwise(text)) for text in unlike_raw)
    assert len(unlike_raw) < len(texts) // 20
    system = "Solve the math problem step by step. Put the final answer after '####', e.g. '#### 42'."
    for p in problems[:100]:
        for messages in ([{"role": "user", "content": p.question}],
                         [{"role": "system", "content": system}, {"role": "user", "content": p.question},
                          {"role": "assistant", "content": p.solution}, {"role": "user", "content": "Check."}]):
            prompt = ours.apply_chat_template(messages)
            assert prompt == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = ours.encode_chat(messages)
            assert ids == _chat_ids(ref, messages)
            assert ours.decode(ids, skip_special_tokens=False) == prompt
            assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)  # <|im_start|>... dropped
    assert ours.vocab_size == len(ref) == 49152
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert (ours.bos_token, ours.eos_token, ours.stop_ids, ours.add_bos) == ("<|im_start|>", "<|im_end|>", (2,), False)
    assert ours.encode("<|endoftext|><|im_end|>") == [0, 2]  # control tokens whole, never split into pieces


def test_default_cache_is_versioned_beside_the_gguf(tmp_path):
    gguf = tmp_path / "m.Q4_1.gguf"
    assert gguf_tokenizer_cache(gguf) == tmp_path / "m.Q4_1.tokenizer-v2"  # not v1's "m.Q4_1.tokenizer"


# ----------------------------------------------------------------------------------------------------------
# small GGUF files written here


def _write_gguf(path: Path, tokens, merges, *, pre="smollm", model="gpt2", types=None, add_bos=None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    if model is not None:
        writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types or [1] * len(tokens))
    writer.add_token_merges(merges)
    specials = {t: i for i, t in enumerate(tokens) if t.startswith("<|")}
    if "<|im_start|>" in specials:
        writer.add_bos_token_id(specials["<|im_start|>"])
        writer.add_eos_token_id(specials["<|im_end|>"])
        writer.add_pad_token_id(specials["<|endoftext|>"])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# the word splits as the families' own tokenizer.json files write them (SmolLM2, Llama 3), spelled out here
# rather than taken from the code under test
FAMILY_PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
    "llama-bpe": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Isolated", "invert": False, "pattern": {"Regex": (
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
            "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")}},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
}


def _family_json(pre: str) -> str:
    """An empty byte-level BPE ``tokenizer.json`` with ``pre``'s family split."""
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": FAMILY_PRE_TOKENIZERS[pre], "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": {}, "merges": []}})


def _trained(pre: str):
    """A byte-level BPE tokenizer of ~500 tokens trained on GSM8K questions with ``pre``'s family split, plus
    three control tokens and one user-defined token; llama-bpe's takes words whole (ignore_merges) like Llama 3's."""
    from tokenizers import AddedToken, pre_tokenizers, trainers
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(_family_json(pre))
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_question_texts(200), trainer)
    backend.add_tokens([AddedToken("<think>", normalized=False)])
    spec = json.loads(backend.to_str())
    spec["model"]["ignore_merges"] = pre == "llama-bpe"
    return Backend.from_str(json.dumps(spec))


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe"])
def test_small_gguf_matches_its_source_and_transformers(pre, tmp_path):
    from transformers import AutoTokenizer

    source = _trained(pre)
    tokens = [source.id_to_token(i) for i in range(source.get_vocab_size())]
    merges = [" ".join(m) for m in json.loads(source.to_str())["model"]["merges"]]
    types = [CONTROL if t.startswith("<|") else USER_DEFINED if t == "<think>" else 1 for t in tokens]
    path = _write_gguf(tmp_path / f"{pre}.gguf", tokens, merges, pre=pre, types=types)
    ours = Tokenizer.from_gguf(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert gguf_tokenizer_cache(path).is_dir()
    for text in TEXTS + _question_texts(220)[200:]:  # questions the vocabulary was not trained on, too
        ids = ours.encode(text, add_bos=False)
        assert ids == source.encode(text, add_special_tokens=False).ids, text
        assert ids == _transformers_ids(ref, text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert len(ours.encode(TEXTS[-1])) > 8 and ours.encode("<think>", add_bos=False) == [tokens.index("<think>")]
    assert ours.decode(ours.encode(TEXTS[-1])) == "user\nhi <think>98 76</think>\nassistant\n"  # control dropped
    messages = [{"role": "user", "content": "What is 12 * 7?"}]
    assert ours.encode_chat(messages) == _chat_ids(ref, messages)
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.pad_id) == (len(tokens), 1, 2, 0)
    assert ours.add_bos == (pre == "llama-bpe")  # llama.cpp adds BOS for llama-bpe unless the file says not to


def _byte_vocab(*extra: str) -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet()) + list(extra)


@pytest.mark.parametrize("pre, expected", [
    ("gpt2", ["1", "2", "34", "5", "6", "7", "Ġ", "x", "y", "z"]),  # GPT-2's split: "1234567" one word
    ("smollm", ["1", "2", "3", "4", "5", "6", "7", "Ġ", "x", "y", "z"]),  # every digit alone
    ("llama-bpe", ["1", "2", "3", "4", "5", "6", "7", "Ġxyz"]),  # "123|456|7"; "Ġxyz" is a token: taken whole
])
def test_family_splits_by_hand(pre, expected, tmp_path):
    """"34" is a merge but crosses a word boundary under llama-bpe's split (digits in threes) and smollm's (each
    digit alone); "Ġxyz" is in the vocabulary but no merge makes it, so only llama-bpe (ignore_merges) emits it."""
    tokens = _byte_vocab("34", "Ġxyz")
    ours = Tokenizer.from_gguf(_write_gguf(tmp_path / "m.gguf", tokens, ["3 4"], pre=pre))
    assert [tokens[i] for i in ours.encode("1234567 xyz")] == expected
    assert ours.decode(ours.encode("1234567 xyz")) == "1234567 xyz"


def test_add_bos_from_the_file_wins(tmp_path):
    tokens = _byte_vocab("34", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
    types = [1] * 257 + [CONTROL] * 3
    path = _write_gguf(tmp_path / "m.gguf", tokens, ["3 4"], pre="llama-bpe", types=types, add_bos=False)
    tok = Tokenizer.from_gguf(path)
    assert not tok.add_bos and tok.encode("34") == [tokens.index("34")]
    path = _write_gguf(tmp_path / "n.gguf", tokens, ["3 4"], pre="smollm", types=types, add_bos=True)
    assert Tokenizer.from_gguf(path).encode("34") == [258, tokens.index("3"), tokens.index("4")]


@pytest.mark.parametrize("model, pre, message", [
    ("llama", "default", "tokenizer.ggml.model='llama' is not supported"),
    ("gpt2", "qwen2", r"tokenizer.ggml.pre='qwen2' \(tokenizer.ggml.model='gpt2'\) is not supported"),
    ("gpt2", None, "tokenizer.ggml.pre=None"),
    (None, None, "no tokenizer in this GGUF file"),
])
def test_unsupported_tokenizers_are_named(model, pre, message, tmp_path):
    path = _write_gguf(tmp_path / "x.gguf", _byte_vocab(), [], model=model, pre=pre)
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: {message}"):
        Tokenizer.from_gguf(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]  # no cache, no temporary folder left


def test_bad_merge_is_named(tmp_path):
    path = _write_gguf(tmp_path / "x.gguf", _byte_vocab(), ["a b", "ab"])
    with pytest.raises(ValueError, match=r"tokenizer.ggml.merges\[1\]='ab' is not two tokens"):
        Tokenizer.from_gguf(path)


# ----------------------------------------------------------------------------------------------------------
# the run path in a process without torch or transformers

_BLOCK = """
import sys

class _NotInstalled:  # as if torch and transformers were not installed (they are test-only dependencies)
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")

sys.meta_path.insert(0, _NotInstalled())
"""


def test_run_path_needs_neither_torch_nor_transformers(smollm2_pair, tmp_path):
    """The demo's model loading (configs/smollm2_gsm8k.py: the embedded GGUF, its weights and its tokenizer,
    converted into an empty cache) in a process where torch and transformers cannot be imported."""
    cache = tmp_path / "cache"
    (cache / "smollm2").mkdir(parents=True)
    (cache / "smollm2" / assets.SMOLLM2_GGUF).symlink_to(assets.smollm2_gguf())  # no download, a fresh cache
    questions = _question_texts(20)
    code = _BLOCK + textwrap.dedent(f"""
        import json
        import fp8rl_jax.main, fp8rl_jax.trainer  # the demo's imports
        from fp8rl_jax.config import load_config_file
        from fp8rl_jax.model.loading import load_model
        from fp8rl_jax.plan import model_spec

        config = load_config_file({str(REPO / "configs" / "smollm2_gsm8k.py")!r})
        config.model.param_dtype = "bfloat16"
        arch, params, tok = load_model(model_spec(config))
        chats = [tok.encode_chat([{{"role": "user", "content": q}}]) for q in {questions!r}]
        print(json.dumps({{"chats": chats, "vocab": [arch.vocab_size, tok.vocab_size], "stop": tok.stop_ids,
                          "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))}}))
    """)
    env = {**os.environ, "FP8RL_CACHE": str(cache), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    _, ref, _ = smollm2_pair
    assert out["chats"] == [_chat_ids(ref, [{"role": "user", "content": q}]) for q in questions]
    assert out["vocab"] == [49152, 49152] and out["stop"] == [2] and out["loaded"] == []
    assert [p.name for p in (cache / "smollm2").glob("*.tokenizer*")]  # converted in that process, cached there
