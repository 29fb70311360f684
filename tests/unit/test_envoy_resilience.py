"""The Envoy side of running several sitsmesh replicas (issue 15): the sitsmesh cluster
is health-checked over gRPC and has outlier detection, and ext_authz and ratelimit retry
a failed call on another replica, every try inside the filter's timeout.

The real-process proof is tests/integration/test_replicas_envoy.py; this pins the
settings it relies on, so that editing a fragment cannot quietly drop one.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sitsmesh.dev import envoyconf, harness

FILTERS = harness.REPO / "filters"
RETRY_ON = {"unavailable", "reset", "connect-failure"}

Doc = dict[str, Any]


def _seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration.removesuffix("s"))


def _rendered() -> Doc:
    values = harness.envoy_values("127.0.0.1:50051", 18080, 10000, 9901)
    return envoyconf.render(FILTERS / "local" / "bootstrap.yaml", values,
                            ["ext_authz", "ratelimit", "access_log", "metrics_service"])


def check_cluster(bootstrap: Doc) -> None:
    [cluster] = [c for c in bootstrap["static_resources"]["clusters"]
                 if c["name"] == "sitsmesh_data"]
    [check] = cluster["health_checks"]
    assert "grpc_health_check" in check
    assert _seconds(check["interval"]) <= 5, "a drained replica must leave within seconds"
    assert check["unhealthy_threshold"] >= 1 and check["healthy_threshold"] >= 1
    assert cluster.get("common_lb_config", {}).get("update_merge_window") == "0s", \
        "else workers keep choosing a draining replica for up to 1 s"
    outlier = cluster["outlier_detection"]
    assert outlier.get("consecutive_gateway_failure", 0) >= 1
    assert outlier.get("consecutive_5xx", 0) >= 1
    assert outlier.get("enforcing_consecutive_gateway_failure") == 100, \
        "Envoy enforces gateway-failure ejection 0% of the time by default"
    assert 0 < outlier["max_ejection_percent"] <= 50, "never eject a majority"
    [thresholds] = cluster["circuit_breakers"]["thresholds"]
    budget = thresholds["retry_budget"]
    # Every Check in flight on a lost replica is retried at once: Envoy's default of
    # 3 concurrent retries turned the rest into 403s.
    assert budget["budget_percent"]["value"] >= 50
    assert budget["min_retry_concurrency"] >= 16


def check_retries(grpc_service: Doc, filter_timeout: str) -> None:
    policy = grpc_service["retry_policy"]
    assert set(policy["retry_on"].split(",")) >= RETRY_ON
    assert policy["num_retries"] >= 1
    # Envoy's gRPC client uses the back-off's max_interval as the per-try timeout.
    per_try = _seconds(policy["retry_back_off"]["max_interval"])
    assert 0 < per_try < _seconds(filter_timeout)
    assert _seconds(policy["retry_back_off"]["base_interval"]) <= per_try
    predicates = [p["name"] for p in policy.get("retry_host_predicate", [])]
    assert "envoy.retry_host_predicates.previous_hosts" in predicates, \
        "a retry must go to another replica"


def _filters(bootstrap: Doc) -> dict[str, Doc]:
    hcm = envoyconf.http_connection_manager(bootstrap)
    return {f["name"]: f["typed_config"] for f in hcm["http_filters"]}


def check_filters(bootstrap: Doc) -> None:
    filters = _filters(bootstrap)
    authz = filters["envoy.filters.http.ext_authz"]["grpc_service"]
    check_retries(authz, authz["timeout"])
    ratelimit = filters["envoy.filters.http.ratelimit"]
    check_retries(ratelimit["rate_limit_service"]["grpc_service"], ratelimit["timeout"])


def test_sitsmesh_cluster_is_health_checked_and_ejects_failing_replicas() -> None:
    check_cluster(_rendered())


def test_ext_authz_and_ratelimit_retry_on_another_replica_within_their_timeout() -> None:
    check_filters(_rendered())


_AUTHZ = "envoy.filters.http.ext_authz"
_RL = "envoy.filters.http.ratelimit"
BREAKS: list[tuple[str, Any]] = [
    ("cluster", lambda c: c.pop("outlier_detection")),
    ("cluster", lambda c: c["outlier_detection"].pop("enforcing_consecutive_gateway_failure")),
    ("cluster", lambda c: c["outlier_detection"].update(max_ejection_percent=100)),
    ("cluster", lambda c: c["health_checks"][0].pop("grpc_health_check")),
    ("cluster", lambda c: c["health_checks"][0].update(interval="30s")),
    ("cluster", lambda c: c.pop("common_lb_config")),
    ("cluster", lambda c: c.pop("circuit_breakers")),
    ("cluster", lambda c: c["circuit_breakers"]["thresholds"][0]["retry_budget"].update(
        min_retry_concurrency=3)),
    (_AUTHZ, lambda f: f["grpc_service"].pop("retry_policy")),
    (_AUTHZ, lambda f: f["grpc_service"]["retry_policy"].update(retry_on="5xx")),
    (_AUTHZ, lambda f: f["grpc_service"]["retry_policy"].update(num_retries=0)),
    (_AUTHZ, lambda f: f["grpc_service"]["retry_policy"]["retry_back_off"].update(
        max_interval="1s")),
    (_AUTHZ, lambda f: f["grpc_service"]["retry_policy"].pop("retry_host_predicate")),
    (_RL, lambda f: f["rate_limit_service"]["grpc_service"].pop("retry_policy")),
    (_RL, lambda f: f.update(timeout="0.1s")),
]


@pytest.mark.parametrize(("where", "edit"), BREAKS, ids=[f"{w}-{i}" for i, (w, _) in
                                                         enumerate(BREAKS)])
def test_checks_reject_a_weakened_config(where: str, edit: Any) -> None:
    bootstrap = copy.deepcopy(_rendered())
    if where == "cluster":
        [target] = [c for c in bootstrap["static_resources"]["clusters"]
                    if c["name"] == "sitsmesh_data"]
    else:
        target = _filters(bootstrap)[where]
    edit(target)
    with pytest.raises((AssertionError, KeyError)):
        check_cluster(bootstrap)
        check_filters(bootstrap)
