"""``bench e2e``: whole GRPO steps per phase, one precision mode per child process (``fp8rl_jax.bench``).

Each mode runs the trainer from ``--config`` (with ``--set`` overrides) in a fresh process, so that every mode
starts with an empty device and its own ``XLA_FLAGS``: ``--warmup`` steps (compilation, the first calibration),
then ``--steps`` timed steps whose phase times (``time/weights``: the sampler's FP8 kernels quantized;
``rollout``, ``reward``, ``score``, ``train``, ``calibrate``: KV and FP8 recalibration) are averaged. Modes:

    bf16           BF16 everywhere, XLA's default GEMMs (Triton for many shapes)
    bf16_cublas    the same with ``--xla_gpu_enable_triton_gemm=false`` (cuBLAS); the best BF16 is the faster
    fp8_rollout    FP8 sampler, BF16 trainer
    fp8_e2e        FP8 sampler and trainer, one set of delayed scales
    fp8_e2e_head   the same with the LM head in FP8 too (``precision.lm_head_fp8``)
    fp8_e2e_bf16_head_grad  fp8_e2e with the BF16 LM head's backward GEMMs in BF16 too (``precision.lm_head_grad_fp8``
                   off, the earlier default; its results files call fp8_e2e with it on fp8_e2e_headgrad)
    fp8_e2e_bf16_recompute  fp8_e2e with the LM head's backward logit recompute in BF16
                   (``precision.lm_head_recompute_fp8`` off, the earlier default: two of its four GEMMs FP8)
    fp8_e2e_residual_adds  fp8_e2e with the rollout's residual adds after wo and w_down as XLA adds after TE's
                   GEMMs (``precision.residual_in_gemm`` off, the earlier default)
    fp8_e2e_cublas fp8_e2e with its BF16 GEMMs (head, BF16 blocks) on cuBLAS, as bf16_cublas's
    fp8_e2e_xla    fp8_e2e on the xla backend (XLA's FP8 GEMMs and fusions, no TE), cuBLAS for the rest
    fp8_e2e_block  block scaling on the xla backend (``precision.scaling=block``, E4M3); ``_mosaic`` and
                   ``_cublaslt`` with one block GEMM alone, ``_unfused`` with ``precision.fused_mlp`` off

Train throughput counts model FLOPs only (``6 x`` the GEMM parameters per trained token plus causal attention;
remat's recomputation is not counted), MFU is against the device's dense BF16 peak for every mode. The rollout's
fraction of its HBM bound uses the bytes one decode step must read (the sampler's weights once, the KV of the
average context of each slot) over the measured copy bandwidth; the phase includes prefill and host syncs.

Speedups in the summary are fp8_e2e over the best BF16 mode, phase by phase (over the rows of the first
``--packing`` layout); ``mode_speedups`` has them for every mode that is not BF16.

Completion lengths (``--lengths``): with random weights a stop token never comes, so every completion is
``max_new_tokens`` long and padding costs nothing to remove. ``lognormal:MEAN_FRACTION,SIGMA`` draws a length per
sequence, ``max_new_tokens x MEAN_FRACTION x exp(SIGMA Z - SIGMA^2 / 2)`` (mean MEAN_FRACTION of the budget before
clipping to [1, max_new_tokens]), ``file:PATH`` draws with replacement from the integers in a file (whitespace or
JSON list), ``fixed`` keeps what the rollout returned. Each completion is cut at its drawn length after the rollout
(the rollout itself still decodes the whole budget: its time is not what these lengths are for), from the reward
on; the draws depend on the step only, so every mode and layout sees the same lengths.

Packing (``--packing=off|on``, or ``off,on`` for both, each a child process per mode): ``rl.packing``. With both,
``packed_speedup[mode]`` = (score + train) seconds unpacked / packed over the timed steps, each less the seconds
it compiled (the unpacked layout pads to each batch's longest row, so a new width compiles its programs inside a
step; ``timed_steps`` has each step's seconds and compile seconds), ``packed_speedup_with_compile`` the same with
them; ``packing_summary(rows)`` builds ``{"rows": [...], "packed_speedup": {...}, ...}`` from any rows (the
integrator's files of several runs too).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from fp8rl_jax.bench import emit, tree_commit

PHASES = ("weights", "rollout", "reward", "score", "train", "calibrate", "step")
# block scaling (1 x 128 tiles, 128 x 128 weight blocks, E4M3 throughout) on the xla backend
BLOCK = {"precision.backend": "xla", "precision.scaling": "block", "precision.fp8_format": "e4m3"}
MODES = {  # mode -> (precision.mode, extra XLA flags, config overrides)
    "bf16": ("bf16", "", {}),
    "bf16_cublas": ("bf16", "--xla_gpu_enable_triton_gemm=false", {}),
    "fp8_rollout": ("fp8_rollout", "", {}),
    "fp8_e2e": ("fp8_e2e", "", {}),
    "fp8_e2e_head": ("fp8_e2e", "", {"precision.lm_head_fp8": True}),
    "fp8_e2e_bf16_head_grad": ("fp8_e2e", "", {"precision.lm_head_grad_fp8": False}),
    "fp8_e2e_bf16_recompute": ("fp8_e2e", "", {"precision.lm_head_recompute_fp8": False}),
    "fp8_e2e_residual_adds": ("fp8_e2e", "", {"precision.residual_in_gemm": False}),
    # the BF16 GEMMs of an FP8 step (the head, the BF16 first / last blocks) on cuBLAS, as bf16_cublas's
    "fp8_e2e_cublas": ("fp8_e2e", "--xla_gpu_enable_triton_gemm=false", {}),
    # XLA's own FP8 GEMMs (cuBLASLt), its fusions around them (casts and amaxes inside the producers' kernels)
    "fp8_e2e_xla": ("fp8_e2e", "--xla_gpu_enable_triton_gemm=false", {"precision.backend": "xla"}),
    # block scaling: on a Hopper GPU cuBLASLt above a decode step's rows, kernels.block_gemm up to them
    # (precision.block_gemm=auto); then each of the two alone
    "fp8_e2e_block": ("fp8_e2e", "--xla_gpu_enable_triton_gemm=false", BLOCK),
    "fp8_e2e_block_mosaic": ("fp8_e2e", "--xla_gpu_enable_triton_gemm=false",
                             {**BLOCK, "precision.block_gemm": "mosaic"}),
    "fp8_e2e_block_cublaslt": ("fp8_e2e", "--xla_gpu_enable_triton_gemm=false",
                               {**BLOCK, "precision.block_gemm": "cublaslt"}),
    # block scaling's MLP as the two linears' autodiff (precision.fused_mlp off)
    "fp8_e2e_block_unfused": ("fp8_e2e", "--xla_gpu_enable_triton_gemm=false", {**BLOCK, "precision.fused_mlp": False}),
    # block scaling with DeepSeek-V3's weight gradient: its output gradient in 128 x 1 tiles (precision.block_wgrad)
    "fp8_e2e_block_wgrad_tiles": ("fp8_e2e", "--xla_gpu_enable_triton_gemm=false",
                                  {**BLOCK, "precision.block_wgrad": "tiles"}),
}
# dense BF16 tensor-core peaks (TFLOP/s) by device kind prefix; FP8 doubles them on Hopper
BF16_PEAK_TFLOPS = {"NVIDIA H100": 989.4, "NVIDIA H200": 989.4, "NVIDIA GH200": 989.4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/llama1b.py", help="a config file (path[:arg])")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, e.g. --set model.source=preset (repeatable)")
    parser.add_argument("--modes", default="fp8_e2e,bf16,bf16_cublas,fp8_rollout")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per mode")
    parser.add_argument("--smoke", action="store_true", help="configs/tiny.py, bf16 and fp8_e2e, one timed step")
    parser.add_argument("--lengths", default="fixed", type=parse_lengths,
                        help="completion lengths: fixed | lognormal:MEAN_FRACTION,SIGMA | file:PATH")
    parser.add_argument("--packing", default="off", type=parse_packing,
                        help="rl.packing: off | on | off,on (each mode in both layouts)")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # child: run this mode, write --out


def run(args) -> list[dict]:
    if args.one:
        return [measure(args.config, args.one, args.set, args.warmup, args.steps, lengths=args.lengths,
                        packing=args.packing[0])]
    if args.smoke:
        args.config, args.modes, args.steps = "configs/tiny.py", "bf16,fp8_e2e", 1
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"error: bench e2e: mode {mode!r}; allowed: {', '.join(MODES)}")
    rows = []
    for mode, packing in itertools.product(modes, args.packing):
        row = _child(args, mode, packing)
        emit(rows, row)
        if args.out:  # a mode that times out later still leaves the earlier ones
            Path(args.out).write_text(json.dumps(summarize(rows, args), indent=1))
    return rows


def _child(args, mode: str, packing: bool = False) -> dict:
    env = dict(os.environ)
    if MODES[mode][1]:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {MODES[mode][1]}".strip()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "fp8rl_jax.bench", "e2e", "--one", mode, "--config", args.config,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", str(out),
               f"--lengths={args.lengths.spec}", f"--packing={'on' if packing else 'off'}",
               *[f"--set={s}" for s in args.set]]
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code != 0 or not out.exists():
            return {"mode": mode, "packing": "on" if packing else "off", "error": f"child exited {code}"}
        return json.loads(out.read_text())[0]


def measure(config_path: str, mode: str, sets: list[str], warmup: int, steps: int,
            lengths: Lengths | str = "fixed", packing: bool = False) -> dict:
    """Build the trainer for ``mode``, run ``warmup`` then ``steps`` RL steps; the timed steps' averages.
    ``lengths``: the completions' lengths (``parse_lengths``); ``packing``: ``rl.packing``."""
    import jax

    from fp8rl_jax.bench import device_name
    from fp8rl_jax.bench.rollout import _weight_bytes, copy_bandwidth
    from fp8rl_jax.model.attention import resolve_attention
    from fp8rl_jax.trainer import Trainer

    path, _, arg = config_path.partition(":")
    overrides = dict(s.split("=", 1) for s in sets)
    overrides = {k: _value(v) for k, v in overrides.items()}
    with tempfile.TemporaryDirectory() as workdir:
        overrides.update({"precision.mode": MODES[mode][0], "workdir": workdir, "steps": warmup + steps,
                          "checkpoint.every": 0, "checkpoint.save_final": False, "logging.progress": False,
                          "logging.tensorboard": False, "logging.plots": False, "data.num_eval": 0,
                          "rl.packing": packing})
        overrides.update(MODES[mode][2])
        trainer = Trainer.from_file(path, arg or None, **overrides)
        lengths = parse_lengths(lengths) if isinstance(lengths, str) else lengths
        enforce_lengths(trainer, lengths)
        records = [trainer.step() for _ in range(warmup + steps)]
        timed = records[warmup:]
        c, model, slots = trainer.config, trainer.model, trainer.sampler.slot_plan.slots
        precision, train_precision = trainer.rollout_precision, trainer.train_precision
        trainer.close()
    mean = lambda key: mean_of(timed, lambda r: r[key])  # noqa: E731
    row = {"mode": mode, "packing": "on" if packing else "off", "lengths": lengths.spec,
           "backend": timed[-1]["precision_backend"], "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "config": config_path, "overrides": sets,
           "warmup": warmup, "steps": steps, "sequences": c.rollout.prompts_per_step * c.rollout.samples_per_prompt,
           "max_new_tokens": c.rollout.max_new_tokens, "decode_slots": slots,
           "device": device_name(), "devices": jax.device_count(), "num_layers": model.num_layers,
           "hidden_size": model.hidden_size, "params_billion": model.num_params() / 1e9,
           "attention": resolve_attention(precision.attention, precision.dtype, model.head_dim),
           "lm_head_fp8": precision.lm_head_fp8, "lm_head_grad_fp8": train_precision.lm_head_grad_fp8,
           "lm_head_recompute_fp8": train_precision.lm_head_recompute_fp8,
           **{f"time_{p}": mean(f"time/{p}") for p in PHASES if f"time/{p}" in timed[0]},
           "response_length_mean": mean("response_length_mean"),
           "time_score_train": mean_of(timed, lambda r: r["time/score"] + r["time/train"]),
           "rollout_tokens_per_s": mean("rollout_tokens_per_s"),
           # the compiles of the warm-up steps by phase (a slow compile, e.g. a kernel lowered once per call site)
           "warmup_compile_s": {p: round(sum(r.get(f"time/{p}_compile", 0.0) for r in records[:warmup]), 3)
                                for p in PHASES if f"time/{p}_compile" in records[0]}}
    # train: model FLOPs of the trained tokens (prompt + completion) per train-phase second
    tokens = mean_of(timed, lambda r: r["train_tokens_per_s"] * r["time/train"])
    context = tokens / row["sequences"]  # mean trained sequence length
    prompt = context - row["response_length_mean"]
    attention = 6 * model.num_layers * model.q_size * context  # causal: 2 x 2 x T/2 per token and layer, x3 with bwd
    matmul_params = model.num_params() - model.vocab_size * model.hidden_size * (0 if model.tie_embeddings else 1)
    train_flops = tokens * (6 * matmul_params + attention)
    row["train_tflops"] = train_flops / row["time_train"] / 1e12 / jax.device_count()
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if row["device"].startswith(k)), None)
    row["mfu_bf16_peak"] = row["train_tflops"] / peak if peak else None
    # rollout: the decode step's bytes against the copy bandwidth
    if jax.default_backend() != "cpu":
        kv_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * (1 if precision.kv_fp8 else 2)
        step_bytes = _weight_bytes(model, precision) + row["decode_slots"] * (
            prompt + row["response_length_mean"] / 2) * kv_bytes
        bound = row["decode_slots"] / (step_bytes / copy_bandwidth()) / jax.device_count()
        row["rollout_hbm_bound_tokens_per_s"] = bound
        row["hbm_bound_fraction"] = row["rollout_tokens_per_s"] / bound
    # each timed step's score + train seconds and the seconds JAX spent compiling in them (a new row width or
    # packed shape compiles inside a timed step): packed_speedup takes them out
    row["timed_steps"] = [{"step": warmup + i + 1, "score_train": r["time/score"] + r["time/train"],
                           "compile_s": r["time/score_compile"] + r["time/train_compile"]}
                          for i, r in enumerate(timed)]
    if packing:  # rows per microbatch of every step, warmup first (a timed step of new rows compiled its shape)
        row["packing_rows"] = [int(r["packing/rows"]) for r in records]
        row["packing_fill"] = mean("packing/fill")
    row["peak_memory_gib"] = {p: timed[-1][f"memory/{p}_peak_gib"] for p in PHASES
                              if f"memory/{p}_peak_gib" in timed[-1]}
    return row


@dataclasses.dataclass(frozen=True)
class Lengths:
    """How ``bench e2e`` sets completion lengths (``parse_lengths``)."""

    spec: str  # as given on the command line
    kind: str  # fixed | lognormal | file
    mean_fraction: float = 1.0
    sigma: float = 0.0
    values: tuple[int, ...] = ()

    def draw(self, n: int, max_new: int, rng: np.random.Generator) -> np.ndarray | None:
        """``n`` lengths in [1, max_new] (None for ``fixed``)."""
        if self.kind == "fixed":
            return None
        if self.kind == "lognormal":
            z = rng.standard_normal(n)
            drawn = max_new * self.mean_fraction * np.exp(self.sigma * z - self.sigma**2 / 2)
        else:
            drawn = rng.choice(np.asarray(self.values), size=n, replace=True)
        return np.clip(np.rint(drawn), 1, max_new).astype(np.int64)


LENGTHS_HELP = "fixed | lognormal:MEAN_FRACTION,SIGMA (0 < MEAN_FRACTION <= 1, SIGMA >= 0) | file:PATH"


def parse_lengths(spec: str) -> Lengths:
    """``--lengths``: ``fixed``, ``lognormal:MEAN_FRACTION,SIGMA`` or ``file:PATH`` (integers, whitespace-separated
    or a JSON list)."""
    kind, _, arg = spec.partition(":")
    if kind == "fixed" and not arg:
        return Lengths(spec, "fixed")
    if kind == "lognormal":
        try:
            mean_fraction, sigma = (float(x) for x in arg.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--lengths={spec}: allowed: {LENGTHS_HELP}") from None
        if not (0 < mean_fraction <= 1 and sigma >= 0):
            raise argparse.ArgumentTypeError(f"--lengths={spec}: allowed: {LENGTHS_HELP}")
        return Lengths(spec, "lognormal", mean_fraction=mean_fraction, sigma=sigma)
    if kind == "file" and arg:
        try:
            text = Path(arg).read_text()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"--lengths={spec}: cannot read {arg}: {e.strerror}") from None
        try:
            values = json.loads(text) if text.lstrip().startswith("[") else text.split()
            values = tuple(int(v) for v in values)
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"--lengths={spec}: {arg} must hold integers (whitespace-separated or "
                                             "a JSON list)") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"--lengths={spec}: {arg} must hold at least one length, each >= 1")
        return Lengths(spec, "file", values=values)
    raise argparse.ArgumentTypeError(f"--lengths={spec}: allowed: {LENGTHS_HELP}")


def parse_packing(spec: str) -> tuple[bool, ...]:
    """``--packing``: ``off``, ``on`` or both, comma-separated, in the order given."""
    names = spec.split(",")
    if not names or any(n not in ("on", "off") for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--packing={spec}: allowed: off | on | off,on")
    return tuple(n == "on" for n in names)


def truncate(batch, lengths: np.ndarray | None):
    """``batch`` (a ``RolloutBatch``) with each completion cut at ``lengths`` (a completion shorter already stays
    as it is); a cut completion's finish reason becomes ``length``."""
    if lengths is None:
        return batch
    new = np.minimum(batch.lengths, lengths)
    keep = np.arange(batch.tokens.shape[1])[None] < new[:, None]
    reasons = [r if n == old else "length" for r, n, old in zip(batch.finish_reasons, new, batch.lengths,
                                                                    strict=True)]
    return dataclasses.replace(batch, tokens=np.where(keep, batch.tokens, 0).astype(batch.tokens.dtype),
                               logprobs=np.where(keep, batch.logprobs, 0.0).astype(batch.logprobs.dtype),
                               lengths=new.astype(batch.lengths.dtype), finish_reasons=reasons)


def enforce_lengths(trainer, lengths: Lengths) -> None:
    """From now on the trainer's rollouts come back cut to lengths drawn by ``lengths`` (``truncate``), a draw per
    rollout from a generator seeded by the config's seed and the rollout's index: the same lengths in every mode."""
    if lengths.kind == "fixed":
        return
    max_new, seed, count = trainer.config.rollout.max_new_tokens, trainer.config.seed, itertools.count()

    def cut(rollout):
        def call(*args, **kwargs):
            batch = rollout(*args, **kwargs)
            rng = np.random.default_rng([seed, next(count)])
            return truncate(batch, lengths.draw(len(batch.lengths), max_new, rng))
        return call

    trainer.sampler.rollout = cut(trainer.sampler.rollout)
    if trainer.exact_sampler is not None:
        trainer.exact_sampler.rollout = cut(trainer.exact_sampler.rollout)


def packed_speedup(rows: list[dict], steps: set[int] | None = None, *, with_compile: bool = False) -> dict[str, float]:
    """Per mode (and lengths) with both layouts measured: (score + train) seconds unpacked / packed. Several
    ``--lengths`` of one mode: the key is ``mode@lengths``. Where both rows list their ``timed_steps``: summed over
    the steps both timed (the same steps draw the same lengths in both; ``steps``: these instead), each step less
    the seconds it spent compiling (the steady state: the unpacked layout pads to each batch's longest row, so a
    step of a new width compiles its programs; ``with_compile`` keeps them in). Else the rows' means."""
    def seconds(r: dict, pair: set[int] | None) -> float:
        if pair is None:
            return r["time_score"] + r["time_train"]
        return sum(s["score_train"] - (0.0 if with_compile else s["compile_s"])
                   for s in r["timed_steps"] if s["step"] in pair)

    def timed(r: dict) -> set:
        return {s["step"] for s in r.get("timed_steps", [])}

    ok = [r for r in rows if "error" not in r]
    specs = {r["mode"]: set() for r in ok}
    for r in ok:
        specs[r["mode"]].add(r.get("lengths", "fixed"))
    out = {}
    for r in ok:
        if r.get("packing", "off") != "off":
            continue
        spec = r.get("lengths", "fixed")
        on = [q for q in ok if q["mode"] == r["mode"] and q.get("lengths", "fixed") == spec
              and q.get("packing") == "on"]
        if on:
            key = r["mode"] if len(specs[r["mode"]]) == 1 else f"{r['mode']}@{spec}"
            pair = steps if steps is not None else (timed(r) & timed(on[-1])) or None
            out[key] = seconds(r, pair) / seconds(on[-1], pair)
    return out


def packing_summary(rows: list[dict], steps: set[int] | None = None) -> dict:
    """``{"rows": rows, "packed_speedup": {mode: x}}`` (``packed_speedup``), e.g. over the rows of several
    ``bench e2e`` files (their ``modes``). Where no mode is plain ``bf16``, the key ``bf16`` is the BF16 mode
    (``bf16_cublas``) whose unpacked score + train ran fastest, named by ``packed_speedup_bf16_mode``."""
    speedups = packed_speedup(rows, steps)
    out = {"rows": rows, "packed_speedup": speedups,
           "packed_speedup_with_compile": packed_speedup(rows, steps, with_compile=True)}
    if steps is not None:
        out["packed_speedup_steps"] = sorted(steps)
    bf16 = [r for r in rows if "error" not in r and r["mode"].startswith("bf16") and r.get("packing", "off") == "off"
            and r["mode"] in speedups]
    if bf16 and "bf16" not in speedups:
        best = min(bf16, key=lambda r: r["time_score"] + r["time_train"])["mode"]
        for key in ("packed_speedup", "packed_speedup_with_compile"):
            out[key]["bf16"] = out[key][best]
        out["packed_speedup_bf16_mode"] = best
    return out


def mean_of(records: list[dict], fn) -> float:
    return sum(fn(r) for r in records) / len(records)


def _value(text: str):
    """A ``--set`` value: a Python literal where it parses as one (``true``/``false`` too, as on the main command
    line), else the string."""
    import ast

    if text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def output(rows: list[dict], args):
    """What ``--out`` holds: the child's row, or the summary."""
    return rows if args.one else summarize(rows, args)


def summarize(rows: list[dict], args) -> dict:
    """The file ``bench e2e`` writes: speedups of fp8_e2e over the best BF16 mode (``mode_speedups``: of every
    other mode too), and every mode's row."""

    first = next((r.get("packing", "off") for r in rows), "off")  # the speedups over one layout's rows
    ok = {r["mode"]: r for r in rows if "error" not in r and r.get("packing", "off") == first}
    bf16 = [r for m, r in ok.items() if m.startswith("bf16")]
    fp8 = ok.get("fp8_e2e")
    best = lambda key: min(r[key] for r in bf16) if bf16 else None  # noqa: E731
    speedup = lambda key, row=fp8: best(key) / row[key] if row and bf16 else None  # noqa: E731
    phases = {"rollout": "time_rollout", "train": "time_train", "step": "time_step"}
    commit = tree_commit()
    return {
        "rollout_speedup": speedup("time_rollout"),
        "train_speedup": speedup("time_train"),
        "step_speedup": speedup("time_step"),
        "hbm_bound_fraction": fp8.get("hbm_bound_fraction") if fp8 else None,
        "device": next((r["device"] for r in ok.values()), None),
        "num_layers": next((r.get("num_layers") for r in ok.values()), None),
        "commit": commit,
        "command": "python -m fp8rl_jax.bench e2e " + " ".join(sys.argv[2:]),
        "mode_speedups": {m: {p: speedup(key, r) for p, key in phases.items()} for m, r in ok.items()
                          if not m.startswith("bf16")},
        "modes": rows,
        **packing_summary(rows),
    }
