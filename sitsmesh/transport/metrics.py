"""envoy.service.metrics.v3.MetricsService: Envoy's stats sink -> per-cluster queue samples.

Envoy's `envoy.stat_sinks.metrics_service` pushes every stat it keeps at each
stats flush, as Prometheus MetricFamily messages stamped with when Envoy took
them. Backpressure needs a handful: per cluster, requests active and pending
(the stage's queue as Envoy sees it), and completions and failures.

xds-protos ships no stubs for this service: its messages embed Prometheus'
client_model (io.prometheus.client), which xds-protos leaves out. Rather than
compile Envoy's or Prometheus' .proto files, the few fields read here are
declared with protobuf's own descriptor API (field numbers as published), so
the same upb runtime decodes them and every other field is skipped unparsed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from grpc import aio

from sitsmesh.errors import InvalidArgumentError
from sitsmesh.pressure.signals import EnvoySample
from sitsmesh.transport.errors import abort
from sitsmesh.transport.streams import OpenStreams

SERVICE_NAME = "envoy.service.metrics.v3.MetricsService"
_METHOD = "StreamMetrics"
GAUGES = {"upstream_rq_active": "active", "upstream_rq_pending_active": "pending"}
COMPLETED = "upstream_rq_completed"
FAILURES = ("upstream_rq_5xx", "upstream_rq_timeout", "upstream_rq_rx_reset",
            "upstream_rq_tx_reset", "upstream_rq_pending_overflow")
_WANTED = frozenset((*GAUGES, COMPLETED, *FAILURES))
CLUSTER_TAG = "envoy.cluster_name"   # the label with emit_tags_as_labels
MAX_CLUSTERS = 10_000                # clusters one message may report on


def _messages() -> tuple[Any, Any]:
    """(StreamMetricsMessage, StreamMetricsResponse) with only the fields read here."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="sitsmesh/envoy_metrics_subset.proto", package="sitsmesh.envoymetrics",
        syntax="proto2")
    f = descriptor_pb2.FieldDescriptorProto

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        added = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            field = added.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name

    opt, rep = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    pkg = ".sitsmesh.envoymetrics."
    message("LabelPair", ("name", 1, f.TYPE_STRING, opt, ""),
            ("value", 2, f.TYPE_STRING, opt, ""))
    message("Value", ("value", 1, f.TYPE_DOUBLE, opt, ""))
    message("Metric", ("label", 1, f.TYPE_MESSAGE, rep, pkg + "LabelPair"),
            ("gauge", 2, f.TYPE_MESSAGE, opt, pkg + "Value"),
            ("counter", 3, f.TYPE_MESSAGE, opt, pkg + "Value"),
            ("timestamp_ms", 6, f.TYPE_INT64, opt, ""))
    message("MetricFamily", ("name", 1, f.TYPE_STRING, opt, ""),
            ("metric", 4, f.TYPE_MESSAGE, rep, pkg + "Metric"))
    message("Node", ("id", 1, f.TYPE_STRING, opt, ""), ("cluster", 2, f.TYPE_STRING, opt, ""))
    message("Identifier", ("node", 1, f.TYPE_MESSAGE, opt, pkg + "Node"))
    message("StreamMetricsMessage", ("identifier", 1, f.TYPE_MESSAGE, opt, pkg + "Identifier"),
            ("envoy_metrics", 2, f.TYPE_MESSAGE, rep, pkg + "MetricFamily"))
    message("StreamMetricsResponse")
    pool: Any = descriptor_pool.DescriptorPool()  # its lookups are untyped in the stubs
    pool.Add(proto)
    return (message_factory.GetMessageClass(
                pool.FindMessageTypeByName("sitsmesh.envoymetrics.StreamMetricsMessage")),
            message_factory.GetMessageClass(
                pool.FindMessageTypeByName("sitsmesh.envoymetrics.StreamMetricsResponse")))


StreamMetricsMessage, StreamMetricsResponse = _messages()


def _cluster_and_stat(name: str, labels: Any) -> tuple[str, str] | None:
    """('cluster', 'stat') of a family we read: `cluster.NAME.STAT`, or with tags as
    labels `cluster.STAT` and the cluster in a label. Cluster names may hold dots.
    The subset is proto2, whose parser hands back non-UTF-8 strings as bytes: those name
    nothing Envoy sends, so they are skipped."""
    if type(name) is not str or not name.startswith("cluster."):
        return None
    head, _, stat = name.rpartition(".")
    if stat not in _WANTED:
        return None
    if head != "cluster":
        return head[len("cluster."):], stat
    for pair in labels:
        if pair.name == CLUSTER_TAG:
            value = pair.value
            return (value, stat) if type(value) is str else None
    return None


def samples_from(message: Any) -> dict[str, EnvoySample]:
    """Cluster -> its sample, from one StreamMetricsMessage. Times are wall-clock seconds."""
    found: dict[str, EnvoySample] = {}
    for family in message.envoy_metrics:
        for metric in family.metric:
            named = _cluster_and_stat(family.name, metric.label)
            if named is None:
                continue
            cluster, stat = named
            sample = found.get(cluster)
            if sample is None:
                if len(found) >= MAX_CLUSTERS:
                    continue
                sample = found[cluster] = EnvoySample(metric.timestamp_ms / 1000, 0.0, 0.0)
            if stat in GAUGES:
                setattr(sample, GAUGES[stat], metric.gauge.value)
            elif stat == COMPLETED:
                sample.completed = metric.counter.value
            else:
                sample.errors += metric.counter.value
    return found


class MetricsServicer:
    """One stream per Envoy; `on_samples(node, samples)` takes each flush's clusters."""

    def __init__(self, on_samples: Callable[[str, dict[str, EnvoySample]], None],
                 streams: OpenStreams | None = None) -> None:
        self._on_samples = on_samples
        self._streams = streams or OpenStreams()

    async def StreamMetrics(self, request_iterator: AsyncIterator[Any],
                            context: aio.ServicerContext[Any, Any]) -> Any:
        try:
            await self._streams.run(self._consume(request_iterator, context))
        except DecodeError:
            # grpc would answer UNKNOWN with an exception name; say what was wrong.
            await abort(context, InvalidArgumentError(
                "a StreamMetricsMessage could not be parsed"))
        return StreamMetricsResponse()

    async def _consume(self, request_iterator: AsyncIterator[Any],
                       context: aio.ServicerContext[Any, Any]) -> None:
        node = ""
        async for message in request_iterator:
            if message.HasField("identifier"):
                # Sent on the stream's first message only.
                node = message.identifier.node.id
                if type(node) is not str or not node:
                    node = context.peer()
            samples = samples_from(message)
            # Not kept while the next message is awaited: parsed, it is ~4x its bytes.
            del message
            if samples:
                self._on_samples(node or context.peer(), samples)


def add_to_server(servicer: MetricsServicer, server: aio.Server) -> None:
    handler = grpc.stream_unary_rpc_method_handler(
        servicer.StreamMetrics, request_deserializer=StreamMetricsMessage.FromString,
        response_serializer=StreamMetricsResponse.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {_METHOD: handler}),))
