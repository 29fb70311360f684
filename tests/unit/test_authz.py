"""The Check decision as plain Python: identity order, policy, admission, header hygiene."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sitsmesh.authz.admission import Admission, AdmissionPolicy
from sitsmesh.authz.check import (
    Allowed,
    Authorizer,
    AuthzSettings,
    AuthzSnapshot,
    CheckInput,
    Denied,
)
from sitsmesh.authz.extract import classify
from sitsmesh.authz.model import ApiKey, InvalidObject, Tenant, digest, new_key, tenant_from

NOW = 1_000_000.0
ACME = Tenant("acme", ("llama-*", "bert"), priority=2, max_priority=4, max_concurrency=1)
KEY_ID, KEY = new_key()
OLD_ID, OLD = new_key()
GONE_ID, GONE = new_key()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _authorizer(clock: Clock | None = None, **settings: object) -> Authorizer:
    keys = {
        KEY_ID: ApiKey(KEY_ID, "acme", digest(KEY), NOW - 10),
        OLD_ID: ApiKey(OLD_ID, "acme", digest(OLD), NOW - 10, expires_at=NOW - 1),
        GONE_ID: ApiKey(GONE_ID, "acme", digest(GONE), NOW - 10, revoked=True),
    }
    snapshot = AuthzSnapshot({"acme": ACME, "mesh": Tenant("mesh", ("*",))}, keys)
    admission = Admission(AdmissionPolicy({"acme": 1}), hold_s=5, clock=clock or Clock())
    return Authorizer(snapshot, AuthzSettings(**settings),  # type: ignore[arg-type]
                      admission, clock=lambda: NOW)


def _check(authorizer: Authorizer, headers: dict[str, str], path: str = "/v2/models/bert/infer",
           **kw: object) -> Allowed | Denied:
    return authorizer.check(CheckInput(headers, path, **kw))  # type: ignore[arg-type]


def test_api_key_in_either_header() -> None:
    a = _authorizer()
    ok = _check(a, {"x-api-key": KEY}, request_id="r1")
    assert isinstance(ok, Allowed) and ok.tenant == "acme" and ok.model == "bert"
    a.admission.release("r1")
    assert isinstance(_check(a, {"authorization": f"Bearer {KEY}"}), Allowed)


@pytest.mark.parametrize(("headers", "message"), [
    ({}, "no credentials"),
    ({"x-api-key": "nope"}, "invalid API key"),
    ({"x-api-key": KEY[:-1] + ("A" if KEY[-1] != "A" else "B")}, "invalid API key"),
    ({"x-api-key": OLD}, "API key expired"),
    ({"x-api-key": GONE}, "API key revoked"),
    ({"authorization": "Bearer some.user.jwt"}, "no credentials"),
    ({"authorization": f"Basic {KEY}"}, "no credentials"),
])
def test_unauthenticated(headers: dict[str, str], message: str) -> None:
    denied = _check(_authorizer(), headers)
    assert isinstance(denied, Denied) and denied.status == 401
    assert denied.message.startswith(message)


def test_mtls_peer_and_jwt_only_from_trusted_principals() -> None:
    gateway = "spiffe://c/ns/istio-system/sa/ingress"
    a = _authorizer(peer_tenants={"spiffe://c/ns/a/sa/b": "mesh"}, jwt_header="x-jwt",
                    jwt_trusted_principals=frozenset({gateway}))
    peer = _check(a, {}, principal="spiffe://c/ns/a/sa/b")
    assert isinstance(peer, Allowed) and peer.tenant == "mesh"
    payload = base64.urlsafe_b64encode(json.dumps({"tenant": "mesh"}).encode()).decode()
    from_gateway = _check(a, {"x-jwt": payload.rstrip("=")}, principal=gateway)
    assert isinstance(from_gateway, Allowed) and from_gateway.tenant == "mesh"
    # Any other workload of the mesh could write the header itself.
    from_workload = _check(a, {"x-jwt": payload}, principal="spiffe://c/ns/x/sa/y")
    assert isinstance(from_workload, Denied) and from_workload.status == 401
    outside = _check(a, {"x-jwt": payload})
    assert isinstance(outside, Denied) and outside.status == 401
    garbage = _check(a, {"x-jwt": "%%%"}, principal=gateway)
    assert isinstance(garbage, Denied) and garbage.status == 401
    # The tenant claim of a JWT Envoy verified itself (jwt_authn metadata) needs no peer.
    verified = _check(a, {}, jwt_tenant="mesh")
    assert isinstance(verified, Allowed) and verified.tenant == "mesh"
    unknown = _check(a, {}, jwt_tenant="nobody")
    assert isinstance(unknown, Denied) and unknown.message == "JWT names no known tenant"


def test_model_policy_priority_and_header_hygiene() -> None:
    a = _authorizer()
    denied = _check(a, {"x-api-key": KEY}, "/v2/models/gpt/versions/2/generate")
    assert isinstance(denied, Denied) and denied.status == 403
    ok = _check(a, {"x-api-key": KEY, "x-priority": "9", "x-sits-priority": "9",
                    "x-sits-evil": "1"}, "/v2/models/llama-7b/generate_stream")
    assert isinstance(ok, Allowed)
    assert ok.priority == 4 and ok.request_class == "stream"
    assert dict(ok.set_headers)["x-sits-priority"] == "4"
    assert ok.remove_headers == ("x-sits-evil",)


def test_concurrency_cap_holds_until_release_or_timeout() -> None:
    clock = Clock()
    a = _authorizer(clock)
    assert isinstance(_check(a, {"x-api-key": KEY}, request_id="a"), Allowed)
    over = _check(a, {"x-api-key": KEY}, request_id="b")
    assert isinstance(over, Denied) and over.status == 429 and over.retry_after_s == 1.0
    assert a.admission.release("a") and not a.admission.release("a")
    assert isinstance(_check(a, {"x-api-key": KEY}, request_id="c"), Allowed)
    clock.now = 4.9
    assert a.admission.expire() == 0
    clock.now = 5.1
    assert a.admission.expire() == 1 and a.admission.in_flight("acme") == 0


def test_tcp_check_uses_identity_only() -> None:
    a = _authorizer(peer_tenants={"spiffe://p": "mesh"})
    assert isinstance(_check(a, {}, "", principal="spiffe://p", http=False), Allowed)
    denied = _check(a, {}, "", http=False)
    assert isinstance(denied, Denied) and denied.status == 401


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/v2/models/m1/infer", b"", ("m1", "infer", False)),
    ("/v2/models/m1/versions/3/generate?x=1", b"", ("m1", "generate", False)),
    ("/v2/models/m1/ready", b"", ("m1", "metadata", False)),
    ("/inference.GRPCInferenceService/ModelInfer", b"\x00\x00\x00\x00\x05\x0a\x03abc",
     ("abc", "grpc", True)),
    ("/inference.GRPCInferenceService/ModelInfer", b"\x00\x00\x00\x00\x05\x0a\x09ab",
     ("", "grpc", True)),
    ("/v1/chat/completions", b'{"model": "x", "stream": true}', ("x", "stream", True)),
    ("/v1/completions", b"not json", ("", "openai", True)),
    ("/v1/embeddings", b'["model"]', ("", "openai", True)),
])
def test_model_extraction(path: str, body: bytes, expected: tuple[str, str, bool]) -> None:
    assert classify(path, body) == expected


def test_tenant_validation() -> None:
    with pytest.raises(InvalidObject, match="models must be a non-empty list"):
        tenant_from("t", {"models": []})
    with pytest.raises(InvalidObject, match="priority must be an integer from 0 to 9"):
        tenant_from("t", {"models": ["*"], "priority": 10})
    with pytest.raises(InvalidObject, match="tenant name 'Bad Name'"):
        tenant_from("Bad Name", {"models": ["*"]})
    assert tenant_from("t", {"models": ["*"], "priority": 5}).max_priority == 5


_text = st.text(max_size=300)
_headers = st.dictionaries(st.text(min_size=1, max_size=40).map(str.lower),
                           st.one_of(_text, st.text(min_size=5000, max_size=9000)),
                           max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers=_headers, path=st.one_of(_text, st.sampled_from([
    "/v2/models/bert/infer", "/inference.GRPCInferenceService/ModelInfer",
    "/v1/chat/completions", "/v2/models//infer", "/v2/models/%00/infer"])),
       body=st.binary(max_size=2000), principal=st.one_of(st.just(""), _text),
       http=st.booleans())
def test_random_requests_never_crash_and_never_admit_without_identity(
    headers: dict[str, str], path: str, body: bytes, principal: str, http: bool
) -> None:
    headers.pop("x-api-key", None)
    headers.pop("authorization", None)
    decision = _check(_authorizer(jwt_header="x-jwt"), headers, path, body=body,
                      principal=principal, http=http)
    assert isinstance(decision, Denied), "no key, no mapped peer: never admitted"
    assert decision.status in (401, 403)


@settings(max_examples=150, deadline=None)
@given(path=_text, body=st.binary(max_size=4000))
def test_model_extraction_never_crashes(path: str, body: bytes) -> None:
    model, request_class, _ = classify(path, body)
    assert isinstance(model, str) and len(model) <= 256
    assert request_class in {"infer", "generate", "stream", "grpc", "openai", "metadata",
                             "!invalid_path", "!control_api", "!unknown_route",
                             "!duplicate_key", "!mixed_models"}


def test_last_model_name_wins_in_grpc_bodies() -> None:
    # Protobuf (and so Triton) keeps the last model_name; the check must see the same.
    body = b"\x00\x00\x00\x00\x0c\x0a\x04bert\x0a\x04evil"
    assert classify("/inference.GRPCInferenceService/ModelInfer", body) == (
        "evil", "grpc", True)
    denied = _check(_authorizer(), {"x-api-key": KEY},
                    "/inference.GRPCInferenceService/ModelInfer", body=body)
    assert isinstance(denied, Denied) and denied.status == 403


@pytest.mark.parametrize(("headers", "body", "code"), [
    ({"x-envoy-auth-partial-body": "true"}, b'{"model": "bert", "messages": [', "body_too_large"),
    ({}, b'{"messages": []}', "model_unknown"),
    ({}, b"", "model_unknown"),
])
def test_body_models_that_cannot_be_verified_are_denied(
    headers: dict[str, str], body: bytes, code: str
) -> None:
    denied = _check(_authorizer(), {"x-api-key": KEY, **headers}, "/v1/chat/completions",
                    body=body)
    assert isinstance(denied, Denied) and denied.status == 403 and denied.code == code
