"""One response body seen as a token stream: the wire format chosen from its content
type and path, its events split out of the chunks, its tokens timed."""

from __future__ import annotations

from dataclasses import dataclass

from sitsmesh.tokens.formats import FORMATS, Usage
from sitsmesh.tokens.framing import (
    MAX_CHUNK_BYTES,
    MAX_EVENT_BYTES,
    GrpcSplitter,
    LineSplitter,
    SseSplitter,
)
from sitsmesh.tokens.timing import End, StreamClock, StreamSummary


def format_for(content_type: str, path: str) -> str:
    """The token format of a response, or "" for one that is not a token stream (it is
    then not parsed at all)."""
    kind = content_type.partition(";")[0].strip().lower()
    if kind == "text/event-stream":
        # Triton's generate_stream speaks SSE with an event shape of its own.
        return "triton" if path.partition("?")[0].endswith("/generate_stream") else "openai"
    if kind in ("application/x-ndjson", "application/jsonl", "application/ndjson"):
        return "ndjson"
    if kind.startswith("application/grpc") and path.endswith("/ModelStreamInfer"):
        return "triton-grpc"
    return ""


_SPLITTERS: dict[str, type[SseSplitter | LineSplitter | GrpcSplitter]] = {
    "ndjson": LineSplitter, "triton-grpc": GrpcSplitter}


@dataclass(frozen=True, slots=True)
class TokenReport:
    """A finished stream, for the metrics and the request's chain."""

    request_id: str
    path: str
    format: str
    summary: StreamSummary
    usage: Usage | None
    bad_events: int      # events its format could not read, and oversized ones
    cluster: str = ""    # Envoy's upstream cluster and route: the stage it belongs to
    route: str = ""
    # From the request's headers that Check set: its tenant, and the input tokens its
    # token budget reserved for (x-sits-token-estimate; 0 without), to settle with.
    tenant: str = ""
    input_estimate: int = 0
    model: str = ""  # x-sits-model: the model Check read from the request


class TokenStream:
    __slots__ = ("_clock", "_parse", "_splitter", "bad_events", "done", "error", "format",
                 "max_chunk_bytes", "usage")
    _splitter: SseSplitter | LineSplitter | GrpcSplitter

    def __init__(self, fmt: str, started: float, stall_s: float,
                 max_event_bytes: int = MAX_EVENT_BYTES,
                 max_chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        self.format = fmt
        self.max_chunk_bytes = max_chunk_bytes
        self._parse = FORMATS[fmt]
        self._splitter = _SPLITTERS.get(fmt, SseSplitter)(max_event_bytes)
        self._clock = StreamClock(started, stall_s)
        self.usage: Usage | None = None
        self.done = False   # the format's own end came ([DONE], done: true, an error)
        self.error = ""  # the error event that ended the stream
        self.bad_events = 0

    def chunk(self, data: bytes, at: float) -> None:
        """A piece of the body, seen at `at`; one over max_chunk_bytes is not parsed (the
        event it ends in counts as oversized)."""
        if len(data) > self.max_chunk_bytes:
            self._splitter.skip(data)
            return
        for event in self._splitter.feed(data):
            piece = self._parse(event)
            if piece.error:
                self.bad_events += 1
                if piece.done:  # the engine's own error event, not one unreadable
                    self.error = piece.error
            if piece.tokens:
                self._clock.tokens(piece.tokens, at)
            if piece.usage is not None:
                self.usage = piece.usage
            if piece.done:
                self.done = True

    def finish(self, end: End, at: float) -> StreamSummary:
        if end is End.COMPLETE and self.error and self.done:
            end = End.ERROR
        tokens = self.usage.completion_tokens if self.usage is not None else None
        return self._clock.summary(end, at, tokens)

    @property
    def oversized(self) -> int:
        return self._splitter.skipped

    @property
    def held(self) -> int:
        """Bytes kept of an unfinished event."""
        return self._splitter.held
