"""Every config file loads and validates; bad values, keys and paths fail naming them."""

import glob
import os
import subprocess
import sys

import pytest

from fp8rl_jax.config import ConfigError, base_config, load_config_file, validate

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.py")))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_loads_and_validates(path, tmp_path):
    arg = str(tmp_path) if os.path.basename(path).startswith("llama") else None  # the model folder
    config = load_config_file(path, arg)
    validate(config)
    assert config.precision.mode in ("bf16", "fp8_rollout", "fp8_e2e")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("precision.mode", "fp16", "config.precision.mode='fp16'"),
        ("rollout.top_p", 1.5, "config.rollout.top_p=1.5"),
        ("rollout.tensor_parallel", 0, "config.rollout.tensor_parallel=0"),
        ("rl.advantage", "ppo", "grpo | drgrpo | rloo"),
        ("data.train_path", "/nope.jsonl", "config.data.train_path='/nope.jsonl'"),
        ("rl.minibatches", 3, "a divisor of prompts_per_step * samples_per_prompt = 32"),
        # non-finite floats, wherever they are (issue 10: lr=inf used to pass and train non-finite params)
        ("optim.lr", float("inf"), "config.optim.lr=inf"),
        ("rollout.temperature", float("inf"), "config.rollout.temperature=inf"),
        ("rollout.temperature", float("nan"), "config.rollout.temperature=nan"),
        ("optim.b2", float("nan"), "config.optim.b2=nan"),
        ("model.init_std", float("-inf"), "config.model.init_std=-inf"),
        ("reward.weights", ("inf",), "config.reward.weights"),
        ("reward.weights", ("1.0,x",), "config.reward.weights"),
        ("precision.bf16_layers", ("1,a",), "config.precision.bf16_layers"),
        ("precision.bf16_linears", ("w_down,w_up",), "config.precision.bf16_linears"),
        ("precision.scaling", "blockwise", "config.precision.scaling='blockwise'"),
        ("precision.attention", "flash", "config.precision.attention='flash'"),
        ("precision.block_gemm", "cutlass", "config.precision.block_gemm='cutlass'"),
        # rowwise is built in the xla backend only; the default backend (auto) may pick te
        ("precision.scaling", "rowwise", "rowwise with precision.backend=xla"),
        ("precision.fp8_gemms", ("fprop,bwd",), "a non-empty subset of fprop, dgrad, wgrad"),
        ("precision.fp8_gemms", ("dgrad,dgrad",), "each once"),
        ("precision.fp8_gemms", (), "each once"),
        ("precision.fp8_gemms", ("fprop",), "or fewer with precision.backend=xla"),
    ],
)
def test_bad_values_are_named(key, value, message):
    config = base_config()
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("|", r"\|")):
        validate(config)


def test_fp8_gemms_are_the_recipes_and_a_forward_without_fp8_is_bf16_in_the_rollout():
    """``precision.fp8_gemms``: the train and rollout recipes' GEMMs; without fprop the rollout is BF16 (the training
    forward is), and fp8_rollout, whose FP8 is the forward's, needs fprop."""
    from fp8rl_jax.plan import run_precision

    config = base_config()
    config.precision.backend = "xla"
    config.precision.fp8_gemms = ("dgrad", "wgrad")
    validate(config)
    train, rollout = run_precision(config, "train"), run_precision(config, "rollout")
    assert train.fp8 and train.backend == "xla" and train.recipe.fp8_gemms == ("dgrad", "wgrad")
    assert not rollout.fp8 and rollout.backend == "bf16"
    config.precision.fp8_gemms = ("wgrad", "fprop")  # any order: the recipe's
    assert run_precision(config, "rollout").recipe.fp8_gemms == ("fprop", "wgrad")
    assert run_precision(config, "rollout").fp8
    config.precision.mode, config.precision.fp8_gemms = "fp8_rollout", ("dgrad",)
    with pytest.raises(ConfigError, match="with fprop under precision.mode=fp8_rollout"):
        validate(config)


def _main(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "fp8rl_jax.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_main_help_lists_flags():
    result = _main("--help")
    assert result.returncode == 0
    for flag in ("--config", "--steps", "dry_run", "--config.section.key=value"):
        assert flag in result.stdout


def test_main_bad_config_path_is_named():
    result = _main("--config=configs/does_not_exist.py")
    assert result.returncode != 0
    assert "does_not_exist.py" in result.stderr


def test_main_unknown_key_is_named():
    result = _main("--config=configs/tiny.py", "--config.rollout.temprature=0.5")
    assert result.returncode != 0
    assert "unknown key 'temprature' in config.rollout" in result.stderr


def test_main_list_keys_from_the_command_line():
    """``--config.reward.fns=a,b`` stays the way to give a list (config_flags hands a tuple field ("a,b",))."""
    result = _main("--config=configs/tiny.py", "--config.reward.fns=pattern,pattern", "--config.reward.weights=1,0.5",
                   "--config.precision.bf16_layers=0,1", "--config.precision.bf16_linears=w_down,wo", "--dry_run")
    assert result.returncode == 0, result.stderr
    bad = _main("--config=configs/tiny.py", "--config.reward.fns=pattern,nope", "--dry_run")
    assert bad.returncode != 0 and "config.reward.fns='nope'" in bad.stderr


def test_num_layers_cuts_a_preset_and_is_refused_for_a_file_model():
    import jax

    from fp8rl_jax.model.loading import load_model
    from fp8rl_jax.plan import model_spec

    config = load_config_file(os.path.join(REPO, "configs", "tiny.py"))
    config.model.num_layers = 1
    validate(config)
    arch, params, _ = load_model(model_spec(config))
    assert arch.num_layers == 1
    assert {leaf.shape[0] for leaf in jax.tree.leaves(params["blocks"])} == {1}  # [L, ...] stacked
    config.model.num_layers = -1
    with pytest.raises(ConfigError, match="config.model.num_layers=-1"):
        validate(config)
    config = base_config()  # the embedded GGUF model: its blocks are its own
    config.model.num_layers = 4
    with pytest.raises(ConfigError, match="num_layers=4 is invalid; allowed: 0 with model.source='smollm2'"):
        validate(config)


def test_block_gemm_is_the_recipes_and_registers_nothing_off_a_gpu(monkeypatch):
    """``precision.block_gemm`` reaches both recipes; the cuBLASLt FFI target is registered on a GPU only (plan.py),
    so a CPU run with block_gemm=cublaslt runs the emulation and needs no compiler."""
    from fp8rl_jax.kernels import cublaslt
    from fp8rl_jax.plan import run_precision

    config = base_config()
    config.precision.backend = "xla"
    config.precision.scaling = "block"
    config.precision.block_gemm = "cublaslt"
    validate(config)
    monkeypatch.setattr(cublaslt, "register", lambda *a, **k: pytest.fail("registered off a GPU"))
    assert run_precision(config, "train").recipe.block_gemm == "cublaslt"
    assert run_precision(config, "rollout").recipe.block_gemm == "cublaslt"


def test_block_gemm_cublaslt_that_cannot_load_is_a_config_error_with_the_way_out(monkeypatch):
    """On a GPU the run registers the handler at start-up; where it can neither build nor load, the error names the
    key, the reason and the prebuild command."""
    from fp8rl_jax import plan
    from fp8rl_jax.kernels import cublaslt

    config = base_config()
    config.precision.backend = "xla"
    config.precision.scaling = "block"
    config.precision.block_gemm = "cublaslt"

    tries = []

    def no_compiler(*a, **k):
        tries.append(a)
        raise RuntimeError("building the cuBLASLt block GEMM needs a C++ compiler: 'g++' is not on PATH (set CXX)")

    monkeypatch.setattr(cublaslt, "register", no_compiler)
    monkeypatch.setattr(plan.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv(cublaslt.ENV_LIB, "")
    plan._cublaslt_failure.cache_clear()
    message = r"precision.block_gemm=cublaslt: .*C\+\+ compiler.*fp8rl_jax.kernels.cublaslt"
    with pytest.raises(ConfigError, match=message):
        plan.run_precision(config, "train")
    config.precision.block_gemm = "auto"  # auto runs on without it: the Mosaic kernel, and a warning that says so
    with pytest.warns(UserWarning, match=r"block_gemm=auto: no cuBLASLt .*Mosaic.*fp8rl_jax.kernels.cublaslt"):
        assert plan.run_precision(config, "train").recipe.block_gemm == "auto"
        assert plan.run_precision(config, "rollout").recipe.block_gemm == "auto"
    assert len(tries) == 1  # the build is tried once a process, not again for each role
    monkeypatch.setenv(cublaslt.ENV_LIB, "/elsewhere/lib.so")  # another library: tried again
    with pytest.warns(UserWarning, match="block_gemm=auto: no cuBLASLt"):
        plan.run_precision(config, "train")
    assert len(tries) == 2
    plan._cublaslt_failure.cache_clear()
