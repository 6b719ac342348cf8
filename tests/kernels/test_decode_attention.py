"""Length-aware decode attention: the Pallas kernel (through Pallas' interpreter on CPU) and the XLA path against
a float64 numpy reference, garbage past the lengths, the engine's greedy tokens, and the kernel's GPU lowering.

Tolerances (max |got - reference| <= atol + rtol |reference|):
- f32 query and f32 or FP8 K/V: 1e-5 / 1e-5. The FP8 values are exact in f32 and the scales are applied in f32.
- BF16 query with BF16 or FP8 K/V: 1e-2 / 1e-2. The reference is computed from the very BF16 / E4M3 values the
  kernel reads (dequantized in float64), so what is left is the BF16 rounding of the probabilities before the
  P.V dot and of the output (2**-9 relative each). Over an FP8 cache the dots take F16 operands by default (the
  BF16 query is exact in F16 here; the probabilities round to 2**-12); ``fp8_bf16dot`` checks BF16 operands.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.kernels import decode_attention as da

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

B, K, H, S = 4, 2, 16, 40
LENGTHS = np.array([1, 16, 23, S], np.int32)  # one token, a block multiple, a ragged block, the full cache
TOL = {"f32": 1e-5, "bf16": 1e-2, "fp8": 1e-2, "fp8_f32q": 1e-5, "fp8_bf16dot": 1e-2}


def _inputs(kind: str, g: int, seed: int = 0, layers: int | None = None, kv_heads: int = K):
    """q [B, K, G, H]; k, v [(L,) B, K, S, H] in the cache dtype; scales; and float64 copies of what the kernel
    reads: q, and K / V after dequantization."""
    rng = np.random.default_rng(seed)
    lead = (layers,) if layers else ()
    q = rng.standard_normal((B, kv_heads, g, H))
    k = 2.0 * rng.standard_normal((*lead, B, kv_heads, S, H))
    v = rng.standard_normal((*lead, B, kv_heads, S, H))
    q_dtype = jnp.float32 if kind in ("f32", "fp8_f32q") else jnp.bfloat16
    q = np.asarray(jnp.asarray(q, q_dtype))
    if kind.startswith("fp8"):
        k_scale, v_scale = np.float32(448 / 12.0), np.float32(448 / 6.0)  # |k| < 12, |v| < 6 here
        k8 = (k * k_scale).astype(ml_dtypes.float8_e4m3fn)
        v8 = (v * v_scale).astype(ml_dtypes.float8_e4m3fn)
        k64, v64 = k8.astype(np.float64) / np.float64(k_scale), v8.astype(np.float64) / np.float64(v_scale)
        return q, k8, v8, k_scale, v_scale, q.astype(np.float64), k64, v64
    cache_dtype = jnp.float32 if kind == "f32" else jnp.bfloat16
    k, v = np.asarray(jnp.asarray(k, cache_dtype)), np.asarray(jnp.asarray(v, cache_dtype))
    return q, k, v, None, None, q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)


def _reference(q, k, v, lengths):
    """Softmax attention over positions 0..length-1 of each sequence, float64 (zeros for length 0).
    q [B, K, G, H]; k, v [B, K, S, H]."""
    out = np.zeros(q.shape)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        # [K, G, H] x [K, n, H] -> [K, G, n]
        scores = np.einsum("kgh,ksh->kgs", q[b], k[b, :, :n]) / np.sqrt(q.shape[-1])
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[b] = np.einsum("kgs,ksh->kgh", p / p.sum(-1, keepdims=True), v[b, :, :n])
    return out


@functools.cache
def _jitted(impl: str, block_k: int | None, k_splits: int | None, stacked: bool, dot_dtype: str | None = None,
            heads_per_program: int = 1):
    tuning = {"tuning": da.DecodeTuning(block_k=block_k, k_splits=k_splits, dot_dtype=dot_dtype,
                                        heads_per_program=heads_per_program)}
    tuning = {} if impl == "xla" else tuning

    def run(q, k, v, lengths, k_scale, v_scale, layer):
        return da.decode_attention(q, k, v, lengths, layer=layer if stacked else None, k_scale=k_scale,
                                   v_scale=v_scale, impl=impl, **tuning)

    return jax.jit(run)


def _attend(impl, q, k, v, lengths, k_scale, v_scale, *, block_k=16, k_splits=2, layer=None, dot_dtype=None,
            heads_per_program=1):
    f = _jitted(impl, block_k, k_splits, layer is not None, dot_dtype, heads_per_program)
    return np.asarray(f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), k_scale, v_scale,
                        layer), np.float64)


CASES = [  # kind, G, block_k, k_splits
    ("f32", 1, 16, 3),
    ("f32", 3, 16, 2),
    ("f32", 4, 16, 1),
    ("f32", 8, 32, 2),
    ("bf16", 4, 16, 3),
    ("bf16", 3, 16, 1),
    ("fp8", 4, 16, 2),
    ("fp8", 8, 16, 3),
    ("fp8", 4, 16, 1),  # one split: the kernel normalises and applies 1/v_scale itself
    ("fp8_f32q", 4, 16, 2),
    ("fp8_bf16dot", 4, 16, 2),  # BF16 dot operands instead of the default F16
]


@pytest.mark.parametrize("kind,g,block_k,k_splits", CASES)
def test_kernel_matches_float64_reference(kind, g, block_k, k_splits):
    q, k, v, k_scale, v_scale, q64, k64, v64 = _inputs(kind, g)
    want = _reference(q64, k64, v64, LENGTHS)
    got = _attend("pallas_interpret", q, k, v, LENGTHS, k_scale, v_scale, block_k=block_k, k_splits=k_splits,
                  dot_dtype="bfloat16" if kind == "fp8_bf16dot" else None)
    tol = TOL[kind]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# several kv heads per program (``heads_per_program`` P): lengths 0 (zeros out), 1, a ragged block, the full cache
PACKED_LENGTHS = np.array([0, 1, 23, S], np.int32)
PACKED_CASES = [  # kind, G, K, P, block_k, k_splits
    ("f32", 4, 4, 4, 16, 1),  # 16 rows: every row of the score tile real
    ("f32", 2, 8, 2, 16, 3),  # 4 rows padded to 16; 3 splits (23 positions leave one split empty)
    ("f32", 4, 8, 2, 32, 2),
    ("f32", 4, 8, 8, 16, 2),  # P*G = 32 rows: the tile grows to 32
    ("bf16", 4, 4, 2, 16, 3),
    ("bf16", 2, 8, 4, 16, 1),
    ("fp8", 4, 8, 4, 16, 2),
    ("fp8", 2, 4, 2, 16, 1),
    ("fp8", 2, 4, 4, 16, 3),
    ("fp8_f32q", 4, 4, 4, 16, 3),
    ("fp8_bf16dot", 4, 4, 2, 16, 2),
]


@pytest.mark.parametrize("kind,g,kv_heads,heads_per_program,block_k,k_splits", PACKED_CASES)
def test_packed_heads_match_float64_reference(kind, g, kv_heads, heads_per_program, block_k, k_splits):
    """P kv heads per program, one shared softmax: every head's output against the reference (a head that took
    another head's K, V or accumulator rows would differ: the heads' data are independent draws)."""
    q, k, v, k_scale, v_scale, q64, k64, v64 = _inputs(kind, g, seed=1, kv_heads=kv_heads)
    want = _reference(q64, k64, v64, PACKED_LENGTHS)
    got = _attend("pallas_interpret", q, k, v, PACKED_LENGTHS, k_scale, v_scale, block_k=block_k,
                  k_splits=k_splits, dot_dtype="bfloat16" if kind == "fp8_bf16dot" else None,
                  heads_per_program=heads_per_program)
    tol = TOL[kind]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert not got[0].any()  # length 0


def test_packed_heads_bad_count_names_the_key():
    q, k, v, *_ = _inputs("f32", 2, kv_heads=4)
    for bad in (3, 8, 0):
        with pytest.raises(ValueError, match=f"heads_per_program={bad}"):
            da.decode_attention_pallas(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(LENGTHS),
                                       tuning=da.DecodeTuning(heads_per_program=bad), interpret=True)


@pytest.mark.parametrize("kind", ["f32", "bf16", "fp8"])
def test_xla_path_matches_float64_reference(kind):
    q, k, v, k_scale, v_scale, q64, k64, v64 = _inputs(kind, 4)
    want = _reference(q64, k64, v64, LENGTHS)
    got = _attend("xla", q, k, v, LENGTHS, k_scale, v_scale)
    tol = TOL[kind]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl,heads_per_program", [("pallas_interpret", 1), ("pallas_interpret", 2), ("xla", 1)])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_garbage_past_the_length_does_not_leak(impl, heads_per_program, kind):
    """NaN and huge values at positions >= length (and in another layer) change nothing, bit for bit."""
    q, k, v, k_scale, v_scale, *_ = _inputs(kind, 4, layers=2)
    attend = functools.partial(_attend, heads_per_program=heads_per_program)
    clean = attend(impl, q, k, v, LENGTHS, k_scale, v_scale, layer=1)
    big = 448.0 if kind == "fp8" else 1e30
    k_bad, v_bad = k.astype(np.float32), v.astype(np.float32)
    for b, n in enumerate(LENGTHS):
        k_bad[1, b, :, n:], v_bad[1, b, :, n:] = np.nan, np.nan
        k_bad[1, b, :, n::3], v_bad[1, b, :, n + 1 :: 3] = big, -big
    k_bad[0], v_bad[0] = np.nan, np.nan
    k_bad, v_bad = k_bad.astype(k.dtype), v_bad.astype(v.dtype)
    assert np.isnan(k_bad.astype(np.float32)).any()
    dirty = attend(impl, q, k_bad, v_bad, LENGTHS, k_scale, v_scale, layer=1)
    assert np.isfinite(dirty).all()
    np.testing.assert_array_equal(dirty, clean)


def test_stacked_cache_reads_the_given_layer():
    """A [L, B, K, S, H] cache with a traced layer index equals the reference on that layer."""
    q, k, v, k_scale, v_scale, q64, k64, v64 = _inputs("fp8", 4, layers=3)
    for layer in (0, 2):
        got = _attend("pallas_interpret", q, k, v, LENGTHS, k_scale, v_scale, layer=jnp.int32(layer))
        np.testing.assert_allclose(got, _reference(q64, k64[layer], v64[layer], LENGTHS), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind,k_splits", [("fp8", 1), ("fp8", 3), ("bf16", 2)])
def test_unmasked_whole_blocks_change_nothing(kind, k_splits):
    """``tail_loop`` (whole blocks without masks, the partial last block masked in a loop of its own; off by
    default) gives the one masked loop's result bit for bit, lengths on and off block boundaries, garbage past
    them."""
    q, k, v, k_scale, v_scale, *_ = _inputs(kind, 4)
    lengths = np.array([16, 23, 32, S], np.int32)
    k_bad, v_bad = k.astype(np.float32), v.astype(np.float32)
    for b, n in enumerate(lengths):
        k_bad[b, :, n:], v_bad[b, :, n:] = np.nan, np.nan
    args = [jnp.asarray(a) for a in (q, k_bad.astype(k.dtype), v_bad.astype(v.dtype), lengths)]
    tuning = da.DecodeTuning(block_k=16, k_splits=k_splits)
    run = functools.partial(da.decode_attention_pallas, k_scale=k_scale, v_scale=v_scale, interpret=True)
    one_loop = np.asarray(jax.jit(functools.partial(run, tuning=tuning))(*args), np.float32)
    assert np.isfinite(one_loop).all()
    two_loops = jax.jit(functools.partial(run, tuning=dataclasses.replace(tuning, tail_loop=True)))(*args)
    np.testing.assert_array_equal(np.asarray(two_loops, np.float32), one_loop)
    assert da.DecodeTuning().tail_loop is False


@pytest.mark.parametrize("impl", ["pallas_interpret", "xla"])
def test_per_layer_scales_are_read_at_the_layer(impl):
    """Stacked per-layer scales [L] with a traced layer index: bit for bit the result with that layer's scalars."""
    q, k, v, k_scale, v_scale, *_ = _inputs("fp8", 4, layers=3)
    k_scales = np.array([1.0, k_scale, 2.0 * k_scale], np.float32)
    v_scales = np.array([0.5, 0.25 * v_scale, v_scale], np.float32)
    for layer in (1, 2):
        got = _attend(impl, q, k, v, LENGTHS, k_scales, v_scales, layer=jnp.int32(layer), k_splits=1)
        want = _attend(impl, q, k, v, LENGTHS, k_scales[layer], v_scales[layer], layer=jnp.int32(layer), k_splits=1)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="k_scale has 2 per-layer entries; the cache has 3 layers"):
        da.decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(LENGTHS), layer=0,
                            k_scale=k_scales[:2], v_scale=v_scales, impl=impl)


@pytest.mark.parametrize("impl,k_splits", [("pallas_interpret", 1), ("pallas_interpret", 2), ("xla", None)])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_fp8_output_is_the_next_linear_quantization(impl, k_splits, kind):
    """``out_dtype`` FP8 with ``out_scale``: bit for bit ``recipe.quantize`` of the BF16 output (what the next
    linear would make of it), whether the kernel writes it (one split) or XLA's combine of the splits does."""
    from fp8rl_jax.fp8.recipe import quantize

    q, k, v, k_scale, v_scale, *_ = _inputs(kind, 4)
    tuning = {} if impl == "xla" else {"tuning": da.DecodeTuning(block_k=16, k_splits=k_splits)}
    args = [jnp.asarray(a) for a in (q, k, v, LENGTHS)]
    run = functools.partial(da.decode_attention, k_scale=k_scale, v_scale=v_scale, impl=impl, **tuning)
    out_scale = jnp.float32(448.0 / 2.0)  # saturates: |out| reaches ~3 here
    plain = jax.jit(run)(*args)
    got = jax.jit(functools.partial(run, out_scale=out_scale, out_dtype=jnp.float8_e4m3fn))(*args)
    assert got.dtype == jnp.float8_e4m3fn and plain.dtype == q.dtype
    want = quantize(plain, out_scale, jnp.float8_e4m3fn)
    assert np.abs(np.asarray(want, np.float32)).max() == 448.0  # the clip is exercised
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="out_scale goes with an FP8 out_dtype"):
        run(*args, out_dtype=jnp.float8_e4m3fn)


def _tiles_case(impl, g, heads_per_program, k_splits, kv_heads=K, seed=0, layers=None):
    """The output in 1 x 128 tiles (``out_tiles``) and the BF16 output, from the same launch (H = 16: 8 heads a
    tile)."""
    q, k, v, k_scale, v_scale, *_ = _inputs("fp8", g, seed=seed, kv_heads=kv_heads, layers=layers)
    tuning = {} if impl == "xla" else {"tuning": da.DecodeTuning(block_k=16, k_splits=k_splits,
                                                                 heads_per_program=heads_per_program)}
    args = [jnp.asarray(a) for a in (q, k, v, LENGTHS)]
    layer = {"layer": jnp.int32(layers - 1)} if layers else {}
    run = functools.partial(da.decode_attention, k_scale=k_scale, v_scale=v_scale, impl=impl, **layer, **tuning)
    return jax.jit(functools.partial(run, out_tiles=jnp.float8_e4m3fn))(*args), jax.jit(run)(*args)


def _assert_tiles_of(got, plain):
    """``got`` = (q, inv_t) is ``block.tile_quantize`` of each sequence's [N H] row of ``plain``, bit for bit."""
    from fp8rl_jax.fp8 import block

    q, inv_t = got
    b = plain.shape[0]
    want_q, want_inv = block.tile_quantize(plain.reshape(b, -1), jnp.float8_e4m3fn)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == plain.shape and inv_t.shape == (want_inv.shape[1], b)
    np.testing.assert_array_equal(np.asarray(q, np.float32).reshape(b, -1), np.asarray(want_q, np.float32))
    np.testing.assert_array_equal(np.asarray(inv_t).T, np.asarray(want_inv))


@pytest.mark.parametrize("impl,g,heads_per_program,k_splits,kv_heads,in_kernel", [
    ("pallas_interpret", 8, 1, 1, 2, True),  # a program's 8 heads of 16: one whole tile
    ("pallas_interpret", 4, 2, 1, 4, True),  # two kv heads a program: one tile
    ("pallas_interpret", 8, 2, 1, 2, True),  # 16 heads a program: two tiles
    ("pallas_interpret", 4, 1, 1, 2, False),  # half a tile a program: XLA makes them after the kernel
    ("pallas_interpret", 8, 1, 2, 2, False),  # two splits: XLA's combine, then the tiles
    ("xla", 8, 1, None, 2, False),
])
def test_tiles_output_is_the_next_linears_tiles(impl, g, heads_per_program, k_splits, kv_heads, in_kernel):
    """``out_tiles``: bit for bit ``block.tile_quantize`` of each sequence's BF16 output row (what block scaling's
    ``wo`` makes of it), whether the kernel writes the tiles or XLA does after it."""
    if impl != "xla":
        assert da.kernel.tiles_in_kernel(heads_per_program, g, H, k_splits) == in_kernel
    got, plain = _tiles_case(impl, g, heads_per_program, k_splits, kv_heads)
    _assert_tiles_of(got, plain)


def test_tiles_output_is_checked():
    q, k, v, k_scale, v_scale, *_ = _inputs("fp8", 3)  # N H = 2 x 3 x 16 = 96: no whole tile
    args = [jnp.asarray(a) for a in (q, k, v, LENGTHS)]
    with pytest.raises(ValueError, match="1 x 128 tiles of a row of N H = 96"):
        da.decode_attention(*args, k_scale=k_scale, v_scale=v_scale, impl="xla", out_tiles=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="without out_scale and out_dtype"):
        da.decode_attention(*args, k_scale=k_scale, v_scale=v_scale, impl="xla", out_tiles=jnp.float8_e4m3fn,
                            out_dtype=jnp.float8_e4m3fn, out_scale=jnp.float32(1.0))


# the new token's K/V written by the kernel (``new_kv``): lengths 0 (nothing), 1 (the new token alone), a ragged
# block, the cache's last position, past the cache (not written: the whole cache is attended to)
NEW_LENGTHS = np.array([0, 1, 23, S, S + 3], np.int32)
NEW_CASES = [  # kind, G, P, block_k, k_splits
    ("f32", 4, 1, 16, 1),
    ("f32", 2, 2, 16, 3),
    ("bf16", 4, 1, 16, 2),
    ("fp8", 4, 1, 16, 1),
    ("fp8", 4, 1, 16, 3),
    ("fp8", 2, 2, 16, 2),
]


@pytest.mark.parametrize("kind,g,heads_per_program,block_k,k_splits", NEW_CASES)
def test_new_token_written_by_the_kernel(kind, g, heads_per_program, block_k, k_splits):
    """``new_kv``: the caches come back with each sequence's new K/V stored at ``length - 1`` bit for bit as
    ``write_new``'s scatter stores them (quantized for FP8), nothing else changed, and the output is attention over
    the written cache (the float64 reference and the XLA path given the same new K/V)."""
    _check_new_token("pallas_interpret", kind, g, heads_per_program, block_k, k_splits)


def _check_new_token(impl, kind, g, heads_per_program, block_k, k_splits):
    b = len(NEW_LENGTHS)
    q, k, v, k_scale, v_scale, *_ = _inputs(kind, g, seed=2, layers=2, kv_heads=4)
    q, k, v = q[:1].repeat(b, 0), k[:, :1].repeat(b, 1), v[:, :1].repeat(b, 1)  # B = 5 rows
    q = q + np.asarray(jnp.asarray(np.arange(b)[:, None, None, None] * 0.1, q.dtype))  # rows differ
    rng = np.random.default_rng(5)
    new = [np.asarray(jnp.asarray(rng.standard_normal((b, 4, H)) * m, q.dtype)) for m in (2.0, 1.0)]
    args = [jnp.asarray(a) for a in (q, k, v, NEW_LENGTHS)]
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    tuning = da.DecodeTuning(block_k=block_k, k_splits=k_splits, heads_per_program=heads_per_program)
    run = jax.jit(functools.partial(da.decode_attention, layer=jnp.int32(1), new_kv=tuple(map(jnp.asarray, new)),
                                    impl=impl, tuning=tuning, **scales))
    out, k_written, v_written = run(*args)
    layer_scales = {"k": k_scale, "v": v_scale}
    for name, cache, written, new_name in (("k", k, k_written, 0), ("v", v, v_written, 1)):
        want = da.write_new(jnp.asarray(cache), 1, jnp.asarray(NEW_LENGTHS), jnp.asarray(new[new_name]),
                            layer_scales[name])
        np.testing.assert_array_equal(np.asarray(written, np.float32), np.asarray(want, np.float32))
    changed = np.asarray(k_written, np.float32) != np.asarray(jnp.asarray(k), np.float32)
    assert changed[1, [1, 2, 3]].any() and not changed[0].any() and not changed[1, [0, 4]].any()
    # the reference: attention over the written layer, dequantized, lengths clipped to the cache
    deq = lambda a, scale: np.asarray(a, np.float64) / (np.float64(scale) if scale is not None else 1.0)  # noqa: E731
    want = _reference(np.asarray(q, np.float64), deq(k_written[1], k_scale), deq(v_written[1], v_scale),
                      np.minimum(NEW_LENGTHS, S))
    tol = TOL[kind]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol)
    assert not np.asarray(out, np.float32)[0].any()  # length 0
    xla_out, xla_k, xla_v = jax.jit(functools.partial(da.decode_attention, layer=jnp.int32(1),
                                                      new_kv=tuple(map(jnp.asarray, new)), impl="xla",
                                                      **scales))(*args)
    np.testing.assert_array_equal(np.asarray(xla_k, np.float32), np.asarray(k_written, np.float32))
    np.testing.assert_array_equal(np.asarray(xla_v, np.float32), np.asarray(v_written, np.float32))
    if jax.default_backend() == "gpu":  # XLA's f32 einsums run in TF32 on the GPU (the kernel's f32 dots do not)
        tol = max(tol, 1e-2)
    np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(xla_out, np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind,g,heads_per_program,k_splits", [("fp8", 4, 1, 1), ("fp8", 2, 2, 3), ("bf16", 4, 1, 2)])
def test_fused_projection_is_split_then_attended(kind, g, heads_per_program, k_splits):
    """``decode_attention_qkv``: the kernel reading and rotating its queries and new K/V from the fused projection
    gives, bit for bit, what ``split_qkv`` (XLA's rotation, ``rope.apply_rope``'s) then ``new_kv`` give: the output
    and the written caches; and the XLA impl writes the same caches."""
    _check_fused("pallas_interpret", kind, g, heads_per_program, k_splits)


def _check_fused(impl, kind, g, heads_per_program, k_splits):
    from fp8rl_jax.model.rope import apply_rope

    b, kv_heads = len(NEW_LENGTHS), 4
    _, k, v, k_scale, v_scale, *_ = _inputs(kind, g, seed=4, layers=2, kv_heads=kv_heads)
    k, v = k[:, :1].repeat(b, 1), v[:, :1].repeat(b, 1)
    dtype = jnp.float32 if kind == "f32" else jnp.bfloat16
    qkv = jnp.asarray(np.random.default_rng(6).standard_normal((b, kv_heads * (g + 2), H)) * 2.0, dtype)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, H, 2) / H)).astype(np.float32)
    freqs = jnp.asarray(NEW_LENGTHS - 1, jnp.float32)[:, None] * inv_freq
    rope = (jnp.cos(freqs), jnp.sin(freqs))
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    tuning = da.DecodeTuning(block_k=16, k_splits=k_splits, heads_per_program=heads_per_program)
    args = [jnp.asarray(a) for a in (k, v, NEW_LENGTHS)]
    fused = jax.jit(functools.partial(da.decode_attention_qkv, layer=jnp.int32(1), impl=impl, tuning=tuning, **scales))
    got = fused(qkv, *args, rope)
    q, new_kv = da.split_qkv(qkv, kv_heads, rope)
    # split_qkv rotates as the model does
    positions = jnp.asarray(NEW_LENGTHS - 1)[:, None]
    rotated = apply_rope(qkv[:, None, : kv_heads * g], positions, inv_freq)[:, 0]
    np.testing.assert_array_equal(np.asarray(q, np.float32).reshape(rotated.shape), np.asarray(rotated, np.float32))
    split = jax.jit(functools.partial(da.decode_attention, layer=jnp.int32(1), impl=impl, tuning=tuning, **scales))
    want = split(q, *args[:2], args[2], new_kv=new_kv)
    xla = jax.jit(functools.partial(da.decode_attention_qkv, layer=jnp.int32(1), impl="xla", **scales))(
        qkv, *args, rope)
    if impl == "pallas_interpret":  # the same jnp arithmetic: bit for bit
        for a, w in [*zip(got, want, strict=True), *zip(got[1:], xla[1:], strict=True)]:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32))
        return
    # compiled, Triton and XLA may contract the rotation's products into FMAs differently: a last-bit difference in
    # f32 that can move a rounded value by one step, rarely
    tol = TOL[kind]
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=tol, atol=tol)
    for a, w in [*zip(got[1:], want[1:], strict=True), *zip(got[1:], xla[1:], strict=True)]:
        assert np.mean(np.asarray(a, np.float32) != np.asarray(w, np.float32)) < 1e-3


def test_fused_projection_bad_shapes_name_the_key():
    k = jnp.zeros((B, K, S, H), jnp.bfloat16)
    rope = (jnp.zeros((B, H // 2)), jnp.zeros((B, H // 2)))
    with pytest.raises(ValueError, match="qkv must be the fused projection"):
        da.decode_attention_qkv(jnp.zeros((B, 2 * K + 1, H), jnp.bfloat16), k, k, jnp.asarray(LENGTHS), rope,
                                impl="pallas_interpret")
    with pytest.raises(ValueError, match="rope must be"):
        da.decode_attention_qkv(jnp.zeros((B, 4 * K, H), jnp.bfloat16), k, k, jnp.asarray(LENGTHS), rope[:1],
                                impl="pallas_interpret")


def test_new_kv_bad_shape_names_the_key():
    q, k, v, *_ = _inputs("f32", 2)
    bad = jnp.zeros((B, K, H + 1), jnp.float32)
    with pytest.raises(ValueError, match="new_kv k must be"):
        da.decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(LENGTHS), new_kv=(bad, bad),
                            impl="pallas_interpret")


def test_heads_per_program_default_hand_derived():
    """Two kv heads a program over an FP8 cache at batch 256 (B*K = 2048: 1024 programs, no splits), one otherwise:
    batch 64, a BF16 cache, an odd K, 2G rows past the 16-row tile; a tuning's ``heads_per_program`` wins."""
    assert da.default_heads_per_program(256 * 8, 8, 4, 1) == 2
    assert da.default_heads_per_program(64 * 8, 8, 4, 1) == 1
    assert da.default_heads_per_program(256 * 8, 8, 4, 2) == 1
    assert da.default_heads_per_program(256 * 7, 7, 4, 1) == 1
    assert da.default_heads_per_program(256 * 4, 4, 16, 1) == 1
    # target_programs 512: batch 128 at K=8 qualifies
    assert da.default_heads_per_program(128 * 8, 8, 4, 1, target_programs=512) == 2
    # through a tuning (rows, K, G, H, itemsize, S): the rule, its target, or the tuning's own count
    assert da.DecodeTuning().resolved(256 * 8, 8, 4, 64, 1, 1088).heads_per_program == 2
    assert da.DecodeTuning().resolved(128 * 8, 8, 4, 64, 1, 1088).heads_per_program == 1
    assert da.DecodeTuning(target_programs=512).resolved(128 * 8, 8, 4, 64, 1, 1088).heads_per_program == 2
    assert da.DecodeTuning(heads_per_program=1).resolved(256 * 8, 8, 4, 64, 1, 1088).heads_per_program == 1


def test_defaults_hand_derived():
    # 16 KiB of K per block, at most 64 positions: 16384 / (128 * 2) = 64; FP8 and H=64 give 128 or more, capped
    default = da.DecodeTuning()
    assert (default.max_block_k, default.target_programs, default.num_stages, default.num_warps) == (64, 1024, 3, 4)
    assert (default.heads_per_program, default.block_k, default.k_splits, default.dot_dtype) == (None,) * 4
    assert default == da.DEFAULT_TUNING
    assert da.default_block_k(128, 2, 1088) == 64
    assert da.default_block_k(128, 1, 1088) == 64
    assert da.default_block_k(64, 2, 4160) == 64
    assert da.default_block_k(64, 1, 4160) == 64
    assert da.default_block_k(16, 4, 26) == 32  # no bigger than the cache rounded up to a power of two
    # several kv heads per program: 16 KiB of K over all of them
    assert da.default_block_k(128, 1, 1088, heads_per_program=4) == 32
    assert da.default_block_k(64, 1, 1088, heads_per_program=2) == 64
    assert da.default_block_k(128, 2, 1088, heads_per_program=8) == 16
    # ~1024 programs: 2048 rows need 1 split, 512 rows 2, 8 rows 16 (the cap), unless the cache has fewer blocks;
    # a cache of 32 blocks or more gets 2 at least
    assert da.default_k_splits(2048, 1088, 64) == 1
    assert da.default_k_splits(2048, 4160, 64) == 2
    assert da.default_k_splits(512, 1088, 64) == 2
    assert da.default_k_splits(8, 1088, 64) == 16
    assert da.default_k_splits(8, 40, 16) == 3
    # the earlier defaults, as bench rollout --decode_tuning 128:2048:2 builds them
    assert (da.default_block_k(64, 1, 1088, max_block_k=128), da.default_k_splits(512, 1088, 128, 2048)) == (128, 4)
    earlier = da.DecodeTuning(max_block_k=128, target_programs=2048, num_stages=2).resolved(512, 8, 4, 64, 1, 1088)
    assert (earlier.block_k, earlier.k_splits, earlier.heads_per_program, earlier.num_stages) == (128, 4, 1, 2)
    # the rules on the default tuning: one split of 64 positions at batch 256 (two heads a program over FP8)
    resolved = default.resolved(256 * 8, 8, 4, 64, 1, 1088)
    assert (resolved.block_k, resolved.k_splits, resolved.heads_per_program) == (64, 1, 2)
    assert default.resolved(64 * 8, 8, 4, 64, 2, 1088).k_splits == 2
    # what a tuning fixes stays as it is
    fixed = da.DecodeTuning(block_k=16, k_splits=3, heads_per_program=4).resolved(256 * 8, 8, 4, 64, 1, 1088)
    assert (fixed.block_k, fixed.k_splits, fixed.heads_per_program) == (16, 3, 4)
    # F16 dot operands for a BF16 query over an FP8 cache only
    assert da.default_dot_dtype(jnp.bfloat16, jnp.float8_e4m3fn) == jnp.float16
    assert da.default_dot_dtype(jnp.float32, jnp.float8_e4m3fn) == jnp.float32
    assert da.default_dot_dtype(jnp.bfloat16, jnp.bfloat16) == jnp.bfloat16


def test_bad_options_name_the_key():
    from fp8rl_jax.rollout.engine import EngineConfig

    with pytest.raises(ValueError, match="decode_attention='cuda'"):
        EngineConfig(decode_attention="cuda")
    with pytest.raises(ValueError, match="decode_attention='fast'"):
        da.resolve_impl("fast")
    on_gpu = jax.default_backend() == "gpu"
    assert da.resolve_impl("auto") == ("pallas" if on_gpu else "xla")
    if not on_gpu:
        q, k, v, *_ = _inputs("bf16", 4)
        with pytest.raises(ValueError, match="needs a GPU backend"):
            da.decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(LENGTHS), impl="pallas")


@pytest.mark.parametrize("field,bad", [
    ("max_block_k", 48), ("max_block_k", 8), ("block_k", 24), ("block_k", 8), ("target_programs", 0),
    ("num_stages", 0), ("num_warps", 3), ("heads_per_program", 0), ("k_splits", 0), ("k_splits", True),
    ("dot_dtype", "int8"), ("dot_dtype", "float8_e4m3fn"), ("tail_loop", 1)])
def test_tuning_fields_are_validated(field, bad):
    """Each ``DecodeTuning`` field refuses what the kernel cannot launch, naming the field and the value."""
    with pytest.raises(ValueError, match=f"DecodeTuning {field}={bad!r} must be"):
        da.DecodeTuning(**{field: bad})


def test_tuning_is_a_hashable_value():
    """Frozen and hashable (a static argument, a compile cache key): equal fields make equal, equally hashed values,
    whichever way the dot dtype is spelled; none can be set after construction."""
    a = da.DecodeTuning(block_k=32, dot_dtype=jnp.float16)
    b = da.DecodeTuning(block_k=32, dot_dtype="float16")
    assert a == b and hash(a) == hash(b) and a.dot_dtype == "float16"
    assert a != da.DecodeTuning(block_k=64, dot_dtype="float16")
    assert len({da.DecodeTuning(), da.DEFAULT_TUNING, da.DecodeTuning(num_stages=2)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.block_k = 64
    with pytest.raises(TypeError, match="tuning must be a DecodeTuning"):
        da.decode_attention(jnp.zeros((B, K, 2, H)), jnp.zeros((B, K, S, H)), jnp.zeros((B, K, S, H)),
                            jnp.asarray(LENGTHS), impl="pallas_interpret", tuning={"block_k": 16})


def _pallas_calls(jaxpr):
    """The pallas_call equations of ``jaxpr`` and of every jaxpr inside it (scans, loops, jitted calls)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _pallas_calls(inner)


def _launches(fn, *args) -> list[tuple]:
    """(grid, num_warps, num_stages) of each decode attention kernel ``fn(*args)`` traces to."""
    calls = _pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)
    return [(e.params["grid_mapping"].grid, e.params["compiler_params"].num_warps,
             e.params["compiler_params"].num_stages) for e in calls if e.params["name"] == "decode_attention"]


def test_tuning_is_part_of_the_compiled_program():
    """Two tunings, two programs: as a static argument the tuning is in jit's cache key (an equal one hits the cache),
    each program launches the kernel as its tuning says (grid, warps, stages), and both attend alike."""
    q, k, v, k_scale, v_scale, q64, k64, v64 = _inputs("fp8", 4)
    args = [jnp.asarray(a) for a in (q, k, v, LENGTHS)]
    one = da.DecodeTuning(block_k=16, k_splits=1, num_stages=2)
    three = da.DecodeTuning(block_k=16, k_splits=3, num_warps=8)
    attend = jax.jit(functools.partial(da.decode_attention, k_scale=k_scale, v_scale=v_scale, impl="pallas_interpret"),
                     static_argnames=("tuning",))
    outs = [np.asarray(attend(*args, tuning=t), np.float64) for t in (one, three, dataclasses.replace(one))]
    assert attend._cache_size() == 2
    want = _reference(q64, k64, v64, LENGTHS)
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=TOL["fp8"], atol=TOL["fp8"])
    np.testing.assert_array_equal(outs[2], outs[0])
    launch = lambda t: _launches(functools.partial(attend, tuning=t), *args)  # noqa: E731
    assert launch(one) == [((B * K, 1), 4, 2)] and launch(three) == [((B * K, 3), 8, 3)]
    # the rules under other parameters: target_programs 64 over 8 (sequence, kv head) rows -> 8 splits, capped by
    # the cache's 3 blocks of 16
    assert launch(da.DecodeTuning(max_block_k=16, target_programs=64)) == [((B * K, 3), 4, 3)]


# ----------------------------------------------------------------------------------------------------------
# the engine


def _tiny():
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.config import preset

    config = preset("tiny")
    return config, llama.init_params(config, jax.random.PRNGKey(0), std=0.1)


def _kv_scales(config, params, tokens):
    from fp8rl_jax.fp8 import kv as kvq
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.model import llama

    return kvq.scales_from_amax(llama.forward(params, tokens, config=config, precision=Precision())[2])


def test_greedy_rollout_same_tokens_with_kernel_and_xla():
    """The engine on the tiny preset, greedy, f32 compute with an FP8 KV cache: the kernel (interpreted) gives
    the XLA path's tokens, and logprobs within 1e-5. (In BF16 the two paths round differently and this random
    model's near-flat logits have near-ties, so tokens may flip: see the teacher-forced test below.)"""
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.rollout import driver
    from fp8rl_jax.rollout.engine import Engine, EngineConfig
    from fp8rl_jax.rollout.sampling import SamplingParams

    config, params = _tiny()
    prompts = [list(np.random.RandomState(i).randint(3, config.vocab_size, size=n)) for i, n in enumerate((5, 9, 3))]
    precision = Precision(compute_dtype="float32", kv_cache_dtype="float8_e4m3fn")
    kv_scales = _kv_scales(config, params, jnp.asarray([p[:3] for p in prompts], jnp.int32))
    batches = {}
    for impl in ("xla", "pallas_interpret"):
        engine = Engine(config, precision, EngineConfig(
            max_concurrent_decodes=4, max_prefill_length=16, max_new_tokens=8, sampling=SamplingParams(greedy=True),
            decode_attention=impl))
        engine_params = engine.load_params(params, None, kv_scales)
        batches[impl] = driver.generate(engine, engine_params, prompts, 1, jax.random.PRNGKey(1), steps_per_sync=4)
    xla, kernel = batches["xla"], batches["pallas_interpret"]
    np.testing.assert_array_equal(kernel.lengths, xla.lengths)
    np.testing.assert_array_equal(kernel.tokens, xla.tokens)
    for i in range(len(prompts)):
        n = xla.lengths[i]
        np.testing.assert_allclose(kernel.logprobs[i, :n], xla.logprobs[i, :n], rtol=0, atol=1e-5)


def test_engine_carries_its_decode_tuning():
    """``EngineConfig.decode_tuning`` reaches every decode kernel of the engine's decode step (each layer's launch is
    the tuning's), and an engine of another tuning compiles another program; a tuning that is not a DecodeTuning is
    refused."""
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.rollout.engine import Engine, EngineConfig

    config, params = _tiny()
    launches = {}
    for tuning in (da.DecodeTuning(), da.DecodeTuning(block_k=16, k_splits=2, num_warps=2, num_stages=1)):
        engine = Engine(config, Precision(), EngineConfig(max_concurrent_decodes=4, max_prefill_length=16,
                                                          max_new_tokens=8, decode_attention="pallas_interpret",
                                                          decode_tuning=tuning))
        assert engine.config.decode_tuning is tuning
        p = engine.load_params(params, None, None)
        launches[tuning] = _launches(engine._generate_impl, p, engine.init_decode_state())
        assert len(launches[tuning]) == config.num_layers
    default, tuned = launches.values()
    programs = config.num_kv_heads * 4  # one kv head a program over a BF16 cache
    assert set(default) == {((programs, 1), 4, 3)}  # 24 positions: one block of 32, one split
    assert set(tuned) == {((programs, 2), 2, 1)}
    assert EngineConfig() != EngineConfig(decode_tuning=da.DecodeTuning(num_stages=2))
    with pytest.raises(ValueError, match="EngineConfig.decode_tuning=.* must be a DecodeTuning"):
        EngineConfig(decode_tuning={"k_splits": 2})


def _decode_logprobs(config, params, precision, seqs, prompt_len, impl, kv_scales=None):
    """Prefill ``prompt_len`` tokens, then decode the rest of ``seqs`` one token a step (teacher forced):
    log-softmax of the logits that predict tokens prompt_len..T-1, [B, T - prompt_len, V]."""
    from fp8rl_jax.model import kv_cache, llama

    b, t = seqs.shape
    kw = dict(config=config, precision=precision, kv_scales=kv_scales, decode_attention=impl)

    @jax.jit
    def run(seqs):
        cache = kv_cache.init_cache(config, b, t, kv_cache.cache_dtype(precision))
        positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (b, prompt_len))
        logits, cache, _ = llama.forward(params, seqs[:, :prompt_len], positions, cache=cache, **kw)
        steps = [logits[:, -1]]
        for pos in range(prompt_len, t - 1):
            logits, cache, _ = llama.forward(params, seqs[:, pos : pos + 1], jnp.full((b, 1), pos, jnp.int32),
                                             cache=cache, **kw)
            steps.append(logits[:, 0])
        return jax.nn.log_softmax(jnp.stack(steps, axis=1), axis=-1)

    return np.asarray(run(seqs))


def test_teacher_forced_decode_against_full_forward():
    """Decode steps through the kernel against the full-sequence forward (the scoring path).

    f32 compute (BF16 or FP8 cache): max |decode - full| <= 1e-5 in every logprob. BF16 compute: both decode
    paths are compared with the f32 forward; the kernel's mean error may not exceed the XLA path's by more
    than 10%, its max by more than 50% (measured: mean 5.2e-3 vs 5.3e-3, max 3.0e-2 vs 3.1e-2).
    """
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.model import llama

    config, params = _tiny()
    prompt_len, seqs = 7, jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (3, 13)), jnp.int32)
    kv_scales = _kv_scales(config, params, seqs)

    def full(precision):
        logits = llama.forward(params, seqs, config=config, precision=precision, kv_scales=kv_scales)[0]
        return np.asarray(jax.nn.log_softmax(logits, axis=-1))[:, prompt_len - 1 : -1]

    for kv_dtype in ("float32", "float8_e4m3fn"):
        precision = Precision(compute_dtype="float32", kv_cache_dtype=kv_dtype)
        got = _decode_logprobs(config, params, precision, seqs, prompt_len, "pallas_interpret", kv_scales)
        np.testing.assert_allclose(got, full(precision), rtol=0, atol=1e-5)

    truth = full(Precision(compute_dtype="float32"))
    bf16 = Precision()
    kernel = np.abs(_decode_logprobs(config, params, bf16, seqs, prompt_len, "pallas_interpret") - truth)
    xla = np.abs(_decode_logprobs(config, params, bf16, seqs, prompt_len, "xla") - truth)
    print(f"BF16 decode vs f32 forward: kernel mean {kernel.mean():.2e} max {kernel.max():.2e}; "
          f"xla mean {xla.mean():.2e} max {xla.max():.2e}")
    assert kernel.mean() <= 1.1 * xla.mean() and kernel.max() <= 1.5 * xla.max()


# ----------------------------------------------------------------------------------------------------------
# the GPU lowering, checked on CPU: Pallas lowers the kernel to Triton IR without a GPU


@pytest.mark.parametrize("cache_dtype,q_dtype", [("float8_e4m3fn", "bfloat16"), ("bfloat16", "bfloat16"),
                                                 ("float32", "float32"), ("float8_e4m3fn", "float32")])
def test_kernel_lowers_to_triton(cache_dtype, q_dtype, triton_ir):
    """Llama-3.2-1B shapes (K=8, G=4, H=64): the kernel lowers; FP8 is converted in-kernel (no BF16 cache)."""
    q = jax.ShapeDtypeStruct((8, 8, 4, 64), jnp.dtype(q_dtype))
    cache = jax.ShapeDtypeStruct((16, 8, 8, 1088, 64), jnp.dtype(cache_dtype))
    fn = functools.partial(da.decode_attention_pallas, k_scale=jnp.float32(2.0), v_scale=jnp.float32(3.0))
    [ttir] = triton_ir(lambda q, k, v, n, i: fn(q, k, v, n, layer=i), q, cache, cache,
                        jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    assert "tt.dot" in ttir and "scf.for" in ttir
    if cache_dtype == "float8_e4m3fn":
        assert "tt.fp_to_fp" in ttir and "f8E4M3FN" in ttir


def test_fp8_output_and_per_layer_scales_lower_to_triton(triton_ir):
    """Llama-3.2-1B shapes, FP8 cache, the scales of all layers [L] and an FP8 output: the kernel lowers, reads the
    scales at the layer index and stores E4M3 values."""
    q = jax.ShapeDtypeStruct((8, 8, 4, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((16, 8, 8, 1088, 64), jnp.float8_e4m3fn)
    scales = jax.ShapeDtypeStruct((16,), jnp.float32)
    fn = functools.partial(da.decode_attention_pallas, out_dtype=jnp.float8_e4m3fn, tuning=da.DecodeTuning(k_splits=1))
    [ttir] = triton_ir(lambda q, k, v, n, i, ks, vs, s: fn(q, k, v, n, layer=i, k_scale=ks, v_scale=vs, out_scale=s),
                        q, cache, cache, jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
                        scales, scales, jax.ShapeDtypeStruct((), jnp.float32))
    stores = [line for line in ttir.splitlines() if "tt.store" in line]
    assert any("f8E4M3FN" in line for line in stores), stores


def test_tiles_output_lowers_to_triton(triton_ir):
    """Llama-3.2-1B shapes, one split: the kernel lowers with the output's tiles (E4M3 values, f32 inverse scales
    [N H / 128, B] stored from the program) and makes them itself."""
    q = jax.ShapeDtypeStruct((8, 8, 4, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((16, 8, 8, 1088, 64), jnp.float8_e4m3fn)
    scales = jax.ShapeDtypeStruct((16,), jnp.float32)
    fn = functools.partial(da.decode_attention_pallas, out_tiles=jnp.float8_e4m3fn, tuning=da.DecodeTuning(k_splits=1))
    [ttir] = triton_ir(lambda q, k, v, n, i, ks, vs: fn(q, k, v, n, layer=i, k_scale=ks, v_scale=vs),
                        q, cache, cache, jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
                        scales, scales)
    stores = [line for line in ttir.splitlines() if "tt.store" in line]
    assert any("f8E4M3FN" in line for line in stores) and len(stores) == 2, stores


@pytest.mark.parametrize("cache_dtype,q_dtype", [("float8_e4m3fn", "bfloat16"), ("bfloat16", "bfloat16")])
def test_packed_heads_kernel_lowers_to_triton(cache_dtype, q_dtype, triton_ir):
    """Llama-3.2-1B shapes with 4 kv heads per program (16 query rows): one loop, 4 QK and 4 PV dots in it."""
    q = jax.ShapeDtypeStruct((8, 8, 4, 64), jnp.dtype(q_dtype))
    cache = jax.ShapeDtypeStruct((16, 8, 8, 1088, 64), jnp.dtype(cache_dtype))
    fn = functools.partial(da.decode_attention_pallas, k_scale=jnp.float32(2.0), v_scale=jnp.float32(3.0),
                           tuning=da.DecodeTuning(heads_per_program=4))
    [ttir] = triton_ir(lambda q, k, v, n, i: fn(q, k, v, n, layer=i), q, cache, cache,
                        jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    # one loop, every block masked (``tail_loop`` off by default)
    assert ttir.count("scf.for") == 1 and ttir.count("tt.dot") == 8


def test_new_kv_lowers_to_triton(triton_ir):
    """Llama-3.2-1B, batch 256, 1088 positions, FP8 caches written by the kernel (``new_kv``): it lowers, stores E4M3
    values into the caches with 64-bit offsets (a 2.3e9-byte cache) and quantizes the BF16 inputs."""
    q = jax.ShapeDtypeStruct((256, 8, 4, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((16, 256, 8, 1088, 64), jnp.float8_e4m3fn)
    new = jax.ShapeDtypeStruct((256, 8, 64), jnp.bfloat16)
    fn = functools.partial(da.decode_attention_pallas, k_scale=jnp.float32(2.0), v_scale=jnp.float32(3.0),
                           tuning=da.DecodeTuning(heads_per_program=1))
    [ttir] = triton_ir(lambda q, k, v, n, i, nk, nv: fn(q, k, v, n, layer=i, new_kv=(nk, nv)), q, cache, cache,
                        jax.ShapeDtypeStruct((256,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32), new, new)
    stores = [line for line in ttir.splitlines() if "tt.store" in line and "f8E4M3FN" in line]
    assert len(stores) == 2, stores  # K and V
    cache_offsets = [line for line in ttir.splitlines() if "tt.addptr" in line and "f8E4M3FN" in line]
    assert cache_offsets and all("xi64>" in line for line in cache_offsets), cache_offsets


@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_fused_projection_lowers_to_triton(heads_per_program, triton_ir):
    """Llama-3.2-1B, batch 256, the fused projection with RoPE (``decode_attention_qkv``): the kernel lowers (the
    rotation's split, stack and transpose included) and stores the rotated, quantized K and V into the caches."""
    qkv = jax.ShapeDtypeStruct((256, 48, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((16, 256, 8, 1088, 64), jnp.float8_e4m3fn)
    half = jax.ShapeDtypeStruct((256, 32), jnp.float32)
    fn = functools.partial(da.decode_attention_pallas, k_scale=jnp.float32(2.0), v_scale=jnp.float32(3.0),
                           tuning=da.DecodeTuning(heads_per_program=heads_per_program))
    [ttir] = triton_ir(lambda x, k, v, n, i, c, s: fn(x, k, v, n, layer=i, rope=(c, s)), qkv, cache, cache,
                        jax.ShapeDtypeStruct((256,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32), half, half)
    stores = [line for line in ttir.splitlines() if "tt.store" in line and "f8E4M3FN" in line]
    assert len(stores) == 2 * heads_per_program, stores
    assert "tt.split" in ttir and "tt.join" in ttir and "tt.dot" in ttir


def test_lean_loop_lowers_to_triton(triton_ir):
    """Llama-3.2-1B, batch 256, FP8 cache: the block loop takes exp2 of log2-unit scores (no ``__nv_expf``) and loads
    V's masked rows as zeros (``tt.load`` with an ``other`` operand, no select on the converted tile)."""
    cache = jax.ShapeDtypeStruct((16, 256, 8, 1088, 64), jnp.float8_e4m3fn)
    fn = functools.partial(da.decode_attention_pallas, k_scale=jnp.float32(2.0), v_scale=jnp.float32(3.0))
    q = jax.ShapeDtypeStruct((256, 8, 4, 64), jnp.bfloat16)
    [ttir] = triton_ir(lambda q, k, v, n, i: fn(q, k, v, n, layer=i), q, cache, cache,
                       jax.ShapeDtypeStruct((256,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    assert "__nv_exp2f" in ttir and "__nv_expf" not in ttir
    # the masked V block: tt.load ptr, mask, other
    v_loads = [line for line in ttir.splitlines() if "tt.load" in line and "tensor<64x64x!tt.ptr<f8E4M3FN>>" in line]
    assert any(line.split("tt.load")[1].count("%") == 3 for line in v_loads), v_loads


def test_large_fp8_cache_gets_64_bit_offsets(triton_ir):
    """Llama-3.2-1B, batch 256, 1088 positions: one FP8 K cache of 2.3e9 bytes (> 2**31 elements, < 4 GiB), for
    which Pallas would compute 32-bit element offsets that wrap; its pointer offsets must be 64-bit."""
    q = jax.ShapeDtypeStruct((256, 8, 4, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((16, 256, 8, 1088, 64), jnp.float8_e4m3fn)
    assert 2**31 < np.prod(cache.shape) <= 2**32
    fn = functools.partial(da.decode_attention_pallas, k_scale=jnp.float32(2.0), v_scale=jnp.float32(3.0))
    [ttir] = triton_ir(lambda q, k, v, n, i: fn(q, k, v, n, layer=i), q, cache, cache,
                        jax.ShapeDtypeStruct((256,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    cache_offsets = [line for line in ttir.splitlines() if "tt.addptr" in line and "f8E4M3FN" in line]
    assert cache_offsets and all("xi64>" in line for line in cache_offsets), cache_offsets


# ----------------------------------------------------------------------------------------------------------
# on the GPU host: the compiled kernel


@pytest.mark.gpu
@pytest.mark.parametrize("kind,g,block_k,k_splits", CASES)
def test_gpu_kernel_matches_float64_reference(kind, g, block_k, k_splits):
    q, k, v, k_scale, v_scale, q64, k64, v64 = _inputs(kind, g)
    got = _attend("pallas", q, k, v, LENGTHS, k_scale, v_scale, block_k=block_k, k_splits=k_splits,
                  dot_dtype="bfloat16" if kind == "fp8_bf16dot" else None)
    np.testing.assert_allclose(got, _reference(q64, k64, v64, LENGTHS), rtol=TOL[kind], atol=TOL[kind])


@pytest.mark.gpu
@pytest.mark.parametrize("k_splits", [1, 2])
def test_gpu_fp8_output_is_the_next_linear_quantization(k_splits):
    """On the GPU the kernel's E4M3 output (one split: written by the kernel) is bit for bit ``recipe.quantize``
    of its BF16 output, with per-layer scales read at the layer index."""
    from fp8rl_jax.fp8.recipe import quantize

    q, k, v, k_scale, v_scale, *_ = _inputs("fp8", 4, layers=2)
    args = [jnp.asarray(a) for a in (q, k, v, LENGTHS)]
    scales = dict(k_scale=jnp.asarray([1.0, k_scale], jnp.float32), v_scale=jnp.asarray([1.0, v_scale], jnp.float32))
    run = functools.partial(da.decode_attention, layer=jnp.int32(1), impl="pallas",
                            tuning=da.DecodeTuning(block_k=16, k_splits=k_splits), **scales)
    out_scale = jnp.float32(448.0 / 3.0)
    plain = jax.jit(run)(*args)
    got = jax.jit(functools.partial(run, out_scale=out_scale, out_dtype=jnp.float8_e4m3fn))(*args)
    want = quantize(plain, out_scale, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("g,heads_per_program,k_splits", [(8, 1, 1), (8, 2, 1), (4, 1, 1), (8, 1, 2)])
def test_gpu_tiles_output_is_the_next_linears_tiles(g, heads_per_program, k_splits):
    """On the GPU the output's tiles, the kernel's (one split, whole tiles a program) or XLA's after it, are bit
    for bit ``block.tile_quantize`` of its BF16 output (Triton's division gives XLA's quotients), with per-layer
    scales read at the layer index."""
    got, plain = _tiles_case("pallas", g, heads_per_program, k_splits, seed=2, layers=2)
    _assert_tiles_of(got, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,g,heads_per_program,block_k,k_splits", NEW_CASES)
def test_gpu_new_token_written_by_the_kernel(kind, g, heads_per_program, block_k, k_splits):
    """``new_kv`` on the GPU: the compiled kernel's stores equal ``write_new``'s scatter bit for bit."""
    _check_new_token("pallas", kind, g, heads_per_program, block_k, k_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,g,heads_per_program,k_splits", [("fp8", 4, 1, 1), ("fp8", 2, 2, 3), ("bf16", 4, 1, 2)])
def test_gpu_fused_projection_is_split_then_attended(kind, g, heads_per_program, k_splits):
    """``decode_attention_qkv`` on the GPU: the compiled kernel's output and stores against the split form's (XLA's
    rotation) and the XLA impl's."""
    _check_fused("pallas", kind, g, heads_per_program, k_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_gpu_decode_step_writes_the_cache_in_place(kv_dtype):
    """The engine's decode loop (tiny preset, 4 steps): the kernel's aliased caches are the loop's own buffers, so
    the compiled program copies no layer of the cache (a copy would read and write the whole layer each step)."""
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.rollout.engine import Engine, EngineConfig

    config, params = _tiny()
    precision = Precision(kv_cache_dtype=kv_dtype)
    kv_scales = _kv_scales(config, params, jnp.ones((1, 4), jnp.int32)) if kv_dtype != "bfloat16" else None
    engine = Engine(config, precision, EngineConfig(max_concurrent_decodes=8, max_prefill_length=16,
                                                    max_new_tokens=48))
    p = engine.load_params(params, None, kv_scales)
    state = engine.init_decode_state()
    hlo = engine._generate_steps.lower(p, state, 4).compile().as_text()
    layer = f"[8,{config.num_kv_heads},{engine.config.max_cache_length},{config.head_dim}]"
    assert "decode_attention" in hlo
    copies = [line for line in hlo.splitlines() if layer in line and ("copy(" in line or "copy-start" in line)]
    assert not copies, copies[:3]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["xla", pytest.param("te", marks=pytest.mark.te)])
def test_gpu_decode_step_adds_the_residual_in_its_fp8_gemms(backend):
    """The engine's decode loop over FP8 weights (``precision.residual_in_gemm``, the default): wo and w_down are
    cuBLASLt FP8 GEMMs that read the residual stream as their C operand (beta 1), none falls back to a wider GEMM;
    with the option off, none reads a C operand (the xla backend's four FP8 GEMMs a block, te's TE calls)."""
    import re

    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.model import llama
    from fp8rl_jax.rollout.engine import Engine, EngineConfig

    config, params = _tiny()
    counts = {}
    for into in (True, False):
        precision = Precision(backend=backend, kv_cache_dtype="float8_e4m3fn", residual_in_gemm=into)
        kv_scales = _kv_scales(config, params, jnp.ones((1, 4), jnp.int32))
        engine = Engine(config, precision, EngineConfig(max_concurrent_decodes=8, max_prefill_length=16,
                                                        max_new_tokens=48))
        p = engine.load_params(params, llama.init_fp8_state(config, precision), kv_scales)
        hlo = engine._generate_steps.lower(p, engine.init_decode_state(), 4).compile().as_text()
        f8 = [line for line in hlo.splitlines() if 'custom_call_target="__cublas$lt$matmul$f8"' in line]
        counts[into] = (len(f8), sum(bool(re.search(r'"beta":1(\.0)?[,}]', line)) for line in f8))
    print(backend, "FP8 GEMMs (all, with C):", counts)
    (f8_on, c_on), (f8_off, c_off) = counts[True], counts[False]
    assert c_off == 0 and c_on > 0 and c_on % 2 == 0
    if backend == "xla":  # the same four FP8 GEMMs a block either way (none fell back to a wider one), two with C
        assert f8_on == f8_off == 2 * c_on
    else:  # TE's qkv and gate_up (TE custom calls) either way; wo and w_down XLA's FP8 GEMMs with C, or TE's
        assert f8_off == 0 and f8_on == c_on


@pytest.mark.gpu
def test_gpu_large_fp8_cache_last_layer():
    """Llama-3.2-1B, batch 256, 1088 positions, FP8: a K cache of 2.3 GB (the 64-bit offset case); the last
    layer's rows at the end of the buffer against the XLA path, default tuning."""
    shape = (16, 256, 8, 1088, 64)
    key_k, key_v, key_q = jax.random.split(jax.random.PRNGKey(0), 3)
    scale = jnp.float32(448.0 / 5.0)

    def cache(key):  # one random layer, repeated; the last layer differs
        one = (jax.random.normal(key, shape[1:], jnp.bfloat16) * scale).astype(jnp.float8_e4m3fn)
        stack = jnp.broadcast_to(one[None], shape)
        return stack.at[-1].set((-stack[-1].astype(jnp.float32)).astype(jnp.float8_e4m3fn))

    k_cache, v_cache = jax.jit(cache)(key_k), jax.jit(cache)(key_v)
    q = jax.random.normal(key_q, (256, 8, 4, 64), jnp.bfloat16)
    lengths = jnp.asarray(np.random.default_rng(0).integers(1, 1089, 256), jnp.int32)
    args = dict(layer=jnp.int32(15), k_scale=scale, v_scale=scale)
    got = jax.jit(functools.partial(da.decode_attention, impl="pallas", **args))(q, k_cache, v_cache, lengths)
    want = jax.jit(functools.partial(da.decode_attention, impl="xla", **args))(q, k_cache, v_cache, lengths)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_benchmark_script_runs_interpreted(tmp_path, benchmark_script):
    """benchmarks/decode_attention.py end to end on the tiny shape (kernel interpreted): rows with timings, and the
    kernel's output on the benchmark's data within BF16 rounding of the model's path."""
    import json

    bench = benchmark_script("decode_attention")
    out = tmp_path / "bench.json"
    bench.main(["--interpret", "--out", str(out), "--fill", "0.5", "--kv", "fp8", "--repeats", "1", "--warmup", "0"])
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"xla", "pallas", "scatter_only"}
    assert all(r["us_per_layer"] > 0 for r in rows)
    assert [r["max_abs_diff_vs_xla"] for r in rows if r["impl"] == "pallas"][0] <= 2e-2
