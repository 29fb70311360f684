"""envoy.service.ext_proc.v3.ExternalProcessor: Envoy's ext_proc filter shows sitsmesh a
streaming response's body chunk by chunk; sitsmesh times the tokens in it.

One Process stream is one HTTP request. The request headers start its clock (and give
its x-request-id and path), the response headers say whether the body is a token
stream (SSE or NDJSON: anything else is not parsed), each body chunk is fed to the
stream's parser as it arrives, and the end of the body, or of the Process stream before
it, finishes it. In observability mode (filters/fragments/ext_proc.yaml) Envoy waits for
no answer, so none is sent; otherwise every message is answered CONTINUE, unchanged.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from grpc import aio

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


def _attribute(request: Any, name: str) -> str:
    """An attribute Envoy sent with the message (`response_attributes` in the fragment)."""
    for struct in request.attributes.values():
        value = struct.fields.get(name)
        if value is not None and value.WhichOneof("kind") == "string_value":
            return str(value.string_value[:MAX_HEADER_VALUE])
    return ""


class ExternalProcessorServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, report: Callable[[TokenReport], None], streams: OpenStreams, *,
                 stall_s: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 stall_of: Callable[[str, str], float] | None = None) -> None:
        """`stall_of(cluster, route)`: the stall threshold of the stage a stream went to,
        asked when its response headers name it; `stall_s` for every stream without."""
        self._report = report
        self._streams = streams
        self._stall_s = stall_s
        self._stall_of = stall_of
        self._clock = clock
        self._wall = wall
        self.untracked = 0  # responses that were not token streams

    async def Process(self, request_iterator: AsyncIterator[Any],
                      context: aio.ServicerContext[Any, Any]) -> None:
        try:
            await self._streams.run(self._serve(request_iterator, context))
        except DecodeError:
            await abort(context, InvalidArgumentError(
                "a ProcessingRequest could not be parsed"))

    async def _serve(self, request_iterator: AsyncIterator[Any],
                     context: aio.ServicerContext[Any, Any]) -> None:
        clock = self._clock
        started = clock()
        request_id = path = cluster = route = ""
        stream: TokenStream | None = None
        finished = False
        last = started
        async for request in request_iterator:
            now = clock()
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                started = self._started(request, now)
                request_id = _header(request.request_headers, "x-request-id")
                path = _header(request.request_headers, ":path")
            elif kind == "response_headers":
                fmt = format_for(_header(request.response_headers, "content-type"), path)
                cluster = _attribute(request, "xds.cluster_name")
                route = _attribute(request, "xds.route_name")
                if fmt:
                    stall_s = (self._stall_s if self._stall_of is None
                               else self._stall_of(cluster, route))
                    stream = TokenStream(fmt, started, stall_s)
                else:
                    self.untracked += 1
            elif kind == "response_body" and stream is not None and not finished:
                body = request.response_body
                stream.chunk(body.body, now)
                last = now
                # Its format's end ([DONE], done: true) is the end: clients such as the
                # openai SDK hang up on [DONE] before the body's end reaches Envoy, and
                # the Process stream then ends only after CLOSE_DELAY_S.
                if body.end_of_stream or stream.done:
                    finished = True
                    self._finish(stream, End.COMPLETE, now,
                                 (request_id, path, cluster, route))
            if not request.observability_mode and kind in _CONTINUE:
                await context.write(_CONTINUE[kind])
        if stream is not None and not finished:
            # Envoy ended the exchange before the body's end: cut, or idle past its
            # timeout. It ended CLOSE_DELAY_S before the Process stream did (never before
            # the last chunk seen), which is what a stall at the end is measured to.
            ended = max(last, clock() - CLOSE_DELAY_S)
            self._finish(stream, End.CUT, ended, (request_id, path, cluster, route))

    def _started(self, request: Any, received: float) -> float:
        """When Envoy had the request (its `request.time` attribute), on this process's
        clock: the unawaited copy of the headers reaches sitsmesh some ms later, and
        TTFT counted from there came out 4 % short. Received time where the attribute
        is missing, or the two clocks disagree by more than MAX_LAG_S."""
        raw = _attribute(request, "request.time")
        if not raw:
            return received
        try:
            lag = self._wall() - datetime.fromisoformat(raw).timestamp()
        except ValueError:
            return received
        return received - lag if 0.0 <= lag <= MAX_LAG_S else received

    def _finish(self, stream: TokenStream, end: End, at: float,
                seen: tuple[str, str, str, str]) -> None:
        """`seen`: the request id, path, upstream cluster and route name."""
        request_id, path, cluster, route = seen
        summary = stream.finish(end, at)
        self._report(TokenReport(request_id, path, stream.format, summary, stream.usage,
                                 stream.bad_events + stream.oversized, cluster, route))


def add_to_server(servicer: pb_grpc.ExternalProcessorServicer, server: aio.Server) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
