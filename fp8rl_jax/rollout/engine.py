"""The rollout engine: prefill, insert, generate, with the shape of JetStream's Engine API.

One engine serves two drivers: the offline continuous-batching driver of the RL loop (``driver.py``) and the
JetStream server (``fp8rl_jax.serve``). It runs the model's one forward (``llama.forward_hidden``) with the
rollout weights (FP8 kernels quantized once per RL step, ``rollout.weights``) and a BF16 or FP8 KV cache.

    prefill(params, padded_tokens, true_length, rng)  -> Prefix (the prompt's KV cache + its first token)
    prefill_batch(params, padded [N, P], lengths, rngs) -> the same for N prompts in one forward (the RL driver)
    insert(prefix, decode_state, slot[, rng])         -> decode_state with the prefix in ``slot``
    insert_samples(prefix, decode_state, slots, rngs) -> the same for several samples of the prompt, one dispatch
    generate(params, decode_state)                    -> (decode_state, ResultTokens): one token for every slot
    generate_steps(params, decode_state, n)           -> n steps in one compiled loop (the RL driver's path)

Slots. The decode state holds ``max_concurrent_decodes`` slots, each a sequence at its own position. A slot is
``done`` once it sampled a stop token, reached ``max_new_tokens``, or filled the cache; done slots keep running
in the batch (it is one dense step) but emit invalid tokens and stop advancing, until ``insert`` reuses them.

Several samples of one prompt share one prefill: ``insert(prefix, state, slot, rng)`` re-draws the first token
from the prefix's last-position logits with the sample's own key.

On a mesh (``Engine(..., mesh=mesh)``: the trainer's) the rollout has a layout of its own: the rollout mesh
(``parallel.mesh.rollout_mesh``), over the trainer's devices (colocated) or over ``rollout_devices`` of its own
(``mesh.rollout_devices``), replica groups of ``tensor_parallel`` devices (its ``data`` axis) that each hold the
whole model, split only over the group (its ``tensor`` axis). Once per RL step ``load_params`` quantizes the FP8
kernels where the trainer's masters lie and moves them to that layout as FP8 bytes (``rollout.refit``: one program
colocated; across the device groups one ``jax.device_put``, recorded in ``last_refit``). The decode state (KV
cache: slots over the replica groups, kv heads over tensor; every per-slot array over the groups) is created sharded
and kept so by the out_shardings of insert / generate. A decode step then moves no weight: with ``tensor_parallel=1``
it has no collective at all, with more only tensor parallelism's all-reduces (after the row-parallel ``wo`` /
``w_down``, the vocab-parallel embedding and head; the fused q|k|v and gate|up columns are laid out per tensor shard,
``weights.interleave_fused``). The layers run unrolled and the Pallas decode kernel runs under a ``shard_map`` over
batch and kv heads, as on one device. Every call traces and runs under the rollout mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.linear import mesh_context
from fp8rl_jax.fp8.policy import Precision
from fp8rl_jax.kernels.decode_attention import IMPLS as DECODE_ATTENTION_IMPLS
from fp8rl_jax.kernels.decode_attention import DecodeTuning
from fp8rl_jax.model import kv_cache, llama
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.distributed import place
from fp8rl_jax.parallel.mesh import rollout_mesh
from fp8rl_jax.rollout.refit import Refit
from fp8rl_jax.rollout.sampling import SamplingParams, sample
from fp8rl_jax.xla_options import gpu_compiler_options

PREFILL_BUCKETS = tuple(2**i for i in range(4, 16))  # 16 .. 32768, JetStream's convention

# XLA:GPU options for the programs that decode (prefill, generate, generate_steps), passed per jit so that the
# trainer's programs keep the process's defaults: the decode GEMMs (M = the batch) take cuBLAS rather than Triton,
# 1.4x the BF16 rollout on the H100 (benchmarks/RESULTS.md, "Rollout throughput"). Measured and left out: while
# loops inside CUDA graphs
# (xla_gpu_enable_command_buffer with WHILE, CONDITIONAL) changed nothing; the GPU idles under 7% of a decode
# step.
DECODE_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
COMPILER_OPTIONS = ("auto", "none")
LAYER_LOOPS = ("auto", "scan", "unrolled")
STEP_LOOPS = ("scan", "unrolled")


def decode_compiler_options(choice: str = "auto", backend: str | None = None) -> dict:
    """The XLA options the decode programs compile with: ``DECODE_GPU_OPTIONS`` on a GPU for ``auto``
    (``gpu_compiler_options``); ``{}`` for ``none``."""
    if choice not in COMPILER_OPTIONS:
        raise ValueError(f"EngineConfig.compiler_options={choice!r}; allowed: {COMPILER_OPTIONS}")
    return {} if choice == "none" else gpu_compiler_options(DECODE_GPU_OPTIONS, backend)


def _check_tensor_parallel(model: LlamaConfig, shards: int, mesh: jax.sharding.Mesh | None) -> None:
    """``rollout.tensor_parallel`` must split whole kv heads (each device attends with its own) and the MLP's
    columns, on a mesh (``rollout_mesh`` checks that it divides the devices)."""
    if shards == 1:
        return
    if mesh is None:
        raise ValueError(f"rollout.tensor_parallel={shards} needs a mesh of devices (none given)")
    for what, size in (("num_kv_heads", model.num_kv_heads), ("intermediate_size", model.intermediate_size)):
        if size % shards:
            raise ValueError(f"rollout.tensor_parallel={shards} must divide the model's {what}={size}")


def prefill_bucket(length: int, max_prefill_length: int) -> int:
    """Smallest power-of-two bucket (>= 16) holding ``length`` tokens, capped at ``max_prefill_length``."""
    if length > max_prefill_length:
        raise ValueError(f"prompt of {length} tokens exceeds max_prefill_length={max_prefill_length}")
    return min(next(b for b in PREFILL_BUCKETS if b >= length), max_prefill_length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """A prefilled prompt: its KV cache [L, 1, K, P, H], last-position logits and first sampled token."""

    cache: dict
    logits: jax.Array  # [V] f32
    token: jax.Array  # [] int32
    logprob: jax.Array  # [] f32
    length: jax.Array  # [] int32, the true prompt length
    key: jax.Array  # the sequence's key after drawing ``token``

    def row(self, i) -> Prefix:
        """Prompt ``i`` (an int or a traced scalar) of a ``prefill_batch`` result, whose every field has a leading N
        (cache [L, N, K, P, H]): the single-prompt layout above."""
        take = lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False)
        return Prefix({n: jax.lax.dynamic_index_in_dim(a, i, axis=1) for n, a in self.cache.items()},
                      *(take(a) for a in (self.logits, self.token, self.logprob, self.length, self.key)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    cache: dict  # {"k", "v"}: [L, B, K, S, H]; on CPU (per-layer weights) L arrays [B, K, S, H] of bits each
    tokens: jax.Array  # [B] int32: the last sampled token, the next step's input
    logprobs: jax.Array  # [B] f32: its logprob under pi_T
    positions: jax.Array  # [B] int32: where ``tokens`` goes in the cache
    generated: jax.Array  # [B] int32: tokens sampled so far (the first one included)
    done: jax.Array  # [B] bool: finished, or never filled
    keys: jax.Array  # [B, 2] uint32: per-sequence keys


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ResultTokens:
    """JetStream's layout: ``data`` [B, 3] = (token, valid, length) per slot; plus the tokens' logprobs."""

    data: jax.Array
    logprobs: jax.Array
    tokens_idx: tuple[int, int] = dataclasses.field(default=(0, 1), metadata={"static": True})
    valid_idx: tuple[int, int] = dataclasses.field(default=(1, 2), metadata={"static": True})
    length_idx: tuple[int, int] = dataclasses.field(default=(2, 3), metadata={"static": True})
    samples_per_slot: int = dataclasses.field(default=1, metadata={"static": True})

    def convert_to_numpy(self) -> ResultTokens:
        return dataclasses.replace(self, data=np.asarray(self.data), logprobs=np.asarray(self.logprobs))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_concurrent_decodes: int = 32
    max_prefill_length: int = 512
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    # attention of the decode step: "pallas" reads each sequence's filled cache only (a Triton kernel, GPU),
    # "xla" scores the whole cache (masked), "auto" = pallas on GPU, xla elsewhere; "pallas_interpret" (tests)
    decode_attention: str = "auto"
    # how the pallas kernel is launched (part of the decode programs: engines of two tunings compile two programs)
    decode_tuning: DecodeTuning = DecodeTuning()
    # XLA options of the decoding programs: "auto" = DECODE_GPU_OPTIONS on a GPU, "none" = the process's defaults
    compiler_options: str = "auto"
    # the decode step's layers: "unrolled" reads per-layer weights and cache in place (one straight-line program),
    # "scan" loops over stacked ones; "auto" = unrolled
    layer_loop: str = "auto"
    # generate_steps' steps: "scan" one compiled loop over them, "unrolled" one straight-line program of them all (no
    # loop between steps; compiles each step's code once per step)
    step_loop: str = "scan"
    # rollout.tensor_parallel: on a mesh, the devices of one replica group, over which the rollout weights are split
    # (heads, MLP columns, vocabulary); the rest of the mesh splits the decode batch (parallel.mesh.rollout_mesh)
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.decode_attention not in DECODE_ATTENTION_IMPLS:
            raise ValueError(f"EngineConfig.decode_attention={self.decode_attention!r}; "
                             f"allowed: {DECODE_ATTENTION_IMPLS}")
        if not isinstance(self.decode_tuning, DecodeTuning):
            raise ValueError(f"EngineConfig.decode_tuning={self.decode_tuning!r} must be a DecodeTuning")
        if self.compiler_options not in COMPILER_OPTIONS:
            raise ValueError(f"EngineConfig.compiler_options={self.compiler_options!r}; allowed: {COMPILER_OPTIONS}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"EngineConfig.layer_loop={self.layer_loop!r}; allowed: {LAYER_LOOPS}")
        if self.step_loop not in STEP_LOOPS:
            raise ValueError(f"EngineConfig.step_loop={self.step_loop!r}; allowed: {STEP_LOOPS}")
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) \
                or self.tensor_parallel < 1:
            raise ValueError(f"rollout.tensor_parallel={self.tensor_parallel!r} must be a positive int")

    @property
    def max_cache_length(self) -> int:
        return self.max_prefill_length + self.max_new_tokens


class Engine:
    """Prefill / insert / generate over the model forward, jitted, with the decode state donated."""

    def __init__(self, model: LlamaConfig, precision: Precision, config: EngineConfig, tokenizer: Any = None, *,
                 mesh: jax.sharding.Mesh | None = None, rollout_devices: list[jax.Device] | None = None):
        """``mesh``: the trainer's, where the weights come from; ``rollout_devices``: devices of the rollout's own
        (``parallel.mesh.split_devices``), None = the trainer's."""
        self.model, self.precision, self.config = model, precision, config
        self.tokenizer = tokenizer
        self.train_mesh = mesh  # where the weights come from (the trainer's params)
        if rollout_devices is not None and mesh is None:
            raise ValueError("Engine(rollout_devices=...) needs the trainer's mesh (mesh=...) the weights come from")
        same = rollout_devices is None or set(rollout_devices) == set(mesh.devices.flat)  # colocated: one program
        group = mesh if same else rollout_devices
        self.mesh = None if mesh is None else rollout_mesh(group, config.tensor_parallel)  # where the rollout runs
        _check_tensor_parallel(model, config.tensor_parallel, mesh)
        self.compiler_options = decode_compiler_options(config.compiler_options)
        # jit for the programs that decode: with the decode options (see DECODE_GPU_OPTIONS)
        self._decode_jit = decode_jit = functools.partial(jax.jit, compiler_options=self.compiler_options or None)
        # jitted: eagerly, the zeroed [L, ...] cache, its bits and its per-layer slices would all be live at once
        # (three times the cache: an 8B model's FP8 cache at batch 256 then overflowed an H100)
        self._init_state = jax.jit(self._new_decode_state)
        self._prefill = decode_jit(self._prefill_impl)
        self._prefill_batch = decode_jit(self._prefill_batch_impl)
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,))
        self._insert_samples = jax.jit(self._insert_samples_impl, donate_argnums=(1,))
        self._generate = decode_jit(self._generate_impl, donate_argnums=(1,))
        self._generate_steps = decode_jit(self._generate_steps_impl, donate_argnums=(1,), static_argnums=(2,))
        # unrolled layers (the default on one device): weights as one tree per layer, which the decode step reads
        # in place, and the cache as one array (of bits) per layer (kv_cache.cache_layers), which it writes in place.
        # On a CPU a scan over stacked weights has XLA copy each layer's slice (as many bytes again as the GEMMs
        # read) and convert the whole cache to its bits and back in every step; on the H100 the unrolled step has
        # fewer copies and kernels, and is faster in FP8 (benchmarks/RESULTS.md, "Rollout throughput"). On a mesh
        # too: the per-layer arrays are placed by the same rules as the stacked ones.
        self._per_layer = config.layer_loop != "scan"
        # the rollout's copy of the weights, FP8 state and KV scales, once per RL step (colocated or not)
        self._refit = Refit(model, precision, mesh, self.mesh, per_layer=self._per_layer,
                            tensor_parallel=config.tensor_parallel)
        if self.mesh is not None:
            self._jit_on_mesh(self.mesh)

    def _jit_on_mesh(self, mesh: jax.sharding.Mesh) -> None:
        """The same functions on the rollout ``mesh``, with the decode state's shardings as out_shardings
        (in_shardings follow the arguments, which come placed); the weights come through ``_refit``."""
        state = rules.decode_state_shardings(jax.eval_shape(self._new_decode_state), mesh)
        rep = rules.replicated(mesh)  # what the host reads back each call: tokens, logprobs, flags
        self._init_state = jax.jit(self._new_decode_state, out_shardings=state)
        decode_jit = self._decode_jit
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=state)
        self._insert_samples = jax.jit(self._insert_samples_impl, donate_argnums=(1,), out_shardings=state)
        self._generate = decode_jit(self._generate_impl, donate_argnums=(1,), out_shardings=(state, rep))
        self._generate_steps = decode_jit(self._generate_steps_impl, donate_argnums=(1,), static_argnums=(2,),
                                          out_shardings=(state, rep, rep, rep))

    # -- sizes ----------------------------------------------------------------------------------------------

    @property
    def last_refit(self) -> dict | None:
        """What the last ``load_params`` moved between the trainer's devices and the rollout's own (``Refit.last``:
        bytes per dtype, their total, the same with BF16 kernels, the transfer's seconds); None colocated."""
        return self._refit.last

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def cache_dtype(self):
        return kv_cache.cache_dtype(self.precision)

    # -- params and state -----------------------------------------------------------------------------------

    def load_params(self, params: dict, fp8_state: dict | None = None, kv_scales: dict | None = None) -> dict:
        """Rollout params from training params: FP8 kernels quantized once with the current scales."""
        if self.precision.fp8 and fp8_state is None:
            raise ValueError(f"precision backend {self.precision.backend!r} needs the FP8 state")
        if self.precision.kv_fp8 and kv_scales is None:
            kv_scales = kvq.init_kv_scales(self.model.num_layers)
        return self._refit(params, fp8_state, kv_scales)

    def init_decode_state(self) -> DecodeState:
        with mesh_context(self.mesh, self.precision.backend):
            return self._init_state()

    def _new_decode_state(self) -> DecodeState:
        b = self.config.max_concurrent_decodes
        cache = kv_cache.init_cache(self.model, b, self.config.max_cache_length, self.cache_dtype)
        return DecodeState(
            cache=kv_cache.cache_layers(cache, as_bits=True) if self._per_layer else cache,
            tokens=jnp.zeros((b,), jnp.int32),
            logprobs=jnp.zeros((b,), jnp.float32),
            positions=jnp.zeros((b,), jnp.int32),
            generated=jnp.zeros((b,), jnp.int32),
            done=jnp.ones((b,), bool),
            keys=jnp.zeros((b, 2), jnp.uint32),
        )

    # -- the three calls ----------------------------------------------------------------------------------

    def _keys(self, rngs) -> jax.Array:
        """Random keys as the rollout's programs take them: uint32, and on a mesh replicated on the rollout mesh.
        A caller's keys usually derive from the trainer's (replicated on the training mesh, another mesh over the
        same devices), and one program's arguments must all lie on one mesh (JAX on GPUs refuses the mix; CPU devices
        let it pass)."""
        typed = isinstance(rngs, jax.Array) and jax.dtypes.issubdtype(rngs.dtype, jax.dtypes.prng_key)
        rngs = rngs if typed else jnp.asarray(rngs, jnp.uint32)
        return rngs if self.mesh is None else place(rngs, rules.replicated(self.mesh))

    def prefill(self, params: dict, padded_tokens: jax.Array, true_length: int, rng: jax.Array) -> Prefix:
        """Run the prompt (right-padded to a bucket) and draw its first token with ``rng``."""
        with mesh_context(self.mesh, self.precision.backend):
            return self._prefill(params, jnp.asarray(padded_tokens, jnp.int32), jnp.int32(true_length),
                                 self._keys(rng))

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, rng: jax.Array | None = None):
        """Put ``prefix`` into ``slot``; with ``rng``, re-draw the first token (another sample of the prompt)."""
        with mesh_context(self.mesh, self.precision.backend):
            return self._insert(prefix, decode_state, jnp.int32(slot), None if rng is None else self._keys(rng))

    def prefill_batch(self, params: dict, padded_tokens, true_lengths, rngs) -> Prefix:
        """Several prompts, right-padded to one bucket [N, P], in one forward: a ``Prefix`` whose every field has a
        leading N (cache [L, N, K, P, H]); prompt ``i`` is drawn with ``rngs[i]``. ``insert_samples(..., row=i)``
        inserts prompt ``i``. A prompt's prefix depends on the batch's shape, not on the other prompts in it (its
        rows of every GEMM are its own), so callers that keep N fixed per bucket keep their rollouts reproducible."""
        with mesh_context(self.mesh, self.precision.backend):
            return self._prefill_batch(params, jnp.asarray(padded_tokens, jnp.int32),
                                       jnp.asarray(true_lengths, jnp.int32), self._keys(rngs))

    def insert_samples(self, prefix: Prefix, decode_state: DecodeState, slots, rngs, row: int | None = None,
                       size: int | None = None) -> DecodeState:
        """Several samples of one prompt in one call: ``prefix`` into every slot of ``slots``, slot ``i`` re-drawing
        its first token with ``rngs[i]``. The same state as ``insert(prefix, state, slots[i], rngs[i])`` in turn,
        in one dispatch instead of len(slots). The slots are padded to ``size`` (default: the next power of two),
        so that one compiled program serves every count up to it; the padding writes nowhere. ``row``: ``prefix``
        came from ``prefill_batch`` and this is its prompt ``row``."""
        slots = np.asarray(slots, np.int32).reshape(-1)
        rngs = jnp.asarray(rngs, jnp.uint32).reshape(-1, 2)
        if len(slots) != rngs.shape[0]:
            raise ValueError(f"{len(slots)} slots and {rngs.shape[0]} keys")
        if len(slots) != len(set(slots.tolist())) or not all(0 <= s < self.max_concurrent_decodes for s in slots):
            raise ValueError(f"slots must be distinct, in [0, {self.max_concurrent_decodes}): {slots.tolist()}")
        m = size or 1 << max(len(slots) - 1, 0).bit_length()
        if m < len(slots):
            raise ValueError(f"size={size} is smaller than the {len(slots)} slots")
        padded = np.full((m,), self.max_concurrent_decodes, np.int32)  # out of range: the scatters drop it
        padded[: len(slots)] = slots
        rngs = self._keys(jnp.concatenate([rngs, jnp.zeros((m - len(slots), 2), jnp.uint32)]))
        if row is not None:
            n = prefix.token.shape[0]
            if not 0 <= row < n:
                raise ValueError(f"row={row} outside the prefill batch of {n} prompts")
            row = jnp.int32(row)
        with mesh_context(self.mesh, self.precision.backend):
            return self._insert_samples(prefix, decode_state, jnp.asarray(padded), rngs, row)

    def generate(self, params: dict, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
        with mesh_context(self.mesh, self.precision.backend):
            return self._generate(params, decode_state)

    def generate_steps(self, params: dict, decode_state: DecodeState, num_steps: int):
        """``num_steps`` decode steps in one compiled loop: (state, tokens, logprobs, valid), each [n, B]."""
        with mesh_context(self.mesh, self.precision.backend):
            return self._generate_steps(params, decode_state, num_steps)

    # -- implementations ------------------------------------------------------------------------------------

    def _forward(self, params, tokens, positions, cache):
        return llama.forward_hidden(
            params["weights"], tokens, positions, config=self.model, precision=self.precision,
            fp8_state=params["fp8_state"], kv_scales=params["kv_scales"], cache=cache,
            decode_attention=self.config.decode_attention, decode_tuning=self.config.decode_tuning,
            cache_dtype=self.cache_dtype, fused_shards=self.config.tensor_parallel,
        )

    def _logits(self, params, hidden):
        return llama.logits_from_hidden(
            params["weights"], hidden, precision=self.precision, fp8_state=params["fp8_state"]
        )

    def _draw(self, logits, keys):
        """Split each key, draw with one half, keep the other: logits [B, V], keys [B, 2]."""
        split = jax.vmap(jax.random.split)(keys)  # [B, 2, 2]
        tokens, logprobs = sample(logits, split[:, 1], self.config.sampling)
        return tokens, logprobs, split[:, 0]

    def _prefill_impl(self, params, padded_tokens, true_length, rng):
        return self._prefill_batch_impl(params, padded_tokens[None], true_length[None], rng[None]).row(0)

    def _prefill_batch_impl(self, params, padded_tokens, true_lengths, rngs):
        n, p = padded_tokens.shape
        cache = kv_cache.init_cache(self.model, n, p, self.cache_dtype)
        if self._per_layer:  # one array of bits per layer, as in the decode state (see __init__)
            cache = kv_cache.cache_layers(cache, as_bits=True)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (n, p))
        hidden, cache, _ = self._forward(params, padded_tokens, positions, cache)
        if self._per_layer:
            cache = kv_cache.cache_stack(cache, self.cache_dtype)
        # [N, P, D] -> [N, D]: only each prompt's last real position needs logits
        last = jnp.take_along_axis(hidden, (true_lengths - 1)[:, None, None], axis=1)[:, 0]
        logits = self._logits(params, last)  # [N, V]
        token, logprob, key = self._draw(logits, rngs)
        return Prefix(cache, logits, token, logprob, true_lengths, key)

    def _is_done(self, tokens, generated, positions):
        stop = jnp.isin(tokens, jnp.asarray(self.config.stop_ids or (-1,), jnp.int32))
        return stop | (generated >= self.config.max_new_tokens) | (positions >= self.config.max_cache_length)

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, rng):
        if rng is None:
            token, logprob, key = prefix.token, prefix.logprob, prefix.key
        else:
            t, lp, k = self._draw(prefix.logits[None], rng[None])
            token, logprob, key = t[0], lp[0], k[0]
        if isinstance(state.cache["k"], tuple):  # one array of bits per layer (CPU)
            parts = kv_cache.cache_layers({n: a.astype(self.cache_dtype) for n, a in prefix.cache.items()},
                                          as_bits=True)
            cache = {name: tuple(jax.lax.dynamic_update_slice(layer, part, (slot, 0, 0, 0))
                                 for layer, part in zip(state.cache[name], parts[name], strict=True))
                     for name in ("k", "v")}
        else:
            cache = {
                name: jax.lax.dynamic_update_slice(state.cache[name],
                                                   prefix.cache[name].astype(state.cache[name].dtype),
                                                   (0, slot, 0, 0, 0))
                for name in ("k", "v")
            }
        set_ = lambda arr, value: arr.at[slot].set(value)
        return DecodeState(
            cache=cache,
            tokens=set_(state.tokens, token),
            logprobs=set_(state.logprobs, logprob),
            positions=set_(state.positions, prefix.length),
            generated=set_(state.generated, 1),
            done=set_(state.done, self._is_done(token, 1, prefix.length)),
            keys=set_(state.keys, key),
        )

    def _insert_samples_impl(self, prefix: Prefix, state: DecodeState, slots, rngs, row=None):
        if row is not None:  # prompt ``row`` of a prefill_batch
            prefix = prefix.row(row)
        tokens, logprobs, keys = self._draw(jnp.broadcast_to(prefix.logits, (slots.shape[0], prefix.logits.shape[0])),
                                            rngs)
        m, p = slots.shape[0], prefix.cache["k"].shape[3]
        # the prompt's [K, P, H] per layer, written at (slot, :, 0:P, :) of every slot; out-of-range slots dropped
        if isinstance(state.cache["k"], tuple):  # one array of bits per layer (see __init__)
            parts = kv_cache.cache_layers({n: a.astype(self.cache_dtype) for n, a in prefix.cache.items()},
                                          as_bits=True)
            # [1, K, P, H] -> [M, K, P, H] per layer
            cache = {name: tuple(layer.at[slots, :, :p, :].set(jnp.broadcast_to(part, (m, *part.shape[1:])),
                                                               mode="drop")
                                 for layer, part in zip(state.cache[name], parts[name], strict=True))
                     for name in ("k", "v")}
        else:
            # [L, 1, K, P, H] -> [L, M, K, P, H]
            cache = {name: state.cache[name].at[:, slots, :, :p, :].set(
                jnp.broadcast_to(prefix.cache[name], (prefix.cache[name].shape[0], m, *prefix.cache[name].shape[2:]))
                .astype(state.cache[name].dtype), mode="drop") for name in ("k", "v")}
        set_ = lambda arr, values: arr.at[slots].set(values, mode="drop")
        first = jnp.ones_like(slots)
        length = jnp.broadcast_to(prefix.length, slots.shape)
        return DecodeState(
            cache=cache,
            tokens=set_(state.tokens, tokens),
            logprobs=set_(state.logprobs, logprobs),
            positions=set_(state.positions, length),
            generated=set_(state.generated, first),
            done=set_(state.done, self._is_done(tokens, first, length)),
            keys=set_(state.keys, keys),
        )

    def _step(self, params, state: DecodeState):
        hidden, cache, _ = self._forward(params, state.tokens[:, None], state.positions[:, None], state.cache)
        logits = self._logits(params, hidden[:, 0])  # [B, V]
        tokens, logprobs, keys = self._draw(logits, state.keys)
        valid = ~state.done
        generated = state.generated + valid
        positions = jnp.where(valid, state.positions + 1, state.positions)
        done = state.done | self._is_done(tokens, generated, positions)
        new = DecodeState(cache, tokens, logprobs, positions, generated, done, keys)
        return new, (tokens, logprobs, valid)

    def _generate_impl(self, params, state):
        state, (tokens, logprobs, valid) = self._step(params, state)
        data = jnp.stack([tokens, valid.astype(jnp.int32), state.generated], axis=1)
        return state, ResultTokens(data=data, logprobs=logprobs)

    def _generate_steps_impl(self, params, state, num_steps):
        state, (tokens, logprobs, valid) = jax.lax.scan(lambda s, _: self._step(params, s), state, None,
                                                        length=num_steps, unroll=self.config.step_loop == "unrolled")
        return state, tokens, logprobs, valid
