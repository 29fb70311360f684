"""The ext_proc servicer's pure parts: where a stream's clock starts, and the stage
attributes Envoy sends."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sitsmesh.tokens.stream import TokenReport
from sitsmesh.tokens.timing import End
from sitsmesh.transport.extproc import (
    CLOSE_DELAY_S,
    ExternalProcessorServicer,
    _attribute,
)
from sitsmesh.transport.streams import OpenStreams

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
    assert _attribute(request, "xds.cluster_name") == "llm"
    assert len(_attribute(request, "xds.route_name")) == 256
    assert _attribute(request, "absent") == ""


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
        headers = pb.ProcessingRequest(observability_mode=True)
        headers.request_headers.headers.headers.add(key=":path", value="/v1/chat/completions")
        yield headers
        response = pb.ProcessingRequest(observability_mode=True)
        response.response_headers.headers.headers.add(key="content-type",
                                                       value="text/event-stream")
        yield response
        for at, body, end in chunks:
            clock.now = at
            yield pb.ProcessingRequest(observability_mode=True, response_body=pb.HttpBody(
                body=body, end_of_stream=end))
        clock.now += closes_after  # when the Process stream ends
    return messages()


def _serve(chunks: list[tuple[float, bytes, bool]], closes_after: float = 30.0
           ) -> list[TokenReport]:
    clock = _Clock()
    reports: list[TokenReport] = []
    servicer = ExternalProcessorServicer(reports.append, OpenStreams(), stall_s=1.0,
                                         clock=clock)

    async def serve() -> None:
        await servicer._serve(_messages(clock, chunks, closes_after), None)  # type: ignore[arg-type]

    asyncio.run(serve())
    return reports


TOKEN = b'data: {"choices": [{"delta": {"content": " t"}}]}\n\n'


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
