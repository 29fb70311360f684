"""What Envoy's ext_proc filter (observability mode) sends sitsmesh for one streaming
chat completion, for the unit tests of the token observer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

TOKEN = b'data: {"choices": [{"delta": {"content": " t"}}]}\n\n'


async def sse_exchange(chunks: list[tuple[float, bytes, bool]], set_now: Callable[[float], None],
                       attributes: dict[str, str] | None = None) -> AsyncIterator[Any]:
    """Request headers, SSE response headers (with `attributes`), then each
    (at, body, end) chunk, `set_now(at)` before it."""
    headers = pb.ProcessingRequest(observability_mode=True)
    headers.request_headers.headers.headers.add(key=":path", value="/v1/chat/completions")
    yield headers
    response = pb.ProcessingRequest(observability_mode=True)
    response.response_headers.headers.headers.add(key="content-type", value="text/event-stream")
    if attributes:
        response.attributes["envoy.filters.http.ext_proc"].update(attributes)
    yield response
    for at, body, end in chunks:
        set_now(at)
        yield pb.ProcessingRequest(observability_mode=True, response_body=pb.HttpBody(
            body=body, end_of_stream=end))
