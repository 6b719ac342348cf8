"""``bench fidelity``: where FP8 loses its points. Each FP8 form's forward and policy gradient against f32.

Deterministic, no training. Fixed parameters (SmolLM2-135M-Instruct as shipped, or a Llama-3.2-1B-shaped model with
random weights and fewer blocks); fixed batches of the RL study's task (``--config``, default
``configs/smollm2_arith.py``: its prompts, rewards, temperature and loss), completions sampled once by SmolLM2 in
BF16 (the rollout engine, a fixed key), rewarded, and given GRPO advantages. For each form, against the f32 model
(every GEMM f32, ``compute_dtype=float32``) on the same batch:

- ``logp_err_vs_f32``: mean |log pi_T(token) - f32's| over the completion tokens (the forward);
- ``grad_cos_vs_f32`` and ``grad_rel_err_vs_f32`` = ||g - g_ref|| / ||g_ref||: the gradient of the project's
  policy loss (``rl.losses.policy_loss``, ratio 1 as in the trainer's first minibatch, no IS weights) with respect
  to every parameter; ``per_role`` the same over each GEMM's kernels (qkv, o, gate_up, down; the head's, which a
  tied model shares with the embedding, and the norms), ``per_layer`` over each block's parameters.

Delayed scales (``tensor``, and the backward of ``rowwise``) come from two passes of the same loss over another
batch of the same size (the next prompts), in the ``tensor`` form: the first observes under scale 1, the second
under the first's scales, and every form's state holds the second's amaxes (as a delayed scale is one step old),
turned into scales for its own formats. Current and block scales need none, nor do the ``mantissa`` forms (the
floor: no scale at all, every operand of the blocks' GEMMs rounded to the format's mantissa with an unbounded
exponent, ``numerics.mantissa_rounded``; the head's backward GEMMs stay per-tensor delayed, as under block).
Transformer Engine runs on a GPU only: ``tensor`` here is the ``xla`` backend's delayed scaling, the same recipe
on the same quantized operands (the tests hold TE's operands to it bit for bit, ``tests/fp8/test_te_gpu.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax import plan
from fp8rl_jax.bench import tree_commit
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.fp8.recipe import Fp8Recipe, update_state
from fp8rl_jax.model import llama
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.rl.losses import policy_loss
from fp8rl_jax.rl.scoring import token_logprobs

ROLES = {"qkv": ("wqkv", "bqkv"), "o": ("wo",), "gate_up": ("w_gate_up",), "down": ("w_down",)}
LINEAR_OF = {"qkv": "wqkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}
BLOCK_E4M3 = Fp8Recipe(scaling="block", fp8_format="e4m3")  # DeepSeek-V3's recipe
MANTISSA_E4M3 = Fp8Recipe(scaling="mantissa", fp8_format="e4m3")  # the floor: E4M3's mantissa, no range limit


def forms(base: Precision) -> dict[str, tuple[str, Precision]]:
    """name -> (what it is, its precision). ``base``: the trainer's fp8_e2e on the xla backend (per-tensor delayed
    scaling, HYBRID, the head's backward GEMMs in FP8 with its recompute)."""
    r = base.recipe
    recipe = lambda **kw: base.replace(recipe=dataclasses.replace(r, **kw))  # noqa: E731
    bf16_head = dict(lm_head_grad_fp8=False, lm_head_recompute_fp8=False)
    # block scaling (DeepSeek-V3's) with some of its GEMMs, or its forward in another form, the head all BF16
    block_part = lambda **kw: base.replace(recipe=dataclasses.replace(BLOCK_E4M3, **kw), **bf16_head)  # noqa: E731
    # block scaling with every GEMM in FP8, the head's backward too
    block_all = lambda **kw: recipe(scaling="block", fp8_format="e4m3", **kw)  # noqa: E731
    out = {
        "bf16": ("BF16 GEMMs, no FP8 (the baseline's precision)", Precision(compute_dtype=base.compute_dtype)),
        "tensor": ("per-tensor delayed scaling, E4M3 fwd / E5M2 grads (fp8_e2e; TE's DelayedScaling, emulated)", base),
        "current": ("per-tensor current scaling, all three GEMMs", recipe(scaling="current")),
        "rowwise": ("rowwise: the forward per token x per output channel, the backward per tensor delayed",
                    recipe(scaling="rowwise")),
        "block": ("block: 1x128 tiles, 128x128 weight blocks, E4M3 fwd and bwd (DeepSeek-V3)", block_all()),
        "block_hybrid": ("block scaling with E5M2 gradients", recipe(scaling="block")),
        "block_wgrad_tiles": ("block with DeepSeek-V3's wgrad: its output gradient in 128x1 tiles (block_wgrad)",
                              block_all(block_wgrad="tiles")),
        "tensor_e4m3": ("per-tensor delayed, E4M3 gradients", recipe(fp8_format="e4m3")),
        "head_bf16": ("the blocks' GEMMs in FP8, the LM head all BF16 (its backward GEMMs too)",
                      base.replace(**bf16_head)),
        "head_only": ("the LM head's backward in FP8 only, every block BF16",
                      base.replace(bf16_linears=tuple(LINEAR_OF.values()))),
        # the blocks' GEMMs by kind, the head all BF16 (compare with head_bf16)
        "fprop_only": ("the blocks' forward in FP8 (BF16 dgrad and wgrad), the head BF16",
                       recipe(fp8_gemms=("fprop",)).replace(**bf16_head)),
        "dgrad_only": ("the blocks' dgrad in FP8 (BF16 forward and wgrad), the head BF16",
                       recipe(fp8_gemms=("dgrad",)).replace(**bf16_head)),
        "wgrad_only": ("the blocks' wgrad in FP8 (BF16 forward and dgrad), the head BF16",
                       recipe(fp8_gemms=("wgrad",)).replace(**bf16_head)),
        "backward_only": ("the blocks' dgrad and wgrad in FP8 (BF16 forward), the head BF16",
                          recipe(fp8_gemms=("dgrad", "wgrad")).replace(**bf16_head)),
        # the same split under the finer scalings, as the study's fp8_e2e_block_fprop, _block_backward and
        # _rowwise_fprop ran them
        "block_fprop_only": ("block's forward alone (BF16 dgrad and wgrad), the head BF16",
                             block_part(fp8_gemms=("fprop",))),
        "block_backward_only": ("block's dgrad and wgrad alone (BF16 forward), the head BF16",
                                block_part(fp8_gemms=("dgrad", "wgrad"))),
        # block's wgrad alone, its output gradient in 128 x 128 blocks (the default) or in 128 x 1 tiles (DeepSeek-V3's)
        "block_wgrad_only": ("block's wgrad alone (BF16 forward and dgrad), the head BF16",
                             block_part(fp8_gemms=("wgrad",))),
        "block_wgrad_only_tiles": ("block's wgrad alone with block_wgrad=tiles, the head BF16",
                                   block_part(fp8_gemms=("wgrad",), block_wgrad="tiles")),
        "rowwise_fprop_only": ("rowwise's forward alone (BF16 dgrad and wgrad), the head BF16",
                               recipe(scaling="rowwise", fp8_gemms=("fprop",)).replace(**bf16_head)),
        # block's forward halves (precision.block_forward), each alone as block_fprop_only
        **{f"block_fprop_{half}": (f"block's forward alone with block_forward={half}, the head BF16",
                                   block_part(fp8_gemms=("fprop",), block_forward=half))
           for half in ("tiles_channels", "tokens_blocks")},
        "head_fp8": ("the LM head in FP8 both ways (lm_head_fp8)", base.replace(lm_head_fp8=True)),
        "bf16_ends": ("the first and the last block in BF16", base.replace(bf16_first_layers=1, bf16_last_layers=1)),
        "block_head_bf16": ("block, the LM head all BF16", block_part()),
        # the floor (probe only): every block GEMM operand rounded to the format's mantissa with an unbounded
        # exponent, the best power-of-2 scales of any granularity can do (not a bound for f32 scales, which put each
        # group's amax on 448 exactly); the head's backward GEMMs stay per-tensor delayed, as under block scaling
        "mantissa_e4m3": ("floor: the blocks' GEMM operands rounded to E4M3's 3 mantissa bits, unbounded exponent",
                          base.replace(recipe=dataclasses.replace(r, scaling="mantissa", fp8_format="e4m3"))),
        "mantissa_hybrid": ("floor with E5M2's 2 mantissa bits for the gradients (HYBRID)", recipe(scaling="mantissa")),
        "mantissa_e4m3_head_bf16": ("mantissa_e4m3, the LM head all BF16",
                                    base.replace(recipe=MANTISSA_E4M3, **bf16_head)),
    }
    for role, name in LINEAR_OF.items():
        out[f"bf16_{role}"] = (f"{name} in BF16 in every block", base.replace(bf16_linears=(name,)))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/smollm2_arith.py",
                        help="the RL run whose task, rewards and loss the batch takes")
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "llama1b"),
                        help="llama1b: Llama-3.2-1B shapes, random weights (seed), SmolLM2's tokenizer and vocabulary")
    parser.add_argument("--layers", type=int, default=4, help="llama1b: its blocks cut to this many")
    parser.add_argument("--prompts", type=int, default=4,
                        help="prompts per batch (the probe's and the calibration's), each with rewards that differ")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (a GRPO group)")
    parser.add_argument("--pool", type=int, default=32, help="prompts sampled to find those groups, in order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forms", default="all", help="comma-separated names (see fidelity.forms), or all")
    parser.add_argument("--plot", default="", help="also draw the result into this PNG (``plot``)")
    parser.add_argument("--checkpoint", default=None,
                        help="smollm2: the parameters of a trainer checkpoint of it (a run's workdir, its "
                             "checkpoints/ folder or one step's folder) instead of the shipped ones; the batches "
                             "are still the shipped model's")


def run(args) -> list[dict]:
    from fp8rl_jax.config import load_config_file
    from fp8rl_jax.model import loading

    if args.checkpoint and args.model != "smollm2":
        raise SystemExit(f"--checkpoint is SmolLM2's trained parameters; --model={args.model} has random weights")
    config = load_config_file(args.config)
    config.precision.mode, config.precision.backend = "fp8_e2e", "xla"
    base = plan.run_precision(config, "train")
    table = forms(base)
    names = list(table) if args.forms == "all" else args.forms.split(",")
    if unknown := [n for n in names if n not in table]:
        raise SystemExit(f"--forms: {unknown} unknown; allowed: {', '.join(table)}")
    spec = plan.model_spec(config)
    smol = dataclasses.replace(spec, source="smollm2", tokenizer="", num_layers=0)
    sampler_model, sampler_params, tokenizer = loading.load_model(smol)
    t0 = time.perf_counter()
    probe, calib = sample_batches(config, sampler_model, sampler_params, tokenizer, args)
    print(f"batches sampled in {time.perf_counter() - t0:.0f} s: {probe['info']}", flush=True)
    if args.model == "smollm2":
        model, params = sampler_model, sampler_params
        if args.checkpoint:
            model, params = trained_params(config, args.checkpoint, sampler_model)
    else:
        model, params, _ = loading.load_model(dataclasses.replace(
            spec, source="preset", preset="llama3_1b", tokenizer="smollm2", num_layers=args.layers,
            preset_vocab="tokenizer", seed=args.seed))
    args.batch_info, args.model_info = probe["info"], describe(model, args)
    loss_cfg = plan.loss_config(config)
    ref_logp, ref_grad = run_form(_loss_and_grad(model, Precision(compute_dtype="float32"), loss_cfg), params,
                                  probe, None)
    t0 = time.perf_counter()
    observed = calibration(_loss_and_grad(model, base, loss_cfg), model, params, base, calib)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for name in names:
        what, precision = table[name]
        t = time.perf_counter()
        state = None
        if precision.fp8:
            state = update_state(llama.init_fp8_state(model, precision), observed, precision.recipe)
        logp, grad = run_form(_loss_and_grad(model, precision, loss_cfg), params, probe, state)
        mask = probe["mask"]
        row = {"form": name, "what": what, "logp_err_vs_f32": float(np.abs(logp - ref_logp)[mask].mean()),
               **grad_metrics(grad, ref_grad, model), "seconds": round(time.perf_counter() - t, 1)}
        print(json.dumps({k: v for k, v in row.items() if k not in ("per_layer", "per_role")}), flush=True)
        rows.append(row)
        del logp, grad, state
        jax.clear_caches()  # this form's programs and their buffers
    if args.plot:
        print(f"wrote {plot(rows, args.plot)}", flush=True)
    return rows


def trained_params(config, checkpoint: str, shipped: LlamaConfig) -> tuple[LlamaConfig, dict]:
    """``(model, master params)`` of the trainer checkpoint ``checkpoint`` (``eval.cli.resolve_checkpoint``'s
    forms), which must be of the shipped model's shape."""
    from fp8rl_jax.eval.cli import resolve_checkpoint
    from fp8rl_jax.policy_io import load_policy

    folder, step = resolve_checkpoint(checkpoint)
    model, params, _, _, _ = load_policy(config, folder, step)
    if model != shipped:
        raise SystemExit(f"--checkpoint={checkpoint}: its model {model} is not the shipped SmolLM2's {shipped}")
    print(f"parameters: {folder} step {step}", flush=True)
    return model, params


def describe(model: LlamaConfig, args) -> str:
    if args.model == "smollm2" and args.checkpoint:
        return f"SmolLM2-135M-Instruct after RL: the master parameters of the checkpoint {args.checkpoint}"
    if args.model == "smollm2":
        return "SmolLM2-135M-Instruct (the embedded GGUF, dequantized to f32)"
    return (f"Llama-3.2-1B shapes (hidden {model.hidden_size}, MLP {model.intermediate_size}), {model.num_layers} "
            f"blocks, vocabulary {model.vocab_size}, random weights (seed {args.seed})")


# ----------------------------------------------------------------------------------------------------------
# the batch


def sample_batches(config, model: LlamaConfig, params: dict, tokenizer, args) -> tuple[dict, dict]:
    """The probe's batch and the calibration's: the first ``2 * args.prompts`` prompts of the task's train split
    (of the first ``args.pool``) whose ``args.samples`` completions, sampled by the model in BF16 with one fixed key,
    do not all get one reward (a group whose advantages are all 0 has no gradient). Each batch: ``tokens`` [B, W]
    (prompt, completion, padding; one W for both), ``mask`` [B, W] (the completion tokens), ``advantages`` [B]."""
    from fp8rl_jax.data.prompts import load_prompts
    from fp8rl_jax.rl.advantages import group_advantages
    from fp8rl_jax.rl.rewards import combined_rewards
    from fp8rl_jax.rollout import driver
    from fp8rl_jax.rollout.engine import Engine, EngineConfig, prefill_bucket
    from fp8rl_jax.rollout.sampling import SamplingParams

    records = load_prompts(plan.data_spec(config), tokenizer, "train", limit=args.pool).records
    prompts = [list(r.prompt_ids) for r in records]
    n = args.samples
    engine = Engine(model, Precision(), EngineConfig(
        max_concurrent_decodes=min(len(prompts) * n, 64), max_new_tokens=config.rollout.max_new_tokens,
        max_prefill_length=prefill_bucket(max(map(len, prompts)), 1024),
        sampling=SamplingParams(temperature=config.rollout.temperature), stop_ids=tokenizer.stop_ids))
    batch = driver.generate(engine, engine.load_params(params), prompts, n, jax.random.PRNGKey(args.seed))
    completions = [batch.completion(i).tolist() for i in range(len(prompts) * n)]
    texts = [tokenizer.decode(c) for c in completions]
    rewards, _ = combined_rewards(config.reward.fns, config.reward.weights, [records[i // n] for i in
                                                                              range(len(texts))], texts)
    rewards = rewards.reshape(len(prompts), n)
    groups = [p for p in range(len(prompts)) if np.ptp(rewards[p]) > 0][: 2 * args.prompts]
    if len(groups) < 2 * args.prompts:
        raise SystemExit(f"only {len(groups)} of the first {args.pool} prompts got differing rewards; "
                         f"{2 * args.prompts} needed: raise --pool or --samples")
    adv = np.asarray(group_advantages(jnp.asarray(rewards[groups]), config.rl.advantage), np.float32)
    seqs = [prompts[p] + completions[p * n + s] for p in groups for s in range(n)]
    width = -(-max(map(len, seqs)) // 16) * 16
    tokens = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), bool)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = seq
        mask[i, len(prompts[groups[i // n]]): len(seq)] = True
    half = args.prompts * n
    out = []
    for part in (slice(0, half), slice(half, 2 * half)):
        chosen = groups[part.start // n: part.stop // n]
        info = {"sequences": half, "prompts": [records[p].question for p in chosen], "width": width,
                "completion_tokens": int(mask[part].sum()), "mean_reward": float(rewards[chosen].mean()),
                "first_completion": texts[chosen[0] * n]}
        out.append({"tokens": tokens[part], "mask": mask[part], "advantages": adv[part.start // n: part.stop // n]
                    .ravel(), "info": info})
    return out[0], out[1]


# ----------------------------------------------------------------------------------------------------------
# one form


def _loss_and_grad(model: LlamaConfig, precision: Precision, loss_cfg):
    def loss_fn(params, state, tokens, mask, advantages):
        logp = token_logprobs(params, tokens, config=model, precision=precision, fp8_state=state,
                              temperature=loss_cfg.temperature)[0]
        loss, _ = policy_loss(logp, jax.lax.stop_gradient(logp), advantages, mask, clip_low=loss_cfg.clip_low,
                              clip_high=loss_cfg.clip_high, clip_ratio_c=loss_cfg.clip_ratio_c,
                              loss_agg=loss_cfg.loss_agg, loss_agg_norm=loss_cfg.loss_agg_norm)
        return loss, logp

    return jax.jit(jax.grad(loss_fn, argnums=(0, 1), has_aux=True))


def run_form(step, params, batch, state):
    """(logp [B, W] of the batch, the loss's gradient with respect to the params) of ``step`` (``_loss_and_grad``)."""
    (grad, _), logp = step(params, state, batch["tokens"], batch["mask"], batch["advantages"])
    return np.asarray(logp, np.float64), jax.tree.map(np.asarray, grad)  # f32 on the host (a 1B model's are 4 GB)


def calibration(step, model, params, precision, batch):
    """The amaxes of the loss's gradient (``step``, in ``precision``) over ``batch``, observed under the scales of a
    first such pass (see the module's docstring)."""
    init = llama.init_fp8_state(model, precision)
    state = init
    for _ in range(2):
        (_, observed), _ = step(params, state, batch["tokens"], batch["mask"], batch["advantages"])
        state = update_state(init, observed, precision.recipe)
    return observed


# ----------------------------------------------------------------------------------------------------------
# metrics


def _cos_rel(g: list[np.ndarray], ref: list[np.ndarray]) -> dict:
    """Cosine and ||g - ref|| / ||ref|| of the arrays taken as one vector; sums in float64, one array at a time."""
    ab = aa = bb = dd = 0.0
    for x, y in zip(g, ref, strict=True):
        a, b = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
        ab, aa, bb, dd = ab + a @ b, aa + a @ a, bb + b @ b, dd + (a - b) @ (a - b)
    return {"cos": float(ab / np.sqrt(aa * bb)), "rel_err": float(np.sqrt(dd / bb))}


def role_params(tree: dict, tied: bool) -> dict[str, list[np.ndarray]]:
    """A params-shaped tree's arrays by GEMM role (stacked over the blocks), the head's and the norms'."""
    blocks = tree["blocks"]
    out = {role: [blocks[n] for n in names if n in blocks] for role, names in ROLES.items()}
    out["head"] = [tree["embed"] if tied else tree["lm_head"]]
    out["norms"] = [blocks["attn_norm"], blocks["mlp_norm"], tree["final_norm"]]
    if not tied:
        out["embed"] = [tree["embed"]]
    return out


def grad_metrics(grad: dict, ref: dict, model: LlamaConfig) -> dict:
    whole = _cos_rel(jax.tree.leaves(grad), jax.tree.leaves(ref))
    tied = "lm_head" not in grad
    got, want = role_params(grad, tied), role_params(ref, tied)
    per_role = {role: _cos_rel(got[role], want[role]) for role in got}
    per_layer = []
    for i in range(model.num_layers):
        blocks = [a[i] for a in grad["blocks"].values()], [a[i] for a in ref["blocks"].values()]
        layer = {"layer": i, **_cos_rel(*blocks)}
        layer["rel_err_by_role"] = {role: _cos_rel([a[i] for a in got[role]], [a[i] for a in want[role]])["rel_err"]
                                    for role in ROLES}
        per_layer.append(layer)
    return {"grad_cos_vs_f32": whole["cos"], "grad_rel_err_vs_f32": whole["rel_err"], "per_role": per_role,
            "per_layer": per_layer}


def output(rows: list[dict], args) -> dict:
    """The file: what was run, on what, and one row per form."""
    return {"device": rows[0]["device"] if rows else None, "commit": tree_commit(),
            "command": "python -m fp8rl_jax.bench fidelity " + " ".join(sys.argv[2:]), "model": args.model_info,
            "config": args.config, "batch": args.batch_info,
            "te": "not run: Transformer Engine needs a CUDA GPU; 'tensor' is the xla backend's delayed scaling",
            "reference": "f32: every GEMM and the activations in f32 (Precision(compute_dtype='float32'))",
            "calibration": "delayed scales: the amaxes of the 'tensor' form's second pass of the loss's gradient over "
                           "the next prompts' batch (the first under scale 1), in each form's formats",
            "rows": rows}


# ----------------------------------------------------------------------------------------------------------
# the plot

# what each panel shows, where the rows have it: the gradient error by source (the FP8 GEMMs of one kind alone, the
# rest BF16), by scaling, then per role and per block for the forms that frame the target
SOURCES = (("bf16", "BF16"), ("fprop_only", "blocks' forward alone"), ("dgrad_only", "blocks' dgrad alone"),
           ("wgrad_only", "blocks' wgrad alone"), ("head_only", "head's backward alone"), ("tensor", "all (fp8_e2e)"))
SCALINGS = (("tensor", "per-tensor delayed"), ("current", "per-tensor current"), ("rowwise", "rowwise"),
            ("tensor_e4m3", "per-tensor, E4M3 grads"), ("block_hybrid", "block, E5M2 grads"), ("block", "block"),
            ("mantissa_e4m3", "floor: E4M3 mantissa"))
FRAMED = ("bf16", "tensor", "block", "mantissa_e4m3", "fprop_only")


def plot(rows: list[dict], path: str) -> str:
    """Draw a probe's rows into ``path`` (PNG): the gradient's relative error against f32 by source and by scaling
    (bars; the dashed line is half of per-tensor delayed scaling's, the issue's target for block), per GEMM role
    and per block for the framing forms. Panels whose forms a run left out are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r["form"]: r for r in rows}
    bars = [(title, [(by[f], label) for f, label in group if f in by])
            for title, group in (("by source", SOURCES), ("by scaling", SCALINGS))]
    bars = [(title, group) for title, group in bars if group]
    framed = [by[f] for f in FRAMED if f in by]
    panels = len(bars) + 2 * bool(framed)
    if not panels:
        raise ValueError(f"no form to plot among {sorted(by)}")
    cols = min(panels, 2)
    fig, axes = plt.subplots(-(-panels // cols), cols, figsize=(6.4 * cols, 4.0 * -(-panels // cols)), squeeze=False)
    axes = list(axes.ravel())
    target = 0.5 * by["tensor"]["grad_rel_err_vs_f32"] if "tensor" in by else None
    try:
        for (title, group), ax in zip(bars, axes, strict=False):
            values = [r["grad_rel_err_vs_f32"] for r, _ in group]
            ax.barh(range(len(group)), values, color="tab:blue")
            ax.set_yticks(range(len(group)), [label for _, label in group])
            ax.invert_yaxis()
            for i, v in enumerate(values):
                ax.text(v, i, f" {v:.3f}", va="center", fontsize=8)
            if target is not None:
                ax.axvline(target, color="tab:red", linestyle="--", linewidth=1, label="0.5 x per-tensor")
                ax.legend(loc="lower right", fontsize=8)
            ax.set_xlim(0, 1.2 * max(values))
            ax.set_title(f"policy gradient's error vs f32, {title}", fontsize=9)
            ax.set_xlabel("||g - g_f32|| / ||g_f32||")
        if framed:
            ax_role, ax_layer = axes[len(bars): len(bars) + 2]
            roles = list(framed[0]["per_role"])
            width = 0.8 / len(framed)
            for k, r in enumerate(framed):
                ax_role.bar([i + k * width for i in range(len(roles))], [r["per_role"][q]["rel_err"] for q in roles],
                            width, label=r["form"])
                layers = r["per_layer"]
                ax_layer.plot([x["layer"] for x in layers], [x["rel_err"] for x in layers], marker=".",
                              label=r["form"])
            ax_role.set_xticks([i + 0.4 - width / 2 for i in range(len(roles))], roles)
            ax_role.set_title("per GEMM role's parameters", fontsize=9)
            ax_layer.set_title("per block's parameters", fontsize=9)
            ax_layer.set_xlabel("block")
            for ax in (ax_role, ax_layer):
                ax.set_ylabel("relative error vs f32")
                ax.grid(alpha=0.3)
                ax.set_ylim(0, 1.2 * ax.get_ylim()[1])  # room for the legend above the lines and bars
                ax.legend(fontsize=7, ncol=len(framed), loc="upper center")
        for ax in axes[panels:]:  # an odd count's last cell
            ax.set_visible(False)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
