"""ext_authz end to end: real Envoy with envoy.filters.http.ext_authz, real sitsmesh."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from sitsmesh.dev import harness

Start = Callable[..., harness.Sitsmesh]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict[str, object]:
        doc: dict[str, object] = json.loads(self.body)
        return doc


def _request(envoy: harness.Envoy, path: str, headers: dict[str, str] | None = None,
             body: bytes | None = None) -> Reply:
    req = urllib.request.Request(envoy.url(path), data=body, headers=headers or {},
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()},
                         resp.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, {k.lower(): v for k, v in err.headers.items()}, err.read())


@dataclass
class Stack:
    node: harness.Sitsmesh
    envoy: harness.Envoy
    key: str


def _setup_tenant(node: harness.Sitsmesh, *extra: str) -> str:
    created = node.cli("tenants", "create", "acme", "--models", "llama-*,bert",
                       "--priority", "3", "--max-priority", "5", *extra)
    assert created.returncode == 0, created.stderr
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    assert made.returncode == 0, made.stderr
    doc = json.loads(made.stdout)
    assert doc["key"].startswith("smk_") and doc["id"] in doc["key"]
    key: str = doc["key"]
    return key


@pytest.fixture
def stack(tmp_path: Path, start_sitsmesh: Start, upstream: int) -> Iterator[Stack]:
    node = start_sitsmesh("--admission-hold-seconds", "2", "--reload-interval-seconds", "0.2")
    key = _setup_tenant(node, "--max-concurrency", "2")
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream, fragments=["ext_authz"])
    yield Stack(node, envoy, key)
    envoy.kill()


INFER = "/v2/models/llama-3/infer"


def test_good_key_passes_and_upstream_sees_sits_headers(stack: Stack) -> None:
    reply = _request(stack.envoy, INFER, {"x-api-key": stack.key, "x-priority": "9",
                                          "x-sits-priority": "9", "x-sits-forged": "yes"},
                     body=b"{}")
    assert reply.status == 200, reply.body
    seen = reply.json()["headers"]
    assert isinstance(seen, dict)
    assert seen["x-sits-tenant"] == "acme"
    assert seen["x-sits-model"] == "llama-3"
    assert seen["x-sits-request-class"] == "infer"
    assert seen["x-sits-priority"] == "5", "asked for 9, capped at the tenant's max_priority"
    assert "x-sits-forged" not in seen, "client-sent x-sits-* headers are stripped"

    bearer = _request(stack.envoy, INFER, {"authorization": f"Bearer {stack.key}"}, b"{}")
    assert bearer.status == 200


def test_openai_body_names_the_model(stack: Stack) -> None:
    ok = _request(stack.envoy, "/v1/chat/completions",
                  {"x-api-key": stack.key, "content-type": "application/json"},
                  json.dumps({"model": "bert", "messages": []}).encode())
    assert ok.status == 200
    denied = _request(stack.envoy, "/v1/chat/completions",
                      {"x-api-key": stack.key, "content-type": "application/json"},
                      json.dumps({"model": "gpt-9"}).encode())
    assert denied.status == 403
    assert denied.json()["code"] == "model_not_allowed"


def test_no_key_bad_key_wrong_model(stack: Stack) -> None:
    none = _request(stack.envoy, INFER, body=b"{}")
    assert none.status == 401
    assert none.headers["www-authenticate"].startswith("Bearer")
    assert none.json()["code"] == "unauthenticated"
    bad = _request(stack.envoy, INFER, {"x-api-key": stack.key[:-2] + "xx"}, b"{}")
    assert bad.status == 401 and bad.json()["message"] == "invalid API key"
    wrong = _request(stack.envoy, "/v2/models/secret-model/infer", {"x-api-key": stack.key},
                     b"{}")
    assert wrong.status == 403
    assert "may not call model secret-model" in str(wrong.json()["message"])


def test_concurrency_cap_gives_429_with_retry_after(stack: Stack) -> None:
    # No access log is configured, so each admitted request holds its slot for the
    # 2 s hold time: the third request within it is over the cap of 2.
    codes = [_request(stack.envoy, INFER, {"x-api-key": stack.key}, b"{}") for _ in range(3)]
    assert [r.status for r in codes] == [200, 200, 429]
    over = codes[-1]
    assert over.headers["retry-after"] == "1"
    assert over.json()["retry_after_s"] == 1
    assert over.json()["code"] == "over_capacity"
    harness.wait_until(lambda: _request(stack.envoy, INFER, {"x-api-key": stack.key},
                                        b"{}").status == 200, 8, "the hold to expire")


def test_revoked_key_gets_401(stack: Stack) -> None:
    listed = stack.node.cli("apikeys", "list", "--tenant", "acme")
    assert listed.returncode == 0 and "active" in listed.stdout
    assert stack.key not in listed.stdout, "secrets are never listed"
    key_id = stack.key.split("_")[1]
    assert stack.node.cli("apikeys", "revoke", key_id).returncode == 0
    reply = _request(stack.envoy, INFER, {"x-api-key": stack.key}, b"{}")
    assert reply.status == 401 and reply.json()["message"] == "API key revoked"


def test_grpc_client_gets_grpc_status_through_envoy(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.envoy.listen_port}") as channel:
        infer: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as err:
            infer(b"\x0a\x07llama-3", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            infer(b"\x0a\x0csecret-model", metadata=(("x-api-key", stack.key),), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Over the tenant's cap of 2 (holds last 2 s): a shed gRPC call is
        # RESOURCE_EXHAUSTED, not the UNAVAILABLE that Envoy maps a bare 429 to.
        codes = []
        for _ in range(3):
            try:
                infer(b"\x0a\x07llama-3", metadata=(("x-api-key", stack.key),), timeout=5)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        assert codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED, codes


def test_sitsmesh_down_fails_closed_and_keys_survive_restart(
    tmp_path: Path, start_sitsmesh: Start, upstream: int
) -> None:
    node = start_sitsmesh(name="authz")
    key = _setup_tenant(node)
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream, fragments=["ext_authz"])
    try:
        assert _request(envoy, INFER, {"x-api-key": key}, b"{}").status == 200
        assert node.stop(signal.SIGKILL) != 0
        assert _request(envoy, INFER, {"x-api-key": key}, b"{}").status == 403
        again = start_sitsmesh(name="authz")
        assert again.state_dir == node.state_dir
        # Same data address as before? No: a new port. Point a new Envoy at it.
        envoy.kill()
        envoy = harness.start_envoy(tmp_path, again.data_addr, upstream,
                                    fragments=["ext_authz"])
        deadline = time.monotonic() + 10
        status = 0
        while time.monotonic() < deadline and status != 200:
            status = _request(envoy, INFER, {"x-api-key": key}, b"{}").status
            time.sleep(0.1)
        assert status == 200, "the key persisted across the restart"
    finally:
        envoy.kill()


def test_tcp_check_without_http_attributes_is_answered_from_the_peer(
    start_sitsmesh: Start,
) -> None:
    from envoy.service.auth.v3 import (
        attribute_context_pb2,
        external_auth_pb2,
        external_auth_pb2_grpc,
    )
    from google.rpc import code_pb2

    node = start_sitsmesh("--authz-peer-tenants", "spiffe://cluster.local/ns/a/sa/b=acme",
                          "--reload-interval-seconds", "0.2")
    _setup_tenant(node)

    def check(principal: str) -> int:
        request = external_auth_pb2.CheckRequest(attributes=attribute_context_pb2.AttributeContext(
            source=attribute_context_pb2.AttributeContext.Peer(principal=principal)))
        with grpc.insecure_channel(node.data_addr) as channel:
            reply = external_auth_pb2_grpc.AuthorizationStub(channel).Check(request, timeout=5)
        code: int = reply.status.code
        return code

    assert check("spiffe://cluster.local/ns/a/sa/b") == code_pb2.OK
    assert check("spiffe://cluster.local/ns/x/sa/y") == code_pb2.UNAUTHENTICATED
    assert check("") == code_pb2.UNAUTHENTICATED


def test_access_log_entry_ends_the_admission_hold(
    tmp_path: Path, start_sitsmesh: Start, upstream: int
) -> None:
    # A 60 s hold would block the second request for a minute; the access log that
    # Envoy sends when the first request ends releases the slot instead.
    node = start_sitsmesh("--admission-hold-seconds", "60", "--reload-interval-seconds", "0.2",
                          name="released")
    key = _setup_tenant(node, "--max-concurrency", "1")
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream,
                                fragments=["ext_authz", "access_log"])
    try:
        assert _request(envoy, INFER, {"x-api-key": key}, b"{}").status == 200
        harness.wait_until(lambda: _request(envoy, INFER, {"x-api-key": key},
                                            b"{}").status == 200, 5,
                           "the access-log entry to release the first request's slot")
    finally:
        envoy.kill()
