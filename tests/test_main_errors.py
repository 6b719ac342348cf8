"""Broken input files fail in one line that names the file: config files that raise (through the CLI, with
``--dry_run``, and through ``load_config_file``) and weight files that are not what their name says."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fp8rl_jax.config import ConfigError, load_config_file
from fp8rl_jax.model import weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# get_config bodies, and the one line each must give (after "error: <file>: ")
RAISING_CONFIGS = [
    ('raise RuntimeError("boom")', "get_config raised RuntimeError: boom"),  # was a 39-line traceback
    ('raise ValueError("bad\\n  value")', "get_config raised ValueError: bad value"),  # was ml_collections' 11
    ('raise OSError("disk")', "get_config raised OSError: disk"),  # was deferred, and named no file
    ('return {}["steps"]', "get_config raised KeyError: 'steps'"),
    ("import no_such_module_here", "get_config raised ModuleNotFoundError: No module named 'no_such_module_here'"),
]


def _config_file(tmp_path, body, name="bad.py"):
    path = tmp_path / name
    path.write_text(f"def get_config(arg=None):\n    {body}\n")
    return str(path)


def _main(*args, module="fp8rl_jax.main"):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _one_error_line(result, status=2) -> str:
    """The one ``error:`` line of a command that failed with ``status`` and printed nothing else."""
    assert (result.returncode, result.stdout) == (status, ""), result.stderr[-3000:]
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr[-3000:]
    return result.stderr.rstrip("\n")


ROLLOUT_KEYS = ("decode_attention, decode_slots, exact, inflight_updates, load_delay_chunks, max_new_tokens, "
                "max_staleness, prompts_per_step, samples_per_prompt, temperature, tensor_parallel, top_k, top_p")
# a flag that does not parse, and the start of the one line it gives (all exited with status 1 before, most in two)
BAD_FLAGS = [
    ("--config.rollout.foo=1", f"--config.rollout.foo: unknown key 'foo' in config.rollout; known: {ROLLOUT_KEYS}"),
    ("--config.nosuchsection.x=1", "--config.nosuchsection.x: unknown key 'nosuchsection' in config; known: "
     "checkpoint, data, faults, logging, mesh, model, optim, precision, reward, rl, rollout, seed, steps, workdir"),
    ("--config.seed.x=1", "--config.seed.x: config.seed is a value (int), not a section with keys"),
    ("--nosuchflag", "Unknown command line flag 'nosuchflag' (--help lists the flags)"),
    ("--config.rollout.prompts_per_step=abc", "flag --config.rollout.prompts_per_step=abc: "),
    ("--config.optim.lr=abc", "flag --config.optim.lr=abc: "),
    ("--config.rl.packing=maybe", "flag --config.rl.packing=maybe: "),
    ("--steps=abc", "flag --steps=abc: "),
    ("extra", "unexpected arguments: ['extra']"),
]


@pytest.mark.parametrize("arg, message", BAD_FLAGS, ids=[a.split("=")[0] for a, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_and_exit_status_2(tmp_path, arg, message):
    line = _one_error_line(_main("--config=configs/tiny.py", f"--config.workdir={tmp_path / 'run'}", arg,
                                 "--dry_run"))
    assert line.startswith(f"error: {message}")
    assert not (tmp_path / "run").exists()


def test_unknown_key_without_dry_run():
    """What README and the module docstring promise, as a user types it: exit status 2, one line."""
    line = _one_error_line(_main("--config=configs/tiny.py", "--config.rollout.foo=1"))
    assert line == f"error: --config.rollout.foo: unknown key 'foo' in config.rollout; known: {ROLLOUT_KEYS}"


@pytest.mark.parametrize("module", ["export", "serve"])
@pytest.mark.parametrize("arg, message", [
    ("--config.rollout.foo=1", f"--config.rollout.foo: unknown key 'foo' in config.rollout; known: {ROLLOUT_KEYS}"),
    ("--nosuchflag", "Unknown command line flag 'nosuchflag' (--help lists the flags)"),
    ("--config.optim.lr=abc", "flag --config.optim.lr=abc: "),
    ("extra", "unexpected arguments: ['extra']"),  # was absl's usage text, exit status 1
    ("--steps=3", "--steps=3: a trainer flag (python -m fp8rl_jax.main)"),
], ids=["unknown_key", "unknown_flag", "bad_value", "positional", "steps"])
def test_export_and_serve_bad_flags_are_one_line(tmp_path, module, arg, message):
    """The other entry points that parse with ``fp8rl_jax.main``'s flags say the same, in the same way."""
    extra = [f"--out={tmp_path / 'out'}"] if module == "export" else ["--port=0"]
    line = _one_error_line(_main("--config=configs/tiny.py", *extra, arg, "--dry_run", module=f"fp8rl_jax.{module}"))
    assert line.startswith(f"error: {message}")


@pytest.mark.parametrize("body, message", RAISING_CONFIGS, ids=[m.split(":")[0] for _, m in RAISING_CONFIGS])
def test_cli_config_whose_get_config_raises(tmp_path, body, message):
    path = _config_file(tmp_path, body)
    result = _main(f"--config={path}", "--dry_run")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {path}: {message}\n")


def test_cli_config_that_fails_to_import_or_has_no_get_config(tmp_path):
    broken = tmp_path / "syntax.py"
    broken.write_text("def get_config(arg=None):\n    return 1 +\n")
    result = _main(f"--config={broken}", "--dry_run")
    assert result.returncode == 2
    assert result.stderr == f"error: {broken}: importing it raised SyntaxError: invalid syntax (syntax.py, line 2)\n"

    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    result = _main(f"--config={empty}:arg", "--dry_run")
    assert (result.returncode, result.stderr) == (2, f"error: {empty} defines no get_config(arg=None)\n")


def test_cli_config_arg_reaches_get_config(tmp_path):
    path = _config_file(tmp_path, "raise ValueError(f'no variant {arg!r}')")
    result = _main(f"--config={path}:big", "--dry_run")
    assert (result.returncode, result.stderr) == (2, f"error: {path}: get_config raised ValueError: no variant 'big'\n")


def test_cli_good_config_still_runs(tmp_path):
    result = _main("--config=configs/tiny.py:bf16", "--dry_run")
    assert result.returncode == 0, result.stderr
    assert "mode: bf16" in result.stdout


@pytest.mark.parametrize("name, preset", [("llama8b", "llama3_8b"), ("llama1b", "llama3_1b")])
def test_config_without_its_model_folder_says_what_to_pass(name, preset):
    """``configs/llama8b.py`` takes the model folder as its argument; run without it, the one line says how to give
    it, or how to run random weights of its architecture instead, and that second command line is valid."""
    result = _main(f"--config=configs/{name}.py")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"error: config.model.source is empty: configs/{name}.py needs a model. Pass a Hugging Face folder "
        f"(config.json, *.safetensors, tokenizer.json) as the config's argument, "
        f"--config=configs/{name}.py:/path/to/model-folder, or as --config.model.source=/path/to/model-folder; or "
        f"train random weights of its architecture (preset {preset}) with the demo model's tokenizer: "
        "--config.model.source=preset --config.model.tokenizer=smollm2\n")
    suggested = _main(f"--config=configs/{name}.py", "--config.model.source=preset",
                      "--config.model.tokenizer=smollm2", "--dry_run")
    assert suggested.returncode == 0, suggested.stderr
    assert f"preset: {preset}" in suggested.stdout and "tokenizer: smollm2" in suggested.stdout
    # random weights without a tokenizer: said at start-up, not as a traceback from the loader
    no_tokenizer = _main(f"--config=configs/{name}.py", "--config.model.source=preset", "--dry_run")
    assert no_tokenizer.returncode == 2
    assert no_tokenizer.stderr.startswith("error: config.model.tokenizer='' is invalid; allowed: smollm2")


def test_smollm2_tokenizer_for_random_weights():
    """``model.tokenizer=smollm2``: the embedded model's tokenizer (SmolLM2's 49,152 tokens) for a preset."""
    from fp8rl_jax.config import base_config
    from fp8rl_jax.model.loading import load_tokenizer
    from fp8rl_jax.plan import model_spec

    config = base_config()
    config.model.source, config.model.preset, config.model.tokenizer = "preset", "llama3_8b", "smollm2"
    tokenizer = load_tokenizer(model_spec(config), config.model.source)
    assert tokenizer.vocab_size == 49152
    assert tokenizer.decode(tokenizer.encode("What is 2+3?")).endswith("What is 2+3?")


EMPTY_CONFIG_LACKS = ("the sections checkpoint, data, faults, logging, mesh, model, optim, precision, reward, rl, "
                      "rollout and the keys seed, steps, workdir of base_config()")


@pytest.mark.parametrize("module", ["main", "eval", "export", "serve"])
def test_config_without_the_base_sections_is_one_line(tmp_path, module):
    """``get_config`` returning a bare ``ConfigDict()``: a 34-line traceback ending ``KeyError: 'precision'``, now the
    sections it lacks, from every entry point."""
    path = tmp_path / "empty.py"
    path.write_text("import ml_collections\n\n\ndef get_config(arg=None):\n    return ml_collections.ConfigDict()\n")
    extra = {"eval": [], "export": ["--dry_run", f"--out={tmp_path / 'out'}"]}.get(module, ["--dry_run"])
    line = _one_error_line(_main(f"--config={path}", *extra, module=f"fp8rl_jax.{module}"))
    assert line == (f"error: {path}: get_config returned a config without {EMPTY_CONFIG_LACKS}; start it from "
                    "fp8rl_jax.config.base_config() and change what it needs (as configs/*.py do)")


def test_validate_names_what_a_config_lacks():
    from fp8rl_jax.config import base_config, missing_keys, validate

    assert missing_keys(base_config()) is None
    config = base_config()
    del config["rollout"]
    del config.optim["lr"]
    with pytest.raises(ConfigError) as err:
        validate(config, config_file="c.py")
    assert str(err.value) == ("c.py lacks the section rollout and the key optim.lr of base_config(); a config starts "
                              "from fp8rl_jax.config.base_config() and changes what it needs")


@pytest.mark.parametrize("body, message", RAISING_CONFIGS[:3])
def test_load_config_file_names_the_file(tmp_path, body, message):
    path = _config_file(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_config_file(path)
    assert str(err.value) == f"{path}: {message}"
    with pytest.raises(ConfigError, match="get_config returned NoneType, not an ml_collections.ConfigDict"):
        load_config_file(_config_file(tmp_path, "return None", "none.py"))


# ----------------------------------------------------------------------------------------------------------
# weight files


def _hf_folder(tmp_path, safetensors_bytes):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
                                                    "num_hidden_layers": 1, "num_attention_heads": 2}))
    (folder / "model.safetensors").write_bytes(safetensors_bytes)
    return folder


def test_corrupt_safetensors_is_named(tmp_path):
    folder = _hf_folder(tmp_path, np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError) as err:
        weights.load_hf(folder)
    assert str(err.value) == (f"{folder / 'model.safetensors'}: not a readable safetensors file (SafetensorError: "
                              "Error while deserializing header: header too large)")


def test_cut_safetensors_is_named(tmp_path):
    from safetensors.numpy import save

    whole = save({"model.embed_tokens.weight": np.ones((16, 8), np.float32)})
    folder = _hf_folder(tmp_path, whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"hf/model\.safetensors: not a readable safetensors file \(SafetensorError"):
        weights.load_hf(folder)


def test_hf_config_that_is_not_json_is_named(tmp_path):
    folder = _hf_folder(tmp_path, b"")
    (folder / "config.json").write_bytes(b"\x00\xff binary")
    with pytest.raises(ValueError, match=r"hf/config\.json: not a JSON config \(UnicodeDecodeError"):
        weights.load_hf(folder)


@pytest.mark.parametrize("content, cause", [
    (np.random.default_rng(0).bytes(4096), "ValueError: GGUF magic invalid"),
    (b"GGUF\x03\x00\x00\x00" + np.random.default_rng(1).bytes(100), "IndexError: "),  # right magic, then noise
    (b"", "ValueError: cannot mmap an empty file"),
], ids=["random", "magic_then_noise", "empty"])
def test_bad_gguf_is_named(tmp_path, content, cause):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        weights.load_gguf(path)
    assert str(err.value).startswith(f"{path}: not a readable GGUF file ({cause}")
    assert "\n" not in str(err.value)


def test_missing_tensor_and_non_object_configs_are_named(tmp_path):
    from safetensors.numpy import save

    from fp8rl_jax.errors import InputFileError, MissingTensorError

    folder = _hf_folder(tmp_path, save({"model.embed_tokens.weight": np.ones((16, 8), np.float32)}))
    with pytest.raises(MissingTensorError) as err:
        weights.load_hf(folder)
    assert isinstance(err.value, KeyError) and isinstance(err.value, InputFileError)  # caught as either
    assert str(err.value).startswith(f"{folder}: tensor 'model.layers.0.")  # the message, not KeyError's repr of it
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(InputFileError, match=r"hf/config\.json: a JSON list, not an object of model settings"):
        weights.load_hf(folder)


@pytest.mark.parametrize("content, cause", [
    (b"garbage", "expected value at line 1 column 1"),
    (b"\x00\xff\xfe", "stream did not contain valid UTF-8"),
    (b"{}", "Model missing"),
], ids=["text", "binary", "empty_object"])
def test_bad_tokenizer_json_is_named(tmp_path, content, cause):
    """The tokenizers library raises a bare ``Exception`` naming no file: it passed every entry point's catch."""
    from fp8rl_jax.errors import InputFileError
    from fp8rl_jax.model.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(InputFileError) as err:
        Tokenizer.from_folder(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'tokenizer.json'}: not a readable tokenizer.json ({cause}")
    (tmp_path / "tokenizer.json").unlink()


# ----------------------------------------------------------------------------------------------------------
# bad data and model files through the entry points: one line naming the file, exit status 2


def _bad_input(tmp_path, kind: str) -> tuple[list[str], str]:
    """``(config overrides that read a bad file of this kind, the file)``."""
    if kind == "data":
        path = tmp_path / "train.jsonl"
        path.write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
        return ["--config.data.dataset=gsm8k", f"--config.data.train_path={path}", f"--config.data.eval_path={path}",
                "--config.precision.mode=bf16"], str(path)
    if kind == "gguf":
        path = tmp_path / "model.gguf"
        path.write_bytes(np.random.default_rng(0).bytes(4096))
        return [f"--config.model.source={path}", "--config.model.tokenizer="], str(path)
    if kind == "tokenizer":  # a model folder that loads, beside a tokenizer.json that does not
        import jax

        from fp8rl_jax.model import llama
        from fp8rl_jax.model.config import preset

        folder = tmp_path / "hf"
        arch = preset("tiny")
        weights.save_hf(folder, llama.init_params(arch, jax.random.PRNGKey(0)), arch)
        (folder / "tokenizer.json").write_text("garbage")
        return [f"--config.model.source={folder}", "--config.model.tokenizer="], str(folder / "tokenizer.json")
    folder = _hf_folder(tmp_path, np.random.default_rng(0).bytes(4096))
    if kind == "hf_config":
        (folder / "config.json").write_bytes(np.random.default_rng(1).bytes(300))
    return [f"--config.model.source={folder}", "--config.model.tokenizer="], str(
        folder / ("config.json" if kind == "hf_config" else "model.safetensors"))


@pytest.mark.parametrize("module, kind", [
    ("main", "data"), ("main", "gguf"), ("main", "safetensors"), ("main", "hf_config"), ("main", "tokenizer"),
    ("serve", "gguf"), ("serve", "hf_config"), ("serve", "tokenizer"),
    ("export", "safetensors"), ("export", "tokenizer"),
])
def test_bad_data_or_model_file_is_one_line(tmp_path, module, kind):
    """main and serve printed the cause as the last line of a ~30-line traceback (exit status 1), export as one line
    with exit status 1, and a tokenizer.json that does not parse was a traceback everywhere."""
    overrides, path = _bad_input(tmp_path, kind)
    extra = {"main": [f"--config.workdir={tmp_path / 'run'}", "--steps=1"], "serve": ["--port=0"],
             "export": [f"--out={tmp_path / 'out'}"]}[module]
    line = _one_error_line(_main("--config=configs/tiny.py", *overrides, *extra, module=f"fp8rl_jax.{module}"))
    assert line.startswith(f"error: {path}")


@pytest.mark.parametrize("kind", ["data", "tokenizer"])
def test_eval_bad_data_or_model_file_is_exit_status_2(tmp_path, capsys, kind):
    """The evaluation said these in one line already, with exit status 1 (as for a failure, not bad input)."""
    from fp8rl_jax.eval.cli import main as eval_main

    overrides, path = _bad_input(tmp_path, kind)
    tiny = os.path.join(REPO, "configs", "tiny.py")
    status = eval_main(["fp8rl_jax.eval", f"--config={tiny}", *overrides, f"--out={tmp_path / 'out'}"])
    out = capsys.readouterr()
    assert (status, out.err.count("\n")) == (2, 1), out.err
    assert out.err.startswith(f"error: {path}")


@pytest.mark.parametrize("module", ["export", "serve"])
def test_missing_checkpoint_folder_is_refused_not_created(tmp_path, module):
    """``--checkpoint`` naming a folder that does not exist: Orbax's CheckpointManager created it (and its parents),
    then found no checkpoint there. Refused in one line, and nothing is created."""
    missing = tmp_path / "runs" / "nope" / "checkpoints"
    extra = [f"--out={tmp_path / 'out'}"] if module == "export" else ["--port=0"]
    line = _one_error_line(_main("--config=configs/tiny.py", f"--checkpoint={missing}", *extra,
                                 module=f"fp8rl_jax.{module}"))
    assert line == f"error: checkpoint folder {missing} does not exist (expected a trainer's <workdir>/checkpoints)"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_checkpoint_folder_that_is_a_file_is_refused(tmp_path):
    from fp8rl_jax.checkpoint import existing_checkpoint_folder

    (tmp_path / "ckpt").write_text("")
    with pytest.raises(NotADirectoryError, match="checkpoint folder .*/ckpt is a file"):
        existing_checkpoint_folder(tmp_path / "ckpt")
    assert existing_checkpoint_folder(tmp_path) == str(tmp_path)
