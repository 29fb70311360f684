"""Two `sitsmesh serve` replicas with shared_runtime=redis on a real redis-server: one
controller decides on both replicas' traffic, WatchPressure answers alike on either,
and when the leader dies the other takes over within a second."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.dev import harness
from sitsmesh.dev.redis import RedisServer, redis_server
from tests import sharedstack
from tests.sharedstack import check, replicas

Start = Callable[..., harness.Sitsmesh]
PIPELINE = """\
name: infer
models: [bert]
stages:
  - {name: model, match: {upstream_cluster: model}}
"""


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as server:
        yield server


def _replicas(start: Start, tmp_path: Path, redis: RedisServer) -> list[harness.Sitsmesh]:
    return replicas(start, tmp_path / "state", redis.url,
                                "--admission-hold-seconds", "60")


def _watch(node: harness.Sitsmesh) -> admin_pb2.PipelinePressure:
    return sharedstack.watch(node, "infer")


def _in_flight(node: harness.Sitsmesh) -> int:
    """-1 while the replica does not know the pipeline yet."""
    try:
        return _watch(node).in_flight
    except grpc.RpcError:
        return -1


def test_one_controller_sees_both_replicas_and_either_reports_it(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    a, b = _replicas(start_sitsmesh, tmp_path, redis)
    assert a.cli("tenants", "create", "acme", "--models", "bert").returncode == 0
    key = json.loads(a.cli("apikeys", "create", "--tenant", "acme", "--output",
                           "json").stdout)["key"]
    (tmp_path / "p.yaml").write_text(PIPELINE)
    assert a.cli("pipelines", "apply", str(tmp_path / "p.yaml")).returncode == 0
    harness.wait_until(lambda: _in_flight(a) == 0 and _in_flight(b) == 0, 5,
                       "the pipeline on both")
    harness.wait_until(lambda: check(b, key, "warm") == code_pb2.OK, 5, "the key on b")
    harness.wait_until(lambda: _in_flight(a) == 1 == _in_flight(b), 5, "b's hold on both")
    base = 1
    # Traffic through a only, held in flight (no access logs): both replicas' controller
    # input counts it, and whichever replica is asked reports the same.
    for n in range(60):
        assert check(a, key, f"r{n}") == code_pb2.OK
    harness.wait_until(lambda: _in_flight(a) == base + 60 and _in_flight(b) == base + 60, 5,
                       "the 60 held requests seen by both replicas")
    seen_a, seen_b = _watch(a), _watch(b)
    assert seen_a.arrival_rate > 0 and seen_b.arrival_rate > 0
    assert seen_a.fraction == seen_b.fraction
    assert sharedstack.leader([a, b]) in (a, b)  # exactly one of them leads


def test_the_other_replica_takes_over_within_a_second_when_the_leader_dies(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    nodes = _replicas(start_sitsmesh, tmp_path, redis)
    (tmp_path / "p.yaml").write_text(PIPELINE)
    assert nodes[0].cli("pipelines", "apply", str(tmp_path / "p.yaml")).returncode == 0
    harness.wait_until(lambda: all(_in_flight(n) == 0 for n in nodes), 5, "the pipeline")
    harness.wait_until(lambda: sum('"leading"' in n.output() for n in nodes) == 1, 5,
                       "one leader")
    leader = sharedstack.leader(nodes)
    survivor = next(n for n in nodes if n is not leader)
    assert leader.stop(signal.SIGKILL) != 0
    died = time.monotonic()
    harness.wait_until(lambda: '"leading"' in survivor.output(), 3, "the survivor leads")
    took = time.monotonic() - died
    # The lease lapses 0.6 s after its last renewal; the survivor tries every 0.2 s (and
    # the log line has to reach the file): within a second.
    assert took < 1.0, took
    assert _watch(survivor).pipeline == "infer"  # and answers WatchPressure as the leader


def test_an_envoys_stats_flush_reaches_every_replicas_controller(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    from sitsmesh.transport.metrics import StreamMetricsMessage

    a, b = _replicas(start_sitsmesh, tmp_path, redis)
    (tmp_path / "p.yaml").write_text(PIPELINE)
    assert a.cli("pipelines", "apply", str(tmp_path / "p.yaml")).returncode == 0
    harness.wait_until(lambda: _in_flight(a) == 0 == _in_flight(b), 5, "the pipeline")

    def envoy_age(node: harness.Sitsmesh) -> float:
        """-1 while no Envoy stats reached this replica's controller."""
        (stage,) = _watch(node).stages
        return next((s.age_s for s in stage.signals
                     if s.source == admin_pb2.SIGNAL_SOURCE_ENVOY_STATS), -1.0)

    assert envoy_age(b) == -1
    message = StreamMetricsMessage()
    message.identifier.node.id = "sidecar-1"
    family = message.envoy_metrics.add(name="cluster.model.upstream_rq_active")
    metric = family.metric.add(timestamp_ms=int(time.time() * 1000))
    metric.gauge.value = 3.0
    with grpc.insecure_channel(a.data_addr) as channel:  # the flush reaches a only
        stream: Any = channel.stream_unary(
            "/envoy.service.metrics.v3.MetricsService/StreamMetrics",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=lambda raw: raw)
        stream(iter([message]), timeout=5)
    harness.wait_until(lambda: envoy_age(b) >= 0, 5, "b's controller has the sample")


def test_workers_share_the_controller_chains_and_caps_through_redis(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    """--workers 2 with shared runtime state: what one process could not do alone (a
    pipeline, a tenant cap) is accepted, and the supervisor's admin API sees every
    worker's traffic."""
    node = start_sitsmesh("--workers", "2", "--redis-url", redis.url, "--shared-runtime",
                          "redis", "--reload-interval-seconds", "0.2",
                          "--admission-hold-seconds", "60")
    assert node.cli("tenants", "create", "acme", "--models", "bert", "--max-concurrency",
                    "30").returncode == 0
    key = json.loads(node.cli("apikeys", "create", "--tenant", "acme", "--output",
                              "json").stdout)["key"]
    (tmp_path / "p.yaml").write_text(PIPELINE)
    applied = node.cli("pipelines", "apply", str(tmp_path / "p.yaml"))
    assert applied.returncode == 0, applied.stderr
    harness.wait_until(lambda: _in_flight(node) == 0, 5, "the pipeline on the supervisor")
    time.sleep(0.5)  # the workers' catalogs follow the state store
    # Fresh connections: the kernel spreads them over both workers.
    codes = []
    for n in range(40):  # over several report ticks (0.1 s): overshoot stays a tick's worth
        codes.append(check(node, key, f"w{n}"))
        time.sleep(0.01)
    admitted = codes.count(code_pb2.OK)
    # The cap of 30 holds over both workers (a tick's overshoot at most).
    assert 30 <= admitted < 40, codes
    harness.wait_until(lambda: _in_flight(node) == admitted, 5,
                       "the supervisor sees every worker's holds")
