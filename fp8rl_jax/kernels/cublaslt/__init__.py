"""The block-scaled FP8 GEMM by cuBLASLt on Hopper: ``fp8.block.block_gemm`` as one ``cublasLtMatmul`` call with
cuBLAS's own block scale modes (cuBLAS >= 12.9, sm_90: ``VEC128_32F`` for 1 x 128 tiles, ``BLK128x128_32F`` for a
weight's 128 x 128 blocks), through an XLA FFI handler (``block_gemm.cc``; ``jax.ffi``). The other Hopper path beside
``kernels.block_gemm``'s Mosaic GPU kernel; ``precision.block_gemm`` picks one (``fp8.xla.block_gemm``).

What it computes: the same sum as ``block.block_gemm``: each 128-deep slice of the contraction summed by the tensor
cores, multiplied by its two scales and added to an f32 accumulator (cuBLASLt has no fast accumulation with block
scales). Operands: qa [P, C] and qb [Q, C], E4M3 or E5M2 (cuBLAS multiplies E4M3 x E5M2 and E5M2 x E4M3, not E5M2 x
E5M2); qa scaled per row and slice ([P, Cb]), qb per row and slice ([Q, Cb]) or per 128 x 128 block ([ceil(Q/128),
Cb]). The wrapper lays the scales out as cuBLASLt reads them (transposed, their minor axis padded to a multiple of 4,
the layout Transformer Engine calls GEMM-ready). cuBLAS's FP8 GEMM wants rows of whole 16 bytes (C, and Q of the
output), and P a multiple of 4: other sizes are padded with zeros there (a copy; a zero adds nothing; no pad crosses a
128 boundary, so the scales keep their shapes).

The library. ``build`` compiles ``block_gemm.cc`` with the host's C++ compiler against the XLA FFI headers that
jaxlib ships (``jax.ffi.include_dir()``) and cuBLAS's and CUDA's headers (the ``nvidia-cublas`` and
``nvidia-cuda-runtime`` wheels that ``jax[cuda13]`` installs, or ``$CUDA_HOME``); the file's name carries a hash of
the source, so an edited handler is never mistaken for a built one. ``register`` loads one (``$FP8RL_CUBLASLT_LIB``,
or this source's build in the folder it is given: the project's cache, ``plan.py``), refuses one whose interface
(``ABI``: its operands and attributes) is not this source's, and registers the FFI target once a process;
``block_gemm_cublaslt`` calls it. The handler caches one cuBLASLt handle a stream and the heuristic's algorithm a
problem, and is safe inside XLA's command buffers (no allocation, no synchronization: the workspace is
an output XLA allocates).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "fp8rl_block_gemm_cublaslt"
SYMBOL = "Fp8rlBlockGemmCublasLt"
ABI_SYMBOL = "Fp8rlBlockGemmCublasLtAbi"
ABI = 2  # block_gemm.cc's Fp8rlBlockGemmCublasLtAbi(): 2 since the ``algo`` attribute
SOURCE = Path(__file__).with_name("block_gemm.cc")
WORKSPACE_BYTES = 32 << 20  # block_gemm.cc's kWorkspaceBytes
MAX_ALGOS = 16  # block_gemm.cc's kMaxAlgos
BLOCK = 128
ALIGN_BYTES = 16  # cuBLAS FP8: leading dimensions a multiple of 16 bytes
ENV_LIB = "FP8RL_CUBLASLT_LIB"
_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_registered: dict[str, str] = {}  # TARGET -> the library registered in this process


def library_name() -> str:
    """The built library's file name: a hash of the handler's source (the FFI ABI is versioned by XLA itself)."""
    return f"libfp8rl_cublaslt_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}.so"


def _nvidia_dirs(sub: str) -> list[str]:
    """``sub`` (include, lib) folders of the NVIDIA wheels installed beside JAX (``nvidia/cu13``, ``nvidia/*/``)."""
    found = []
    for base in sys.path:
        for pattern in (f"nvidia/cu1*/{sub}", f"nvidia/*/{sub}"):
            found += sorted(glob.glob(os.path.join(base, pattern)))
    return list(dict.fromkeys(d for d in found if os.path.isdir(d)))


def _has(dirs: list[str], header: str) -> bool:
    return any(os.path.exists(os.path.join(d, header)) for d in dirs)


def build(out_dir: str | os.PathLike, include_dirs=(), lib_dirs=(), compiler: str | None = None) -> Path:
    """Compiles ``block_gemm.cc`` into ``out_dir/library_name()`` (kept if already there) and returns its path.
    ``include_dirs``/``lib_dirs``: more places for cublasLt.h, CUDA's runtime headers and libcublasLt.so (after the
    NVIDIA wheels' and ``$CUDA_HOME``'s). Raises RuntimeError naming what is missing."""
    target = Path(out_dir) / library_name()
    if target.exists():
        return target
    compiler = compiler or os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"building the cuBLASLt block GEMM needs a C++ compiler: {compiler!r} is not on PATH "
                           "(set CXX)")
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    includes = [jax.ffi.include_dir(), *map(str, include_dirs), *_nvidia_dirs("include"), f"{cuda_home}/include"]
    libs = [*map(str, lib_dirs), *_nvidia_dirs("lib"), f"{cuda_home}/lib64"]
    for header in ("cublasLt.h", "driver_types.h", "cuda_bf16.h"):
        if not _has(includes, header):
            raise RuntimeError(f"building the cuBLASLt block GEMM: no {header} in {includes} (install nvidia-cublas "
                               "and nvidia-cuda-runtime, as jax[cuda13] does, set CUDA_HOME, or pass include_dirs)")
    lib = next((f"-l:{os.path.basename(p)}" for d in libs
                for p in sorted(glob.glob(os.path.join(d, "libcublasLt.so*")), key=len)), None)
    if lib is None:
        raise RuntimeError(f"building the cuBLASLt block GEMM: no libcublasLt.so in {libs} (pass lib_dirs)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # atomic: a half-written library is never found
        partial = Path(tmp) / target.name
        command = [compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-w", *(f"-I{d}" for d in includes),
                   str(SOURCE), "-o", str(partial), *(f"-L{d}" for d in libs), lib]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the cuBLASLt block GEMM failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
        os.replace(partial, target)
    return target


def _preload_cublaslt() -> None:
    """Loads libcublasLt (globally) from the NVIDIA wheels where the dynamic loader would not find it, so that the
    handler's library resolves against the copy JAX itself uses."""
    for d in _nvidia_dirs("lib"):
        for path in sorted(glob.glob(os.path.join(d, "libcublasLt.so.*")), key=len):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return


def register(lib_dir: str | os.PathLike | None = None, *, build_missing: bool = True) -> str:
    """Registers the FFI target for CUDA once a process and returns the library's path: ``$FP8RL_CUBLASLT_LIB``,
    else ``lib_dir/library_name()``, built there first if missing (``build_missing``)."""
    if TARGET in _registered:
        return _registered[TARGET]
    path = os.environ.get(ENV_LIB)
    if not path:
        if lib_dir is None:
            raise ValueError(f"the cuBLASLt block GEMM's library: set ${ENV_LIB} or pass lib_dir")
        candidate = Path(lib_dir) / library_name()
        if not candidate.exists():
            if not build_missing:
                raise FileNotFoundError(f"no {candidate} (build it: fp8rl_jax.kernels.cublaslt.build)")
            candidate = build(lib_dir)
        path = str(candidate)
    if not os.path.exists(path):
        raise FileNotFoundError(f"${ENV_LIB}={path}: no such file")
    _preload_cublaslt()
    lib = ctypes.CDLL(path)
    abi = getattr(lib, ABI_SYMBOL)() if hasattr(lib, ABI_SYMBOL) else 1
    if abi != ABI:
        raise RuntimeError(f"{path} is the cuBLASLt block GEMM of another fp8rl_jax (its interface {abi}, this one's "
                           f"{ABI}): rebuild it (python -m fp8rl_jax.kernels.cublaslt --out DIR)")
    handler = getattr(lib, SYMBOL)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="CUDA")
    _registered[TARGET] = path
    return path


def registered() -> bool:
    return TARGET in _registered


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def refusal(qa: jax.Array, qb: jax.Array, out_dtype=jnp.float32) -> str | None:
    """Why cuBLASLt's block-scaled GEMM cannot take these operands (None: it can): 2-D FP8 operands of one
    contraction size, not both E5M2, an f32 or BF16 output."""
    if qa.ndim != 2 or qb.ndim != 2:
        return f"2-D operands, not {qa.shape} and {qb.shape}"
    if qa.dtype not in _FP8 or qb.dtype not in _FP8:
        return f"FP8 operands (float8_e4m3fn, float8_e5m2), not {qa.dtype} and {qb.dtype}"
    if qa.dtype == qb.dtype == jnp.dtype(jnp.float8_e5m2):
        return "not two E5M2 operands (cuBLAS multiplies E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3)"
    if qa.shape[1] != qb.shape[1]:
        return f"operands of one contraction size, not qa {qa.shape} and qb {qb.shape}"
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"an f32 or BF16 output, not {jnp.dtype(out_dtype)}"
    return None


def runs_here(qa: jax.Array, qb: jax.Array, out_dtype=jnp.float32) -> bool:
    """Whether ``block_gemm_cublaslt`` runs for these operands in this trace: the target registered, operands it
    takes (``refusal``), a Hopper GPU outside a mesh of several devices (``kernels.block_gemm.one_hopper``)."""
    from fp8rl_jax.kernels.block_gemm import one_hopper

    return registered() and refusal(qa, qb, out_dtype) is None and one_hopper()


@functools.partial(jax.jit, static_argnames=("out_dtype", "algo"))
def block_gemm_cublaslt(qa: jax.Array, a_scale_inv: jax.Array, qb: jax.Array, b_scale_inv: jax.Array,
                        out_dtype=jnp.float32, algo: int = 0) -> jax.Array:
    """``block.block_gemm(qa, a_scale_inv, qb, b_scale_inv)`` -> [P, Q] in ``out_dtype`` (f32 or BF16; the sum is
    f32 either way), by cuBLASLt. qa [P, C], qb [Q, C] FP8; a_scale_inv [P, Cb] f32; b_scale_inv [Q, Cb] (per-row
    scales) or [ceil(Q / 128), Cb] (a weight's 128 x 128 blocks), Cb = ceil(C / 128). ``algo``: the rank of the
    algorithm among cuBLASLt's heuristic's candidates (0, its pick; fewer than ``MAX_ALGOS``; a rank it does not
    offer fails at run time, naming how many it does): ``benchmarks/block_gemm_speed.py --cublaslt-algos`` times
    them. Needs ``register()`` first; lowers for CUDA only."""
    p, c = qa.shape
    q = qb.shape[0]
    cb = _blocks(c)
    reason = refusal(qa, qb, out_dtype)
    if reason:
        raise ValueError(f"block_gemm_cublaslt takes {reason}")
    if a_scale_inv.shape != (p, cb):
        raise ValueError(f"a_scale_inv must be [P, ceil(C/128)] = {(p, cb)}, not {a_scale_inv.shape}")
    if not 0 <= algo < MAX_ALGOS:
        raise ValueError(f"algo must be in [0, {MAX_ALGOS}), not {algo}")
    # rows of whole 16 bytes: C for both operands, Q for the output; and P a multiple of 4 (cuBLASLt found no
    # algorithm for 130 rows of 1 x 128 tiles on an H200). Zeros; no pad crosses a 128 boundary
    cp, qp = _round_up(c, ALIGN_BYTES), _round_up(q, ALIGN_BYTES // jnp.dtype(out_dtype).itemsize)
    pp = _round_up(p, 4)
    if b_scale_inv.shape == (_blocks(q), cb):
        weight_blocks = 1  # (also Q <= 128 with one row of blocks: then both forms are one)
        sb = jnp.pad(b_scale_inv.astype(jnp.float32), ((0, 0), (0, _round_up(cb, 4) - cb)))  # [Qb, round_up(Cb, 4)]
    elif b_scale_inv.shape == (q, cb):
        weight_blocks = 0
        sb = jnp.pad(b_scale_inv.astype(jnp.float32).T, ((0, 0), (0, _round_up(qp, 4) - q)))  # [Cb, round_up(Qp, 4)]
    else:
        raise ValueError(f"b_scale_inv must be [Q, Cb] = {(q, cb)} or [ceil(Q/128), Cb] = {(_blocks(q), cb)}, "
                         f"not {b_scale_inv.shape}")
    sa = jnp.pad(a_scale_inv.astype(jnp.float32).T, ((0, 0), (0, pp - p)))  # [Cb, Pp]
    if (pp, cp) != (p, c):
        qa = jnp.pad(qa, ((0, pp - p), (0, cp - c)))
    if (qp, cp) != (q, c):
        qb = jnp.pad(qb, ((0, qp - q), (0, cp - c)))
    out, _ = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct((pp, qp), jnp.dtype(out_dtype)), jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)),
    )(qa, sa, qb, sb, weight_blocks=np.int32(weight_blocks), algo=np.int32(algo))
    return out if (pp, qp) == (p, q) else out[:p, :q]
