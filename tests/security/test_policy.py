"""Issue 13, request-path policy: each attack a probe found against `sitsmesh serve` with
its defaults, replayed through the real server (and real Envoy where the path matters).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from google.protobuf.struct_pb2 import Struct
from google.rpc import code_pb2

from sitsmesh.dev import harness

pytestmark = pytest.mark.integration

GATEWAY = "spiffe://cluster.local/ns/istio-system/sa/ingress"
WORKLOAD = "spiffe://cluster.local/ns/apps/sa/anything"


@dataclass
class Node:
    node: harness.Sitsmesh
    key: str   # tenant acme: model bert, at most 2 requests in flight
    free: str  # tenant free: model bert, no cap


def _start(tmp: Path) -> Node:
    # No access log reaches this sitsmesh: every admitted request holds its slot for
    # the whole 30 s hold, longer than any test here.
    node = harness.start_sitsmesh(tmp, "--admission-hold-seconds", "30",
                                  "--reload-interval-seconds", "0.2",
                                  "--authz-jwt-header", "x-jwt-payload",
                                  "--authz-jwt-trusted-principals", GATEWAY,
                                  "--authz-jwt-metadata-key", "jwt_payload")
    try:
        keys = []
        for args in (("acme", "--models", "bert", "--max-concurrency", "2"),
                     ("free", "--models", "bert"), ("other", "--models", "secret")):
            done = node.cli("tenants", "create", *args)
            assert done.returncode == 0, done.stderr
            made = node.cli("apikeys", "create", "--tenant", args[0], "--output", "json")
            assert made.returncode == 0, made.stderr
            keys.append(json.loads(made.stdout)["key"])
    except BaseException:
        node.kill()
        raise
    return Node(node, keys[0], keys[1])


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    started = _start(tmp_path)
    yield started
    started.node.kill()


@dataclass
class Stack:
    node: harness.Sitsmesh
    envoy: harness.Envoy
    key: str
    free: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    started = _start(tmp)
    try:
        with harness.echo_upstream() as port:
            envoy = harness.start_envoy(tmp, started.node.data_addr, port,
                                        fragments=["ext_authz"])
            try:
                yield Stack(started.node, envoy, started.key, started.free)
            finally:
                envoy.kill()
    finally:
        started.node.kill()


def _check(node: harness.Sitsmesh, *, headers: dict[str, str], path: str = "",
           principal: str = "", request_id: str = "",
           filter_metadata: dict[str, Struct] | None = None) -> int:
    http = attribute_context_pb2.AttributeContext.HttpRequest(
        method="POST", path=path or "/v2/models/bert/infer", headers=headers, id=request_id)
    request = external_auth_pb2.CheckRequest(attributes=attribute_context_pb2.AttributeContext(
        source=attribute_context_pb2.AttributeContext.Peer(principal=principal),
        request=attribute_context_pb2.AttributeContext.Request(http=http),
        metadata_context=base_pb2.Metadata(filter_metadata=filter_metadata or {})))
    with grpc.insecure_channel(node.data_addr) as channel:
        reply = external_auth_pb2_grpc.AuthorizationStub(channel).Check(request, timeout=5)
    code: int = reply.status.code
    return code


def _post(envoy: harness.Envoy, path: str, headers: dict[str, str],
          body: bytes = b"{}") -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(envoy.url(path), data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        # sitsmesh's denials are JSON; Envoy's own (jwt_authn) are plain text.
        return err.code, json.loads(raw) if raw.startswith(b"{") else {"text": raw.decode()}


def test_checks_sharing_one_request_id_do_not_bypass_the_concurrency_cap(node: Node) -> None:
    codes = [_check(node.node, headers={"x-api-key": node.key, "x-request-id": "same"})
             for _ in range(20)]
    assert codes.count(code_pb2.OK) == 2, codes
    assert codes[2:] == [code_pb2.RESOURCE_EXHAUSTED] * 18


def test_checks_without_a_request_id_do_not_bypass_the_concurrency_cap(node: Node) -> None:
    codes = [_check(node.node, headers={"x-api-key": node.key}) for _ in range(20)]
    assert codes.count(code_pb2.OK) == 2, codes


def test_a_client_chosen_request_id_through_envoy_does_not_bypass_the_cap(stack: Stack) -> None:
    # Envoy keeps the id of a request from a loopback (internal) client, as a gateway
    # with preserve_external_request_id or without use_remote_address would.
    statuses = [_post(stack.envoy, "/v2/models/bert/infer",
                      {"x-api-key": stack.key, "x-request-id": "chosen"})[0]
                for _ in range(20)]
    assert statuses.count(200) == 2, statuses
    assert set(statuses[2:]) == {429}


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/v2/repository/models/bert/unload", b"{}", 403, "control_api_not_allowed"),
    ("/v2/repository/index", b"{}", 403, "control_api_not_allowed"),
    ("/v2/models/secret/infer/", b"{}", 403, "model_not_allowed"),
    ("/v2/models/secret//infer", b"{}", 403, "model_not_allowed"),
    ("/v2/models/%73ecret/infer", b"{}", 403, "model_not_allowed"),
    ("/v2/models/bert/../secret/infer", b"{}", 403, "model_not_allowed"),
    ("/V2/MODELS/secret/INFER", b"{}", 403, "model_not_allowed"),
    ("/v1/chat/completions/", b'{"model": "secret"}', 403, "model_not_allowed"),
    ("/v1/chat/completions", b'{"model": "secret", "model": "bert"}', 400,
     "json_duplicate_key"),
    ("/somewhere/else", b"{}", 403, "route_not_allowed"),
])
def test_paths_outside_the_tenants_models_are_refused(
    stack: Stack, path: str, body: bytes, status: int, code: str
) -> None:
    got, doc = _post(stack.envoy, path, {"x-api-key": stack.free,
                                         "content-type": "application/json"}, body)
    assert (got, doc.get("code")) == (status, code), doc


def test_the_tenants_own_routes_still_pass(stack: Stack) -> None:
    for path, body in (("/v2/models/bert/infer/", b"{}"),
                       ("/v1/chat/completions/", b'{"model": "bert"}')):
        got, doc = _post(stack.envoy, path, {"x-api-key": stack.free}, body)
        assert got == 200, (path, doc)
    for path in ("/v2/health/ready", "/v2/models/bert/ready", "/v2/models/bert",
                 "/v1/models/bert"):
        assert _send(stack.envoy, "GET", path, {"x-api-key": stack.free})[0] == 200, path
        # The echo upstream has no HEAD (501): past ext_authz, which let it through.
        assert _send(stack.envoy, "HEAD", path, {"x-api-key": stack.free})[0] == 501, path


def _send(envoy: harness.Envoy, method: str, path: str, headers: dict[str, str],
          body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(envoy.url(path), data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


@pytest.mark.parametrize(("method", "path", "body", "allow"), [
    # Issue 26: each of these reached the backend (DELETE /v1/models/m, OpenAI's
    # delete-model call, as metadata).
    ("DELETE", "/v1/models/bert", None, "GET, HEAD"),
    ("DELETE", "/v2/models/bert/infer", None, "POST"),
    ("PUT", "/v2/models/bert/infer", b"{}", "POST"),
    ("PATCH", "/v1/chat/completions", b'{"model": "bert"}', "POST"),
    ("TRACE", "/v2/models/bert/generate", None, "POST"),
    ("GET", "/v2/models/bert/infer", None, "POST"),
    ("POST", "/v2/health/ready", b"", "GET, HEAD"),
])
def test_methods_a_route_does_not_take_are_refused_through_envoy(
    stack: Stack, method: str, path: str, body: bytes | None, allow: str
) -> None:
    status, headers, raw = _send(stack.envoy, method, path,
                                 {"x-api-key": stack.free, "content-type": "application/json"},
                                 body)
    assert status == 405, raw
    assert headers["allow"] == allow
    doc = json.loads(raw)
    assert doc["code"] == "method_not_allowed" and allow in doc["message"]


def test_jwt_payload_header_counts_only_from_trusted_principals(node: Node) -> None:
    payload = base64.urlsafe_b64encode(json.dumps({"tenant": "other"}).encode()).decode()
    headers = {"x-jwt-payload": payload.rstrip("="), "x-request-id": "j"}
    path = "/v2/models/secret/infer"
    assert _check(node.node, headers=headers, path=path,
                  principal=WORKLOAD) == code_pb2.UNAUTHENTICATED
    assert _check(node.node, headers=headers, path=path, principal=GATEWAY) == code_pb2.OK


def test_jwt_payload_verified_by_envoy_is_read_from_dynamic_metadata(node: Node) -> None:
    verified = Struct()
    verified.update({"jwt_payload": {"tenant": "other", "sub": "someone"}})
    metadata = {"envoy.filters.http.jwt_authn": verified}
    path = "/v2/models/secret/infer"
    assert _check(node.node, headers={"x-request-id": "m"}, path=path,
                  filter_metadata=metadata) == code_pb2.OK
    assert _check(node.node, headers={"x-request-id": "n"}, path=path,
                  filter_metadata={"some.other.filter": verified}) == code_pb2.UNAUTHENTICATED


PIPELINE = """name: demo
models: ["bert"]
stages:
  - name: model
    match: {upstream_cluster: upstream}
"""


def test_an_unknown_pipeline_hint_does_not_take_a_request_out_of_its_pipeline(
    tmp_path: Path, node: Node
) -> None:
    (tmp_path / "demo.yaml").write_text(PIPELINE)
    done = node.node.cli("pipelines", "apply", str(tmp_path / "demo.yaml"))
    assert done.returncode == 0, done.stderr
    harness.wait_until(lambda: node.node.pressure("demo").pipeline == "demo", 10,
                       "the pipeline's first decision")
    headers = {"x-api-key": node.key, "x-sits-pipeline-hint": "nonexistent"}
    codes = [_check(node.node, headers={**headers, "x-request-id": f"h{i}"})
             for i in range(2)]
    assert codes == [code_pb2.OK] * 2
    # Held in the pipeline, so its shedding applies to them.
    harness.wait_until(lambda: node.node.pressure("demo").in_flight == 2, 10,
                       "both requests to count in flight in pipeline demo")


def test_each_access_log_entry_releases_one_hold_of_its_id(node: Node) -> None:
    from envoy.data.accesslog.v3 import accesslog_pb2
    from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

    headers = {"x-api-key": node.key, "x-request-id": "shared"}
    assert [_check(node.node, headers=headers) for _ in range(3)] == [
        code_pb2.OK, code_pb2.OK, code_pb2.RESOURCE_EXHAUSTED]
    entry = accesslog_pb2.HTTPAccessLogEntry(
        request=accesslog_pb2.HTTPRequestProperties(request_id="shared"))
    entry.common_properties.start_time.GetCurrentTime()
    entry.common_properties.duration.FromMilliseconds(5)
    message = als_pb2.StreamAccessLogsMessage(
        http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=[entry]))
    with grpc.insecure_channel(node.node.data_addr) as channel:
        als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([message]), timeout=5)
    # One entry ended one of the two requests: one slot, not both, is free again.
    assert [_check(node.node, headers=headers) for _ in range(2)] == [
        code_pb2.OK, code_pb2.RESOURCE_EXHAUSTED]


def _hs256(secret: bytes, claims: dict[str, object]) -> str:
    import hashlib
    import hmac

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode().rstrip("=")

    signed = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k"}).encode()) + "." + \
        b64(json.dumps(claims).encode())
    return signed + "." + b64(hmac.new(secret, signed.encode(), hashlib.sha256).digest())


def test_envoy_jwt_authn_payload_reaches_check_as_metadata(tmp_path: Path, node: Node) -> None:
    """Real Envoy: jwt_authn verifies the token and puts its payload in dynamic metadata,
    ext_authz forwards that namespace, sitsmesh takes the tenant from it."""
    import time

    from sitsmesh.dev import envoyconf

    secret = b"0123456789abcdef0123456789abcdef"
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "k",
                      "k": base64.urlsafe_b64encode(secret).decode().rstrip("=")}]}
    jwt_authn = {"name": "envoy.filters.http.jwt_authn", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3."
                 "JwtAuthentication",
        "providers": {"test": {"issuer": "https://id.test",
                               "local_jwks": {"inline_string": json.dumps(jwks)},
                               "payload_in_metadata": "jwt_payload"}},
        "rules": [{"match": {"prefix": "/"}, "requires": {"provider_name": "test"}}]}}
    with harness.echo_upstream() as port:
        listen, admin = harness.free_port(), harness.free_port()
        config = envoyconf.render(harness.REPO / "filters" / "local" / "bootstrap.yaml",
                                  harness.envoy_values(node.node.data_addr, port, listen, admin),
                                  ["ext_authz"])
        filters = envoyconf.http_connection_manager(config)["http_filters"]
        ext_authz = next(f for f in filters if f["name"] == "envoy.filters.http.ext_authz")
        ext_authz["typed_config"]["metadata_context_namespaces"] = [jwt_authn["name"]]
        filters.insert(filters.index(ext_authz), jwt_authn)
        envoy = harness.launch_envoy(envoyconf.write(config, tmp_path / "envoy.yaml"), listen,
                                     admin, tmp_path / "envoy.log")
        try:
            claims = {"iss": "https://id.test", "exp": int(time.time()) + 600,
                      "tenant": "other"}
            token = _hs256(secret, claims)
            got, doc = _post(envoy, "/v2/models/secret/infer",
                             {"authorization": f"Bearer {token}"})
            assert got == 200, doc
            assert doc["headers"]["x-sits-tenant"] == "other"  # type: ignore[index]
            forged = _hs256(b"not the secret, not the secret!!", claims)
            got, _ = _post(envoy, "/v2/models/secret/infer", {"authorization": f"Bearer {forged}"})
            assert got == 401
        finally:
            envoy.kill()
