"""Decision telemetry as plain Python: counts and labels, the decision log's modes, sample,
rate bound and masking, and the scrape-time serving and SLA gauges."""

from __future__ import annotations

import json
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

from sitsmesh.app.metrics import ServingStates
from sitsmesh.authz.check import Allowed, CheckInput, Denied
from sitsmesh.chains.metrics import StageSlas
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.ratelimit.config import Rule
from sitsmesh.ratelimit.limiter import Decision, Descriptor, Status
from sitsmesh.status import Serving, StatusBoard
from sitsmesh.telemetry import decisionlog
from sitsmesh.telemetry.decisionlog import MASK, DecisionLog, masked
from sitsmesh.telemetry.decisions import AuthzMetrics, Telemetry
from tests.unit.test_authz import KEY, KEY_ID, _authorizer, _check

ALLOWED = Allowed("acme", 3, "bert", "infer", (), ())
SHED = Denied(429, "shed", "overloaded", 1.0, tenant="acme")


def _count(registry: CollectorRegistry, **labels: str) -> float:
    return registry.get_sample_value("sitsmesh_authz_decisions_total", labels) or 0.0


def test_decisions_are_counted_by_decision_reason_and_bounded_tenant() -> None:
    registry = CollectorRegistry()
    metrics = AuthzMetrics(registry, max_tenants=2)
    telemetry = Telemetry(metrics, None)
    for decision in (ALLOWED, ALLOWED, SHED, Denied(401, "unauthenticated", "no key"),
                     Allowed("beta", 1, "bert", "infer", (), ()),
                     Allowed("gamma", 1, "bert", "infer", (), ())):
        telemetry.check(CheckInput({}), decision, 0.0)
    telemetry.refused("too_many_headers", 0.0)
    assert _count(registry, decision="allow", reason="ok", tenant="acme") == 0  # not flushed
    telemetry.flush()
    assert _count(registry, decision="allow", reason="ok", tenant="acme") == 2
    assert _count(registry, decision="deny", reason="shed", tenant="acme") == 1
    assert _count(registry, decision="deny", reason="unauthenticated", tenant="none") == 1
    assert _count(registry, decision="deny", reason="too_many_headers", tenant="none") == 1
    # acme and beta took the two tenant labels; gamma counts as other.
    assert _count(registry, decision="allow", reason="ok", tenant="beta") == 1
    assert _count(registry, decision="allow", reason="ok", tenant="other") == 1
    assert registry.get_sample_value("sitsmesh_authz_check_seconds_count",
                                     {"decision": "deny"}) == 3
    assert registry.get_sample_value("sitsmesh_authz_check_seconds_count",
                                     {"decision": "allow"}) == 4


def test_denials_name_the_tenant_once_it_is_known_and_replies_stay_shared() -> None:
    a = _authorizer()
    wrong_model = _check(a, {"x-api-key": KEY}, "/v2/models/gpt/infer")
    control = _check(a, {"x-api-key": KEY}, "/v2/repository/index")
    anonymous = _check(a, {}, "/v2/repository/index")
    assert isinstance(wrong_model, Denied) and wrong_model.tenant == "acme"
    assert isinstance(control, Denied) and control.tenant == "acme"
    assert isinstance(anonymous, Denied) and anonymous.tenant == ""
    # The tenant is not part of the answer: one cached reply serves every tenant.
    assert control == Denied(control.status, control.code, control.message)
    assert hash(control) == hash(Denied(control.status, control.code, control.message))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def captured() -> Any:
    with structlog.testing.capture_logs() as logs:
        yield logs


def test_modes_sample_and_rate_bound(captured: list[dict[str, Any]]) -> None:
    clock = Clock()
    draws = iter([0.1, 0.9, 0.2, 0.3, 0.4, 0.6])
    log = DecisionLog("denials", sample=0.5, max_per_s=2, rand=lambda: next(draws),
                      clock=clock)
    assert not log.wants(False)                  # denials only
    assert log.wants(True)                       # 0.1 < 0.5
    assert not log.wants(True)                   # 0.9: not sampled
    assert log.wants(True)                       # 0.2: the second token
    assert not log.wants(True)                   # 0.3: sampled, but over 2 a second
    clock.now = 0.5                              # half a second: one token back
    assert log.wants(True)                       # 0.4
    log.flush()
    assert captured == [{"event": "decision log records over decision_log_max_per_s were "
                                  "dropped", "dropped": 1, "max_per_s": 2,
                         "log_level": "warning", "component": "sitsmesh.decisions"}]
    assert not DecisionLog("off").wants(True)
    assert DecisionLog("all").wants(False)
    with pytest.raises(ValueError, match="decision_log must be one of off, denials, all"):
        DecisionLog("some")


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("x-user", "alice", "alice"),
    ("x-api-key", "anything", MASK),                 # always masked by name
    ("x-custom", "x", MASK),                         # named in the mask setting
    ("x-session-id", "abc", MASK),                   # a credential-like name
    ("api_key", "abc", MASK),
    ("x-user", "smk_0123456789ab_" + "s" * 32, MASK),  # an sitsmesh key, by its shape
    ("x-user", "Bearer abc.def", MASK),
    ("x-user", "basic dXNlcjpwYXNz", MASK),
    ("x-user", "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0.", MASK),  # a JWT
    ("x-user", "a" * 300, "a" * 256),                # long values are cut
])
def test_masking(name: str, value: str, shown: str) -> None:
    assert masked(name, value, frozenset({"x-custom", "x-api-key"})) == shown


def test_records_hold_no_secret_and_name_the_key_by_id(captured: list[dict[str, Any]]) -> None:
    log = DecisionLog("all", headers=("x-api-key", "x-note", "X-Org"), mask=("x-org",),
                      pipeline_of=lambda model, tenant: f"p-{model}-{tenant}")
    request = CheckInput({"x-api-key": KEY, "x-note": "hello", "x-org": "s3cret"},
                         f"/v2/models/bert/infer?key={KEY}", b"", "spiffe://a/b", "rid-1")
    log.authz(request, ALLOWED, 0.00125)
    rule = Rule("d.user", 1, None, 60, name="per-user")
    log.ratelimit("d", [Descriptor((("user", KEY), ("tenant", "acme"))),
                        Descriptor((("user", "bob"),))],
                  Decision(True, [Status(True, rule, 0, 1.0), Status(False, rule, 1, 1.0)]),
                  0.0005, "")
    log.ratelimit("nowhere", [], None, 0.0, "unknown domain nowhere")
    log.flush()
    assert KEY not in json.dumps(captured) and "s3cret" not in json.dumps(captured)
    authz, limited, failed = captured
    assert authz == {
        "event": "decision", "kind": "authz", "request_id": "rid-1", "tenant": "acme",
        "latency_ms": 1.25, "path": "/v2/models/bert/infer", "decision": "allow",
        "reason": "ok", "status": 200, "model": "bert", "pipeline": "p-bert-acme", "priority": 3,
        "principal": "spiffe://a/b", "api_key_id": KEY_ID,
        "headers": {"x-api-key": MASK, "x-note": "hello", "x-org": MASK},
        "log_level": "info", "component": "sitsmesh.decisions"}
    assert limited["descriptors"] == [f"user={MASK},tenant=acme", "user=bob"]
    assert (limited["decision"], limited["reason"], limited["tenant"]) == (
        "over_limit", "per-user", "acme")
    assert (failed["decision"], failed["reason"]) == ("error", "unknown domain nowhere")


def test_serving_and_sla_gauges_are_read_at_scrape_time() -> None:
    board = StatusBoard()
    board.register("", "data", Serving.SERVING)
    board.register("envoy.service.auth.v3.Authorization", "data", Serving.NOT_SERVING)
    pipelines = {"p": Pipeline("p", (Stage("pre", "upstream_cluster", "pre", 50.0),
                                     Stage("model", "upstream_cluster", "m")))}
    registry = CollectorRegistry()
    registry.register(ServingStates(board))
    registry.register(StageSlas(lambda: pipelines))
    assert registry.get_sample_value("sitsmesh_serving", {"server": "data",
                                                          "service": ""}) == 1.0
    authz = {"server": "data", "service": "envoy.service.auth.v3.Authorization"}
    assert registry.get_sample_value("sitsmesh_serving", authz) == 0.0
    board.set("envoy.service.auth.v3.Authorization", Serving.SERVING)
    assert registry.get_sample_value("sitsmesh_serving", authz) == 1.0
    assert registry.get_sample_value("sitsmesh_stage_sla_seconds",
                                     {"pipeline": "p", "stage": "pre"}) == 0.05
    assert registry.get_sample_value("sitsmesh_stage_sla_seconds",
                                     {"pipeline": "p", "stage": "model"}) is None
    pipelines.clear()
    assert registry.get_sample_value("sitsmesh_stage_sla_seconds",
                                     {"pipeline": "p", "stage": "pre"}) is None


def test_module_keeps_its_mask_list_lowercase() -> None:
    assert all(name == name.lower() for name in decisionlog.ALWAYS_MASKED)
