"""Reading back the token timing Envoy's Lua filter leaves on an access-log entry
(sitsmesh/tokens/envoytimed.py): the same figures the ext_proc observer's clock gives
for the same token times, how a stream that was cut ended, and precise refusals of
fields the filter does not write."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

from sitsmesh.tokens import envoytimed
from sitsmesh.tokens.stream import TokenReport
from sitsmesh.tokens.timing import End, StreamClock
from sitsmesh.transport.accesslog import AccessLogServicer

START_US = 1_796_000_000_000_000  # the entry's start_time, in microseconds


def _entry(fields: dict[str, Any] | None, *, flags: tuple[str, ...] = (),
           duration_s: float = 0.0) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    common.start_time.seconds, micros = divmod(START_US, 1_000_000)
    common.start_time.nanos = micros * 1000
    common.upstream_cluster, common.route_name = "llm", "chat"
    common.duration.seconds = int(duration_s)
    common.duration.nanos = round((duration_s % 1) * 1e9)
    common.time_to_last_downstream_tx_byte.seconds = 1
    for flag in flags:
        setattr(common.response_flags, flag, True)
    entry.request.request_id, entry.request.path = "r1", "/v1/chat/completions"
    if fields is not None:
        common.metadata.filter_metadata[envoytimed.NAMESPACE].update(fields)
    return entry


def _read(entry: accesslog_pb2.HTTPAccessLogEntry, stall_s: float = 1.0
          ) -> TokenReport:
    fields = envoytimed.timed(entry)
    assert fields is not None
    return envoytimed.report(entry, fields, lambda cluster, route: stall_s)


def _us(seconds: float) -> int:
    return START_US + round(seconds * 1e6)


def test_a_whole_stream_gives_the_clock_s_figures_for_the_same_token_times() -> None:
    # First token at 0.15 s, then gaps of 20 ms, one event of 3 tokens, a 1.5 s stall.
    times = [0.15, 0.17, 0.19, 0.21, 1.71, 1.73]
    counts = [1, 1, 3, 1, 1, 1]
    gaps = [round((b - a) * 1e6) for a, b in itertools.pairwise(times)]
    g = ",".join(str(gap) if k == 1 else f"{gap}*{k}"
                 for gap, k in zip(gaps, counts[1:], strict=True))
    report = _read(_entry({"f": "openai", "t0": _us(0.15), "k0": 1, "g": g,
                           "n": sum(counts), "tl": _us(1.73), "te": _us(1.74),
                           "end": "done"}))
    clock = StreamClock(0.0, 1.0)
    for at, k in zip(times, counts, strict=True):
        clock.tokens(k, at)
    expected = clock.summary(End.COMPLETE, 1.74)
    got = report.summary
    assert (got.tokens, got.stall_count, got.end) == (8, 1, End.COMPLETE)
    assert got.ttft_s == pytest.approx(expected.ttft_s, abs=1e-6)
    assert got.itl_p50_s == pytest.approx(expected.itl_p50_s, abs=1e-6)
    assert got.itl_p99_s == pytest.approx(expected.itl_p99_s, abs=1e-6)
    assert got.stalls[0].length_s == pytest.approx(1.5, abs=1e-6)
    assert got.stalls[0].after_s == pytest.approx(0.21, abs=1e-6)
    assert (report.request_id, report.format, report.cluster, report.route) == (
        "r1", "openai", "llm", "chat")


def test_usage_gives_the_count_and_an_engine_error_ends_it_as_an_error() -> None:
    fields = {"f": "openai", "t0": _us(0.1), "k0": 1, "g": "20000", "n": 2,
              "tl": _us(0.12), "te": _us(0.13), "end": "done", "u": "7,40,3"}
    report = _read(_entry(fields))
    assert report.usage is not None and (report.usage.prompt_tokens,
                                         report.usage.completion_tokens,
                                         report.usage.cached_tokens) == (7, 40, 3)
    assert report.summary.tokens == 40
    errored = _read(_entry({**fields, "err": True, "bad": 1}))
    assert errored.summary.end is End.ERROR and errored.bad_events == 1


@pytest.mark.parametrize(("flags", "end"), [
    ((), End.CUT),
    (("downstream_connection_termination",), End.CLIENT_ABORT),
    (("downstream_remote_reset",), End.CLIENT_ABORT),
    (("upstream_remote_reset",), End.UPSTREAM_RESET),
    (("stream_idle_timeout",), End.IDLE_TIMEOUT),
])
def test_a_cut_stream_ends_as_envoy_s_flags_say_and_keeps_every_token(
        flags: tuple[str, ...], end: End) -> None:
    # The gaps were last written at the third token; two more came before the cut.
    report = _read(_entry({"f": "openai", "t0": _us(0.1), "k0": 1, "g": "20000,20000",
                           "n": 5, "tl": _us(0.2)}, flags=flags, duration_s=2.5))
    summary = report.summary
    assert (summary.end, summary.tokens) == (end, 5)
    # From the last token (0.2 s) to the end Envoy logged (2.5 s): a stall at the end.
    assert summary.stall_count == 1
    assert summary.stalls[0].length_s == pytest.approx(2.3, abs=1e-6)
    # Gaps were kept only for what was written: the untimed two add none.
    assert summary.itl_p50_s == pytest.approx(0.02, abs=1e-6)


def test_a_stream_with_no_token_has_no_ttft() -> None:
    report = _read(_entry({"f": "ndjson", "te": _us(0.5), "end": "body"}))
    assert report.summary.ttft_s is None and report.summary.tokens == 0


@pytest.mark.parametrize(("fields", "error"), [
    ({"f": "xml"}, "format"),
    ({"f": "openai", "t0": _us(0.1), "k0": 1, "g": "-5"}, "gap"),
    ({"f": "openai", "t0": _us(0.1), "k0": 1, "g": "5*0"}, "gap"),
    ({"f": "openai", "t0": _us(0.1), "k0": 1, "g": "5,x"}, "gap"),
    ({"f": "openai", "t0": _us(0.1), "k0": 1, "g": "5*x"}, "gap"),
    # A sender's huge numbers are refused by length, before int() is asked to read them.
    ({"f": "openai", "t0": _us(0.1), "k0": 1, "g": "9" * 4000}, "gap"),
    ({"f": "openai", "t0": _us(0.1), "k0": 1, "g": "5*" + "9" * 4000}, "gap"),
    ({"f": "openai", "t0": _us(0.1), "k0": 1, "g": "9" * (envoytimed.MAX_GAPS_TEXT + 1)},
     "g is not a string"),
    ({"f": "openai", "n": "many"}, "n is not a count"),
    ({"f": "openai", "n": -1}, "n is not a count"),
    ({"f": "openai", "n": 1.5}, "n is not a count"),
    ({"f": "openai", "u": "1,2"}, "usage"),
    ({"f": 3}, "f is not a string"),
])
def test_fields_the_filter_does_not_write_are_refused(fields: dict[str, Any], error: str
                                                      ) -> None:
    entry = _entry(fields)
    with pytest.raises(envoytimed.Unreadable, match=error):
        envoytimed.report(entry, entry.common_properties.metadata.filter_metadata[
            envoytimed.NAMESPACE].fields, lambda cluster, route: 1.0)


def test_only_entries_the_filter_wrote_are_read() -> None:
    assert envoytimed.timed(_entry(None)) is None
    other = _entry(None)
    other.common_properties.metadata.filter_metadata["envoy.filters.http.ext_authz"].update(
        {"tenant": "a"})
    assert envoytimed.timed(other) is None
    # The request filter notes the path before the response says it is a stream.
    assert envoytimed.timed(_entry({"path": "generate_stream"})) is None


def test_the_access_log_service_hands_over_only_timed_entries() -> None:
    class Sink:
        def add(self, hop: object) -> None:
            pass

    seen: list[str] = []
    servicer = AccessLogServicer(Sink(), lambda request_id, end: False,
                                 tokens=lambda entry, fields: seen.append(
                                     entry.request.request_id))
    message = als_pb2.StreamAccessLogsMessage()
    timed = _entry({"f": "openai", "n": 0})
    plain = _entry(None)
    plain.request.request_id = "r2"
    message.http_logs.log_entry.extend([timed, plain])

    async def stream() -> Any:
        yield message

    asyncio.run(servicer.StreamAccessLogs(stream(), None))  # type: ignore[arg-type]
    assert seen == ["r1"]


def test_a_completion_that_did_not_stream_carries_only_its_usage() -> None:
    report = _read(_entry({"f": "json", "u": "12,30,0", "te": _us(0.5), "end": "body"}))
    assert report.format == envoytimed.JSON
    assert report.usage is not None and report.usage.completion_tokens == 30
    assert (report.summary.tokens, report.summary.ttft_s) == (30, None)
