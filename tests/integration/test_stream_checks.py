"""Per-message checks of gRPC ModelStreamInfer streams through real Envoy (ext_authz at
the stream's start, the grpc_stream_check ext_proc filter for every message) to a real
Triton with a decoupled streaming model: a refused message ends the stream with its
reason and the messages before it are answered; a revoked key cuts its open stream; a
message that stalls past the deadline follows the fail mode."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient import grpc as triton_grpc
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from sitsmesh.dev import envoyconf, harness, stream_model
from sitsmesh.dev.triton import TritonServer

pytestmark = pytest.mark.integration
TOKENS = 3
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    server = stream_model.start_triton(tmp_path_factory.mktemp("triton"), ttft_ms=20,
                                       itl_ms=20, tokens=TOKENS)
    yield server
    server.kill()


@dataclass
class Stack:
    node: harness.Sitsmesh
    envoy: harness.Envoy
    key: str
    key_id: str


def _stack(tmp: Path, node: harness.Sitsmesh, triton: TritonServer) -> Stack:
    created = node.cli("tenants", "create", "acme", "--models", stream_model.NAME)
    assert created.returncode == 0, created.stderr
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    assert made.returncode == 0, made.stderr
    doc = json.loads(made.stdout)

    def checked(bootstrap: dict[str, Any]) -> None:
        envoyconf.add_route(bootstrap, name="triton_grpc", prefix="/inference.",
                            host="127.0.0.1", port=triton.grpc_port, timeout="0s",
                            http2=True)
        envoyconf.stream_checks_on(bootstrap, ["triton_grpc"])

    envoy = harness.start_envoy(tmp, node.data_addr, triton.http_port,
                                fragments=["ext_authz", "grpc_stream_check"], edit=checked)
    return Stack(node, envoy, doc["key"], doc["id"])


@pytest.fixture
def stack(tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh],
          triton: TritonServer) -> Iterator[Stack]:
    made = _stack(tmp_path, start_sitsmesh(), triton)
    yield made
    made.envoy.kill()


@dataclass
class Client:
    """A tritonclient stream through Envoy: every answer, and the error that ended it."""

    envoy: harness.Envoy
    key: str
    answers: queue.Queue[Any] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        self.client = triton_grpc.InferenceServerClient(f"127.0.0.1:{self.envoy.listen_port}")
        self.client.start_stream(callback=lambda result, error: self.answers.put(
            error if error is not None else result.as_numpy("text_output")[0]),
            headers={"x-api-key": self.key} if self.key else None)

    def send(self, model: str = stream_model.NAME, tokens: int = TOKENS) -> None:
        text = triton_grpc.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
        count = triton_grpc.InferInput("max_tokens", [1], "INT32")
        count.set_data_from_numpy(np.array([tokens], dtype=np.int32))
        self.client.async_stream_infer(model, [text, count])

    def take(self, count: int, timeout: float = 10) -> list[Any]:
        return [self.answers.get(timeout=timeout) for _ in range(count)]

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def _error(answer: Any) -> tuple[str, str]:
    assert isinstance(answer, InferenceServerException), answer
    return str(answer.status()), str(answer.message())


def _refusals(node: harness.Sitsmesh, code: str) -> float:
    return harness.metric_value(node.metrics(), "sitsmesh_stream_check_refusals_total",
                                code=code)


def test_each_message_is_checked_and_a_refused_one_ends_the_stream_with_its_reason(
        stack: Stack) -> None:
    tokens = [f" t{i}".encode() for i in range(TOKENS)]
    client = Client(stack.envoy, stack.key)
    try:
        for _ in range(3):  # each message is forwarded once it passed, and answered
            client.send()
            assert client.take(TOKENS) == tokens
        client.send(model="other-model")  # a model this stream did not start with
        status, message = _error(client.take(1)[0])
        assert status == "StatusCode.PERMISSION_DENIED", (status, message)
        assert "model_mixed" in message and "other-model" in message
    finally:
        client.close()
    assert _refusals(stack.node, "model_mixed") == 1
    assert harness.metric_value(stack.node.metrics(), "sitsmesh_stream_check_messages_total",
                                outcome="forwarded") == 3

    # A first message for a model the tenant may not call: nothing was answered yet.
    client = Client(stack.envoy, stack.key)
    try:
        client.send(model="forbidden-model")
        status, message = _error(client.take(1)[0])
        assert status == "StatusCode.PERMISSION_DENIED", (status, message)
        assert "model_not_allowed" in message and "forbidden-model" in message
    finally:
        client.close()

    # Without a key ext_authz refuses the stream at its start, before any message
    # (the client may learn it before it sends one).
    client = Client(stack.envoy, "")
    try:
        with contextlib.suppress(InferenceServerException):
            client.send()
        assert _error(client.take(1)[0])[0] == "StatusCode.UNAUTHENTICATED"
    finally:
        client.close()


def test_a_revoked_key_cuts_its_open_stream(stack: Stack) -> None:
    client = Client(stack.envoy, stack.key)
    try:
        client.send(tokens=400)  # 8 s of tokens at 20 ms each
        client.take(2)
        assert stack.node.cli("apikeys", "revoke", stack.key_id).returncode == 0
        revoked = time.monotonic()
        got = 0
        while not isinstance(answer := client.answers.get(timeout=10), Exception):
            got += 1
        cut_after = time.monotonic() - revoked
        print(f"\nstream cut {cut_after * 1000:.0f} ms after the revocation returned, "
              f"{got} tokens after it")
        # Cut long before the model had finished (400 tokens; 8 s).
        assert got < 200, got
        status, message = _error(answer)
        assert status in ("StatusCode.UNAUTHENTICATED", "StatusCode.INTERNAL"), message
    finally:
        client.close()
    assert _refusals(stack.node, "unauthenticated") == 1


# --- a client that stalls mid-message: raw HTTP/2 (no gRPC library sends half a message)


def _frame(model: str) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model)
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"hi")
    count = request.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    count.contents.int_contents.append(TOKENS)
    payload: bytes = request.SerializeToString()  # ModelStreamInfer takes ModelInferRequests
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def _stalled_stream(envoy: harness.Envoy, key: str, first: bytes, rest: bytes,
                    pause_s: float) -> tuple[dict[str, str], int]:
    """Send `first`, wait `pause_s`, send `rest` and end; returns the response's headers
    and trailers together, and the bytes of gRPC messages answered."""
    import h2.config
    import h2.connection
    import h2.events

    sock = socket.create_connection(("127.0.0.1", envoy.listen_port), timeout=10)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"),
                               (":authority", "127.0.0.1"), (":path", STREAM),
                               ("content-type", "application/grpc"), ("te", "trailers"),
                               ("x-api-key", key)])
    conn.send_data(stream, first)
    sock.sendall(conn.data_to_send())
    headers: dict[str, str] = {}
    answered, ended, sent_rest = 0, False, False
    deadline = time.monotonic() + 15
    resume = time.monotonic() + pause_s
    sock.settimeout(0.05)
    while not ended and time.monotonic() < deadline:
        if not sent_rest and time.monotonic() >= resume:
            sent_rest = True
            conn.send_data(stream, rest, end_stream=True)
            sock.sendall(conn.data_to_send())
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        if not data:
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                headers.update({k.decode(): v.decode() for k, v in event.headers})
            elif isinstance(event, h2.events.DataReceived):
                answered += len(event.data)
                conn.acknowledge_received_data(event.flow_controlled_length, stream)
            elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                ended = True
        sock.sendall(conn.data_to_send())
    sock.close()
    return headers, answered


@pytest.mark.parametrize("fail_mode", ["closed", "open"])
def test_a_message_stalled_past_the_deadline_follows_the_fail_mode(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh],
        triton: TritonServer, fail_mode: str) -> None:
    node = start_sitsmesh("--stream-check-deadline-seconds", "0.3",
                          "--stream-check-fail-mode", fail_mode)
    made = _stack(tmp_path, node, triton)
    try:
        frame = _frame(stream_model.NAME)
        # Half a message, then nothing for 1 s: over the 0.3 s deadline.
        headers, answered = _stalled_stream(made.envoy, made.key, frame[:9], frame[9:], 1.0)
        if fail_mode == "closed":
            assert headers.get("grpc-status") == "4", headers  # DEADLINE_EXCEEDED
            assert "check_deadline" in headers.get("grpc-message", ""), headers
            assert answered == 0
            assert _refusals(node, "check_deadline") == 1
        else:
            assert headers.get("grpc-status") == "0", headers
            assert answered > 0  # the model answered the message let through
            assert harness.metric_value(node.metrics(),
                                        "sitsmesh_stream_check_messages_total",
                                        outcome="unchecked") == 1
        # A message that arrives whole in time is checked and answered either way.
        headers, answered = _stalled_stream(made.envoy, made.key, frame[:9], frame[9:], 0.05)
        assert headers.get("grpc-status") == "0" and answered > 0, headers
    finally:
        made.envoy.kill()


def test_sitsmesh_gone_mid_stream_fails_the_stream_without_a_hang(stack: Stack) -> None:
    client = Client(stack.envoy, stack.key)
    try:
        client.send()
        assert len(client.take(TOKENS)) == TOKENS
        stack.node.kill()
        # failure_mode_allow false: no message goes on unchecked: Envoy ends the stream
        # when sitsmesh's side of it breaks (at once, or at the next message).
        with contextlib.suppress(InferenceServerException):
            client.send()
        answers = []
        while not isinstance(answer := client.answers.get(timeout=10), Exception):
            answers.append(answer)
        assert answers == []
        assert _error(answer)[0] in ("StatusCode.INTERNAL", "StatusCode.UNAVAILABLE")
    finally:
        client.close()


def test_a_frozen_sitsmesh_fails_the_stream_within_seconds(stack: Stack) -> None:
    """Envoy has no per-message timer for these streams; its keepalive pings (the
    bootstrap's connection_keepalive) close the connection to a sitsmesh that stopped
    answering, and the stream fails closed instead of waiting for it."""
    client = Client(stack.envoy, stack.key)
    try:
        client.send()
        assert len(client.take(TOKENS)) == TOKENS
        os.kill(stack.node.proc.pid, signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            with contextlib.suppress(InferenceServerException):
                client.send()
            answer = client.answers.get(timeout=15)
            waited = time.monotonic() - frozen
        finally:
            os.kill(stack.node.proc.pid, signal.SIGCONT)
        print(f"\nstream failed {waited:.2f} s after sitsmesh froze")
        assert isinstance(answer, InferenceServerException), answer
        assert _error(answer)[0] in ("StatusCode.INTERNAL", "StatusCode.UNAVAILABLE")
    finally:
        client.close()
