"""The per-message check servicer's answers to Envoy (transport/streamcheck.py), message
by message: what is forwarded with a refusal, the refusal in the trailers, the bound on
incomplete messages held across streams. Real Envoy and Triton:
tests/integration/test_stream_checks.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from sitsmesh.authz.streamcheck import StreamCheckSettings
from sitsmesh.transport.streamcheck import StreamCheckMetrics, StreamCheckServicer
from tests.streamframes import KEY, PATH, acme_authorizer, frame_of


class Context:
    """What Envoy got back, in order."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def write(self, response: Any) -> None:
        self.sent.append(response)


def _headers() -> Any:
    request = pb.ProcessingRequest()
    for key, value in ((":path", PATH), ("x-api-key", KEY)):
        request.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    return request


def _body(data: bytes, end: bool = False) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def _servicer(**settings: object) -> StreamCheckServicer:
    return StreamCheckServicer(acme_authorizer(), StreamCheckSettings(**settings),  # type: ignore[arg-type]
                               StreamCheckMetrics(CollectorRegistry()))


async def _run(servicer: StreamCheckServicer, messages: list[Any], context: Context) -> None:
    async def stream() -> AsyncIterator[Any]:
        for message in messages:
            yield message
            await asyncio.sleep(0)
    await servicer.Process(stream(), context)  # type: ignore[arg-type]


def _forwarded(response: Any) -> tuple[bytes, bool]:
    streamed = response.request_body.response.body_mutation.streamed_response
    return streamed.body, streamed.end_of_stream


def test_the_messages_before_a_refused_one_go_with_the_end_of_the_request() -> None:
    ok, bad = frame_of("llama-3") + frame_of("llama-3", 10), frame_of("llama-4")
    trailers = pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    context = Context()
    asyncio.run(_run(_servicer(), [_headers(), _body(ok + bad + ok), trailers], context))
    headers, body, status = context.sent
    assert headers.HasField("request_headers")
    assert _forwarded(body) == (ok, True)  # never the refused one, nor those after it
    mutation = {h.header.key: h.header.raw_value.decode()
                for h in status.response_trailers.header_mutation.set_headers}
    assert mutation["grpc-status"] == "7"
    assert mutation["grpc-message"].startswith("model_mixed: message 3 names model llama-4")


def test_incomplete_messages_held_across_streams_are_bounded() -> None:
    servicer = _servicer(max_held_bytes=100)
    frame = frame_of("llama-3", 200)
    first, second = Context(), Context()

    async def both() -> None:
        gate = asyncio.Event()

        async def holding(context: Context) -> AsyncIterator[Any]:
            yield _headers()
            yield _body(frame[:80])
            await gate.wait()

        one = asyncio.ensure_future(servicer.Process(holding(first), first))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        assert servicer.held == 80
        await _run(servicer, [_headers(), _body(frame[:80])], second)
        gate.set()
        await one

    asyncio.run(both())
    # The first stream's 80 bytes fit; the second's would pass 100: it is ended.
    assert len(first.sent) == 1
    _, ended = second.sent
    assert _forwarded(ended) == (b"", True)
    assert servicer.held == 0  # both streams closed: nothing held
