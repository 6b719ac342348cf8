"""The ``te`` FP8 backend: Transformer Engine's fused cast kernels and cuBLASLt FP8 GEMMs (GPU only).

Same contract as ``xla``: the scales come from our FP8 state (``recipe.py``), and the state's cotangent carries
the amaxes observed in the call. TE's own ``dense`` returns its *updated quantizer state* as the cotangent,
which adds up wrongly across microbatches and re-implements the scale update; so this module builds its own
``custom_vjp`` from TE's primitives (``tex.quantize``, ``tex.gemm``), following ``transformer_engine.jax.dense``:

    forward   y  = gemm(q(x) [M, K],      q(w) as [N, K])          both K-major: Hopper's FP8 GEMMs need "TN"
    dgrad     dx = gemm(q(g) [M, N],      q(w) as [K, N])
    wgrad     dw = gemm(q(x) as [K, M],   q(g) as [N, M])

TE quantizes with ``saturate(x * scale)`` and round-to-nearest-even, exactly as ``recipe.quantize`` does, so a
kernel pre-quantized by the pure-JAX code (``xla.quantize_kernel``) is bit-identical to the one TE makes inside
the training forward.

Transformer Engine is imported lazily; ``pip install "transformer-engine[jax]"`` on a CUDA host provides it.
Import it (``preload()``) before JAX initialises its GPU backend: JAX loads its own cuDNN, and a TE core library
linked against another cuDNN then fails to load ("undefined symbol ... libcudnn_graph.so.9", seen on the H100
image). ``main`` and the benchmarks call ``preload()`` first. Before TE, the import loads the cuDNN of JAX's
wheels (``_load_jax_cudnn``), so that both use one cuDNN: with two, cuDNN's flash attention failed in its backward.
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fp8 import xla
from fp8rl_jax.fp8.recipe import Fp8LinearState, Fp8Recipe, amax, observations
from fp8rl_jax.fp8.xla import QuantizedKernel
from fp8rl_jax.parallel import fsdp

quantize_kernel = xla.quantize_kernel  # same bits as TE's cast kernel; one place to get them from


SHARES_JAX_CUDNN = False  # set when TE was imported after JAX's own cuDNN (``_load_jax_cudnn``)
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
    global SHARES_JAX_CUDNN
    shared = _load_jax_cudnn()
    try:
        from transformer_engine.jax import cpp_extensions as tex
        from transformer_engine.jax.quantize import (
            DelayedScaleQuantizer,
            QuantizeLayout,
            ScaledTensorFactory,
            ScalingMode,
            TensorUsage,
        )
        from transformer_engine.jax.quantize.helper import AmaxComputeAlgo
    except (ImportError, OSError) as e:
        raise ImportError(
            "precision.backend='te' needs Transformer Engine for JAX on a CUDA GPU "
            "(pip install 'transformer-engine[jax]'); use precision.backend='xla' elsewhere. "
            "If a cuDNN symbol is missing, import Transformer Engine before JAX starts its GPU backend "
            f"(fp8rl_jax.fp8.te.preload()). Import failed with: {e}"
        ) from e
    SHARES_JAX_CUDNN = shared
    return {
        "tex": tex,
        "Quantizer": DelayedScaleQuantizer,
        "Layout": QuantizeLayout,
        "Factory": ScaledTensorFactory,
        "Mode": ScalingMode,
        "Usage": TensorUsage,
        "Algo": AmaxComputeAlgo,
    }


def preload() -> bool:
    """Import Transformer Engine now, if it is installed (see the module docstring); True on success."""
    try:
        _te()
    except ImportError:
        return False
    return True


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


def _quantizer(dtype, scale: jax.Array, both_layouts: bool):
    """A TE delayed-scaling quantizer that uses our scale. Its own history update is never read."""
    t = _te()
    return t["Quantizer"](
        q_dtype=dtype,  # TE compares against the jnp scalar types, not np.dtype instances
        scaling_mode=t["Mode"].DELAYED_TENSOR_SCALING,  # the inherited default would be current scaling
        q_layout=t["Layout"].ROWWISE_COLWISE if both_layouts else t["Layout"].ROWWISE,
        data_layout="NT",
        margin=0.0,
        amax_compute_algo=t["Algo"].MAX,
        scale=scale.astype(jnp.float32).reshape(1),
        amax_history=jnp.zeros((2,), jnp.float32),
    )


def _observed_amax(scaled) -> jax.Array:
    """The amax TE's cast kernel computed while quantizing (read from the row-wise tensor)."""
    t = _te()
    rowwise = scaled.get_tensor(usage=t["Usage"].LHS) if hasattr(scaled, "get_tensor") else scaled
    return rowwise.amax.reshape(()).astype(jnp.float32)


def prequantized_matmul(x: jax.Array, kernel: QuantizedKernel, x_scale: jax.Array, recipe: Fp8Recipe) -> jax.Array:
    """``x [M, K] @ kernel`` with the kernel already FP8 [N, K]; returns [M, N] in ``x.dtype``."""
    t = _te()
    qx = t["tex"].quantize(x, quantizer=_quantizer(recipe.fwd_dtype, x_scale, both_layouts=False), flatten_axis=-1)
    qw = t["Factory"].create_1x(
        kernel.data,
        kernel.scale_inv.astype(jnp.float32).reshape(1),
        scaling_mode=t["Mode"].DELAYED_TENSOR_SCALING,
        dq_dtype=x.dtype,
    )
    # [M, K] . [N, K] -> [M, N]
    return t["tex"].gemm(qx, qw, contracting_dims=((1,), (1,)))


@functools.cache
def _fp8_matmul_fn(x_dtype, w_dtype, out_dtype, recipe: Fp8Recipe, gather: P | None = None):
    # TE's GEMM writes in the input's dtype: quantize an f32 copy of x when f32 output is wanted (same FP8 bits)
    gemm_dtype = jnp.dtype(jnp.float32) if out_dtype == jnp.dtype(jnp.float32) else x_dtype

    @jax.custom_vjp
    def f(x, kernel, state, kernel_amax):
        return fwd(x, kernel, state, kernel_amax)[0]

    def fwd(x, kernel, state, kernel_amax):
        t = _te()
        tex, usage = t["tex"], t["Usage"]
        qx = tex.quantize(x.astype(gemm_dtype), quantizer=_quantizer(recipe.fwd_dtype, state["x"]["scale"], True))
        if gather is not None:
            # FSDP: each shard quantized where it is and its FP8 bits gathered (``parallel.fsdp``; the same bits as
            # TE's cast of the whole kernel), then handed to TE's GEMM as a pre-quantized [N, K] operand
            qk = xla.quantize_kernel(kernel, state["kernel"], recipe, "f8", gather)
            y = tex.gemm(qx.get_tensor(usage=usage.LHS), _kernel_operand(qk.data, qk.scale_inv, gemm_dtype),
                         contracting_dims=((1,), (1,)))
            amax_w = amax(kernel) if kernel_amax is None else kernel_amax
            residuals = (qx.get_tensor(usage=usage.LHS_TRANS), (qk.data, qk.scale_inv), state,
                         _observed_amax(qx), amax_w, kernel_amax)
            return y.astype(out_dtype), residuals
        qw = tex.quantize(kernel, quantizer=_quantizer(recipe.fwd_dtype, state["kernel"]["scale"], True))
        # [M, K] . [K, N] -> [M, N]; on Hopper TE hands the GEMM the K-major copy of w
        y = tex.gemm(qx.get_tensor(usage=usage.LHS), qw.get_tensor(usage=usage.RHS), contracting_dims=((1,), (0,)))
        residuals = (
            qx.get_tensor(usage=usage.LHS_TRANS),
            qw.get_tensor(usage=usage.RHS_TRANS),
            state,
            _observed_amax(qx),
            _observed_amax(qw),
            kernel_amax,
        )
        return y.astype(out_dtype), residuals

    def bwd(residuals, g):
        t = _te()
        tex, usage = t["tex"], t["Usage"]
        qx_t, qw_t, state, amax_x, amax_w, kernel_amax = residuals
        qg = tex.quantize(g.astype(gemm_dtype), quantizer=_quantizer(recipe.bwd_dtype, state["grad"]["scale"], True))
        if gather is not None:  # the gathered [N, K] FP8 kernel, laid out [K, N] for the dgrad's K-major operand
            data, scale_inv = qw_t
            qw_t = _kernel_operand(jnp.swapaxes(data, 0, 1), scale_inv, gemm_dtype)
        # dx [M, K] = g [M, N] . w [K, N]^T
        dx = tex.gemm(qg.get_tensor(usage=usage.LHS), qw_t, contracting_dims=((1,), (1,)))
        # dw [K, N] = x [M, K]^T . g [M, N]
        dw = tex.gemm(qx_t, qg.get_tensor(usage=usage.RHS), contracting_dims=((0,), (0,))).astype(w_dtype)
        if gather is not None:  # the devices' partial wgrads summed onto the master's shards (a reduce-scatter)
            dw = fsdp.reduce_to(dw, gather)
        no_amax = None if kernel_amax is None else jnp.zeros_like(kernel_amax)  # not differentiated
        return dx.astype(x_dtype), dw, observations(state, amax_x, amax_w, _observed_amax(qg)), no_amax

    f.defvjp(fwd, bwd)
    return f


def _kernel_operand(data: jax.Array, scale_inv: jax.Array, dq_dtype):
    """An FP8 kernel already quantized (``data`` [rows, K], contracted on its last axis) as TE's GEMM operand."""
    t = _te()
    return t["Factory"].create_1x(data, scale_inv.astype(jnp.float32).reshape(1),
                                  scaling_mode=t["Mode"].DELAYED_TENSOR_SCALING, dq_dtype=dq_dtype)


def fp8_matmul(
    x: jax.Array, kernel: jax.Array, state: Fp8LinearState, recipe: Fp8Recipe, out_dtype=None, *,
    gather: P | None = None, kernel_amax: jax.Array | None = None,
) -> jax.Array:
    """Differentiable FP8 ``x [M, K] @ kernel [K, N]`` through Transformer Engine (see module docstring).
    ``gather`` / ``kernel_amax``: an FSDP-sharded kernel, as in ``xla.fp8_matmul``."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    fn = _fp8_matmul_fn(jnp.dtype(x.dtype), jnp.dtype(kernel.dtype), out_dtype, recipe, gather)
    return fn(x, kernel, state, kernel_amax)
