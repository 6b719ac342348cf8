"""The JetStream server around the tiny model, driven with JetStream's own gRPC client stub.

Precision: configs/tiny.py as it is, ``fp8_e2e`` on the ``xla`` FP8 backend (so the server's own FP8-state init
path runs), greedy sampling so outputs are deterministic. The reference is the offline continuous-batching
driver (``rollout.driver.generate``) on an engine with the same settings: what the server streams must be
exactly its completions, the first token (drawn at prefill) included, a final stop token excluded (JetStream
ends a stream on a stop token without sending it).
"""

import concurrent.futures
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("jetstream", reason="google-jetstream is not installed (make test installs it)")

import grpc  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import portpicker  # noqa: E402
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402

from fp8rl_jax import serve  # noqa: E402
from fp8rl_jax.config import load_config_file  # noqa: E402
from fp8rl_jax.rollout import driver  # noqa: E402
from fp8rl_jax.serve.server import has_ipv6_loopback  # noqa: E402

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[1]
SLOTS, MAX_NEW = 4, 12
PROMPTS = ["bfca:", "ab:", "hgfedcba:", "dc:", "gaeh:", "fb:"]  # more prompts than slots: slots are reused
DRIVER_THREADS = ("prefill-", "transfer-", "generate-", "detokenize-", "serve-grpc")


@pytest.fixture(scope="module")
def server():
    config = load_config_file(str(ROOT / "configs/tiny.py"))
    assert config.precision.mode == "fp8_e2e" and config.precision.backend == "xla"
    before = set(threading.enumerate())
    handle = serve.build_server(config, port=portpicker.pick_unused_port(), greedy=True,
                                max_concurrent_decodes=SLOTS, max_new_tokens=MAX_NEW)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, jetstream_pb2_grpc.OrchestratorStub(channel), before
    channel.close()
    handle.stop()


def _cli_env() -> dict:
    """The server process's environment: conftest's XLA flags for a subprocess (XLA:CPU's code generation at -O0,
    as for every test's programs; not its 8 devices): one device, as a user's shell has it."""
    return {**os.environ, "XLA_FLAGS": os.environ["FP8RL_TEST_CHILD_XLA_FLAGS"]}


def _text(text, max_tokens=MAX_NEW):
    return jetstream_pb2.DecodeRequest(max_tokens=max_tokens,
                                       text_content=jetstream_pb2.DecodeRequest.TextContent(text=text))


def _tokens(ids, max_tokens=MAX_NEW):
    return jetstream_pb2.DecodeRequest(max_tokens=max_tokens,
                                       token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids))


def _decode(stub, request) -> tuple[list[int], str]:
    ids, text = [], ""
    for response in stub.Decode(request, timeout=120):
        (sample,) = response.stream_content.samples
        ids += sample.token_ids
        text += sample.text
    return ids, text


def _expected(handle, prompt_ids, max_tokens=MAX_NEW) -> list[int]:
    batch = driver.generate(handle.engine, handle.params, prompt_ids, 1, jax.random.PRNGKey(7))
    out = []
    for i in range(len(prompt_ids)):
        tokens = [int(t) for t in batch.completion(i)]
        if batch.finish_reasons[i] == "stop":
            tokens = tokens[:-1]
        out.append(tokens[:max_tokens])
    return out


def test_protos_and_seqio_stand_in():
    serve.install_jetstream_compat()
    from jetstream.engine import token_utils

    try:
        import seqio  # noqa: F401
    except ImportError:  # our stand-in, seen only by JetStream's module: fine for its imports, loud if used
        with pytest.raises(RuntimeError, match="seqio is not installed"):
            token_utils.SentencePieceVocabulary("spm.model")
    request = _tokens([1, 2, 3], max_tokens=5)
    assert jetstream_pb2.DecodeRequest.FromString(request.SerializeToString()) == request


def test_import_alone_changes_nothing_and_install_stays_scoped():
    """``import fp8rl_jax.serve`` touches no global; the JetStream compat (what ``build_server`` installs) leaves
    ``jax``, ``sys.modules`` and the root logger as they were, and moves JetStream's log lines off the root."""
    code = """if True:
        import logging, sys
        import jax
        root = logging.getLogger()
        before = (root.level, list(root.handlers), hasattr(jax, "tree_map"), "seqio" in sys.modules)
        import fp8rl_jax.serve as serve
        assert not [m for m in sys.modules if m.split(".")[0] in ("jetstream", "seqio")], "JetStream imported"
        assert (root.level, list(root.handlers), hasattr(jax, "tree_map"), "seqio" in sys.modules) == before
        serve.install_jetstream_compat()
        serve.install_jetstream_compat()  # idempotent
        from jetstream.core import orchestrator
        assert (root.level, list(root.handlers), hasattr(jax, "tree_map"), "seqio" in sys.modules) == before
        assert orchestrator.logging.getLogger is logging.getLogger  # everything but the log calls is logging's
        assert logging.getLogger("jetstream").level == logging.WARNING
        print("ok")
    """
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_tokenizer_pads_to_buckets(server):
    handle, _, _ = server
    tokenizer = handle.adapter.build_tokenizer(handle.adapter.get_tokenizer())
    ids = handle.tokenizer.encode("bfca:")
    assert ids[0] == handle.tokenizer.bos_id and len(ids) == 6
    padded, true_length = tokenizer.encode("bfca:")
    assert true_length == 6 and padded.shape == (16,)
    np.testing.assert_array_equal(padded, ids + [0] * 10)
    assert tokenizer.encode("bfca:", is_bos=False)[1] == 5
    assert tokenizer.stop_tokens == {handle.tokenizer.eos_id}
    assert tokenizer.decode(ids[1:]) == "bfca:"
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        tokenizer.encode("a" * 16)


def test_binds_localhost_only(server):
    handle, stub, _ = server
    assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        pytest.skip("needs Linux /proc/net/tcp")
    listening = [line.split()[1].split(":")[0] for table in tables if table.exists()
                 for line in table.read_text().splitlines()[1:]
                 if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == handle.port]
    # 127.0.0.1 (hex, little-endian), maybe as the IPv4-mapped ::ffff:127.0.0.1 of a dual-stack socket;
    # server_lib's "[::]" would show up as all zeros
    assert listening and set(listening) <= {"0100007F", "0000000000000000FFFF00000100007F"}, listening


def test_streams_match_offline_driver(server):
    handle, stub, _ = server
    prompt_ids = [handle.tokenizer.encode(p) for p in PROMPTS]
    expected = _expected(handle, prompt_ids)
    assert len({t for e in expected for t in e}) > 5, "degenerate outputs would make this test vacuous"
    requests = [_text(p) for p in PROMPTS[:3]] + [_tokens(ids) for ids in prompt_ids[3:]]
    requests[1].max_tokens = 5  # a request may ask for fewer tokens than the engine's cap
    expected[1] = expected[1][:5]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: _decode(stub, r), requests))
    for i, (ids, text) in enumerate(results):
        assert ids == expected[i], PROMPTS[i]
        if i < 3:  # text content is detokenized server-side
            assert text == handle.tokenizer.decode(expected[i]), PROMPTS[i]


@pytest.mark.parametrize("request_, detail", [
    (_text("abcd" * 10), "exceeds max_prefill_length=16"),
    (_text("ABC"), "not in the char tokenizer's vocabulary"),
    (_tokens([]), "1 or more token ids"),
    (_tokens([5, 10_000]), "token ids in [0, 50)"),
    (jetstream_pb2.DecodeRequest(max_tokens=4), "no content"),
    (_text("ab:", max_tokens=0), "max_tokens=0"),
], ids=["too_long", "unknown_char", "empty", "out_of_vocab", "no_content", "max_tokens_0"])
def test_malformed_request_is_rejected_and_server_keeps_serving(server, request_, detail):
    handle, stub, _ = server
    with pytest.raises(grpc.RpcError) as error:
        _decode(stub, request_)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail in error.value.details()
    assert _decode(stub, _text("bfca:"))[0] == _expected(handle, [handle.tokenizer.encode("bfca:")])[0]


@pytest.mark.parametrize("body", [b"\xff\xff\xff\xff", b"\x0a\x05ab"], ids=["bad_varint", "truncated"])
def test_corrupt_request_body_is_invalid_argument(server, body):
    """A body that is no DecodeRequest at all: INVALID_ARGUMENT naming the message, not UNKNOWN."""
    handle, stub, _ = server
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        decode = channel.unary_stream("/jetstream_proto.Orchestrator/Decode")  # raw bytes in and out
        with pytest.raises(grpc.RpcError) as error:
            list(decode(body, timeout=30))
        health = channel.unary_unary("/jetstream_proto.Orchestrator/HealthCheck")
        with pytest.raises(grpc.RpcError) as health_error:
            health(body, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value
    assert "not a valid jetstream_proto.DecodeRequest" in error.value.details()
    assert health_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, health_error.value
    assert _decode(stub, _text("bfca:"))[0] == _expected(handle, [handle.tokenizer.encode("bfca:")])[0]


def test_second_server_on_the_same_port_fails(server):
    """gRPC's default SO_REUSEPORT would let a second server bind the port and take part of the traffic."""
    handle, stub, _ = server
    config = load_config_file(str(ROOT / "configs/tiny.py"), "bf16")
    threads = set(threading.enumerate())
    with pytest.raises(OSError, match=f"port {handle.port} is in use"):
        serve.build_server(config, port=handle.port, greedy=True, max_concurrent_decodes=2, max_new_tokens=4)
    assert [t.name for t in set(threading.enumerate()) - threads if not t.daemon] == []  # nothing left running
    assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live


def test_jetstream_logs_nothing_per_step_at_info(server, caplog):
    """JetStream logs each decode step (and detokenize step) at INFO on the root logger; those now go to the
    ``jetstream`` loggers, at WARNING, so a root logger at INFO (a notebook, absl) stays quiet."""
    handle, stub, _ = server
    caplog.set_level(logging.INFO)
    assert _decode(stub, _text("bfca:"))[0]
    jetstream_records = [r for r in caplog.records if f"{os.sep}jetstream{os.sep}" in r.pathname]
    assert jetstream_records == [], [r.getMessage() for r in jetstream_records][:5]


@pytest.mark.parametrize("method", ["prefill", "insert", "generate"])
def test_engine_failure_is_internal_and_server_recovers(server, method, monkeypatch):
    handle, stub, _ = server
    real, calls = getattr(handle.engine, method), []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(handle.engine, method, fails_once)
    with pytest.raises(grpc.RpcError) as error:
        _decode(stub, _text("gaeh:"))
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert f"{method} failed: RuntimeError: injected failure" in error.value.details()
    assert _decode(stub, _text("gaeh:"))[0] == _expected(handle, [handle.tokenizer.encode("gaeh:")])[0]


def test_stop_leaves_no_threads(server):
    handle, stub, before = server
    handle.stop()
    handle.stop()  # idempotent
    ours = [t.name for t in threading.enumerate() if t.name.startswith(DRIVER_THREADS)]
    assert ours == []
    assert [t.name for t in set(threading.enumerate()) - before if not t.daemon] == []
    with pytest.raises(grpc.RpcError) as error:
        stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=2)
    assert error.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_cli_rejects_unknown_key():
    result = subprocess.run([sys.executable, "-m", "fp8rl_jax.serve", "--config=configs/tiny.py",
                             "--config.rollout.nope=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "unknown key 'nope' in config.rollout" in result.stderr


def test_cli_serves_and_exits_on_sigterm():
    port = portpicker.pick_unused_port()
    env = _cli_env()
    process = subprocess.Popen([sys.executable, "-m", "fp8rl_jax.serve", "--config=configs/tiny.py:bf16",
                                f"--port={port}", "--max_concurrent_decodes=2", "--max_new_tokens=4", "--greedy"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    watchdog = threading.Timer(120, process.kill)  # a hung start must fail the test, not hang it
    watchdog.start()
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("serving"):
                break
        assert f"127.0.0.1:{port}" in lines[-1], "".join(lines)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            ids, _ = _decode(jetstream_pb2_grpc.OrchestratorStub(channel), _text("bfca:", max_tokens=4))
        assert 0 < len(ids) <= 4
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stdout.read()
    finally:
        watchdog.cancel()
        process.kill()


def test_serves_a_trainer_checkpoint(tmp_path):
    """--checkpoint: the server streams what the trained policy (its params, FP8 state, KV scales) decodes."""
    from fp8rl_jax.policy_io import load_policy
    from fp8rl_jax.trainer import Trainer

    config = load_config_file(str(ROOT / "configs/tiny.py"))
    with config.unlocked():
        config.workdir = str(tmp_path)
        config.steps = 2
        config.logging.progress = config.logging.tensorboard = config.logging.plots = False
    trainer = Trainer(config)
    trainer.run()
    want = trainer.sample(["bfca:"], greedy=True)[0][0]
    state = jax.device_get(trainer.state)
    trainer.close()
    _, params, fp8_state, _, _ = load_policy(config)
    for a, b in zip(jax.tree.leaves((params, fp8_state)), jax.tree.leaves((state["params"], state["fp8_state"])),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with serve.build_server(config, port=0, greedy=True, checkpoint=str(tmp_path / "checkpoints")) as handle:
        channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
        _, text = _decode(jetstream_pb2_grpc.OrchestratorStub(channel), _text("bfca:"))
        channel.close()
    assert text == want.removesuffix("<eos>") and text


def test_a_host_name_is_served_on_every_address_it_resolves_to():
    """``host="localhost"``, port 0: one port, bound on 127.0.0.1 and on ::1 (where there is IPv6)."""
    from fp8rl_jax.serve.server import bind_addresses

    addresses = bind_addresses("localhost")
    assert "127.0.0.1" in addresses and ("::1" in addresses) == has_ipv6_loopback(), addresses
    assert bind_addresses("127.0.0.1") == ["127.0.0.1"] and bind_addresses("::") == ["::"]
    config = load_config_file(str(ROOT / "configs/tiny.py"), "bf16")
    with serve.build_server(config, host="localhost", port=0, greedy=True, max_concurrent_decodes=2,
                            max_new_tokens=4) as handle:
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe, pytest.raises(OSError) as taken:
                probe.bind((address, handle.port))
            assert taken.value.errno == errno.EADDRINUSE, (address, taken.value)
            with grpc.insecure_channel(f"{'[::1]' if ':' in address else address}:{handle.port}") as channel:
                assert jetstream_pb2_grpc.OrchestratorStub(channel).HealthCheck(
                    jetstream_pb2.HealthCheckRequest(), timeout=30).is_live


def test_cli_refuses_a_host_name_one_of_whose_addresses_is_held():
    """``--host=localhost``, 127.0.0.1:PORT held by another server: gRPC's resolver gives localhost as [::1] and
    127.0.0.1, bound the one it could and served, so clients of localhost:PORT reached either server. Every address
    a host name resolves to must be bound, or the server does not start."""
    if "127.0.0.1" not in {a[4][0] for a in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)}:
        pytest.skip("localhost does not resolve to 127.0.0.1 here")
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback (::1) here: localhost resolves to one address only")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:  # another server's port on 127.0.0.1 only
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = _cli_env()
        process = subprocess.Popen([sys.executable, "-m", "fp8rl_jax.serve", "--config=configs/tiny.py:bf16",
                                    "--host=localhost", f"--port={port}", "--max_concurrent_decodes=2",
                                    "--max_new_tokens=4"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env)
        watchdog = threading.Timer(120, process.kill)
        watchdog.start()
        try:
            first = process.stdout.readline()  # "serving ..." if it started: stop it, the test has failed
            if first.startswith("serving"):
                process.send_signal(signal.SIGTERM)
            stdout, stderr = process.communicate(timeout=120)
        finally:
            watchdog.cancel()
            process.kill()
    stdout = first + stdout
    assert not first.startswith("serving"), f"started although 127.0.0.1:{port} is held: {first}{stderr}"
    assert process.returncode == 2, stdout + stderr  # a port in use: exit status 2, as for any bad input
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"port {port} is in use on 127.0.0.1" in errors[0], stderr
    assert "Traceback" not in stderr, stderr
