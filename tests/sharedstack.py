"""Helpers for tests of replicas that share runtime state through Redis: start them on one
state store, ask them a Check, and find the controller's leader."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc

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
