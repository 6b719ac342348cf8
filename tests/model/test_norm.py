"""The blocks' RMSNorm and its 1 x 128 tiles from one kernel (``model.norm``, ``kernels.block_quantize.norm_tiles``):
the kernel through Pallas' interpreter against ``rms_norm`` then ``block.tile_quantize``; a block-scaled rollout
forward that takes it against the training forward; its CUDA lowering; on a GPU, the compiled kernel against XLA's
norm (their sums of squares are added in different orders)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import block, xla
from fp8rl_jax.fp8.block import Tiles
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.kernels import block_quantize
from fp8rl_jax.model import kv_cache, llama, norm
from fp8rl_jax.model.config import preset
from fp8rl_jax.rollout.weights import rollout_params

E4M3 = jnp.float8_e4m3fn
BLOCK = Fp8Recipe(scaling="block", fp8_format="e4m3")


def _inputs(p, c, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(p, c)).astype(np.float32) * np.exp(rng.normal(size=(1, c))).astype(np.float32)
    x[1, 7] = 3000.0  # a massive value: its row's tiles
    add = rng.normal(size=(p, c)).astype(np.float32)
    w = (1 + 0.1 * rng.normal(size=(c,))).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(add, dtype), jnp.asarray(w)


def _xla(x, add, w, eps, dtype=E4M3):
    s = x if add is None else x + add
    q, inv = block.tile_quantize(norm.rms_norm(s, w, eps, jnp.bfloat16), dtype)
    return s, q, inv


def _f32(a):
    return np.asarray(a.astype(jnp.float32))


def _close(got, want):
    """The kernel's tiles against XLA's: equal but where a sum of squares added in another order moved an element
    of h by a BF16 unit across an FP8 rounding boundary (one FP8 step), scales within that unit."""
    (s, q, inv_t), (rs, rq, rinv) = got, want
    if s is not None:
        np.testing.assert_array_equal(_f32(s), _f32(rs))
    a, b = _f32(q), _f32(rq)
    assert np.mean(a == b) > 0.999
    assert np.all(np.abs(a - b) <= np.abs(b) * 2.0**-3 + 1e-30)
    np.testing.assert_allclose(np.asarray(inv_t).T, np.asarray(rinv), rtol=2.0**-7)


@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("rows", [1, 4, None])
def test_kernel_follows_rms_norm_then_the_tiles(with_add, rows):
    x, add, w = _inputs(16, 512)
    add = add if with_add else None
    got = jax.jit(lambda x, a, w: block_quantize.norm_tiles(x, w, 1e-5, E4M3, add=a, h_dtype=jnp.bfloat16,
                                                            rows_per_program=rows, interpret=True))(x, add, w)
    assert (got[0] is None) == (not with_add)
    assert got[1].dtype == jnp.dtype(E4M3) and got[1].shape == (16, 512) and got[2].shape == (4, 16)
    _close(got, _xla(x, add, w, 1e-5))


def test_kernel_checks_its_shapes():
    x, add, w = _inputs(12, 256)
    for width in (200, 384):  # not whole tiles; three tiles (Triton's blocks are powers of 2)
        with pytest.raises(ValueError, match="C 128 times a power of 2"):
            block_quantize.norm_tiles(jnp.zeros((12, width)), jnp.zeros((width,)), 1e-5, E4M3, interpret=True)
    with pytest.raises(ValueError, match="weight must be"):
        block_quantize.norm_tiles(x, w[:128], 1e-5, E4M3, interpret=True)
    with pytest.raises(ValueError, match="rows_per_program=8"):
        block_quantize.norm_tiles(x, w, 1e-5, E4M3, rows_per_program=8, interpret=True)
    assert [block_quantize.norm_rows(p) for p in (256, 12, 7, 4096)] == [2, 2, 1, 2]


def test_kernel_lowers_for_cuda(triton_ir):
    """Pallas' Triton lowering of both forms on this host (a shape or op it refuses fails here)."""
    x = jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2048,), jnp.float32)
    for add in (None, x):
        (ir,) = triton_ir(lambda x, w, a: block_quantize.norm_tiles(x, w, 1e-5, E4M3, add=a), x, w, add)
        assert "norm_tiles" in ir


CONFIG = preset("tiny").replace(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, CONFIG.vocab_size, (2, 12)))


@pytest.fixture
def norm_kernel_here(monkeypatch):
    """``normed`` takes the kernel on this CPU host (through Pallas' interpreter) where its width allows; the list
    holds whether each traced call had an add."""
    calls, kernel = [], block_quantize.norm_tiles

    def traced(*args, add=None, **kw):
        calls.append(add is not None)
        return kernel(*args, add=add, interpret=True, **kw)

    monkeypatch.setattr(block_quantize, "norm_fits", block_quantize._norm_width)
    monkeypatch.setattr(block_quantize, "norm_tiles", traced)
    return calls


def test_block_rollout_forward_takes_the_kernel_and_follows_the_training_forward(norm_kernel_here):
    """A block-scaled rollout forward (pre-quantized kernels, a cache) with both norms of each block from the kernel
    (the residual add after wo in the second): the training forward's logits, up to the kernel's order of adding
    the squares (equal on this host)."""
    params = llama.init_params(CONFIG, jax.random.PRNGKey(0), std=0.05)
    prec = Precision(backend="xla", recipe=BLOCK)
    state = llama.init_fp8_state(CONFIG, prec)
    train = jax.jit(lambda p, s: llama.forward(p, TOKENS, config=CONFIG, precision=prec, fp8_state=s)[0])(
        params, state)
    rp = jax.jit(lambda p, s: rollout_params(p, s, prec, CONFIG.num_layers))(params, state)
    cache = kv_cache.init_cache(CONFIG, 2, 16, kv_cache.cache_dtype(prec))

    def roll(p, s, c):
        return llama.forward(p, TOKENS, config=CONFIG, precision=prec, fp8_state=s, cache=c)[0]

    got = jax.jit(roll)(rp, state, cache)
    assert norm_kernel_here == [False, True]  # the block traced once (the layers are scanned)
    np.testing.assert_allclose(np.asarray(got), np.asarray(train), atol=1e-5)


def test_normed_takes_the_kernel_for_block_rollout_kernels_only(norm_kernel_here):
    x = jnp.ones((2, 3, 128), jnp.bfloat16)
    w, st = jnp.ones((128,)), init_linear_state(BLOCK)
    rollout = xla.QuantizedKernel(jnp.zeros((128, 128)), jnp.ones((1, 1)))
    block_prec = Precision(backend="xla", recipe=BLOCK)
    s, h = norm.normed(x, x, w, 1e-5, rollout, st, block_prec)
    assert isinstance(h, Tiles) and h.q.shape == (2, 3, 128) and h.scale_inv.shape == (2, 3, 1)
    np.testing.assert_array_equal(_f32(s), 2 * _f32(x))
    for kernel, state, prec in ((jnp.zeros((128, 128)), st, block_prec), (rollout, None, block_prec),
                                (rollout, st, Precision(backend="xla")),
                                (rollout, st, Precision(backend="xla", recipe=Fp8Recipe(
                                    scaling="block", block_forward="tokens_blocks")))):
        s, h = norm.normed(x, None, w, 1e-5, kernel, state, prec)
        assert not isinstance(h, Tiles) and s is x
    assert not norm.norm_tiles_apply(x[..., :64], rollout, st, block_prec)
    assert not norm.norm_tiles_apply(jnp.ones((2, 384)), rollout, st, block_prec)


@pytest.mark.gpu
def test_gpu_kernel_follows_xla_norm():
    """The compiled kernel against XLA's RMSNorm and quantizer on the GPU, at a decode step's rows and a prefill's:
    the residual sum bit for bit, tiles equal but where the two orders of adding the squares part (``_close``)."""
    for p in (256, 4096):
        x, add, w = _inputs(p, 2048, seed=p)
        got = jax.jit(lambda x, a, w: block_quantize.norm_tiles(x, w, 1e-5, E4M3, add=a, h_dtype=jnp.bfloat16))(
            x, add, w)
        _close(got, jax.jit(lambda x, a, w: _xla(x, a, w, 1e-5))(x, add, w))


def test_block_decode_step_takes_its_tiles_from_the_norm_and_attention_kernels(norm_kernel_here, monkeypatch):
    """A block-scaled decode step through the decode attention kernel (Pallas' interpreter): both norms' tiles from
    the norm kernel, the attention output's from the attention kernel (``out_tiles``; 4 heads of 32 a kv-head pair:
    one tile a program with two kv heads). The same logits as the step whose attention kernel writes BF16 and whose
    norms and quantizers are XLA's (bit for bit on this host, where both orders of adding the squares agree)."""
    from fp8rl_jax.kernels.decode_attention import DecodeTuning

    params = llama.init_params(CONFIG, jax.random.PRNGKey(1), std=0.05)
    prec = Precision(backend="xla", recipe=BLOCK)
    state = llama.init_fp8_state(CONFIG, prec)
    rp = rollout_params(params, state, prec, CONFIG.num_layers)
    cache = kv_cache.init_cache(CONFIG, 2, 16, kv_cache.cache_dtype(prec))
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    _, cache, _ = llama.forward(rp, TOKENS, positions, config=CONFIG, precision=prec, fp8_state=state, cache=cache)
    calls = len(norm_kernel_here)

    def step():
        return llama.forward(rp, TOKENS[:, -1:], jnp.full((2, 1), 12), config=CONFIG, precision=prec,
                             fp8_state=state, cache=cache, decode_attention="pallas_interpret",
                             decode_tuning=DecodeTuning(k_splits=1, heads_per_program=2))[0]

    tiles = []
    attend = llama.decode_kernel.decode_attention_qkv
    monkeypatch.setattr(llama.decode_kernel, "decode_attention_qkv",
                        lambda *a, **kw: tiles.append(kw.get("out_tiles")) or attend(*a, **kw))
    got = jax.jit(lambda: step())()
    assert norm_kernel_here[calls:] == [False, True] and tiles == [jnp.float8_e4m3fn]
    monkeypatch.setattr(block_quantize, "norm_fits", lambda x: False)
    monkeypatch.setattr(llama, "_decode_output", lambda *a: {})
    want = jax.jit(lambda: step())()  # traced anew
    assert tiles[1:] == [None]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_benchmark_runs_interpreted(tmp_path, benchmark_script):
    """benchmarks/norm_tiles_speed.py --check: every path and launch runs through Pallas' interpreter, and on this
    host the kernel's tiles, scales and residual sum equal XLA's route bit for bit (its norm reads the rounded
    residual: ``rms_norm``)."""
    import json

    out = tmp_path / "norm.json"
    benchmark_script("norm_tiles_speed").main(["--check", "--rows", "1,8", "--num-warps", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["path"] for r in rows] == ["kernel", "kernel", "two_kernels"]
    assert all(r["differ"] == r["scales_differ"] == r["residual_differs"] == 0 for r in rows), rows


@pytest.mark.gpu
def test_gpu_block_decode_step_with_its_kernels_follows_the_xla_route(monkeypatch):
    """On the GPU a block-scaled decode step at llama1b's width (2 layers, 256 sequences: the norm kernel, the
    attention kernel's tiles, the Mosaic GEMMs) against the same step with the attention kernel's BF16 output and
    XLA's norms and quantizer: the sums of squares add in other orders, so a few tiles move by an FP8 step and the
    logits by their effect only."""
    from fp8rl_jax.model.config import LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=2048, intermediate_size=8192, num_layers=2, num_heads=32,
                         num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=512)
    params = llama.init_params(config, jax.random.PRNGKey(3), std=0.02)
    prec = Precision(backend="xla", recipe=BLOCK)
    state = llama.init_fp8_state(config, prec)
    rp = rollout_params(params, state, prec, config.num_layers)
    b = 256
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (b, 24)))
    cache = kv_cache.init_cache(config, b, 32, kv_cache.cache_dtype(prec))
    positions = jnp.broadcast_to(jnp.arange(24), (b, 24))
    _, cache, _ = jax.jit(lambda c: llama.forward(rp, tokens, positions, config=config, precision=prec,
                                                  fp8_state=state, cache=c))(cache)

    def step():
        return llama.forward(rp, tokens[:, -1:], jnp.full((b, 1), 24), config=config, precision=prec,
                             fp8_state=state, cache=cache, decode_attention="pallas")[0]

    calls, kernel = [], block_quantize.norm_tiles
    monkeypatch.setattr(block_quantize, "norm_tiles", lambda *a, add=None, **kw: calls.append(add is not None)
                        or kernel(*a, add=add, **kw))
    got = jax.jit(lambda: step())()
    assert calls == [False, True]  # the block traced once (the layers are scanned)
    monkeypatch.setattr(block_quantize, "norm_fits", lambda x: False)
    monkeypatch.setattr(llama, "_decode_output", lambda *a: {})
    want = jax.jit(lambda: step())()  # traced anew
    a, w = np.asarray(got), np.asarray(want)
    assert np.all(np.isfinite(a)) and np.mean(a == w) > 0.9, np.mean(a == w)
    np.testing.assert_allclose(a, w, atol=0.05 * np.abs(w).max())
