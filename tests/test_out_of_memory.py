"""A device allocation that fails, in any phase, is one ``DeviceOutOfMemory`` line naming the phase, its shapes, the
device memory and the keys that lower it; ``python -m fp8rl_jax.main`` prints it as one ``error:`` line, exit 5.

CPU does not run out of memory on these sizes, so the phases' device functions are replaced by ones that raise
what XLA raises on the GPU (``jax.errors.JaxRuntimeError``, ``RESOURCE_EXHAUSTED: Out of memory while trying to
allocate ...``; the H100's own words in ``benchmarks/results/train_memory_h100.jsonl``)."""

import os
import subprocess
import sys
import types

import jax
import pytest

from fp8rl_jax import policy_io
from fp8rl_jax.config import load_config_file
from fp8rl_jax.memory import EXIT_OUT_OF_MEMORY, DeviceOutOfMemory, device_memory, out_of_memory_report
from fp8rl_jax.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.py")
XLA_OOM = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 111.14GiB with allocator GPU_0_bfc on device "
           "0. [tf-allocator-allocation-error=''] [executable_name='jit_train_step']")


def _raise_oom(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(XLA_OOM)


def _config(workdir):
    config = load_config_file(TINY)
    with config.unlocked():
        config.workdir = str(workdir)
        config.logging.progress = False
        config.logging.plots = False
        config.rl.minibatches = 2  # a scoring pass (one minibatch scores inside the train step)
        config.rl.microbatch_tokens = 512  # 8 x 8 rows of up to 16 + 12 -> 32 tokens: 16 per microbatch
    return config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    trainer = Trainer(_config(tmp_path_factory.mktemp("oom") / "run"))
    yield trainer
    trainer.close()


def _one_line(error: DeviceOutOfMemory) -> str:
    message = str(error)
    assert "\n" not in message
    assert error.__cause__ is None and error.__suppress_context__  # raised `from None`: no XLA traceback chained
    return message


def test_the_budget_sets_the_trainers_microbatch(tiny):
    # 64 sequences, 2 minibatches of 32; rows of 16 + 12 tokens pad to 32; 512 / 32 = 16 rows, a divisor of 32
    assert (tiny.minibatch, tiny.row_tokens, tiny.microbatch) == (32, 32, 16)


def test_train_step_out_of_memory_names_phase_shapes_and_knobs(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "_train_step", _raise_oom)
    with pytest.raises(DeviceOutOfMemory) as info:
        tiny.step()
    assert _one_line(info.value) == (
        "device out of memory in the train phase (XLA asked for 111.14GiB for jit_train_step): 2 update(s) of 32 "
        "sequences in microbatches of 16 x up to 32 tokens (512 tokens; rl.microbatch_tokens=512), model.remat=none; "
        "device memory: no allocator statistics on cpu. Lower it with rl.microbatch_tokens (now 512), "
        "rl.microbatch_sequences (now 0; a divisor of 32), model.remat=full (now none), rollout.max_new_tokens "
        "(now 12), data.max_prompt_tokens (now 16), mesh.fsdp (now 1; more devices split the batch and the state), "
        "mesh.tensor (now 1)")
    assert info.value.xla_message == XLA_OOM
    assert tiny.step_count == 0


def test_packed_train_step_out_of_memory_names_packed_rows(tmp_path, monkeypatch):
    config = _config(tmp_path / "run")
    with config.unlocked():
        config.rl.packing = True
        config.data.max_prompt_tokens = 40  # rows of 40 + 12 -> 64 tokens hold 2-3 of the ~20-token sequences
    trainer = Trainer(config)
    try:
        monkeypatch.setattr(trainer, "_train_step_packed", _raise_oom)
        with pytest.raises(DeviceOutOfMemory) as info:
            trainer.step()
    finally:
        trainer.close()
    # 512 / 64 = 8 rows a microbatch (or fewer: PackingPlan.choose_rows), 64 // 16 = 4 sequences a row at most
    assert _one_line(info.value) == (
        "device out of memory in the train phase (XLA asked for 111.14GiB for jit_train_step): 2 update(s) of 32 "
        "sequences packed (rl.packing) in microbatches of 8 (or 4, 2, 1) rows x 64 tokens (up to 512 tokens, 4 "
        "sequences a row; rl.microbatch_tokens=512), model.remat=none; device memory: no allocator statistics on cpu. "
        "Lower it with rl.microbatch_tokens (now 512; at least one row of 64), rl.microbatch_sequences (now 0; rows a "
        "packed microbatch where > 0), model.remat=full (now none), rollout.max_new_tokens (now 12), "
        "data.max_prompt_tokens (now 40), mesh.fsdp (now 1; more devices split the batch and the state), "
        "mesh.tensor (now 1)")


def test_packing_declined_runs_and_reports_right_padded(tmp_path, monkeypatch):
    """Rows of 16 + 12 -> 32 tokens hold one tiny sequence each: packing would run as many tokens as right-padding,
    so the step runs right-padded (packing/rows 0) and an out-of-memory message says its microbatches."""
    config = _config(tmp_path / "run")
    with config.unlocked():
        config.rl.packing = True
    trainer = Trainer(config)
    try:
        monkeypatch.setattr(trainer, "_train_step_packed", _raise_oom)  # never called
        record = trainer.step()
        assert record["packing/rows"] == 0 and 0 < record["packing/fill"] <= 1
        monkeypatch.setattr(trainer, "_train_step", _raise_oom)
        with pytest.raises(DeviceOutOfMemory, match=r"2 update\(s\) of 32 sequences in microbatches of 16 x up to 32 "):
            trainer.step()
    finally:
        trainer.close()


def test_microbatch_sequences_set_names_only_the_knob_that_acts(tmp_path, monkeypatch):
    """``rl.microbatch_sequences`` > 0 sets the microbatch and ``rl.microbatch_tokens`` then changes nothing: the
    message names the count alone (it suggested the token budget first, which the count overrides)."""
    config = _config(tmp_path / "run")
    with config.unlocked():
        config.rl.microbatch_sequences = 8
    trainer = Trainer(config)
    try:
        assert trainer.microbatch == 8
        monkeypatch.setattr(trainer, "_train_step", _raise_oom)
        with pytest.raises(DeviceOutOfMemory) as info:
            trainer.step()
    finally:
        trainer.close()
    assert _one_line(info.value).endswith(
        "Lower it with rl.microbatch_sequences (now 8; a smaller divisor of 32; it overrides rl.microbatch_tokens), "
        "model.remat=full (now none), rollout.max_new_tokens (now 12), data.max_prompt_tokens (now 16), mesh.fsdp "
        "(now 1; more devices split the batch and the state), mesh.tensor (now 1)")
    assert "rl.microbatch_tokens (now" not in str(info.value)
    for phase in ("score", "calibrate", "initial calibration"):
        knobs = trainer._knobs(phase)
        assert not any(k.startswith("rl.microbatch_tokens") for k in knobs), (phase, knobs)
        assert "rl.microbatch_sequences (now 8; a smaller divisor of 32; it overrides rl.microbatch_tokens)" in knobs


def test_score_and_rollout_out_of_memory(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "_score", _raise_oom)
    with pytest.raises(DeviceOutOfMemory) as info:
        tiny.step()
    message = _one_line(info.value)
    assert message.startswith("device out of memory in the score phase (XLA asked for 111.14GiB for jit_train_step)"
                              ": 64 sequences in microbatches of 16 x up to 32 tokens (512 tokens; "
                              "rl.microbatch_tokens=512); device memory: ")
    assert message.endswith("Lower it with rl.microbatch_tokens (now 512), rl.microbatch_sequences (now 0; a "
                            "divisor of 32), rollout.max_new_tokens (now 12), data.max_prompt_tokens (now 16)")
    monkeypatch.undo()

    monkeypatch.setattr(tiny.sampler, "rollout", _raise_oom)
    with pytest.raises(DeviceOutOfMemory) as info:
        tiny.step()
    message = _one_line(info.value)
    # tiny samples in FP8 with a BF16 KV cache: the FP8 cache is among the knobs
    assert message.startswith("device out of memory in the rollout phase (XLA asked for 111.14GiB for "
                              "jit_train_step): 8 prompts x 8 samples = 64 sequences through 64 decode slots, a KV "
                              "cache of 64 x (16 + 12) positions x 2 layers in bfloat16; device memory: ")
    assert message.endswith("Lower it with rollout.decode_slots=32 (now 0; automatic: 64 slots), "
                            "rollout.max_new_tokens (now 12), "
                            "data.max_prompt_tokens (now 16), precision.kv_cache_dtype=float8_e4m3fn (now bfloat16), "
                            "mesh.fsdp (now 1; more devices split the batch and the state), mesh.tensor (now 1)")


def test_other_runtime_errors_pass_through(tiny, monkeypatch):
    def internal(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: a kernel failed to launch")

    monkeypatch.setattr(tiny, "_train_step", internal)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: a kernel failed") as info:
        tiny.step()
    assert not isinstance(info.value, DeviceOutOfMemory)


def test_initial_calibration_out_of_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(policy_io, "make_calibrate", lambda *a, **k: _raise_oom)
    with pytest.raises(DeviceOutOfMemory) as info:
        Trainer(_config(tmp_path / "run"))
    message = _one_line(info.value)
    # 8 prompts of 16 characters (the pattern task), padded to 32: 512 / 32 = 16 rows fit, so all 8 at once
    assert message.startswith("device out of memory in the initial calibration phase (XLA asked for 111.14GiB for "
                              "jit_train_step): 8 prompts in microbatches of 8 x 32 tokens, forward and backward; ")
    assert "Lower it with rl.microbatch_tokens (now 512), " in message and "model.remat=full (now none)" in message


class _Gpu:
    """A device with allocator statistics (what a GPU's ``memory_stats`` holds)."""

    def __init__(self, name, **stats):
        self.name, self.stats = name, stats

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return self.name


def test_device_memory_reads_the_fullest_device():
    gib = 2**30
    devices = [_Gpu("cuda:0", bytes_limit=63763906560, peak_bytes_in_use=10 * gib, bytes_in_use=gib),
               _Gpu("cuda:1", bytes_limit=63763906560, peak_bytes_in_use=int(30.38 * gib), bytes_in_use=12 * gib)]
    # 63763906560 B = 59.38 GiB (the H100's limit at JAX's default 75%)
    assert device_memory(devices) == "59.4 GiB limit, 30.4 GiB peak in use, 12.0 GiB in use now (cuda:1, the " \
                                     "fullest of 2)"
    assert device_memory([types.SimpleNamespace(platform="cpu", memory_stats=lambda: None)]) == \
        "no allocator statistics on cpu"


def test_out_of_memory_report_reads_shapes_only_on_failure():
    calls = []
    with out_of_memory_report("score", lambda: calls.append(1) or "shapes", ["k"]):
        pass
    assert calls == []
    with pytest.raises(ValueError, match="not memory"), out_of_memory_report("score", "s", ["k"]):
        raise ValueError("not memory")


def test_main_prints_one_error_line_and_exits_3(tmp_path):
    """The whole command line: the train step's allocation fails, the user sees one line and exit status 5."""
    script = f"""
import sys
import jax
import fp8rl_jax.trainer as trainer_module

def out_of_memory(*args, **kwargs):
    raise jax.errors.JaxRuntimeError({XLA_OOM!r})

trainer_module.make_train_step = lambda *args, **kwargs: out_of_memory
from fp8rl_jax import main
sys.argv = ["fp8rl_jax.main", "--config=configs/tiny.py", "--steps=1", "--config.workdir={tmp_path / 'run'}",
            "--config.logging.progress=False", "--config.logging.plots=False"]
main.run()
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == EXIT_OUT_OF_MEMORY == 5, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == result.stderr.strip().splitlines()[-1]
    assert errors[0].startswith("error: device out of memory in the train phase (XLA asked for 111.14GiB for "
                                "jit_train_step): 1 update(s) of 64 sequences in microbatches of 64 x up to 32 "
                                "tokens (2048 tokens; rl.microbatch_tokens=32768), model.remat=none; ")
    assert "rl.microbatch_tokens (now 32768)" in errors[0] and "model.remat=full (now none)" in errors[0]
