"""A small OTLP/gRPC trace receiver for tests: the real TraceService/Export wire API
(opentelemetry-proto's stubs) on a free loopback port, keeping every span it gets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str       # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _value(value: common_pb2.AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, which) if which else None


def _attributes(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(ReceivedSpan(
                        span.name, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), span.kind, span.start_time_unix_nano,
                        span.end_time_unix_nano, span.status.code, span.status.message,
                        _attributes(span.attributes), resource))
        with self._lock:
            self.spans.extend(received)
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.name == name]


@contextmanager
def running(tls: tuple[Path, Path] | None = None) -> Iterator[tuple[Collector, str]]:
    """(the collector, its endpoint) while the block runs: http://127.0.0.1:PORT, or
    with `tls` (certificate chain, key PEM files) https://localhost:PORT."""
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        collector, server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
        endpoint = f"http://127.0.0.1:{port}"
    else:
        chain, key = (path.read_bytes() for path in tls)
        port = server.add_secure_port("127.0.0.1:0",
                                      grpc.ssl_server_credentials([(key, chain)]))
        endpoint = f"https://localhost:{port}"
    server.start()
    try:
        yield collector, endpoint
    finally:
        server.stop(0).wait(5)
