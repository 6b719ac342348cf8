"""Where block scaling's SwiGLU backward kernel spends its time (``kernels.swiglu_grad.swiglu_grad_tiles``, programs of
``chunk`` rows or columns of a [128, 128] block): the same programs, reads and stores with parts of the work taken
out, at a llama1b microbatch's shape (40,960 tokens, F = 8,192) on one GPU.

    JAX_PLATFORMS=cuda python benchmarks/swiglu_anatomy.py --out swiglu_anatomy.json

Variants: ``math`` ``copy`` (the inputs cast to f32 as they are), ``swiglu`` (h, dgate, dup as the kernel computes
them); ``scales`` ``fixed`` (a scale of 1: no amaxes, no divisions) or ``tiles`` (each tile's own, as the kernel);
``forms`` both, or the row-form (1 x 128 tiles of [dgate | dup]) or column-form programs (h, dgate, dup in 128 x 1
tiles, written transposed) alone; ``transpose`` of the FP8 outputs (the kernel's) or of the BF16 inputs. ``swiglu``
+ ``tiles`` + both forms is the kernel's own work (its rows say whether they gave the product's bits); the product's
call is timed beside it. Each row: the median of ``--runs`` calls (``fp8rl_jax.bench.timeit``). Not a product path.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.bench import device_name, timeit
from fp8rl_jax.kernels.block_quantize import TILE, col_tiles, row_tiles
from fp8rl_jax.kernels.swiglu_grad import CHUNK, swiglu_grad_tiles, swiglu_math
from fp8rl_jax.numerics import fp8_max, quantize

E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def variant(m: int, f: int, math: str, scales: str, forms=("row", "col"), chunk: int = CHUNK, warps: int = 8,
            transpose: str = "outputs"):
    """The kernel's grid and memory traffic with ``math``, ``scales`` and ``forms`` as in the module docstring;
    ``transpose="inputs"``: the column-form programs transpose their three BF16 inputs as they load them and take
    row tiles of the result (the same values), where the kernel transposes its three FP8 outputs."""
    nf, per, limit = f // TILE, TILE // chunk, float(fp8_max(E4M3))

    def values(gate, up, g_h):
        if math == "copy":
            return tuple(a.astype(jnp.float32) for a in (gate, up, g_h))
        return swiglu_math(gate, up, g_h)

    def tiles(v, axis):
        if scales == "tiles":
            return (row_tiles if axis == 1 else col_tiles)(v, limit, E4M3)
        q = quantize(v, jnp.float32(1.0), E4M3)
        return (q if axis == 1 else q.T), jnp.ones((v.shape[1 - axis],), jnp.float32)

    def kernel(gate_up_ref, g_h_ref, qh_t_ref, sh_ref, qg_ref, sg_ref, qg_t_ref, sg_t_ref):
        part, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

        def read(rows, cols):
            return values(gate_up_ref[rows, cols], gate_up_ref[rows, pl.ds(f + cols.start, cols.size)],
                          g_h_ref[rows, cols])

        if "row" in forms:
            @pl.when(part < per)
            def _():
                rows = pl.ds(i * TILE + part * chunk, chunk)
                _, dgate, dup = read(rows, pl.ds(j * TILE, TILE))
                for value, col0, column_block in ((dgate, j * TILE, j), (dup, f + j * TILE, nf + j)):
                    qg_ref[rows, pl.ds(col0, TILE)], inv = tiles(value, 1)
                    sg_ref[pl.ds(column_block, 1), rows] = inv[None, :]

        if "col" in forms:
            @pl.when(part >= per)
            def _():
                cols, rows = pl.ds(j * TILE + (part - per) * chunk, chunk), pl.ds(i * TILE, TILE)
                if transpose == "inputs":
                    h, dgate, dup = values(gate_up_ref[rows, cols].T,
                                           gate_up_ref[rows, pl.ds(f + cols.start, cols.size)].T, g_h_ref[rows, cols].T)
                    axis = 1
                else:
                    (h, dgate, dup), axis = read(rows, cols), 0
                qh_t_ref[cols, rows], inv = tiles(h, axis)
                sh_ref[pl.ds(i, 1), cols] = inv[None, :]
                for value, at in ((dgate, cols), (dup, pl.ds(f + cols.start, cols.size))):
                    qg_t_ref[at, rows], inv = tiles(value, axis)
                    sg_t_ref[pl.ds(i, 1), at] = inv[None, :]

    return pl.pallas_call(
        kernel,
        grid=(2 * per, m // TILE, nf),
        out_shape=(
            jax.ShapeDtypeStruct((f, m), E4M3), jax.ShapeDtypeStruct((m // TILE, f), jnp.float32),
            jax.ShapeDtypeStruct((m, 2 * f), E4M3), jax.ShapeDtypeStruct((2 * nf, m), jnp.float32),
            jax.ShapeDtypeStruct((2 * f, m), E4M3), jax.ShapeDtypeStruct((m // TILE, 2 * f), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        name="swiglu_anatomy",
    )


VARIANTS = {  # name: (math, scales, forms)
    "copy, fixed scale": ("copy", "fixed", ("row", "col")),
    "copy, tile scales": ("copy", "tiles", ("row", "col")),
    "swiglu, fixed scale": ("swiglu", "fixed", ("row", "col")),
    "swiglu, tile scales (the kernel's work)": ("swiglu", "tiles", ("row", "col")),
    "swiglu, tile scales, row form alone": ("swiglu", "tiles", ("row",)),
    "swiglu, tile scales, column form alone": ("swiglu", "tiles", ("col",)),
    "copy, fixed scale, column form alone": ("copy", "fixed", ("col",)),
    "swiglu, tile scales, inputs transposed": ("swiglu", "tiles", ("row", "col"), CHUNK, 8, "inputs"),
    "swiglu, tile scales, inputs transposed, column form alone": ("swiglu", "tiles", ("col",), CHUNK, 8, "inputs"),
    "swiglu, tile scales, inputs transposed, 4 warps": ("swiglu", "tiles", ("row", "col"), CHUNK, 4, "inputs"),
    "swiglu, tile scales, inputs transposed, programs of 32": ("swiglu", "tiles", ("row", "col"), 32, 8, "inputs"),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=40960)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", default="")
    args = p.parse_args()
    m, f = args.tokens, args.intermediate
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    gate_up = (jax.random.normal(k[0], (m, 2 * f), jnp.float32) * 2).astype(jnp.bfloat16)
    g_h = (jax.random.normal(k[1], (m, f), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    out = {"device": device_name(), "tokens": m, "intermediate": f, "chunk": CHUNK, "rows": []}
    fns = {"the product's call (swiglu_grad_tiles)": lambda a, b: swiglu_grad_tiles(a, b, E4M3, E4M3)}
    fns.update({name: (lambda a, b, v=v: variant(m, f, *v)(a, b)) for name, v in VARIANTS.items()})
    product = jax.jit(fns["the product's call (swiglu_grad_tiles)"])(gate_up, g_h)
    for name, fn in fns.items():
        row = {"variant": name}
        try:
            row["ms"] = timeit(jax.jit(fn), gate_up, g_h, repeats=args.runs) * 1e3
            if name.startswith("swiglu, tile scales") and "alone" not in name:  # the kernel's work: its bits
                got = jax.jit(fn)(gate_up, g_h)
                row["same_bits_as_product"] = all(bool(jnp.array_equal(a, b))
                                                  for a, b in zip(got, product, strict=True))
        except Exception as e:  # a launch Triton refuses: say so, go on
            row["error"] = str(e)[:300]
        print(json.dumps(row))
        out["rows"].append(row)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
