"""Block scaling's MLP in one custom VJP (``fp8.block_mlp``) and its SwiGLU backward kernel
(``kernels.swiglu_grad.swiglu_grad_tiles``): the kernel through Pallas' interpreter against the XLA form bit for bit,
the XLA form against a numpy reference of the tiles, the forward against the two linears' bit for bit, the gradient
against theirs and against exact f32 sums, and the model taking it where it applies."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import block_mlp, xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, init_linear_state
from fp8rl_jax.fp8.train_kernel import TrainKernel
from fp8rl_jax.fp8.xla import QuantizedKernel
from fp8rl_jax.kernels import block_quantize
from fp8rl_jax.model import mlp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BLOCK = Fp8Recipe(scaling="block", fp8_format="e4m3")
M, D, F = 256, 384, 256


def _swiglu_inputs(m=M, f=F, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    gate_up = (jax.random.normal(k[0], (m, 2 * f)) * 2).astype(jnp.bfloat16)
    g_h = (jax.random.normal(k[1], (m, f)) * 0.01 * jnp.exp(jax.random.normal(k[1], (m, 1)))).astype(jnp.bfloat16)
    return gate_up, g_h.at[3, 7].set(40.0)  # a massive gradient: its tiles only


def _f32(q):
    return np.asarray(q.astype(jnp.float32))


@pytest.mark.parametrize("g_dtype, g_blocks", [(E4M3, False), (E5M2, False), (E4M3, True)])
def test_kernel_equals_the_xla_form_bit_for_bit(g_dtype, g_blocks):
    """Pallas' interpreter runs the kernel's programs (2 x 2 blocks of 128 x 128) with XLA's arithmetic: every value
    and scale of the three forms as the XLA form makes them (``g_blocks``: the gradient's second form in blocks)."""
    gate_up, g_h = _swiglu_inputs()
    run = lambda impl: jax.jit(lambda a, b: block_mlp.swiglu_grad_tiles_any(a, b, E4M3, g_dtype, impl, g_blocks))(
        gate_up, g_h)
    want, got = run("xla"), run("pallas_interpret")
    assert want[1][1][1].shape == ((4, 2) if g_blocks else (512, 2))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert (w.dtype, w.shape) == (g.dtype, g.shape)
        np.testing.assert_array_equal(_f32(g), _f32(w))


@pytest.mark.parametrize("chunk", [16, 64])
def test_kernel_chunks_give_the_whole_blocks_bits(chunk):
    """``chunk``: a block's programs take ``chunk`` rows or ``chunk`` columns each, against one program a whole block
    (``chunk=None``): through Pallas' interpreter, every output the same. The gradient's blocks take whole blocks."""
    from fp8rl_jax.kernels.swiglu_grad import swiglu_grad_tiles

    gate_up, g_h = _swiglu_inputs(seed=2)
    run = lambda chunk: jax.jit(lambda a, b: swiglu_grad_tiles(a, b, E4M3, E5M2, interpret=True, chunk=chunk))(
        gate_up, g_h)
    for w, g in zip(run(None), run(chunk), strict=True):
        np.testing.assert_array_equal(_f32(g), _f32(w))
    with pytest.raises(ValueError, match="chunk=48"):
        swiglu_grad_tiles(gate_up, g_h, E4M3, E4M3, chunk=48)
    with pytest.raises(ValueError, match=f"chunk={chunk}; allowed: None, or .* without g_blocks"):
        swiglu_grad_tiles(gate_up, g_h, E4M3, E4M3, chunk=chunk, g_blocks=True)


def test_xla_form_is_the_tiles_of_the_swiglu_and_its_gradient():
    """Against numpy's tiles (``test_block_scaling.ref_tiles``) of autodiff's f32 h, dgate and dup: h in 128 x 1
    tiles along the tokens, transposed; [dgate | dup] in 1 x 128 tiles and in 128 x 1 tiles, transposed; values
    equal but where f32 sums in another order straddle an FP8 rounding boundary (one step)."""
    from test_block_scaling import ref_tiles

    gate_up, g_h = _swiglu_inputs(seed=1)
    gate, up = gate_up[:, :F].astype(jnp.float32), gate_up[:, F:].astype(jnp.float32)
    h, vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)
    dgu = np.asarray(jnp.concatenate(vjp(g_h.astype(jnp.float32)), axis=1))
    (qh_t, sh), ((qg, sg), (qg_t, sg_t)) = block_mlp.swiglu_grad_tiles_any(gate_up, g_h, E4M3, E4M3, "xla")
    for (q, s), ref in (((qh_t, sh), np.asarray(h).T), ((qg, sg), dgu), ((qg_t, sg_t), dgu.T)):
        rq, rs = ref_tiles(ref, E4M3)
        np.testing.assert_allclose(np.asarray(s), rs, rtol=1e-6)
        got, want = _f32(q), rq.astype(np.float32)
        assert np.all(np.abs(got - want) <= np.abs(want) * 2.0**-3 + 1e-30)
        assert np.mean(got == want) > 0.99


def test_kernel_shapes_are_checked_and_it_lowers_for_cuda(triton_ir):
    """128 must divide M and F; Pallas' Triton lowering takes the kernel on this host: one kernel, two scale
    divisions for each of its five tile forms and the sigmoid's."""
    from fp8rl_jax.kernels.swiglu_grad import swiglu_grad_tiles

    gate_up, g_h = _swiglu_inputs()
    with pytest.raises(ValueError, match="128 dividing M and F"):
        swiglu_grad_tiles(gate_up[:200], g_h[:200], E4M3, E4M3)
    with pytest.raises(ValueError, match="impl='cuda'"):
        block_mlp.swiglu_grad_tiles_any(gate_up, g_h, E4M3, E4M3, "cuda")
    args = [jax.ShapeDtypeStruct((1024, 2 * 512), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)]
    (ir,) = triton_ir(lambda a, b: block_mlp.swiglu_grad_tiles_any(a, b, E4M3, E4M3, "pallas"), *args)
    assert ir.count("arith.divf") == 2 * 5 + 2  # and the sigmoid's, in the row-form and the column-form programs
    # the gradient's blocks: one program a whole block, one sigmoid
    (ir,) = triton_ir(lambda a, b: block_mlp.swiglu_grad_tiles_any(a, b, E4M3, E4M3, "pallas", True), *args)
    assert ir.count("arith.divf") == 2 * 5 + 1


@pytest.mark.parametrize("m,block_rows", [(256, 32), (256, 128), (384, 64)])
def test_swiglu_tiles_kernel_equals_the_xla_form_bit_for_bit(m, block_rows):
    """The forward's kernel (h of gate/up in 1 x 128 tiles, from one read) through Pallas' interpreter: the values and
    scales of ``swiglu_h`` quantized by ``block.tile_quantize``, bit for bit, with a massive gate in one tile."""
    from fp8rl_jax.kernels.swiglu_grad import swiglu_tiles

    gate_up = _swiglu_inputs(m=m, seed=4)[0].at[5, 130].set(300.0).at[5, F + 130].set(3.0)  # h = 900
    want = jax.jit(lambda a: block_mlp.swiglu_tiles_any(a, jnp.bfloat16, E4M3, "xla"))(gate_up)
    q, inv = jax.jit(lambda a: swiglu_tiles(a, E4M3, jnp.bfloat16, interpret=True, block_rows=block_rows))(gate_up)
    assert (q.dtype, q.shape, inv.shape) == (E4M3, (m, F), (F // 128, m))
    np.testing.assert_array_equal(_f32(q), _f32(want[0]))
    np.testing.assert_array_equal(np.asarray(inv.T), np.asarray(want[1]))
    assert float(jnp.max(want[1])) > 20 * float(jnp.median(want[1]))  # the massive value's tile only


def test_swiglu_tiles_shapes_are_checked_and_it_lowers_for_cuda(triton_ir):
    from fp8rl_jax.kernels.swiglu_grad import swiglu_tiles

    gate_up = _swiglu_inputs()[0]
    for bad in (gate_up[:200], gate_up[None]):
        with pytest.raises(ValueError, match="128 dividing M and F"):
            swiglu_tiles(bad, E4M3, jnp.bfloat16)
    with pytest.raises(ValueError, match="block_rows=48"):
        swiglu_tiles(gate_up, E4M3, jnp.bfloat16, block_rows=48)
    with pytest.raises(ValueError, match="impl='cuda'"):
        block_mlp.swiglu_tiles_any(gate_up, jnp.bfloat16, E4M3, "cuda")
    (ir,) = triton_ir(lambda a: block_mlp.swiglu_tiles_any(a, jnp.bfloat16, E4M3, "pallas"),
                      jax.ShapeDtypeStruct((1024, 2 * 512), jnp.bfloat16))
    assert "swiglu_tiles" in ir and ir.count("arith.divf") == 2 + 1  # the tiles' scales and the sigmoid's


def test_swiglu_tiles_benchmark_runs_its_paths(tmp_path, benchmark_script):
    """benchmarks/swiglu_tiles_speed.py end to end on its tiny shape (kernels interpreted): a row per path and
    launch, with the bytes the kernel must move."""
    out = tmp_path / "swiglu_tiles.json"
    benchmark_script("swiglu_tiles_speed").main(["--check", "--out", str(out), "--block-rows", "32,128",
                                                 "--num-warps", "4"])
    result = json.loads(out.read_text())
    assert [(r["path"], r["block_rows"]) for r in result["rows"]] == [
        ("kernel", 32), ("kernel", 128), ("two_kernels", 32), ("two_kernels", 128), ("xla", None)]
    assert all(r["bytes"] == 256 * 512 * 2 + 256 * 256 + 256 * 2 * 4 and r["ms"] > 0 for r in result["rows"])


def _mlp_operands(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(k[0], (M, D)).astype(jnp.bfloat16)
    w_gate_up = jax.random.normal(k[1], (D, 2 * F)) * 0.05
    w_down = jax.random.normal(k[2], (F, D)) * 0.05
    g = jax.random.normal(k[3], (M, D)) * 1e-2
    return x, w_gate_up, w_down, g


def _two_linears(recipe):
    def mlp(x, w_gate_up, w_down, st_gu, st_down):
        gate, up = jnp.split(xla.fp8_matmul(x, w_gate_up, st_gu, recipe, jnp.bfloat16), 2, axis=-1)
        return xla.fp8_matmul(block_mlp.swiglu_h(gate, up, jnp.bfloat16), w_down, st_down, recipe, jnp.float32)
    return mlp


@pytest.mark.parametrize("recipe", [BLOCK, Fp8Recipe(scaling="block"),
                                    Fp8Recipe(scaling="block", fp8_format="e4m3", block_forward="tokens_blocks"),
                                    Fp8Recipe(scaling="block", fp8_format="e4m3", block_wgrad="tiles")],
                         ids=["e4m3", "hybrid", "tokens_blocks", "wgrad_tiles"])
def test_forward_is_the_two_linears_and_the_gradient_follows_theirs(recipe):
    """The forward equals the two ``fp8_matmul`` calls bit for bit (the rollout runs those); the gradients differ
    only where the f32 SwiGLU gradient and autodiff's BF16 one quantize to neighbouring FP8 values, and are as
    close to exact f32 sums as the two linears' are; the states' cotangents are theirs (block observes nothing)."""
    x, w_gate_up, w_down, g = _mlp_operands()
    states = (init_linear_state(recipe), init_linear_state(recipe))
    fused = lambda *a: block_mlp.block_swiglu_mlp(*a, recipe, jnp.float32)
    (y2, vjp2), (y1, vjp1) = (jax.vjp(f, x, w_gate_up, w_down, *states) for f in (_two_linears(recipe), fused))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    grads1, grads2 = vjp1(g), vjp2(g)

    def exact(x, w_gate_up, w_down):
        with jax.default_matmul_precision("highest"):
            gate, up = jnp.split(x.astype(jnp.float32) @ w_gate_up, 2, axis=-1)
            return (jax.nn.silu(gate) * up) @ w_down

    _, vjp = jax.vjp(exact, x, w_gate_up, w_down)
    rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b.astype(jnp.float32)))
    for a, b, e in zip(grads1[:3], grads2[:3], vjp(g), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a, b) < 0.05
        assert rel(a, e) <= 1.01 * rel(b, e)
    for a, b in zip(jax.tree.leaves(grads1[3:]), jax.tree.leaves(grads2[3:]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_refuses_recipes_it_does_not_compute():
    x, w_gate_up, w_down, _ = _mlp_operands()
    for recipe in (Fp8Recipe(), Fp8Recipe(scaling="block", fp8_gemms=("fprop",))):
        with pytest.raises(ValueError, match="block scaling with all three GEMMs"):
            block_mlp.block_swiglu_mlp(x, w_gate_up, w_down, init_linear_state(recipe), init_linear_state(recipe),
                                       recipe)


def test_the_model_takes_it_where_it_applies():
    """Training and scoring under block scaling (xla backend, all three GEMMs in FP8, whole kernels) take the fused
    MLP; the rollout's pre-quantized kernels, another scaling, fewer FP8 GEMMs and gate/up shards do not."""
    block = Precision(backend="xla", recipe=BLOCK)
    w = jnp.zeros((4, 4))
    layer = {"w_gate_up": w, "w_down": w}
    states = {"w_gate_up": init_linear_state(BLOCK), "w_down": init_linear_state(BLOCK)}
    assert mlp.fused_mlp(layer, states, block, 1) == "block"
    train = {n: TrainKernel(master=w, kn=w, nk=w, amax=jnp.zeros(())) for n in layer}
    assert mlp.fused_mlp(train, states, block, 1) == "block"
    rollout = {n: QuantizedKernel(w, jnp.ones((1, 1))) for n in layer}
    assert mlp.fused_mlp(rollout, states, block, 1) is None
    assert mlp.fused_mlp(layer, states, block, 2) is None
    assert mlp.fused_mlp(layer, states, Precision(backend="xla"), 1) is None
    fprop = Precision(backend="xla", recipe=Fp8Recipe(scaling="block", fp8_gemms=("fprop",)))
    assert mlp.fused_mlp(layer, states, fprop, 1) is None
    assert mlp.fused_mlp(layer, {"w_gate_up": states["w_gate_up"]}, block, 1) is None


def test_block_mlp_backward_runs_one_swiglu_kernel(monkeypatch, triton_ir):
    """Lowered for CUDA where the quantizer kernels fit: the MLP's backward quantizes through three kernels (g's two
    forms, the SwiGLU's operands, x's weight-gradient form) where the two linears took four and XLA's SwiGLU
    gradient; the forward through two (x's tiles, and h's from the gate/up output: ``swiglu_tiles``), where the two
    linears' forwards quantize an h that XLA wrote."""
    monkeypatch.setattr(block_quantize, "fits", lambda a: a.ndim == 2 and a.shape[0] % 128 == a.shape[1] % 128 == 0)
    recipe = Fp8Recipe(scaling="block", fp8_format="e4m3", block_gemm="mosaic")
    states = (init_linear_state(recipe), init_linear_state(recipe))
    args = [jax.ShapeDtypeStruct(s, d) for s, d in (((M, D), jnp.bfloat16), ((D, 2 * F), jnp.float32),
                                                     ((F, D), jnp.float32), ((M, D), jnp.float32))]

    def grads(mlp):
        def run(x, w_gate_up, w_down, g):
            y, vjp = jax.vjp(lambda *a: mlp(*a, *states), x, w_gate_up, w_down)
            return (y, *vjp(g))
        return run

    fused = grads(lambda *a: block_mlp.block_swiglu_mlp(*a, recipe, jnp.float32))
    names = [ir.split("tt.func public @", 1)[1].split("(", 1)[0] for ir in triton_ir(fused, *args)]
    assert sorted(names) == sorted(["block_tile_quantize"] * 3 + ["swiglu_tiles", "swiglu_grad_tiles"]), names
    assert len(triton_ir(grads(_two_linears(recipe)), *args)) == 6


def test_the_rollout_mlp_takes_the_swiglu_tiles_where_it_applies():
    """The rollout's two linears (pre-quantized kernels) under block scaling make h's tiles from the gate/up output
    (``block_mlp.swiglu_down``); whole training kernels (the fused MLP or autodiff's), gate/up shards, per-tensor
    scaling and a BF16 forward do not."""
    block = Precision(backend="xla", recipe=BLOCK)
    w = jnp.zeros((4, 4))
    states = {"w_gate_up": init_linear_state(BLOCK), "w_down": init_linear_state(BLOCK)}
    rollout = {n: QuantizedKernel(w, jnp.ones((1, 1))) for n in states}
    assert mlp.swiglu_tiles_applies(rollout, states, block, 1)
    assert not mlp.swiglu_tiles_applies({n: w for n in states}, states, block, 1)
    assert not mlp.swiglu_tiles_applies(rollout, states, block, 2)
    assert not mlp.swiglu_tiles_applies(rollout, {"w_gate_up": states["w_gate_up"]}, block, 1)
    assert not mlp.swiglu_tiles_applies(rollout, states, Precision(backend="xla"), 1)
    wgrad = Precision(backend="xla", recipe=Fp8Recipe(scaling="block", fp8_gemms=("wgrad",)))
    assert not mlp.swiglu_tiles_applies(rollout, states, wgrad, 1)


def test_fused_mlp_off_takes_the_two_linears():
    block = Precision(backend="xla", recipe=BLOCK, fused_mlp=False)
    w = jnp.zeros((4, 4))
    states = {"w_gate_up": init_linear_state(BLOCK), "w_down": init_linear_state(BLOCK)}
    assert mlp.fused_mlp({"w_gate_up": w, "w_down": w}, states, block, 1) is None


@pytest.mark.gpu
def test_gpu_kernel_chunks_give_the_whole_blocks_bits():
    """The compiled kernel with each of ``CHUNKS`` against one program a whole block: the same bits."""
    from fp8rl_jax.kernels.swiglu_grad import CHUNKS, swiglu_grad_tiles

    gate_up, g_h = _swiglu_inputs(m=1024, f=512, seed=3)
    run = lambda chunk: jax.jit(lambda a, b: swiglu_grad_tiles(a, b, E4M3, E4M3, chunk=chunk))(gate_up, g_h)
    whole = run(None)
    for chunk in CHUNKS:
        for w, g in zip(whole, run(chunk), strict=True):
            np.testing.assert_array_equal(_f32(g), _f32(w))


@pytest.mark.gpu
def test_gpu_kernel_follows_the_xla_form_and_the_mlp_runs_it():
    """The compiled kernel against the XLA form on the GPU: the same values but where Triton's f32 arithmetic of the
    gradient and XLA's differ in a last bit at an FP8 rounding boundary (then one FP8 step; their sigmoid agrees on
    every BF16 gate: the forward kernel's test below), scales to f32 rounding; the MLP's backward
    runs it (in the compiled program), its forward equals the two linears' bit for bit, its gradients follow theirs."""
    gate_up, g_h = _swiglu_inputs(m=1024, f=512, seed=2)
    run = lambda impl, g_blocks: jax.jit(
        lambda a, b: block_mlp.swiglu_grad_tiles_any(a, b, E4M3, E4M3, impl, g_blocks))(gate_up, g_h)
    for g_blocks in (False, True):
        got, want = run("pallas", g_blocks), run("xla", g_blocks)
        for (gq, gs), (wq, ws) in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
            a, b = _f32(gq), _f32(wq)
            assert np.mean(a == b) > 0.999
            assert np.all(np.abs(a - b) <= np.abs(b) * 2.0**-3 + 1e-30)
            np.testing.assert_allclose(np.asarray(gs), np.asarray(ws), rtol=1e-6)
    recipe = BLOCK
    x, w_gate_up, w_down, g = _mlp_operands()
    states = (init_linear_state(recipe), init_linear_state(recipe))

    def grads(mlp):
        def run(x, w_gate_up, w_down, g):
            y, vjp = jax.vjp(lambda *a: mlp(*a, *states), x, w_gate_up, w_down)
            return (y, *vjp(g))
        return jax.jit(run)

    fused = grads(lambda *a: block_mlp.block_swiglu_mlp(*a, recipe, jnp.float32))
    assert "swiglu_grad_tiles" in fused.lower(x, w_gate_up, w_down, g).as_text()
    one, two = fused(x, w_gate_up, w_down, g), grads(_two_linears(recipe))(x, w_gate_up, w_down, g)
    np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(two[0]))
    for a, b in zip(one[1:], two[1:], strict=True):
        assert float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b.astype(jnp.float32))) < 0.05


@pytest.mark.gpu
def test_gpu_swiglu_tiles_equal_the_xla_form_for_every_bf16_gate(benchmark_script):
    """The compiled forward kernel against XLA's form on the GPU, every finite BF16 gate value with random ups: the
    same FP8 values and scales, bit for bit (a rollout and a trainer may each take one of them)."""
    got = benchmark_script("swiglu_tiles_speed").tiles_bits()
    assert got == {"check": "swiglu_tiles_vs_xla", "values": 512 * 128, "differ": 0, "scales_differ": 0}


def test_anatomy_benchmark_variants_lower_for_cuda(benchmark_script, triton_ir):
    """benchmarks/swiglu_anatomy.py: each of its variants of the kernel's programs lowers through Pallas' Triton
    lowering, and the one that does the kernel's work divides as the kernel does."""
    anatomy = benchmark_script("swiglu_anatomy")
    args = [jax.ShapeDtypeStruct((1024, 2 * 512), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)]
    for name, v in anatomy.VARIANTS.items():
        (ir,) = triton_ir(lambda a, b, v=v: anatomy.variant(1024, 512, *v)(a, b), *args)
        if name.startswith("swiglu, tile scales (the kernel's work)"):
            assert ir.count("arith.divf") == 2 * 5 + 2
