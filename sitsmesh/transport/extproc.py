"""envoy.service.ext_proc.v3.ExternalProcessor: Envoy's ext_proc filter shows sitsmesh a
streaming response's body chunk by chunk; sitsmesh times the tokens in it.

One Process stream is one HTTP request. The request headers start its clock (and give
its x-request-id and path), the response headers say whether the body is a token
stream (SSE or NDJSON: anything else is not parsed), each body chunk is fed to the
stream's parser as it arrives, and the end of the body, or of the Process stream before
it, finishes it. In observability mode (filters/fragments/ext_proc.yaml) Envoy waits for
no answer, so none is sent; otherwise every message is answered CONTINUE, unchanged.

Why observability mode, measured (bench/token_streams.py --streamed, 100 streams x 256
tokens at 20 ms a token, bench/RESULTS.md): with STREAMED bodies answered CONTINUE at
once, each chunk waits for a round trip through this event loop, and TTFT grew by
2.0-3.4 ms at p50 and 8.9-21 ms at p99 over no filter, against 0.7-0.9 and 1.6-4.1 ms
in observability mode; ITL p99 by 1.3-2.8 ms against 0.6-0.9; Envoy's CPU per 1 000
tokens was 72-75 ms against 56-59 (33-34 with no filter) and sitsmesh's 129-131
against 97-102. FULL_DUPLEX_STREAMED would make sitsmesh send every chunk back: more work
still, and the client's stream would depend on sitsmesh.

Bounds: MAX_STREAMS parsed at once and MAX_HELD_BYTES of unfinished events over all of
them (past either, a response is not parsed, and `untracked` is told why), a chunk over
MAX_CHUNK_BYTES not parsed (sitsmesh/tokens/framing.py), and IDLE_S without a chunk
ends a stream as idle_timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from grpc import aio

from sitsmesh.budgets.model import ESTIMATE_HEADER, estimate_from_header
from sitsmesh.errors import InvalidArgumentError
from sitsmesh.tokens.stream import TokenReport, TokenStream, format_for
from sitsmesh.tokens.timing import End
from sitsmesh.transport.errors import abort
from sitsmesh.transport.streams import OpenStreams

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
MAX_HEADER_VALUE = 256  # request ids and paths kept per stream
MAX_LAG_S = 1.0  # Envoy's request.time this far before receipt, or after: clock skew
# The fragment's `deferred_close_timeout`: in observability mode Envoy keeps the Process
# stream open this long after the HTTP stream ends, so a stream that was cut (no body
# end) is seen to end this much after it did.
CLOSE_DELAY_S = 1.0
# Streams parsed at once; a response past it is passed by unparsed (and counted). Each
# keeps at most MAX_EVENT_BYTES of an unfinished event plus ~9 KiB of gaps (MAX_GAPS).
MAX_STREAMS = 4096
# What all open streams' unfinished events may keep together: past it, the stream whose
# chunk went over is dropped (counted). 4096 x 9 KiB of gaps + this: ~70 MiB at worst.
MAX_HELD_BYTES = 32 << 20
# A Process stream with no chunk for this long is finished as idle_timeout and
# forgotten: twice Envoy's default stream_idle_timeout (5 min), so where Envoy keeps it,
# Envoy ends an idle stream first (reported as cut); this bounds a stream Envoy never
# ends. Checked every IDLE_S / 4.
IDLE_S = 600.0
_CONTINUE = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


def _header(headers: Any, name: str) -> str:
    for header in headers.headers.headers:
        if header.key == name:
            value = header.value or header.raw_value.decode("utf-8", "replace")
            return str(value[:MAX_HEADER_VALUE])
    return ""


def attribute(request: Any, name: str, limit: int = MAX_HEADER_VALUE) -> str:
    """A string attribute Envoy sent with the message (the fragment's
    `request_attributes` / `response_attributes`), at most `limit` characters."""
    for struct in request.attributes.values():
        value = struct.fields.get(name)
        if value is not None and value.WhichOneof("kind") == "string_value":
            return str(value.string_value[:limit])
    return ""


class _Open:
    """A tracked token stream and what its report needs."""

    __slots__ = ("held", "last", "seen", "stream")

    def __init__(self, stream: TokenStream, last: float,
                 seen: tuple[str, str, str, str, str, str, str]) -> None:
        self.stream: TokenStream | None = stream  # None once finished or dropped
        self.last = last  # when its last chunk came, for the idle bound
        self.held = 0     # bytes its splitter keeps of an unfinished event
        # request id, path, tenant, token estimate, model, upstream cluster, route name
        self.seen = seen


class ExternalProcessorServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """`untracked(reason)` is told of each response not parsed as a token stream:
    "not_streaming" (not a token stream's content type), "streams" (MAX_STREAMS open
    already), "bytes" (its unfinished event would take the bytes all streams keep over
    MAX_HELD_BYTES: it is dropped, unreported)."""

    def __init__(self, report: Callable[[TokenReport], None], streams: OpenStreams, *,
                 stall_s: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 stall_of: Callable[[str, str], float] | None = None,
                 untracked: Callable[[str], None] = lambda reason: None,
                 max_streams: int = MAX_STREAMS, max_held_bytes: int = MAX_HELD_BYTES,
                 idle_s: float = IDLE_S) -> None:
        """`stall_of(cluster, route)`: the stall threshold of the stage a stream went to,
        asked when its response headers name it; `stall_s` for every stream without."""
        self._report = report
        self._streams = streams
        self._stall_s = stall_s
        self._stall_of = stall_of
        self._clock = clock
        self._wall = wall
        self._untracked = untracked
        self.max_streams = max_streams
        self.max_held_bytes = max_held_bytes
        self.idle_s = idle_s
        self.open: set[_Open] = set()
        self.held = 0  # bytes all open streams' splitters keep
        self._sweeper: asyncio.TimerHandle | None = None
        self.untracked = 0  # responses that were not token streams

    async def Process(self, request_iterator: AsyncIterator[Any],
                      context: aio.ServicerContext[Any, Any]) -> None:
        try:
            # The iterator, not context.read(): the data server's byte budget meters each
            # message in it (sitsmesh/transport/budgetwrap.py).
            await self._streams.run(self._serve(request_iterator.__anext__, context))
        except DecodeError:
            await abort(context, InvalidArgumentError(
                "a ProcessingRequest could not be parsed"))

    async def _serve(self, read: Callable[[], Awaitable[Any]],
                     context: aio.ServicerContext[Any, Any]) -> None:
        """`read`: the next ProcessingRequest; StopAsyncIteration at the stream's end."""
        clock = self._clock
        started = clock()
        request_id = path = tenant = estimate = model = ""
        tracked: _Open | None = None
        try:
            while True:
                try:
                    request = await read()
                except StopAsyncIteration:
                    break
                now = clock()
                kind = request.WhichOneof("request")
                if kind == "response_body":
                    if tracked is not None and tracked.stream is not None:
                        self._chunk(tracked, tracked.stream, request.response_body, now)
                elif kind == "request_headers":
                    started = self._started(request, now)
                    headers = request.request_headers
                    request_id = _header(headers, "x-request-id")
                    path = _header(headers, ":path")
                    tenant = _header(headers, "x-sits-tenant")
                    estimate = _header(headers, ESTIMATE_HEADER)
                    model = _header(headers, "x-sits-model")
                elif kind == "response_headers" and tracked is None:
                    tracked = self._track(request, started,
                                          (request_id, path, tenant, estimate, model), now)
                if not request.observability_mode and kind in _CONTINUE:
                    await context.write(_CONTINUE[kind])
        finally:
            if tracked is not None and tracked.stream is not None:
                # Envoy ended the exchange before the body's end: cut, or idle past its
                # timeout. It ended CLOSE_DELAY_S before the Process stream did (never
                # before the last chunk seen), which is what a stall at the end is
                # measured to.
                self._finish(tracked, End.CUT, max(tracked.last, clock() - CLOSE_DELAY_S))

    def _track(self, request: Any, started: float, seen: tuple[str, str, str, str, str],
               now: float) -> _Open | None:
        """The response headers: a tracked stream, or None where it is not parsed."""
        fmt = format_for(_header(request.response_headers, "content-type"), seen[1])
        if not fmt:
            self.untracked += 1
            self._untracked("not_streaming")
            return None
        if len(self.open) >= self.max_streams:
            self._untracked("streams")
            return None
        cluster = attribute(request, "xds.cluster_name")
        route = attribute(request, "xds.route_name")
        stall_s = self._stall_s if self._stall_of is None else self._stall_of(cluster, route)
        tracked = _Open(TokenStream(fmt, started, stall_s), now, (*seen, cluster, route))
        self.open.add(tracked)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(
                self.idle_s / 4, self._sweep)
        return tracked

    def _chunk(self, tracked: _Open, stream: TokenStream, body: Any, now: float) -> None:
        stream.chunk(body.body, now)
        tracked.last = now
        held = stream.held
        if held != tracked.held:
            self.held += held - tracked.held
            tracked.held = held
            if self.held > self.max_held_bytes:
                self._drop(tracked)
                self._untracked("bytes")
                return
        # Its format's end ([DONE], done: true) is the end: clients such as the openai
        # SDK hang up on [DONE] before the body's end reaches Envoy, and the Process
        # stream then ends only after CLOSE_DELAY_S.
        if body.end_of_stream or stream.done:
            self._finish(tracked, End.COMPLETE, now)

    def sweep(self, now: float) -> int:
        """Finish every stream with no chunk for idle_s (a Process stream Envoy left
        open) as IDLE_TIMEOUT, and forget it; how many there were."""
        idle = [t for t in self.open if now - t.last > self.idle_s]
        for tracked in idle:
            self._finish(tracked, End.IDLE_TIMEOUT, now)
        return len(idle)

    def _sweep(self) -> None:
        self.sweep(self._clock())
        self._sweeper = asyncio.get_running_loop().call_later(
            self.idle_s / 4, self._sweep) if self.open else None

    def _drop(self, tracked: _Open) -> None:
        self.open.discard(tracked)
        self.held -= tracked.held
        tracked.held = 0
        tracked.stream = None  # its memory goes now

    def _started(self, request: Any, received: float) -> float:
        """When Envoy had the request (its `request.time` attribute), on this process's
        clock: the unawaited copy of the headers reaches sitsmesh some ms later, and
        TTFT counted from there came out 4 % short. Received time where the attribute
        is missing, or the two clocks disagree by more than MAX_LAG_S."""
        raw = attribute(request, "request.time")
        if not raw:
            return received
        try:
            lag = self._wall() - datetime.fromisoformat(raw).timestamp()
        except ValueError:
            return received
        return received - lag if 0.0 <= lag <= MAX_LAG_S else received

    def _finish(self, tracked: _Open, end: End, at: float) -> None:
        stream = tracked.stream
        assert stream is not None
        self._drop(tracked)
        request_id, path, tenant, estimate, model, cluster, route = tracked.seen
        summary = stream.finish(end, at)
        self._report(TokenReport(request_id, path, stream.format, summary, stream.usage,
                                 stream.bad_events + stream.oversized, cluster, route,
                                 tenant, estimate_from_header(estimate), model))


def add_to_server(servicer: pb_grpc.ExternalProcessorServicer, server: aio.Server) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
