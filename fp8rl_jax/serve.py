"""JetStream 0.2.2 gRPC server around the rollout engine: ``python -m fp8rl_jax.serve --config=configs/tiny.py``.

Serves ``config.model`` with the rollout precision of ``config.precision`` and the sampling of ``config.rollout``
(``--greedy``: argmax). A caller that holds a policy (the trainer, a notebook) passes it to ``build_server(config,
params=, fp8_state=, kv_scales=)``; otherwise the model is loaded from the config with FP8 scales of 1, and an
untrained FP8 state served without calibration gives poor FP8 numerics; ``--checkpoint=DIR`` (a trainer's
``<workdir>/checkpoints``) serves a trained policy with its own FP8 and KV scales. Binds 127.0.0.1 unless
``--host`` says otherwise; no TLS, no auth.

JetStream's orchestrator (``Driver``, interleaved, one engine) and servicer run as they are, except:
- the gRPC server is ours: ``server_lib`` always binds ``[::]``, every interface;
- 0.2.2's ``prefill`` returns only a prefix, so the first token (drawn at prefill) would never be streamed:
  ``generate`` reports each slot's *pending* token (the one fed into the step), one step late. Every sampled
  token is streamed; a stop token ends the stream unsent (as JetStream does);
- prompts are tokenized and padded by us: text with our tokenizer's BOS rule, token content verbatim; a bad
  request gets INVALID_ARGUMENT, an engine failure INTERNAL (an exception in a JetStream thread would SIGKILL
  the process). A device fault surfacing asynchronously in JetStream's detokenize thread still ends it: a
  faulted device cannot serve, and a supervisor should restart the server;
- per-request randomness: the n-th prefill since start draws with ``fold_in(PRNGKey(config.seed), n)``.
Not streamed: logprobs (0.2.2 has no field for them). Text is decoded token by token, so a character that a
byte-level BPE splits over tokens arrives garbled in ``text``; ``token_ids`` are exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import signal
import sys
import threading
import types

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.model.tokenizer import Tokenizer
from fp8rl_jax.rollout.engine import DecodeState, Engine, EngineConfig, ResultTokens, prefill_bucket

log = logging.getLogger(__name__)
DEFAULT_HOST = "127.0.0.1"


def _install_jetstream_shims() -> None:
    # (a) 0.2.2's orchestrator frees each prefix with jax.tree_map, which JAX has removed.
    if not hasattr(jax, "tree_map"):
        jax.tree_map = jax.tree.map
    # (b) token_utils imports seqio (and so TensorFlow) for its SentencePiece path. Our tokenizer never goes
    # through seqio; without it, stand-ins provide the two names JetStream references and fail loudly if used.
    try:
        import seqio  # noqa: F401
    except ImportError:
        class Vocabulary:
            def __init__(self, *args, **kwargs):
                raise RuntimeError("seqio is not installed; fp8rl_jax.serve uses its own tokenizer, never seqio's")

        class SentencePieceVocabulary(Vocabulary):
            pass

        vocabularies = types.ModuleType("seqio.vocabularies")
        seqio = types.ModuleType("seqio")
        for module in (seqio, vocabularies):
            module.Vocabulary, module.SentencePieceVocabulary = Vocabulary, SentencePieceVocabulary
        seqio.vocabularies = vocabularies
        sys.modules.update({"seqio": seqio, "seqio.vocabularies": vocabularies})


_install_jetstream_shims()
_root = logging.getLogger()
_root_state = (_root.level, list(_root.handlers))
try:  # (e) protoc-4.25 generated code under a newer protobuf runtime: if it ever stops loading, say so
    from jetstream.core import orchestrator
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: F401 - clients import them here
    from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2
except (ImportError, TypeError) as e:  # protobuf's version errors are TypeErrors
    from google.protobuf import __version__ as _protobuf_version

    raise ImportError(f"JetStream 0.2.2 failed to import (protobuf runtime {_protobuf_version}): {e}") from e
finally:  # importing the orchestrator sets the root logger to DEBUG on stdout: undo that global side effect
    _root.setLevel(_root_state[0])
    for _handler in [h for h in _root.handlers if h not in _root_state[1]]:
        _root.removeHandler(_handler)


class RequestRejected(ValueError):
    """A request the server cannot run as sent: INVALID_ARGUMENT."""


class EngineFailure(RuntimeError):
    """The engine raised while running a request: INTERNAL (the server goes on serving)."""


def to_jetstream(result: ResultTokens) -> engine_api.ResultTokens:
    """Our ResultTokens as JetStream's: the same [B, 3] = (token, valid, length) array; logprobs dropped."""
    r = result
    return engine_api.ResultTokens(r.data, r.tokens_idx, r.valid_idx, r.length_idx, r.samples_per_slot)


class ServeTokenizer(tokenizer_api.Tokenizer):
    """Our ``Tokenizer`` behind JetStream's tokenizer API; prompts padded to ``prefill_bucket`` sizes."""

    def __init__(self, tokenizer: Tokenizer, *, max_prefill_length: int, vocab_size: int, stop_ids: tuple[int, ...]):
        self.tokenizer, self.max_prefill_length, self.vocab_size = tokenizer, max_prefill_length, vocab_size
        self._stop_ids = set(stop_ids)  # not JetStream's default {eos, pad}: a pad token may be an ordinary one

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        # is_bos=False (a continuation) suppresses BOS; otherwise our tokenizer's own rule decides
        ids = self.tokenizer.encode(s, add_bos=None if kwargs.get("is_bos", True) else False)
        return self.pad(ids, kwargs.get("max_prefill_length"))

    def pad(self, ids, max_prefill_length: int | None = None) -> tuple[np.ndarray, int]:
        """Right-pad with 0 as the offline driver does (the prefill reads only ``true_length`` positions)."""
        ids = [int(i) for i in ids]
        if not ids or min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestRejected(f"a prompt needs 1 or more token ids in [0, {self.vocab_size})")
        try:
            padded = np.zeros(prefill_bucket(len(ids), max_prefill_length or self.max_prefill_length), np.int32)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        padded[: len(ids)] = ids
        return padded, len(ids)

    def decode(self, token_ids: list[int], **kwargs) -> str:
        try:  # runs in JetStream's detokenize thread: (c) never raise there
            return self.tokenizer.decode(token_ids)
        except Exception:
            log.exception("decoding %s failed", token_ids)
            return ""

    stop_tokens = property(lambda self: self._stop_ids)
    # JetStream wants ints: -1 (no token) where our tokenizer has none
    pad_id = property(lambda self: -1 if self.tokenizer.pad_id is None else self.tokenizer.pad_id)
    eos_id = property(lambda self: -1 if self.tokenizer.eos_id is None else self.tokenizer.eos_id)
    bos_id = property(lambda self: -1 if self.tokenizer.bos_id is None else self.tokenizer.bos_id)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ServeState:
    decode: DecodeState
    emitted: jax.Array  # [B] int32: tokens of the slot's sequence already reported to JetStream


@dataclasses.dataclass
class _PrefillJob:  # what _Driver hands prefill() as padded_tokens: the tokens and their request
    tokens: np.ndarray | None
    request: orchestrator.ActiveRequest | None
    error: Exception | None = None


@dataclasses.dataclass
class _ServePrefix:  # a prefix and its request, so later failures reach the client; not a pytree, so
    prefix: object | None  # JetStream's delete_pytree skips it and insert drops the KV cache itself
    request: orchestrator.ActiveRequest | None


def _fail(request, error: Exception) -> None:
    if request is not None and request.return_channel is not None:  # Driver.stop() clears channels
        request.return_channel.set_exception(error)


@jax.jit
def _pending(state: ServeState) -> tuple[ResultTokens, jax.Array]:
    """Each slot's pending token as JetStream's row (token, valid, length), and the new ``emitted``."""
    d = state.decode
    valid = d.generated > state.emitted
    data = jnp.stack([d.tokens, valid.astype(jnp.int32), d.generated], axis=1)  # [B, 3]
    return ResultTokens(data=data, logprobs=jnp.where(valid, d.logprobs, 0.0)), data[:, 2]


@jax.jit
def _retire(state: ServeState, slot) -> ServeState:
    """``slot`` finished with nothing pending: its request completes at the next step and frees the slot."""
    d = state.decode
    done = dataclasses.replace(d, done=d.done.at[slot].set(True))
    return ServeState(done, state.emitted.at[slot].set(d.generated[slot]))


class ServeEngine(engine_api.Engine):
    """Our ``Engine`` behind JetStream 0.2.2's Engine API, with the keyword calls its orchestrator makes."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, seed: int = 0):
        self.engine, self.tokenizer = engine, tokenizer
        self._key, self._requests = jax.random.PRNGKey(seed), itertools.count()
        self._slot_requests: dict[int, orchestrator.ActiveRequest | None] = {}

    def load_params(self, params: dict, fp8_state: dict | None = None, kv_scales: dict | None = None) -> dict:
        return self.engine.load_params(params, fp8_state, kv_scales)

    def init_decode_state(self) -> ServeState:
        return ServeState(self.engine.init_decode_state(), jnp.zeros((self.max_concurrent_decodes,), jnp.int32))

    def prefill(self, *, params: dict, existing_prefix=None, padded_tokens, true_length: int) -> _ServePrefix:
        job = padded_tokens if isinstance(padded_tokens, _PrefillJob) else _PrefillJob(padded_tokens, None)
        error = job.error
        if existing_prefix is not None:
            error = RequestRejected("existing_prefix (a session cache) is not supported")
        if error is None:
            try:
                key = jax.random.fold_in(self._key, next(self._requests))
                return _ServePrefix(self.engine.prefill(params, job.tokens, true_length, key), job.request)
            except Exception as e:  # (c) never let it reach JetStream's thread
                log.exception("prefill failed")
                error = EngineFailure(f"prefill failed: {type(e).__name__}: {e}")
        _fail(job.request, error)
        return _ServePrefix(None, job.request)  # insert retires the slot, so the request frees it again

    def insert(self, prefix: _ServePrefix, decode_state: ServeState, slot: int) -> ServeState:
        prefix = prefix if isinstance(prefix, _ServePrefix) else _ServePrefix(prefix, None)
        try:
            if prefix.prefix is None:
                return _retire(decode_state, slot)
            decode = self.engine.insert(prefix.prefix, decode_state.decode, slot)
            self._slot_requests[slot] = prefix.request
            return ServeState(decode, decode_state.emitted.at[slot].set(0))
        except Exception as e:  # (c)
            log.exception("insert failed")
            _fail(prefix.request, EngineFailure(f"insert failed: {type(e).__name__}: {e}"))
            if any(x.is_deleted() for x in jax.tree.leaves(decode_state)):  # donated before it failed
                return self._reset()[0]
            return _retire(decode_state, slot)
        finally:
            prefix.prefix = None  # free the prompt's KV cache now, not when the request ends

    def generate(self, params: dict, decode_state: ServeState) -> tuple[ServeState, engine_api.ResultTokens]:
        try:
            result, emitted = _pending(decode_state)
            decode, _ = self.engine.generate(params, decode_state.decode)
            return ServeState(decode, emitted), to_jetstream(result)
        except Exception as e:  # (c) fail the requests in the slots, go on with empty slots
            log.exception("generate failed")
            for request in self._slot_requests.values():
                _fail(request, EngineFailure(f"generate failed: {type(e).__name__}: {e}"))
            return self._reset()

    def _reset(self) -> tuple[ServeState, engine_api.ResultTokens]:
        """Empty slots and a step whose tokens are all invalid, so JetStream completes (and frees) every slot."""
        self._slot_requests.clear()
        b = self.max_concurrent_decodes
        return self.init_decode_state(), to_jetstream(ResultTokens(np.zeros((b, 3), np.int32), np.zeros(b)))

    def get_prefix_destination_sharding(self) -> None:
        return None  # interleaved mode only: a prefix never moves to another engine

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="fp8rl_jax")  # informational: build_tokenizer ignores it

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> ServeTokenizer:
        return ServeTokenizer(self.tokenizer, max_prefill_length=self.max_prefill_length,
                              vocab_size=self.engine.model.vocab_size, stop_ids=self.engine.config.stop_ids)

    max_concurrent_decodes = property(lambda self: self.engine.max_concurrent_decodes)
    max_prefill_length = property(lambda self: self.engine.max_prefill_length)
    samples_per_slot = property(lambda self: 1)
    colocated_cpus = property(lambda self: None)
    mesh = property(lambda self: jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))


class _Driver(orchestrator.Driver):
    """JetStream's Driver with our prompt handling: a long prompt is an error, not silently cut; never raises."""

    def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
        try:
            content = request.prefill_content
            tokens, true_length = (tokenizer.encode(content, is_bos=is_bos) if isinstance(content, str)
                                   else tokenizer.pad(content))  # token content: verbatim, no BOS added
            return _PrefillJob(tokens, request), true_length
        except Exception as e:  # e.g. a character outside the vocabulary
            return _PrefillJob(None, request, e if isinstance(e, RequestRejected) else RequestRejected(str(e))), 0


class _Servicer(orchestrator.LLMOrchestrator):
    """JetStream's servicer, with requests checked first and engine errors turned into gRPC status codes."""

    async def Decode(self, request, context=None):  # noqa: N802 - the gRPC method name
        which = request.WhichOneof("content")
        problem = ("no content: set text_content or token_content" if which is None
                   else f"max_tokens={request.max_tokens} must be > 0" if request.max_tokens <= 0
                   else "session_cache is not supported" if request.session_cache else None)
        try:
            if problem:
                raise RequestRejected(problem)
            async for response in super().Decode(request, context):
                yield response
        except (RequestRejected, EngineFailure) as e:
            if context is None:
                raise
            bad = isinstance(e, RequestRejected)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT if bad else grpc.StatusCode.INTERNAL, str(e))


class ServerHandle:
    """A running server: ``.port``, ``.engine``, ``.params`` (the rollout params), ``.stop()``; a context manager."""

    def __init__(self, *, host: str, port: int, engine: Engine, adapter: ServeEngine, params: dict,
                 tokenizer: Tokenizer):
        self.host, self.engine, self.adapter, self.params, self.tokenizer = host, engine, adapter, params, tokenizer
        self._lock, self._stopped, self._server = threading.Lock(), threading.Event(), None
        self.driver = _Driver(prefill_engines=[adapter], generate_engines=[adapter], prefill_params=[params],
                              generate_params=[params], interleaved_mode=True, jax_padding=False)
        self._loop = asyncio.new_event_loop()  # the aio server and the orchestrator's futures live here
        self._thread = threading.Thread(target=self._loop.run_forever, name="serve-grpc", daemon=True)
        self._thread.start()
        try:
            self.port = self._run(self._start(f"[{host}]:{port}" if ":" in host else f"{host}:{port}"))
        except BaseException:
            self.stop(grace_s=0)
            raise

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start(self, address: str) -> int:
        self._server = grpc.aio.server()
        jetstream_pb2_grpc.add_OrchestratorServicer_to_server(_Servicer(self.driver), self._server)
        port = self._server.add_insecure_port(address)  # raises if it cannot bind
        await self._server.start()
        return port

    def stop(self, grace_s: float = 5.0) -> None:
        """(d) Let in-flight requests finish (up to ``grace_s``), then stop the Driver's threads (its detokenize
        thread is no daemon: the process would never exit) and the event loop. Idempotent."""
        with self._lock:
            if self._stopped.is_set():
                return
            if self._server is not None:
                self._run(self._server.stop(grace_s))
            self.driver.stop()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def build_server(config, *, params: dict | None = None, fp8_state: dict | None = None, kv_scales: dict | None = None,
                 port: int = 9000, host: str = DEFAULT_HOST, model: LlamaConfig | None = None,
                 tokenizer: Tokenizer | None = None, greedy: bool = False,
                 max_concurrent_decodes: int | None = None, max_new_tokens: int | None = None,
                 checkpoint: str | None = None) -> ServerHandle:
    """Serve ``params`` (training params, FP8 state and KV scales as the trainer holds them; with ``model`` and
    ``tokenizer``, else those load from the config) or, with none, the model of ``config``. ``port=0``: any."""
    from fp8rl_jax.fp8.policy import from_config
    from fp8rl_jax.model import llama
    from fp8rl_jax.model.loading import load_model
    from fp8rl_jax.rollout.sampling import SamplingParams

    precision = from_config(config, "rollout")
    if checkpoint is not None:  # a trainer checkpoint: its params, FP8 state and KV scales
        from fp8rl_jax.trainer import load_policy

        model, params, fp8_state, kv_scales, tokenizer = load_policy(config, checkpoint)
    if params is None or model is None or tokenizer is None:
        loaded = load_model(config)
        model, params, tokenizer = model or loaded[0], loaded[1] if params is None else params, tokenizer or loaded[2]
    if precision.fp8 and fp8_state is None:
        log.warning("serving an uncalibrated FP8 state (all scales 1): expect poor FP8 numerics")
        fp8_state = llama.init_fp8_state(model, precision)
    r = config.rollout
    engine = Engine(model, precision, EngineConfig(
        max_concurrent_decodes=max_concurrent_decodes or r.decode_slots,
        max_prefill_length=config.data.max_prompt_tokens, max_new_tokens=max_new_tokens or r.max_new_tokens,
        sampling=SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, greedy=greedy),
        stop_ids=tuple(tokenizer.stop_ids)), tokenizer)
    adapter = ServeEngine(engine, tokenizer, seed=config.seed)
    rollout = adapter.load_params(params, fp8_state if precision.fp8 else None, kv_scales if precision.kv_fp8 else None)
    return ServerHandle(host=host, port=port, engine=engine, adapter=adapter, params=rollout, tokenizer=tokenizer)


# ----------------------------------------------------------------------------------------------------------
# command line: the trainer's --config flag and friendly errors (fp8rl_jax.main), and the server's own flags


def main(argv) -> int:
    from absl import app

    from fp8rl_jax import main as cli
    from fp8rl_jax.config import ConfigError, validate

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if cli._STEPS.value is not None:
        raise app.UsageError("--steps is a trainer flag")
    try:
        config = cli._CONFIG.value
        config.get("seed")  # a config file that failed to load raises its error on first access
        validate(config)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cli._DRY_RUN.value:
        print(config)
        return 0
    # JetStream logs every decode step on the root logger at INFO
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handle = build_server(config, port=_PORT.value, host=_HOST.value, greedy=_GREEDY.value,
                          max_concurrent_decodes=_SLOTS.value, max_new_tokens=_MAX_NEW.value,
                          checkpoint=_CHECKPOINT.value)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: handle.stop())
    print(f"serving {config.model.source} on {handle.host}:{handle.port} (JetStream gRPC); Ctrl-C stops", flush=True)
    handle.wait()
    return 0


def _parse_flags(argv: list[str]) -> list[str]:
    from absl import flags

    from fp8rl_jax import main as cli

    if any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:]):
        sys.exit(print(__doc__, flags.FLAGS.main_module_help(), sep="\n"))
    return cli._parse_flags(argv)


if __name__ == "__main__":
    from absl import app, flags

    import fp8rl_jax.main  # noqa: F401 - defines --config (and the trainer's --steps, --dry_run)

    _PORT = flags.DEFINE_integer("port", 9000, "gRPC port (0: any free one).", lower_bound=0, upper_bound=65535)
    _HOST = flags.DEFINE_string("host", DEFAULT_HOST, "Interface to bind; 0.0.0.0 or :: exposes it (no auth).")
    _SLOTS = flags.DEFINE_integer("max_concurrent_decodes", None, "Decode slots (default: rollout.decode_slots).",
                                  lower_bound=1)
    _MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens per request at most, whatever its max_tokens "
                                    "(default: rollout.max_new_tokens).", lower_bound=1)
    _GREEDY = flags.DEFINE_bool("greedy", False, "Argmax sampling (deterministic) instead of config.rollout's.")
    _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A trainer's checkpoint directory (<workdir>/checkpoints): "
                                      "serve its params, FP8 state and KV scales (latest step).")
    app.run(main, flags_parser=_parse_flags)
