"""Our rollout ``Engine`` behind JetStream 0.2.2's Engine API, Driver and gRPC servicer (``fp8rl_jax.serve`` says
what differs from JetStream and why). Importing this module installs the JetStream compat first: JetStream cannot
load without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import ipaddress
import itertools
import logging
import socket
import threading

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from google.protobuf.message import DecodeError

from fp8rl_jax.model.tokenizer import Tokenizer
from fp8rl_jax.rollout.engine import DecodeState, Engine, ResultTokens, prefill_bucket
from fp8rl_jax.serve import install_jetstream_compat

install_jetstream_compat()

from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2  # noqa: E402
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2  # noqa: E402

log = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True)
class _Malformed:
    """What the request parser returns for a body that is no message of the method's type."""

    reason: str


def _parse_or_malformed(message_class):
    """A request deserializer that returns ``_Malformed`` for a corrupt body: gRPC answers an exception raised by
    the deserializer with UNKNOWN, and the servicer turns ``_Malformed`` into INVALID_ARGUMENT."""
    full_name = message_class.DESCRIPTOR.full_name

    def parse(body: bytes):
        try:
            return message_class.FromString(body)
        except DecodeError as e:
            return _Malformed(f"the request is not a valid {full_name}: {e}")

    return parse


class _Servicer(orchestrator.LLMOrchestrator):
    """JetStream's servicer, with requests checked first and engine errors turned into gRPC status codes."""

    async def Decode(self, request, context=None):  # noqa: N802 - the gRPC method name
        which = None if isinstance(request, _Malformed) else request.WhichOneof("content")
        problem = (request.reason if isinstance(request, _Malformed)
                   else "no content: set text_content or token_content" if which is None
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

    async def HealthCheck(self, request, context=None):  # noqa: N802 - the gRPC method name
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await super().HealthCheck(request, context)


def _add_servicer(servicer: _Servicer, server: grpc.aio.Server) -> None:
    """JetStream's ``add_OrchestratorServicer_to_server``, with requests parsed by ``_parse_or_malformed``."""
    handlers = {
        "Decode": grpc.unary_stream_rpc_method_handler(
            servicer.Decode, request_deserializer=_parse_or_malformed(jetstream_pb2.DecodeRequest),
            response_serializer=jetstream_pb2.DecodeResponse.SerializeToString),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(
            servicer.HealthCheck, request_deserializer=_parse_or_malformed(jetstream_pb2.HealthCheckRequest),
            response_serializer=jetstream_pb2.HealthCheckResponse.SerializeToString),
    }
    service = jetstream_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


def _bind_error(host: str, port: int, error: Exception, address: str | None = None) -> OSError:
    """Why gRPC could not bind ``address`` (default ``host``; it says only "Failed to bind"): a port in use, or the
    system's reason. Where ``host`` is a name, the message says which of its addresses failed."""
    address = address or host
    where = "" if address == host else f" on {address}"
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is no conflict
            probe.bind((address, port))
    except OSError as e:
        reason = f"port {port} is in use{where}" if e.errno == errno.EADDRINUSE else f"{e.strerror or e}{where}"
        return OSError(f"cannot serve on {host}:{port}: {reason}")
    return OSError(f"cannot serve on {host}:{port}: {error}")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.partition("%")[0])  # an IPv6 address may carry a %zone
    except ValueError:
        return False
    return True


def has_ipv6_loopback() -> bool:
    """Whether this host can bind the IPv6 loopback, ::1 (what `localhost` also resolves to where it can)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def bind_addresses(host: str) -> list[str]:
    """The addresses to bind for ``host``, each of which a client of ``host:port`` may reach: an address (or ``""``)
    as it is; a name, every address it resolves to. Given a name, gRPC binds what it can of the addresses its own
    resolver finds and serves on those ("Only 1 addresses added out of total 2"), so a client of ``localhost:PORT``
    whose resolver picks the other address reaches whichever server holds it there. ``localhost`` (and
    ``*.localhost``) also names both loopbacks, 127.0.0.1 and ::1 where this machine has IPv6, as gRPC's resolver
    has it (RFC 6761) whatever ``/etc/hosts`` says. Raises OSError naming ``host`` if it does not resolve."""
    if not host or _is_address(host):
        return [host]
    try:
        found = [info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    except socket.gaierror as e:
        raise OSError(f"cannot serve on {host}: the name does not resolve ({e.strerror or e})") from None
    if host.lower().rstrip(".") == "localhost" or host.lower().rstrip(".").endswith(".localhost"):
        found += ["127.0.0.1", *(["::1"] if has_ipv6_loopback() else [])]
    return list(dict.fromkeys(found))  # once each, in the resolver's order


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
            self.port = self._run(self._start(host, port))
        except BaseException:
            self.stop(grace_s=0)
            raise

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start(self, host: str, port: int) -> int:
        """Bind every address of ``host`` (``bind_addresses``) on one port, or none; ``port=0``: a port free on all
        of them (another one where a later address has the first one's taken)."""
        addresses, tries = bind_addresses(host), 1 if port else 10
        for attempt in range(1, tries + 1):
            # no SO_REUSEPORT (gRPC's default): a second server on this port must fail, not take part of its traffic
            server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            _add_servicer(_Servicer(self.driver), server)
            bound, failed = port, None
            for address in addresses:  # one at a time: given a name, gRPC serves on what it could bind of it
                try:
                    bound = server.add_insecure_port(f"[{address}]:{bound}" if ":" in address else f"{address}:{bound}")
                except RuntimeError as e:
                    failed = (address, e)
                    break
            if failed is None:
                self._server = server
                await server.start()
                return bound
            partly = failed[0] != addresses[0]
            if partly:  # gRPC lets go of the addresses it did bind only when a started server stops
                await server.start()
                await server.stop(0)
            if not (partly and port == 0 and attempt < tries):
                raise _bind_error(host, bound, failed[1], failed[0]) from None
        raise AssertionError("unreachable: the last try returns or raises")

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
