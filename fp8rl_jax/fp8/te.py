"""The ``te`` FP8 backend: Transformer Engine's cuBLASLt FP8 GEMMs, on operands quantized by XLA (GPU only).

Same contract as ``xla``: the scales come from our FP8 state (``recipe.py``), and the state's cotangent carries
the amaxes observed in the call. TE's own ``dense`` returns its *updated quantizer state* as the cotangent,
which adds up wrongly across microbatches and re-implements the scale update; so this module builds its own
``custom_vjp`` around TE's GEMM (``tex.gemm``), following ``transformer_engine.jax.dense``:

    forward   y  = gemm(q(x) [M, K],      q(w) as [N, K])          both K-major: Hopper's FP8 GEMMs need "TN"
    dgrad     dx = gemm(q(g) [M, N],      q(w) as [K, N])
    wgrad     dw = gemm(q(x) as [K, M],   q(g) as [N, M])

Quantization is ``recipe.quantize`` (``saturate(x * scale)``, round-to-nearest-even: the bits TE's cast kernel
writes) and the amaxes are ``recipe.amax``, plain XLA ops. XLA fuses them into the kernels that produce their inputs
(the RMSNorm, the SwiGLU, the residual gradient), where TE's ``tex.quantize`` was a kernel of its own per tensor
that read the BF16 (for an f32 output: an f32 copy) and wrote both FP8 layouts. The transposed layouts the wgrad
needs (token-minor: the weight gradient contracts over the tokens) are made in the backward pass by a byte
transpose kernel (``kernels.transpose``). A GEMM writes its output in the dtype wanted (f32 for the residual stream
and the weight gradient), not in its input's, in the rollout's GEMM (``prequantized_matmul``) as in training's.
The same code quantizes the rollout's activations and the training forward's, and the kernel's bits are
``xla.quantize_kernel``'s in both. On one device the kernels' FP8 operands can be made once per optimizer update
(``TrainKernel``, ``quantize_for_update``) instead of in every forward.

Transformer Engine is imported lazily; ``pip install "transformer-engine[jax]"`` on a CUDA host provides it.
Import it (``preload()``) before JAX initialises its GPU backend: JAX loads its own cuDNN, and a TE core library
linked against another cuDNN then fails to load ("undefined symbol ... libcudnn_graph.so.9", seen on the H100
image). ``main`` and the benchmarks call ``preload()`` first. Before TE, the import loads the cuDNN of JAX's
wheels (``_load_jax_cudnn``), so that both use one cuDNN: with two, cuDNN's flash attention failed in its backward.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.recipe import Fp8LinearState, Fp8Recipe, amax, observations, quantize, quantize_input
from fp8rl_jax.fp8.train_kernel import TrainKernel
from fp8rl_jax.fp8.xla import QuantizedKernel
from fp8rl_jax.kernels.swiglu_grad import swiglu_grad_fp8
from fp8rl_jax.kernels.transpose import transpose_bytes
from fp8rl_jax.parallel import fsdp

quantize_kernel = xla.quantize_kernel  # same bits as TE's cast kernel; one place to get them from


_CUDNN = {"shared": False}  # "shared": set when TE was imported after JAX's own cuDNN (``_load_jax_cudnn``)
_CUDNN_LIBS = ("graph", "engines_precompiled", "engines_runtime_compiled", "heuristic", "ops", "cnn", "adv", "")


def _load_jax_cudnn() -> bool:
    """Load every library of the cuDNN that JAX's CUDA wheels ship (``nvidia.cudnn``) into the global namespace,
    before Transformer Engine loads, so that TE's core binds to the cuDNN JAX uses. Otherwise TE's core brings the
    system's cuDNN (9.14 on the H100 image against the wheel's 9.19), JAX's cuDNN front then runs on the other's
    sub-libraries, and cuDNN's flash attention backward fails to load (measured: ``benchmarks/cudnn_te_check.py``).
    False where the wheel is not there (TE then loads as before)."""
    try:
        import nvidia.cudnn
    except ImportError:
        return False
    lib = os.path.join(list(nvidia.cudnn.__path__)[0], "lib")
    paths = [os.path.join(lib, f"libcudnn{'_' + name if name else ''}.so.9") for name in _CUDNN_LIBS]
    if not all(os.path.exists(p) for p in paths):
        return False
    try:
        for p in paths:
            ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    return True


@functools.cache
def _te():
    shared = _load_jax_cudnn()
    try:
        from transformer_engine.jax import cpp_extensions as tex
        from transformer_engine.jax.quantize import ScaledTensorFactory, ScalingMode
    except (ImportError, OSError) as e:
        raise ImportError(
            "precision.backend='te' needs Transformer Engine for JAX on a CUDA GPU "
            "(pip install 'transformer-engine[jax]'); use precision.backend='xla' elsewhere. "
            "If a cuDNN symbol is missing, import Transformer Engine before JAX starts its GPU backend "
            f"(fp8rl_jax.fp8.te.preload()). Import failed with: {e}"
        ) from e
    _CUDNN["shared"] = shared
    return {"tex": tex, "Factory": ScaledTensorFactory, "Mode": ScalingMode}


def preload() -> bool:
    """Import Transformer Engine now, if it is installed (see the module docstring); True on success."""
    try:
        _te()
    except ImportError:
        return False
    return True


def mesh_resource() -> contextlib.AbstractContextManager:
    """TE's global ``MeshResource`` for our mesh axes (``parallel.mesh``), as a context: TE's primitives' custom
    partitioning then all-gathers an FSDP-sharded weight, all-reduces a GEMM whose contraction is split over
    ``tensor``, and max-reduces the amax of every FP8 cast over the whole mesh (GPU with Transformer Engine only)."""
    if not preload():  # TE's own import, in the order this module needs (cuDNN)
        raise ImportError("precision.backend='te' needs Transformer Engine for JAX on a CUDA GPU "
                          "(pip install 'transformer-engine[jax]'); use precision.backend='xla' elsewhere")
    from transformer_engine.jax.sharding import MeshResource, global_shard_guard

    # batch over data (and fsdp), weights over fsdp, heads / MLP columns over tensor. No tensor-sequence,
    # pipeline, context or expert parallelism here.
    return global_shard_guard(MeshResource(dp_resource="data", fsdp_resource="fsdp", tp_resource="tensor"))


def shares_jax_cudnn() -> bool:
    """Whether Transformer Engine was imported here (``preload``) after JAX's own cuDNN (``_load_jax_cudnn``), so
    that both use one cuDNN; False before that import, or where it failed."""
    return _CUDNN["shared"]


def is_available() -> bool:
    """Transformer Engine imports and a GPU is visible."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the ``te`` backend cannot run here (the import error, or no GPU), or None when it can."""
    try:
        _te()
    except ImportError as e:
        return f"Transformer Engine does not import: {e.__cause__ or e}"
    if not any(d.platform == "gpu" for d in jax.devices()):
        platforms = sorted({d.platform for d in jax.devices()})
        return f"Transformer Engine imports, but JAX sees no GPU (devices: {', '.join(platforms)})"
    return None


def _operand(data: jax.Array, scale_inv: jax.Array, out_dtype) -> object:
    """FP8 ``data`` [rows, K] (contracted on its last axis) as an operand of TE's GEMM. A GEMM writes its output in
    its left operand's ``out_dtype`` (TE's ``dq_dtype``), so an f32 or BF16 result needs no conversion after it."""
    t = _te()
    return t["Factory"].create_1x(data, jnp.asarray(scale_inv, jnp.float32).reshape(1),
                                  scaling_mode=t["Mode"].DELAYED_TENSOR_SCALING, dq_dtype=out_dtype)


def _gemm(lhs, rhs) -> jax.Array:
    """``lhs [M, K] . rhs [N, K] -> [M, N]``: both operands K-major, the one layout Hopper's FP8 GEMMs take."""
    return _te()["tex"].gemm(lhs, rhs, contracting_dims=((1,), (1,)))


def _inv(scale: jax.Array) -> jax.Array:
    return 1.0 / scale.astype(jnp.float32)


def prequantized_matmul(x: jax.Array, kernel: QuantizedKernel, x_scale: jax.Array, recipe: Fp8Recipe, *,
                        out_dtype=None, x_scale_inv: jax.Array | None = None) -> jax.Array:
    """``x [M, K] @ kernel`` with the kernel already FP8 [N, K]; returns [M, N] in ``out_dtype`` (default
    ``x.dtype``), written so by the GEMM as the training forward writes it (an f32 output is never rounded to BF16
    first). ``x`` is quantized by XLA, inside the fusion that produces it (see the module docstring).
    ``x_scale_inv``: ``1 / x_scale`` made beforehand (``recipe.with_input_scale_inv``; the rollout's, once per RL
    step): the GEMM reads it from memory, and computed here it is a one-thread XLA kernel before every GEMM.
    An FP8 ``x`` is already quantized with ``x_scale`` (then ``out_dtype`` is required)."""
    if jnp.dtype(x.dtype).itemsize == 1 and out_dtype is None:
        raise ValueError("a pre-quantized FP8 input needs out_dtype")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    qx = quantize_input(x, x_scale, recipe.fwd_dtype)
    x_scale_inv = _inv(x_scale) if x_scale_inv is None else x_scale_inv
    return _gemm(_operand(qx, x_scale_inv, out_dtype), _operand(kernel.data, kernel.scale_inv, out_dtype))


def quantize_for_update(kernel: jax.Array, scale: jax.Array, recipe: Fp8Recipe) -> TrainKernel:
    """``kernel`` [K, N] (or stacked [L, K, N] with ``scale`` [L]) as a ``TrainKernel``: the same bits the forward
    would make from it (``recipe.quantize`` with the delayed scale; a kernel's transpose)."""
    if kernel.ndim == 3:
        return jax.vmap(lambda k, s: quantize_for_update(k, s, recipe))(kernel, scale)
    kn = quantize(kernel, scale, recipe.fwd_dtype)
    return TrainKernel(kernel, kn, transpose_bytes(kn, tokens=False), amax(kernel))


@functools.cache
def _fp8_matmul_fn(x_dtype, w_dtype, out_dtype, recipe: Fp8Recipe, gather: P | None = None):
    fwd_dtype, bwd_dtype = recipe.fwd_dtype, recipe.bwd_dtype

    @jax.custom_vjp
    def f(x, kernel, state, kernel_amax, hoisted):
        return fwd(x, kernel, state, kernel_amax, hoisted)[0]

    def fwd(x, kernel, state, kernel_amax, hoisted):
        s_x = state["x"]["scale"]
        qx = quantize(x, s_x, fwd_dtype)  # [M, K], fused by XLA into the op that produces x
        s_w = state["kernel"]["scale"]
        if hoisted is not None:  # made once for the update (``TrainKernel``)
            qw, w_nk = hoisted
        elif gather is None:  # [K, N] (the dgrad's layout, kept) and its transpose [N, K] for this GEMM
            qw = quantize(kernel, s_w, fwd_dtype)
            w_nk = transpose_bytes(qw, tokens=False)
        else:  # [N, K]: each FSDP shard quantized where it is and its FP8 bits gathered (``parallel.fsdp``)
            qw = w_nk = xla.quantize_kernel(kernel, state["kernel"], recipe, "f8", gather).data
        y = _gemm(_operand(qx, _inv(s_x), out_dtype), _operand(w_nk, _inv(s_w), out_dtype))
        amax_w = amax(kernel) if kernel_amax is None else kernel_amax
        return y, (qx, qw, state, amax(x), amax_w, kernel_amax)

    def bwd(residuals, g):
        qx, qw, state, amax_x, amax_w, kernel_amax = residuals
        s_x, s_w, s_g = (state[r]["scale"] for r in ("x", "kernel", "grad"))
        qg = quantize(g, s_g, bwd_dtype)  # [M, N]
        # dx [M, K] = g [M, N] . w [N, K]: the kernel laid out [K, N], contracted on N
        w_kn = qw if gather is None else transpose_bytes(qw, tokens=False)
        dx = _gemm(_operand(qg, _inv(s_g), x_dtype), _operand(w_kn, _inv(s_w), x_dtype))
        # dw [K, N] = x [M, K]^T . g [M, N]: both laid out token-minor, contracted on M; written in the master's dtype
        dw = _gemm(_operand(transpose_bytes(qx), _inv(s_x), w_dtype),
                   _operand(transpose_bytes(qg), _inv(s_g), w_dtype))
        if gather is not None:  # the devices' partial wgrads summed onto the master's shards (a reduce-scatter)
            dw = fsdp.reduce_to(dw, gather)
        no_amax = None if kernel_amax is None else jnp.zeros_like(kernel_amax)  # not differentiated
        return dx, dw, observations(state, amax_x, amax_w, amax(g)), no_amax, None

    f.defvjp(fwd, bwd)
    return f


def fp8_matmul(
    x: jax.Array, kernel: jax.Array | TrainKernel, state: Fp8LinearState, recipe: Fp8Recipe, out_dtype=None, *,
    gather: P | None = None, kernel_amax: jax.Array | None = None,
) -> jax.Array:
    """Differentiable FP8 ``x [M, K] @ kernel [K, N]`` through Transformer Engine's GEMMs (see module docstring).
    ``gather`` / ``kernel_amax``: an FSDP-sharded kernel, as in ``xla.fp8_matmul``. A ``TrainKernel`` brings its FP8
    operands and amax made once for the update; the gradient goes to its master."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    hoisted = None
    if isinstance(kernel, TrainKernel):
        if gather is not None:
            raise ValueError("a TrainKernel is a whole kernel; an FSDP-sharded one is gathered per layer instead")
        kernel, hoisted, kernel_amax = kernel.master, (kernel.kn, kernel.nk), kernel.amax
    fn = _fp8_matmul_fn(jnp.dtype(x.dtype), jnp.dtype(kernel.dtype), out_dtype, recipe, gather)
    return fn(x, kernel, state, kernel_amax, hoisted)


@functools.cache
def _fp8_swiglu_mlp_fn(x_dtype, out_dtype, gu_dtype, down_dtype, recipe: Fp8Recipe):
    fwd_dtype, bwd_dtype = recipe.fwd_dtype, recipe.bwd_dtype

    @jax.custom_vjp
    def fp8_swiglu_mlp(x, w_gate_up, w_down, st_gu, st_down, hoisted):
        return fwd(x, w_gate_up, w_down, st_gu, st_down, hoisted)[0]

    def fwd(x, w_gate_up, w_down, st_gu, st_down, hoisted):
        (gu_kn, gu_nk, gu_amax), (down_kn, down_nk, down_amax) = hoisted
        s_x, s_h = st_gu["x"]["scale"], st_down["x"]["scale"]
        # the two linears' forwards exactly (the rollout runs them as two ``linear`` calls)
        qx = quantize(x, s_x, fwd_dtype)
        gate_up = _gemm(_operand(qx, _inv(s_x), x_dtype), _operand(gu_nk, _inv(st_gu["kernel"]["scale"]), x_dtype))
        gate, up = jnp.split(gate_up, 2, axis=-1)
        qh = quantize(jax.nn.silu(gate) * up, s_h, fwd_dtype)
        y = _gemm(_operand(qh, _inv(s_h), out_dtype), _operand(down_nk, _inv(st_down["kernel"]["scale"]), out_dtype))
        # q(h) is not kept: the backward's kernel makes its transpose, from gate_up
        return y, (qx, gate_up, st_gu, st_down, amax(x), gu_kn, down_kn, gu_amax, down_amax)

    def bwd(residuals, g):
        qx, gate_up, st_gu, st_down, amax_x, gu_kn, down_kn, gu_amax, down_amax = residuals
        s_x, s_h = st_gu["x"]["scale"], st_down["x"]["scale"]
        s_gy, s_ggu = st_down["grad"]["scale"], st_gu["grad"]["scale"]
        s_gu, s_down = st_gu["kernel"]["scale"], st_down["kernel"]["scale"]
        qgy = quantize(g, s_gy, bwd_dtype)  # [M, D]
        # g_h [M, F] = g [M, D] . w_down [F, D]^T
        g_h = _gemm(_operand(qgy, _inv(s_gy), x_dtype), _operand(down_kn, _inv(s_down), x_dtype))
        qh_t, qg, qg_t, amax_h, amax_g = swiglu_grad_fp8(gate_up, g_h, s_h, s_ggu, fwd_dtype, bwd_dtype)
        # dw_down [F, D] = h^T g;  dx [M, D] = g_gu [M, 2F] . w_gate_up [D, 2F]^T;  dw_gate_up [D, 2F] = x^T g_gu
        d_down = _gemm(_operand(qh_t, _inv(s_h), down_dtype), _operand(transpose_bytes(qgy), _inv(s_gy), down_dtype))
        dx = _gemm(_operand(qg, _inv(s_ggu), x_dtype), _operand(gu_kn, _inv(s_gu), x_dtype))
        d_gu = _gemm(_operand(transpose_bytes(qx), _inv(s_x), gu_dtype), _operand(qg_t, _inv(s_ggu), gu_dtype))
        return (dx, d_gu, d_down, observations(st_gu, amax_x, gu_amax, amax_g),
                observations(st_down, amax_h, down_amax, amax(g)), None)

    fp8_swiglu_mlp.defvjp(fwd, bwd)
    return fp8_swiglu_mlp


def fp8_swiglu_mlp(x: jax.Array, w_gate_up: TrainKernel, w_down: TrainKernel, st_gu: Fp8LinearState,
                   st_down: Fp8LinearState, recipe: Fp8Recipe, out_dtype=None) -> jax.Array:
    """The MLP ``down(silu(gate) * up)`` of ``x`` [M, D] through TE's FP8 GEMMs, with kernels made once for the
    update (``TrainKernel``, one device), as one differentiable function. Its forward is the two ``fp8_matmul``
    forwards, bit for bit; its backward makes every FP8 operand of the gate/up linear's GEMMs and the down
    projection's weight gradient in one kernel (``kernels.swiglu_grad``: the SwiGLU's backward, q(h) token-minor and
    q(dgate_up) in both layouts, their amaxes) instead of three XLA passes over the [M, 2F] gate/up output and two byte
    transposes. The observations are the two linears' as ``fp8_matmul`` makes them. Returns [M, D] in
    ``out_dtype`` (default ``x.dtype``)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    hoisted = ((w_gate_up.kn, w_gate_up.nk, w_gate_up.amax), (w_down.kn, w_down.nk, w_down.amax))
    fn = _fp8_swiglu_mlp_fn(jnp.dtype(x.dtype), out_dtype, jnp.dtype(w_gate_up.master.dtype),
                            jnp.dtype(w_down.master.dtype), recipe)
    return fn(x, w_gate_up.master, w_down.master, st_gu, st_down, hoisted)
