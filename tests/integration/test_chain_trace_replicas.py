"""Trace ids across replicas: the hop that carried the traceparent reaches one replica
(as Envoy's access-log entry), the rest of the chain another (stage reports); through the
hop bus on a real redis-server both replicas name the same trace for the slowest chains."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf.timestamp_pb2 import Timestamp

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from sitsmesh.dev.redis import RedisServer, redis_server
from tests.sharedstack import replicas

Start = Callable[..., harness.Sitsmesh]
PIPELINE = """\
name: duo
stages:
  - {name: edge, match: {upstream_cluster: edge}}
  - {name: model, match: {upstream_cluster: model}}
"""
# request id -> (edge hop ms, traceparent the edge Envoy logged)
REQUESTS = {
    "r-slow": (90, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    "r-bad": (70, "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"),
    "r-fast": (50, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
}


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as server:
        yield server


def _stamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _edge_entries(node: harness.Sitsmesh, t0: float) -> None:
    entries = []
    for rid, (ms, traceparent) in REQUESTS.items():
        entry = accesslog_pb2.HTTPAccessLogEntry(request=accesslog_pb2.HTTPRequestProperties(
            request_id=rid, request_headers={"traceparent": traceparent}))
        entry.common_properties.upstream_cluster = "edge"
        entry.common_properties.start_time.FromNanoseconds(int(t0 * 1e9))
        entry.common_properties.duration.FromMilliseconds(ms)
        entries.append(entry)
    message = als_pb2.StreamAccessLogsMessage(
        http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=entries))
    with grpc.insecure_channel(node.data_addr) as channel:
        als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([message]), timeout=5)


def _model_reports(node: harness.Sitsmesh, t0: float) -> None:
    reports = [admin_pb2.ReportStageLatencyRequest(request_id=rid, pipeline="duo", stage="model",
                                      start=_stamp(t0 + 0.002), end=_stamp(t0 + 0.012))
               for rid in REQUESTS]
    with grpc.insecure_channel(node.admin_addr) as channel:
        reply = admin_pb2_grpc.AdminServiceStub(channel).ReportStageLatency(
            iter(reports), metadata=node.admin_metadata(), timeout=5)
    assert reply.accepted == len(REQUESTS)


def _chain(node: harness.Sitsmesh) -> admin_pb2.LatencyChain:
    with grpc.insecure_channel(node.admin_addr) as channel:
        reply: admin_pb2.LatencyChain = admin_pb2_grpc.AdminServiceStub(channel).GetLatencyChain(
            admin_pb2.GetLatencyChainRequest(pipeline="duo"), metadata=node.admin_metadata(),
            timeout=5).chain
    return reply


def test_the_trace_id_crosses_the_hop_bus(start_sitsmesh: Start, tmp_path: Path,
                                          redis: RedisServer) -> None:
    a, b = replicas(start_sitsmesh, tmp_path / "state", redis.url)
    with grpc.insecure_channel(a.admin_addr) as channel:
        admin_pb2_grpc.AdminServiceStub(channel).ApplyPipeline(
            admin_pb2.ApplyPipelineRequest(yaml=PIPELINE), metadata=a.admin_metadata(),
            timeout=5)
    harness.wait_until(lambda: b.cli("pipelines", "list").stdout.split() == ["duo"], 5,
                       "the pipeline on b")
    t0 = time.time()
    _edge_entries(a, t0)
    _model_reports(b, t0)
    harness.wait_until(lambda: _chain(a).chains == 3 == _chain(b).chains, 5,
                       "three whole chains on both replicas")
    for node in (a, b):
        slowest = [(c.request_id, c.trace_id, round(c.e2e_ms)) for c in _chain(node).slowest]
        assert slowest == [("r-slow", "4bf92f3577b34da6a3ce929d0e0e4736", 90),
                           ("r-bad", "", 70),  # an all-zero parent id: no trace
                           ("r-fast", "0af7651916cd43dd8448eb211c80319c", 50)], node.admin_addr
