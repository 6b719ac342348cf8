"""Prompt building (chat / plain), the length filter, and the grain stream's epochs and checkpoint/restore."""

import json

import pytest

from fp8rl_jax.config import base_config
from fp8rl_jax.data import prompts
from fp8rl_jax.model.tokenizer import char_tokenizer
from fp8rl_jax.plan import data_spec


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from fp8rl_jax.model import assets
    from fp8rl_jax.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(assets.smollm2_gguf())


@pytest.fixture(scope="module")
def char_tok():
    return char_tokenizer()


def _config(dataset="pattern", **data):
    c = base_config()
    c.data.dataset = dataset
    c.data.prompt_format = "plain"
    c.data.max_prompt_tokens = 16
    for key, value in data.items():
        c.data[key] = value
    return c


def _gsm8k_file(tmp_path, questions):
    path = tmp_path / "mini.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n" for i, q in enumerate(questions)))
    return str(path)


def test_chat_prompt_uses_the_template(smollm2_tokenizer):
    text, ids = prompts.build_prompt(smollm2_tokenizer, "What is 2+3?", prompt_format="chat",
                                     system_prompt="Answer after ####.")
    assert text == ("<|im_start|>system\nAnswer after ####.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert ids == tuple(smollm2_tokenizer.encode(text, add_bos=False))
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text
    # no system prompt given: the template's own default system message, then the question
    text, _ = prompts.build_prompt(smollm2_tokenizer, "Hi?", prompt_format="chat", system_prompt="")
    assert text.count("<|im_start|>user\nHi?<|im_end|>") == 1 and text.endswith("<|im_start|>assistant\n")


def test_plain_prompts(char_tok, smollm2_tokenizer):
    text, ids = prompts.build_prompt(char_tok, "kqz:", prompt_format="plain")
    assert text == "kqz:" and ids == (char_tok.bos_id, *char_tok.encode("kqz:", add_bos=False))
    text, ids = prompts.build_prompt(smollm2_tokenizer, "How {many}?", prompt_format="plain", system_prompt="Be brief.",
                                     plain_template=prompts.GSM8K_PLAIN_TEMPLATE)
    assert text == "Be brief.\n\nQuestion: How {many}?\nAnswer:"
    with pytest.raises(ValueError, match="no chat template"):
        prompts.build_prompt(char_tok, "kqz:", prompt_format="chat")
    with pytest.raises(ValueError, match="prompt_format 'xml'"):
        prompts.build_prompt(char_tok, "kqz:", prompt_format="xml")


def test_gsm8k_chat_prompts_of_the_real_file(smollm2_tokenizer):
    c = _config("gsm8k", prompt_format="chat", max_prompt_tokens=256, system_prompt="Put the answer after ####.")
    ps = prompts.load_prompts(data_spec(c), smollm2_tokenizer, "test")
    assert ps.total == 1319 and len(ps.records) + ps.dropped == 1319
    r = ps.records[0]
    assert r.task == "gsm8k" and r.answer == "18" and "Janet" in r.prompt_text
    assert all(len(r.prompt_ids) <= 256 for r in ps.records)


def test_long_prompts_are_dropped_and_counted(tmp_path, smollm2_tokenizer):
    questions = ["two", "three four five six seven eight nine ten", "one", "a b c d e f g h i j k l m n o p"]
    lengths = [len(prompts.build_prompt(smollm2_tokenizer, q, prompt_format="plain",
                                        plain_template=prompts.GSM8K_PLAIN_TEMPLATE)[1]) for q in questions]
    limit = max(lengths[0], lengths[2])
    assert limit < min(lengths[1], lengths[3])  # the test's premise: two short prompts, two long
    c = _config("gsm8k", train_path=_gsm8k_file(tmp_path, questions), max_prompt_tokens=limit)
    ps = prompts.load_prompts(data_spec(c), smollm2_tokenizer)
    assert [r.answer for r in ps.records] == ["0", "2"] and (ps.dropped, ps.total) == (2, 4)
    assert ps.records[0].prompt_text == "Question: two\nAnswer:"
    it = prompts.prompt_iterator(data_spec(c), smollm2_tokenizer)
    assert (it.dropped, it.total) == (2, 4)
    c.data.max_prompt_tokens = min(lengths) - 1
    with pytest.raises(ValueError, match=f"max_prompt_tokens={min(lengths) - 1} drops all 4"):
        prompts.load_prompts(data_spec(c), smollm2_tokenizer)


def test_train_stream_is_a_new_permutation_each_epoch(tmp_path, smollm2_tokenizer):
    path = _gsm8k_file(tmp_path, [f"q{i}" for i in range(6)])
    it = prompts.prompt_iterator(data_spec(_config("gsm8k", train_path=path, max_prompt_tokens=64)), smollm2_tokenizer,
                                 seed=7)
    epochs = [[r.answer for r in it.take(6)] for _ in range(5)]
    assert all(sorted(e) == [str(i) for i in range(6)] for e in epochs)  # each epoch: every record once
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled, not one order repeated
    c = _config("gsm8k", train_path=path, max_prompt_tokens=64, shuffle=False)
    unshuffled = prompts.prompt_iterator(data_spec(c), smollm2_tokenizer)
    assert [r.answer for r in unshuffled.take(8)] == ["0", "1", "2", "3", "4", "5", "0", "1"]


def test_eval_stream_is_one_pass_in_order(tmp_path, smollm2_tokenizer):
    path = _gsm8k_file(tmp_path, [f"q{i}" for i in range(5)])
    c = _config("gsm8k", eval_path=path, max_prompt_tokens=64)
    records = prompts.prompt_iterator(data_spec(c), smollm2_tokenizer, "test").take(10)
    assert [r.answer for r in records] == ["0", "1", "2", "3", "4"]
    c.data.num_eval = 2
    assert [r.answer for r in prompts.prompt_iterator(data_spec(c), smollm2_tokenizer, "test")] == ["0", "1"]


@pytest.mark.parametrize("dataset", ["pattern", "arithmetic"])
def test_checkpoint_restore(char_tok, dataset):
    c = _config(dataset)
    first = prompts.prompt_iterator(data_spec(c), char_tok)
    head = first.take(5)
    state = json.loads(json.dumps(first.get_state()))  # what a checkpoint stores must survive JSON
    a = first.take(3)
    second = prompts.prompt_iterator(data_spec(c), char_tok)
    second.set_state(state)
    b = second.take(3)
    assert a == b and a != head[:3]
    assert all(r.task == dataset and r.prompt_ids[0] == char_tok.bos_id for r in a)


def test_checkpoint_restore_across_an_epoch(tmp_path, smollm2_tokenizer):
    path = _gsm8k_file(tmp_path, [f"q{i}" for i in range(4)])
    c = _config("gsm8k", train_path=path, max_prompt_tokens=64)
    first = prompts.prompt_iterator(data_spec(c), smollm2_tokenizer)
    first.take(3)
    state = first.get_state()
    a = first.take(6)
    second = prompts.prompt_iterator(data_spec(c), smollm2_tokenizer)
    second.set_state(state)
    assert second.take(6) == a


def test_json_safe_state_round_trip():
    state = {"next_index": 5, "inner": [b"\x00\xffraw", (1, 2)], "name": "x"}
    encoded = prompts.to_json_safe(state)
    decoded = prompts.from_json_safe(json.loads(json.dumps(encoded)))
    assert decoded == {"next_index": 5, "inner": [b"\x00\xffraw", [1, 2]], "name": "x"}


def test_unknown_dataset_and_split(char_tok):
    with pytest.raises(ValueError, match="split 'dev'"):
        prompts.load_prompts(data_spec(_config()), char_tok, "dev")
    with pytest.raises(ValueError, match="config.data.dataset='math'"):
        prompts.load_prompts(data_spec(_config("math")), char_tok)
