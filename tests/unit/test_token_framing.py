"""SSE and NDJSON events out of bodies cut anywhere: the same events whatever the cuts,
bounded, with oversized events dropped and counted."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from sitsmesh.tokens.framing import GrpcSplitter, LineSplitter, SseSplitter

OPENAI = (b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
          b": keep-alive comment\n\n"
          b'data: {"choices":[{"delta":{"content":"lo"}}]}\r\n\r\n'
          b"event: ping\nid: 7\nretry: 100\n\n"
          b"data: first line\ndata:second line\ndata\n\n"
          b"data: [DONE]\n\n")
EVENTS = [b'{"choices":[{"delta":{"content":"Hel"}}]}',
          b'{"choices":[{"delta":{"content":"lo"}}]}',
          b"first line\nsecond line\n",
          b"[DONE]"]


def _all(splitter: SseSplitter | LineSplitter | GrpcSplitter, chunks: list[bytes]
         ) -> list[bytes]:
    return [event for chunk in chunks for event in splitter.feed(chunk)]


def _cut(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(body) + 1) for c in cuts})
    bounds = [0, *points, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(bounds)]


def test_sse_events_in_one_chunk() -> None:
    assert SseSplitter().feed(OPENAI) == EVENTS


@given(st.lists(st.integers(min_value=0), max_size=40))
def test_sse_events_are_the_same_however_the_body_is_cut(cuts: list[int]) -> None:
    assert _all(SseSplitter(), _cut(OPENAI, cuts)) == EVENTS


@given(st.lists(st.integers(min_value=0), max_size=20))
def test_cr_only_line_ends_and_a_crlf_cut_between_chunks(cuts: list[int]) -> None:
    body = b"data: a\r\rdata: b\r\n\r\ndata: c\n\n"
    assert _all(SseSplitter(), _cut(body, cuts)) == [b"a", b"b", b"c"]


def test_an_unfinished_event_is_kept_until_its_blank_line() -> None:
    splitter = SseSplitter()
    assert splitter.feed(b"data: half") == []
    assert splitter.feed(b" and the rest\n") == []
    assert splitter.feed(b"\n") == [b"half and the rest"]


def test_an_oversized_event_is_dropped_whole_and_the_stream_goes_on() -> None:
    splitter = SseSplitter(max_event_bytes=100)
    huge = b"data: " + b"x" * 60 + b"\ndata: " + b"y" * 60 + b"\n\n"
    assert splitter.feed(huge[:50]) == []
    assert splitter.feed(huge[50:] + b"data: next\n\n") == [b"next"]
    assert splitter.skipped == 1
    # What it keeps stays within the bound while the event goes on.
    assert splitter.feed(b"data: " + b"z" * 10_000) == []
    assert len(splitter._line) == 0


@given(st.lists(st.integers(min_value=0), max_size=30))
def test_ndjson_lines_however_the_body_is_cut(cuts: list[int]) -> None:
    body = b'{"response":"a","done":false}\n\n{"response":"b"}\r\n{"done":true}\n'
    assert _all(LineSplitter(), _cut(body, cuts)) == [
        b'{"response":"a","done":false}', b'{"response":"b"}', b'{"done":true}']


def test_an_oversized_line_is_dropped_and_counted() -> None:
    splitter = LineSplitter(max_event_bytes=10)
    assert splitter.feed(b'{"a":"' + b"x" * 50) == []
    assert splitter.feed(b'"}\n{"b":1}\n') == [b'{"b":1}']
    assert splitter.skipped == 1


def _frame(message: bytes, compressed: int = 0) -> bytes:
    return bytes([compressed]) + len(message).to_bytes(4, "big") + message


@given(st.lists(st.integers(min_value=0), max_size=30))
def test_grpc_messages_however_the_body_is_cut(cuts: list[int]) -> None:
    body = _frame(b"one") + _frame(b"") + _frame(b"z" * 300) + _frame(b"two")
    assert _all(GrpcSplitter(), _cut(body, cuts)) == [b"one", b"", b"z" * 300, b"two"]


@given(st.lists(st.integers(min_value=0), max_size=30))
def test_oversized_and_compressed_grpc_messages_are_skipped_by_length(cuts: list[int]) -> None:
    body = (_frame(b"a") + _frame(b"x" * 500) + _frame(b"c" * 10, compressed=1)
            + _frame(b"b"))
    splitter = GrpcSplitter(max_event_bytes=100)
    assert _all(splitter, _cut(body, cuts)) == [b"a", b"b"]
    assert splitter.skipped == 2


_SSE_LINES = st.sampled_from([b"data: a", b"data:b", b"data", b"data: " + b"x" * 40, b"",
                              b": comment", b"event: ping", b"id: 7", b"dat", b"data:  c"])


@given(st.lists(_SSE_LINES, max_size=30), st.lists(st.integers(min_value=0), max_size=20),
       st.integers(min_value=20, max_value=200))
def test_the_fast_path_for_lf_bodies_gives_what_the_general_path_does(
        lines: list[bytes], cuts: list[int], bound: int) -> None:
    # Chunks without a CR take the split-based path; the char-by-char one is the
    # reference, also for events over the bound (dropped and counted alike).
    body = b"\n".join(lines) + b"\n"
    fast, general = SseSplitter(max_event_bytes=bound), SseSplitter(max_event_bytes=bound)
    chunks = _cut(body, cuts)
    assert [e for c in chunks for e in fast.feed(c)] == \
        [e for c in chunks for e in general._feed_cr(c)]
    assert (fast.skipped, fast.held) == (general.skipped, general.held)


def test_a_chunk_over_the_chunk_bound_is_skipped_counted_and_parsing_goes_on() -> None:
    sse = SseSplitter()
    assert sse.feed(b"data: half") == []
    sse.skip(b"data: " + b"x" * 100 + b"\n\n")  # ends at an event's end
    assert (sse.skipped, sse.held) == (1, 0)
    assert sse.feed(b"data: next\n\n") == [b"next"]
    sse.skip(b"data: " + b"x" * 100)  # ends mid-event: the rest of its line goes too
    assert sse.feed(b"xx\n\ndata: after\n\n") == [b"after"]
    assert sse.skipped == 2

    lines = LineSplitter()
    lines.skip(b'{"a": 1}\n{"b": ')
    assert lines.feed(b'2}\n{"c": 3}\n') == [b'{"c": 3}']
    assert lines.skipped == 1

    grpc = GrpcSplitter()
    grpc.skip(_frame(b"x" * 100))
    # The framing is lost with the skipped bytes: nothing more is parsed, counted once.
    assert grpc.feed(_frame(b"one")) == [] and (grpc.skipped, grpc.held) == (1, 0)
