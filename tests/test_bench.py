"""The benchmark entry points run end to end on tiny shapes (the GPU numbers come from the GPU host)."""

import json
import os

import numpy as np
import pytest

from fp8rl_jax.bench.__main__ import main

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out


def test_gemm_and_rollout_benchmarks_smoke(tmp_path):
    main(["gemm", "--smoke", "--out", str(tmp_path / "g.json")])
    rows = json.loads((tmp_path / "g.json").read_text())
    assert {"bf16", "xla_fp8", "xla_fp8_prequant", "xla_fp8_fwd_bwd"} <= {r["path"] for r in rows}
    assert all(r["us"] > 0 and set(r) >= {"M", "K", "N", "path", "us", "tflops", "weight_tbps"} for r in rows)

    main(["rollout", "--smoke", "--out", str(tmp_path / "r.json")])
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["mode"] for r in rows] == ["bf16", "fp8", "fp8_kv"]
    assert all(r["tokens_per_s"] > 0 and 0 < r["hbm_bound_fraction"] for r in rows)

    # a row per decode tuning and form, each an engine built with its values
    main(["rollout", "--smoke", "--modes", "fp8_kv", "--decode_tuning", "128:2048:2", "--variants",
          "default,one_head_per_program", "--out", str(tmp_path / "t.json")])
    rows = json.loads((tmp_path / "t.json").read_text())
    assert [(r["decode_tuning"], r["variant"]) for r in rows] == [
        ("128:2048:2", "default"), ("128:2048:2", "one_head_per_program")]
    with pytest.raises(ValueError, match="unknown form 'fast'"):
        main(["rollout", "--smoke", "--modes", "bf16", "--variants", "fast", "--out", str(tmp_path / "x.json")])


def test_rollout_variants_are_values():
    """``bench rollout``'s --decode_tuning and --variants as the values an engine is built with: a DecodeTuning and a
    precision, nothing set in any module; the forms removed after their A/B are unknown names."""
    from fp8rl_jax.bench.rollout import parse_decode_tuning, variant_values
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.fp8.recipe import Fp8Recipe
    from fp8rl_jax.kernels.decode_attention import DecodeTuning

    assert parse_decode_tuning("default") == DecodeTuning()
    assert parse_decode_tuning("128:2048:2") == DecodeTuning(max_block_k=128, target_programs=2048, num_stages=2)
    for bad, match in (("128:2048", "is not 'default'"), ("a:b:c", "is not 'default'"),
                       ("48:1024:3", "max_block_k=48 must be")):
        with pytest.raises(ValueError, match=match):
            parse_decode_tuning(bad)
    precision = Precision(backend="xla", kv_cache_dtype="float8_e4m3fn")
    assert variant_values(precision, "default", "default") == (precision, DecodeTuning(), {})
    got = variant_values(precision, "128:2048:2", "one_head_per_program+residual_add_kernels")
    assert got == (precision.replace(residual_in_gemm=False),
                   DecodeTuning(max_block_k=128, target_programs=2048, num_stages=2, heads_per_program=1), {})
    block = precision.replace(recipe=Fp8Recipe(scaling="block", fp8_format="e4m3"))
    got = variant_values(block, "default", "cublaslt_gemms+unrolled_steps")
    assert got[0].recipe.block_gemm == "cublaslt" and got[2] == {"step_loop": "unrolled"}
    for removed in ("rotate_in_xla", "scatter_kv", "one_level_draw", "two_pass_block_stats", "select_exp_loop"):
        with pytest.raises(ValueError, match=f"unknown form '{removed}'; known: default, residual_add_kernels, "
                                             "cublaslt_gemms, mosaic_gemms, one_head_per_program, unrolled_steps"):
            variant_values(precision, "default", removed)


def test_rollout_modes_are_precisions():
    """``bench rollout --modes``: each name the precision its rows run, block scaling among them; unknown names and
    block on Transformer Engine refused before any work."""
    from fp8rl_jax.bench.rollout import mode_precision
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.fp8.recipe import Fp8Recipe

    assert mode_precision("bf16") == Precision()
    assert mode_precision("fp8_kv_te_head") == Precision(backend="te", kv_cache_dtype="float8_e4m3fn",
                                                         lm_head_fp8=True)
    assert mode_precision("fp8_kv_block") == Precision(backend="xla", kv_cache_dtype="float8_e4m3fn",
                                                       recipe=Fp8Recipe(scaling="block", fp8_format="e4m3"))
    for bad in ("fp8_block_te", "bf16_block", "fp16", "fp8_kv_fast"):
        with pytest.raises(ValueError, match=f"unknown mode '{bad}'"):
            mode_precision(bad)


def test_collectives_benchmark_smoke(tmp_path):
    main(["collectives", "--smoke", "--train_modes", "fp8_e2e", "--out", str(tmp_path / "c.json")])
    out = json.loads((tmp_path / "c.json").read_text())
    rows = out["decode"]
    assert [(r["mesh"], r["tensor_parallel"]) for r in rows] == [
        ("fsdp=8", 1), ("fsdp=4 x tensor=2", 1), ("fsdp=4 x tensor=2", 2)]
    # whole weights per device: nothing crosses devices in the decode loop; before, the weights were gathered there
    assert all(r["loop_collectives"] == r["loop_bytes"] == 0 for r in rows[:2])
    assert all(r["trainer_layout_loop_bytes"] > 0 and r["reshard_bytes"] > 0 for r in rows)
    assert set(rows[2]["loop_by_kind"]) == {"all-reduce"} and rows[2]["loop_bytes"] > 0
    assert {d for r in rows for d in r["reshard_by_kind"]["all-gather"]["dtypes"]} <= {"u8", "u16"}
    train = out["train"]["fp8_e2e"]  # the FSDP train step's block weights gathered as FP8 bits
    assert out["params_f32_bytes"] > 0 and train["weight_gathers"] == 2
    assert train["all_gather_bytes"] / (train["weight_gathers"] * out["params_f32_bytes"]) <= 0.3


def test_agreement_rollout_path_equals_scoring_in_f32():
    """The teacher-forced rollout engine (prefill in a bucket, then one token per step) against the scoring forward:
    equal to float rounding in f32, apart under FP8 (the numbers ``bench agreement`` reports)."""
    import jax
    import numpy as np

    from fp8rl_jax.bench.agreement import bench_agreement
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.config import preset

    model = preset("tiny")
    params = llama.init_params(model, jax.random.PRNGKey(0), std=0.1)
    rng = np.random.RandomState(0)
    sequences = [(rng.randint(3, model.vocab_size, n).tolist(), rng.randint(3, model.vocab_size, 6).tolist())
                 for n in (5, 17)]  # prompts in the 16 and 32 buckets
    rows = bench_agreement(model, params, sequences,
                           {"f32": Precision(compute_dtype="float32"), "fp8": Precision(backend="xla")})
    assert [r["precision"] for r in rows] == ["f32", "fp8"] and rows[0]["tokens"] == 12
    # f32 scoring against the f32 reference: two programs, whose sums XLA:CPU may order apart (a mean of 4e-8 on a
    # Xeon with AVX-512, 0 elsewhere): a bound float rounding meets with room, far below FP8's > 1e-3
    assert rows[0]["decode_vs_full_max"] < 1e-4 and rows[0]["vs_f32_mean"] < 1e-5
    assert rows[1]["vs_f32_mean"] > 1e-3
    # the trainer's mismatch metrics over the same tokens: mean exp|d| lies between 1 and exp(max |d|), the IS
    # weights exp(d) within exp(+-max |d|), and KL k3 >= 0 (on CPU the FP8 GEMMs accumulate in f32 in both paths,
    # so even FP8's sampler and trainer agree to ~1e-7 on this tiny model)
    for r in rows:
        bound = float(np.exp(r["decode_vs_full_max"]))
        assert 1 <= r["token_mult_prob_error"] <= bound * (1 + 1e-6) and r["mismatch_kl_k3"] >= -1e-9
        assert 1 / bound * (1 - 1e-6) <= r["is_weight_min"] <= r["is_weight_max"] <= bound * (1 + 1e-6)


def test_agreement_exact_variants_agree_with_scoring_bit_for_bit():
    """``<precision>_exact``: the exact sampler's logprobs (each token scored with it and its successors padded
    out) against the scoring program: 0 in BF16 and FP8, where the engine's are not."""
    import jax
    import numpy as np

    from fp8rl_jax.bench.agreement import bench_agreement
    from fp8rl_jax.fp8.policy import Precision
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.config import preset

    model = preset("tiny")
    params = llama.init_params(model, jax.random.PRNGKey(0), std=0.1)
    rng = np.random.RandomState(1)
    sequences = [(rng.randint(3, model.vocab_size, n).tolist(), rng.randint(3, model.vocab_size, m).tolist())
                 for n, m in ((5, 7), (11, 4))]
    rows = bench_agreement(model, params, sequences, {"bf16": Precision(), "bf16_exact": Precision(),
                                                      "fp8_exact": Precision(backend="xla")})
    assert rows[0]["decode_vs_full_max"] > 0  # the KV-cache engine rounds differently
    for r in rows[1:]:
        assert r["tokens"] == 11 and r["decode_vs_full_max"] == 0 and r["token_mult_prob_error"] == 1
    assert rows[2]["vs_f32_mean"] > 1e-3  # FP8, and yet no mismatch


def test_e2e_measures_a_mode_and_summarizes_against_the_best_bf16():
    """One mode in-process on the tiny config (the CLI runs each in a child), then the summary's arithmetic."""
    import argparse

    import jax.numpy as jnp

    from fp8rl_jax.bench import e2e
    from fp8rl_jax.model import attention

    # fp8_e2e_head: fp8_e2e with the LM head in FP8 (its own chunked VJP in the train step)
    row = e2e.measure("configs/tiny.py", "fp8_e2e_head", ["rollout.max_new_tokens=6"], warmup=1, steps=1)
    assert row["mode"] == "fp8_e2e_head" and row["steps"] == 1 and row["max_new_tokens"] == 6
    assert row["lm_head_fp8"] is True and row["backend"] == "xla" and "xla_flags" in row
    assert row["lm_head_grad_fp8"] is True  # the default (with lm_head_fp8, which wins, the head is FP8 both ways)
    assert row["lm_head_recompute_fp8"] is True  # the default (read only with lm_head_grad_fp8)
    assert e2e.MODES["fp8_e2e_bf16_head_grad"] == ("fp8_e2e", "", {"precision.lm_head_grad_fp8": False})
    assert e2e.MODES["fp8_e2e_bf16_recompute"] == ("fp8_e2e", "", {"precision.lm_head_recompute_fp8": False})
    assert row["attention"] == attention.resolve_attention("auto", jnp.bfloat16, 16)  # the tiny config's head dim
    assert all(row[f"time_{p}"] > 0 for p in ("weights", "rollout", "train", "step"))
    assert row["train_tflops"] > 0 and row["rollout_tokens_per_s"] > 0
    # the warm-up step compiled every phase's program: its seconds by phase
    assert row["warmup_compile_s"]["rollout"] > 0 and row["warmup_compile_s"]["train"] > 0

    rows = [{"mode": "bf16", "time_rollout": 10.0, "time_train": 8.0, "time_step": 20.0, "device": "d"},
            {"mode": "bf16_cublas", "time_rollout": 12.0, "time_train": 6.0, "time_step": 19.0, "device": "d"},
            {"mode": "fp8_rollout", "error": "child exited 1"},
            {"mode": "fp8_e2e", "time_rollout": 5.0, "time_train": 4.0, "time_step": 10.0, "device": "d",
             "hbm_bound_fraction": 0.5},
            {"mode": "fp8_e2e_head", "time_rollout": 4.0, "time_train": 3.0, "time_step": 9.5, "device": "d"}]
    summary = e2e.output(rows, argparse.Namespace(one=""))
    assert (summary["rollout_speedup"], summary["train_speedup"], summary["step_speedup"]) == (2.0, 1.5, 1.9)
    assert summary["mode_speedups"] == {"fp8_e2e": {"rollout": 2.0, "train": 1.5, "step": 1.9},
                                        "fp8_e2e_head": {"rollout": 2.5, "train": 2.0, "step": 2.0}}
    assert summary["hbm_bound_fraction"] == 0.5 and summary["device"] == "d" and summary["modes"] == rows


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("m,n,k,block_n,out_dtype", [(5, 40, 256, 16, "float32"), (130, 16, 96, None, "bfloat16")])
def test_fp8_gemm_benchmark_kernel_against_float64(m, n, k, block_n, out_dtype, benchmark_script):
    """benchmarks/fp8_gemm.py's weight-streaming kernel (interpreted): rows padded to 64 and columns past N masked
    out; the products of FP8 values are exact in f32, so only the f32 sums' order and the output's rounding part it
    from float64."""
    import jax.numpy as jnp

    bench = benchmark_script("fp8_gemm")
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.normal(size=s) * 40, jnp.float32).astype(jnp.float8_e4m3fn) for s in ((m, k), (n, k)))
    got = bench.fp8_gemm(x, w, jnp.float32(0.5), jnp.float32(0.25), out_dtype, block_n=block_n,
                         impl="pallas_interpret")
    f64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    want = f64(x) @ f64(w).T * 0.125
    rtol = 2e-6 if out_dtype == "float32" else 2**-8
    assert got.shape == (m, n) and got.dtype == jnp.dtype(out_dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=rtol * np.abs(want).max())


def test_fp8_gemm_benchmark_runs_interpreted(tmp_path, benchmark_script):
    out = tmp_path / "fp8_gemm.json"
    benchmark_script("fp8_gemm").main(["--interpret", "--rows", "5", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"xla", "pallas_interpret"}
    assert all(r["wall_us_per_gemm"] > 0 and r["max_rel_diff"] < 1e-6 for r in rows)


def test_accuracy_study_runs_a_mode_and_writes_table_and_plots(tmp_path, benchmark_script):
    study = benchmark_script("accuracy_study")
    args = ["--config", "configs/tiny.py", "--steps", "2", "--modes", "fp8_e2e_tis", "--parallel", "1",
            "--set", "data.num_eval=4", "--set", "data.eval_every=2", "--workdir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "accuracy.json"), "--docs", str(tmp_path / "docs")]
    assert study.main([*args, "--eval_bf16"]) == 0
    result = json.loads((tmp_path / "accuracy.json").read_text())
    row = result["modes"]["fp8_e2e_tis"]
    one = row["per_seed"]["0"]  # the one seed's own row; the mode's values are means over seeds
    assert result["steps"] == 2 and result["seeds"] == [0] and row["seeds_run"] == 1
    assert one["steps"] == 2 and one["eval_problems"] == 4.0 and one["acc_after_step"] == 2
    assert 0.0 <= row["acc_before"] <= 1.0 and row["acc_after"] == one["acc_after"] and row["acc_after_std"] is None
    assert row["mismatch_kl"] >= 0.0 and row["token_mult_prob_error"] >= 1.0
    assert row["overrides"] == {"precision.mode": "fp8_e2e", "rl.is_correction": "tis"}
    # --eval_bf16: the final checkpoint through the BF16 sampler, on the same 4 test problems
    bf16_eval = json.loads((tmp_path / "runs" / "seed0" / "fp8_e2e_tis" / "eval_bf16" / "results.json").read_text())
    assert bf16_eval["precision_mode"] == "bf16" and bf16_eval["num_problems"] == 4 and bf16_eval["step"] == 2
    assert row["acc_after_bf16"] == one["acc_after_bf16"] == bf16_eval["pass@1"]
    assert (tmp_path / "runs" / "seed0" / "fp8_e2e_tis" / "metrics.jsonl").exists()
    assert "| fp8_e2e_tis |" in (tmp_path / "docs" / "accuracy.md").read_text()
    assert (tmp_path / "docs" / "accuracy_eval.png").stat().st_size > 0
    # --collect rebuilds from the runs and keeps the invocation's record
    saved = dict(result, device="NVIDIA H100 80GB HBM3")
    (tmp_path / "accuracy.json").write_text(json.dumps(saved))
    assert study.main([*args, "--collect"]) == 0
    assert json.loads((tmp_path / "accuracy.json").read_text())["device"] == "NVIDIA H100 80GB HBM3"
    # and so does the hand-written part of the page
    page = tmp_path / "docs" / "accuracy.md"
    page.write_text(page.read_text() + f"\n{study.FINDINGS}\nwhat it means\n")
    assert study.main([*args, "--collect"]) == 0
    assert page.read_text().endswith(f"{study.FINDINGS}\nwhat it means\n") and "| fp8_e2e_tis (1) |" in page.read_text()
    # a run cut short (a time limit) is no result: out of the means, listed as incomplete
    metrics = tmp_path / "runs" / "seed0" / "fp8_e2e_tis" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line).get("step") != 2))
    assert study.main([*args, "--collect"]) == 0
    row = json.loads((tmp_path / "accuracy.json").read_text())["modes"]["fp8_e2e_tis"]
    assert row["seeds_run"] == 0 and row["acc_after"] is None and row["incomplete"] == {"0": 0}
    assert "stopped at step 0" in page.read_text()


def _study(mode_rows: dict[str, dict[int, float]], commit: str) -> dict:
    """An accuracy_study.py output of 40-step runs with the given final accuracies (mode -> seed -> accuracy)."""
    row = lambda acc: {"acc_before": 0.3, "acc_after": acc, "acc_after_step": 40, "steps": 40,  # noqa: E731
                       **{k: 0.0 for k in ("mismatch_kl", "token_mult_prob_error", "reward_start", "reward_end",
                                           "is_weight_mean", "is_clipped_fraction", "step_seconds")},
                       "is_weight_max": 1.0}
    return {"model": "m", "task": "t", "steps": 40, "config": "c", "device": "GPU", "commit": commit, "command": "x",
            "modes": {m: {"per_seed": {str(s): row(a) for s, a in seeds.items()}, "overrides": {}}
                      for m, seeds in mode_rows.items()}}


def test_accuracy_merge_pairs_modes_by_seed_across_studies(tmp_path, benchmark_script):
    merge = benchmark_script("accuracy_merge")
    a = _study({"bf16": {0: 0.80, 1: 0.70}, "fp8_e2e_block": {0: 0.82}}, "c1")
    b = _study({"bf16": {2: 0.90}, "fp8_e2e_block": {1: 0.75, 2: 0.89, 3: 0.5}}, "c2")
    b["modes"]["fp8_e2e_block"]["per_seed"]["3"]["acc_after_step"] = 30  # cut short: not a result
    out = merge.merge([a, b])
    block = out["modes"]["fp8_e2e_block"]
    assert out["seeds"] == [0, 1, 2, 3] and out["modes"]["bf16"]["seeds_run"] == 3
    assert block["seeds_run"] == 3 and block["incomplete"] == {"3": 30}
    assert [r["seeds"] for r in block["runs"]] == [[0], [1, 2, 3]] and block["runs"][1]["commit"] == "c2"
    diff = block["diff_vs_bf16"]  # seeds 0, 1, 2: +0.02, +0.05, -0.01
    assert diff["pairs"] == 3 and abs(diff["mean"] - 0.02) < 1e-12 and abs(diff["se"] - 0.03 / 3 ** 0.5) < 1e-12
    assert -0.01 - 1e-9 <= diff["ci95"][0] <= diff["mean"] <= diff["ci95"][1] <= 0.05 + 1e-9
    assert "diff_vs_bf16" not in out["modes"]["bf16"] and "diff_vs_bf16_bf16_sampler" not in block
    assert merge.merge([out]) == out  # a merged file merges again unchanged
    # --eval_bf16: the final weights through the BF16 sampler, paired the same way
    for seed, acc in (("0", 0.79), ("1", 0.72)):
        a["modes"]["fp8_e2e_block"]["per_seed"].get(seed, {}).update(acc_after_bf16=acc)
        b["modes"]["fp8_e2e_block"]["per_seed"].get(seed, {}).update(acc_after_bf16=acc)
    b["modes"]["fp8_e2e_block"]["per_seed"]["2"]["acc_after_bf16"] = 0.90
    sampler = merge.merge([a, b])["modes"]["fp8_e2e_block"]["diff_vs_bf16_bf16_sampler"]  # -0.01, +0.02, 0.0
    assert sampler["pairs"] == 3 and abs(sampler["mean"] - 0.01 / 3) < 1e-12
    # the same seed of a mode run twice, differently: which is the result?
    with pytest.raises(SystemExit, match="fp8_e2e_block, seed 0"):
        merge.merge([a, _study({"fp8_e2e_block": {0: 0.5}}, "c3")])


def test_every_accuracy_study_mode_is_a_valid_config(benchmark_script):
    from fp8rl_jax.config import load_config_file, validate

    study = benchmark_script("accuracy_study")
    assert set(study.DEFAULT_MODES) <= set(study.MODES)
    for overrides in study.MODES.values():
        config = load_config_file(os.path.join(REPO, "configs", "smollm2_arith.py"))
        config.update_from_flattened_dict(overrides)
        validate(config)


def test_set_values_parse_as_on_the_main_command_line():
    from fp8rl_jax.bench.e2e import _value

    assert _value("true") is True and _value("False") is False and _value("TRUE") is True
    assert _value("3") == 3 and _value("0.5") == 0.5 and _value("[1, 2]") == [1, 2]
    assert _value("float8_e4m3fn") == "float8_e4m3fn" and _value(".gpu/smollm2_tok") == ".gpu/smollm2_tok"


def test_e2e_lengths_and_packing_options(tmp_path):
    """--lengths and --packing as the command line parses them, the length draws, the cut of a rollout batch, and
    packed_speedup's arithmetic."""
    import argparse

    from fp8rl_jax.bench import e2e
    from fp8rl_jax.bench.__main__ import _parser
    from fp8rl_jax.rollout.driver import RolloutBatch

    lengths_file = tmp_path / "lengths.txt"
    lengths_file.write_text("3 5\n9\n")
    args = _parser("e2e").parse_args(["e2e", "--lengths=lognormal:0.25,0.5", "--packing=off,on"])
    assert args.packing == (False, True) and args.lengths.kind == "lognormal"
    assert (args.lengths.mean_fraction, args.lengths.sigma) == (0.25, 0.5)
    args = _parser("e2e").parse_args(["e2e"])
    assert args.packing == (False,) and args.lengths.kind == "fixed"
    assert e2e.parse_lengths(f"file:{lengths_file}").values == (3, 5, 9)
    (tmp_path / "lengths.json").write_text("[4, 7]")
    assert e2e.parse_lengths(f"file:{tmp_path / 'lengths.json'}").values == (4, 7)
    for bad in ("lognormal:2,0.5", "lognormal:0.5", "uniform", "fixed:3", f"file:{tmp_path / 'none'}", "file:"):
        with pytest.raises(argparse.ArgumentTypeError, match="--lengths="):
            e2e.parse_lengths(bad)
    for bad in ("yes", "on,on", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--packing="):
            e2e.parse_packing(bad)

    # draws: a lognormal's mean is MEAN_FRACTION of the budget (few clip at 20000 tokens); clipped to [1, max_new]
    rng = np.random.default_rng(0)
    drawn = e2e.parse_lengths("lognormal:0.25,0.5").draw(20000, 20000, rng)
    assert drawn.min() >= 1 and drawn.max() <= 20000 and abs(drawn.mean() / 5000 - 1) < 0.02
    drawn = e2e.parse_lengths("lognormal:0.9,2.0").draw(1000, 8, rng)
    assert drawn.min() >= 1 and drawn.max() == 8
    assert set(e2e.parse_lengths(f"file:{lengths_file}").draw(200, 6, rng)) == {3, 5, 6}  # 9 clipped to 6
    assert e2e.parse_lengths("fixed").draw(4, 8, rng) is None

    batch = RolloutBatch(prompt_index=np.array([0, 0, 1]), tokens=np.arange(1, 13).reshape(3, 4),
                         logprobs=-np.ones((3, 4), np.float32), lengths=np.array([4, 2, 3]),
                         finish_reasons=["length", "stop", "stop"], stats={})
    cut = e2e.truncate(batch, np.array([2, 3, 1]))
    np.testing.assert_array_equal(cut.lengths, [2, 2, 1])
    np.testing.assert_array_equal(cut.tokens, [[1, 2, 0, 0], [5, 6, 0, 0], [9, 0, 0, 0]])
    np.testing.assert_array_equal(cut.logprobs, [[-1, -1, 0, 0], [-1, -1, 0, 0], [-1, 0, 0, 0]])
    assert cut.finish_reasons == ["length", "stop", "length"]

    rows = [{"mode": "bf16", "packing": "off", "lengths": "x", "time_score": 1.0, "time_train": 5.0},
            {"mode": "bf16", "packing": "on", "lengths": "x", "time_score": 0.5, "time_train": 2.5},
            {"mode": "fp8_e2e", "packing": "off", "lengths": "x", "time_score": 1.0, "time_train": 3.0},
            {"mode": "fp8_e2e", "packing": "on", "lengths": "x", "time_score": 1.0, "time_train": 1.0},
            {"mode": "fp8_rollout", "packing": "off", "lengths": "x", "time_score": 1.0, "time_train": 3.0},
            {"mode": "fp8_rollout", "packing": "on", "error": "child exited 1"}]
    both = {"bf16": 2.0, "fp8_e2e": 2.0}
    assert e2e.packing_summary(rows) == {"rows": rows, "packed_speedup": both, "packed_speedup_with_compile": both}
    # with each step's seconds: summed over the steps, less what each compiled (step 3 compiled unpacked)
    stepped = [dict(rows[0], timed_steps=[{"step": 2, "score_train": 6.0, "compile_s": 0.0},
                                          {"step": 3, "score_train": 40.0, "compile_s": 30.0}]),
               dict(rows[1], timed_steps=[{"step": 2, "score_train": 2.0, "compile_s": 0.0},
                                          {"step": 3, "score_train": 2.5, "compile_s": 0.5}])]
    assert e2e.packed_speedup(stepped) == {"bf16": 4.0}
    assert e2e.packed_speedup(stepped, with_compile=True) == {"bf16": 46.0 / 4.5}
    assert e2e.packed_speedup(stepped, steps={2}) == {"bf16": 3.0}
    cublas = [dict(r, mode="bf16_cublas") for r in rows[:2]]
    three = {"bf16_cublas": 2.0, "fp8_e2e": 2.0, "bf16": 2.0}
    assert e2e.packing_summary(cublas + rows[2:4]) == {
        "rows": cublas + rows[2:4], "packed_speedup": three, "packed_speedup_with_compile": three,
        "packed_speedup_bf16_mode": "bf16_cublas"}
    two = rows[:2] + [dict(rows[0], lengths="y", time_train=2.0), dict(rows[1], lengths="y", time_train=1.0)]
    assert e2e.packed_speedup(two) == {"bf16@x": 2.0, "bf16@y": 2.0}


def test_e2e_packed_mode_with_drawn_lengths():
    """One packed mode in-process on the tiny config with lognormal lengths: completions cut to the draws (mean a
    quarter of 12 tokens, before clipping to [1, 12]), rows that say their layout and lengths."""
    from fp8rl_jax.bench import e2e

    row = e2e.measure("configs/tiny.py", "bf16", [], warmup=1, steps=1, lengths="lognormal:0.25,0.5", packing=True)
    assert row["packing"] == "on" and row["lengths"] == "lognormal:0.25,0.5"
    assert 1 <= row["response_length_mean"] < 6
    assert row["time_score_train"] == pytest.approx(row["time_score"] + row["time_train"])
    # tiny: rows of 16 + 12 -> 32 tokens, 64 sequences in one minibatch; sequences of 3 to 28 tokens fill part
    assert len(row["packing_rows"]) == 2 and 0 < row["packing_fill"] <= 1
    assert [s["step"] for s in row["timed_steps"]] == [2] and row["timed_steps"][0]["compile_s"] >= 0


def test_scale_summary_builds_scale_json_from_step_records(tmp_path, benchmark_script):
    """benchmarks/scale_summary.py: the last step of each scale_run.sh run, per phase and per GPU, fp8_e2e over bf16
    under the same mesh, the rollout per GPU against one GPU's; a file that is not a run is refused by name."""
    summary_module = benchmark_script("scale_summary")

    def records(step_s, train_s, rollout_tps, peak):
        first = {"time/step": 99.0, "time/rollout": 50.0, "time/score": 9.0, "time/train": 40.0,
                 "rollout_tokens_per_s": 1.0, "memory/train_peak_gib": 1.0}  # step 1: compiles, not read
        last = {"precision_backend": "te", "time/step": step_s, "time/rollout": 20.0, "time/score": 5.0,
                "time/train": train_s, "rollout_tokens_per_s": rollout_tps, "memory/rollout_peak_gib": peak - 5,
                "memory/train_peak_gib": peak, "time/rollout_compile": 4.0, "time/train_compile": 1.0}
        return "\n".join(json.dumps(r) for r in (first, last)) + "\n"

    (tmp_path / "scale_bf16_4x1_shipped.jsonl").write_text(records(60.0, 30.0, 80000.0, 50.0))
    (tmp_path / "scale_fp8_e2e_4x1_shipped.jsonl").write_text(records(40.0, 20.0, 100000.0, 45.0))
    (tmp_path / "scale_fp8_e2e_2x2_shipped.jsonl").write_text(records(45.0, 25.0, 90000.0, 40.0))
    files = sorted(tmp_path.glob("*.jsonl"))
    out = tmp_path / "scale.json"
    assert summary_module.main([*map(str, files), "--gpus", "4", "--device", "4x H200", "--batch", "shipped",
                                "--shipped", "--one_gpu_rollout", "25000", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shipped_sizes"] is True and result["gpus"] == 4 and result["one_gpu_rollout_tokens_per_s"] == 25000
    run = result["runs"]["fp8_e2e fsdp=4"]
    assert run == {"mode": "fp8_e2e", "mesh": {"fsdp": 4, "tensor": 1}, "backend": "te", "steps_completed": 2,
                   "step_s": 40.0, "rollout_s": 20.0, "score_s": 5.0, "train_s": 20.0, "peak_mem_gib": 45.0,
                   "rollout_tokens_per_s_per_gpu": 25000.0,
                   "compile_s": {"step": 5.0, "rollout": 4.0, "score": 0.0, "train": 1.0}}
    assert set(result["runs"]) == {"bf16 fsdp=4", "fp8_e2e fsdp=4", "fp8_e2e fsdp=2 x tensor=2"}
    assert result["ratios"]["fp8_e2e fsdp=4"] == {"train_speedup": 1.5, "step_speedup": 1.5,
                                                  "rollout_per_gpu_vs_one_gpu": 1.0}
    assert result["ratios"]["fp8_e2e fsdp=2 x tensor=2"] == {"rollout_per_gpu_vs_one_gpu": 0.9}  # no bf16 there
    assert result["ratios"]["bf16 fsdp=4"] == {"rollout_per_gpu_vs_one_gpu": 0.8}
    # a run of one step: its compile seconds out of each phase, the rollout's tokens over the rest of its time
    assert summary_module.main([*map(str, files), "--gpus", "4", "--device", "4x H200", "--batch", "shipped",
                                "--less_compile", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    run = result["runs"]["fp8_e2e fsdp=4"]
    assert result["times_less_compile"] is True
    assert (run["step_s"], run["rollout_s"], run["train_s"]) == (35.0, 16.0, 19.0)
    assert run["rollout_tokens_per_s_per_gpu"] == pytest.approx(100000.0 * 20.0 / 16.0 / 4)
    ratio = result["ratios"]["fp8_e2e fsdp=4"]  # bf16: step 55, train 29 less compile
    assert ratio["train_speedup"] == pytest.approx(29 / 19) and ratio["step_speedup_with_compile"] == 1.5
    # each mode against its own one-GPU figure
    assert summary_module.main([*map(str, files), "--gpus", "4", "--device", "d", "--batch", "b",
                                "--one_gpu_rollout", "fp8_e2e=20000,bf16=25000", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ratios"]["fp8_e2e fsdp=4"]["rollout_per_gpu_vs_one_gpu"] == 1.25
    assert result["ratios"]["bf16 fsdp=4"]["rollout_per_gpu_vs_one_gpu"] == 0.8
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match="metrics.jsonl: not a scale_MODE_FxT"):
        summary_module.main([str(tmp_path / "metrics.jsonl"), "--gpus", "4", "--device", "d", "--batch", "b"])


def test_agreement_defaults_leave_out_transformer_engine():
    """``bench agreement``'s default precisions run anywhere: the te ones (fp8_te, fp8_kv_te) only when named."""
    import argparse

    from fp8rl_jax.bench import agreement

    parser = argparse.ArgumentParser()
    agreement.add_arguments(parser)
    names = parser.parse_args([]).precisions.split(",")
    assert "fp8_kv" in names and all(agreement.PRECISIONS[n].backend != "te" for n in names)
    assert {"fp8_te", "fp8_kv_te"} <= set(agreement.PRECISIONS) - set(names)


def test_bench_async_auto_delay_is_the_trainers_working_time_in_chunks():
    from fp8rl_jax.bench.asynchronous import auto_delay

    assert auto_delay({"step_seconds": 8.0, "train_idle_s": 2.0, "chunk_s": 0.03}) == 200
    assert auto_delay({"rollout_devices": 2, "error": "child exited timeout"}) == 0


def test_bench_async_measures_the_split_and_keeps_each_steps_time(tmp_path):
    """One variant of ``bench async`` (the rollout on 1 of the 8 forced devices, staleness 1, a load delay of one
    chunk): its row counts the
    trained tokens over the timed steps, keeps each step's time and the trainer's wait, and the weight update moves
    fewer bytes than a BF16 refit."""
    main(["async", "--one", "1", "--config", "configs/tiny.py", "--set", "rollout.max_new_tokens=16", "--warmup", "1",
          "--steps", "2", "--staleness", "1", "--load-delays", "1", "--out", str(tmp_path / "a.json")])
    row = json.loads((tmp_path / "a.json").read_text())["rows"][0]
    assert (row["rollout_devices"], row["max_staleness"], row["devices"], row["load_delay_chunks"]) == (1, 1, 8, 1)
    assert row["decode_chunks"] >= 2 and row["chunk_s"] > 0  # 16 new tokens: 2 chunks of 8 steps at least
    assert len(row["step_seconds_each"]) == len(row["train_idle_s_each"]) == 2
    assert abs(sum(row["step_seconds_each"]) - row["seconds"]) < 0.01
    expected = row["response_length_mean"] * row["sequences"] * 2 / row["seconds"] / 8
    assert row["tokens_per_s_per_gpu"] == pytest.approx(expected)
    assert 0 < row["staleness_mean"] <= 1 and row["weight_update_bytes"] < row["weight_update_bf16_bytes"]


def test_a_trace_sums_gpu_kernels_by_name_family_and_busy_time(tmp_path):
    """``bench.trace.summarize_trace`` on a hand-made trace: only the GPU process's kernels count, overlapping
    kernels count once in the busy time, the gap between them is idle (named by the kernels around it); on this
    CPU ``trace_one_call`` finds no GPU kernel and says so."""
    import gzip

    import jax.numpy as jnp

    from fp8rl_jax.bench import trace

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "block_gemm_fp8_256x2048x8192_n64_c2_k2", "ts": 0, "dur": 100},
        {"ph": "X", "pid": 1, "name": "block_tile_quantize", "ts": 50, "dur": 100},  # overlaps the GEMM by 50 us
        {"ph": "X", "pid": 1, "name": "loop_add_fusion", "ts": 250, "dur": 50},  # after 100 us idle
        {"ph": "X", "pid": 2, "name": "host work", "ts": 0, "dur": 1000},
    ]
    (tmp_path / "run").mkdir()
    with gzip.open(tmp_path / "run" / "x.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = trace.summarize_trace(str(tmp_path))
    assert summary["total_kernel_ms"] == 0.25 and summary["kernels"] == 3
    assert summary["span_ms"] == 0.3 and summary["busy_ms"] == 0.2 and summary["idle_ms"] == 0.1
    assert {f: v["ms"] for f, v in summary["families"].items()} == {"gemm": 0.1, "fp8_cast_amax": 0.1, "fusion": 0.05}
    assert summary["idle_between"] == [{"after": "block_tile_quantize", "before": "loop_add_fusion", "ms": 0.1,
                                        "gaps": 1}]
    assert "error" in trace.trace_one_call(lambda a: a + 1, jnp.ones(3))
