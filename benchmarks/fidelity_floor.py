"""Why block scaling beats the fidelity probe's mantissa floor, and what more bits buy (docs/accuracy.md, the probe).

    python benchmarks/fidelity_floor.py [--variants NAME,NAME,...] [--out PATH] [--checkpoint DIR] [--seed S]

``bench fidelity``'s batch, reference and calibration (SmolLM2-135M-Instruct, its defaults), and variants of its forms
that no config has, made by patching three functions and one constant of this process (nothing in the package
changes):
- ``block_pow2``: ``block``, each tile's and block's scale rounded down to a power of 2 (TE's Float8BlockScaling
  default). Inside E4M3's normal range such a scale moves no significand: the floor's rounding, plus the underflow.
- ``block_nosub`` / ``current_e4m3_nosub``: ``block`` / per-tensor current scaling (E4M3 both ways), each scaled value
  rounded to E4M3's mantissa with an unbounded exponent instead of cast (``numerics.mantissa_rounded``): their scales,
  no subnormals, no flush to zero.
- ``current_e4m3``: per-tensor current scaling, E4M3 both ways, unpatched (the probe's ``current`` has E5M2 gradients).
- ``mantissa_e4m3_c<c>``: the floor with every operand's rounding grid shifted by one factor c (x c rounded to 4
  significant bits, then / c): the same rounding in distribution, another draw of it. Their spread is how far one
  form's figures on one batch move with the luck of its roundings.
- ``block_g<g>`` (g = 128, 64, 32, 16): ``block`` with ``block.BLOCK`` = g while it is traced: 1 x g activation and
  gradient tiles, g x g weight blocks, f32 scales, the GEMM's f32 promotion every g steps of the contraction axis.
  ``block_g128`` is ``block`` itself, run here beside the others. ``block_head_bf16_g<g>``: the same with the LM head
  all BF16 (the probe's ``block_head_bf16``), the blocks' GEMMs without the head's per-tensor FP8 backward.
- ``mantissa_m<k>_head_bf16`` (k = 4, 5): ``mantissa_e4m3_head_bf16_c1.3`` with k mantissa bits instead of E4M3's
  3: how many bits the blocks' GEMM operands need for a given gradient error (no 8-bit format has k > 3).
- ``int8_<form>`` (form: ``block``, ``block_head_bf16``, ``block_fprop_only``, ``block_hybrid``): the form with
  block's tile and block quantizers rounding to INT8 instead of E4M3: each group's f32 scale ``127 / amax``, every
  scaled value rounded to the nearest integer (7 bits of magnitude on a uniform grid, where E4M3 has 3 mantissa
  bits). Hopper's INT8 tensor cores run at FP8's rate. Under ``block_hybrid`` only the E4M3 operands (inputs and
  weights) are INT8, the E5M2 gradients stay. The head's per-tensor FP8 (where a form has it) is unchanged.
  ``int8_block_g<g>`` and ``int8_block_head_bf16_g<g>`` (g = 64, 32, 16): the same in g-wide groups, as
  ``block_g<g>``.
- ``<form>_smooth`` (form: ``block_head_bf16``, ``int8_block_head_bf16``, ``int8_block``): the form with each
  linear's contraction channels smoothed first (SmoothQuant, arXiv 2211.10438, alpha 0.5): x / s and s * w for
  ``s_k = sqrt(amax_x[k] / amax_w[k])`` (the call's current amaxes over the tokens and the output channels; 1 where
  either is 0), the same product before any rounding, so that the forward, the dgrad and the wgrad all quantize
  smoothed operands; the gradients flow back through the two scalings exactly (``s`` is a constant). x / s is
  rounded to x's dtype (BF16: 2**-9 relative, far under INT8's and E4M3's roundings). The MLP runs as two linears
  (``Precision.fused_mlp`` off: the fused block MLP has no such hook), whose forward is the fused MLP's and whose
  gradient is not quite (its own roundings between the two); ``block_head_bf16_two_linears`` is that baseline.
- ``int8_fwd_<form>_g32`` (form: ``block``, ``block_head_bf16``): INT8 in groups of 32 for the forward's GEMM only;
  the dgrad and the wgrad as ``block`` ships them (E4M3, groups of 128, their operands quantized from the
  high-precision values as always). The MLP as two linears (the backward's hooks, ``xla.dgrad``, ``xla.wgrad`` and
  the gradient's ``block.tile_quantize_both``, are those of a linear); ``int8_block_head_bf16_g32_two_linears`` is
  all three GEMMs in INT8 groups of 32 with the same MLP.
- ``<form>_hadamard`` (form: ``block``, ``block_head_bf16``, ``int8_block``, ``int8_block_head_bf16``): the form
  with each linear's contraction axis rotated first by a block-diagonal Walsh-Hadamard matrix H (orthonormal, blocks
  of the largest power of 2 up to 128 that divides the axis: 64 for SmolLM2's 576, 128 for its 1536): x H and H^T w,
  the same product before any rounding, so that all three GEMMs quantize rotated operands (QuaRot, arXiv 2404.00456,
  spreads outliers this way before rounding). Block diagonal, a rotation stays inside block's groups of 128 and costs
  a 128-wide product a row, not another GEMM. x H is rounded to x's dtype, as the smoothing's x / s. The MLP as two
  linears, as the smoothing's; ``block_two_linears``, ``block_head_bf16_two_linears`` and their ``int8_`` forms are
  the baselines. ``int8_fwd_<form>_hadamard`` (form: ``block``, ``block_head_bf16``): the forward's GEMM alone
  rotated and INT8 (its value: plain + stop_gradient(rotated - plain)), the dgrad and the wgrad as ``block`` ships
  them, unrotated (the plain matmul's gradient, its backward quantizers as ``int8_fwd_*_g32``'s).
- Any form of ``bench fidelity`` (``fidelity.forms``) by its name, unpatched: a baseline in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from fp8rl_jax import plan
from fp8rl_jax.bench import fidelity, tree_commit
from fp8rl_jax.config import load_config_file
from fp8rl_jax.fp8 import block, xla
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import scale_from_amax, update_state
from fp8rl_jax.model import llama, loading
from fp8rl_jax.numerics import fp8_max, mantissa_rounded

# the variant being traced: its patch (None | "pow2" | "nosub" | "int8"), the floor's grid factor c, the dtypes an
# INT8 patch takes (None: all), the floor's mantissa bits (None: the dtype's), the smoothing's alpha (None: none),
# whether the patch and the group width apply to the forward's GEMM only, whether the contraction axis is rotated
# (True: in all three GEMMs; "fwd": in the forward's alone)
MODE = {"patch": None, "c": 1.0, "int8_dtypes": None, "bits": None, "smooth": None, "fwd_only": False,
        "rotate": False}
INT8_MAX = 127.0
_scales, _block_quantize, _xla_quantize = block.scales_of, block.quantize, xla.quantize
_general_matmul_fn = xla._general_matmul_fn
WIDTH = block.BLOCK  # 128: block's group width as shipped; a block_g<g> variant sets block.BLOCK = g while traced


def int8(dtype) -> bool:
    """Whether block's quantizers round to INT8 for ``dtype`` now: every dtype, or E4M3 only under a hybrid form."""
    return MODE["patch"] == "int8" and (MODE["int8_dtypes"] is None or jnp.dtype(dtype) in MODE["int8_dtypes"])


def patched_scales(a, dtype):
    if int8(dtype):
        s = scale_from_amax(a, 1.0, INT8_MAX)
        return s, 1.0 / s
    if MODE["patch"] != "pow2":
        return _scales(a, dtype)
    s = jnp.exp2(jnp.floor(jnp.log2(scale_from_amax(a, 1.0, fp8_max(dtype)))))
    return s, 1.0 / s


def patched_quantize(quantize, ints=False):
    def q(x, scale, dtype):
        if ints and int8(dtype):  # the integer values, held in f32 (exact), never cast to FP8
            return jnp.clip(jnp.round(x.astype(jnp.float32) * scale.astype(jnp.float32)), -INT8_MAX, INT8_MAX)
        if MODE["patch"] != "nosub":
            return quantize(x, scale, dtype)
        return mantissa_rounded(x.astype(jnp.float32) * scale.astype(jnp.float32), dtype)
    return q


def shifted(t, dtype):
    t = t.astype(jnp.float32) * MODE["c"]
    if MODE["bits"] is not None:
        return jax.lax.reduce_precision(t, exponent_bits=8, mantissa_bits=MODE["bits"]) / MODE["c"]
    return mantissa_rounded(t, dtype) / MODE["c"]


def hadamard(k: int) -> np.ndarray:
    """The block-diagonal orthonormal Walsh-Hadamard matrix [k, k] of the ``_hadamard`` variants: blocks of the
    largest power of 2 up to 128 that divides k."""
    b = 1
    while b < 128 and k % (2 * b) == 0:
        b *= 2
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(k // b), h / np.sqrt(b)).astype(np.float32)


def smoothing(x, kernel):
    """SmoothQuant's x / s and s * w (f32) for alpha = MODE["smooth"]: ``s_k = amax_x[k] ** alpha / amax_w[k] **
    (1 - alpha)``, 1 where either amax is 0, a constant to the gradients."""
    alpha = MODE["smooth"]
    ax = jnp.max(jnp.abs(x), axis=0)  # [K]
    aw = jnp.max(jnp.abs(kernel), axis=1)  # [K]
    ok = (ax > 0) & (aw > 0)  # else s = 1: 1 ** alpha / 1 ** (1 - alpha)
    s = jax.lax.stop_gradient(jnp.where(ok, ax, 1.0) ** alpha / jnp.where(ok, aw, 1.0) ** (1 - alpha))
    return x / s, kernel * s[:, None]


def rotation(x, kernel):
    """x H and H^T w (f32), H = ``hadamard(K)``: a constant, the gradients flow back through it exactly."""
    h = jnp.asarray(hadamard(x.shape[-1]))
    return x @ h, h.T @ kernel


def transformed_matmul_fn(x_dtype, w_dtype, out_dtype, recipe, form, gather=None):
    """``xla._general_matmul_fn``'s matmul, its operands smoothed or rotated first where MODE says (the ``_smooth``
    and ``_hadamard`` variants): x [M, K] and kernel [K, N] transformed in f32, then rounded back to their dtypes."""
    f = _general_matmul_fn(x_dtype, w_dtype, out_dtype, recipe, form, gather)
    transform = rotation if MODE["rotate"] else smoothing if MODE["smooth"] is not None else None
    if transform is None or gather is not None:
        return f

    def transformed(x, kernel, state, kernel_amax, hoisted):
        if hoisted is not None:
            raise ValueError("the smoothing and rotation variants take whole kernels, not block_kernel_for_update's")
        tx, tk = transform(x.astype(jnp.float32), kernel.astype(jnp.float32))
        return f(tx.astype(x.dtype), tk.astype(kernel.dtype), state, kernel_amax, hoisted)

    def rotated_forward(*args):  # the rotated product's value, the plain matmul's gradient (``rotate="fwd"``)
        plain = f(*args)
        return plain + jax.lax.stop_gradient(transformed(*args) - plain)

    return rotated_forward if MODE["rotate"] == "fwd" else transformed


def as_shipped_in_backward(fn, in_backward=lambda *args, **kwargs: True):
    """``fn`` traced with no patch and 128-wide groups where MODE's ``fwd_only`` says so and ``in_backward`` holds:
    the backward's quantizers of an ``int8_fwd_*`` variant."""
    def wrapped(*args, **kwargs):
        if not (MODE["fwd_only"] and in_backward(*args, **kwargs)):
            return fn(*args, **kwargs)
        saved = MODE["patch"], block.BLOCK
        MODE["patch"], block.BLOCK = None, WIDTH
        try:
            return fn(*args, **kwargs)
        finally:
            MODE["patch"], block.BLOCK = saved

    return wrapped


xla._general_matmul_fn = transformed_matmul_fn
xla.dgrad, xla.wgrad = as_shipped_in_backward(xla.dgrad), as_shipped_in_backward(xla.wgrad)
# the forward quantizes its input with cols=False; the backward's gradient tiles keep cols
block.tile_quantize_both = as_shipped_in_backward(block.tile_quantize_both, lambda *a, cols=True, **k: cols)
block.scales_of, block.quantize, xla.quantize, xla.mantissa_rounded = (
    patched_scales, patched_quantize(_block_quantize, ints=True), patched_quantize(_xla_quantize), shifted)


def check_width(g: int) -> None:
    """``block``'s quantizers traced now have g-wide groups: one scale per 1 x g tile and per g x g block, each
    group's amax on E4M3's max (tests/fp8/test_block_scaling.py checks them against a reference at 128 and 32)."""
    x = np.random.default_rng(0).normal(size=(3, 576)).astype(np.float32)
    q, inv = jax.jit(lambda a: block.tile_quantize(a, jnp.float8_e4m3fn))(x)
    assert inv.shape == (3, -(-576 // g)), inv.shape
    top = np.abs(np.pad(np.asarray(q, np.float32), [(0, 0), (0, -576 % g)])).reshape(3, -1, g).max(-1)
    assert (top == fp8_max(jnp.float8_e4m3fn)).all(), top
    _, inv = jax.jit(lambda a: block.block_quantize(a, jnp.float8_e4m3fn))(x.reshape(36, 48))
    assert inv.shape == (-(-36 // g), -(-48 // g)), inv.shape


def fp8_casts(step, *args) -> dict[str, int]:
    """How many conversions to each float8 dtype ``step``'s program (its gradient included) makes: an INT8 variant
    whose head is BF16 must make none (every block GEMM operand is then an integer held in f32)."""
    counts: dict[str, int] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            dtype = eqn.params.get("new_dtype")
            if eqn.primitive.name == "convert_element_type" and "float8" in str(dtype):
                counts[str(dtype)] = counts.get(str(dtype), 0) + 1
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(step)(*args).jaxpr)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="all", help="comma-separated names (the docstring's, or a form of "
                        "bench fidelity), or all (the docstring's)")
    parser.add_argument("--out", default="/tmp/fidelity_floor.json")
    parser.add_argument("--checkpoint", default=None, help="bench fidelity's --checkpoint: a trainer checkpoint's "
                        "SmolLM2 parameters instead of the shipped ones (the batches stay the shipped model's)")
    parser.add_argument("--seed", type=int, default=0, help="bench fidelity's --seed: which prompts make the batches")
    parser.set_defaults(model="smollm2")  # the model fidelity.describe names: the floor probes SmolLM2 alone
    args = parser.parse_args()
    config = load_config_file("configs/smollm2_arith.py")
    config.precision.mode, config.precision.backend = "fp8_e2e", "xla"
    base = plan.run_precision(config, "train")
    table = fidelity.forms(base)
    current = base.replace(recipe=dataclasses.replace(base.recipe, scaling="current", fp8_format="e4m3"))
    # name -> (precision, MODE's entries while it is traced, block.BLOCK)
    mode = lambda patch=None, c=1.0, int8_dtypes=None, bits=None, smooth=None, fwd_only=False, rotate=False: dict(  # noqa: E731
        patch=patch, c=c, int8_dtypes=int8_dtypes, bits=bits, smooth=smooth, fwd_only=fwd_only, rotate=rotate)
    variants = {"block_pow2": (table["block"][1], mode("pow2"), WIDTH),
                "block_nosub": (table["block"][1], mode("nosub"), WIDTH),
                "current_e4m3": (current, mode(), WIDTH), "current_e4m3_nosub": (current, mode("nosub"), WIDTH)}
    variants |= {f"mantissa_e4m3_c{c}": (table["mantissa_e4m3"][1], mode(c=c), WIDTH) for c in (1.1, 1.3, 1.55, 1.8)}
    variants["mantissa_e4m3_head_bf16_c1.3"] = (table["mantissa_e4m3_head_bf16"][1], mode(c=1.3), WIDTH)
    variants |= {f"mantissa_m{k}_head_bf16": (table["mantissa_e4m3_head_bf16"][1], mode(c=1.3, bits=k), WIDTH)
                 for k in (4, 5)}
    variants |= {f"block_g{g}": (table["block"][1], mode(), g) for g in (128, 64, 32, 16)}
    variants |= {f"block_head_bf16_g{g}": (table["block_head_bf16"][1], mode(), g) for g in (128, 64, 32, 16)}
    e4m3_only = {jnp.dtype(jnp.float8_e4m3fn)}  # block_hybrid's inputs and weights; its E5M2 gradients stay
    variants |= {f"int8_{f}": (table[f][1], mode("int8", int8_dtypes=e4m3_only if f == "block_hybrid" else None),
                               WIDTH) for f in ("block", "block_head_bf16", "block_fprop_only", "block_hybrid")}
    variants |= {f"int8_block_head_bf16_g{g}": (table["block_head_bf16"][1], mode("int8"), g) for g in (64, 32, 16)}
    variants |= {f"int8_block_g{g}": (table["block"][1], mode("int8"), g) for g in (64, 32, 16)}
    two_linears = lambda f: table[f][1].replace(fused_mlp=False)  # noqa: E731
    variants |= {"block_head_bf16_two_linears": (two_linears("block_head_bf16"), mode(), WIDTH),
                 "block_head_bf16_smooth": (two_linears("block_head_bf16"), mode(smooth=0.5), WIDTH),
                 "int8_block_head_bf16_smooth": (two_linears("block_head_bf16"), mode("int8", smooth=0.5), WIDTH),
                 "int8_block_smooth": (two_linears("block"), mode("int8", smooth=0.5), WIDTH)}
    variants |= {f"int8_fwd_{f}_g32": (two_linears(f), mode("int8", fwd_only=True), 32)
                 for f in ("block", "block_head_bf16")}
    variants["int8_block_head_bf16_g32_two_linears"] = (two_linears("block_head_bf16"), mode("int8"), 32)
    variants |= {"block_two_linears": (two_linears("block"), mode(), WIDTH),
                 "block_hadamard": (two_linears("block"), mode(rotate=True), WIDTH),
                 "block_head_bf16_hadamard": (two_linears("block_head_bf16"), mode(rotate=True), WIDTH)}
    variants |= {f"int8_{f}_hadamard": (two_linears(f), mode("int8", rotate=True), WIDTH)
                 for f in ("block", "block_head_bf16")}
    variants |= {f"int8_{f}_two_linears": (two_linears(f), mode("int8"), WIDTH) for f in ("block", "block_head_bf16")}
    variants |= {f"int8_fwd_{f}_hadamard": (two_linears(f), mode("int8", fwd_only=True, rotate="fwd"), WIDTH)
                 for f in ("block", "block_head_bf16")}
    floor_variants = list(variants)
    variants |= {f: (precision, mode(), WIDTH) for f, (_, precision) in table.items() if f not in variants}
    names = floor_variants if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in variants]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(variants)}")

    batch_args = argparse.Namespace(pool=32, prompts=4, samples=4, seed=args.seed)  # bench fidelity's defaults
    spec = plan.model_spec(config)
    model, params, tokenizer = loading.load_model(dataclasses.replace(spec, source="smollm2", tokenizer="",
                                                                      num_layers=0))
    probe, calib = fidelity.sample_batches(config, model, params, tokenizer, batch_args)
    if args.checkpoint:
        model, params = fidelity.trained_params(config, args.checkpoint, model)
    loss_cfg = plan.loss_config(config)
    ref_logp, ref_grad = fidelity.run_form(fidelity._loss_and_grad(model, Precision(compute_dtype="float32"),
                                                                   loss_cfg), params, probe, None)
    observed = fidelity.calibration(fidelity._loss_and_grad(model, base, loss_cfg), model, params, base, calib)
    rows = []
    for name in names:
        precision, settings, width = variants[name]
        MODE.update(settings)
        block.BLOCK = width  # read by block's functions when they are traced (run_form's jit), not when defined
        if MODE["patch"] is None:
            check_width(width)
        t = time.perf_counter()
        try:
            state = update_state(llama.init_fp8_state(model, precision), observed, precision.recipe)
            step = fidelity._loss_and_grad(model, precision, loss_cfg)
            casts = None
            if MODE["patch"] == "int8":
                casts = fp8_casts(step, params, state, probe["tokens"], probe["mask"], probe["advantages"])
                if not precision.lm_head_grad_fp8 and MODE["int8_dtypes"] is None and not MODE["fwd_only"] and casts:
                    raise AssertionError(f"{name}: an FP8 cast left in an all-INT8 program: {casts}")
            logp, grad = fidelity.run_form(step, params, probe, state)
        finally:
            block.BLOCK = WIDTH
        row = {"form": name, "logp_err_vs_f32": float(np.abs(logp - ref_logp)[probe["mask"]].mean()),
               **fidelity.grad_metrics(grad, ref_grad, model), "seconds": round(time.perf_counter() - t, 1),
               **({} if casts is None else {"fp8_casts": casts}),
               "device": jax.devices()[0].platform}
        print(json.dumps({k: v for k, v in row.items() if k not in ("per_layer", "per_role")}), flush=True)
        rows.append(row)
        jax.clear_caches()
    out = {"device": rows[0]["device"], "commit": tree_commit(), "command": "python benchmarks/fidelity_floor.py "
           + " ".join(sys.argv[1:]), "model": fidelity.describe(model, args),
           "config": "configs/smollm2_arith.py", "batch": probe["info"], "what": __doc__.split("\n\n", 2)[2].strip(),
           "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
