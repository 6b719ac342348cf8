"""Builds the cuBLASLt block GEMM's library ahead of a run, e.g. on a cluster's login node whose compiler the GPU
nodes lack: ``python -m fp8rl_jax.kernels.cublaslt --out DIR [--include DIR ...] [--lib DIR ...]`` prints the
library's path, for ``$FP8RL_CUBLASLT_LIB`` (or build into ``$FP8RL_CACHE/kernels``, where a run looks for it)."""

from __future__ import annotations

import argparse
import sys

from fp8rl_jax.kernels import cublaslt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8rl_jax.kernels.cublaslt", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the library, e.g. $FP8RL_CACHE/kernels")
    p.add_argument("--include", action="append", default=[], help="a folder with cublasLt.h or CUDA's headers")
    p.add_argument("--lib", action="append", default=[], help="a folder with libcublasLt.so")
    args = p.parse_args(argv)
    try:
        path = cublaslt.build(args.out, include_dirs=args.include, lib_dirs=args.lib)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
