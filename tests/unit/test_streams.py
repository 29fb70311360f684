"""OpenStreams: end_all ends open streams normally, and only those it ended."""

from __future__ import annotations

import asyncio

import pytest

from sitsmesh.transport.streams import OpenStreams


async def _forever(started: asyncio.Event) -> None:
    started.set()
    await asyncio.Event().wait()


async def test_end_all_ends_open_streams_without_an_error() -> None:
    streams, started = OpenStreams(), asyncio.Event()
    task = asyncio.create_task(streams.run(_forever(started)))
    await started.wait()
    assert streams.end_all() == 1
    await asyncio.wait_for(task, 1)
    assert task.result() is None and not task.cancelled()


async def test_a_cancel_from_elsewhere_still_cancels() -> None:
    streams, started = OpenStreams(), asyncio.Event()
    task = asyncio.create_task(streams.run(_forever(started)))
    await started.wait()
    task.cancel()  # grpc does this when the caller goes away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert streams.end_all() == 0


async def test_a_stream_opened_after_end_all_ends_at_once() -> None:
    streams, started = OpenStreams(), asyncio.Event()
    streams.end_all()
    await asyncio.wait_for(streams.run(_forever(started)), 1)
    assert not started.is_set()
