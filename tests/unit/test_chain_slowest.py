"""The slowest chains kept whole (heap, window, pipelines), and trace ids read strictly from
W3C traceparent headers, from an access-log entry through the hop bus to the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2

from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.histogram import Histogram
from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.chains.slowest import MAX_SLOWEST, SlowChain, Slowest, checked_limit, slowest_of
from sitsmesh.chains.trace import trace_id, valid_trace_id
from sitsmesh.shared.hopbus import decode, encode_hop
from sitsmesh.transport.accesslog import hop_from_entry

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
GOOD = f"00-{TRACE}-00f067aa0ba902b7-01"
DEMO = pipeline_from("demo", {"stages": [
    {"name": "pre", "match": {"upstream_cluster": "pre"}},
    {"name": "model", "match": {"upstream_cluster": "model"}},
]})
OTHER = pipeline_from("other", {"stages": [{"name": "only", "match": {"route_name": "o"}}]})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_valid_traceparent_gives_its_trace_id() -> None:
    assert trace_id(GOOD) == TRACE
    assert trace_id(f"00-{TRACE}-00f067aa0ba902b7-00") == TRACE  # not sampled: still a trace
    assert valid_trace_id(TRACE)


@pytest.mark.parametrize("value", [
    "",
    "garbage",
    f"00-{'0' * 32}-00f067aa0ba902b7-01",              # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",                       # all-zero parent id
    f"00-{TRACE.upper()}-00f067aa0ba902b7-01",         # the spec wants lowercase
    f"01-{TRACE}-00f067aa0ba902b7-01",                 # a version we do not read
    f"ff-{TRACE}-00f067aa0ba902b7-01",                 # the forbidden version
    f"00-{TRACE}-00f067aa0ba902b7-01-extra",           # longer than version 00
    f"00-{TRACE}-00f067aa0ba902b7-1",                  # short flags
    f"00-{TRACE[:-1]}g-00f067aa0ba902b7-01",           # not hex
    f"00_{TRACE}_00f067aa0ba902b7_01",                 # wrong separators
    f" 0-{TRACE}-00f067aa0ba902b7-01",
    GOOD + "\n",
    GOOD * 2000,                                       # long: refused on its length
])
def test_anything_else_has_no_trace_id(value: str) -> None:
    assert trace_id(value) == ""


@pytest.mark.parametrize("value", ["", "0" * 32, TRACE.upper(), TRACE[:-1], TRACE + "0", GOOD])
def test_only_a_bare_nonzero_lowercase_id_is_a_trace_id(value: str) -> None:
    assert not valid_trace_id(value)


def _chain(rid: str, e2e: float) -> SlowChain:
    return SlowChain(rid, "", e2e * 1000, ())


def test_the_heap_keeps_the_n_slowest_and_never_more() -> None:
    kept = Slowest(3)
    for i, e2e in enumerate([0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 0.9]):
        if kept.admits(e2e):
            kept.push(e2e, i, _chain(f"r{i}", e2e))
        assert len(kept.heap) <= 3
    assert not kept.admits(0.5)  # not slower than the fastest kept (0.7)
    # Slowest first; the two 0.9 s chains in arrival order, the later tie was not let in
    # over an equal one.
    assert [c.request_id for c in slowest_of([kept], 3)] == ["r2", "r6", "r4"]
    assert [c.request_id for c in slowest_of([kept], 1)] == ["r2"]


def test_the_top_of_several_slots_is_the_top_of_their_union() -> None:
    a, b = Slowest(2), Slowest(2)
    for i, e2e in enumerate([0.4, 0.8, 0.1]):
        a.push(e2e, i, _chain(f"a{i}", e2e))
    for i, e2e in enumerate([0.6, 0.9]):
        b.push(e2e, 10 + i, _chain(f"b{i}", e2e))
    assert [c.request_id for c in slowest_of([a, b], 3)] == ["b1", "a1", "b0"]


@pytest.mark.parametrize("limit", [0, -1, MAX_SLOWEST + 1, True, 2.5])
def test_the_number_kept_is_bounded(limit: object) -> None:
    with pytest.raises(ValueError, match=r"1\.\.20"):
        checked_limit(limit)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Assembler({}, slowest=limit)  # type: ignore[arg-type]


def _add(asm: Assembler, rid: str, t0: float, pre: float, model: float,
         trace: tuple[str, str] = ("", "")) -> None:
    asm.add(Hop(rid, t0, pre, upstream_cluster="pre", trace_id=trace[0]))
    asm.add(Hop(rid, t0 + 0.005, model, upstream_cluster="model", trace_id=trace[1]))


def test_report_names_the_slowest_chains_with_trace_ids_and_waterfall() -> None:
    clock = Clock()
    asm = Assembler({"demo": DEMO, "other": OTHER}, clock=clock, slowest=3)
    other_trace = "a" * 32
    for i in range(10):
        # The pre hop has no trace id, the model hop does: the first hop that has one wins.
        _add(asm, f"r{i}", 100.0 + i, 0.020 + i * 0.010, 0.010, ("", f"{i:032x}"[:31] + "1"))
    _add(asm, "t", 200.0, 0.5, 0.1, (TRACE, other_trace))
    asm.add(Hop("o1", 300.0, 9.0, route_name="o"))  # much slower, another pipeline
    report = asm.report("demo", 60)
    assert report is not None
    assert [c.request_id for c in report.slowest] == ["t", "r9", "r8"]
    slowest = report.slowest[0]
    assert slowest.trace_id == TRACE  # the first hop's, not the second's
    assert report.slowest[1].trace_id == f"{9:032x}"[:31] + "1"
    assert slowest.e2e_ms == 500.0 and not slowest.failed
    assert [(s.name, s.offset_ms, s.own_ms, s.total_ms) for s in slowest.stages] == [
        ("pre", 0.0, 400.0, 500.0), ("model", 5.0, 100.0, 100.0)]
    other = asm.report("other", 60)
    assert other is not None and [c.request_id for c in other.slowest] == ["o1"]
    # Histograms: one per stage in stage order, the counts add up to the chains.
    assert [h.name for h in report.histograms] == ["pre", "model"]
    for hist in report.histograms:
        assert sum(n for _, n in hist.buckets) == 11
        bounds = [le for le, _ in hist.buckets]
        assert bounds == sorted(bounds)
    model = dict(report.histograms[1].buckets)
    assert sum(n for le, n in model.items() if 100 <= le <= 105) == 1  # the 100 ms hop


def test_the_window_drops_slots_older_than_it() -> None:
    clock = Clock()
    asm = Assembler({"demo": DEMO}, clock=clock, slowest=2)
    _add(asm, "old-slow", 1.0, 2.0, 0.1)
    clock.now += 120
    _add(asm, "new", 2.0, 0.05, 0.01)
    report = asm.report("demo", 60)
    assert report is not None
    assert [c.request_id for c in report.slowest] == ["new"]
    five = asm.report("demo", 300)
    assert five is not None
    assert [c.request_id for c in five.slowest] == ["old-slow", "new"]


def test_incomplete_chains_are_not_among_the_slowest() -> None:
    clock = Clock()
    asm = Assembler({"demo": DEMO}, clock=clock, ttl_s=5)
    asm.add(Hop("half", 1.0, 30.0, upstream_cluster="pre"))
    clock.now += 10
    assert asm.expire() == 1
    report = asm.report("demo", 60)
    assert report is not None and report.slowest == () and report.incomplete == 1
    assert all(h.buckets == () for h in report.histograms)


def test_histogram_buckets_are_the_non_empty_ones_with_upper_bounds() -> None:
    hist = Histogram()
    for seconds in (0.001, 0.001, 0.1):
        hist.add(seconds)
    buckets = hist.buckets()
    assert [n for _, n in buckets] == [2, 1]
    assert 0.001 <= buckets[0][0] < 0.001 * 1.05 and 0.1 <= buckets[1][0] < 0.1 * 1.05


def _entry(traceparent: str | None) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.common_properties.start_time.seconds = 1_700_000_000
    entry.common_properties.duration.nanos = 5_000_000
    entry.common_properties.upstream_cluster = "pre"
    entry.request.request_id = "rid"
    if traceparent is not None:
        entry.request.request_headers["traceparent"] = traceparent
    return entry


@pytest.mark.parametrize(("header", "expected"), [
    (GOOD, TRACE), (None, ""), ("", ""), (f"00-{'0' * 32}-00f067aa0ba902b7-01", ""),
    ("<script>alert(1)</script>", ""), ("x" * 10_000, "")])
def test_the_access_log_entry_gives_the_hop_its_trace_id(header: str | None,
                                                         expected: str) -> None:
    hop = hop_from_entry(_entry(header))
    assert hop is not None and hop.trace_id == expected and hop.duration == 0.005


@pytest.mark.parametrize(("flags", "code", "failed"), [
    ((), 200, False), (("delay_injected",), 200, False), ((), 503, True),
    (("upstream_request_timeout",), 504, True), (("upstream_connection_failure",), 200, True),
    (("delay_injected", "fault_injected"), 200, True)])
def test_a_hop_fails_on_a_5xx_or_a_failure_flag_but_not_on_an_injected_delay(
        flags: tuple[str, ...], code: int, failed: bool) -> None:
    entry = _entry(None)
    entry.response.response_code.value = code
    for flag in flags:
        setattr(entry.common_properties.response_flags, flag, True)
    hop = hop_from_entry(entry)
    assert hop is not None and hop.failed is failed


def test_the_trace_id_crosses_the_hop_bus_and_a_forged_one_is_refused() -> None:
    hop = Hop("r1", 1.5, 0.1, upstream_cluster="pre", trace_id=TRACE)
    event = json.loads(json.dumps(encode_hop(hop)))
    assert len(event) == 13 and decode(event) == hop
    plain = Hop("r2", 1.5, 0.1, upstream_cluster="pre")
    assert len(encode_hop(plain)) == 12  # as before trace ids: older replicas read it
    assert decode(encode_hop(plain)) == plain
    for forged in ("<script>", TRACE.upper(), "0" * 32, 5):
        with pytest.raises(ValueError):
            decode([*encode_hop(plain), forged])


def test_envoy_and_istio_log_the_traceparent_header() -> None:
    import yaml

    root = Path(__file__).resolve().parents[2]
    fragment = yaml.safe_load((root / "filters/fragments/access_log.yaml").read_text())
    assert "traceparent" in fragment["access_log"]["typed_config"][
        "additional_request_headers_to_log"]
    istio = yaml.safe_load((root / "deploy/istio/extension-provider.yaml").read_text())
    [provider] = [p for p in istio["spec"]["meshConfig"]["extensionProviders"]
                  if "envoyHttpAls" in p]
    assert "traceparent" in provider["envoyHttpAls"]["additionalRequestHeadersToLog"]
