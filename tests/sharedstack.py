"""Helpers for tests of replicas that share runtime state through Redis: start them on one
state store, ask them a Check, report timed stage latencies and read the chain report,
and find the controller's leader."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from google.protobuf.timestamp_pb2 import Timestamp

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from sitsmesh.shared.partitions import PARTITIONS

Start = Callable[..., harness.Sitsmesh]


def replicas(start: Start, state: Path, redis_url: str, *extra: str, shared: str = "redis",
             names: tuple[str, ...] = ("a", "b")) -> list[harness.Sitsmesh]:
    """Replicas on one state store and one Redis, started one after the other: the first
    creates the admin token they share."""
    args = ("--redis-url", redis_url, "--shared-runtime", shared,
            "--reload-interval-seconds", "0.2", *extra)
    nodes = [start(*args, name=name, state_dir=state) for name in names]
    if shared == "redis":
        settled(*nodes)
    return nodes


def settled(*nodes: harness.Sitsmesh) -> None:
    """Wait until the replicas split the hop partitions among themselves: a chain whose
    hops straddle a move is counted incomplete on both sides."""
    def owned(node: harness.Sitsmesh) -> tuple[float, float]:
        text = node.metrics()
        return (harness.metric_value(text, "sitsmesh_hop_partitions_owned"),
                harness.metric_value(text, "sitsmesh_hop_partition_replicas"))

    def split() -> bool:
        seen = [owned(n) for n in nodes]
        return (sum(o for o, _ in seen) == PARTITIONS and all(o > 0 for o, _ in seen)
                and all(r == len(nodes) for _, r in seen))
    harness.wait_until(split, 10, "the hop partitions split over the replicas")


def check(node: harness.Sitsmesh, key: str, request_id: str) -> int:
    """A Check for the model bert with `key`, as Envoy sends it; its gRPC status code."""
    http = attribute_context_pb2.AttributeContext.HttpRequest(
        method="POST", path="/v2/models/bert/infer", id=request_id,
        headers={"x-api-key": key, "x-request-id": request_id})
    request = external_auth_pb2.CheckRequest(attributes=attribute_context_pb2.AttributeContext(
        request=attribute_context_pb2.AttributeContext.Request(http=http)))
    with grpc.insecure_channel(node.data_addr) as channel:
        reply = external_auth_pb2_grpc.AuthorizationStub(channel).Check(request, timeout=5)
    code: int = reply.status.code
    return code


def leader(nodes: list[harness.Sitsmesh]) -> harness.Sitsmesh:
    """The one replica whose log says it took the controller's lease."""
    leading = [n for n in nodes if '"leading"' in n.output()]
    assert len(leading) == 1, [n.output()[-2000:] for n in nodes]
    return leading[0]


def _admin(node: harness.Sitsmesh) -> admin_pb2_grpc.AdminServiceStub:
    return admin_pb2_grpc.AdminServiceStub(grpc.insecure_channel(node.admin_addr))


def watch(node: harness.Sitsmesh, pipeline: str) -> admin_pb2.PipelinePressure:
    """One WatchPressure snapshot of `pipeline` from `node`'s controller."""
    with grpc.insecure_channel(node.admin_addr) as channel:
        stream = admin_pb2_grpc.AdminServiceStub(channel).WatchPressure(
            admin_pb2.WatchPressureRequest(pipeline=pipeline, count=1),
            metadata=node.admin_metadata(), timeout=5)
        (snapshot,) = list(stream)
    (found,) = snapshot.pipelines
    return found


def chain_report(node: harness.Sitsmesh, pipeline: str = "trio") -> admin_pb2.LatencyChain:
    reply: admin_pb2.LatencyChain = _admin(node).GetLatencyChain(
        admin_pb2.GetLatencyChainRequest(pipeline=pipeline), metadata=node.admin_metadata(),
        timeout=5).chain
    return reply


def timed_report(node: harness.Sitsmesh, request_id: str, t0: float,
                 spans: list[tuple[str, float, float]], pipeline: str = "trio") -> None:
    """ReportStageLatency for one request: (stage, start after t0, seconds) each."""
    reports = []
    for stage, start, seconds in spans:
        begin, end = Timestamp(), Timestamp()
        begin.FromNanoseconds(int((t0 + start) * 1e9))
        end.FromNanoseconds(int((t0 + start + seconds) * 1e9))
        reports.append(admin_pb2.ReportStageLatencyRequest(
            request_id=request_id, pipeline=pipeline, stage=stage, start=begin, end=end))
    _admin(node).ReportStageLatency(iter(reports), metadata=node.admin_metadata(), timeout=5)
