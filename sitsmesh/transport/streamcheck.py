"""envoy.service.ext_proc.v3 for per-message checks of gRPC streams: Envoy's
`grpc_stream_check` ext_proc filter (filters/fragments/grpc_stream_check.yaml) hands
sitsmesh each request-body chunk of a checked stream, and forwards only what sitsmesh
sends back (FULL_DUPLEX_STREAMED), so a message reaches the model only once it passed
(authz/streamcheck.py).

A refused message ends the stream with its reason as gRPC status and message, and the
messages before it are still answered: sitsmesh ends the request side (end_of_stream),
the server finishes what it was sent and ends its response, and sitsmesh writes the
refusal into that response's trailers (or its headers, for a trailers-only answer).
Envoy's ImmediateResponse cannot do it: once the response has begun, Envoy resets the
stream, and the client sees RST_STREAM with no reason (measured: INTERNAL "Received
RST_STREAM with error code 2"). It is used where nothing has been answered yet (a
refusal at the stream's headers), and to cut a stream whose response does not end
within CUT_GRACE_S of its refusal (a revoked key while the model is still generating).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.rpc import code_pb2
from grpc import aio
from prometheus_client import CollectorRegistry, Counter

from sitsmesh import logs
from sitsmesh.authz.check import MAX_HEADER_VALUE, Authorizer, CheckInput
from sitsmesh.authz.streamcheck import MessageGate, Refusal, StreamCheckSettings
from sitsmesh.transport.authz import grpc_message, verified_claim
from sitsmesh.transport.extproc import attribute

_log = logs.get("sitsmesh.streamcheck")
# How long a refused stream's response may go on before it is cut: enough for a server
# to end a stream with nothing in flight, short enough to cut a revoked key's stream
# within a second.
CUT_GRACE_S = 0.5
MAX_HEADERS = 128
_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_TRAILERS_CONTINUE = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_RESPONSE_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def _body(data: bytes, end: bool) -> Any:
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=data, end_of_stream=end)))))


def _status_headers(refusal: Refusal) -> Any:
    """grpc-status and grpc-message (percent-encoded, as gRPC sends it) of a refusal."""
    return pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
            key="grpc-status", raw_value=str(refusal.status).encode())),
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
            key="grpc-message", raw_value=grpc_message(
                f"{refusal.code}: {refusal.message}").encode()))])


def _immediate(refusal: Refusal) -> Any:
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        grpc_status=pb.GrpcStatus(status=refusal.status),
        details=f"stream_check_{refusal.code}", body=f"{refusal.code}: {refusal.message}".encode()))


class StreamCheckMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        kwargs: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.messages = Counter(
            "sitsmesh_stream_check_messages", "Messages of checked gRPC streams, by outcome "
            "(forwarded, unchecked: let through by the open fail mode)", ["outcome"], **kwargs)
        self.refusals = Counter(
            "sitsmesh_stream_check_refusals", "Checked gRPC streams ended by sitsmesh, by "
            "reason (model_not_allowed, model_mixed, unauthenticated, check_deadline, ...)",
            ["code"], **kwargs)
        self.forwarded = self.messages.labels("forwarded")  # once, not per message
        self.cuts = Counter(
            "sitsmesh_stream_check_cuts", "Refused streams reset because their response "
            "did not end within the grace (a revoked key while the model generates)",
            **kwargs)


class CheckedStream:
    """One open stream: its gate, and the writes to Envoy, which the Process loop, the
    deadline timer and a directory change may each make (one at a time: the lock)."""

    __slots__ = ("_context", "_cut", "_deadline", "_lock", "_metrics", "_servicer", "_tasks",
                 "answered", "ended", "gate")

    def __init__(self, servicer: StreamCheckServicer, gate: MessageGate,
                 context: aio.ServicerContext[Any, Any]) -> None:
        self._servicer = servicer
        self._metrics = servicer.metrics
        self.gate = gate
        self._context = context
        self._lock = asyncio.Lock()
        self._deadline: asyncio.TimerHandle | None = None
        self._cut: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.ended = False     # the request side was ended (a refusal)
        self.answered = False  # the response ended: nothing left to cut

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Work begun outside the Process loop (a timer, a directory change)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def write(self, response: Any) -> None:
        async with self._lock:
            await self._context.write(response)

    async def forward(self, data: bytes, end: bool) -> None:
        gate, servicer = self.gate, self._servicer
        before, held = gate.messages, gate.held
        out = gate.feed(data, servicer.clock())
        servicer.held += gate.held - held
        if gate.messages > before:
            self._metrics.forwarded.inc(gate.messages - before)
        if gate.refusal is None and servicer.held > servicer.settings.max_held_bytes:
            servicer.held -= gate.held
            gate.busy()
        if gate.refusal is not None:
            await self.refuse(out)  # the messages before the refused one still go
            return
        if out or end:
            await self.write(_body(out, end))
        self._arm_deadline()

    def _arm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self.gate.pending_since is not None and not self.ended:
            delay = self.gate.pending_since + self._servicer.settings.deadline_s \
                - self._servicer.clock()
            self._deadline = asyncio.get_running_loop().call_later(
                max(0.0, delay), lambda: self._spawn(self._overdue()))

    async def _overdue(self) -> None:
        self._deadline = None
        held = self.gate.held
        released = self.gate.overdue(self._servicer.clock())
        self._servicer.held += self.gate.held - held
        if self.gate.refusal is not None:
            await self.refuse()
        elif released:
            self._metrics.messages.labels("unchecked").inc()
            _log.warning("stream message let through unchecked past its deadline",
                         tenant=self.gate.tenant, model=self.gate.model)
            await self.write(_body(released, False))

    def recheck(self) -> None:
        """The directory changed (or time passed a key's expiry): still allowed?"""
        if not self.ended and self.gate.identify() is not None:
            self._spawn(self.refuse())

    async def refuse(self, passed: bytes = b"") -> None:
        """Forward `passed` (whole messages before the refused one) and end the request
        side; the refusal goes into the response's trailers, or the stream is cut after
        CUT_GRACE_S."""
        if self.ended:
            return
        self.ended = True
        refusal = self.gate.refusal
        assert refusal is not None
        self._metrics.refusals.labels(refusal.code).inc()
        _log.info("checked stream refused", tenant=self.gate.tenant, model=self.gate.model,
                  messages=self.gate.messages, code=refusal.code, reason=refusal.message)
        if self._deadline is not None:
            self._deadline.cancel()
        await self.write(_body(passed, True))
        self._cut = asyncio.get_running_loop().call_later(
            CUT_GRACE_S, lambda: self._spawn(self._cut_now()))

    async def _cut_now(self) -> None:
        if self.answered:
            return
        refusal = self.gate.refusal
        assert refusal is not None
        self._metrics.cuts.inc()
        await self.write(_immediate(refusal))

    def close(self) -> None:
        self.answered = True
        self._servicer.held -= self.gate.held
        self.gate.release()
        for handle in (self._deadline, self._cut):
            if handle is not None:
                handle.cancel()


class StreamCheckServicer:
    """The `check` role of the data port's ExternalProcessor (transport/extprocmux.py)."""

    def __init__(self, authorizer: Authorizer, settings: StreamCheckSettings,
                 metrics: StreamCheckMetrics, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._authorizer = authorizer
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.open: set[CheckedStream] = set()
        self.held = 0  # bytes of incomplete messages held across every open stream

    def recheck(self) -> None:
        for stream in list(self.open):
            stream.recheck()

    async def Process(self, request_iterator: AsyncIterator[Any],
                      context: aio.ServicerContext[Any, Any]) -> None:
        stream: CheckedStream | None = None
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind == "request_body":
                    if stream is not None and not stream.ended:
                        body = request.request_body
                        await stream.forward(body.body, body.end_of_stream)
                elif kind == "request_headers":
                    stream = await self._start(request, context)
                    if stream is None:
                        return
                elif kind == "response_headers":
                    await self._response_headers(stream, request.response_headers, context)
                elif kind == "response_trailers":
                    await self._response_trailers(stream, context)
                elif kind == "request_trailers":
                    await (stream.write(_TRAILERS_CONTINUE) if stream is not None
                           else context.write(_TRAILERS_CONTINUE))
        finally:
            if stream is not None:
                stream.close()
                self.open.discard(stream)

    async def _start(self, request: Any, context: aio.ServicerContext[Any, Any]
                     ) -> CheckedStream | None:
        headers: dict[str, str] = {}
        for header in request.request_headers.headers.headers[:MAX_HEADERS]:
            headers[header.key] = header.value or header.raw_value.decode("utf-8", "replace")
        path = headers.get(":path", "")
        settings = self._authorizer.settings
        principal = attribute(request, "source.principal", MAX_HEADER_VALUE)
        jwt_tenant = verified_claim(request.metadata_context, settings.jwt_metadata_key,
                                    settings.jwt_tenant_claim) \
            if settings.jwt_metadata_key else ""
        caller = CheckInput(headers, path, principal=principal, jwt_tenant=jwt_tenant,
                            request_id=headers.get("x-request-id", ""))
        field = self.settings.field_of(path)
        gate = MessageGate(self._authorizer, self.settings, caller, field)
        refusal = gate.identify() if field else Refusal(
            code_pb2.PERMISSION_DENIED, "method_not_checked",
            f"{path[:128]} is not a method sitsmesh checks message by message")
        if refusal is not None:
            self.metrics.refusals.labels(refusal.code).inc()
            await context.write(_immediate(refusal))
            return None
        stream = CheckedStream(self, gate, context)
        self.open.add(stream)
        await stream.write(_HEADERS_CONTINUE)
        return stream

    async def _response_headers(self, stream: CheckedStream | None, headers: Any,
                                context: aio.ServicerContext[Any, Any]) -> None:
        if stream is None:
            await context.write(_RESPONSE_HEADERS_CONTINUE)
            return
        refusal = stream.gate.refusal if stream.ended else None
        if refusal is not None and headers.end_of_stream:
            # A trailers-only answer: its status travels in these headers.
            stream.answered = True
            await stream.write(pb.ProcessingResponse(response_headers=pb.HeadersResponse(
                response=pb.CommonResponse(header_mutation=_status_headers(refusal)))))
            return
        await stream.write(_RESPONSE_HEADERS_CONTINUE)

    async def _response_trailers(self, stream: CheckedStream | None,
                                 context: aio.ServicerContext[Any, Any]) -> None:
        if stream is None:
            await context.write(_RESPONSE_TRAILERS_CONTINUE)
            return
        stream.answered = True
        refusal = stream.gate.refusal if stream.ended else None
        if refusal is None:
            await stream.write(_RESPONSE_TRAILERS_CONTINUE)
            return
        await stream.write(pb.ProcessingResponse(response_trailers=pb.TrailersResponse(
            header_mutation=_status_headers(refusal))))
