"""What a data-plane stream holds between its messages, and the per-connection stream cap."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf.message import Message

from sitsmesh.app.dataserver import server_options
from sitsmesh.chains.assembler import Hop
from sitsmesh.config import load_settings
from sitsmesh.errors import ConfigError
from sitsmesh.transport.accesslog import AccessLogServicer


class _Hops:
    def __init__(self) -> None:
        self.hops: list[Hop] = []

    def add(self, hop: Hop) -> None:
        self.hops.append(hop)


def _batch(n: int) -> als_pb2.StreamAccessLogsMessage:
    message = als_pb2.StreamAccessLogsMessage()
    for i in range(n):
        entry = accesslog_pb2.HTTPAccessLogEntry()
        entry.common_properties.start_time.FromSeconds(1_700_000_000)
        entry.common_properties.time_to_last_downstream_tx_byte.FromMilliseconds(20)
        entry.request.request_id = f"r{i}"
        message.http_logs.log_entry.append(entry)
    return message


async def test_an_access_log_stream_holds_no_part_of_a_batch_while_it_awaits_the_next() -> None:
    """upb keeps a parsed batch's whole arena alive while any part of it is referenced:
    the last entry, left in the consumer's frame, held each idle stream's batch (~4x its
    wire bytes), 50 streams of 3.7 MB batches ~750 MB the budget never saw."""
    hops = _Hops()
    servicer = AccessLogServicer(hops, lambda request_id, end: True)
    held: list[str] = []

    async def messages() -> AsyncIterator[Any]:
        yield _batch(3)
        # The consumer is suspended on this read: what does its frame still hold?
        frame = consumer.cr_frame
        assert frame is not None
        held.extend(name for name, value in frame.f_locals.items()
                    if isinstance(value, Message))

    consumer: Any = servicer._consume(messages(), hops.add, lambda request_id, end: True, 128)
    await consumer
    assert len(hops.hops) == 3
    assert held == []


def test_data_port_caps_streams_per_connection_from_a_validated_setting() -> None:
    settings = load_settings({}, env={})
    options = dict(server_options(settings, reuseport=False)["options"])
    assert options["grpc.max_concurrent_streams"] == settings.max_streams_per_connection == 16
    flagged = load_settings({"max_streams_per_connection": "100"}, env={})
    assert dict(server_options(flagged, False)["options"])["grpc.max_concurrent_streams"] == 100
    with pytest.raises(ConfigError, match="SITSMESH_MAX_STREAMS_PER_CONNECTION: must be "
                                          "between 1 and 1000000, got 0"):
        load_settings({}, env={"SITSMESH_MAX_STREAMS_PER_CONNECTION": "0"})
