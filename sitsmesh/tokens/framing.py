"""Events out of a streaming response body that arrives in arbitrary chunks: Server-Sent
Events (`text/event-stream`), newline-delimited JSON and gRPC length-prefixed messages.

Envoy hands a body over in the pieces the upstream wrote, so a chunk may hold several
events, or part of one, split anywhere (even inside a CRLF). Each splitter keeps the
unfinished part and returns only whole events, and it bounds what it keeps: an event
over `max_event_bytes` is dropped whole and counted, and the stream goes on from the
next event. Parsing by hand rather than with an SSE client library, since those read
from a socket or an iterator of their own, not from chunks handed in one at a time.
"""

from __future__ import annotations

MAX_EVENT_BYTES = 64 << 10
# Parsing is Python work on the event loop's thread: one chunk is parsed only up to this
# (4 ms or so of work at the usual event sizes); a bigger one is skipped and counted.
MAX_CHUNK_BYTES = 256 << 10


class SseSplitter:
    """`feed(chunk)` -> the data of each event the chunk completed (its `data:` lines
    joined by newlines, as the SSE spec says). Comments, `event:`, `id:` and `retry:`
    lines carry no tokens and are skipped; an event with no data line yields nothing."""

    __slots__ = ("_cr", "_data", "_held", "_line", "_oversized", "max_event_bytes",
                 "skipped")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self.skipped = 0  # events dropped for their size
        self._line = bytearray()
        self._data: list[bytes] = []
        self._held = 0  # bytes in _data, a newline each
        self._cr = False  # the last chunk ended in CR: a LF first in the next is its pair
        self._oversized = False

    @property
    def held(self) -> int:
        """Bytes kept of the unfinished event."""
        return len(self._line) + self._held

    def skip(self, chunk: bytes) -> None:
        """A chunk over the per-chunk bound, not parsed: the event it ends in is dropped
        and counted as an oversized one (as is the rest of the line it ends in, where it
        ends mid-line), and parsing resumes after that."""
        self._line.clear()
        self._data.clear()
        self._held = 0
        self._cr = False
        if chunk.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
            self._oversized = False
            self.skipped += 1
        else:
            self._oversized = True

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._cr or b"\r" in chunk:
            return self._feed_cr(chunk)
        # The usual chunk, LF line ends only: split at C speed, and handle each line
        # inline unless an earlier chunk left a line open or an event is being dropped.
        lines = chunk.split(b"\n")
        tail = lines.pop()
        events: list[bytes] = []
        data = self._data
        for line in lines:
            if self._line or self._oversized or \
                    len(line) + self._held > self.max_event_bytes:
                self._keep(line)
                self._line_done(events)
            elif not line:
                if data:
                    events.append(b"\n".join(data))
                    data.clear()
                    self._held = 0
            elif line.startswith(b"data:"):
                value = line[6:] if line[5:6] == b" " else line[5:]
                data.append(value)
                self._held += len(value) + 1
            elif line == b"data":
                data.append(b"")
                self._held += 1
        if tail:
            self._keep(tail)
        return events

    def _feed_cr(self, chunk: bytes) -> list[bytes]:
        events: list[bytes] = []
        start = 0
        if self._cr and chunk[:1] == b"\n":
            start = 1
        self._cr = False
        end = len(chunk)
        while start < end:
            cut = _line_end(chunk, start)
            if cut < 0:
                self._keep(chunk[start:])
                break
            self._keep(chunk[start:cut])
            if chunk[cut] == 13:  # CR: CRLF counts once, also across two chunks
                if cut + 1 < end:
                    start = cut + 2 if chunk[cut + 1] == 10 else cut + 1
                else:
                    self._cr = True
                    start = end
            else:
                start = cut + 1
            self._line_done(events)
        return events

    def _keep(self, part: bytes) -> None:
        if self._oversized:
            return
        if len(self._line) + len(part) + self._held > self.max_event_bytes:
            self._oversized = True
            self._line.clear()
            self._data.clear()
            self._held = 0
            return
        self._line += part

    def _line_done(self, events: list[bytes]) -> None:
        line = bytes(self._line)
        self._line.clear()
        if not line:  # a blank line ends the event
            if self._oversized:
                self.skipped += 1
                self._oversized = False
            elif self._data:
                events.append(b"\n".join(self._data))
            self._data.clear()
            self._held = 0
            return
        if self._oversized:
            return
        if line.startswith(b"data:"):
            value = line[5:]
            value = value[1:] if value.startswith(b" ") else value
        elif line == b"data":
            value = b""
        else:
            return
        self._data.append(value)
        self._held += len(value) + 1


class LineSplitter:
    """`feed(chunk)` -> each complete non-blank line (newline-delimited JSON)."""

    __slots__ = ("_line", "_oversized", "max_event_bytes", "skipped")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self.skipped = 0
        self._line = bytearray()
        self._oversized = False

    @property
    def held(self) -> int:
        return len(self._line)

    def skip(self, chunk: bytes) -> None:
        """A chunk over the per-chunk bound, not parsed: the line it is part of is dropped
        and counted; the stream resumes at the next line that starts after it."""
        if chunk.endswith(b"\n"):
            self._line.clear()
            self._oversized = False
            self.skipped += 1
        else:
            self._oversized = True
            self._line.clear()

    def feed(self, chunk: bytes) -> list[bytes]:
        lines: list[bytes] = []
        start = 0
        while True:
            cut = chunk.find(b"\n", start)
            part = chunk[start:] if cut < 0 else chunk[start:cut]
            if not self._oversized:
                if len(self._line) + len(part) > self.max_event_bytes:
                    self._oversized = True
                    self._line.clear()
                else:
                    self._line += part
            if cut < 0:
                return lines
            if self._oversized:
                self.skipped += 1
                self._oversized = False
            else:
                line = bytes(self._line).strip()
                if line:
                    lines.append(line)
            self._line.clear()
            start = cut + 1


def _line_end(chunk: bytes, start: int) -> int:
    """The index of the first CR or LF at or after `start`, or -1."""
    lf = chunk.find(b"\n", start)
    cr = chunk.find(b"\r", start, lf if lf >= 0 else len(chunk))
    return cr if cr >= 0 else lf


class GrpcSplitter:
    """`feed(chunk)` -> each whole gRPC message of a response stream (its 5-byte prefix
    taken off). A message over `max_event_bytes`, or compressed (its payload would need
    the codec), is skipped by its length and counted, and the stream goes on."""

    __slots__ = ("_buffer", "_skip", "max_event_bytes", "skipped")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self.skipped = 0
        self._buffer = bytearray()
        self._skip = 0  # bytes of a skipped message still to come

    @property
    def held(self) -> int:
        return len(self._buffer)

    def skip(self, chunk: bytes) -> None:
        """A chunk over the per-chunk bound, not parsed: the message framing is lost with
        it, so nothing more of the stream is parsed (counted once)."""
        self.skipped += 1
        self._buffer.clear()
        self._skip = -1

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._skip < 0:  # framing lost to a skipped chunk
            return []
        if self._skip:
            taken = min(self._skip, len(chunk))
            self._skip -= taken
            chunk = chunk[taken:]
        buffer = self._buffer
        buffer += chunk
        messages: list[bytes] = []
        while len(buffer) >= 5:
            compressed, size = buffer[0], int.from_bytes(buffer[1:5], "big")
            if compressed or size > self.max_event_bytes:
                self.skipped += 1
                taken = min(size, len(buffer) - 5)
                del buffer[:5 + taken]
                self._skip = size - taken
                if self._skip:
                    # The rest of this chunk was the message's: what follows is in the
                    # next chunks, which the skip above consumes first.
                    break
                continue
            if len(buffer) < 5 + size:
                break
            messages.append(bytes(buffer[5:5 + size]))
            del buffer[:5 + size]
        return messages
