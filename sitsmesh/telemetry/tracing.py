"""OpenTelemetry tracing: spans for Check, ShouldRateLimit, swaps, controller decisions
and the token streams of latency chains, exported in batches over OTLP/gRPC.

Off by default. This module imports the SDK, so sitsmesh.app.compose imports it only
where `otlp_endpoint` is set: with tracing off no SDK object exists and the decision
hook (sitsmesh.telemetry.decisions) pays one None check per request.

Request spans are made after the fact, from the wall-clock times the servicer took,
with explicit start and end: the request path opens no context and attaches nothing.
A request's W3C `traceparent` (gRPC metadata when Envoy's tracer propagates it, else
the HTTP headers a client or the mesh forwarded) parents its span. Sampling is
ParentBased(TraceIdRatio): a traceparent's sampled flag decides, `trace_sample_ratio`
decides for everything that arrives without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sitsmesh import __version__, logs
from sitsmesh.authz.check import Allowed, CheckInput, Denied
from sitsmesh.chains.ttft import RequestTokens
from sitsmesh.config import Settings
from sitsmesh.errors import StartupError
from sitsmesh.pressure.controller import Decision, Snapshot
from sitsmesh.ratelimit.limiter import Decision as RateLimitDecision
from sitsmesh.ratelimit.limiter import Descriptor
from sitsmesh.swap.record import SUCCEEDED, SwapRecord

_log = logs.get("sitsmesh.tracing")

SERVICE_NAME = "sitsmesh"
CHECK = "envoy.service.auth.v3.Authorization/Check"
SHOULD_RATE_LIMIT = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
SWAP = "sitsmesh.swap"
CONTROLLER_DECISION = "sitsmesh.controller.decision"
STREAM_SPAN = "sitsmesh.token_stream"
SHUTDOWN_S = 5.0     # the most a stop waits for the last batch to leave
LOG_EVERY_S = 30.0   # one line per this about failed exports and dropped spans
MAX_DESCRIPTORS = 16        # of a ShouldRateLimit, named on its span
# Of any attribute value and of an error status: callers choose request ids, model names
# and domains up to the message bounds, and up to 2048 spans wait in the export queue.
MAX_ATTRIBUTE_CHARS = 256
# The SDK's own loggers: one line per failed export attempt and per span dropped from a
# full queue (so per request while a collector is down). The throttle below stands in.
SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
               "opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export")

_RPC = {CHECK: {"rpc.system": "grpc", "rpc.service": "envoy.service.auth.v3.Authorization",
                "rpc.method": "Check"},
        SHOULD_RATE_LIMIT: {"rpc.system": "grpc",
                            "rpc.service": "envoy.service.ratelimit.v3.RateLimitService",
                            "rpc.method": "ShouldRateLimit"}}


def carrier(headers: Mapping[str, str] | None = None,
            metadata: Iterable[tuple[str, Any]] | None = None) -> tuple[str, str]:
    """(traceparent, tracestate) of a request: the gRPC call's metadata first (Envoy's
    tracer puts its ext_authz / ratelimit client span there, itself a child of the
    request's), else the HTTP request headers; ("", "") when neither has one."""
    if metadata is not None:
        parent = state = ""
        for key, value in metadata:
            if key == "traceparent" and isinstance(value, str):
                parent = value
            elif key == "tracestate" and isinstance(value, str):
                state = value
        if parent:
            return parent, state
    if headers is not None:
        parent = headers.get("traceparent", "")
        if parent:
            return parent, headers.get("tracestate", "")
    return "", ""


def wall_ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Throttle(logging.Filter):
    """Keeps the SDK's loggers quiet but for one line per LOG_EVERY_S, with how many it
    held back. No lock: a miscount under a race costs nothing."""

    def __init__(self, every_s: float) -> None:
        super().__init__()
        self._every = every_s
        self._last = -math.inf
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        now = time.monotonic()
        if now - self._last >= self._every:
            self._last = now
            held, self.held = self.held, 0
            _log.warning("trace export trouble", detail=record.getMessage(),
                         source=record.name, held_back=held)
        else:
            self.held += 1
        return False


THROTTLE = Throttle(LOG_EVERY_S)


class Tracing:
    """One process's tracer. `provider` owns the export thread; `shutdown` flushes it."""

    __slots__ = ("_decisions", "_propagator", "pipeline_of", "provider", "tracer")

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("sitsmesh", __version__)
        self._propagator = TraceContextTextMapPropagator()
        self._decisions: dict[str, Decision] = {}
        # The pipeline a model's requests enter (sitsmesh.app.compose sets the gate's).
        self.pipeline_of: Callable[[str, str], str] = lambda model, tenant: ""

    def parent(self, traceparent: str, tracestate: str = "") -> Context | None:
        """The context a W3C traceparent names; None (a new root) when it is absent or
        malformed, as the W3C spec asks of a receiver."""
        if not traceparent:
            return None
        fields = {"traceparent": traceparent}
        if tracestate:
            fields["tracestate"] = tracestate
        return self._propagator.extract(fields)

    def request(self, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any],
                *, traceparent: str = "", tracestate: str = "", error: str = "") -> None:
        """One SERVER span of a finished call (name: CHECK or SHOULD_RATE_LIMIT).
        `error`: the call failed (an RPC error, not a deny or an over-limit answer)."""
        span = self.tracer.start_span(
            name, context=self.parent(traceparent, tracestate), kind=SpanKind.SERVER,
            attributes={**_RPC.get(name, {}), **attributes}, start_time=start_ns)
        if error:
            span.set_status(Status(StatusCode.ERROR, error[:MAX_ATTRIBUTE_CHARS]))
        span.end(end_time=end_ns)

    def check(self, request: CheckInput, decision: Allowed | Denied, seconds: float,
              context: Any = None) -> None:
        """The span of one Check that took `seconds` and ended now. An allow answers 200;
        a deny carries its HTTP status and its code as the reason."""
        end = time.time_ns()
        metadata = context.invocation_metadata() if context is not None else None
        parent, state = carrier(request.headers, metadata)
        if isinstance(decision, Denied):
            attributes = {"sitsmesh.decision": "deny", "sitsmesh.reason": decision.code,
                          "http.response.status_code": decision.status,
                          "sitsmesh.tenant": decision.tenant}
        else:
            attributes = {"sitsmesh.decision": "allow", "sitsmesh.reason": "ok",
                          "http.response.status_code": 200,
                          "sitsmesh.tenant": decision.tenant, "sitsmesh.model": decision.model,
                          "sitsmesh.pipeline": self.pipeline_of(decision.model,
                                                                  decision.tenant),
                          "sitsmesh.priority": decision.priority,
                          "sitsmesh.request_class": decision.request_class}
        if request.request_id:
            attributes["sitsmesh.request_id"] = request.request_id
        self.request(CHECK, end - int(seconds * 1e9), end, attributes, traceparent=parent,
                     tracestate=state)

    def ratelimit(self, domain: str, descriptors: Sequence[Descriptor],
                  decision: RateLimitDecision | None, seconds: float, *, error: str = "",
                  context: Any = None) -> None:
        """The span of one ShouldRateLimit that took `seconds` and ended now (`decision`
        None: it failed with `error`)."""
        end = time.time_ns()
        parent, state = carrier(None, context.invocation_metadata()
                                if context is not None else None)
        over = decision is not None and decision.over
        attributes: dict[str, Any] = {
            "sitsmesh.decision": "error" if decision is None else
            "over_limit" if over else "ok", "sitsmesh.ratelimit.domain": domain,
            # Bounded: a request may carry many descriptors and long values.
            "sitsmesh.ratelimit.descriptors": [
                ",".join(f"{k}={v}" for k, v in d.entries)[:MAX_ATTRIBUTE_CHARS]
                for d in descriptors[:MAX_DESCRIPTORS]]}
        if decision is not None:
            attributes["sitsmesh.ratelimit.codes"] = [
                "OVER_LIMIT" if s.over else "OK" for s in decision.statuses[:MAX_DESCRIPTORS]]
        self.request(SHOULD_RATE_LIMIT, end - int(seconds * 1e9), end, attributes,
                     traceparent=parent, tracestate=state,
                     error=error or ("" if decision is not None else "failed"))

    def swap(self, record: SwapRecord, traceparent: str = "") -> None:
        """A finished (or interrupted) swap: one span, one child per phase it ran, at the
        times its record holds."""
        ended = record.ended_at if record.ended_at is not None else time.time()
        outcome = record.state if record.ended_at is not None else "interrupted"
        attributes: dict[str, Any] = {
            "sitsmesh.swap.id": record.id, "sitsmesh.model": record.model,
            "sitsmesh.swap.endpoint": record.endpoint,
            "sitsmesh.swap.to_version": record.to_version,
            "sitsmesh.swap.outcome": outcome}
        if record.from_version is not None:
            attributes["sitsmesh.swap.from_version"] = record.from_version
        span = self.tracer.start_span(SWAP, context=self.parent(traceparent),
                                      kind=SpanKind.INTERNAL, attributes=attributes,
                                      start_time=wall_ns(record.started_at))
        inside = trace.set_span_in_context(span)
        for step in record.steps:
            phase: dict[str, Any] = {
                "sitsmesh.swap.phase": step.phase, "sitsmesh.swap.phase_state": step.state,
                "sitsmesh.swap.message": step.message, "sitsmesh.model": record.model}
            for key, value in step.detail.items():
                phase[f"sitsmesh.swap.{key}"] = (value if isinstance(value, bool | int | float)
                                                 else str(value))
            child = self.tracer.start_span(f"{SWAP}.{step.phase}", context=inside,
                                           kind=SpanKind.INTERNAL, attributes=phase,
                                           start_time=wall_ns(step.started_at))
            if step.state == "failed":
                child.set_status(Status(StatusCode.ERROR, step.message))
            child.end(end_time=wall_ns(step.ended_at if step.ended_at is not None else ended))
        if outcome != SUCCEEDED:
            span.set_status(Status(StatusCode.ERROR, record.error or outcome))
        span.end(end_time=wall_ns(ended))

    def token_streams(self, pipeline: str, figures: RequestTokens) -> None:
        """A joined chain's streaming stages: one span each, in the chain's trace, with
        the GenAI figures as attributes, the first token and each stall as events.

        The chain keeps its trace id but not the caller's span id, so the spans hang
        under a parent derived from the request id (the same for all of a request's
        streams), sampled: the trace was worth a traceparent to someone."""
        if not figures.trace_id or not figures.stage_spans:
            return
        parent_id = int.from_bytes(hashlib.blake2b(figures.request_id.encode(),
                                                   digest_size=8).digest(), "big") or 1
        context = trace.set_span_in_context(NonRecordingSpan(SpanContext(
            int(figures.trace_id, 16), parent_id, is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED))))
        for stream in figures.streams:
            start, end = figures.stage_spans[stream.stage]
            attributes: dict[str, Any] = {
                "sitsmesh.pipeline": pipeline, "sitsmesh.stage": stream.stage,
                "sitsmesh.request_id": figures.request_id,
                "gen_ai.usage.output_tokens": stream.tokens,
                "sitsmesh.tokens_per_s": stream.tokens_per_s,
                "sitsmesh.stalls": stream.stall_count, "sitsmesh.stream_end": stream.end,
                "sitsmesh.ttft_part_ms": figures.shares.get(stream.stage, 0.0) * 1000}
            for key, value in (("gen_ai.server.time_to_first_token", stream.ttft_ms),
                               ("gen_ai.server.time_per_output_token", stream.itl_p50_ms)):
                if value is not None:
                    attributes[key] = value / 1000  # seconds, as the GenAI metrics
            span = self.tracer.start_span(f"{STREAM_SPAN} {stream.stage}", context=context,
                                          kind=SpanKind.INTERNAL, attributes=attributes,
                                          start_time=wall_ns(start))
            if stream.ttft_ms is not None:
                span.add_event("gen_ai.first_token",
                               timestamp=wall_ns(start + stream.ttft_ms / 1000))
            for after, length in stream.stalls:
                span.add_event("sitsmesh.stall", {"sitsmesh.stall_ms": length},
                               timestamp=wall_ns(start + after / 1000))
            span.end(end_time=wall_ns(end))

    def decisions(self, snapshot: Snapshot) -> None:
        """A span for each pipeline whose admitted fraction (to 0.01) or, while shedding,
        bottleneck changed since the last snapshot: not one per tick."""
        for name, new in snapshot.decisions.items():
            old = self._decisions.get(name)
            self._decisions[name] = new
            if _shape(old) == _shape(new):
                continue
            now = time.time_ns()
            view = next((v for v in new.stages if v.name == new.bottleneck), None)
            span = self.tracer.start_span(CONTROLLER_DECISION, kind=SpanKind.INTERNAL,
                                          start_time=now, attributes={
                "sitsmesh.pipeline": name, "sitsmesh.policy": new.policy,
                "sitsmesh.fraction.old": old.fraction if old else 1.0,
                "sitsmesh.fraction.new": new.fraction,
                "sitsmesh.cutoff.old": old.cutoff if old else 0.0,
                "sitsmesh.cutoff.new": new.cutoff,
                "sitsmesh.bottleneck.old": old.bottleneck if old else "",
                "sitsmesh.bottleneck.new": new.bottleneck,
                "sitsmesh.level": new.level,
                "sitsmesh.reason": (view.reason if view is not None and view.reason
                                    else new.level),
                "sitsmesh.concurrency": new.concurrency,
                "sitsmesh.arrival_rate": new.arrival_rate})
            span.end(end_time=now)
        for gone in set(self._decisions) - set(snapshot.decisions):
            del self._decisions[gone]

    async def shutdown(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Flush what is queued and stop the export thread, waiting `timeout_s` at most
        (a collector that is down must not hold up a stop)."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def shutdown() -> None:
            try:
                self.provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop may be gone by then
                    loop.call_soon_threadsafe(done.set)

        # A daemon thread: one stuck on a dead collector must not hold up the exit either.
        threading.Thread(target=shutdown, name="otel-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except TimeoutError:
            _log.warning("trace export did not finish in time; spans may be lost",
                         timeout_s=timeout_s)


def _shape(decision: Decision | None) -> tuple[float, str]:
    if decision is None:
        return 1.0, ""
    fraction = round(decision.fraction, 2)
    return fraction, decision.bottleneck if fraction < 1.0 else ""


def _credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    if settings.otlp_ca_file is None:
        return None  # the exporter's default: the system roots (or OTEL_EXPORTER_OTLP_*)
    try:
        roots = settings.otlp_ca_file.read_bytes()
    except OSError as exc:
        raise StartupError(f"otlp_ca_file {settings.otlp_ca_file}: cannot read: "
                           f"{exc.strerror or exc}") from None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def resource(role: str) -> Resource:
    host = socket.gethostname()
    return Resource.create({
        "service.name": SERVICE_NAME, "service.version": __version__,
        # Unique per process, as the semantic conventions ask: workers share the host
        # (the pod, which is the replica's name in Kubernetes).
        "service.instance.id": f"{host}:{os.getpid()}", "host.name": host,
        "process.pid": os.getpid(), "sitsmesh.role": role})


def build(settings: Settings, role: str, exporter: SpanExporter | None = None) -> Tracing:
    """The tracer for one process. `exporter`: tests pass an in-memory one (then spans
    are exported as they end); otherwise OTLP/gRPC to `otlp_endpoint`, in batches."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    if settings.otlp_ca_file is not None and not settings.otlp_endpoint.startswith("https:"):
        raise StartupError("otlp_ca_file is set but otlp_endpoint is not https://: the "
                           "traces would leave in clear")
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio)),
        resource=resource(role), span_limits=SpanLimits(
            max_span_attribute_length=MAX_ATTRIBUTE_CHARS))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        for name in SDK_LOGGERS:
            logger = logging.getLogger(name)
            if THROTTLE not in logger.filters:
                logger.addFilter(THROTTLE)
        secure = settings.otlp_endpoint.startswith("https:")
        otlp = OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=not secure,
                                credentials=_credentials(settings) if secure else None)
        provider.add_span_processor(BatchSpanProcessor(otlp))
    _log.info("tracing on", endpoint=settings.otlp_endpoint or "in-memory",
              sample_ratio=settings.trace_sample_ratio, role=role)
    return Tracing(provider)
