"""Two `sitsmesh serve` replicas with shared_runtime=redis on a real redis-server: a
request's hops and its end reach whichever replica, and both see the same chains and
free the hold wherever the Check was."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis as redis_py
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import code_pb2

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from sitsmesh.dev.redis import RedisServer, redis_server
from sitsmesh.dev.rediscluster import RedisClusterNodes
from sitsmesh.shared import hopbus
from tests.redisfixtures import (  # noqa: F401 - fixtures
    cluster_fixture,
    redis_cluster_fixture,
    shared_redis_fixture,
)
from tests.sharedstack import chain_report, check, replicas, timed_report

Start = Callable[..., harness.Sitsmesh]
PIPELINE = """\
name: trio
stages:
  - {name: pre, match: {upstream_cluster: pre}}
  - {name: feat, match: {upstream_cluster: feat}}
  - {name: model, match: {upstream_cluster: model}}
"""


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as server:
        yield server


def _pair(start: Start, tmp_path: Path, redis: RedisServer | RedisClusterNodes, shared: str
          ) -> tuple[harness.Sitsmesh, harness.Sitsmesh]:
    a, b = replicas(start, tmp_path / f"state-{shared}", redis.url,
                                "--admission-hold-seconds", "30", shared=shared,
                                names=(f"a-{shared}", f"b-{shared}"))
    return a, b


def _admin(node: harness.Sitsmesh) -> admin_pb2_grpc.AdminServiceStub:
    return admin_pb2_grpc.AdminServiceStub(grpc.insecure_channel(node.admin_addr))


def _report(node: harness.Sitsmesh, request_id: str, *stages: str) -> None:
    t0 = time.time()
    reports = []
    for n, stage in enumerate(stages):
        start, end = Timestamp(), Timestamp()
        start.FromNanoseconds(int((t0 + n * 0.01) * 1e9))
        end.FromNanoseconds(int((t0 + n * 0.01 + 0.005) * 1e9))
        reports.append(admin_pb2.ReportStageLatencyRequest(
            request_id=request_id, pipeline="trio", stage=stage, start=start, end=end))
    reply = _admin(node).ReportStageLatency(iter(reports), metadata=node.admin_metadata(),
                                            timeout=5)
    assert reply.accepted == len(stages)


def _chains(node: harness.Sitsmesh) -> tuple[int, int]:
    reply = _admin(node).GetLatencyChain(admin_pb2.GetLatencyChainRequest(pipeline="trio"),
                                         metadata=node.admin_metadata(), timeout=5).chain
    return reply.chains, reply.incomplete


def _apply_pipeline(a: harness.Sitsmesh, b: harness.Sitsmesh) -> None:
    _admin(a).ApplyPipeline(admin_pb2.ApplyPipelineRequest(yaml=PIPELINE),
                            metadata=a.admin_metadata(), timeout=5)
    harness.wait_until(lambda: len(_admin(b).ListPipelines(
        admin_pb2.ListPipelinesRequest(), metadata=b.admin_metadata(), timeout=5).pipelines)
        == 1, 5, "the pipeline on b")


def test_a_chain_reported_through_two_replicas_is_whole_on_both(
        start_sitsmesh: Start, tmp_path: Path,
        shared_redis: RedisServer | RedisClusterNodes) -> None:
    """On one redis-server and on a Redis Cluster: the bus, the lease and the
    controller's decision all reach it through --redis-url."""
    a, b = _pair(start_sitsmesh, tmp_path, shared_redis, "redis")
    _apply_pipeline(a, b)
    for n in range(5):
        _report(a, f"req-{n}", "pre")
        _report(b, f"req-{n}", "feat", "model")
    harness.wait_until(lambda: _chains(a)[0] == 5 and _chains(b)[0] == 5, 5,
                       "five whole chains on both replicas")
    assert _chains(a) == _chains(b) == (5, 0)


def test_without_shared_runtime_each_replica_sees_only_its_part(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    """The control: the same reports, each replica on its own, assemble nothing."""
    a, b = _pair(start_sitsmesh, tmp_path, redis, "off")
    _apply_pipeline(a, b)
    for n in range(5):
        _report(a, f"req-{n}", "pre")
        _report(b, f"req-{n}", "feat", "model")
    time.sleep(0.5)
    assert _chains(a)[0] == _chains(b)[0] == 0


def _access_log(node: harness.Sitsmesh, request_id: str) -> None:
    entry = accesslog_pb2.HTTPAccessLogEntry(
        request=accesslog_pb2.HTTPRequestProperties(request_id=request_id))
    entry.common_properties.start_time.GetCurrentTime()
    entry.common_properties.duration.FromMilliseconds(5)
    message = als_pb2.StreamAccessLogsMessage(
        http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=[entry]))
    with grpc.insecure_channel(node.data_addr) as channel:
        als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([message]), timeout=5)


def test_the_hold_of_a_check_ends_whichever_replica_gets_its_access_log(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    a, b = _pair(start_sitsmesh, tmp_path, redis, "redis")
    assert a.cli("tenants", "create", "acme", "--models", "bert", "--max-concurrency",
                 "1").returncode == 0
    made = a.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    key = json.loads(made.stdout)["key"]
    harness.wait_until(lambda: check(a, key, "probe-a") == code_pb2.OK, 5, "key on a")
    _access_log(a, "probe-a")
    harness.wait_until(lambda: check(a, key, "first") == code_pb2.OK, 5, "a slot on a")
    assert check(a, key, "second") == code_pb2.RESOURCE_EXHAUSTED
    _access_log(b, "first")  # the request ended; its entry reached the other replica
    harness.wait_until(lambda: check(a, key, "third") == code_pb2.OK, 2,
                       "the slot freed through b")


def _released_on_bus(redis: RedisServer) -> set[str]:
    """The request ids of the hold releases on the broadcast stream."""
    client = redis_py.Redis.from_url(redis.url)
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(  # type: ignore[assignment]
            hopbus.DEFAULT_KEY)
    finally:
        client.close()
    return {event[1] for _, fields in entries for event in json.loads(fields[b"b"])
            if event[0] == "r"}


def test_releases_go_to_the_other_replicas_only_while_one_holds_requests(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    """Every replica decodes every release on the bus: with no hold anywhere, none is
    sent. A hold's release still goes out, even from an entry that came before the
    hold's report did."""
    a, b = _pair(start_sitsmesh, tmp_path, redis, "redis")
    for n in range(20):
        _access_log(b, f"unheld-{n}")
    harness.wait_until(lambda: harness.metric_value(
        b.metrics(), "sitsmesh_hop_bus_releases_kept_total") >= 20, 5, "b keeps them")
    assert not _released_on_bus(redis) & {f"unheld-{n}" for n in range(20)}
    assert a.cli("tenants", "create", "acme", "--models", "bert", "--max-concurrency",
                 "1").returncode == 0
    key = json.loads(a.cli("apikeys", "create", "--tenant", "acme", "--output",
                           "json").stdout)["key"]
    harness.wait_until(lambda: check(a, key, "held") == code_pb2.OK, 5, "key on a")
    _access_log(b, "held")  # at once: a's report of its hold may not have reached b
    harness.wait_until(lambda: check(a, key, "after") == code_pb2.OK, 3,
                       "the slot freed through b")
    assert "held" in _released_on_bus(redis)


def test_redis_down_keeps_each_replica_right_on_its_own_and_sharing_resumes(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    a, b = _pair(start_sitsmesh, tmp_path, redis, "redis")
    _apply_pipeline(a, b)
    redis.kill()
    # What reaches a replica while the bus is down is applied there: a whole chain
    # reported through one replica is still assembled by it.
    _report(a, "alone", "pre", "feat", "model")
    harness.wait_until(lambda: _chains(a)[0] == 1, 5, "a assembles its own chain")
    assert '"hop bus publish failed; applying here only"' in a.output()
    redis.start()
    for n in range(3):
        _report(a, f"back-{n}", "pre")
        _report(b, f"back-{n}", "feat", "model")
    # Both report the fleet's chains, the one a assembled alone included: a shares its
    # tallies once Redis is back.
    harness.wait_until(lambda: _chains(a)[0] == 4 == _chains(b)[0], 10,
                       "sharing resumes once Redis is back")


def test_a_tenant_cap_counts_the_requests_held_on_every_replica(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    a, b = _pair(start_sitsmesh, tmp_path, redis, "redis")
    assert a.cli("tenants", "create", "acme", "--models", "bert", "--max-concurrency",
                 "2").returncode == 0
    key = json.loads(a.cli("apikeys", "create", "--tenant", "acme", "--output",
                           "json").stdout)["key"]
    harness.wait_until(lambda: check(b, key, "b-1") == code_pb2.OK, 5, "key and cap on b")
    assert check(a, key, "a-1") == code_pb2.OK
    # Two held, one on each replica: once each has the other's count (a report every
    # 0.1 s), the cap of 2 is reached on both.
    time.sleep(0.5)
    assert check(a, key, "a-probe") == code_pb2.RESOURCE_EXHAUSTED
    assert check(b, key, "b-probe") == code_pb2.RESOURCE_EXHAUSTED
    _access_log(b, "a-1")  # a's request ended; its entry reached b
    harness.wait_until(lambda: check(b, key, "b-2") == code_pb2.OK, 2, "a slot for b")
    time.sleep(0.5)
    assert check(a, key, "a-2") == code_pb2.RESOURCE_EXHAUSTED  # b's two count on a


def test_replicas_report_the_chains_one_process_reports_on_the_same_traffic(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    """The same requests, whole to one process and split over two sharing replicas: the
    same counts, the same per-stage and end-to-end quantiles, the same bottleneck."""
    a, b = _pair(start_sitsmesh, tmp_path, redis, "redis")
    single = start_sitsmesh("--reload-interval-seconds", "0.2", name="single")
    _apply_pipeline(a, b)
    _admin(single).ApplyPipeline(admin_pb2.ApplyPipelineRequest(yaml=PIPELINE),
                                 metadata=single.admin_metadata(), timeout=5)
    t0 = time.time()
    for n in range(40):
        pre, feat, model = 0.004 + n * 0.0001, 0.008, 0.02 + (n % 10) * 0.004
        spans = [("pre", 0.0, pre), ("feat", pre, feat), ("model", pre + feat, model)]
        at = t0 + n * 0.05
        timed_report(single, f"q{n}", at, spans)
        timed_report(a, f"q{n}", at, spans[:1])
        timed_report(b, f"q{n}", at, spans[1:])
    harness.wait_until(lambda: chain_report(a).chains == 40 == chain_report(b).chains,
                       5, "all chains on both replicas")
    one = chain_report(single)
    assert one.chains == 40
    for replica in (a, b):
        seen = chain_report(replica)
        assert (seen.chains, seen.incomplete, seen.bottleneck) == (
            one.chains, one.incomplete, one.bottleneck)
        assert (seen.e2e_p50_ms, seen.e2e_p99_ms) == (one.e2e_p50_ms, one.e2e_p99_ms)
        assert [(s.name, s.p50_ms, s.p99_ms) for s in seen.stages] == [
            (s.name, s.p50_ms, s.p99_ms) for s in one.stages]
