"""The ext_proc servicer's pure parts: where a stream's clock starts, and the stage
attributes Envoy sends."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sitsmesh.tokens.framing import MAX_CHUNK_BYTES
from sitsmesh.tokens.stream import TokenReport
from sitsmesh.tokens.timing import End
from sitsmesh.transport.extproc import (
    CLOSE_DELAY_S,
    ExternalProcessorServicer,
    attribute,
)
from sitsmesh.transport.streams import OpenStreams
from tests.observed import TOKEN, sse_exchange

WALL = datetime(2026, 12, 5, 6, 16, 15, 723213, tzinfo=UTC).timestamp()


def _request(**attributes: str) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    request.attributes["envoy.filters.http.ext_proc"].update(attributes)
    return request


@pytest.mark.parametrize(("raw", "started"), [
    ("2026-12-05T06:16:15.718213+00:00", 99.995),  # Envoy had it 5 ms before we did
    ("2026-12-05T06:16:17.723213+00:00", 100.0),   # in our future: skewed clocks
    ("2026-12-05T06:16:10.723213+00:00", 100.0),   # 5 s before: skewed clocks
    ("not a time", 100.0),
])
def test_the_clock_starts_when_envoy_had_the_request(raw: str, started: float) -> None:
    servicer = ExternalProcessorServicer(lambda report: None, OpenStreams(), stall_s=1.0,
                                         wall=lambda: WALL)
    assert servicer._started(_request(**{"request.time": raw}), 100.0) == \
        pytest.approx(started)
    assert servicer._started(pb.ProcessingRequest(), 100.0) == 100.0


def test_attributes_are_read_as_strings_and_bounded() -> None:
    request = _request(**{"xds.cluster_name": "llm", "xds.route_name": "r" * 1000})
    assert attribute(request, "xds.cluster_name") == "llm"
    assert len(attribute(request, "xds.route_name")) == 256
    assert attribute(request, "absent") == ""


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _messages(clock: _Clock, chunks: list[tuple[float, bytes, bool]],
              closes_after: float) -> Any:
    """Request headers at 100 s, SSE response headers, then each (at, body, end) chunk;
    the generator's end is the Process stream's end, at the clock's time then."""
    async def messages() -> Any:
        def set_now(at: float) -> None:
            clock.now = at
        async for message in sse_exchange(chunks, set_now):
            yield message
        clock.now += closes_after  # when the Process stream ends
    return messages()


def _serve(chunks: list[tuple[float, bytes, bool]], closes_after: float = 30.0
           ) -> list[TokenReport]:
    clock = _Clock()
    reports: list[TokenReport] = []
    servicer = ExternalProcessorServicer(reports.append, OpenStreams(), stall_s=1.0,
                                         clock=clock)

    async def serve() -> None:
        await servicer._serve(_messages(clock, chunks, closes_after).__anext__, None)  # type: ignore[arg-type]

    asyncio.run(serve())
    return reports




def test_the_formats_end_finishes_the_stream_before_envoy_closes_it() -> None:
    # The openai SDK hangs up at [DONE]: Envoy never sends the body's end.
    [report] = _serve([(100.2, TOKEN, False), (100.3, TOKEN + b"data: [DONE]\n\n", False)])
    assert report.summary.end is End.COMPLETE and report.summary.tokens == 2
    assert report.summary.stall_count == 0


def test_a_cut_stream_ends_the_close_delay_before_its_process_stream() -> None:
    [report] = _serve([(100.2, TOKEN, False), (100.3, TOKEN, False)])
    # Ended at 130.3 - CLOSE_DELAY_S: a 29 s stall after the last token, not 30 s.
    assert report.summary.end is End.CUT and report.summary.stall_count == 1
    [stall] = report.summary.stalls
    assert stall.length_s == pytest.approx(30.0 - CLOSE_DELAY_S)


def test_a_cut_stream_never_ends_before_its_last_chunk() -> None:
    # Envoy closed sooner than the delay (another deferred_close_timeout): no stall.
    [report] = _serve([(100.2, TOKEN, False), (100.3, TOKEN, False)],
                      closes_after=CLOSE_DELAY_S / 2)
    assert report.summary.end is End.CUT and report.summary.stall_count == 0


# --- bounds: streams tracked at once, the bytes they keep, chunk size, idle streams


class _Feed:
    """A Process stream the test drives: `put` its messages, then `close` it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    async def read(self) -> Any:
        message = await self.queue.get()
        if message is None:
            raise StopAsyncIteration
        return message

    def open(self, content_type: str = "text/event-stream") -> _Feed:
        headers = pb.ProcessingRequest(observability_mode=True)
        headers.request_headers.headers.headers.add(key=":path", value="/v1/chat/completions")
        response = pb.ProcessingRequest(observability_mode=True)
        response.response_headers.headers.headers.add(key="content-type", value=content_type)
        self.queue.put_nowait(headers)
        self.queue.put_nowait(response)
        return self

    def chunk(self, body: bytes, end: bool = False) -> None:
        self.queue.put_nowait(pb.ProcessingRequest(
            observability_mode=True, response_body=pb.HttpBody(body=body, end_of_stream=end)))

    def close(self) -> None:
        self.queue.put_nowait(None)


async def _settle() -> None:
    """Let the serving tasks take what was put: a bounded number of loop turns."""
    for _ in range(50):
        await asyncio.sleep(0)


def _servicer(reports: list[TokenReport], reasons: list[str], **bounds: Any
              ) -> ExternalProcessorServicer:
    return ExternalProcessorServicer(reports.append, OpenStreams(), stall_s=1.0,
                                     untracked=reasons.append, **bounds)


def test_streams_past_the_cap_are_not_parsed_and_are_counted() -> None:
    async def run() -> None:
        reports: list[TokenReport] = []
        reasons: list[str] = []
        servicer = _servicer(reports, reasons, max_streams=2)
        feeds = [_Feed().open() for _ in range(3)] + [_Feed().open("application/json")]
        tasks = [asyncio.create_task(servicer._serve(f.read, None)) for f in feeds]  # type: ignore[arg-type]
        await _settle()
        assert sorted(reasons) == ["not_streaming", "streams"]
        assert len(servicer.open) == 2
        for feed in feeds:
            feed.chunk(TOKEN + b"data: [DONE]\n\n")
        await _settle()
        # Only the two tracked streams report; once they are done a new one is tracked.
        assert len(reports) == 2 and not servicer.open
        late = _Feed().open()
        tasks.append(asyncio.create_task(servicer._serve(late.read, None)))  # type: ignore[arg-type]
        await _settle()
        assert len(servicer.open) == 1 and len(reasons) == 2
        for feed in [*feeds, late]:
            feed.close()
        await asyncio.gather(*tasks)
        assert len(reports) == 3 and reports[2].summary.end is End.CUT

    asyncio.run(run())


def test_a_stream_over_the_held_bytes_bound_is_dropped_and_counted() -> None:
    async def run() -> None:
        reports: list[TokenReport] = []
        reasons: list[str] = []
        servicer = _servicer(reports, reasons, max_held_bytes=150)
        first, second = _Feed().open(), _Feed().open()
        tasks = [asyncio.create_task(servicer._serve(f.read, None))  # type: ignore[arg-type]
                 for f in (first, second)]
        first.chunk(b'data: {"choices": [{"delta": {"content": "' + b"a" * 40)
        await _settle()
        assert servicer.held == 82 and not reasons
        second.chunk(b'data: {"choices": [{"delta": {"content": "' + b"b" * 40)
        await _settle()
        # The chunk that took all streams' unfinished events past 150 bytes: its stream
        # is no longer parsed, and what it kept is let go.
        assert reasons == ["bytes"] and servicer.held == 82 and len(servicer.open) == 1
        second.chunk(b'"}}]}\n\n' + TOKEN, end=True)
        first.chunk(b'"}}]}\n\n', end=True)
        for feed in (first, second):
            feed.close()
        await asyncio.gather(*tasks)
        [report] = reports
        assert report.summary.tokens == 1 and servicer.held == 0

    asyncio.run(run())


def test_a_chunk_over_the_chunk_bound_is_skipped_and_counted() -> None:
    [report] = _serve([(100.2, TOKEN, False), (100.3, TOKEN * (MAX_CHUNK_BYTES // len(TOKEN) + 1),
                                               False),
                       (100.4, TOKEN + b"data: [DONE]\n\n", False)])
    # The big chunk's tokens are not counted; its (unparsed) event is an unreadable one.
    assert report.summary.tokens == 2 and report.bad_events == 1
    assert report.summary.end is End.COMPLETE


def test_a_stream_that_never_ends_is_finished_as_idle_and_forgotten() -> None:
    async def run() -> None:
        clock = _Clock()
        reports: list[TokenReport] = []
        servicer = ExternalProcessorServicer(reports.append, OpenStreams(), stall_s=1.0,
                                             clock=clock, idle_s=60.0)
        feed = _Feed().open()
        task = asyncio.create_task(servicer._serve(feed.read, None))  # type: ignore[arg-type]
        feed.chunk(TOKEN + b'data: {"choices": [{"delta": {"content": "' + b"a" * 40)
        await _settle()
        assert servicer.sweep(clock.now + 30.0) == 0
        assert servicer.sweep(clock.now + 61.0) == 1
        [report] = reports
        assert report.summary.end is End.IDLE_TIMEOUT and report.summary.stall_count == 1
        assert not servicer.open and servicer.held == 0
        # The Process stream is still open: what else comes is not parsed or reported.
        feed.chunk(TOKEN, end=True)
        feed.close()
        await task
        assert len(reports) == 1

    asyncio.run(run())


def test_the_servicer_sweeps_idle_streams_by_itself() -> None:
    async def run() -> None:
        ended = asyncio.Event()
        reports: list[TokenReport] = []

        def report(r: TokenReport) -> None:
            reports.append(r)
            ended.set()

        servicer = ExternalProcessorServicer(report, OpenStreams(), stall_s=1.0, idle_s=0.04)
        feed = _Feed().open()
        task = asyncio.create_task(servicer._serve(feed.read, None))  # type: ignore[arg-type]
        feed.chunk(TOKEN)
        await asyncio.wait_for(ended.wait(), 10)
        assert reports[0].summary.end is End.IDLE_TIMEOUT
        feed.close()
        await task

    asyncio.run(run())
