"""envoy.service.accesslog.v3.AccessLogService: Envoy's HTTP entries -> chain hops.

Each entry also ends its request's admission hold (matched by request id).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from grpc import aio

from sitsmesh.chains.assembler import Assembler, Hop

SERVICE_NAME = als_pb2.DESCRIPTOR.services_by_name["AccessLogService"].full_name
STAGE_HEADER = "x-sits-stage"


def _seconds(common: Any, name: str) -> float | None:
    if not common.HasField(name):
        return None
    value = getattr(common, name)
    return float(value.seconds + value.nanos / 1e9)


def hop_from_entry(entry: Any) -> Hop | None:
    """A hop from one HTTPAccessLogEntry; None when it carries no timing to use."""
    common, request = entry.common_properties, entry.request
    duration = _seconds(common, "time_to_last_downstream_tx_byte")
    if duration is None:
        duration = _seconds(common, "duration")
    if duration is None or not common.HasField("start_time"):
        return None
    start = common.start_time.seconds + common.start_time.nanos / 1e9
    code = entry.response.response_code.value if entry.response.HasField("response_code") else 0
    flags = common.response_flags
    failed = code >= 500 or flags.ByteSize() > 0
    return Hop(request.request_id, start, duration,
               ttfb=_seconds(common, "time_to_first_downstream_tx_byte"),
               queue=_seconds(common, "time_to_first_upstream_tx_byte"),
               upstream_cluster=common.upstream_cluster, route_name=common.route_name,
               stage_header=request.request_headers.get(STAGE_HEADER, ""), failed=failed)


class AccessLogServicer(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self, assembler: Assembler, release: Callable[[str], bool]) -> None:
        self._assembler = assembler
        self._release = release
        self.entries = 0

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any],
                               context: aio.ServicerContext[Any, Any]) -> Any:
        add, release = self._assembler.add, self._release
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                self.entries += 1
                if entry.common_properties.intermediate_log_entry:
                    continue  # a periodic log of a long stream; its final entry follows
                request_id = entry.request.request_id
                if request_id:
                    release(request_id)
                hop = hop_from_entry(entry)
                if hop is not None:
                    add(hop)
        return als_pb2.StreamAccessLogsResponse()
