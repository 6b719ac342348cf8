"""Device memory and time of cuDNN's packed (segment) attention, forward + backward, against the number of segments
its static table holds (``attention.row_segments``): jax's cuDNN call sizes its softmax statistics (and cuDNN its
workspace) by rows x segments, so the cap on sequences per packed row sets the train step's memory.

    python benchmarks/packed_attention_memory.py --rows 14 --width 2304 --segments 2,4,8,16,32,144 --out x.json

Per setting: XLA's compiled ``memory_analysis()`` (temp and output bytes) of one layer's attention forward + backward
and its median seconds over a few calls, with the unpacked (no segments) call of the same shape as the baseline.
llama1b's heads by default (32 query heads, 8 kv heads, head dim 64). GPU only (cuDNN).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.bench import timeit
from fp8rl_jax.model import attention


def segment_ids(rows: int, width: int, per_row: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, width]: ``per_row`` random-length segments in each row then a padding tail (id 0)."""
    out = np.zeros((rows, width), np.int32)
    for r in range(rows):
        used = int(width * rng.uniform(0.7, 0.95))
        cuts = np.sort(rng.choice(np.arange(1, used), size=per_row - 1, replace=False)) if per_row > 1 else []
        bounds = [0, *cuts, used]
        for s in range(per_row):
            out[r, bounds[s]:bounds[s + 1]] = s + 1
    return out


def measure(rows, width, heads, kv_heads, head_dim, max_segments, per_row, reps=5):
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (rows, width, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (rows, width, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (rows, width, kv_heads, head_dim), jnp.bfloat16)
    seg = jnp.asarray(segment_ids(rows, width, per_row, rng)) if max_segments else None

    def loss(q, k, v, seg):
        if seg is None:
            out = attention.flash_attention(q, k, v, "cudnn")
        else:
            from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

            lengths, starts = attention.segment_table(seg, max_segments + 1)
            out = cudnn_attention.dot_product_attention(
                q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts, kv_offsets=starts,
                scale=head_dim ** -0.5, mask_type=cudnn_attention.MaskType.PADDING_CAUSAL)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = step.lower(q, k, v, seg).compile()
    mem = compiled.memory_analysis()
    return {"max_segments": max_segments, "segments_per_row": per_row if max_segments else 1,
            "temp_gib": mem.temp_size_in_bytes / 2**30, "output_gib": mem.output_size_in_bytes / 2**30,
            "seconds": timeit(compiled, q, k, v, seg, repeats=reps)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=14)
    p.add_argument("--width", type=int, default=2304)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--segments", default="2,4,8,16,32,144")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = [measure(a.rows, a.width, a.heads, a.kv_heads, a.head_dim, 0, 1)]
    print(json.dumps(rows[-1]), flush=True)
    for m in (int(s) for s in a.segments.split(",")):
        try:
            rows.append(measure(a.rows, a.width, a.heads, a.kv_heads, a.head_dim, m, min(m, 3)))
        except Exception as e:  # an allocation that fails is a result here
            rows.append({"max_segments": m, "error": str(e).splitlines()[0][:300]})
        print(json.dumps(rows[-1]), flush=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": a.rows, "width": a.width,
              "heads": [a.heads, a.kv_heads, a.head_dim], "runs": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
