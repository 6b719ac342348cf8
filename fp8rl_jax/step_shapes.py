"""A trainer's step in words for an out-of-memory message (``memory.out_of_memory_report``): each phase's device
shapes and the config keys that lower its memory, with their values now. Built once by the ``Trainer`` from its
config and sizes; nothing here touches the device."""

from __future__ import annotations

import dataclasses
from typing import Any

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import kv_cache
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.plan import microbatch_sequences, microbatch_source
from fp8rl_jax.rl.packing import PackingPlan


@dataclasses.dataclass(frozen=True, eq=False)
class StepShapes:
    """What the phases of a ``Trainer``'s RL step (and its evaluation, initial calibration) hold on the device."""

    config: Any
    model: LlamaConfig
    rollout_precision: Precision
    train_precision: Precision
    slot_plan: Any  # the sampler's ``plan_decode_slots``
    exact: bool  # rollout.exact: the rollouts drawn by the train precision's scoring forward
    mesh_size: int
    group: int  # rollout.samples_per_prompt
    sequences: int  # a step's
    minibatch: int  # sequences an update
    microbatch: int  # sequences a right-padded microbatch
    row_tokens: int  # the longest row the run can make
    calibration_rows: int  # what step() recalibrates on
    packing: PackingPlan | None  # rl.packing

    def microbatches(self) -> str | None:
        """An update's microbatches in words where it runs more than one (said at the start of a run), else None."""
        if self.microbatch < self.minibatch:
            return (f"microbatches of {self.microbatch} sequences x up to {self.row_tokens} tokens "
                    f"({microbatch_source(self.config)}), {self.minibatch // self.microbatch} per update")
        return None

    def shapes(self, phase: str, packed: bool = False) -> str:
        """The device shapes of ``phase`` in words, for an out-of-memory message; ``packed``: the step's rows are
        packed (``rl.packing``)."""
        c, mb, t = self.config, self.microbatch, self.row_tokens
        micro = (f"in microbatches of {mb} x up to {t} tokens ({mb * t} tokens; "
                 f"{microbatch_source(c)})")
        if packed and phase in ("score", "train"):
            p = self.packing
            fewer = f" (or {', '.join(map(str, p.row_options))})" if p.row_options else ""
            micro = (f"packed (rl.packing) in microbatches of {p.rows}{fewer} rows x {p.width} tokens (up to "
                     f"{p.tokens} tokens, {p.max_segments} sequences a row; {microbatch_source(c)})")
        if phase == "weights":
            return (f"the rollout's copy of the {self.model.num_params() / 1e6:.0f}M-parameter policy "
                    f"({c.precision.mode}) beside the train state, on {self.mesh_size} device(s)")
        if phase == "rollout" and not self.exact:
            slots = self.slot_plan.slots
            return (f"{c.rollout.prompts_per_step} prompts x {self.group} samples = {self.sequences} sequences "
                    f"through {slots} decode slots, a KV cache of {slots} x "
                    f"({c.data.max_prompt_tokens} + {c.rollout.max_new_tokens}) positions x "
                    f"{self.model.num_layers} layers in {kv_cache.cache_dtype(self.rollout_precision).name}")
        if phase in ("rollout", "score"):  # the exact sampler runs the scoring forward too
            return f"{self.sequences} sequences {micro}"
        if phase == "train":
            return (f"{c.rl.minibatches} update(s) of {self.minibatch} sequences {micro}, "
                    f"model.remat={c.model.remat}")
        if phase == "calibrate":
            rows = microbatch_sequences(c, self.calibration_rows, t)
            return f"{self.calibration_rows} sequences in microbatches of {rows} x up to {t} tokens"
        return f"{self.sequences} sequences"

    def knobs(self, phase: str, packed: bool = False) -> list[str]:
        """The config keys that lower ``phase``'s device memory, with their values now."""
        c = self.config

        def key(name: str, to: str = "", note: str = "") -> str:
            value = c
            for part in name.split("."):
                value = value[part]
            return f"{name}{'=' + to if to else ''} (now {value}{'; ' + note if note else ''})"

        # rl.microbatch_sequences > 0 sets the microbatch and rl.microbatch_tokens no longer acts: only the first is
        # named then; at 0 the token budget is, and the count in its place as the other way
        packed = packed and phase in ("score", "train")
        if c.rl.microbatch_sequences > 0:
            micro = [key("rl.microbatch_sequences", note=(
                "rows a packed microbatch; it overrides rl.microbatch_tokens" if packed else
                f"a smaller divisor of {self.minibatch}; it overrides rl.microbatch_tokens"))]
        elif packed:
            micro = [key("rl.microbatch_tokens", note=f"at least one row of {self.packing.width}"),
                     key("rl.microbatch_sequences", note="rows a packed microbatch where > 0")]
        else:
            micro = [key("rl.microbatch_tokens"), key("rl.microbatch_sequences", note=f"a divisor of {self.minibatch}")]
        rows = [key("rollout.max_new_tokens"), key("data.max_prompt_tokens")]
        remat = [] if c.model.remat == "full" else [key("model.remat", "full")]
        devices = [key("mesh.fsdp", note="more devices split the batch and the state"), key("mesh.tensor")]
        if phase == "weights":
            return devices
        if phase == "eval" or (phase == "rollout" and not self.exact):  # the KV-cache engine
            fp8_kv = self.rollout_precision.fp8 and not self.rollout_precision.kv_fp8
            slots = self.slot_plan
            automatic = f"automatic: {slots.slots} slots" if slots.automatic else ""
            return [key("rollout.decode_slots", str(max(slots.slots // 2, 1)), automatic), *rows,
                    *([key("precision.kv_cache_dtype", "float8_e4m3fn")] if fp8_kv else []), *devices]
        if phase in ("rollout", "score"):  # the exact sampler runs the scoring forward a microbatch at a time
            return [*micro, *rows]
        if phase in ("train", "initial calibration"):
            return [*micro, *remat, *rows, *devices]
        if phase == "calibrate":  # a pullback (remat matters) only where training observes no FP8 amaxes
            pullback = self.rollout_precision.fp8 and not self.train_precision.fp8
            return [key("precision.kv_calibration_sequences"), *micro, *(remat if pullback else []), *rows]
        return [key("rollout.prompts_per_step"), key("rollout.samples_per_prompt")]
