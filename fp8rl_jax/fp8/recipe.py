"""Delayed-scaling FP8: the recipe, the state pytree, quantization and the scale update.

Design note
-----------
Formats. E4M3 (max 448, 3 mantissa bits) has the precision that weights and activations need; E5M2 (max 57344,
2 mantissa bits) has the range that gradients need. ``hybrid`` uses E4M3 forward and E5M2 backward; ``e4m3`` uses
E4M3 everywhere. Both are the OCP "fn" variants that XLA, ml_dtypes and Transformer Engine share.

Delayed scaling. Every FP8 linear has three tensors to quantize, its *roles*: the input ``x``, the ``kernel`` and
the output gradient ``grad``. Each role keeps a per-tensor ``scale`` and an ``amax_history`` (newest first). A
tensor is quantized with the scale computed from amaxes seen in *earlier* steps, so quantizing needs no reduction
over the tensor before the GEMM:

    q = saturate(x * scale)            # then cast to FP8, round to nearest even
    x ~= q / scale                     # the GEMM rescales its f32 accumulator by 1/(scale_a * scale_b)

After a train step, each role's amax is pushed to the front of its history and

    scale = fp8_max / amax / 2**margin,   amax = max(history)  (or history[0] for ``most_recent``)

A role whose amax is 0 or not finite keeps its old scale; an amax so small that ``fp8_max / amax`` overflows f32
(e.g. 1e-37 for E4M3) gets the largest finite f32 as its scale, never inf (``0 * inf`` would quantize zeros to
NaN). This follows Transformer Engine's DelayedScaling (same formula, same meaning of margin and of the two
algorithms, the same two guards), so the ``te`` and ``xla`` backends read one state and quantize alike.

One state, two consumers. The state is a pytree of plain arrays beside the params, checkpointed with them.
Only the train step changes it; rollout reads it. Rollout and the training forward therefore quantize every
kernel with the same scale and get bit-identical FP8 operands, which is what keeps importance weights near 1.

How the amaxes leave a jitted step. The amaxes of ``x`` and ``kernel`` are known in the forward pass, the amax
of ``grad`` only in the backward pass. The FP8 linears are ``custom_vjp`` functions whose cotangent for the
state is not a gradient: row 0 of each ``amax_history`` cotangent carries the amax observed in this call, the
rest is zero. ``jax.grad`` with respect to ``(params, fp8_state)`` therefore returns the observations;
``update_state`` rolls them in. Observations from several microbatches combine with ``max`` (they are
non-negative), never with a sum.

Other scalings (``Fp8Recipe.scaling``; the ``xla`` backend only, ``xla.py``): ``rowwise`` (the forward per token and
per output channel, current), ``current`` (per tensor, each tensor's own amax in the call: TE's Float8CurrentScaling)
and ``block`` (1 x 128 activation tiles and 128 x 128 weight blocks, forward and backward: ``block.py``). The
fidelity probe has one more, ``mantissa``, which no config accepts: no scale at all, every GEMM operand rounded to
the format's mantissa with an unbounded exponent (``numerics.mantissa_rounded``), the error that E4M3's or E5M2's
mantissa leaves under the best power-of-2 scaling of any granularity (scales that are not powers of 2 can do better:
each group's amax lands on fp8_max exactly). They all still report the three amaxes per call, so the state keeps one
layout. ``fp8_gemms`` names the GEMMs that run in
FP8 (the forward ``fprop``, the input gradient ``dgrad``, the weight gradient ``wgrad``); the others run on the
compute dtype's operands with f32 accumulation.

Left out: MXFP8 / NVFP4 (Blackwell) and FP8 for attention softmax; the KV cache has its own per-layer scales
(``kv.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# the FP8 primitives: defined below every FP8 layer (the kernels use them too), re-exported as the recipe's names
from fp8rl_jax.numerics import amax as amax
from fp8rl_jax.numerics import fp8_max as fp8_max
from fp8rl_jax.numerics import quantize as quantize
from fp8rl_jax.numerics import rounded as rounded

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
ROLES = ("x", "kernel", "grad")
FORMATS = ("hybrid", "e4m3")
AMAX_ALGOS = ("max", "most_recent")
F32_MAX = float(jnp.finfo(jnp.float32).max)  # the scale of an amax too small for fp8_max / amax to fit in f32

Fp8Meta = dict[str, jax.Array]  # {"scale": f32[], "amax_history": f32[H]}
Fp8LinearState = dict[str, Fp8Meta]  # {"x": Fp8Meta, "kernel": Fp8Meta, "grad": Fp8Meta}


# "tensor": delayed, per tensor (the default); "rowwise": the forward per token x per output channel, current;
# "current": per tensor, current; "block": 1 x 128 tiles / 128 x 128 blocks, current, forward and backward;
# "mantissa" (the fidelity probe's only, never a config value): no scale, every operand rounded to the format's
# mantissa with an unbounded exponent (``numerics.mantissa_rounded``), what power-of-2 scales reach at best
SCALINGS = ("tensor", "rowwise", "current", "block", "mantissa")
GEMMS = ("fprop", "dgrad", "wgrad")  # y = x w, dx = g w^T, dw = x^T g
# block scaling's GEMM on a Hopper GPU: the Mosaic GPU kernel (kernels.block_gemm), cuBLASLt's block-scaled FP8
# (kernels.cublaslt, an XLA FFI call; registered by plan.py), or auto: cuBLASLt above a decode step's rows
# (kernels.block_gemm.SMALL_M) and where 128 x 128 tiles fill the GPU, the Mosaic kernel's small-row tunings for the
# rest (kernels.block_gemm.prefers_cublaslt); elsewhere all are block.block_gemm's emulation
BLOCK_GEMMS = ("mosaic", "cublaslt", "auto")
# block scaling's forward operands, the rollout's and the training forward's (an ablation: which half of block's
# forward does what rowwise's does not; the backward keeps block's tiles): tiles_blocks, DeepSeek-V3's (the input in
# 1 x 128 tiles, the weight in 128 x 128 blocks); tiles_channels (the weight one scale per output channel, as
# rowwise's); tokens_blocks (the input one scale per token, as rowwise's)
BLOCK_FORWARDS = ("tiles_blocks", "tiles_channels", "tokens_blocks")
# block scaling's weight-gradient operands: grad_blocks, the default (x in 128 x 1 tiles along the tokens, g in 128 x
# 128 blocks: one operand in blocks, the form Hopper's block-scaled GEMMs run at about 1.25x per-tensor FP8's time);
# tiles, DeepSeek-V3's (g in 128 x 1 tiles too: about 1.5x). The same gradient error and learning (docs/accuracy.md,
# "Block-scaled FP8"); speed: benchmarks/RESULTS.md, "Block-scaled FP8 on Hopper"
BLOCK_WGRADS = ("grad_blocks", "tiles")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """Delayed-scaling recipe. Hashable, so it can be a static argument of jitted functions."""

    margin: int = 0
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    fp8_format: str = "hybrid"
    # forward GEMM scaling: "tensor" (one delayed scale per tensor) | "rowwise" (each token's activation row and each
    # output channel of the kernel scaled by its own current amax; the backward stays per tensor; xla backend only)
    # | "current" (one scale per tensor from its own amax, all three GEMMs; xla only) | "block" (1 x 128 activation
    # and gradient tiles, 128 x 128 weight blocks, each scaled by its current amax, all three GEMMs; xla only)
    # | "mantissa" (probe only: each operand rounded to the format's 3 or 2 mantissa bits with f32's exponent range,
    # kept in f32, inverse scale 1: the best any power-of-2 scaling can do; xla only, the f32 GEMM form always)
    scaling: str = "tensor"
    # the GEMMs that run in FP8, the rest on compute-dtype operands (f32 accumulation): a subset of GEMMS, in order
    fp8_gemms: tuple[str, ...] = GEMMS
    block_gemm: str = "auto"  # of BLOCK_GEMMS: who runs block scaling's GEMMs on a Hopper GPU
    block_forward: str = "tiles_blocks"  # of BLOCK_FORWARDS: block scaling's forward operands (an ablation)
    block_wgrad: str = "grad_blocks"  # of BLOCK_WGRADS: block scaling's weight-gradient operands

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling={self.scaling!r}; allowed: {SCALINGS}")
        if self.block_gemm not in BLOCK_GEMMS:
            raise ValueError(f"block_gemm={self.block_gemm!r}; allowed: {BLOCK_GEMMS}")
        if self.block_forward not in BLOCK_FORWARDS:
            raise ValueError(f"block_forward={self.block_forward!r}; allowed: {BLOCK_FORWARDS}")
        if self.block_forward != "tiles_blocks" and self.scaling != "block":
            raise ValueError(f"block_forward={self.block_forward!r} is a form of block scaling, not of "
                             f"scaling={self.scaling!r}")
        if self.block_wgrad not in BLOCK_WGRADS:
            raise ValueError(f"block_wgrad={self.block_wgrad!r}; allowed: {BLOCK_WGRADS}")
        if self.block_wgrad != "grad_blocks" and self.scaling != "block":
            raise ValueError(f"block_wgrad={self.block_wgrad!r} is a form of block scaling, not of "
                             f"scaling={self.scaling!r}")
        gemms = tuple(self.fp8_gemms)
        if not gemms or any(g not in GEMMS for g in gemms) or len(set(gemms)) != len(gemms):
            raise ValueError(f"fp8_gemms={self.fp8_gemms!r}; allowed: a non-empty subset of {GEMMS}")
        object.__setattr__(self, "fp8_gemms", tuple(g for g in GEMMS if g in gemms))  # one spelling, one hash
        if self.fp8_format not in FORMATS:
            raise ValueError(f"fp8_format={self.fp8_format!r}; allowed: {FORMATS}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo={self.amax_compute_algo!r}; allowed: {AMAX_ALGOS}")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len={self.amax_history_len}; must be >= 1")
        if self.margin < 0:
            raise ValueError(f"margin={self.margin}; must be >= 0")

    @property
    def standard(self) -> bool:
        """All three GEMMs in FP8 with per-tensor delayed or rowwise scaling: the FP8 linears' original path."""
        return self.fp8_gemms == GEMMS and self.scaling in ("tensor", "rowwise")

    @property
    def delayed(self) -> bool:
        """Whether the linears read the state's delayed scales (``tensor``; ``rowwise``'s backward). Under
        ``current``, ``block`` and ``mantissa`` scaling each scale is its operand's own: the state is never read,
        and the linears observe nothing into it (each amax would be a pass over an activation or a gradient)."""
        return self.scaling in ("tensor", "rowwise")

    @property
    def tiles_forward(self) -> bool:
        """Block scaling whose forward GEMM runs in FP8 on 1 x 128 tiles of its input (``block_forward`` tiles_*): the
        form a kernel that makes the input (a norm, the decode attention) can hand over as ``block.Tiles``."""
        return self.scaling == "block" and self.block_forward != "tokens_blocks" and "fprop" in self.fp8_gemms

    @property
    def grad_blocks(self) -> bool:
        """Block scaling whose weight gradient takes the output gradient in 128 x 128 blocks (``block_wgrad``'s
        default): ``block.tile_quantize_both``'s second form with ``col_blocks``."""
        return self.scaling == "block" and self.block_wgrad == "grad_blocks"

    @property
    def fwd_dtype(self):
        return E4M3

    @property
    def bwd_dtype(self):
        return E5M2 if self.fp8_format == "hybrid" else E4M3

    def dtype_of(self, role: str):
        return self.bwd_dtype if role == "grad" else self.fwd_dtype


def init_meta(history_len: int, stack: tuple[int, ...] = ()) -> Fp8Meta:
    """Scale 1 and an empty history, optionally stacked (e.g. ``stack=(num_layers,)``)."""
    return {
        "scale": jnp.ones(stack, jnp.float32),
        "amax_history": jnp.zeros((*stack, history_len), jnp.float32),
    }


def init_linear_state(recipe: Fp8Recipe, stack: tuple[int, ...] = ()) -> Fp8LinearState:
    return {role: init_meta(recipe.amax_history_len, stack) for role in ROLES}


def with_input_scale_inv(fp8_state):
    """``fp8_state`` (any tree of linear states: a model's, stacked or per layer) with ``1 / scale`` beside each
    input scale (``state["x"]["scale_inv"]``), for programs that run the forward many times with fixed scales (the
    rollout): a pre-quantized GEMM then reads its input's inverse scale instead of computing it each time."""
    if isinstance(fp8_state, dict):
        out = {k: with_input_scale_inv(v) for k, v in fp8_state.items()}
        x = out.get("x")
        if isinstance(x, dict) and "scale" in x and "amax_history" in x:
            out["x"] = {**x, "scale_inv": 1.0 / x["scale"].astype(jnp.float32)}
        return out
    if isinstance(fp8_state, (tuple, list)):
        return type(fp8_state)(with_input_scale_inv(v) for v in fp8_state)
    return fp8_state


def quantize_input(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """A GEMM input ``quantize``d, or ``x`` as it is where it is FP8 already: quantized with ``scale`` beforehand
    (the decode attention kernel writes ``wo``'s input so)."""
    return x if jnp.dtype(x.dtype).itemsize == 1 else quantize(x, scale, dtype)


def scale_from_history(history: jax.Array, old_scale: jax.Array, dtype, recipe: Fp8Recipe) -> jax.Array:
    """``fp8_max / amax / 2**margin`` over the last axis of ``history``; keeps ``old_scale`` where amax is 0 or not
    finite, and gives the largest finite f32 where the quotient overflows (a tiny positive amax)."""
    if recipe.amax_compute_algo == "max":
        a = jnp.max(history, axis=-1)
    else:
        a = history[..., 0]
    return scale_from_amax(a, old_scale, fp8_max(dtype), recipe.margin)


def scale_from_amax(a: jax.Array, old_scale: jax.Array | float, limit: float, margin: int = 0) -> jax.Array:
    """``limit / a / 2**margin`` as f32, guarded as Transformer Engine guards it: ``old_scale`` where ``a`` is 0 or
    not finite, ``F32_MAX`` where the quotient overflows to inf. Shared by the FP8 linears and the KV cache."""
    a = jnp.asarray(a, jnp.float32)
    fresh = jnp.float32(limit) / a / jnp.float32(2.0**margin)
    fresh = jnp.where(jnp.isinf(fresh), F32_MAX, fresh)
    ok = (a > 0) & jnp.isfinite(a)
    return jnp.where(ok, fresh, old_scale).astype(jnp.float32)


def update_meta(meta: Fp8Meta, observed: jax.Array, dtype, recipe: Fp8Recipe) -> Fp8Meta:
    """Push ``observed`` (shape = scale's shape) to the front of the history and recompute the scale.

    A non-finite observation (a NaN step) is recorded as 0, so it neither poisons the window nor moves the scale.
    """
    observed = jnp.where(jnp.isfinite(observed), observed, 0.0).astype(jnp.float32)
    hist = jnp.roll(meta["amax_history"], 1, axis=-1)
    hist = hist.at[..., 0].set(observed)
    return {"scale": scale_from_history(hist, meta["scale"], dtype, recipe), "amax_history": hist}


def _is_meta(node) -> bool:
    return isinstance(node, dict) and set(node) == {"scale", "amax_history"}


def _is_linear_state(node) -> bool:
    return isinstance(node, dict) and set(node) == set(ROLES) and all(_is_meta(node[r]) for r in ROLES)


def update_state(state, observations, recipe: Fp8Recipe):
    """Roll observed amaxes into every linear's state.

    ``observations`` has the structure of ``state`` (it is what ``jax.grad`` returns for it): row 0 of each
    ``amax_history`` holds the amax observed in the step.
    """

    def update_linear(lin, obs):
        return {
            role: update_meta(lin[role], obs[role]["amax_history"][..., 0], recipe.dtype_of(role), recipe)
            for role in ROLES
        }

    return jax.tree.map(update_linear, state, observations, is_leaf=_is_linear_state)


def combine_observations(a, b):
    """Merge observations of two microbatches: elementwise max (amaxes are >= 0)."""
    return jax.tree.map(jnp.maximum, a, b)


def observation_cotangent(meta: Fp8Meta, observed: jax.Array) -> Fp8Meta:
    """The cotangent the FP8 linears return for one role: ``observed`` in history row 0, zeros elsewhere."""
    hist = jnp.zeros_like(meta["amax_history"]).at[..., 0].set(observed.astype(jnp.float32))
    return {"scale": jnp.zeros_like(meta["scale"]), "amax_history": hist}


def observations(state: Fp8LinearState, amax_x: jax.Array, amax_kernel: jax.Array,
                 amax_grad: jax.Array) -> Fp8LinearState:
    """A linear's state cotangent: the three amaxes observed in one forward + backward call."""
    amaxes = {"x": amax_x, "kernel": amax_kernel, "grad": amax_grad}
    return {role: observation_cotangent(state[role], amaxes[role]) for role in ROLES}

