"""``kernels.cublaslt``: the block-scaled FP8 GEMM by cuBLASLt through an XLA FFI call, against
``fp8.block.block_gemm``.

On the CPU: the call lowered for CUDA (one custom call to the FFI target, the scales in the layout cuBLASLt reads,
the padding of rows that are not whole 16 bytes), its refusals, and the handler built where a compiler and cuBLAS's
headers are (else skipped). On the GPU (``gpu`` marker; ``$FP8RL_CUBLASLT_LIB``, or a build into a temporary folder):
small-integer operands, whose 128-deep slice sums are exact in any accumulator, so that cuBLASLt and the emulation add
the same scaled partial sums and differ by f32 roundings alone; random block-quantized data within Hopper's FP8 MMA
precision of exact sums; and the FP8 linear's three GEMMs through it against the emulation.
"""

import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_operands import U, integers, magnitude, quantized

from fp8rl_jax.fp8 import block, xla
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.kernels import cublaslt


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------------------------------------------------
# CPU: lowering for CUDA, refusals, the build


@pytest.mark.parametrize("p,q,c,form,out_dtype", [
    (200, 576, 1536, "blocks", jnp.float32),
    (200, 576, 1536, "rows", jnp.bfloat16),
    (4096, 2048, 8192, "blocks", jnp.bfloat16),
])
def test_lowers_for_cuda_to_one_ffi_call(p, q, c, form, out_dtype):
    qa, sa, qb, sb, _ = quantized(p, q, c, form)
    text = _cuda_text(lambda *a: cublaslt.block_gemm_cublaslt(*a, out_dtype), qa, sa, qb, sb)
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\).*?-> \((.*?)\)", text)
    assert [name for name, _, _ in calls] == [cublaslt.TARGET]
    cb = block.num_blocks(c)
    operands, results = calls[0][1], calls[0][2]
    assert f"tensor<{cb}x{-(-p // 4) * 4}xf32>" in text  # sa: [Cb, round_up(P, 4)], rows contiguous
    sb_shape = (f"{block.num_blocks(q)}x{-(-cb // 4) * 4}" if form == "blocks" else f"{cb}x{-(-q // 4) * 4}")
    assert f"tensor<{sb_shape}xf32>" in text
    dtype = "f32" if out_dtype == jnp.float32 else "bf16"
    assert f"tensor<{p}x{q}x{dtype}>" in results and f"tensor<{cublaslt.WORKSPACE_BYTES}xui8>" in results
    assert "weight_blocks = " + ("1" if form == "blocks" else "0") in text
    assert operands  # four operands: qa, sa, qb, sb
    out = jax.eval_shape(lambda *a: cublaslt.block_gemm_cublaslt(*a, out_dtype), qa, sa, qb, sb)
    assert out.shape == (p, q) and out.dtype == jnp.dtype(out_dtype)


def test_rows_of_odd_bytes_are_padded_to_16():
    """A contraction (1000 -> 1008) and an output row (Q=150 f32 -> 152) that are not whole 16 bytes, and rows P that
    are no multiple of 4 (130 -> 132): zeros after the end, the output cut back to [P, Q]."""
    qa, sa, qb, sb, _ = quantized(130, 150, 1000, "rows")
    text = _cuda_text(lambda *a: cublaslt.block_gemm_cublaslt(*a), qa, sa, qb, sb)
    assert "tensor<132x1008xf8E4M3FN>" in text and "tensor<152x1008xf8E4M3FN>" in text
    out = jax.eval_shape(cublaslt.block_gemm_cublaslt, qa, sa, qb, sb)
    assert out.shape == (130, 150)


def test_mixed_fp8_types_lower_and_two_e5m2_are_refused():
    qa, sa, qb, sb, _ = quantized(128, 256, 256, "rows", b_dtype=jnp.float8_e5m2)
    assert cublaslt.TARGET in _cuda_text(cublaslt.block_gemm_cublaslt, qa, sa, qb, sb)
    with pytest.raises(ValueError, match="not two E5M2"):
        cublaslt.block_gemm_cublaslt(qa.astype(jnp.float8_e5m2), sa, qb, sb)


def test_bad_input_is_named():
    qa, sa, qb, sb, _ = quantized(128, 256, 256, "blocks")
    with pytest.raises(ValueError, match="FP8 operands"):
        cublaslt.block_gemm_cublaslt(qa.astype(jnp.bfloat16), sa, qb, sb)
    with pytest.raises(ValueError, match="a_scale_inv must be"):
        cublaslt.block_gemm_cublaslt(qa, sa.T, qb, sb)
    with pytest.raises(ValueError, match="b_scale_inv must be"):
        cublaslt.block_gemm_cublaslt(qa, sa, qb, sb[:, :1])
    with pytest.raises(ValueError, match="f32 or BF16 output"):
        cublaslt.block_gemm_cublaslt(qa, sa, qb, sb, jnp.float16)
    with pytest.raises(ValueError, match="one contraction size"):
        cublaslt.block_gemm_cublaslt(qa, sa, qb[:, :128], sb[:, :1])
    with pytest.raises(ValueError, match=r"algo must be in \[0, 16\)"):
        cublaslt.block_gemm_cublaslt(qa, sa, qb, sb, algo=16)
    assert "algo = 3 : i32" in _cuda_text(lambda *a: cublaslt.block_gemm_cublaslt(*a, algo=3), qa, sa, qb, sb)


def test_runs_here_only_where_registered_on_hopper():
    qa, _, qb, _, _ = quantized(128, 256, 256, "blocks")
    assert not cublaslt.runs_here(qa, qb)  # this host: no registration, no Hopper GPU


def test_register_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv(cublaslt.ENV_LIB, raising=False)
    monkeypatch.setitem(cublaslt._registered, "unused", "")  # a registration of another target changes nothing
    with pytest.raises(FileNotFoundError, match="no .*libfp8rl_cublaslt_"):
        cublaslt.register(tmp_path, build_missing=False)
    monkeypatch.setenv(cublaslt.ENV_LIB, str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match="FP8RL_CUBLASLT_LIB"):
        cublaslt.register(tmp_path)
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.delenv(cublaslt.ENV_LIB)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        cublaslt.build(tmp_path)


def test_a_library_of_another_interface_is_refused_at_registration(tmp_path, monkeypatch):
    """A prebuilt library (``$FP8RL_CUBLASLT_LIB``) from an older handler source, which lacks the ``algo``
    attribute, fails at start-up naming the rebuild, not in the first step's FFI call."""

    class OldLibrary:  # what ctypes finds in a library without the ABI symbol: only the handler
        Fp8rlBlockGemmCublasLt = object()

    class Library(OldLibrary):
        @staticmethod
        def Fp8rlBlockGemmCublasLtAbi():
            return cublaslt.ABI + 1

    old = tmp_path / "libold.so"
    old.write_bytes(b"")
    monkeypatch.setenv(cublaslt.ENV_LIB, str(old))
    monkeypatch.setattr(cublaslt, "_preload_cublaslt", lambda: None)
    for library, found in ((OldLibrary, 1), (Library, cublaslt.ABI + 1)):
        monkeypatch.setattr(cublaslt.ctypes, "CDLL", lambda path, library=library: library())
        with pytest.raises(RuntimeError, match=f"interface {found}, this one's {cublaslt.ABI}.*kernels.cublaslt --out"):
            cublaslt.register()
    assert not cublaslt.registered()


def test_prebuild_command_names_what_is_missing(tmp_path, monkeypatch, capsys):
    """``python -m fp8rl_jax.kernels.cublaslt --out DIR``: exit 1 with the reason where it cannot build."""
    from fp8rl_jax.kernels.cublaslt.__main__ import main

    monkeypatch.setenv("CXX", "no-such-compiler")
    assert main(["--out", str(tmp_path)]) == 1
    assert "needs a C++ compiler" in capsys.readouterr().err


def test_library_name_follows_the_source():
    assert re.fullmatch(r"libfp8rl_cublaslt_[0-9a-f]{12}\.so", cublaslt.library_name())


def test_handler_builds_where_headers_are(tmp_path):
    """Compiled with this host's compiler against jaxlib's FFI headers and cuBLAS's (skipped where either is
    missing: CI has no cuBLAS headers); the library exports the handler's symbol."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler")
    try:
        path = cublaslt.build(tmp_path)
    except RuntimeError as e:
        if "no cublasLt.h" in str(e) or "no driver_types.h" in str(e) or "no cuda_bf16.h" in str(e) \
                or "no libcublasLt" in str(e):
            pytest.skip(str(e).splitlines()[0][:200])
        raise
    assert path.name == cublaslt.library_name() and cublaslt.SYMBOL.encode() in path.read_bytes()
    assert cublaslt.ABI_SYMBOL.encode() in path.read_bytes()
    assert cublaslt.build(tmp_path) == path  # kept, not rebuilt


def test_block_linear_lowers_its_gemms_to_cublaslt(monkeypatch):
    """The FP8 linear under block scaling with ``block_gemm='cublaslt'``, lowered for CUDA where the target runs:
    fprop, dgrad and wgrad are one FFI call each, for E4M3 and for HYBRID's E5M2 gradients (mixed types), and for
    ``block_forward``'s halves (per-row scales on one side of the forward)."""
    monkeypatch.setattr(cublaslt, "runs_here", lambda qa, qb, out_dtype=jnp.float32: True)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 576)), jnp.float32)
    w = jnp.asarray(0.05 * rng.normal(size=(576, 1536)), jnp.float32)
    g = jnp.asarray(1e-3 * rng.normal(size=(256, 1536)), jnp.float32)
    for fmt, forward in (("e4m3", "tiles_blocks"), ("hybrid", "tiles_blocks"), ("e4m3", "tiles_channels"),
                         ("e4m3", "tokens_blocks")):
        recipe = Fp8Recipe(scaling="block", fp8_format=fmt, block_forward=forward, block_gemm="cublaslt")
        state = init_linear_state(recipe)

        def run(x, w, g, recipe=recipe, state=state):
            y, vjp = jax.vjp(lambda x, w: xla.fp8_matmul(x, w, state, recipe, jnp.float32, "f8"), x, w)
            return (y, *vjp(g))

        text = _cuda_text(run, x, w, g)
        assert text.count(f"@{cublaslt.TARGET}(") == 3, (fmt, forward)


@pytest.mark.parametrize("rows,n,calls", [(256, 1536, 1), (384, 1536, 3), (256, 66 * 128, 2)])
def test_auto_takes_cublaslt_above_a_decode_steps_rows(monkeypatch, rows, n, calls):
    """``block_gemm='auto'``: cuBLASLt for a GEMM of more than ``block_gemm.SMALL_M`` rows, and of fewer where its
    128 x 128 tiles fill the GPU's 132 multiprocessors (2 x 66 at 256 x 8448), the Mosaic kernel (here, off a GPU,
    the emulation) for the rest. At 256 tokens and 1536 columns only the wgrad (576 rows: the kernel's K) takes
    cuBLASLt."""
    monkeypatch.setattr(cublaslt, "runs_here", lambda qa, qb, out_dtype=jnp.float32: True)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, 576)), jnp.float32)
    w = jnp.asarray(0.05 * rng.normal(size=(576, n)), jnp.float32)
    g = jnp.asarray(1e-3 * rng.normal(size=(rows, n)), jnp.float32)
    recipe = Fp8Recipe(scaling="block", fp8_format="e4m3", block_gemm="auto")
    state = init_linear_state(recipe)

    def run(x, w, g):
        y, vjp = jax.vjp(lambda x, w: xla.fp8_matmul(x, w, state, recipe, jnp.float32, "f8"), x, w)
        return (y, *vjp(g))

    assert _cuda_text(run, x, w, g).count(f"@{cublaslt.TARGET}(") == calls


# ----------------------------------------------------------------------------------------------------------
# GPU: the handler run


@pytest.fixture(scope="module")
def cublaslt_registered(tmp_path_factory):
    try:
        cublaslt.register(tmp_path_factory.mktemp("cublaslt"))
    except (RuntimeError, FileNotFoundError) as e:
        pytest.fail(f"the cuBLASLt block GEMM did not build or load here: {e}")


GPU_CASES = [  # p, q, c, form
    (128, 128, 128, "blocks"),
    (200, 576, 1536, "blocks"),  # SmolLM2-ish: rows that are no multiple of 128 or 4
    (130, 576, 1536, "rows"),  # P no multiple of 4: padded
    (130, 576, 1536, "blocks"),
    (576, 1536, 2000, "rows"),  # a wgrad's shape (C = tokens, no multiple of 128)
    (64, 150, 1000, "rows"),  # rows of odd bytes: padded
    (4096, 4096, 4096, "blocks"),
    (1024, 2048, 8192, "blocks"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("p,q,c,form", GPU_CASES)
def test_gpu_exact_slice_sums_equal_block_gemm(p, q, c, form, b_dtype, cublaslt_registered):
    """Small-integer operands: the slice sums are exact, so cuBLASLt and the emulation differ by f32 roundings of the
    scaled partial sums alone; BF16 output is the f32 result rounded (to one BF16 step: cuBLASLt may round its own
    f32 sum in another order)."""
    qa, sa, qb, sb, rows = integers(p, q, c, form, b_dtype=b_dtype)
    got = np.asarray(cublaslt.block_gemm_cublaslt(qa, sa, qb, sb))
    want = np.asarray(jax.jit(block.block_gemm)(qa, sa, qb, rows))
    mag = magnitude(qa, sa, qb, rows)
    err = np.abs(got - want)
    tol = (3 * block.num_blocks(c) + 4) * U * mag
    assert got.shape == (p, q)
    assert (err <= tol).all(), f"max err {err.max()}, max err / magnitude {(err / np.maximum(mag, 1e-30)).max()}"
    got16 = np.asarray(cublaslt.block_gemm_cublaslt(qa, sa, qb, sb, jnp.bfloat16), np.float32)
    assert (np.abs(got16 - want) <= 2.0**-7 * np.abs(want) + tol).all()


@pytest.mark.gpu
@pytest.mark.parametrize("p,q,c,form", GPU_CASES)
def test_gpu_quantized_data_within_fp8_accumulation_of_exact_sums(p, q, c, form, cublaslt_registered):
    """Block-quantized random data with massive values against f32 products and sums: within Hopper's FP8 MMA
    precision (2**-8 of the magnitude, the Mosaic kernel's bound: tests/kernels/test_block_gemm.py)."""
    qa, sa, qb, sb, rows = quantized(p, q, c, form)
    got = np.asarray(cublaslt.block_gemm_cublaslt(qa, sa, qb, sb))
    with jax.default_matmul_precision("highest"):
        exact = np.asarray(jax.jit(block.block_gemm)(qa.astype(jnp.float32), sa, qb.astype(jnp.float32), rows))
    mag = magnitude(qa, sa, qb, rows)
    err = np.abs(got - exact)
    bound = 2.0**-8 * mag + (block.BLOCK + block.num_blocks(c) + 3) * U * mag
    assert (err <= bound).all(), f"max err / magnitude {(err / np.maximum(mag, 1e-30)).max():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,forward,gemm", [
    ("e4m3", "tiles_blocks", "cublaslt"), ("hybrid", "tiles_blocks", "cublaslt"),
    ("e4m3", "tiles_channels", "cublaslt"), ("e4m3", "tokens_blocks", "cublaslt"),
    ("e4m3", "tiles_channels", "mosaic"), ("e4m3", "tokens_blocks", "mosaic")])
def test_gpu_block_linear_through_cublaslt_equals_the_emulation(fmt, forward, gemm, cublaslt_registered):
    """y, dx and dw of the FP8 linear with ``block_gemm='cublaslt'`` against the same linear's XLA emulation (the
    ``f32`` form: exact products, f32 sums), within the FP8 MMA's precision of their magnitudes; ``block_forward``'s
    halves (a weight's scales per output channel, or an input's per token: per-row scales in the forward's GEMM)
    through either kernel too."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(300, 576)), jnp.float32).at[3, 4].set(3000.0)
    w = jnp.asarray(0.05 * rng.normal(size=(576, 1536)), jnp.float32)
    g = jnp.asarray(1e-3 * rng.normal(size=(300, 1536)), jnp.float32)

    def grads(recipe, form):
        state = init_linear_state(recipe)

        def run(x, w, g):
            y, vjp = jax.vjp(lambda x, w: xla.fp8_matmul(x, w, state, recipe, jnp.float32, form), x, w)
            return (y, *vjp(g))

        return [np.asarray(t) for t in jax.jit(run)(x, w, g)], jax.jit(run).lower(x, w, g).as_text()

    (got, text), (want, _) = (
        grads(Fp8Recipe(scaling="block", fp8_format=fmt, block_forward=forward, block_gemm=gemm), "f8"),
        grads(Fp8Recipe(scaling="block", fp8_format=fmt, block_forward=forward), "f32"))
    target = f"@{cublaslt.TARGET}(" if gemm == "cublaslt" else "custom_call @mosaic_gpu"
    assert text.count(target) == 3, (target, text.count(target))
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        scale = np.max(np.abs(b))
        assert np.max(np.abs(a - b)) <= 2.0**-7 * scale, (name, np.max(np.abs(a - b)) / scale)
