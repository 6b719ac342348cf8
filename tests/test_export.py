"""Hugging Face export, checked by loading the folder back with transformers (PyTorch, CPU, float32): the same
logits as our forward, a tokenizer that encodes (and renders the chat template) like ours."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from fp8rl_jax.config import load_config_file
from fp8rl_jax.export import export_hf, export_run
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import llama, weights
from fp8rl_jax.model.tokenizer import Tokenizer, char_tokenizer

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[1]
F32 = Precision(compute_dtype="float32")
TEXTS = ["bfca:", "a b:12", "37+48=85\n#### 85", "kqz:\n\nx  y"]


def _logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _relative(ours, ref) -> float:
    return float(np.linalg.norm(np.asarray(ours) - ref) / np.linalg.norm(ref))


def test_cli_exports_a_trained_checkpoint(tmp_path):
    """configs/tiny.py trained 2 steps; the exported folder gives the trained policy's logits in transformers."""
    from fp8rl_jax.trainer import Trainer

    config = load_config_file(str(ROOT / "configs/tiny.py"))
    with config.unlocked():
        config.workdir = str(tmp_path / "run")
        config.steps = 2
        config.logging.progress = config.logging.tensorboard = config.logging.plots = False
    trainer = Trainer(config)
    initial = jax.device_get(trainer.state["params"])
    trainer.run()
    trained, model, ours_tok = jax.device_get(trainer.state["params"]), trainer.model, trainer.tokenizer
    trainer.close()

    out = tmp_path / "hf"
    result = subprocess.run([sys.executable, "-m", "fp8rl_jax.export", "--config=configs/tiny.py",
                             f"--config.workdir={tmp_path / 'run'}", f"--checkpoint={tmp_path / 'run/checkpoints'}",
                             f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config["model_type"], hf_config["vocab_size"], hf_config["eos_token_id"]) == ("llama", 50, 2)

    tokens = np.asarray([ours_tok.encode(t)[:8] for t in ["bfca:abcd", "hgfe:hhgg", "ab:bbaaba"]])
    ref = _logits(out, tokens)
    forward = jax.jit(lambda p, t: llama.forward(p, t, config=model, precision=F32)[0])
    ours = forward(trained, jnp.asarray(tokens))
    assert _relative(ours, ref) < 1e-4
    assert _relative(forward(initial, jnp.asarray(tokens)), ref) > 1e-3  # the trained policy, not the initial one

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == ours_tok.encode(text), text
        assert hf_tok.decode(ours_tok.encode(text), skip_special_tokens=True) == text
    reloaded = Tokenizer.from_folder(out)
    assert [reloaded.encode(t) for t in TEXTS] == [ours_tok.encode(t) for t in TEXTS]
    assert (reloaded.bos_id, reloaded.eos_id, reloaded.pad_id) == (ours_tok.bos_id, ours_tok.eos_id, ours_tok.pad_id)


def test_qwen2_initial_weights_export(tmp_path):
    """No checkpoint: the model the config loads (here a random tiny Qwen2: q/k/v biases, its own head)."""
    config = load_config_file(str(ROOT / "configs/tiny.py"))
    with config.unlocked():
        config.model.preset = "tiny_qwen2"
        config.model.init_std = 0.1  # peaky logits: a wrong weight layout shows
    out = export_run(config, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    from fp8rl_jax.model.loading import load_model
    from fp8rl_jax.plan import model_spec

    model, params, tokenizer = load_model(model_spec(config))
    tokens = np.random.RandomState(0).randint(0, model.vocab_size, (2, 20))
    ours = llama.forward(params, jnp.asarray(tokens), config=model, precision=F32)[0]
    assert _relative(ours, _logits(out, tokens)) < 1e-4
    back_model, back = weights.load_hf(out)  # and it loads back here (config.model.source=<out>)
    assert back_model == model
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_export_and_existing_folder(tmp_path):
    config = load_config_file(str(ROOT / "configs/tiny.py"))
    out = export_run(config, tmp_path / "hf", dtype="bfloat16")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(FileExistsError, match="is not an empty folder"):
        export_run(config, out)
    with pytest.raises(ValueError, match="--step needs --checkpoint"):
        export_run(config, tmp_path / "other", step=3)


def test_smollm2_tokenizer_exports_with_its_chat_template(tmp_path):
    """The embedded model's GGUF tokenizer (byte-level BPE, no BOS on plain text, a chat template)."""
    from fp8rl_jax.model import assets

    ours = Tokenizer.from_gguf(assets.smollm2_gguf())
    ours.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = ["The answer is 72.\n#### 72", "Natalia sold 48 clips in April. ¿Qué? 😀", "  two  spaces"]
    for text in texts:
        assert hf(text)["input_ids"] == ours.encode(text), text
        assert hf.decode(ours.encode(text)) == ours.decode(ours.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 x 7?"}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.encode_chat(messages) == list(expected)
    assert hf.eos_token_id == ours.eos_id and hf.bos_token_id == ours.bos_id
    reloaded = Tokenizer.from_folder(tmp_path)
    assert reloaded.encode_chat(messages) == ours.encode_chat(messages)


def test_export_refuses_a_tokenizer_wider_than_the_model(tmp_path):
    from fp8rl_jax.model.config import preset

    model = preset("tiny").replace(vocab_size=40)
    params = llama.init_params(model, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="the tokenizer has 50 tokens"):
        export_hf(tmp_path / "hf", params, model, char_tokenizer())
    assert not (tmp_path / "hf").exists()
