"""Which matmuls run in FP8, and how: a small static description that the model's forward reads."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fp8rl_jax.errors import ConfigError
from fp8rl_jax.fp8.recipe import Fp8Recipe

BACKENDS = ("bf16", "xla", "te")
KV_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")
COMPUTE_DTYPES = ("bfloat16", "float32")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas")


@dataclasses.dataclass(frozen=True)
class Precision:
    """Static precision policy of one forward (hashable: a jit static argument).

    backend: ``bf16`` (no FP8; matmuls in ``compute_dtype``), ``xla`` (pure-JAX FP8) or ``te`` (Transformer
      Engine FP8, GPU). Both FP8 backends read the same FP8 state.
    bf16_first_layers / bf16_last_layers: transformer blocks kept out of FP8 at either end of the stack.
    bf16_layers: more blocks kept out of FP8, by index (e.g. blocks whose activations carry massive outliers,
      which per-tensor scales cannot represent: the rest of the tensor falls into E4M3's subnormals).
    bf16_linears: linears kept out of FP8 in every block, by name (``w_down``: the input that carries the
      massive activations of many LLMs).
    lm_head_fp8: run the output projection in FP8 too (off by default: logits are precision-sensitive).
    lm_head_grad_fp8: the BF16 head's two backward GEMMs (logit gradient x kernel, hidden x logit gradient) in FP8:
      E5M2 logit gradient, E4M3 kernel and hidden state, the head's own delayed scales; the forward, its logits and
      logprobs, and the rollout's head stay BF16 (``model.fp8_heads.fp8_grad_head_logprobs``). With ``lm_head_fp8``
      too, ``lm_head_fp8`` wins: the head is FP8 both ways.
    lm_head_recompute_fp8: with ``lm_head_grad_fp8`` (and not ``lm_head_fp8``), the backward's recompute of the
      logits in FP8 too, with the head's delayed x and kernel scales, normalised on the FP8 logits' own softmax
      statistics: the FP8 head's backward under the BF16 forward, whose logits, logprobs and rollout stay BF16.
      Read only with ``lm_head_grad_fp8``.
    kv_cache_dtype: ``float8_e4m3fn`` stores K/V in FP8 with per-layer scales; the full-sequence forward then
      rounds K/V through the same FP8 values, so scoring sees what rollout saw.
    residual_in_gemm: in the rollout's FP8 decode and prefill (pre-quantized kernels, GPU), the residual adds after
      ``wo`` and ``w_down`` as their FP8 GEMM's C operand (XLA's cuBLASLt FP8 GEMM on the same FP8 operands and
      scales, beta 1: ``xla.gemm_into``), as XLA makes them for a BF16 GEMM; off: TE's GEMM, then an XLA add kernel.
      Scoring and training keep TE's GEMM and the add: there it gained nothing in the train phase and, with scoring
      on XLA's GEMM too, moved the rollout/scoring agreement and broke the exact sampler's bit-for-bit contract
      (benchmarks/RESULTS.md, "Rollout throughput").
    fused_mlp: training's and scoring's MLP as one custom VJP where it applies (``model.mlp.fused_mlp``: the te
      backend's ``te.fp8_swiglu_mlp``, block scaling's ``block_mlp.block_swiglu_mlp``): the same forward as the two
      linears', a backward whose SwiGLU gradient and FP8 operands come from one kernel. Off: the two ``linear``
      calls and autodiff between them.
    attention: the full-sequence (no-cache) attention of scoring and training: ``xla`` (the masked einsum, the
      [T, S] scores in memory), ``cudnn`` (cuDNN's fused flash attention through ``jax.nn.dot_product_attention``,
      GPU, BF16), ``pallas`` (JAX's Pallas Triton flash attention, GPU) or ``auto`` (a GPU: cudnn, or pallas
      beside a Transformer Engine on another cuDNN; else xla: ``fp8rl_jax.model.attention.resolve_attention``).
    """

    backend: str = "bf16"
    recipe: Fp8Recipe = Fp8Recipe()
    compute_dtype: str = "bfloat16"
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    bf16_layers: tuple[int, ...] = ()
    bf16_linears: tuple[str, ...] = ()
    lm_head_fp8: bool = False
    lm_head_grad_fp8: bool = False
    lm_head_recompute_fp8: bool = False
    kv_cache_dtype: str = "bfloat16"
    residual_in_gemm: bool = True
    fused_mlp: bool = True
    attention: str = "auto"

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"precision attention={self.attention!r}; allowed: {ATTENTION_IMPLS}")
        if self.backend not in BACKENDS:
            raise ValueError(f"precision backend={self.backend!r}; allowed: {BACKENDS}")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}; allowed: {KV_DTYPES}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r}; allowed: {COMPUTE_DTYPES}")
        if self.bf16_first_layers < 0 or self.bf16_last_layers < 0:
            raise ValueError("bf16_first_layers and bf16_last_layers must be >= 0")
        if self.recipe.scaling != "tensor" and self.backend == "te":
            raise ValueError(f"FP8 scaling={self.recipe.scaling!r} is built in the xla backend only; the te backend "
                             "scales per tensor")
        if not self.recipe.standard and self.recipe.scaling == "tensor" and self.backend == "te":
            raise ValueError(f"FP8 GEMMs {self.recipe.fp8_gemms} (not all three) are built in the xla backend only")

    @property
    def fp8(self) -> bool:
        return self.backend != "bf16"

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def kv_fp8(self) -> bool:
        return self.kv_cache_dtype == "float8_e4m3fn"

    def segments(self, num_layers: int) -> tuple[tuple[int, int, bool], ...]:
        """Runs of consecutive blocks with one precision: ``(start, end, fp8)``."""
        if any(not 0 <= i < num_layers for i in self.bf16_layers):
            raise ValueError(f"bf16_layers={self.bf16_layers} has an index outside 0..{num_layers - 1}")
        fp8 = [self.fp8 and self.bf16_first_layers <= i < num_layers - self.bf16_last_layers
               and i not in self.bf16_layers for i in range(num_layers)]
        runs, start = [], 0
        for i in range(1, num_layers + 1):
            if i == num_layers or fp8[i] != fp8[start]:
                runs.append((start, i, fp8[start]))
                start = i
        return tuple(runs)

    def replace(self, **kw) -> Precision:
        return dataclasses.replace(self, **kw)


def choose_backend(name: str) -> tuple[str, str]:
    """``(backend, why)`` for ``precision.backend=name``: ``auto`` -> ``te`` where Transformer Engine and a GPU are
    there, else ``xla`` (``why`` says which was missing); ``te`` where it cannot run raises ``ConfigError`` with the
    reason, never falls back."""
    if name not in ("auto", "xla", "te"):
        raise ConfigError(f"config.precision.backend={name!r} is invalid; allowed: auto | xla | te")
    if name == "xla":
        return "xla", "precision.backend=xla"
    from fp8rl_jax.fp8 import te

    reason = te.unavailable_reason()
    if name == "te":
        if reason is not None:
            raise ConfigError(
                f"config.precision.backend='te' cannot run here: {reason}. Install Transformer Engine on a CUDA host "
                "(pip install 'transformer-engine[jax]'; import it before JAX starts its GPU backend: "
                "fp8rl_jax.fp8.te.preload()), or use precision.backend=xla (pure-JAX FP8, CPU or GPU) or auto")
        return "te", "precision.backend=te"
    if reason is None:
        return "te", "precision.backend=auto: Transformer Engine imports and a GPU is visible"
    return "xla", f"precision.backend=auto: not te, because {reason}"


def resolve_backend(name: str) -> str:
    """The FP8 backend ``precision.backend=name`` runs on (see ``choose_backend``)."""
    return choose_backend(name)[0]
