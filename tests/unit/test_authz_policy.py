"""Request-path policy as plain Python (issue 13): admission counts every admit, routes
are denied by default after normalization, hints and JWT headers are trusted only
where configured."""

from __future__ import annotations

import pytest

from sitsmesh.authz.admission import Admission, AdmissionPolicy
from sitsmesh.authz.check import (
    Allowed,
    Authorizer,
    AuthzSettings,
    AuthzSnapshot,
    CheckInput,
    Denied,
)
from sitsmesh.authz.extract import normalize, open_path
from sitsmesh.authz.model import ApiKey, Tenant, digest, new_key
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.config import load_settings
from sitsmesh.errors import ConfigError
from sitsmesh.pressure.gate import PressureGate
from sitsmesh.pressure.signals import Signals

KEY_ID, KEY = new_key()
BERT_ONLY = Tenant("acme", ("bert",), max_concurrency=2)
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _frame(model: str) -> bytes:
    message = b"\x0a" + bytes([len(model)]) + model.encode()
    return b"\x00" + len(message).to_bytes(4, "big") + message


def _authorizer(clock: Clock | None = None, gate: PressureGate | None = None,
                **settings: object) -> Authorizer:
    admission = Admission(AdmissionPolicy({"acme": 2}), hold_s=5, clock=clock or Clock(),
                          gate=gate)
    snapshot = AuthzSnapshot({"acme": BERT_ONLY},
                             {KEY_ID: ApiKey(KEY_ID, "acme", digest(KEY), 0.0)})
    return Authorizer(snapshot, AuthzSettings(**settings),  # type: ignore[arg-type]
                      admission, clock=lambda: 1.0)


def _check(a: Authorizer, path: str, body: bytes = b"", request_id: str = "",
           headers: dict[str, str] | None = None) -> Allowed | Denied:
    return a.check(CheckInput({"x-api-key": KEY, **(headers or {})}, path, body,
                              request_id=request_id))


def test_checks_sharing_one_request_id_each_hold_a_slot() -> None:
    clock = Clock()
    a = _authorizer(clock)
    decisions = [_check(a, "/v2/models/bert/infer", request_id="same") for _ in range(20)]
    assert sum(isinstance(d, Allowed) for d in decisions) == 2
    assert a.admission.in_flight("acme") == 2
    # Each access-log entry for the id ends one of its holds, oldest first.
    assert a.admission.release("same") and a.admission.in_flight("acme") == 1
    assert isinstance(_check(a, "/v2/models/bert/infer", request_id="same"), Allowed)
    assert a.admission.held() == 2
    clock.now = 5.1
    assert a.admission.expire() == 2 and a.admission.held() == 0
    assert a.admission.in_flight("acme") == 0 and not a.admission.release("same")


def test_checks_without_a_request_id_are_held_until_their_timeout() -> None:
    clock = Clock()
    a = _authorizer(clock)
    decisions = [_check(a, "/v2/models/bert/infer") for _ in range(20)]
    assert sum(isinstance(d, Allowed) for d in decisions) == 2
    assert not a.admission.release(""), "no access-log entry can name an id-less request"
    clock.now = 4.9
    assert a.admission.expire() == 0
    clock.now = 5.0
    assert a.admission.expire() == 2 and a.admission.in_flight("acme") == 0


def test_holds_of_many_ids_interleave_and_expire_in_arrival_order() -> None:
    clock = Clock()
    admission = Admission(AdmissionPolicy({"t": 100}), hold_s=5, clock=clock)
    for i, request_id in enumerate(["a", "b", "a", "", "b", "a"]):
        clock.now = float(i)
        assert admission.admit("t", "", 0, "", request_id).admit
    assert admission.release("b") and admission.release("a")
    clock.now = 7.5  # the holds admitted at 0, 1 and 2 are due; 0 and 1 were released
    assert admission.expire() == 1 and admission.held() == 3
    assert admission.release("b") and admission.release("a") and not admission.release("a")
    clock.now = 100
    assert admission.expire() == 1 and admission.in_flight("t") == 0


@pytest.mark.parametrize(("raw", "normalized"), [
    ("/v2/models/bert/infer", "/v2/models/bert/infer"),
    ("/v2/models/secret/infer/", "/v2/models/secret/infer"),
    ("/v2/models/secret//infer", "/v2/models/secret/infer"),
    ("/v2/models/bert/../secret/./infer?x=1#f", "/v2/models/secret/infer"),
    ("/v2/models/%73ecret/%69nfer", "/v2/models/secret/infer"),
    ("/v2/models/a%2Fb/infer", "/v2/models/a/b/infer"),
    ("/../..", "/"),
    ("/v2/models/%zz/infer", ""),
    ("/v2/models/%ff/infer", ""),
    ("/v2/models/a\\b/infer", ""),
    ("/v2/models/a b/infer", ""),
    ("v2/models/bert/infer", ""),
    ("/v2/models/bert/infer\n", ""),
    ("/v2/models/bert%0a/infer", ""),
])
def test_paths_are_normalized_as_a_lenient_backend_would(raw: str, normalized: str) -> None:
    assert normalize(raw) == normalized


@pytest.mark.parametrize(("path", "body", "code"), [
    ("/v2/models/secret/infer/", b"", "model_not_allowed"),
    ("/v2/models/secret//infer", b"", "model_not_allowed"),
    ("/V2/Models/secret/INFER", b"", "model_not_allowed"),
    ("/v2/models/bert/%2e%2e/secret/infer", b"", "model_not_allowed"),
    ("/v2/models/secret/ready", b"", "model_not_allowed"),
    ("/v2/models/secret", b"", "model_not_allowed"),
    ("/v2/repository/models/bert/unload", b"", "control_api_not_allowed"),
    ("/v2/repository/index", b"", "control_api_not_allowed"),
    ("/v2/models/bert/config", b"", "control_api_not_allowed"),
    ("/v2/models/stats", b"", "control_api_not_allowed"),
    ("/v2/systemsharedmemory/region/x/register", b"", "control_api_not_allowed"),
    ("/inference.GRPCInferenceService/RepositoryModelUnload", b"", "control_api_not_allowed"),
    ("/inference.GRPCInferenceService/RepositoryModelLoad", b"", "control_api_not_allowed"),
    ("/inference.GRPCInferenceService/RepositoryIndex", b"", "control_api_not_allowed"),
    ("/inference.GRPCInferenceService/ModelConfig", _frame("bert"), "control_api_not_allowed"),
    (STREAM, _frame("secret"), "model_not_allowed"),
    (STREAM, _frame("bert") + _frame("secret"), "model_mixed"),
    (STREAM, _frame("bert")[:-1], "model_unknown"),
    ("/inference.GRPCInferenceService/ModelMetadata", _frame("secret"), "model_not_allowed"),
    ("/v1/chat/completions/", b'{"model": "secret"}', "model_not_allowed"),
    ("/v1/chat/completions", b'{"model": "secret", "model": "bert"}', "json_duplicate_key"),
    ("/v1/chat/completions", b'{"model": "bert", "stream": false, "stream": true}',
     "json_duplicate_key"),
    ("/v1/chat/completions", b'[{"model": "bert"}]', "model_unknown"),
    ("/v1/models", b"", "route_not_allowed"),
    ("/anything", b"", "route_not_allowed"),
    ("/", b"", "route_not_allowed"),
    ("/v2/models/bert/infer/x", b"", "route_not_allowed"),
    ("/v2/models/%zz/infer", b"", "path_invalid"),
])
def test_routes_are_denied_unless_known_and_allowed(path: str, body: bytes, code: str) -> None:
    denied = _check(_authorizer(), path, body)
    assert isinstance(denied, Denied), denied
    assert denied.code == code
    assert denied.status == (400 if code in ("path_invalid", "json_duplicate_key") else 403)


@pytest.mark.parametrize(("path", "body", "model", "request_class"), [
    ("/v2/models/bert/infer/", b"", "bert", "infer"),
    ("/v2/models/bert/versions/1/generate_stream", b"", "bert", "stream"),
    ("/v2/health/ready", b"", "", "metadata"),
    ("/v2/health/live", b"", "", "metadata"),
    ("/v2", b"", "", "metadata"),
    ("/v2/models/bert", b"", "bert", "metadata"),
    ("/v2/models/bert/versions/2/ready", b"", "bert", "metadata"),
    ("/v1/models/bert", b"", "bert", "metadata"),
    (STREAM, _frame("bert") + _frame("bert"), "bert", "grpc"),
    ("/inference.GRPCInferenceService/ModelInfer", _frame("bert"), "bert", "grpc"),
    ("/inference.GRPCInferenceService/ModelReady", _frame("bert"), "bert", "metadata"),
    ("/inference.GRPCInferenceService/ServerLive", b"", "", "metadata"),
    ("/v1/chat/completions/", b'{"model": "bert", "stream": true}', "bert", "stream"),
    # Only the top level, where model and stream are read, must be unambiguous.
    ("/v1/completions", b'{"model": "bert", "x": {"a": 1, "a": 2}}', "bert", "openai"),
])
def test_known_routes_are_allowed(path: str, body: bytes, model: str,
                                  request_class: str) -> None:
    a = _authorizer()
    allowed = _check(a, path, body, request_id="r")
    assert isinstance(allowed, Allowed), allowed
    assert (allowed.model, allowed.request_class) == (model, request_class)


def test_grpc_callers_get_grpc_status_on_refusals() -> None:
    denied = _check(_authorizer(), "/inference.GRPCInferenceService/RepositoryModelLoad",
                    headers={"content-type": "application/grpc"})
    assert isinstance(denied, Denied) and denied.grpc


def test_open_paths_are_allowed_without_a_model() -> None:
    a = _authorizer(open_paths=frozenset({"/pipeline"}))
    allowed = _check(a, "/pipeline/", request_id="r")
    assert isinstance(allowed, Allowed) and allowed.request_class == "other"
    denied = _check(a, "/pipeline/x")
    assert isinstance(denied, Denied) and denied.code == "route_not_allowed"


@pytest.mark.parametrize("bad", ["pipeline", "/a/", "/a//b", "/v2/x", "/v1/models",
                                 "/inference.GRPCInferenceService/X", "/v2", "/a?b"])
def test_open_paths_must_be_normalized_non_model_paths(bad: str) -> None:
    with pytest.raises(ValueError, match="an open path is a normalized path"):
        open_path(bad)
    with pytest.raises(ConfigError, match="--authz-open-paths"):
        load_settings({"authz_open_paths": f"/ok,{bad}"}, env={})


def test_policy_settings_parse() -> None:
    settings = load_settings({"authz_open_paths": "/pipeline, /classify",
                              "authz_trust_pipeline_hint": "true",
                              "authz_jwt_trusted_principals": "spiffe://a, spiffe://b"}, env={})
    assert settings.authz_open_paths == ("/pipeline", "/classify")
    assert settings.authz_trust_pipeline_hint is True
    assert settings.authz_jwt_trusted_principals == ("spiffe://a", "spiffe://b")
    defaults = load_settings({}, env={})
    assert defaults.authz_trust_pipeline_hint is False
    assert defaults.authz_jwt_trusted_principals == () and defaults.authz_open_paths == ()


def _gate() -> PressureGate:
    gate = PressureGate(Signals())
    stage = (Stage("model", "upstream_cluster", "triton"),)
    gate.set_pipelines({"demo": Pipeline("demo", stage, ("bert",)),
                        "side": Pipeline("side", stage, ("other",))})
    return gate


def test_pipeline_hint_is_ignored_unless_trusted_and_never_escapes_the_model() -> None:
    gate = _gate()
    a = _authorizer(gate=gate)
    for hint in ("side", "nonexistent"):
        assert isinstance(_check(a, "/v2/models/bert/infer", request_id=hint,
                                 headers={"x-sits-pipeline-hint": hint}), Allowed)
    assert gate.signals.pipeline("demo").in_flight == 2
    assert gate.signals.pipeline("side").in_flight == 0
    trusting = _authorizer(gate=_gate(), trust_pipeline_hint=True)
    assert trusting.admission.gate is not None
    for hint in ("side", "nonexistent"):
        _check(trusting, "/v2/models/bert/infer", request_id=hint,
               headers={"x-sits-pipeline-hint": hint})
    signals = trusting.admission.gate.signals
    assert signals.pipeline("side").in_flight == 1, "a known hint, trusted, picks the pipeline"
    assert signals.pipeline("demo").in_flight == 1, "an unknown one falls back to the model"


def test_metadata_calls_never_enter_a_pipeline() -> None:
    gate = _gate()
    a = _authorizer(gate=gate)
    assert isinstance(_check(a, "/v2/models/bert/ready", request_id="r"), Allowed)
    assert gate.signals.pipeline("demo").in_flight == 0
