"""The model against the Hugging Face PyTorch implementation (float32, CPU), and the KV-cache decode path."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
import transformers

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import attention, kv_cache, llama, weights
from fp8rl_jax.model.config import RopeScaling, preset
from fp8rl_jax.parallel.mesh import make_mesh, mesh_context

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

F32 = Precision(compute_dtype="float32")


def _hf_model(kind: str):
    """A randomly initialised Hugging Face model (their code, their init), weights scaled up to make logits peaky."""
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **common, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32},
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama_tied":
        cfg = transformers.LlamaConfig(**common, rope_theta=100000.0, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.eval().float()


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2"])
def test_logits_match_hugging_face(kind, tmp_path):
    model = _hf_model(kind)
    model.save_pretrained(tmp_path, safe_serialization=True)  # their writer, our loader
    config, params = weights.load_hf(tmp_path)
    assert config.qkv_bias == (kind == "qwen2")
    assert config.tie_embeddings == (kind == "llama_tied")
    assert (config.rope_scaling is not None) == (kind == "llama")

    tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, 45))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours, _, _ = jax.jit(lambda p, t: llama.forward(p, t, config=config, precision=F32))(params, jnp.asarray(tokens))
    rel = np.linalg.norm(np.asarray(ours) - ref) / np.linalg.norm(ref)
    print(f"{kind}: relative error vs transformers = {rel:.2e}")
    assert rel < 1e-4


def test_saved_weights_load_in_transformers(tmp_path):
    """Our writer, their loader: params -> save_hf -> transformers gives the same logits."""
    config = preset("tiny_qwen2")
    params = llama.init_params(config, jax.random.PRNGKey(3), std=0.1)
    weights.save_hf(tmp_path, params, config)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.RandomState(2).randint(0, config.vocab_size, (1, 30))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours, _, _ = llama.forward(params, jnp.asarray(tokens), config=config, precision=F32)
    assert np.linalg.norm(np.asarray(ours) - ref) / np.linalg.norm(ref) < 1e-4


def test_sharded_safetensors_index(tmp_path):
    model = _hf_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    _, params = weights.load_hf(tmp_path)
    ref = model.model.layers[2].mlp.down_proj.weight.detach().numpy().T
    np.testing.assert_array_equal(np.asarray(params["blocks"]["w_down"][2]), ref)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    model = _hf_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        weights.load_hf(tmp_path)


@pytest.mark.parametrize("name", ["tiny", "tiny_qwen2"])
def test_kv_cache_decode_equals_full_forward(name):
    config = preset(name).replace(rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16))
    params = llama.init_params(config, jax.random.PRNGKey(0), std=0.1)
    batch, total, prompt = 3, 24, 7
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (batch, total)))
    full, _, _ = llama.forward(params, tokens, config=config, precision=F32)

    step = jax.jit(lambda p, t, pos, c: llama.forward(p, t, pos, config=config, precision=F32, cache=c)[:2])
    cache = kv_cache.init_cache(config, batch, 32, jnp.float32)
    logits, cache = step(params, tokens[:, :prompt], jnp.broadcast_to(jnp.arange(prompt), (batch, prompt)), cache)
    pieces = [logits]
    for i in range(prompt, total):
        logits, cache = step(params, tokens[:, i : i + 1], jnp.full((batch, 1), i), cache)
        pieces.append(logits)
    decoded = jnp.concatenate(pieces, axis=1)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), rtol=1e-5, atol=1e-5)


def test_decode_with_ragged_positions():
    """Sequences at different lengths in one decode batch (what continuous batching does)."""
    config = preset("tiny")
    params = llama.init_params(config, jax.random.PRNGKey(1), std=0.1)
    rng = np.random.RandomState(5)
    seqs = [rng.randint(0, config.vocab_size, n) for n in (5, 9, 12)]
    cache = kv_cache.init_cache(config, 3, 16, jnp.float32)
    for row, seq in enumerate(seqs):  # prefill each row alone, up to its last token
        toks = np.zeros((3, len(seq) - 1), np.int32)
        toks[row] = seq[:-1]
        pos = np.tile(np.arange(len(seq) - 1), (3, 1))
        pos[np.arange(3) != row] = 15  # other rows write into a scratch position nobody reads yet
        _, cache, _ = llama.forward(params, jnp.asarray(toks), jnp.asarray(pos), config=config, precision=F32,
                                    cache=cache)
    last = jnp.asarray([[s[-1]] for s in seqs])
    pos = jnp.asarray([[len(s) - 1] for s in seqs])
    logits, _, _ = llama.forward(params, last, pos, config=config, precision=F32, cache=cache)
    for row, seq in enumerate(seqs):
        full, _, _ = llama.forward(params, jnp.asarray(seq)[None], config=config, precision=F32)
        np.testing.assert_allclose(np.asarray(logits[row, 0]), np.asarray(full[0, -1]), rtol=1e-5, atol=1e-5)


def test_gguf_smollm2_greedy_answer(smollm2):
    config, params, tok = smollm2
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    prompt = tok.encode_chat([{"role": "user", "content": "What is 2+3?"}])
    cache = kv_cache.init_cache(config, 1, len(prompt) + 24, jnp.float32)
    step = jax.jit(lambda p, t, pos, c: llama.forward(p, t, pos, config=config, precision=F32, cache=c)[:2])
    logits, cache = step(params, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], cache)
    out = []
    for i in range(24):
        nxt = int(jnp.argmax(logits[0, -1]))
        if nxt in tok.stop_ids:
            break
        out.append(nxt)
        logits, cache = step(params, jnp.asarray([[nxt]]), jnp.asarray([[len(prompt) + i]]), cache)
    answer = tok.decode(out)
    print(f"SmolLM2-135M-Instruct, greedy: 'What is 2+3?' -> {answer!r}")
    assert "5" in answer


# ----------------------------------------------------------------------------------------------------------
# full-sequence attention: the masked einsum and the flash-attention call (cuDNN on a GPU)


def _qkv(dtype, b=2, t=19, n=8, kh=2, h=16, seed=0):
    rng = np.random.RandomState(seed)
    q, k, v = (jnp.asarray(rng.randn(b, t, heads, h), dtype) for heads in (n, kh, kh))
    return q, k, v


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_flash_attention_call_equals_masked_einsum(impl, dtype, tol):
    """The flash calls' layout (K/V as [B, T, K, H], causal by index, GQA; for Pallas the kv heads repeated and T
    padded to a tile) against the model's einsum over positions 0..T-1, forward and gradient; on CPU through jax's
    reference of the cuDNN call and Pallas' interpreter."""
    q, k, v = _qkv(dtype, n=4)
    pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    einsum = lambda q, k, v: attention.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), pos, pos)
    flash = lambda q, k, v: attention.flash_attention(q, k, v, impl)
    out, ref = flash(q, k, v), einsum(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
    weights = jnp.asarray(np.random.RandomState(1).randn(*q.shape), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * weights)
    grads, ref_grads = jax.grad(loss(flash), (0, 1, 2))(q, k, v), jax.grad(loss(einsum), (0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=5 * tol, atol=5 * tol)


def test_resolve_attention():
    gpu = {"backend": "gpu", "cudnn_clash": False}
    assert attention.resolve_attention("auto", jnp.bfloat16, 64, **gpu) == "cudnn"
    assert attention.resolve_attention("auto", jnp.bfloat16, 128, **gpu) == "cudnn"
    assert attention.resolve_attention("auto", jnp.float32, 64, **gpu) == "xla"  # cuDNN's is BF16 / F16
    assert attention.resolve_attention("auto", jnp.bfloat16, 256, **gpu) == "xla"
    # Transformer Engine on another cuDNN than JAX's: the cuDNN flash backward failed on the H100 image; Pallas' then
    te = {"backend": "gpu", "cudnn_clash": True}
    assert attention.resolve_attention("auto", jnp.bfloat16, 64, **te) == "pallas"
    assert attention.resolve_attention("auto", jnp.bfloat16, 96, **te) == "xla"  # Triton tiles: powers of two
    assert attention.resolve_attention("auto", jnp.float32, 64, **te) == "xla"
    # the Pallas kernel is not partitioned: under a mesh of several devices the einsum (cuDNN's call is)
    assert attention.resolve_attention("auto", jnp.bfloat16, 64, mesh_devices=8, **te) == "xla"
    assert attention.resolve_attention("auto", jnp.bfloat16, 64, mesh_devices=8, **gpu) == "cudnn"
    with mesh_context(make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1}))):
        assert jax.sharding.get_abstract_mesh().size == jax.device_count()
        expected = "xla" if jax.device_count() > 1 else "pallas"
        assert attention.resolve_attention("auto", jnp.bfloat16, 64, **te) == expected
    assert attention.resolve_attention("auto", jnp.bfloat16, 64, backend="cpu") == "xla"
    assert attention.resolve_attention("xla", jnp.bfloat16, 64, backend="gpu") == "xla"
    assert attention.resolve_attention("cudnn", jnp.bfloat16, 64, backend="cpu") == "cudnn"
    assert Precision().attention == "auto"
    with pytest.raises(ValueError, match="attention='flash'"):
        Precision(attention="flash")


@pytest.mark.parametrize("kv_dtype", ["float32", "float8_e4m3fn"])
def test_forward_through_the_flash_branch(monkeypatch, kv_dtype):
    """The model's flash branch (q, k, v kept in [B, T, heads, H]; FP8 K/V rounded first, as the cache would) gives
    the einsum branch's logits. On CPU the branch is forced and runs jax's reference of the cuDNN call."""
    config = preset("tiny")
    params = llama.init_params(config, jax.random.PRNGKey(3), std=0.1)
    precision = Precision(compute_dtype="float32", kv_cache_dtype=kv_dtype, attention="xla")
    kw = {"config": config, "precision": precision}
    if precision.kv_fp8:
        kw["kv_scales"] = {"k": jnp.full((config.num_layers,), 4.0), "v": jnp.full((config.num_layers,), 8.0)}
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (3, 21)))
    ref, _, _ = llama.forward(params, tokens, **kw)
    seen = []
    flash = attention.flash_attention

    def reference_flash(q, k, v, implementation, segment_ids=None):
        seen.append(implementation)
        return flash(q, k, v, "xla", segment_ids=segment_ids)

    monkeypatch.setattr(llama, "resolve_attention", lambda *a, **k: "cudnn")
    monkeypatch.setattr(llama, "flash_attention", reference_flash)
    out, _, _ = llama.forward(params, tokens, **kw)
    assert seen == ["cudnn"] * config.num_layers or seen == ["cudnn"]  # unrolled or scanned layers
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    if precision.kv_fp8:  # the FP8 rounding of K/V is there in both branches: without it the logits move
        plain, _, _ = llama.forward(params, tokens, config=config,
                                    precision=precision.replace(kv_cache_dtype="float32"))
        assert float(jnp.max(jnp.abs(plain - out))) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_gpu_flash_attention_matches_the_einsum(impl):
    """Flash attention in the BF16 forward and its gradient: as close to the f32 reference as the einsum path
    (Llama-like head dim 64, GQA, a length that is no multiple of a tile)."""
    if impl == "cudnn" and attention.resolve_attention("auto", jnp.bfloat16, 64) != "cudnn":
        pytest.skip("Transformer Engine loaded another cuDNN than JAX's (fp8.te.shares_jax_cudnn() is False): the "
                    "cuDNN flash backward fails beside it; run with FP8RL_TEST_NO_TE=1")
    config = preset("tiny").replace(head_dim=64, num_heads=8, num_kv_heads=2)
    params = llama.init_params(config, jax.random.PRNGKey(0), std=0.1)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (3, 200)))

    def loss(p, precision):
        logits, _, _ = llama.forward(p, tokens, config=config, precision=precision)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)), logits

    def run(precision):
        (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, precision)
        return np.asarray(logits, np.float32), np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])

    ref_logits, ref_grads = run(Precision(compute_dtype="float32", attention="xla"))
    errors = {}
    for name in ("xla", impl):
        logits, grads = run(Precision(attention=name))
        errors[name] = (np.abs(logits - ref_logits).mean(),
                        np.linalg.norm(grads - ref_grads) / np.linalg.norm(ref_grads))
    print(errors)
    assert errors[impl][0] <= 1.5 * errors["xla"][0] + 1e-3
    assert errors[impl][1] <= 1.5 * errors["xla"][1] + 1e-3


# ----------------------------------------------------------------------------------------------------------
# packed rows (rl.packing): attention confined to each segment, in every implementation

# two rows of 19 tokens: three sequences and a padding tail (segment 0); two sequences
SEGMENTS = np.array([[1] * 7 + [2] * 5 + [3] * 4 + [0] * 3, [1] * 10 + [2] * 9], np.int32)


def _runs(row):
    """(start, end) of each run of equal ids in a row."""
    starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]]
    return list(zip(starts, starts[1:] + [len(row)], strict=True))


def _segment_positions(segments):
    pos = np.zeros(segments.shape, np.int32)
    for b, row in enumerate(segments):
        for start, end in _runs(row):
            pos[b, start:end] = np.arange(end - start)
    return jnp.asarray(pos)


def _attention_per_sequence(q, k, v, segments):
    """The reference: every run of a row on its own, through the einsum at positions 0..n-1, put back in place."""
    out = np.zeros(q.shape, np.float32)
    for b, row in enumerate(segments):
        for start, end in _runs(row):
            pos = jnp.arange(end - start)[None]
            # [1, n, heads, H]; K/V as [1, K, n, H]
            one = attention.attention(q[b : b + 1, start:end], k[b : b + 1, start:end].transpose(0, 2, 1, 3),
                                  v[b : b + 1, start:end].transpose(0, 2, 1, 3), pos, pos)
            out[b, start:end] = np.asarray(one[0], np.float32)
    return out


def test_segment_table_by_hand():
    lengths, starts = attention.segment_table(jnp.asarray(SEGMENTS), 4)
    np.testing.assert_array_equal(lengths, [[7, 5, 4, 3], [10, 9, -1, -1]])
    np.testing.assert_array_equal(starts, [[0, 7, 12, 16, -1], [0, 10, -1, -1, -1]])
    # cuDNN's reading of the table (each run a sequence of its own, causal inside it) is the segment mask
    for b, row in enumerate(SEGMENTS):
        owner = np.full(len(row), -1)
        for j, (s, n) in enumerate(zip(np.asarray(starts[b]), np.asarray(lengths[b]), strict=False)):
            if n > 0:
                owner[s : s + n] = j
        assert (owner >= 0).all()  # every position in a run: no output left undefined
        np.testing.assert_array_equal(owner[:, None] == owner[None, :], row[:, None] == row[None, :])
    assert attention.row_segments(19) == 1 and attention.row_segments(64) == 4  # one run more for the padding tail
    # capped: cuDNN's packed attention sizes its buffers by rows x segments (0.5 GiB a segment at llama1b's 14 x 2304)
    assert attention.row_segments(2304) == attention.MAX_ROW_SEGMENTS == 8


def test_segment_masked_einsum_equals_each_sequence_alone():
    q, k, v = _qkv(jnp.float32, n=4)
    pos = _segment_positions(SEGMENTS)
    seg = jnp.asarray(SEGMENTS)
    out = attention.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), pos, pos, seg, seg)
    np.testing.assert_allclose(np.asarray(out), _attention_per_sequence(q, k, v, SEGMENTS), rtol=1e-5, atol=1e-6)
    # without the segments the second sequence of row 0 would read the first: the mask is doing the work
    plain = attention.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), pos, pos)
    assert float(jnp.max(jnp.abs(plain - out))) > 1e-2


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_flash_attention_with_segments_equals_the_segment_masked_einsum(impl, dtype, tol):
    """The flash calls with segment ids (jax's reference of the cuDNN call with a segment mask; Pallas' interpreter
    with its segment ids, padded to a tile with ids no query has) against the einsum, forward and gradient."""
    q, k, v = _qkv(dtype, n=4)
    pos = _segment_positions(SEGMENTS)
    seg = jnp.asarray(SEGMENTS)
    einsum = lambda q, k, v: attention.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), pos, pos, seg,
                                             seg)
    flash = lambda q, k, v: attention.flash_attention(q, k, v, impl, segment_ids=seg)
    out, ref = flash(q, k, v), einsum(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
    weights = jnp.asarray(np.random.RandomState(1).randn(*q.shape), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * weights)
    grads, ref_grads = jax.grad(loss(flash), (0, 1, 2))(q, k, v), jax.grad(loss(einsum), (0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=5 * tol, atol=5 * tol)


def test_packed_forward_through_the_flash_branch(monkeypatch):
    """forward_hidden with segment ids takes them to the flash branch (here jax's reference of the cuDNN call) and
    to the einsum branch alike: the same hidden states; a packed row's sequences equal each sequence run alone."""
    config = preset("tiny")
    params = llama.init_params(config, jax.random.PRNGKey(3), std=0.1)
    tokens = jnp.asarray(np.random.RandomState(2).randint(1, config.vocab_size, SEGMENTS.shape))
    pos, seg = _segment_positions(SEGMENTS), jnp.asarray(SEGMENTS)
    kw = {"config": config, "precision": F32.replace(attention="xla")}
    ref, _, _ = llama.forward_hidden(params, tokens, pos, segment_ids=seg, **kw)
    for b, row in enumerate(SEGMENTS):
        for start, end in _runs(row):
            alone, _, _ = llama.forward_hidden(params, tokens[b : b + 1, start:end],
                                               jnp.arange(end - start)[None], **kw)
            np.testing.assert_allclose(np.asarray(ref[b, start:end]), np.asarray(alone[0]), rtol=1e-5, atol=1e-5)
    flash = attention.flash_attention
    monkeypatch.setattr(llama, "resolve_attention", lambda *a, **k: "cudnn")
    monkeypatch.setattr(llama, "flash_attention", lambda q, k, v, impl, segment_ids=None: flash(
        q, k, v, "xla", segment_ids=segment_ids))
    out, _, _ = llama.forward_hidden(params, tokens, pos, segment_ids=seg, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="segment_ids .* without a cache"):
        llama.forward_hidden(params, tokens, pos, segment_ids=seg,
                             cache=kv_cache.init_cache(config, 2, 19, jnp.float32), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_gpu_packed_flash_attention_matches_the_einsum(impl):
    """Packed rows on the GPU: cuDNN's packed (THD) layout and Pallas' segment ids against the f32 segment-masked
    einsum, BF16, forward and gradient; as close as the BF16 einsum (Llama-like head dim 64, GQA 8/2, rows of 256
    with 1-5 sequences and padding tails)."""
    if impl == "cudnn" and attention.resolve_attention("auto", jnp.bfloat16, 64) != "cudnn":
        pytest.skip("Transformer Engine loaded another cuDNN than JAX's; run with FP8RL_TEST_NO_TE=1")
    rng = np.random.RandomState(0)
    t = 256
    rows = []
    for cuts in ([256], [100, 156], [40, 60, 80, 50], [16, 16, 16, 16, 100], [30, 30, 30]):
        ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(cuts)])
        rows.append(np.r_[ids, np.zeros(t - len(ids))].astype(np.int32))
    seg = jnp.asarray(np.stack(rows))
    pos = _segment_positions(np.stack(rows))
    q, k, v = (jnp.asarray(rng.randn(len(rows), t, heads, 64), jnp.float32) for heads in (8, 2, 2))
    weights = jnp.asarray(rng.randn(*q.shape), jnp.float32)

    def run(f, dtype):
        def loss(q, k, v):
            out = f(q.astype(dtype), k.astype(dtype), v.astype(dtype))
            return jnp.sum(out.astype(jnp.float32) * weights), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
        return np.asarray(out, np.float32), np.concatenate([np.ravel(g) for g in grads])

    einsum = lambda q, k, v: attention.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), pos, pos, seg,
                                             seg)
    ref_out, ref_grads = run(einsum, jnp.float32)
    errors = {}
    for name, f in (("xla", einsum), (impl, lambda q, k, v: attention.flash_attention(q, k, v, impl, segment_ids=seg))):
        out, grads = run(f, jnp.bfloat16)
        errors[name] = (np.abs(out - ref_out).max(), np.linalg.norm(grads - ref_grads) / np.linalg.norm(ref_grads))
    print(errors)
    assert errors[impl][0] <= 2 * errors["xla"][0] + 1e-2
    assert errors[impl][1] <= 2 * errors["xla"][1] + 1e-2
