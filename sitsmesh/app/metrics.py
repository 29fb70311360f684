"""Prometheus metrics of the process: one registry, per-RPC series for every server, and
the admin API's auth failures. Domain metrics live beside their domain."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from grpc import aio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from sitsmesh.status import Serving, StatusBoard
from sitsmesh.transport.budget import ByteBudget
from sitsmesh.transport.errors import Refused
from sitsmesh.transport.handlers import behaviour

# Sub-millisecond buckets: the request path answers in well under 1 ms.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
               0.25, 0.5, 1.0, 2.5, 5.0)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
# (request streaming, response streaming) -> the grpc_type label.
_TYPES = {(False, False): "unary", (False, True): "server_stream",
          (True, False): "client_stream", (True, True): "bidi_stream"}


def new_registry() -> CollectorRegistry:
    """Registry for this process. With worker processes it aggregates their files."""
    registry = CollectorRegistry(auto_describe=True)
    if os.environ.get(MULTIPROC_ENV):
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class LiveCollectors(CollectorRegistry):
    """Stands in for `registry` in multiprocess mode, where prometheus_client's own
    metrics reach it through the files: it passes on only the collectors read at scrape
    time (live state), so none is lost and no series is exported twice."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(auto_describe=True)
        self._registry = registry

    def register(self, collector: Collector) -> None:
        if not isinstance(collector, MetricWrapperBase):
            self._registry.register(collector)

    def unregister(self, collector: Collector) -> None:
        if not isinstance(collector, MetricWrapperBase):
            self._registry.unregister(collector)


def admin_auth_failures(registry: CollectorRegistry | None) -> Counter:
    return Counter("sitsmesh_admin_auth_failures_total",
                   "Admin calls rejected for a missing or wrong bearer token.",
                   registry=registry)


class ServingStates(Collector):
    """`sitsmesh_serving{server,service}`: 1 while a health service answers SERVING, 0
    while NOT_SERVING or DRAINING (service "" is the whole server), read at scrape time."""

    def __init__(self, board: StatusBoard) -> None:
        self._board = board

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("sitsmesh_serving",
                                   "1 while the health service answers SERVING, else 0.",
                                   labels=["server", "service"])
        for service in self._board.services():
            family.add_metric([service.server, service.name],
                              1.0 if service.state is Serving.SERVING else 0.0)
        yield family


class BudgetMetrics(Collector):
    """The in-flight byte budget (sitsmesh/transport/budget.py), read at scrape time."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget

    def collect(self) -> Iterator[Metric]:
        budget = self._budget
        for name, text, value in (
            ("sitsmesh_inflight_bytes", "Request bytes held in flight now.", budget.held),
            ("sitsmesh_inflight_peak_bytes", "Most request bytes held in flight at once.",
             budget.peak),
            ("sitsmesh_inflight_capacity_bytes", "The in-flight byte budget.",
             budget.capacity),
        ):
            yield GaugeMetricFamily(name, text, value=float(value))
        yield CounterMetricFamily("sitsmesh_inflight_refused",
                                  "Requests and streams refused by the in-flight budget or "
                                  "the large-message rate.", value=float(budget.refused))


class RpcMetrics:
    """Counters and latency histograms for every RPC a server handles, under the names and
    labels gRPC dashboards already query (go-grpc-prometheus, grpc-ecosystem's Python
    interceptors): the data and admin servers' methods differ by `grpc_service`."""

    __slots__ = ("_handled", "_latency")

    def __init__(self, registry: CollectorRegistry | None) -> None:
        # registry None: values only go to the multiprocess files (worker processes).
        self._handled = Counter(
            "grpc_server_handled_total", "RPCs completed on the server, by method and code.",
            ["grpc_service", "grpc_method", "grpc_code", "grpc_type"], registry=registry,
        )
        self._latency = Histogram(
            "grpc_server_handling_seconds",
            "Time to handle an RPC, until its last message (sub-millisecond buckets).",
            ["grpc_service", "grpc_method", "grpc_type"], buckets=RPC_BUCKETS,
            registry=registry,
        )

    def interceptor(self) -> aio.ServerInterceptor:
        return _MetricsInterceptor(self._handled, self._latency)

    def registrar(self, server: aio.Server) -> InstrumentedRegistrar:
        """Register services through this and each handler is wrapped once, at startup.

        An interceptor costs an extra coroutine on every call (about 10 % of the
        data plane's throughput, measured); wrapping at registration costs nothing
        per call beyond the metrics themselves.
        """
        return InstrumentedRegistrar(server, _MetricsInterceptor(self._handled, self._latency))


class InstrumentedRegistrar:
    """Stands in for an aio.Server while services register; wraps what they add."""

    def __init__(self, server: aio.Server, wrapper: _MetricsInterceptor) -> None:
        self._server = server
        self._wrapper = wrapper

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_InstrumentedGeneric(h, self._wrapper) for h in handlers))

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self._server.add_registered_method_handlers(
            service, {name: self._wrapper.wrapped(f"/{service}/{name}", handler)
                      for name, handler in handlers.items()})


class _InstrumentedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, wrapper: _MetricsInterceptor) -> None:
        self._inner = inner
        self._wrapper = wrapper

    def service(self, handler_call_details: grpc.HandlerCallDetails
                ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        return self._wrapper.wrapped(handler_call_details.method, handler)


class _MetricsInterceptor(aio.ServerInterceptor):
    """Wraps each method handler once and caches it, so per-call work is two dict lookups."""

    def __init__(self, handled: Counter, latency: Histogram) -> None:
        self._handled = handled
        self._latency = latency
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails],
                               Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        method: str = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None:
            return cached
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return self.wrapped(method, handler)

    def wrapped(self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
                ) -> grpc.RpcMethodHandler[Any, Any]:
        """The instrumented handler for `method`, built once."""
        cached = self._wrapped.get(method)
        if cached is None:
            cached = self._wrapped[method] = self._wrap(method, handler)
        return cached

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
              ) -> grpc.RpcMethodHandler[Any, Any]:
        service, _, name = method.lstrip("/").rpartition("/")
        kind = _TYPES[handler.request_streaming, handler.response_streaming]
        observe = self._latency.labels(service, name, kind).observe
        counters: dict[Any, Any] = {}

        def finish(context: Any, start: float, failed: bool) -> None:
            observe(time.perf_counter() - start)
            code = context.code()
            if code is None:
                code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
            child = counters.get(code)
            if child is None:
                status = code if isinstance(code, grpc.StatusCode) else _CODES_BY_VALUE.get(
                    code, grpc.StatusCode.UNKNOWN)
                child = counters[code] = self._handled.labels(service, name, status.name, kind)
            child.inc()

        inner, factory = behaviour(handler)
        if inspect.isasyncgenfunction(inner):
            async def gen_behavior(request: Any, context: Any) -> Any:
                start = time.perf_counter()
                failed = True
                try:
                    async for item in inner(request, context):
                        yield item
                    failed = False
                except Refused:  # the status is set: ending the stream sends it
                    failed = False
                finally:
                    finish(context, start, failed)

            return factory(gen_behavior, handler.request_deserializer,
                           handler.response_serializer)

        # Unary responses, and streams answered through context.write().
        async def behavior(request: Any, context: Any) -> Any:
            start = time.perf_counter()
            failed = True
            try:
                result = await inner(request, context)
                failed = False
                return result
            except Refused:  # the status is set: returning sends it
                failed = False
                return None
            finally:
                finish(context, start, failed)

        return factory(behavior, handler.request_deserializer, handler.response_serializer)
