"""envoy.service.ratelimit.v3.RateLimitService: protobuf in, limiter decision out."""

from __future__ import annotations

import time
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf.message import DecodeError
from google.protobuf.struct_pb2 import Struct
from grpc import aio

from sitsmesh import logs
from sitsmesh.errors import Code, InvalidArgumentError, SitsmeshError
from sitsmesh.ratelimit.config import Rule
from sitsmesh.ratelimit.limiter import Decision, Descriptor, RateLimiter, Status
from sitsmesh.telemetry.decisions import Telemetry
from sitsmesh.transport.errors import abort

SERVICE_NAME = rls_pb2.DESCRIPTOR.services_by_name["RateLimitService"].full_name
_REQUEST = rls_pb2.RateLimitRequest
_OK = rls_pb2.RateLimitResponse.OK
_OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
_log = logs.get("sitsmesh.ratelimit")


DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
# The RateLimit messages kept for reuse: per-route overrides make a new rule (whose stats
# key is the caller's descriptor) per request, so the cache is bounded in bytes.
LIMIT_CACHE_BYTES = 4 << 20
_LIMIT_ENTRY_BYTES = 400


class MessageTooLargeError(SitsmeshError):
    code = Code.RESOURCE_EXHAUSTED


class _Undecodable:
    """Stands in for a request that was not parsed: protobuf could not (for example
    non-UTF-8 strings), or it was too big to try."""

    __slots__ = ("error",)

    def __init__(self, error: SitsmeshError) -> None:
        self.error = error


_NOT_PARSED = InvalidArgumentError(
    "request is not a valid RateLimitRequest (strings must be UTF-8)")


def deserializer(max_bytes: int) -> Any:
    """Parse a request of at most `max_bytes`; anything bigger is refused unparsed."""
    too_large = _Undecodable(MessageTooLargeError(
        f"RateLimitRequest larger than {max_bytes} bytes (max_ratelimit_message_bytes)"))
    not_parsed = _Undecodable(_NOT_PARSED)

    def deserialize(data: bytes) -> Any:
        if len(data) > max_bytes:
            return too_large
        # grpc would answer a parse failure with UNKNOWN and an exception name; callers
        # deserve INVALID_ARGUMENT and a reason.
        try:
            return _REQUEST.FromString(data)
        except DecodeError:
            return not_parsed

    return deserialize


def add_to_server(servicer: RateLimitServicer, server: aio.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(
        servicer.ShouldRateLimit, request_deserializer=deserializer(servicer.max_message_bytes),
        response_serializer=rls_pb2.RateLimitResponse.SerializeToString)
    handlers = {"ShouldRateLimit": handler}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    # Registered methods are looked up in C core, skipping the per-call Python lookup.
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


LIMIT_HEADERS = ("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset")


def header_status(statuses: list[Status]) -> Status | None:
    """The status envoyproxy/ratelimit's RateLimit-* headers describe: the one with the
    least remaining among those with a limit (the first on a tie), unless a descriptor
    is over, outside quota mode (then the last of those)."""
    chosen: Status | None = None
    for status in statuses:
        rule = status.rule
        if rule is None or rule.unlimited:
            continue
        if chosen is None or status.remaining < chosen.remaining:
            chosen = status
    for status in statuses:
        if status.over and status.rule is not None and not status.rule.quota_mode:
            chosen = status
    return chosen


def dynamic_metadata(request: Any, decision: Decision) -> dict[str, Any]:
    """envoyproxy/ratelimit's response metadata: the domain, each descriptor's entries
    (and hits_addend), the request's hits_addend, and the config `metadata` of the
    descriptors that passed, merged in request order (the first value of a key wins).
    sitsmesh adds which quota-mode descriptors went over."""
    descriptors = []
    for d in request.descriptors:
        item: dict[str, Any] = {"entries": [f"{e.key}={e.value}" for e in d.entries]}
        if d.HasField("hits_addend"):
            item["hitsAddend"] = d.hits_addend.value
        descriptors.append(item)
    out: dict[str, Any] = {"domain": request.domain, "descriptors": descriptors}
    if request.hits_addend:
        out["hitsAddend"] = request.hits_addend
    merged: dict[str, Any] = {}
    for i, found in sorted((decision.metadata or {}).items()):
        if not decision.statuses[i].over:
            _merge_first(merged, found)
    if merged:
        out["metadata"] = merged
    if decision.violations is not None:
        out["quotaModeEnabled"] = True
        out["quotaModeViolations"] = decision.violations
    return out


def _merge_first(into: dict[str, Any], more: Any) -> None:
    for key, value in more.items():
        if key not in into:
            into[key] = value
        elif isinstance(into[key], dict) and isinstance(value, dict):
            merged = dict(into[key])
            _merge_first(merged, value)
            into[key] = merged


class RateLimitServicer(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(self, limiter: RateLimiter,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *,
                 limit_headers: bool = False, dynamic_metadata: bool = False,
                 header_names: tuple[str, str, str] = LIMIT_HEADERS,
                 telemetry: Telemetry | None = None) -> None:
        self._limiter = limiter
        self._telemetry = telemetry
        self.max_message_bytes = max_message_bytes
        # RateLimit-Limit/-Remaining/-Reset on every answer with a limit, as
        # envoyproxy/ratelimit's LIMIT_RESPONSE_HEADERS_ENABLED.
        self._limit_headers = limit_headers
        self._header_names = header_names
        # Envoy's dynamic metadata on every answer, as RESPONSE_DYNAMIC_METADATA.
        self._dynamic_metadata = dynamic_metadata
        # One RateLimit message per rule, built once; rules live as long as their snapshot.
        self._limits: dict[int, Any] = {}
        self._limits_bytes = 0

    def _limit(self, rule: Rule) -> Any:
        cached = self._limits.get(id(rule))
        if cached is None or cached[0] is not rule:
            message = rls_pb2.RateLimitResponse.RateLimit(
                name=rule.name, requests_per_unit=rule.requests_per_unit, unit=int(rule.unit or 0))
            cost = _LIMIT_ENTRY_BYTES + len(rule.stats_key) + len(rule.name)
            if len(self._limits) > 100_000 or self._limits_bytes + cost > LIMIT_CACHE_BYTES:
                self._limits.clear()
                self._limits_bytes = 0
            cached = self._limits[id(rule)] = (rule, message)
            self._limits_bytes += cost
        return cached[1]

    async def ShouldRateLimit(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        started = time.perf_counter()
        telemetry = self._telemetry
        if type(request) is _Undecodable:
            if telemetry is not None:
                telemetry.ratelimit("", [], None, started, error=request.error.message,
                                    context=context)
            await abort(context, request.error)
        descriptors = [
            Descriptor(tuple([(e.key, e.value) for e in d.entries]),
                       d.hits_addend.value if d.HasField("hits_addend") else None,
                       (d.limit.requests_per_unit, d.limit.unit) if d.HasField("limit") else None)
            for d in request.descriptors
        ]
        try:
            decision = await self._limiter.check(request.domain, descriptors,
                                                 request.hits_addend)
        except SitsmeshError as exc:
            if telemetry is not None:
                telemetry.ratelimit(request.domain, descriptors, None, started,
                                    error=exc.message, context=context)
            await abort(context, exc)
        response = rls_pb2.RateLimitResponse(overall_code=_OVER if decision.over else _OK)
        for status in decision.statuses:
            entry = response.statuses.add(code=_OVER if status.over else _OK,
                                          limit_remaining=status.remaining)
            if status.rule is not None and not status.rule.unlimited:
                entry.current_limit.CopyFrom(self._limit(status.rule))
                reset = status.reset_s
                whole = int(reset)
                until = entry.duration_until_reset
                until.seconds = whole
                until.nanos = int((reset - whole) * 1e9)
        if self._limit_headers:
            shown = header_status(decision.statuses)
            if shown is not None and shown.rule is not None:
                values = (shown.rule.requests_per_unit, shown.remaining, int(shown.reset_s))
                response.response_headers_to_add.extend(
                    base_pb2.HeaderValue(key=name, value=str(value))
                    for name, value in zip(self._header_names, values, strict=True))
        if self._dynamic_metadata:
            metadata = Struct()
            metadata.update(dynamic_metadata(request, decision))
            response.dynamic_metadata.CopyFrom(metadata)
        if decision.over:
            _log.debug("over limit", domain=request.domain)
        if telemetry is not None:
            telemetry.ratelimit(request.domain, descriptors, decision, started, context=context)
        return response
