"""Hugging Face safetensors read straight onto their shards: the values ``load_model`` reads, in the rules' places,
read as slices (never a whole sharded tensor), each slice once."""

import json
import math
import os

import jax
import ml_collections
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from fp8rl_jax.config import load_config_file
from fp8rl_jax.model import weights
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.model.loading import load_model
from fp8rl_jax.model.sharded import load_model_sharded
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.mesh import make_mesh
from fp8rl_jax.plan import model_spec

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "tiny.py")

# 6 heads of 16 and 2 kv heads: wqkv's columns [q 96 | k 32 | v 32] split over tensor=2 at 80, inside q, so one
# shard reads the tail of q and all of k and v
ARCH = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=120, num_layers=3, num_heads=6, num_kv_heads=2,
                   head_dim=16, tie_embeddings=False, qkv_bias=False, max_position_embeddings=256)
MESHES = {"fsdp8": (1, 8, 1), "fsdp4_tensor2": (1, 4, 2), "data2_fsdp4": (2, 4, 1)}


def _write_checkpoint(folder, arch: LlamaConfig, files: int = 1, dtype=np.float32) -> dict[str, np.ndarray]:
    """A Hugging Face folder of random weights (every tensor, the norms included, distinct random values): one
    ``model.safetensors`` or ``files`` files and a ``model.safetensors.index.json``. Returns the tensors."""
    from fp8rl_jax.model import llama

    shapes = jax.eval_shape(lambda k: llama.init_params(arch, k), jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    tensors = weights.to_hf_tensors(params, arch, dtype)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(weights.config_to_hf(arch)))
    if files == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return tensors
    # alternate names over the files: one layer's q, k and v (gate and up) live in different files
    names = sorted(tensors)
    where = {n: f"model-{i % files + 1:05d}-of-{files:05d}.safetensors" for i, n in enumerate(names)}
    for file in sorted(set(where.values())):
        save_file({n: tensors[n] for n in names if where[n] == file}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))
    return tensors


def _config(folder, param_dtype="float32"):
    config = load_config_file(TINY)
    with config.unlocked():
        config.model.source = str(folder)
        config.model.tokenizer = "char"
        config.model.param_dtype = param_dtype
    return config


def _mesh(name):
    data, fsdp, tensor = MESHES[name]
    return make_mesh(ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor}))


def _record_reads(monkeypatch) -> list[tuple[str, tuple, tuple]]:
    """Every slice the sharded loader reads: (tensor name, index, shape read)."""
    reads = []
    read_slice = weights._read_slice

    def recording(handle, name, index):
        out = read_slice(handle, name, index)
        reads.append((name, tuple((s.start, s.stop) for s in index), out.shape))
        return out

    monkeypatch.setattr(weights, "_read_slice", recording)
    return reads


def _assert_same(params, ref, mesh):
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    assert tree == jax.tree.structure(ref)
    for (path, got), want in zip(flat, jax.tree.leaves(ref), strict=True):
        assert got.dtype == want.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    expected = rules.state_shardings(params, mesh)
    for (path, got), want in zip(flat, jax.tree.leaves(expected), strict=True):
        assert got.sharding == want, f"{jax.tree_util.keystr(path)}: {got.sharding} != {want}"


@pytest.mark.parametrize("files", [1, 2])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_loads_onto_the_shards_by_slices(tmp_path, monkeypatch, files, mesh_name):
    tensors = _write_checkpoint(tmp_path / "hf", ARCH, files)
    config = _config(tmp_path / "hf")
    ref_arch, ref, _ = load_model(model_spec(config))
    mesh = _mesh(mesh_name)

    def whole(*args, **kwargs):
        raise AssertionError("load_model_sharded read the checkpoint whole")

    reads = _record_reads(monkeypatch)
    monkeypatch.setattr(weights, "load_hf", whole)
    arch, params, tokenizer = load_model_sharded(model_spec(config), mesh)
    assert arch == ref_arch and tokenizer.vocab_size > 0
    _assert_same(params, ref, mesh)
    if mesh_name == "fsdp4_tensor2":
        assert params["blocks"]["wqkv"].addressable_shards[0].data.shape == (3, 96 // 4, 160 // 2)

    # every kernel and the embedding is sharded on these meshes: no read takes a whole one (the norms are
    # replicated, [D], and read whole once)
    for name, index, shape in reads:
        if "norm" not in name:
            assert shape != tensors[name].shape, f"{name} read whole ({index})"
    # each slice read once (data=2 holds every shard twice), and together the reads cover every element once
    keys = [(name, index) for name, index, _ in reads]
    assert len(keys) == len(set(keys))
    assert sum(math.prod(shape) for _, _, shape in reads) == sum(t.size for t in tensors.values())
    assert {name for name, _, _ in reads} == set(tensors)


def test_bf16_checkpoint_with_biases_and_tied_embeddings(tmp_path, monkeypatch):
    """A Qwen2-style model (q/k/v biases, no lm_head) stored in bfloat16, loaded as bfloat16 and as float32."""
    arch = ARCH.replace(qkv_bias=True, tie_embeddings=True)
    tensors = _write_checkpoint(tmp_path / "hf", arch, files=2, dtype=ml_dtypes.bfloat16)
    assert "lm_head.weight" not in tensors and tensors["model.norm.weight"].dtype == ml_dtypes.bfloat16
    mesh = _mesh("fsdp4_tensor2")
    for param_dtype in ("bfloat16", "float32"):
        config = _config(tmp_path / "hf", param_dtype)
        _, ref, _ = load_model(model_spec(config))
        reads = _record_reads(monkeypatch)
        arch_got, params, _ = load_model_sharded(model_spec(config), mesh)
        assert arch_got.qkv_bias and arch_got.tie_embeddings and "lm_head" not in params
        assert params["blocks"]["bqkv"].dtype == jax.numpy.dtype(param_dtype)
        _assert_same(params, ref, mesh)
        # bqkv [q 96 | k 32 | v 32] over tensor=2: one shard reads q[:80], the other q[80:], k and v
        layer0 = sorted((name.split(".")[-2], shape) for name, _, shape in reads if ".layers.0." in name
                        and name.endswith("bias"))
        assert layer0 == [("k_proj", (32,)), ("q_proj", (16,)), ("q_proj", (80,)), ("v_proj", (32,))]


def test_missing_tensor_is_named(tmp_path):
    folder = tmp_path / "hf"
    _write_checkpoint(folder, ARCH, files=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    missing = "model.layers.1.mlp.up_proj.weight"
    file = folder / index["weight_map"].pop(missing)
    from safetensors.numpy import load_file

    kept = {k: v for k, v in load_file(str(file)).items() if k != missing}
    save_file(kept, str(file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError) as sharded:
        load_model_sharded(model_spec(_config(folder)), _mesh("fsdp8"))
    with pytest.raises(KeyError) as whole:
        load_model(model_spec(_config(folder)))
    assert sharded.value.args[0] == whole.value.args[0] == (
        f"{folder}: tensor {missing!r} not found in the safetensors files")


def test_misshapen_tensor_is_named(tmp_path):
    folder = tmp_path / "hf"
    tensors = _write_checkpoint(folder, ARCH)
    tensors["model.layers.2.self_attn.k_proj.weight"] = tensors["model.layers.2.self_attn.k_proj.weight"][:16]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_model_sharded(model_spec(_config(folder)), _mesh("fsdp8"))
    assert str(err.value) == (f"{folder / 'model.safetensors'}: tensor 'model.layers.2.self_attn.k_proj.weight' "
                              "has shape [16, 96], config.json implies [32, 96]")


def test_f32_checkpoint_loaded_as_bfloat16_rounds_like_load_model(tmp_path):
    _write_checkpoint(tmp_path / "hf", ARCH)
    config = _config(tmp_path / "hf", "bfloat16")
    _, ref, _ = load_model(model_spec(config))
    mesh = _mesh("fsdp4_tensor2")
    _assert_same(load_model_sharded(model_spec(config), mesh)[1], ref, mesh)


def test_trainer_trains_from_a_hugging_face_folder_on_the_mesh(tmp_path):
    from fp8rl_jax.trainer import Trainer

    _write_checkpoint(tmp_path / "hf", ARCH.replace(eos_token_ids=(2,)), files=2)
    config = _config(tmp_path / "hf")
    with config.unlocked():
        config.workdir = str(tmp_path / "run")
        config.steps = 1
        config.logging.progress = config.logging.tensorboard = config.logging.plots = False
        config.rollout.prompts_per_step = 2
        config.rollout.decode_slots = 8
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 4, 2
    trainer = Trainer(config)
    params = trainer.state["params"]
    assert params["blocks"]["wqkv"].sharding.spec == P(None, "fsdp", "tensor")
    _, ref, _ = load_model(model_spec(config))
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(ref["lm_head"]))
    record = trainer.run(1)[0]
    assert np.isfinite(record["loss"])
    trainer.close()


def test_host_memory_stays_at_a_few_layer_slices(tmp_path):
    """Host memory (traced numpy and Python allocations) stays far below one stacked param, where ``load_hf``
    holds the whole model. On CPU a placed slice is aliased by its device buffer (``device_put`` of an aligned numpy
    array copies nothing), so here the bound is the layer being placed, all 8 devices' slices of it, plus the
    unstacked params' final shards; on a GPU the host slice is freed once copied."""
    import tracemalloc

    from fp8rl_jax.model.sharded import load_hf_sharded

    arch = ARCH.replace(hidden_size=256, intermediate_size=2048, num_layers=4, num_heads=16, num_kv_heads=4)
    tensors = _write_checkpoint(tmp_path / "hf", arch)
    model_bytes = sum(t.nbytes for t in tensors.values())
    stacked_gate_up = 4 * 256 * 2 * 2048 * 4  # 16 MiB; a layer of it 4 MiB; one device's slice of that 512 KiB
    mesh = _mesh("fsdp8")
    load_hf_sharded(tmp_path / "hf", mesh)  # compile once: the jit caches are not what is measured
    tracemalloc.start()
    try:
        _, params = load_hf_sharded(tmp_path / "hf", mesh)
        sharded_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        weights.load_hf(tmp_path / "hf")
        whole_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"model {model_bytes / 2**20:.1f} MiB: sharded load peak {sharded_peak / 2**20:.2f} MiB, "
          f"whole load peak {whole_peak / 2**20:.1f} MiB")
    assert whole_peak > model_bytes  # tracemalloc sees the loaders' arrays
    assert sharded_peak < stacked_gate_up / 2
