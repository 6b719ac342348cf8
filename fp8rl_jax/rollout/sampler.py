"""A policy's sampler: rollout engines over one model, tokenizer, rollout precision and mesh, one per sampling setup.

The trainer draws its RL rollouts, ``Trainer.sample`` and ``Trainer.evaluate`` through one, and ``python -m
fp8rl_jax.eval`` builds one around a checkpoint: the same engine settings (``config.rollout``, the stop tokens of
the tokenizer, the prompt length limit) and the same weight pre-quantization, whoever holds the policy. The policy's
state (``params``, ``fp8_state``, ``kv_scales``, as the trainer's state dict holds them) is passed to every call, so
a trainer's sampler always samples its current policy.

Its engines decode ``slot_plan.slots`` sequences at once (``rollout.slots``): ``rollout.decode_slots``, or with 0
as many as the rollouts it is built for (``sequences``) that the device's memory holds beside ``held``, the state
that stays on the device while it samples. The config's values it uses come as a ``SamplerSpec``
(``fp8rl_jax.plan.sampler_spec`` builds it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.model import kv_cache
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.rollout import driver
from fp8rl_jax.rollout.engine import Engine, EngineConfig
from fp8rl_jax.rollout.sampling import SamplingParams
from fp8rl_jax.rollout.slots import SlotPlan, device_limit, plan_slots, slot_bytes, tree_device_bytes
from fp8rl_jax.rollout.weights import rollout_params


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """The run's settings a sampler uses (``fp8rl_jax.plan.sampler_spec`` reads them from the config)."""

    decode_slots: int  # rollout.decode_slots (0: automatic, as many as the device memory holds)
    tensor_parallel: int  # rollout.tensor_parallel
    max_prompt_tokens: int  # data.max_prompt_tokens
    max_new_tokens: int  # rollout.max_new_tokens
    decode_attention: str  # rollout.decode_attention
    temperature: float  # rollout.temperature
    top_k: int  # rollout.top_k
    top_p: float  # rollout.top_p
    # the rollout weights resident at once: 1, or in a rollout stream (rollout.max_staleness = S) S + 2: the loaded
    # version, up to S published ahead of it (held for the loads the schedule fixes) and the next one while the
    # trainer makes it, before the stream's next round loads one and drops the oldest
    weight_versions: int = 1


def plan_decode_slots(spec: SamplerSpec, model: LlamaConfig, precision: Precision, mesh: jax.sharding.Mesh | None,
                      *, sequences: int, held: dict, rollout_devices: list[jax.Device] | None = None) -> SlotPlan:
    """The decode slots of rollouts of ``sequences`` sequences (``rollout.slots.plan_slots``) for
    ``spec.decode_slots``, beside ``held`` (the policy state, ``params`` at least, that stays on the device) and the
    rollout weights made from it. With ``rollout_devices`` (the rollout's own devices) only the rollout weights stay
    beside the slots, and the memory limit is those devices'."""
    tp = spec.tensor_parallel
    group = rollout_devices if rollout_devices is not None else None if mesh is None else list(mesh.devices.flat)
    replicas = 1 if group is None else len(group) // tp
    load = functools.partial(rollout_params, precision=precision, num_layers=model.num_layers)
    weights = jax.eval_shape(load, held["params"], held.get("fp8_state") if precision.fp8 else None)
    held_bytes = -(-tree_device_bytes(weights) // tp) * spec.weight_versions
    if rollout_devices is None:
        held_bytes += tree_device_bytes(held)
    per_slot = slot_bytes(model, max_prompt_tokens=spec.max_prompt_tokens, max_new_tokens=spec.max_new_tokens,
                          cache_dtype=kv_cache.cache_dtype(precision), tensor_parallel=tp)
    what = "rollout weights" if spec.weight_versions == 1 else f"{spec.weight_versions} versions of rollout weights"
    split = {"held_what": f"train state and {what}"} if rollout_devices is None else {
        "limit": device_limit(rollout_devices), "held_what": what}
    return plan_slots(spec.decode_slots, sequences, slot_bytes=per_slot, held_bytes=held_bytes,
                      replicas=replicas, **split)


class Sampler:
    def __init__(self, spec: SamplerSpec, model: LlamaConfig, tokenizer, precision: Precision,
                 mesh: jax.sharding.Mesh | None = None, *, sequences: int, held: dict,
                 rollout_devices: list[jax.Device] | None = None):
        """``sequences``: how many sequences a rollout decodes (an RL step's prompts x samples); ``held``: the
        policy state that stays on the device while it samples (``params``, ``fp8_state``, ..., optimizer moments
        too), whose bytes and those of its rollout weights an automatic slot count leaves room for;
        ``rollout_devices``: the rollout's own devices (``plan.meshes``), None = ``mesh``'s."""
        self.spec, self.model, self.tokenizer, self.precision, self.mesh = spec, model, tokenizer, precision, mesh
        self.rollout_devices = rollout_devices
        self._engines: dict[tuple[SamplingParams, int], Engine] = {}
        self.slot_plan = plan_decode_slots(spec, model, precision, mesh, sequences=sequences, held=held,
                                           rollout_devices=rollout_devices)

    def engine(self, sampling: SamplingParams, max_new_tokens: int) -> Engine:
        """The engine of one sampling setup, built once (each compiles its own steps at first use)."""
        key = (sampling, max_new_tokens)
        if key not in self._engines:
            s = self.spec
            self._engines[key] = Engine(self.model, self.precision, EngineConfig(
                max_concurrent_decodes=self.slot_plan.slots, max_prefill_length=s.max_prompt_tokens,
                max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=tuple(self.tokenizer.stop_ids),
                decode_attention=s.decode_attention, tensor_parallel=s.tensor_parallel),
                mesh=self.mesh, rollout_devices=self.rollout_devices)
        return self._engines[key]

    def weights(self, engine: Engine, state: dict) -> dict:
        """The sampler's copy of the policy ``state``: its rollout weights quantized with its FP8 scales (FP8
        precisions), its KV scales read (FP8 KV cache)."""
        return engine.load_params(state["params"], state["fp8_state"] if self.precision.fp8 else None,
                                  state["kv_scales"] if self.precision.kv_fp8 else None)

    def rollout(self, engine: Engine, state: dict, prompts: list, n: int, key: jax.Array,
                params: dict | None = None, limits=None) -> driver.RolloutBatch:
        """``n`` completions of each prompt (token ids) from the policy ``state`` (or its ``weights`` already
        made: ``params``); ``limits``: ``driver.generate``'s (benchmarks)."""
        params = self.weights(engine, state) if params is None else params
        return driver.generate(engine, params, [list(p) for p in prompts], n, key, limits=limits)

    def texts(self, batch: driver.RolloutBatch) -> list[str]:
        """The completions of ``batch`` as text (special tokens dropped), row by row."""
        return [self.tokenizer.decode(batch.completion(i)) for i in range(len(batch.lengths))]
