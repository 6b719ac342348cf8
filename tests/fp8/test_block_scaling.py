"""Block-scaled FP8 (``precision.scaling='block'``) against a numpy / ml_dtypes reference written here.

The reference quantizes tile by tile in Python loops (f32 arithmetic, ml_dtypes' round-to-nearest-even cast) and
sums the scaled GEMMs in float64, where the sums are exact: a product of two FP8 values has at most 8 significant
bits between 2**-18 and 2**18 (E4M3; E5M2 x E4M3 stays inside 53 bits too), and 128 of them add up within float64's
53. The quantized values and scales must match bit for bit. The emulated GEMM (f32 sums inside each 128-wide slice
of the contraction axis, in the dot's own order, then across slices in order) must be within the rounding bound of
f32 summation: |y - y_exact| <= (128 + slices + 3) * 2**-24 * sum over slices of |qa| . |qb| * |scale_a scale_b|.

The tile width is ``block.BLOCK`` (128), read at call time; the quantizers and the linear are checked at 32 too
(``width``), the finer groups ``benchmarks/fidelity_floor.py`` makes by patching it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax import config as config_lib
from fp8rl_jax.errors import ConfigError
from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.model import kv_cache, llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.rollout.weights import rollout_params

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
T = 128
U = 2.0**-24
BLOCK = Fp8Recipe(scaling="block", fp8_format="e4m3")  # DeepSeek-V3's recipe: E4M3 forward and backward


# ----------------------------------------------------------------------------------------------------------
# the reference


def ref_scale(values: np.ndarray, dtype) -> np.float32:
    """fp8_max / amax in f32; 1 for an all-zero tile (what Transformer Engine's guard keeps for a fresh scale)."""
    a = np.float32(np.max(np.abs(values.astype(np.float32))))
    return np.float32(float(ml_dtypes.finfo(dtype).max)) / a if a > 0 else np.float32(1.0)


def ref_quantize(values: np.ndarray, scale: np.float32, dtype) -> np.ndarray:
    limit = np.float32(float(ml_dtypes.finfo(dtype).max))
    return np.clip(values.astype(np.float32) * scale, -limit, limit).astype(dtype)


def ref_tiles(a: np.ndarray, dtype, T=T):
    """1 x T tiles along the last axis of a [P, C]: (q [P, C], scale_inv [P, ceil(C/T)])."""
    p, c = a.shape
    q, inv = np.zeros((p, c), dtype), np.zeros((p, -(-c // T)), np.float32)
    for i in range(p):
        for j in range(inv.shape[1]):
            tile = a[i, j * T:(j + 1) * T]
            s = ref_scale(tile, dtype)
            q[i, j * T:(j + 1) * T] = ref_quantize(tile, s, dtype)
            inv[i, j] = np.float32(1.0) / s
    return q, inv


def ref_blocks(w: np.ndarray, dtype, T=T):
    """T x T blocks of w [R, C]: (q [R, C], scale_inv [ceil(R/T), ceil(C/T)])."""
    r, c = w.shape
    q, inv = np.zeros((r, c), dtype), np.zeros((-(-r // T), -(-c // T)), np.float32)
    for i in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            blk = w[i * T:(i + 1) * T, j * T:(j + 1) * T]
            s = ref_scale(blk, dtype)
            q[i * T:(i + 1) * T, j * T:(j + 1) * T] = ref_quantize(blk, s, dtype)
            inv[i, j] = np.float32(1.0) / s
    return q, inv


def ref_gemm(qa, sa, qb, sb, T=T):
    """sum_j (qa [P, C] . qb [Q, C]^T over slice j) * sa[:, j] sb[:, j], in float64 (exact sums), and the bound
    of f32 summation on it. sa [P, Cb], sb [Q, Cb] (a weight's block scales repeated per row)."""
    a, b = qa.astype(np.float64), qb.astype(np.float64)
    y, mag = 0.0, 0.0
    for j in range(sa.shape[1]):
        s = np.outer(sa[:, j].astype(np.float64), sb[:, j].astype(np.float64))
        y = y + (a[:, j * T:(j + 1) * T] @ b[:, j * T:(j + 1) * T].T) * s
        mag = mag + (np.abs(a[:, j * T:(j + 1) * T]) @ np.abs(b[:, j * T:(j + 1) * T]).T) * s
    return y, (T + sa.shape[1] + 3) * U * mag


def rows(block_inv: np.ndarray, n: int, T=T) -> np.ndarray:
    return np.repeat(block_inv, T, axis=0)[:n]


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _data(seed: int, shape, outliers: bool = True) -> np.ndarray:
    """Normal values with a few massive ones (an LLM's activations) and an all-zero tile."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=shape).astype(np.float32)
    if outliers:
        a.flat[rng.choice(a.size, 3, replace=False)] = [3000.0, -1200.0, 800.0]
    a[0, :T] = 0.0
    return a


WIDTHS = [128, 32]


@pytest.fixture
def width(request, monkeypatch):
    """The tile width (indirect parameter): ``block.BLOCK`` as shipped, or patched to 32 (read at trace time; the
    caches are cleared so that no trace made under another width is reused)."""
    monkeypatch.setattr(xla.block, "BLOCK", request.param)
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def tile_amax(q: np.ndarray, t: int) -> np.ndarray:
    """max |q| of each 1 x t tile along the last axis (the last one partial)."""
    q = q.astype(np.float32)
    q = np.pad(q, [(0, 0), (0, -q.shape[1] % t)])
    return np.abs(q).reshape(q.shape[0], -1, t).max(-1)


# ----------------------------------------------------------------------------------------------------------
# the quantizers


@pytest.mark.parametrize("width", WIDTHS, indirect=True)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_tile_quantize_matches_reference(dtype, width):
    a = _data(0, (37, 300))  # 300 = 2 tiles + a partial one (9 + a partial one at 32)
    q, inv = jax.jit(lambda x: xla.block.tile_quantize(x, jnp.dtype(dtype)))(a)
    rq, rinv = ref_tiles(a, dtype, width)
    np.testing.assert_array_equal(bits(q), bits(rq))
    np.testing.assert_array_equal(np.asarray(inv), rinv)
    assert inv.shape == (37, -(-300 // width)) and float(inv[0, 0]) == 1.0  # the all-zero tile keeps scale 1
    top = tile_amax(np.asarray(q), width)  # each tile's amax lands on the format's max exactly
    assert (top[1:] == float(ml_dtypes.finfo(dtype).max)).all() and (top[0, : 128 // width] == 0).all()


@pytest.mark.parametrize("width", WIDTHS, indirect=True)
def test_block_quantize_matches_reference_and_its_transpose(width):
    w = _data(1, (200, 300))
    q, inv = jax.jit(lambda x: xla.block.block_quantize(x, jnp.float8_e4m3fn))(w)
    rq, rinv = ref_blocks(w, E4M3, width)
    np.testing.assert_array_equal(bits(q), bits(rq))
    np.testing.assert_array_equal(np.asarray(inv), rinv)
    assert inv.shape == (-(-200 // width), -(-300 // width))
    qt, invt = xla.block.block_quantize(jnp.asarray(w.T), jnp.float8_e4m3fn)  # a block is a block transposed
    np.testing.assert_array_equal(bits(qt), bits(rq.T))
    np.testing.assert_array_equal(np.asarray(invt), rinv.T)


# ----------------------------------------------------------------------------------------------------------
# the linear: forward, rollout, backward

M, K, N = 70, 300, 200  # none a multiple of 128: every axis has a partial last tile


@pytest.fixture(scope="module")
def operands():
    x = _data(2, (M, K))
    w = (0.05 * np.random.default_rng(3).normal(size=(K, N))).astype(np.float32)
    w[5, 7] = 4.0  # one large weight: its block's scale only
    g = _data(4, (M, N), outliers=False) * np.float32(1e-3)
    return x, w, g


def _call(recipe, x, w, g):
    state = init_linear_state(recipe)
    f = lambda x, w, s: xla.fp8_matmul(x, w, s, recipe, jnp.float32)
    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w), state)
    return (y, *vjp(jnp.asarray(g)))


@pytest.mark.parametrize("width", WIDTHS, indirect=True)
def test_forward_matches_reference(operands, width):
    x, w, g = operands
    y = np.asarray(jax.jit(lambda x, w: _call(BLOCK, x, w, g)[0])(x, w))
    qx, sx = ref_tiles(x, E4M3, width)
    qw, sw = ref_blocks(w.T, E4M3, width)  # [N, K], scales [Nb, Kb]
    ref, bound = ref_gemm(qx, sx, qw, rows(sw, N, width), width)
    err = np.abs(y - ref)
    assert (err <= bound).all(), float((err / bound).max())


def test_forward_keeps_what_a_per_tensor_scale_flushes(operands):
    """Relative rounding is E4M3's 3 mantissa bits under any scale while values stay in its normal range (2**-6 to
    448 of the scaled values): block scales gain only where a tensor spans more, as one massive activation 3e5 times
    the rest does (SmolLM2's ~3000 against ~0.01), which pushes the rest into E4M3's subnormals under one scale."""
    _, w, _ = operands
    x = (0.01 * np.random.default_rng(5).normal(size=(M, K))).astype(np.float32)
    x[3, 4] = 3000.0
    exact = x.astype(np.float64) @ w.astype(np.float64)
    tensor = Fp8Recipe(fp8_format="e4m3")
    state = init_linear_state(tensor)
    state["x"]["scale"] = jnp.float32(448.0 / 3000.0)  # its delayed scale: this very amax seen before
    run = jax.jit(lambda x, w: (xla.fp8_matmul(x, w, state, tensor), xla.fp8_matmul(x, w, state, BLOCK)))
    y_tensor, y_block = run(x, w)
    # over the rows without the outlier
    rel = lambda v: np.linalg.norm((np.asarray(v) - exact)[4:]) / np.linalg.norm(exact[4:])
    assert rel(y_block) < rel(y_tensor) / 4, (rel(y_block), rel(y_tensor))


def test_rollout_kernel_is_the_training_forward(operands):
    """The rollout's pre-quantized kernel: the same FP8 values and [ceil(N/128), ceil(K/128)] scales as the
    training forward, and the same GEMM on them, bit for bit."""
    x, w, g = operands
    state = init_linear_state(BLOCK)
    kernel = jax.jit(lambda w: xla.quantize_kernel(w, state["kernel"], BLOCK))(w)
    qw, sw = ref_blocks(w.T, E4M3)
    assert kernel.scale_inv.shape == (2, 3) and kernel.data.shape == (N, K)
    np.testing.assert_array_equal(np.asarray(kernel.data, np.float32), qw.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(kernel.scale_inv), sw)
    rollout, train = jax.jit(lambda x, w, k: (xla.prequantized_matmul(x, k, state["x"]["scale"], BLOCK),
                                              xla.fp8_matmul(x, w, state, BLOCK)))(x, w, kernel)
    np.testing.assert_array_equal(np.asarray(rollout), np.asarray(train))


def ref_rows(a: np.ndarray, dtype, slices: int):
    """One scale a row of a [P, C] (a single tile as wide as the row): (q [P, C], its inverse scale repeated for each
    of ``slices`` 128-wide slices, [P, slices])."""
    q, inv = ref_tiles(a, dtype, T=a.shape[1])
    return q, np.repeat(inv, slices, axis=1)


@pytest.mark.parametrize("form", ["tiles_channels", "tokens_blocks"])
def test_forward_halves_match_reference_and_the_rollout(operands, form):
    """``block_forward``'s ablations: one half of DeepSeek-V3's forward as rowwise makes it (the weight per output
    channel, or the input per token), the other half as block scaling does, summed per 128-wide slice as block's
    GEMM is; the rollout's pre-quantized kernel gives the training forward bit for bit."""
    x, w, g = operands
    recipe = Fp8Recipe(scaling="block", fp8_format="e4m3", block_forward=form, fp8_gemms=("fprop",))
    state = init_linear_state(recipe)
    kernel = jax.jit(lambda w: xla.quantize_kernel(w, state["kernel"], recipe))(w)
    rollout, train = jax.jit(lambda x, w, k: (xla.prequantized_matmul(x, k, state["x"]["scale"], recipe),
                                              xla.fp8_matmul(x, w, state, recipe, jnp.float32)))(x, w, kernel)
    kb = -(-K // T)
    if form == "tiles_channels":
        qx, sx = ref_tiles(x, E4M3)
        qw, sw = ref_rows(w.T, E4M3, kb)  # [N, K], [N, Kb]
        assert kernel.scale_inv.shape == (N, kb)
    else:
        qx, sx = ref_rows(x, E4M3, kb)
        qw, sw_blocks = ref_blocks(w.T, E4M3)
        sw = rows(sw_blocks, N)
    np.testing.assert_array_equal(np.asarray(kernel.data, np.float32), qw.astype(np.float32))
    ref, bound = ref_gemm(qx, sx, qw, sw)
    err = np.abs(np.asarray(train) - ref)
    assert (err <= bound).all(), float((err / bound).max())
    np.testing.assert_array_equal(np.asarray(rollout), np.asarray(train))


BLOCK_TILES = dataclasses.replace(BLOCK, block_wgrad="tiles")  # DeepSeek-V3's weight gradient


@pytest.mark.parametrize(("recipe", "width"), [(BLOCK, 128), (Fp8Recipe(scaling="block"), 128), (BLOCK, 32),
                                               (BLOCK_TILES, 128), (BLOCK_TILES, 32)],
                         ids=["e4m3-128", "hybrid-128", "e4m3-32", "wgrad_tiles-128", "wgrad_tiles-32"],
                         indirect=["width"])
def test_backward_matches_reference(operands, recipe, width):
    x, w, g = operands
    gdt = E4M3 if recipe.fp8_format == "e4m3" else E5M2
    _, dx, dw, obs = jax.jit(lambda x, w, g: _call(recipe, x, w, g))(x, w, g)
    # dgrad: g in 1 x 128 tiles along N, w in the forward's 128 x 128 blocks (laid [K, N])
    qg, sg = ref_tiles(g, gdt, width)
    qw, sw = ref_blocks(w, E4M3, width)
    ref, bound = ref_gemm(qg, sg, qw, rows(sw, K, width), width)
    assert (np.abs(np.asarray(dx) - ref) <= bound).all()
    # wgrad: x and g quantized again from their high-precision values, x along the tokens (128 x 1 tiles); g in
    # 128 x 128 blocks (block_wgrad's default, grad_blocks: g^T's blocks are g's) or in 128 x 1 tiles (tiles)
    qxt, sxt = ref_tiles(x.T, E4M3, width)
    if recipe.block_wgrad == "grad_blocks":
        qgt, sgt = ref_blocks(g.T, gdt, width)
        sgt = rows(sgt, N, width)
    else:
        qgt, sgt = ref_tiles(g.T, gdt, width)
    ref, bound = ref_gemm(qxt, sxt, qgt, sgt, width)
    assert (np.abs(np.asarray(dw) - ref) <= bound).all()
    # the state's cotangent: block scaling reads no delayed scale, so it observes nothing (0: the scales stay)
    assert not recipe.delayed
    seen = [float(obs[r]["amax_history"][0]) for r in ("x", "kernel", "grad")]
    assert seen == [0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------------------------------------
# a model, the rollout weights, the knobs

CONFIG = preset("tiny").replace(num_layers=2)
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, CONFIG.vocab_size, (2, 12)))


def test_tiny_model_block_rollout_weights_reproduce_the_training_forward():
    """hidden 64 and intermediate 160: every kernel is a partial block. The rollout's kernels (quantized once)
    give the training forward's logits bit for bit. (Closer to f32 than per-tensor scaling it is not, on this
    random model: its values span far less than E4M3's normal range, and inside that range every scale rounds to
    the same 3 mantissa bits; mean |dlogp| 0.0177 block against 0.0175 per tensor.)"""
    params = llama.init_params(CONFIG, jax.random.PRNGKey(0), std=0.05)
    block = Precision(backend="xla", recipe=BLOCK)
    state = llama.init_fp8_state(CONFIG, block)
    fwd = lambda p, prec, s: llama.forward(p, TOKENS, config=CONFIG, precision=prec, fp8_state=s)[0]
    train = jax.jit(lambda p, s: fwd(p, block, s))(params, state)
    rp = jax.jit(lambda p, s: rollout_params(p, s, block, CONFIG.num_layers))(params, state)
    scales = [k.scale_inv.shape for seg in rp["blocks"] for k in seg.values() if isinstance(k, xla.QuantizedKernel)]
    assert sorted(scales) == [(2, 1, 1), (2, 1, 1), (2, 1, 2), (2, 3, 1)]  # [L, Nb, Kb]: wqkv, wo, w_down, w_gate_up
    cache = kv_cache.init_cache(CONFIG, 2, 16, kv_cache.cache_dtype(block))
    roll = jax.jit(lambda p, s, c: llama.forward(p, TOKENS, config=CONFIG, precision=block, fp8_state=s,
                                                 cache=c)[0])(rp, state, cache)
    np.testing.assert_array_equal(np.asarray(roll), np.asarray(train))


def test_block_scaling_is_validated():
    with pytest.raises(ValueError, match="xla backend only"):
        Precision(backend="te", recipe=BLOCK)
    with pytest.raises(ValueError, match="scaling"):
        Fp8Recipe(scaling="blocks")
    with pytest.raises(ValueError, match="block_gemm='cutlass'"):
        Fp8Recipe(scaling="block", block_gemm="cutlass")
    with pytest.raises(ValueError, match="block_forward='tiles'"):
        Fp8Recipe(scaling="block", block_forward="tiles")
    with pytest.raises(ValueError, match="a form of block scaling, not of scaling='rowwise'"):
        Fp8Recipe(scaling="rowwise", block_forward="tokens_blocks")
    with pytest.raises(ValueError, match="block_wgrad='blocks'"):
        Fp8Recipe(scaling="block", block_wgrad="blocks")
    with pytest.raises(ValueError, match="a form of block scaling, not of scaling='tensor'"):
        Fp8Recipe(block_wgrad="tiles")
    assert BLOCK.block_wgrad == Fp8Recipe().block_wgrad == "grad_blocks"
    c = config_lib.base_config()
    c.precision.scaling = "block"
    c.precision.backend = "xla"
    config_lib.validate(c, training=False)
    c.precision.backend = "auto"
    with pytest.raises(ConfigError, match="precision.scaling"):
        config_lib.validate(c, training=False)
    c.precision.backend, c.precision.block_forward = "xla", "tiles_channels"
    config_lib.validate(c, training=False)
    c.precision.scaling = "tensor"
    with pytest.raises(ConfigError, match="precision.block_forward='tiles_channels' is invalid"):
        config_lib.validate(c, training=False)
    c.precision.block_forward, c.precision.block_wgrad = "tiles_blocks", "tiles"
    with pytest.raises(ConfigError, match="precision.block_wgrad='tiles' is invalid"):
        config_lib.validate(c, training=False)
