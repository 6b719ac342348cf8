"""The benchmark entry points run end to end on tiny shapes (the GPU numbers come from the GPU host)."""

import json

from fp8rl_jax import bench


def test_gemm_and_rollout_benchmarks_smoke(tmp_path):
    bench.main(["gemm", "--smoke", "--out", str(tmp_path / "g.json")])
    rows = json.loads((tmp_path / "g.json").read_text())
    assert {"bf16", "xla_fp8", "xla_fp8_prequant", "xla_fp8_fwd_bwd"} <= {r["path"] for r in rows}
    assert all(r["us"] > 0 and set(r) >= {"M", "K", "N", "path", "us", "tflops", "weight_tbps"} for r in rows)

    bench.main(["rollout", "--smoke", "--out", str(tmp_path / "r.json")])
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["mode"] for r in rows] == ["bf16", "fp8", "fp8_kv"]
    assert all(r["tokens_per_s"] > 0 and 0 < r["hbm_bound_fraction"] for r in rows)
