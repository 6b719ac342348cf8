"""JetStream 0.2.2 gRPC server around the rollout engine: ``python -m fp8rl_jax.serve --config=configs/tiny.py``.

Serves ``config.model`` with the rollout precision of ``config.precision`` and the sampling of ``config.rollout``
(``--greedy``: argmax). A caller that holds a policy (the trainer, a notebook) passes it to ``build_server(config,
params=, fp8_state=, kv_scales=)``; otherwise the model is loaded from the config with FP8 scales of 1, and an
untrained FP8 state served without calibration gives poor FP8 numerics; ``--checkpoint=DIR`` (a trainer's
``<workdir>/checkpoints``) serves a trained policy with its own FP8 and KV scales. Binds 127.0.0.1 unless
``--host`` says otherwise; no TLS, no auth. A port another server holds is an error (gRPC's default
``SO_REUSEPORT`` would let both bind it and split the traffic between two models); a host name is bound on every
address it resolves to (``localhost``: 127.0.0.1 and ::1), and another server holding the port on any one of them is
the same error (gRPC alone would serve on the others, and a client could reach either model).

JetStream's orchestrator (``Driver``, interleaved, one engine) and servicer run as they are (``server.py``), except:
- the gRPC server is ours: ``server_lib`` always binds ``[::]``, every interface; we bind ``--host``'s addresses one
  by one (``server.bind_addresses``), all or none;
- 0.2.2's ``prefill`` returns only a prefix, so the first token (drawn at prefill) would never be streamed:
  ``generate`` reports each slot's *pending* token (the one fed into the step), one step late. Every sampled
  token is streamed; a stop token ends the stream unsent (as JetStream does);
- prompts are tokenized and padded by us: text with our tokenizer's BOS rule, token content verbatim; a bad
  request (a corrupt protobuf body included) gets INVALID_ARGUMENT, an engine failure INTERNAL (an exception in
  a JetStream thread would SIGKILL the process). A device fault surfacing asynchronously in JetStream's
  detokenize thread still ends it: a faulted device cannot serve, and a supervisor should restart the server;
- per-request randomness: the n-th prefill since start draws with ``fold_in(PRNGKey(config.seed), n)``.
Not streamed: logprobs (0.2.2 has no field for them). Text is decoded token by token, so a character that a
byte-level BPE splits over tokens arrives garbled in ``text``; ``token_ids`` are exact.

Importing this module imports no JetStream and changes no global state; ``build_server`` first calls
``install_jetstream_compat`` (what JetStream 0.2.2 needs to load and run here, each change kept inside JetStream's
own modules).
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from typing import TYPE_CHECKING

from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from fp8rl_jax.serve.server import ServerHandle

log = logging.getLogger(__name__)
DEFAULT_HOST = "127.0.0.1"
# decode slots with rollout.decode_slots=0 (automatic) and no --max_concurrent_decodes: requests decoded at once, at
# most this many, fewer where the device memory holds fewer (rollout.slots)
SERVE_SLOTS = 64

_LOG_CALLS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"})


class _ModuleLogging:
    """What one JetStream module sees as ``logging``: its ``logging.info(...)`` calls go to the logger named after
    the module instead of the root logger; every other attribute is the ``logging`` module's own."""

    def __init__(self, module_name: str):
        self._logger = logging.getLogger(module_name)

    def __getattr__(self, name: str):
        return getattr(self._logger if name in _LOG_CALLS else logging, name)


def _seqio_stand_in() -> dict[str, types.ModuleType]:
    """``seqio`` and ``seqio.vocabularies`` with the two classes JetStream's ``token_utils`` imports; using them
    raises (our tokenizer never goes through seqio)."""

    class Vocabulary:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("seqio is not installed; fp8rl_jax.serve uses its own tokenizer, never seqio's")

    class SentencePieceVocabulary(Vocabulary):
        pass

    seqio, vocabularies = types.ModuleType("seqio"), types.ModuleType("seqio.vocabularies")
    for module in (seqio, vocabularies):
        module.Vocabulary, module.SentencePieceVocabulary = Vocabulary, SentencePieceVocabulary
    seqio.vocabularies = vocabularies
    return {"seqio": seqio, "seqio.vocabularies": vocabularies}


@functools.cache  # idempotent: once it has returned, later calls do nothing (a raise is not cached: tried again)
def install_jetstream_compat() -> None:
    """Import JetStream 0.2.2 so that it loads and runs here; ``build_server`` calls it. Idempotent.

    Nothing outside JetStream's own modules changes (``jax``, ``sys.modules`` and the root logger end as they were):
    - seqio: JetStream's ``token_utils`` imports seqio (and so TensorFlow) for its SentencePiece path. Without
      seqio installed, a stand-in sits in ``sys.modules`` only while JetStream is imported: ``token_utils`` keeps
      its two classes (they raise if used), and ``import seqio`` anywhere else still fails.
    - root logger: importing the orchestrator sets the root logger to DEBUG and gives it a stdout handler: undone.
    - logs: JetStream logs with module-level ``logging.info(...)`` on the root logger, two lines per decode step.
      Its modules' log calls go to loggers named after them (``jetstream.core.orchestrator``, ...), and the
      ``jetstream`` logger is set to WARNING unless it has a level already;
      ``logging.getLogger("jetstream").setLevel(logging.INFO)`` brings the lines back.
    - ``jax.tree_map``: the orchestrator frees each prefix with it, and JAX has removed it: the orchestrator's
      ``delete_pytree`` becomes the same function on ``jax.tree.map``.
    - a protoc-4.25 module under a newer protobuf runtime: if it ever stops loading, the ImportError says so.
    """
    import jax

    root = logging.getLogger()
    root_state = (root.level, list(root.handlers))
    try:
        import seqio  # noqa: F401
        stand_in = {}
    except ImportError:
        stand_in = _seqio_stand_in()
    sys.modules.update(stand_in)
    try:
        from jetstream.core import orchestrator
        from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: F401
        from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: F401
    except (ImportError, TypeError) as e:  # protobuf's version errors are TypeErrors
        from google.protobuf import __version__ as protobuf_version

        raise ImportError(f"JetStream 0.2.2 failed to import (protobuf runtime {protobuf_version}): {e}") from e
    finally:
        for name in stand_in:
            sys.modules.pop(name, None)
        root.setLevel(root_state[0])
        for handler in [h for h in root.handlers if h not in root_state[1]]:
            root.removeHandler(handler)

    for name, module in list(sys.modules.items()):
        if name.startswith("jetstream.") and getattr(module, "logging", None) is logging:
            module.logging = _ModuleLogging(name)
    jetstream_logger = logging.getLogger("jetstream")
    if jetstream_logger.level == logging.NOTSET:
        jetstream_logger.setLevel(logging.WARNING)

    def delete_pytree(tree) -> None:  # orchestrator.delete_pytree, on jax.tree.map
        jax.tree.map(lambda leaf: leaf.delete() if isinstance(leaf, jax.Array) else None, tree)

    orchestrator.delete_pytree = delete_pytree


def build_server(config, *, params: dict | None = None, fp8_state: dict | None = None, kv_scales: dict | None = None,
                 port: int = 9000, host: str = DEFAULT_HOST, model: LlamaConfig | None = None,
                 tokenizer: Tokenizer | None = None, greedy: bool = False,
                 max_concurrent_decodes: int | None = None, max_new_tokens: int | None = None,
                 checkpoint: str | None = None) -> ServerHandle:
    """Serve ``params`` (training params, FP8 state and KV scales as the trainer holds them; with ``model`` and
    ``tokenizer``, else those load from the config) or, with none, the model of ``config``. ``port=0``: any.

    Raises OSError naming the port when it cannot bind it (held by another server, say), and ``FileNotFoundError``
    naming a ``checkpoint`` folder that does not exist (nothing is created)."""
    if checkpoint is not None:
        from fp8rl_jax.checkpoint import existing_checkpoint_folder

        checkpoint = existing_checkpoint_folder(checkpoint)
    install_jetstream_compat()
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.loading import load_model
    from fp8rl_jax.plan import model_spec, run_precision, sampler_spec
    from fp8rl_jax.rollout.engine import Engine, EngineConfig
    from fp8rl_jax.rollout.sampler import plan_decode_slots
    from fp8rl_jax.rollout.sampling import SamplingParams
    from fp8rl_jax.serve.server import ServeEngine, ServerHandle

    precision = run_precision(config, "rollout")
    if checkpoint is not None:  # a trainer checkpoint: its params, FP8 state and KV scales
        from fp8rl_jax.policy_io import load_policy

        model, params, fp8_state, kv_scales, tokenizer = load_policy(config, checkpoint)
    if params is None or model is None or tokenizer is None:
        loaded = load_model(model_spec(config))
        model, params, tokenizer = model or loaded[0], loaded[1] if params is None else params, tokenizer or loaded[2]
    if precision.fp8 and fp8_state is None:
        log.warning("serving an uncalibrated FP8 state (all scales 1): expect poor FP8 numerics")
        fp8_state = llama.init_fp8_state(model, precision)
    r = config.rollout
    slots = max_concurrent_decodes or r.decode_slots
    if not slots:  # automatic: up to SERVE_SLOTS requests at once, as many as the device memory holds
        slots = plan_decode_slots(sampler_spec(config), model, precision, None, sequences=SERVE_SLOTS,
                                  held={"params": params, "fp8_state": fp8_state}).slots
        log.info("serving with %d decode slots (rollout.decode_slots=0: automatic, at most %d)", slots, SERVE_SLOTS)
    engine = Engine(model, precision, EngineConfig(
        max_concurrent_decodes=slots,
        max_prefill_length=config.data.max_prompt_tokens, max_new_tokens=max_new_tokens or r.max_new_tokens,
        sampling=SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, greedy=greedy),
        stop_ids=tuple(tokenizer.stop_ids)), tokenizer)
    adapter = ServeEngine(engine, tokenizer, seed=config.seed)
    rollout = adapter.load_params(params, fp8_state if precision.fp8 else None, kv_scales if precision.kv_fp8 else None)
    return ServerHandle(host=host, port=port, engine=engine, adapter=adapter, params=rollout, tokenizer=tokenizer)
