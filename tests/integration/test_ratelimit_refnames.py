"""/metrics of a real `sitsmesh serve` under each ratelimit_metric_names setting, after a
known sequence of ShouldRateLimit calls: envoyproxy/ratelimit's names, labels and amounts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from sitsmesh.dev import harness

Start = Callable[..., harness.Sitsmesh]
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]
OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT

# Hour windows: a window rolling over mid-test would reset the counts.
CONFIG = """
domain: rl
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: remote_address
    value: 10.0.0.1
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: k1
    value: A
    descriptors:
      - key: k2
        shadow_mode: true
        rate_limit: {unit: hour, requests_per_unit: 2}
  - key: free
    rate_limit: {unlimited: true}
"""
RL = "ratelimit_service_rate_limit_"
USER = {"domain": "rl", "key1": "user"}
ADDRESS = {"domain": "rl", "key1": "remote_address_10_0_0_1"}  # sanitised: no dots
NESTED = {"domain": "rl", "key1": "k1_A", "key2": "k2"}
# What the reference counts for the sequence in _traffic (limit 10: near threshold 8;
# limit 2: near threshold floor(1.6) = 1).
EXPECTED: list[tuple[str, dict[str, str], float]] = [
    # 9 (9 - 8 near), then 3 more crossing the limit (2 over, 10 - 9 near)
    (RL + "total_hits", USER, 12), (RL + "within_limit", USER, 9),
    (RL + "near_limit", USER, 2), (RL + "over_limit", USER, 2),
    (RL + "total_hits", ADDRESS, 1), (RL + "within_limit", ADDRESS, 1),
    # shadow rule, three single hits on a limit of 2: the third is over and shadowed
    (RL + "total_hits", NESTED, 3), (RL + "within_limit", NESTED, 2),
    (RL + "near_limit", NESTED, 1), (RL + "over_limit", NESTED, 1),
    (RL + "shadow_mode", NESTED, 1),
    ("ratelimit_service_should_rate_limit_error", {"err_type": "service_error"}, 1),
    ("ratelimit_service_total_requests", {"grpc_method": "ShouldRateLimit"}, 8),
]


def _desc(*pairs: str) -> ratelimit_pb2.RateLimitDescriptor:
    it = iter(pairs)
    return ratelimit_pb2.RateLimitDescriptor(entries=[
        ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v)
        for k, v in zip(it, it, strict=True)])


def _traffic(node: harness.Sitsmesh) -> None:
    # One channel: with --workers every call reaches the same worker and its counters.
    with grpc.insecure_channel(node.data_addr) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)

        def ask(*descs: ratelimit_pb2.RateLimitDescriptor, addend: int = 0,
                domain: str = "rl") -> int:
            reply = stub.ShouldRateLimit(rls_pb2.RateLimitRequest(
                domain=domain, descriptors=list(descs), hits_addend=addend), timeout=5)
            code: int = reply.overall_code
            return code

        assert ask(_desc("user", "u"), addend=9) == OK
        assert ask(_desc("user", "u"), addend=3) == OVER
        assert ask(_desc("remote_address", "10.0.0.1")) == OK
        assert [ask(_desc("k1", "A", "k2", "x")) for _ in range(3)] == [OK, OK, OK]
        assert ask(_desc("free", "x")) == OK
        with pytest.raises(grpc.RpcError) as failed:
            ask(_desc("user", "u"), domain="")
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _series(node: harness.Sitsmesh) -> Series:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(node.metrics())
            for s in family.samples}


def _get(series: Series, name: str, labels: dict[str, str]) -> float | None:
    return series.get((name, frozenset(labels.items())))


def _start(start: Start, tmp_path: Path, names: str, *extra: str) -> harness.Sitsmesh:
    config = tmp_path / "rl.yaml"
    config.write_text(CONFIG)
    return start("--ratelimit-config", str(config), "--ratelimit-metric-names", names, *extra)


def _settled(node: harness.Sitsmesh) -> Series:
    """The scrape once the flush task has moved the sequence's sums into the counters."""
    latest: list[Series] = [{}]

    def done() -> bool:
        latest[0] = _series(node)
        return _get(latest[0], "sitsmesh_ratelimit_hits_total",
                    {"key": "rl.k1_A.k2", "outcome": "shadow_mode"}) == 1 or _get(
            latest[0], RL + "shadow_mode", NESTED) == 1

    harness.wait_until(done, 10, "the rate-limit counters to be flushed", interval=0.2)
    return latest[0]


def _assert_reference(series: Series) -> None:
    for name, labels, value in EXPECTED:
        assert _get(series, name, labels) == value, (name, labels)
    # Unlimited descriptors count nothing; a counter that never moved is not shown.
    assert not [key for key in series if ("key1", "free") in key[1]]
    assert _get(series, RL + "over_limit", ADDRESS) is None
    assert _get(series, RL + "shadow_mode", USER) is None
    loads = _get(series, "ratelimit_service_config_load_success", {})
    assert loads is not None and loads >= 1
    assert _get(series, "ratelimit_service_config_load_error", {}) is None


@pytest.mark.parametrize("names", ["sitsmesh", "envoyproxy", "both"])
def test_metric_names_setting(start_sitsmesh: Start, tmp_path: Path, names: str) -> None:
    node = _start(start_sitsmesh, tmp_path, names)
    _traffic(node)
    series = _settled(node)
    reference = {name for name, _ in series if name.startswith("ratelimit_service_")}
    own = _get(series, "sitsmesh_ratelimit_hits_total",
               {"key": "rl.user", "outcome": "near_limit"})
    if names == "sitsmesh":
        assert not reference
        assert own == 2
    else:
        _assert_reference(series)
        assert _get(series, "ratelimit_service_config_load_success", {}) == 1
        assert own == (2 if names == "both" else None)
    # RPC and process series stay whatever the setting.
    assert any(name == "grpc_server_handled_total" for name, _ in series)
    assert node.stop() == 0


def test_reference_names_with_worker_processes(start_sitsmesh: Start, tmp_path: Path) -> None:
    # With --workers the supervisor's /metrics sums the workers' multiprocess files; the
    # reference names are built from that sum.
    node = _start(start_sitsmesh, tmp_path, "envoyproxy", "--workers", "2")
    _traffic(node)
    series = _settled(node)
    _assert_reference(series)
    assert not [name for name, _ in series if name.startswith("sitsmesh_ratelimit_hits")]
    assert node.stop() == 0


def test_no_config_loaded_is_a_service_error(start_sitsmesh: Start, tmp_path: Path) -> None:
    # As the reference: a config that does not load counts config_load_error, and until
    # one loads every call fails ("no rate limit configuration loaded") as service_error.
    bad = tmp_path / "bad.yaml"
    bad.write_text("domain: rl\ndescriptors:\n  - key: user\n    rate_limit: {unit: fortnight}\n")
    node = start_sitsmesh("--ratelimit-config", str(bad), "--ratelimit-metric-names",
                          "envoyproxy")
    with grpc.insecure_channel(node.data_addr) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as failed:
                stub.ShouldRateLimit(rls_pb2.RateLimitRequest(
                    domain="rl", descriptors=[_desc("user", "u")]), timeout=5)
            assert failed.value.code() == grpc.StatusCode.UNKNOWN
    error = ("ratelimit_service_should_rate_limit_error", {"err_type": "service_error"})
    harness.wait_until(lambda: _get(_series(node), *error) == 2, 10, "service_error 2")
    series = _series(node)
    assert _get(series, "ratelimit_service_total_requests",
                {"grpc_method": "ShouldRateLimit"}) == 2
    assert _get(series, "ratelimit_service_config_load_error", {}) == 1
    assert _get(series, "ratelimit_service_config_load_success", {}) is None
    assert node.stop() == 0
