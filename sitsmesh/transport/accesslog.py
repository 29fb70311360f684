"""envoy.service.accesslog.v3.AccessLogService: Envoy's HTTP entries -> chain hops.

Each entry also ends its request's admission hold (matched by request id).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf.message import DecodeError
from grpc import aio

from sitsmesh.chains.assembler import Hop
from sitsmesh.chains.trace import HEADER as TRACEPARENT
from sitsmesh.chains.trace import trace_id
from sitsmesh.errors import InvalidArgumentError
from sitsmesh.tokens.envoytimed import timed
from sitsmesh.transport.errors import abort
from sitsmesh.transport.streams import OpenStreams

SERVICE_NAME = als_pb2.DESCRIPTOR.services_by_name["AccessLogService"].full_name
STAGE_HEADER = "x-sits-stage"
DEFAULT_MAX_REQUEST_ID = 128
YIELD_EVERY = 1000


def hop_from_entry(entry: Any) -> Hop | None:
    """A hop from one HTTPAccessLogEntry; None when it carries no timing to use.

    Unset Durations read as zero, and a zero is taken as "not known": Envoy
    leaves a timing unset when the event never happened, and a measured zero
    would add nothing to a histogram that a missing sample does not. This
    avoids a HasField call per timing; the entry path runs at tens of
    thousands of entries per second.
    """
    common = entry.common_properties
    started = common.start_time
    if not started.seconds:
        return None
    value = common.time_to_last_downstream_tx_byte
    duration = value.seconds + value.nanos * 1e-9
    if not duration:
        value = common.duration
        duration = value.seconds + value.nanos * 1e-9
        if not duration:
            return None
    value = common.time_to_first_downstream_tx_byte
    ttfb = value.seconds + value.nanos * 1e-9
    value = common.time_to_first_upstream_tx_byte
    queue = value.seconds + value.nanos * 1e-9
    request = entry.request
    headers = request.request_headers
    code = entry.response.response_code.value
    traceparent = headers.get(TRACEPARENT)
    return Hop(request.request_id, started.seconds + started.nanos * 1e-9, duration,
               ttfb or None, queue or None, common.upstream_cluster, common.route_name,
               headers.get(STAGE_HEADER, ""),
               failed=code >= 500 or _failure_flagged(common.response_flags),
               trace_id=trace_id(traceparent) if traceparent else "")


def _failure_flagged(flags: Any) -> bool:
    """Any response flag but an injected delay (DI), which slows a request without
    failing it; the common case, no flag, costs one size check."""
    return flags.ByteSize() > 0 and any(
        field.name != "delay_injected" for field, _ in flags.ListFields())


class HopSink(Protocol):
    """Where hops go: the assembler, or the bus that shares them with other replicas."""

    def add(self, hop: Hop) -> None: ...

class AccessLogServicer(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self, assembler: HopSink,
                 release: Callable[[str, float | None], bool], *,
                 max_request_id: int = DEFAULT_MAX_REQUEST_ID,
                 on_drop: Callable[[str], None] | None = None,
                 pace: Callable[[], Awaitable[None]] | None = None,
                 streams: OpenStreams | None = None,
                 tokens: Callable[[Any, Any], None] | None = None) -> None:
        """`tokens(entry, fields)`: an entry whose stream Envoy's token-timing filter
        timed (fields: its `sitsmesh.tokens` metadata, sitsmesh/tokens/envoytimed.py)."""
        self._assembler = assembler
        self._tokens = tokens
        self._streams = streams or OpenStreams()
        self._release = release
        self._max_request_id = max_request_id
        self._on_drop = on_drop
        # Awaited between messages when the sink can fall behind (the shared hop bus):
        # the stream then slows its sender instead of growing a buffer.
        self._pace = pace
        self.entries = 0
        self.dropped = 0

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any],
                               context: aio.ServicerContext[Any, Any]) -> Any:
        add, release = self._assembler.add, self._release
        max_request_id = self._max_request_id
        try:
            await self._streams.run(
                self._consume(request_iterator, add, release, max_request_id))
        except DecodeError:
            # grpc would answer UNKNOWN with an exception name; say what was wrong.
            await abort(context, InvalidArgumentError(
                "a StreamAccessLogsMessage could not be parsed"))
        return als_pb2.StreamAccessLogsResponse()

    async def _consume(self, request_iterator: AsyncIterator[Any], add: Callable[[Hop], None],
                       release: Callable[[str, float | None], bool],
                       max_request_id: int) -> None:
        pace, tokens = self._pace, self._tokens
        cancelled = False
        entry: Any = None
        async for message in request_iterator:
            if pace is not None:
                await pace()
            for done, entry in enumerate(message.http_logs.log_entry, 1):
                if not done % YIELD_EVERY:
                    # A 4 MiB batch is ~30 000 entries, ~0.3 s of work: let the Checks
                    # waiting on the loop through between slices. A batch taken is
                    # finished even if the stream is cancelled meanwhile.
                    try:
                        await asyncio.sleep(0)
                    except asyncio.CancelledError:
                        cancelled = True
                self.entries += 1
                if entry.common_properties.intermediate_log_entry:
                    continue  # a periodic log of a long stream; its final entry follows
                request_id = entry.request.request_id
                if len(request_id) > max_request_id:
                    # Ids are kept (open and recently closed chains): one whose length the
                    # sender chose is refused, not stored. Envoy's own ids are 36 long.
                    self.dropped += 1
                    if self._on_drop is not None:
                        self._on_drop("request_id_too_long")
                    continue
                hop = hop_from_entry(entry)
                if request_id:
                    release(request_id, hop.end if hop is not None else None)
                if hop is not None:
                    add(hop)
                if tokens is not None:
                    fields = timed(entry)
                    if fields is not None:
                        tokens(entry, fields)
            # Not kept while the next message is awaited: parsed, it is ~4x its bytes, and
            # upb keeps a message's whole arena alive while any part of it is referenced,
            # so the last `entry` held the batch too (50 streams idling on their next
            # read held ~15 MB each, outside what the budget and tracemalloc see).
            del message
            entry = None
            if cancelled:
                raise asyncio.CancelledError
