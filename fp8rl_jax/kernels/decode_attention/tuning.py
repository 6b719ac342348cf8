"""The decode attention kernel's launch choices (``DecodeTuning``) and the rules that fill in the ones left open.

The defaults are the H100's measured ones (``docs/decode_attention.md``, "Defaults"; ``benchmarks/decode_attention.py``
sweeps them, ``bench rollout --decode_tuning`` runs the rollout under others).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

IMPLS = ("auto", "pallas", "pallas_interpret", "xla")
MIN_DOT_ROWS = 16  # Triton's smallest dot tile: the query rows (G) are padded up to it
LONG_CACHE_BLOCKS = 32  # a cache of this many blocks or more gets at least two splits
DOT_DTYPES = ("float16", "bfloat16", "float32")


def _pow2_ceil(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_pow2(x) -> bool:
    return _is_int(x) and x >= 1 and not x & (x - 1)


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """How the decode attention kernel is launched: a static value (frozen, hashable) that every entry point takes as
    an argument (``tuning``) and the rollout engine carries (``EngineConfig.decode_tuning``), so it is part of each
    traced program: two tunings are two programs, and nothing is read from module state while tracing.

    The rules' parameters: ``max_block_k`` (the longest block; ``block_k`` None takes 16 KiB of K per iteration, at
    most this many positions, ``default_block_k``), ``target_programs`` (``k_splits`` None adds splits until the grid
    has about this many programs, ``default_k_splits``; ``heads_per_program`` None puts two kv heads in a program
    where that still makes this many, ``default_heads_per_program``). Set ``block_k``, ``k_splits`` or
    ``heads_per_program`` to fix them instead (``heads_per_program`` must divide the kv heads). ``num_warps``,
    ``num_stages``: Triton's launch settings. ``dot_dtype``: the dots' operand dtype (None: ``default_dot_dtype``).
    ``tail_loop``: a split's whole blocks walked without masks and the partial last block in a loop of its own (off:
    measured slower in the rollout, ``benchmarks/RESULTS.md``). The XLA path ignores all of it.
    """

    max_block_k: int = 64
    target_programs: int = 1024
    num_stages: int = 3
    num_warps: int = 4
    heads_per_program: int | None = None
    block_k: int | None = None
    k_splits: int | None = None
    dot_dtype: str | None = None
    tail_loop: bool = False

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"DecodeTuning {name}={getattr(self, name)!r} must be {want}")

        for name in ("max_block_k", "block_k"):
            value = getattr(self, name)
            if (value is not None or name == "max_block_k") and not (_is_pow2(value) and value >= 16):
                bad(name, "a power of two >= 16")
        for name in ("target_programs", "num_stages", "heads_per_program", "k_splits"):
            value = getattr(self, name)
            if (value is not None or name in ("target_programs", "num_stages")) and not (_is_int(value) and value >= 1):
                bad(name, "a positive integer" + (" or None" if name in ("heads_per_program", "k_splits") else ""))
        if not _is_pow2(self.num_warps):
            bad("num_warps", "a power of two")
        if not isinstance(self.tail_loop, bool):
            bad("tail_loop", "a bool")
        if self.dot_dtype is not None:  # kept as its name: the same value whichever way the dtype was spelled
            try:
                name = jnp.dtype(self.dot_dtype).name
            except TypeError:
                name = None
            if name not in DOT_DTYPES:
                bad("dot_dtype", f"one of {DOT_DTYPES} or None")
            object.__setattr__(self, "dot_dtype", name)

    def resolved(self, rows: int, kv_heads: int, groups: int, head_dim: int, cache_itemsize: int,
                 cache_len: int) -> DecodeTuning:
        """This tuning with ``heads_per_program``, ``block_k`` and ``k_splits`` filled in by the rules for ``rows``
        (B*K) (sequence, kv head) rows of G query heads each over a cache of ``cache_len`` positions."""
        heads = self.heads_per_program or default_heads_per_program(rows, kv_heads, groups, cache_itemsize,
                                                                    self.target_programs)
        if kv_heads % heads:
            raise ValueError(f"heads_per_program={heads!r} must be a positive integer dividing the kv heads "
                             f"K={kv_heads}")
        block_k = self.block_k or default_block_k(head_dim, cache_itemsize, cache_len, heads, self.max_block_k)
        k_splits = self.k_splits or default_k_splits(rows // heads, cache_len, block_k, self.target_programs)
        return dataclasses.replace(self, heads_per_program=heads, block_k=block_k, k_splits=k_splits)


DEFAULT_TUNING = DecodeTuning()


def resolve_impl(impl: str) -> str:
    """``auto`` -> ``pallas`` on a GPU backend, ``xla`` elsewhere; the others pass through (validated)."""
    if impl not in IMPLS:
        raise ValueError(f"decode_attention={impl!r}; allowed: {IMPLS}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def default_block_k(head_dim: int, cache_itemsize: int, cache_len: int, heads_per_program: int = 1,
                    max_block_k: int = DEFAULT_TUNING.max_block_k) -> int:
    """16 KiB of K per iteration (over the program's ``heads_per_program`` kv heads), a power of two in
    [16, ``max_block_k``], no larger than the cache (rounded up)."""
    block_k = min(max(_pow2_floor(16 * 1024 // (heads_per_program * head_dim * cache_itemsize)), 16), max_block_k)
    return min(block_k, max(_pow2_ceil(cache_len), 16))


def default_heads_per_program(rows: int, kv_heads: int, groups: int, cache_itemsize: int,
                              target_programs: int = DEFAULT_TUNING.target_programs) -> int:
    """2 kv heads a program over an FP8 cache when ``rows`` (B*K) / 2 programs still make ``target_programs`` (no
    splits needed), K is even and the 2G query rows fit one 16-row tile; else 1 (measured faster only there:
    ``benchmarks/RESULTS.md``, "Two kv heads a program")."""
    two = (cache_itemsize == 1 and kv_heads % 2 == 0 and 2 * groups <= MIN_DOT_ROWS
           and rows // 2 >= target_programs)
    return 2 if two else 1


def default_k_splits(programs: int, cache_len: int, block_k: int,
                     target_programs: int = DEFAULT_TUNING.target_programs) -> int:
    """About ``target_programs`` programs in all, 1..16 splits, at least 2 for a long cache (``LONG_CACHE_BLOCKS``),
    no more splits than cache blocks."""
    blocks = -(-cache_len // block_k)
    splits = min(max(-(-target_programs // programs), 2 if blocks >= LONG_CACHE_BLOCKS else 1), 16)
    return max(min(splits, blocks), 1)


def default_dot_dtype(q_dtype, cache_dtype):
    """float16 for a BF16 query over an FP8 cache (measured 10-22% faster on the H100 than BF16 operands,
    ``benchmarks/results/decode_sweep_h100.json``); the query's dtype otherwise."""
    if jnp.dtype(cache_dtype).itemsize == 1 and jnp.dtype(q_dtype) == jnp.bfloat16:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(q_dtype)


def pallas_unsupported(head_dim: int) -> str | None:
    """Why the kernel cannot take this head dim (Triton tiles are powers of two, dots at least 16 wide), or None."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim} is not a power of two >= 16"
    return None
