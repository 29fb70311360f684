"""Per-message checks of a gRPC stream as plain Python (authz/streamcheck.py): which
bytes are forwarded however the body is cut, each refusal and its status, revocation
and policy changes mid-stream, the deadline's two fail modes, the settings' parsers;
and Check's part (a route that checks per message)."""

from __future__ import annotations

import dataclasses

import pytest
from google.rpc import code_pb2
from hypothesis import given
from hypothesis import strategies as st

from sitsmesh.authz.check import Allowed, Authorizer, AuthzSnapshot, CheckInput
from sitsmesh.authz.model import Tenant
from sitsmesh.authz.streamcheck import (
    MessageGate,
    StreamCheckSettings,
    parse_deadline,
    parse_methods,
)
from tests.streamframes import KEY, KEY_ID, PATH, acme_authorizer, frame_of


def _gate(authorizer: Authorizer | None = None, **settings: object) -> MessageGate:
    gate = MessageGate(authorizer or acme_authorizer(),
                       StreamCheckSettings(**settings),  # type: ignore[arg-type]
                       CheckInput({"x-api-key": KEY}, PATH), 1)
    assert gate.identify() is None
    return gate


def _feed(gate: MessageGate, body: bytes, cuts: list[int], now: float = 0.0) -> bytes:
    out, start = b"", 0
    for cut in [*sorted({c % (len(body) + 1) for c in cuts}), len(body)]:
        out += gate.feed(body[start:cut], now)
        start = cut
    return out


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_whole_messages_are_forwarded_however_the_body_is_cut(cuts: list[int]) -> None:
    body = frame_of("llama-3", 40) + frame_of("llama-3") + frame_of("llama-3", 300)
    gate = _gate()
    assert _feed(gate, body, cuts) == body
    assert gate.messages == 3 and gate.refusal is None and gate.pending_since is None


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_a_refused_message_and_all_after_it_are_never_forwarded(cuts: list[int]) -> None:
    allowed = frame_of("llama-3") + frame_of("llama-3", 20)
    gate = _gate()
    out = _feed(gate, allowed + frame_of("llama-4") + frame_of("llama-3"), cuts)
    assert out == allowed
    assert gate.refusal is not None and gate.refusal.code == "model_mixed"
    assert gate.refusal.status == code_pb2.PERMISSION_DENIED
    assert "message 3" in gate.refusal.message and "llama-4" in gate.refusal.message
    assert gate.feed(frame_of("llama-3"), 0.0) == b""  # the gate stays shut


@pytest.mark.parametrize(("body", "code", "status"), [
    (frame_of("bert"), "model_not_allowed", code_pb2.PERMISSION_DENIED),
    (b"\x00\x00\x00\x00\x02\x10\x01", "model_unknown", code_pb2.PERMISSION_DENIED),
    (b"\x01" + frame_of("llama-3")[1:], "message_compressed", code_pb2.INVALID_ARGUMENT),
    # The length prefix alone is enough to refuse: its body never has to arrive.
    (b"\x00\x00\x10\x00\x01", "message_too_large", code_pb2.RESOURCE_EXHAUSTED),
])
def test_each_refusal_has_its_code_and_status(body: bytes, code: str,
                                             status: int) -> None:
    gate = _gate(max_message_bytes=4096)
    assert gate.feed(body, 0.0) == b""
    assert gate.refusal is not None
    assert (gate.refusal.code, gate.refusal.status) == (code, status)


def test_a_revoked_key_or_a_narrowed_tenant_is_refused_mid_stream() -> None:
    authorizer = acme_authorizer()
    gate = _gate(authorizer)
    assert gate.feed(frame_of("llama-3"), 0.0)
    revoked = dataclasses.replace(authorizer.snapshot.keys[KEY_ID], revoked=True)
    authorizer.snapshot = AuthzSnapshot(authorizer.snapshot.tenants, {KEY_ID: revoked})
    refusal = gate.identify()  # what a directory change runs on every open stream
    assert refusal is not None and refusal.status == code_pb2.UNAUTHENTICATED
    assert refusal.message == "API key revoked"

    authorizer = acme_authorizer()
    gate = _gate(authorizer)
    assert gate.feed(frame_of("llama-3"), 0.0)
    authorizer.snapshot = AuthzSnapshot({"acme": Tenant("acme", ("bert",))},
                                        authorizer.snapshot.keys)
    assert gate.feed(frame_of("llama-3"), 0.0) == b""
    assert gate.refusal is not None and gate.refusal.code == "model_not_allowed"


def test_a_message_past_its_deadline_is_refused_when_failing_closed() -> None:
    gate = _gate(deadline_s=1.0)
    frame = frame_of("llama-3", 50)
    assert gate.feed(frame[:10], 5.0) == b""
    assert gate.pending_since == 5.0
    assert gate.overdue(5.5) == b"" and gate.refusal is None  # not yet
    assert gate.overdue(6.1) == b""
    assert gate.refusal is not None and gate.refusal.code == "check_deadline"
    assert gate.refusal.status == code_pb2.DEADLINE_EXCEEDED
    assert gate.feed(frame[10:], 6.2) == b""


def test_a_message_past_its_deadline_goes_through_unchecked_when_failing_open() -> None:
    gate = _gate(deadline_s=1.0, fail_open=True)
    frame = frame_of("llama-3", 50)
    assert gate.feed(frame[:10], 5.0) == b""
    assert gate.overdue(6.1) == frame[:10]
    # The rest of it passes; the messages after it are checked again.
    nxt, bad = frame_of("llama-3"), frame_of("bert")
    assert gate.feed(frame[10:] + nxt + bad, 6.2) == frame[10:] + nxt
    assert gate.refusal is not None and gate.refusal.code == "model_mixed"


def test_the_settings_parsers_refuse_what_cannot_be_checked() -> None:
    assert parse_methods(f"{PATH}=1,/pkg.S/Gen=3") == {PATH: 1, "/pkg.S/Gen": 3}
    assert parse_methods({PATH: 2}) == {PATH: 2}
    for bad, message in (("pkg.S/Gen=1", "a gRPC method path"), ("/pkg.S/Gen=x", "integer"),
                         ("/pkg.S/Gen=0", "not a protobuf field"), ("//Gen=1", "gRPC method")):
        with pytest.raises(ValueError, match=message):
            parse_methods(bad)
    assert parse_deadline("0.5") == 0.5
    for bad in ("0", "61", "soon"):
        with pytest.raises(ValueError):
            parse_deadline(bad)
    assert StreamCheckSettings().field_of(PATH) == 1
    assert StreamCheckSettings().field_of("/inference.GRPCInferenceService/ModelInfer") == 0


def test_check_lets_a_per_message_stream_start_without_its_body() -> None:
    authorizer = acme_authorizer()
    headers = {"x-api-key": KEY, "content-type": "application/grpc"}
    bare = authorizer.check(CheckInput(headers, PATH, method="POST"))
    assert not isinstance(bare, Allowed) and bare.code == "model_unknown"
    started = authorizer.check(CheckInput(headers, PATH, method="POST", per_message=True))
    assert isinstance(started, Allowed) and started.tenant == "acme"
    # The flag does not lift a body's check: a body that names a model is checked.
    body = frame_of("bert")
    named = authorizer.check(CheckInput(headers, PATH, body, method="POST", per_message=True))
    assert not isinstance(named, Allowed) and named.code == "model_not_allowed"
    # Nor does it open a method the stream checks do not check (its one message would
    # go unchecked), nor an HTTP route whose model is in its body.
    unary = authorizer.check(CheckInput(headers, "/inference.GRPCInferenceService/ModelInfer",
                                        method="POST", per_message=True))
    assert not isinstance(unary, Allowed) and unary.code == "model_unknown"
    http = authorizer.check(CheckInput({"x-api-key": KEY}, "/v1/chat/completions",
                                       method="POST", per_message=True))
    assert not isinstance(http, Allowed)
