"""HTTP methods in the request-path policy (issue 26, item 6): inference routes take POST,
metadata and health GET and HEAD, gRPC POST; anything else is a 405 naming what the
route accepts. The setting that changes it per route family, and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from sitsmesh.authz import methods
from sitsmesh.authz.admission import Admission, AdmissionPolicy
from sitsmesh.authz.check import (
    Allowed,
    Authorizer,
    AuthzSettings,
    AuthzSnapshot,
    CheckInput,
    Denied,
)
from sitsmesh.authz.model import ApiKey, Tenant, digest, new_key
from sitsmesh.config import load_settings
from sitsmesh.errors import ConfigError

KEY_ID, KEY = new_key()


def _authorizer(**settings: object) -> Authorizer:
    snapshot = AuthzSnapshot({"acme": Tenant("acme", ("bert",))},
                             {KEY_ID: ApiKey(KEY_ID, "acme", digest(KEY), 0.0)})
    return Authorizer(snapshot, AuthzSettings(**settings),  # type: ignore[arg-type]
                      Admission(AdmissionPolicy(), hold_s=5), clock=lambda: 1.0)


def _check(a: Authorizer, method: str, path: str, body: bytes = b"",
           content_type: str = "") -> Allowed | Denied:
    headers = {"x-api-key": KEY}
    if content_type:
        headers["content-type"] = content_type
    return a.check(CheckInput(headers, path, body, method=method))


GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
FRAME = b"\x00\x00\x00\x00\x06\x0a\x04bert"
OPENAI = b'{"model": "bert"}'

ALLOWED = [
    ("POST", "/v2/models/bert/infer", b""),
    ("POST", "/v2/models/bert/generate_stream", b""),
    ("POST", "/v1/chat/completions", OPENAI),
    ("POST", "/v1/embeddings", OPENAI),
    ("GET", "/v2/models/bert", b""),
    ("HEAD", "/v2/models/bert/versions/1", b""),
    ("GET", "/v1/models/bert", b""),
    ("GET", "/v2", b""),
    ("GET", "/v2/health/ready", b""),
    ("HEAD", "/v2/health/live", b""),
    ("GET", "/v2/models/bert/ready", b""),
    ("POST", GRPC_INFER, FRAME),
    ("POST", "/inference.GRPCInferenceService/ServerReady", b""),
]


@pytest.mark.parametrize(("method", "path", "body"), ALLOWED,
                         ids=[f"{m} {p}" for m, p, _ in ALLOWED])
def test_each_route_takes_its_methods(method: str, path: str, body: bytes) -> None:
    assert isinstance(_check(_authorizer(), method, path, body), Allowed)


REFUSED = [
    # Issue 26: these passed before, DELETE /v1/models/m (OpenAI's delete-model) as metadata.
    ("DELETE", "/v1/models/bert", b"", "metadata", "GET, HEAD"),
    ("DELETE", "/v2/models/bert/infer", b"", "inference", "POST"),
    ("PUT", "/v2/models/bert/infer", b"", "inference", "POST"),
    ("PATCH", "/v1/chat/completions", OPENAI, "inference", "POST"),
    ("TRACE", "/v2/models/bert/generate", b"", "inference", "POST"),
    ("GET", "/v2/models/bert/infer", b"", "inference", "POST"),
    ("GET", "/v1/chat/completions", b"", "inference", "POST"),
    ("post", "/v2/models/bert/infer", b"", "inference", "POST"),  # methods are case-sensitive
    ("POST", "/v2/models/bert", b"", "metadata", "GET, HEAD"),
    ("DELETE", "/v2/models/bert/versions/2", b"", "metadata", "GET, HEAD"),
    ("PUT", "/v2/health/ready", b"", "health", "GET, HEAD"),
    ("POST", "/v2/models/bert/ready", b"", "health", "GET, HEAD"),
    ("OPTIONS", "/v2", b"", "metadata", "GET, HEAD"),
]


@pytest.mark.parametrize(("method", "path", "body", "family", "allow"), REFUSED,
                         ids=[f"{m} {p}" for m, p, *_ in REFUSED])
def test_other_methods_get_a_405_naming_what_the_route_accepts(
        method: str, path: str, body: bytes, family: str, allow: str) -> None:
    decision = _check(_authorizer(), method, path, body)
    assert isinstance(decision, Denied)
    assert (decision.status, decision.code, decision.allow) == (405, "method_not_allowed",
                                                                allow)
    assert decision.message == f"{family} routes accept {allow} only"
    assert decision.tenant == "acme" and not decision.grpc


def test_grpc_routes_are_post_only_and_answer_as_grpc() -> None:
    decision = _check(_authorizer(), "GET", GRPC_INFER, FRAME, "application/grpc")
    assert isinstance(decision, Denied)
    assert (decision.status, decision.allow, decision.grpc) == (405, "POST", True)
    health = _check(_authorizer(), "GET", "/inference.GRPCInferenceService/ServerLive")
    assert isinstance(health, Denied) and health.message == "grpc routes accept POST only"


def test_path_refusals_come_before_the_method() -> None:
    a = _authorizer()
    for path, code in (("/v2/repository/index", "control_api_not_allowed"),
                       ("/elsewhere", "route_not_allowed")):
        decision = _check(a, "DELETE", path)
        assert isinstance(decision, Denied) and decision.code == code


def test_a_method_is_refused_before_the_body_is_judged() -> None:
    # A GET on an OpenAI route has no body: 405, not "cannot determine the model".
    decision = _check(_authorizer(), "GET", "/v1/completions")
    assert isinstance(decision, Denied) and decision.status == 405


def test_open_paths_take_get_head_and_post_by_default() -> None:
    a = _authorizer(open_paths=frozenset({"/pipeline"}))
    for method in ("GET", "HEAD", "POST"):
        assert isinstance(_check(a, method, "/pipeline"), Allowed)
    decision = _check(a, "DELETE", "/pipeline")
    assert isinstance(decision, Denied) and decision.allow == "GET, HEAD, POST"


def test_a_check_without_a_method_is_judged_on_its_path_alone() -> None:
    # Envoy always sends one for HTTP; a direct caller could as well send any it likes.
    assert isinstance(_check(_authorizer(), "", "/v2/models/bert/infer"), Allowed)


def test_families_are_configurable() -> None:
    a = _authorizer(methods=methods.parse("inference=POST|PUT,open=DELETE"))
    assert isinstance(_check(a, "PUT", "/v2/models/bert/infer"), Allowed)
    assert isinstance(_check(a, "GET", "/v2/health/live"), Allowed)  # default kept
    decision = _check(a, "GET", "/v2/models/bert/infer")
    assert isinstance(decision, Denied) and decision.allow == "POST, PUT"


def test_the_setting_from_flag_env_and_file(tmp_path: Path) -> None:
    defaults = load_settings({}, env={}).authz_methods
    assert defaults == methods.DEFAULTS
    flag = load_settings({"authz_methods": "metadata=get|head|options"}, env={})
    assert flag.authz_methods["metadata"] == ("GET", "HEAD", "OPTIONS")
    assert flag.authz_methods["inference"] == ("POST",)
    env = load_settings({}, env={"SITSMESH_AUTHZ_METHODS": "health=GET"})
    assert env.authz_methods["health"] == ("GET",)
    config = tmp_path / "sitsmesh.yaml"
    config.write_text("authz_methods:\n  inference: [POST]\n  open: GET|POST\n")
    from_file = load_settings({"config": str(config)}, env={})
    assert from_file.authz_methods["open"] == ("GET", "POST")


@pytest.mark.parametrize(("raw", "message"), [
    ("inference=POST,everything=GET",
     "--authz-methods: unknown route family 'everything' (allowed: inference, metadata, "
     "health, open)"),
    ("inference=PSOT", "--authz-methods: inference: unknown HTTP method 'PSOT' (allowed: "
     "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE, CONNECT)"),
    ("metadata=", "--authz-methods: metadata: expected at least one HTTP method"),
    ("grpc=GET", "--authz-methods: grpc: gRPC calls are POST by protocol; the family "
     "cannot be configured"),
    ("inference", "--authz-methods: expected FAMILY=METHOD|METHOD, got 'inference'"),
])
def test_a_bad_setting_is_refused_precisely(raw: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings({"authz_methods": raw}, env={})
    assert str(err.value) == message


def test_a_bad_file_value_names_the_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "sitsmesh.yaml"
    config.write_text("authz_methods:\n  inference: [POST, 7]\n")
    with pytest.raises(ConfigError, match=r"sitsmesh.yaml: key 'authz_methods': inference: "
                                          r"expected a list of HTTP methods"):
        load_settings({"config": str(config)}, env={})
