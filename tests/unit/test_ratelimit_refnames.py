"""envoyproxy/ratelimit's Prometheus names: sanitising, the default mapper's key split, and
the scrape-time collector over sitsmesh's own families."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from sitsmesh.ratelimit import refnames
from sitsmesh.ratelimit.config import Algorithm, Rule, Unit
from sitsmesh.ratelimit.metrics import RuleMetrics
from sitsmesh.ratelimit.store import Count
from sitsmesh.transport.ratelimit import SERVICE_NAME


@pytest.mark.parametrize(("key", "sanitized"), [
    ("d.k_v", "d.k_v"),
    ("d.path_a:b|c", "d.path_a_b_c"),
    ("d.remote_address_10.0.0.1", "d.remote_address_10_0_0_1"),
    ("d.ip_192.168.1.20.port_80", "d.ip_192_168_1_20.port_80"),
    ("d.v_1.2.3", "d.v_1.2.3"),                       # three groups: not an address
    ("d.v_1234.5.6.7", "d.v_1234_5_6_7"),             # leftmost match starts at "234"
    ("d.v_10.0.0.1:8080", "d.v_10_0_0_1_8080"),
    ("d.v_\u0661\u0662.\u0661.\u0661.\u0661", "d.v_\u0661\u0662.\u0661.\u0661.\u0661"),
])
def test_sanitize_as_the_reference(key: str, sanitized: str) -> None:
    assert refnames.sanitize(key) == sanitized


@pytest.mark.parametrize(("key", "outcome", "name", "labels"), [
    ("d.k", "total_hits", "ratelimit_service_rate_limit_total_hits",
     {"domain": "d", "key1": "k"}),
    ("edge.remote_address_10.0.0.1", "over_limit", "ratelimit_service_rate_limit_over_limit",
     {"domain": "edge", "key1": "remote_address_10_0_0_1"}),
    ("d.k1_A.k2", "near_limit", "ratelimit_service_rate_limit_near_limit",
     {"domain": "d", "key1": "k1_A", "key2": "k2"}),
    # past the third part the mapper drops the rest
    ("d.a.b.c.e", "within_limit", "ratelimit_service_rate_limit_within_limit",
     {"domain": "d", "key1": "a", "key2": "b"}),
    ("d.k_a:b.user", "shadow_mode", "ratelimit_service_rate_limit_shadow_mode",
     {"domain": "d", "key1": "k_a_b", "key2": "user"}),
    # the mapper's regexes are unanchored and tried in order: a key part named like a
    # counter catches a later counter, as in the reference
    ("d.a.b.over_limit", "total_hits", "ratelimit_service_rate_limit_over_limit",
     {"domain": "d", "key1": "a", "key2": "b"}),
])
def test_reference_series_splits_the_sanitised_key(key: str, outcome: str, name: str,
                                                   labels: dict[str, str]) -> None:
    found = refnames.reference_series(key, outcome)
    assert found is not None
    assert (found[0], dict(found[1])) == (name, labels)


def test_a_key_of_one_part_is_unmapped() -> None:
    assert refnames.reference_series("overflow", "total_hits") is None


def _rule(stats_key: str, limit: int) -> Rule:
    return Rule(stats_key=stats_key, requests_per_unit=limit, unit=Unit.MINUTE,
                window_s=60, algorithm=Algorithm.FIXED_WINDOW)


def _source() -> CollectorRegistry:
    """sitsmesh's families after a known sequence: limit 10 on d.k, hits of 9 then 3."""
    registry = CollectorRegistry()
    metrics = RuleMetrics(registry)
    metrics.record(_rule("d.k", 10), 9, Count(False, 1, 1.0, 9))
    metrics.record(_rule("d.k", 10), 3, Count(True, 0, 1.0, 12))
    # two keys the mapper folds into one series: their counts add up
    metrics.record(_rule("d.a.b.x", 100), 1, Count(False, 99, 1.0, 1))
    metrics.record(_rule("d.a.b.y", 100), 2, Count(False, 97, 1.0, 2))
    metrics.global_shadow()
    metrics.flush()
    Counter("sitsmesh_ratelimit_config_loads_total", "loads", registry=registry).inc(2)
    Counter("sitsmesh_ratelimit_config_load_errors_total", "errors", registry=registry)
    handled = Counter("grpc_server_handled_total", "rpcs",
                      ["grpc_service", "grpc_method", "grpc_code", "grpc_type"],
                      registry=registry)
    handled.labels(SERVICE_NAME, "ShouldRateLimit", "OK", "unary").inc(5)
    handled.labels(SERVICE_NAME, "ShouldRateLimit", "INVALID_ARGUMENT", "unary").inc(2)
    handled.labels(SERVICE_NAME, "ShouldRateLimit", "PERMISSION_DENIED", "unary").inc(7)
    handled.labels("envoy.service.auth.v3.Authorization", "Check", "OK", "unary").inc(3)
    return registry


def _values(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in registry.collect() for s in family.samples}


def _get(values: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
         **labels: str) -> float | None:
    return values.get((name, frozenset(labels.items())))


def test_both_keeps_sitsmesh_names_and_adds_the_reference_ones() -> None:
    values = _values(refnames.exposed(_source(), "both"))
    assert _get(values, "sitsmesh_ratelimit_hits_total", key="d.k", outcome="total_hits") == 12
    rl = "ratelimit_service_rate_limit_"
    d_k = {"domain": "d", "key1": "k"}
    assert _get(values, rl + "total_hits", **d_k) == 12
    assert _get(values, rl + "within_limit", **d_k) == 9
    assert _get(values, rl + "near_limit", **d_k) == 1 + 1  # 9 - 8, then 10 - 9
    assert _get(values, rl + "over_limit", **d_k) == 2
    assert _get(values, rl + "shadow_mode", **d_k) is None  # never moved: not shown
    assert _get(values, rl + "total_hits", domain="d", key1="a", key2="b") == 3
    assert _get(values, "ratelimit_service_config_load_success") == 2
    assert _get(values, "ratelimit_service_config_load_error") is None
    assert _get(values, "ratelimit_service_global_shadow_mode") == 1
    assert _get(values, "ratelimit_service_should_rate_limit_error",
                err_type="service_error") == 2
    # every ShouldRateLimit answered, whatever its code
    assert _get(values, "ratelimit_service_total_requests", grpc_method="ShouldRateLimit") == 14


def test_envoyproxy_replaces_the_families_it_renames() -> None:
    values = _values(refnames.exposed(_source(), "envoyproxy"))
    names = {name for name, _ in values}
    assert not names & {"sitsmesh_ratelimit_hits_total", "sitsmesh_ratelimit_config_loads_total",
                        "sitsmesh_ratelimit_global_shadow_mode_total"}
    assert "grpc_server_handled_total" in names  # not a rate-limit family
    assert _get(values, "ratelimit_service_rate_limit_total_hits", domain="d", key1="k") == 12


def test_sitsmesh_serves_the_registry_unchanged() -> None:
    registry = _source()
    assert refnames.exposed(registry, "sitsmesh") is registry


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="ratelimit_metric_names must be one of"):
        refnames.exposed(CollectorRegistry(), "statsd")


def test_exposition_keeps_the_exact_names_in_both_formats() -> None:
    served = refnames.exposed(_source(), "envoyproxy")
    text = generate_latest(served).decode()
    assert "# TYPE ratelimit_service_rate_limit_total_hits untyped" in text
    assert 'ratelimit_service_rate_limit_total_hits{domain="d",key1="k"} 12.0' in text
    openmetrics = generate_openmetrics(served).decode()  # type: ignore[no-untyped-call]
    assert "# TYPE ratelimit_service_rate_limit_total_hits unknown" in openmetrics
    assert 'ratelimit_service_rate_limit_total_hits{domain="d",key1="k"} 12.0' in openmetrics
    assert "ratelimit_service_rate_limit_total_hits_total" not in openmetrics


def test_a_name_filter_still_finds_the_reference_families() -> None:
    served = refnames.exposed(_source(), "both")
    restricted = served.restricted_registry(["ratelimit_service_config_load_success"])
    assert [s.value for f in restricted.collect() for s in f.samples] == [2]


def test_redis_errors_come_from_the_store_tally() -> None:
    registry = CollectorRegistry()
    Counter("sitsmesh_ratelimit_store_errors_total", "errors", registry=registry).inc(4)
    values = _values(refnames.exposed(registry, "envoyproxy"))
    assert values == {("ratelimit_service_should_rate_limit_error",
                       frozenset({("err_type", "redis_error")})): 4}


def test_the_service_name_is_the_transport_one() -> None:
    assert refnames.RLS_SERVICE == SERVICE_NAME
