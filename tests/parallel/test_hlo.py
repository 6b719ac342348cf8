"""The HLO collective reader against programs whose collectives are known by construction (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.parallel import hlo


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]), ("fsdp",))


def _layers_program(mesh, gather_dtype, bits):
    """A scan over 4 stacked [64, 32] layer weights sharded on their rows: each iteration gathers its layer, cast
    to ``gather_dtype``, as ``bits`` (XLA:CPU widens a BF16 or FP8 all-gather to f32 / f16; their bits it moves
    as they are)."""
    w = jax.device_put(jnp.ones((4, 64, 32)), NamedSharding(mesh, P(None, "fsdp")))
    x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("fsdp")))

    def gather_shard(s):  # the cast shard gathered explicitly (a sharding constraint alone lets XLA gather the
        # f32 shard and cast after)
        b = jax.lax.bitcast_convert_type(s.astype(gather_dtype), bits)
        return jax.lax.bitcast_convert_type(jax.lax.all_gather(b, "fsdp", axis=0, tiled=True), gather_dtype)

    gather = jax.shard_map(gather_shard, mesh=mesh, in_specs=P("fsdp"), out_specs=P(), check_vma=False)

    def f(w, x):
        def body(h, layer):
            y = jnp.tanh(h @ gather(layer).astype(jnp.float32))  # [8, 32]
            return jnp.concatenate([y, y], axis=1), jnp.max(y)  # [8, 64]

        return jax.lax.scan(body, x, w)

    return jax.jit(f).lower(w, x).compile().as_text()


@pytest.mark.parametrize("dtype,bits,name,itemsize", [(jnp.float32, jnp.uint32, "u32", 4),
                                                      (jnp.bfloat16, jnp.uint16, "u16", 2),
                                                      (jnp.float8_e4m3fn, jnp.uint8, "u8", 1)])
def test_per_layer_gathers_inside_the_loop(mesh, dtype, bits, name, itemsize):
    text = _layers_program(mesh, dtype, bits)
    inside = hlo.loop_collectives(text)
    gathers = [c for c in inside if c.kind == "all-gather"]
    assert len(gathers) == 1, inside  # one gather per iteration of the layer loop
    assert gathers[0].dtype == name
    assert gathers[0].shape == ((64, 32),) and gathers[0].bytes == 64 * 32 * itemsize
    # the per-layer max of y is reduced over the batch shards inside the loop too
    assert any(c.kind == "all-reduce" for c in inside)
    total = hlo.summary(hlo.collectives(text))
    assert total["by_kind"]["all-gather"] == {"count": 1, "bytes": 64 * 32 * itemsize, "dtypes": [name]}


def test_loop_invariant_gather_is_outside_the_loop(mesh):
    w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("fsdp")))
    x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P()))

    def f(w, x):
        full = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ full @ full.T), None), x, None, length=3)[0]

    text = jax.jit(f).lower(w, x).compile().as_text()
    assert [c.kind for c in hlo.loop_collectives(text)] == []
    gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
    assert len(gathers) == 1 and gathers[0].bytes == 64 * 32 * 4


def test_parser_reads_tuple_and_async_results():
    text = """HloModule m

%body.1 (p: (s32[])) -> (s32[]) {
  %x = f32[4]{0} parameter(0)
  %ag = (f32[1,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%x), dimensions={0}
  %agd = f32[8,4]{1,0} all-gather-done(%ag)
  %ar = (f32[], bf16[16]{0}) all-reduce(%a, %b), to_apply=%sum
  %cp = (bf16[2]{0}, bf16[2]{0}, u32[], u32[]) collective-permute-start(%y), source_target_pairs={{0,1}}
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[]) while(%t), condition=%cond, body=%body.1
  ROOT %r = f32[4]{0} all-reduce(%a), to_apply=%sum
}
"""
    found = hlo.collectives(text)
    assert [(c.kind, c.dtype, c.bytes) for c in found] == [
        ("all-gather", "f32", 8 * 4 * 4), ("all-reduce", "bf16,f32", 4 + 32), ("collective-permute", "bf16", 4),
        ("all-reduce", "f32", 16)]
    assert [c.computation for c in hlo.loop_collectives(text)] == ["body.1"] * 3
