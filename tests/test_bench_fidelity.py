"""``bench fidelity``'s pieces on CPU: its forms, its metrics (figures derived by hand), one form on a tiny model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.bench import fidelity
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import update_state
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import preset
from fp8rl_jax.rl.step import LossConfig

BASE = Precision(backend="xla", lm_head_grad_fp8=True, lm_head_recompute_fp8=True)


def test_forms_are_the_knobs_they_name():
    table = fidelity.forms(BASE)
    assert table["tensor"][1] == BASE and not table["bf16"][1].fp8
    assert table["block"][1].recipe.scaling == "block" and table["block"][1].recipe.fp8_format == "e4m3"
    assert table["block_hybrid"][1].recipe.fp8_format == "hybrid"
    assert table["mantissa_e4m3"][1].recipe == table["mantissa_e4m3_head_bf16"][1].recipe == fidelity.MANTISSA_E4M3
    assert table["mantissa_hybrid"][1].recipe.scaling == "mantissa"
    assert table["mantissa_hybrid"][1].recipe.fp8_format == "hybrid"
    assert not table["mantissa_e4m3_head_bf16"][1].lm_head_grad_fp8 and table["mantissa_e4m3"][1].lm_head_grad_fp8
    assert table["fprop_only"][1].recipe.fp8_gemms == ("fprop",) and not table["fprop_only"][1].lm_head_grad_fp8
    assert table["head_only"][1].lm_head_grad_fp8 and len(table["head_only"][1].bf16_linears) == 4
    for name, gemms in (("block_fprop_only", ("fprop",)), ("block_backward_only", ("dgrad", "wgrad"))):
        assert table[name][1].recipe == dataclasses.replace(fidelity.BLOCK_E4M3, fp8_gemms=gemms)
    assert table["block_fprop_tokens_blocks"][1].recipe.block_forward == "tokens_blocks"
    assert table["block_fprop_tiles_channels"][1].recipe.fp8_gemms == ("fprop",)
    rowwise = table["rowwise_fprop_only"][1]
    assert rowwise.recipe.scaling == "rowwise" and rowwise.recipe.fp8_gemms == ("fprop",)
    assert not rowwise.lm_head_grad_fp8 and not table["block_fprop_only"][1].lm_head_grad_fp8
    assert table["bf16_down"][1].bf16_linears == ("w_down",)
    assert not table["head_bf16"][1].lm_head_grad_fp8 and table["head_fp8"][1].lm_head_fp8
    assert all(p.backend in ("xla", "bf16") for _, p in table.values())


def _tree(blocks, head, norm=0.0):
    shape = (2, 3)
    return {"embed": np.full((4, 3), head), "final_norm": np.full(3, norm),
            "blocks": {n: np.full(shape, v) for n, v in blocks.items()} |
            {"attn_norm": np.full(shape, norm), "mlp_norm": np.full(shape, norm)}}


def test_metrics_by_hand():
    """rel_err = ||g - ref|| / ||ref||, cos = <g, ref> / (|g| |ref|), whole, per role, per layer."""
    config = preset("tiny").replace(num_layers=2)
    ref = _tree({"wqkv": 1.0, "wo": 1.0, "w_gate_up": 1.0, "w_down": 1.0}, head=1.0, norm=1.0)
    got = _tree({"wqkv": 1.0, "wo": 1.0, "w_gate_up": 1.0, "w_down": -1.0}, head=1.5, norm=1.0)
    got["blocks"]["wqkv"] = np.asarray([[1.0] * 3, [2.0] * 3])  # layer 1's qkv twice as large
    m = fidelity.grad_metrics(got, ref, config)
    approx = lambda d: pytest.approx(d, abs=1e-12)  # noqa: E731
    assert m["per_role"]["down"] == approx({"cos": -1.0, "rel_err": 2.0})
    assert m["per_role"]["o"] == approx({"cos": 1.0, "rel_err": 0.0})
    assert m["per_role"]["head"] == approx({"cos": 1.0, "rel_err": 0.5})
    assert m["per_role"]["qkv"]["rel_err"] == approx(np.sqrt(3 / 6))
    # sums of squares: the differences (w_down's 6 entries, layer 1's 3 of qkv, the head's 12) over the reference's
    # (6 block arrays of 6, the embedding's 12, the final norm's 3)
    diff = 6 * 4 + 3 * 1 + 12 * 0.25
    assert m["grad_rel_err_vs_f32"] == approx(np.sqrt(diff / (6 * 6 + 12 + 3)))
    layer1 = m["per_layer"][1]["rel_err_by_role"]
    assert layer1["qkv"] == approx(1.0) and layer1["down"] == approx(2.0) and layer1["o"] == 0.0
    assert m["per_layer"][0]["rel_err_by_role"]["qkv"] == 0.0


def test_one_form_on_a_tiny_model():
    """The f32 form against itself is exact; the FP8 forms are not, and each observes every linear."""
    config = preset("tiny").replace(num_layers=2)
    params = llama.init_params(config, jax.random.PRNGKey(0), std=0.05)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(1, config.vocab_size, (4, 16)).astype(np.int32),
             "mask": np.arange(16)[None, :].repeat(4, 0) >= 6, "advantages": np.asarray([1, -1, 0.5, -0.5], np.float32)}
    loss = LossConfig(temperature=1.0, clip_low=0.2, clip_high=0.2, clip_ratio_c=0.0, loss_agg="token_mean",
                      loss_agg_norm=10.0, kl_coef=0.0, kl_estimator="k3", is_correction="none", is_cap=2.0,
                      mis_band=(0.999, 1.002), icepop_band=(0.5, 5.0))
    f32 = Precision(compute_dtype="float32")
    ref_logp, ref = fidelity.run_form(fidelity._loss_and_grad(config, f32, loss), params, batch, None)
    m = fidelity.grad_metrics(ref, ref, config)
    assert m["grad_rel_err_vs_f32"] == 0.0 and m["grad_cos_vs_f32"] == pytest.approx(1.0)
    observed = fidelity.calibration(fidelity._loss_and_grad(config, BASE, loss), config, params, BASE, batch)
    for name in llama.LINEARS:
        assert all(float(jnp.min(observed["blocks"][name][r]["amax_history"][:, 0])) > 0 for r in ("x", "grad"))
    block = fidelity.forms(BASE)["block"][1]
    state = update_state(llama.init_fp8_state(config, block), observed, block.recipe)
    logp, grad = fidelity.run_form(fidelity._loss_and_grad(config, block, loss), params, batch, state)
    m = fidelity.grad_metrics(grad, ref, config)
    assert 0 < m["grad_rel_err_vs_f32"] < 0.5 and len(m["per_layer"]) == 2
    assert 0 < np.abs(logp - ref_logp)[batch["mask"]].mean() < 0.1


def test_trained_params_are_the_checkpoints_master(tmp_path):
    """``--checkpoint``: the master parameters a trainer saved, for a model of the shipped shape; another shape is
    an error naming the checkpoint."""
    from pathlib import Path

    from fp8rl_jax.config import load_config_file
    from fp8rl_jax.trainer import Trainer

    config = load_config_file(str(Path(__file__).resolve().parents[1] / "configs" / "tiny.py"))
    with config.unlocked():
        config.workdir = str(tmp_path / "run")
        config.logging.progress = config.logging.tensorboard = config.logging.plots = False
    trainer = Trainer(config)
    trainer.save()
    want, model = jax.tree.map(np.asarray, trainer.state["params"]), trainer.model
    trainer.close()
    got_model, got = fidelity.trained_params(config, str(tmp_path / "run"), model)
    assert got_model == model
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), want)
    with pytest.raises(SystemExit, match="--checkpoint=.*run: its model .* is not the shipped SmolLM2"):
        fidelity.trained_params(config, str(tmp_path / "run"), model.replace(num_layers=model.num_layers + 1))


def test_plot_draws_the_forms_a_run_has(tmp_path):
    """``plot``: a PNG from any subset of the forms it knows (the panels of absent forms left out); none is an
    error."""
    def row(form, err):
        roles = {r: {"cos": 1.0, "rel_err": err} for r in ("qkv", "o", "gate_up", "down", "head", "norms")}
        layers = [{"layer": i, "cos": 1.0, "rel_err": err + i / 10} for i in range(3)]
        return {"form": form, "grad_rel_err_vs_f32": err, "per_role": roles, "per_layer": layers}

    rows = [row("bf16", 0.03), row("tensor", 0.4), row("block", 0.35), row("fprop_only", 0.3)]
    for subset in (rows, rows[2:3]):
        path = tmp_path / f"{len(subset)}.png"
        assert fidelity.plot(subset, str(path)) == str(path) and path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no form to plot"):
        fidelity.plot([row("head_fp8", 0.4)], str(tmp_path / "none.png"))
