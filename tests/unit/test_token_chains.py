"""Token streams on latency chains: the TTFT attribution rule and the join by request id."""

from __future__ import annotations

import pytest

from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.chains.tokenjoin import TokenJoin, attribution
from sitsmesh.chains.ttft import owner, request_tokens, ttft_shares
from sitsmesh.tokens.timing import End, Stall, StreamSummary

PIPE = Pipeline("chat", (Stage("guard", "upstream_cluster", "guard"),
                         Stage("llm", "upstream_cluster", "llm")))


def summary(ttft: float | None, itl: float = 0.02, tokens: int = 10,
            stalls: tuple[Stall, ...] = ()) -> StreamSummary:
    return StreamSummary(ttft, itl, itl * 1.5, tokens, 1 / itl, stalls, len(stalls),
                         End.COMPLETE)


def hops(guard_s: float, llm_ttft_s: float, rid: str = "r") -> dict[str, Hop]:
    """Entry hop at 100 (cluster guard: the guard proxy), the LLM hop nested in it after
    the guard's own work, both ending after 1 s of streaming."""
    end = 100 + guard_s + llm_ttft_s + 1.0
    return {"guard": Hop(rid, 100.0, end - 100.0, upstream_cluster="guard"),
            "llm": Hop(rid, 100.0 + guard_s, end - 100.0 - guard_s, upstream_cluster="llm")}


def test_a_guard_before_the_llm_owns_the_ttft_it_spent() -> None:
    chain = hops(0.5, 0.1)
    figures = request_tokens("r", "", chain, {"guard": summary(0.6), "llm": summary(0.1)},
                             1.6, order=("guard", "llm"))
    assert figures is not None
    assert figures.source == "llm" and figures.ttft_s == pytest.approx(0.6)
    assert figures.shares == pytest.approx({"guard": 0.5, "llm": 0.1})
    assert owner(figures.shares) == "guard"
    # The LLM's own TTFT dominating: the LLM owns it.
    chain = hops(0.01, 0.3)
    figures = request_tokens("r", "", chain, {"guard": summary(0.31), "llm": summary(0.3)},
                             1.31, order=("guard", "llm"))
    assert figures is not None and owner(figures.shares) == "llm"


def test_without_a_stream_at_the_entry_the_sources_first_token_counts_from_the_entry() -> None:
    chain = hops(0.2, 0.1)
    figures = request_tokens("r", "", chain, {"llm": summary(0.1)}, 1.3, order=("guard", "llm"))
    assert figures is not None and figures.ttft_s == pytest.approx(0.3)
    assert figures.shares == pytest.approx({"guard": 0.2, "llm": 0.1})
    assert [s.stage for s in figures.streams] == ["llm"]
    assert request_tokens("r", "", chain, {}, 1.3, order=("guard", "llm")) is None


def test_stages_after_the_first_token_own_none_of_it() -> None:
    chain = {"a": Hop("r", 0.0, 2.0), "b": Hop("r", 0.1, 0.5), "post": Hop("r", 1.0, 0.5)}
    assert ttft_shares(chain, 0.0, 0.4) == pytest.approx({"a": 0.1, "b": 0.3})
    assert ttft_shares(chain, 0.0, 0.0) == {}


def test_attribution_is_the_mean_part_over_the_requests() -> None:
    assert attribution([{"a": 1.0}, {"a": 0.0, "b": 2.0}]) == {"a": 0.5, "b": 1.0}
    assert attribution([]) == {}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def joined(clock: Clock, **kw: int) -> tuple[Assembler, TokenJoin]:
    assembler = Assembler({"chat": PIPE}, clock=clock)
    join = TokenJoin(clock=clock, **kw)  # type: ignore[arg-type]
    assembler.on_close = join.closed
    return assembler, join


def add_chain(assembler: Assembler, rid: str, guard_s: float, llm_ttft_s: float) -> None:
    for hop in hops(guard_s, llm_ttft_s, rid).values():
        assembler.add(hop)


def test_reports_join_their_chain_in_either_order_and_the_slow_guard_owns_ttft() -> None:
    clock = Clock()
    assembler, join = joined(clock)
    # 200 requests: the LLM's TTFT is 100 ms; the slowest 1 % (2) spend 900 ms in the guard.
    for i in range(200):
        rid = f"r{i}"
        guard = 0.9 if i in (17, 160) else 0.01
        streams = {"guard": summary(guard + 0.1), "llm": summary(0.1)}
        if i % 2 == 0:  # reports first, then the chain (so the pipeline streams)
            for stage, s in streams.items():
                join.report(rid, "chat", stage, s)
            add_chain(assembler, rid, guard, 0.1)
        else:      # the chain first
            add_chain(assembler, rid, guard, 0.1)
            for stage, s in streams.items():
                join.report(rid, "chat", stage, s)
    report = join.report_for("chat", 60)
    assert report.chains == 200 and join.waiting() == (0, 0)
    assert report.ttft_owner == "guard"
    assert report.attributed_ms["guard"] == pytest.approx(900, abs=1)
    assert report.share["guard"] == pytest.approx(0.9, abs=0.01)
    assert report.ttft_p50_ms == pytest.approx(110, rel=0.05)
    assert report.itl_p50_ms == pytest.approx(20, rel=0.05)


def test_a_stall_is_kept_with_its_stage_length_and_offset() -> None:
    clock = Clock()
    assembler, join = joined(clock)
    stalled = summary(0.1, stalls=(Stall(0.3, 2.0),))
    join.report("s", "chat", "llm", stalled)
    join.report("s", "chat", "guard", summary(0.11))
    add_chain(assembler, "s", 0.01, 0.1)
    report = join.report_for("chat", 60)
    assert report.stall_max_ms == {"llm": 2000.0}
    figures = report.requests["s"]
    assert figures.longest_stall == ("llm", 300.0, 2000.0)


def test_a_closed_chain_waits_for_missing_reports_then_joins_what_came() -> None:
    clock = Clock()
    assembler, join = joined(clock)
    join.report("x", "chat", "llm", summary(0.1))  # marks the pipeline as streaming
    add_chain(assembler, "y", 0.01, 0.1)
    join.report("y", "chat", "llm", summary(0.1))  # the guard hop never reports
    assert join.waiting() == (2, 1)
    clock.now += 3
    report = join.report_for("chat", 60)
    assert report.chains == 1 and join.waiting() == (1, 0)
    # A pipeline that never streamed holds nothing.
    other = Pipeline("plain", (Stage("a", "upstream_cluster", "a"),))
    join.closed("z", other, {"a": Hop("z", 0.0, 1.0)}, 1.0, "")
    assert join.waiting() == (1, 0)


def test_reports_whose_chain_never_comes_are_dropped_and_counted() -> None:
    clock = Clock()
    _, join = joined(clock, max_pending=3)
    for i in range(5):
        join.report(f"lost{i}", "chat", "llm", summary(0.1))
    assert join.waiting() == (3, 0) and join.dropped["max_pending"] == 2
    clock.now += 31
    join.report_for("chat", 60)
    assert join.waiting() == (0, 0) and join.dropped["expired"] == 3
    assert join.report_for("chat", 60).dropped == 5


def test_a_relayed_stall_is_the_inner_stages() -> None:
    chain = hops(0.01, 0.1)  # the LLM's hop starts 10 ms after the guard's
    relayed = summary(0.11, stalls=(Stall(0.31, 2.0),))
    made = summary(0.1, stalls=(Stall(0.3, 2.0),))
    guard_own = summary(0.11, stalls=(Stall(5.0, 1.5),))  # no stall inside at that time
    figures = request_tokens("r", "", chain, {"guard": relayed, "llm": made}, 4.0,
                             order=("guard", "llm"))
    assert figures is not None
    assert {s.stage: s.stalls for s in figures.streams} == {
        "guard": (), "llm": ((300.0, 2000.0),)}
    assert figures.streams[0].stall_count == 1  # the count is what the stage saw
    figures = request_tokens("r", "", chain, {"guard": guard_own, "llm": made}, 7.0,
                             order=("guard", "llm"))
    assert figures is not None and figures.streams[0].stalls == ((5000.0, 1500.0),)


def test_the_streaming_stages_spans_carry_the_genai_figures_first_token_and_stalls() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sitsmesh.config import Settings
    from sitsmesh.telemetry import tracing

    exporter = InMemorySpanExporter()
    tracer = tracing.build(Settings(trace_sample_ratio=0.0), "single", exporter)
    clock = Clock()
    assembler, join = joined(clock)
    join.listen(tracer.token_streams)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    join.report("t", "chat", "guard", summary(0.6))
    join.report("t", "chat", "llm", summary(0.1, stalls=(Stall(0.3, 2.0),)))
    for hop in hops(0.5, 0.1, "t").values():
        hop.trace_id = trace_id
        assembler.add(hop)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"sitsmesh.token_stream guard", "sitsmesh.token_stream llm"}
    llm = spans["sitsmesh.token_stream llm"]
    assert llm.context is not None and f"{llm.context.trace_id:032x}" == trace_id
    assert llm.attributes is not None
    assert llm.attributes["gen_ai.server.time_to_first_token"] == pytest.approx(0.1)
    assert llm.attributes["gen_ai.usage.output_tokens"] == 10
    assert llm.attributes["sitsmesh.ttft_part_ms"] == pytest.approx(100)
    events = {e.name: e for e in llm.events}
    assert llm.start_time is not None
    assert events["gen_ai.first_token"].timestamp - llm.start_time == pytest.approx(1e8, rel=1e-3)
    assert events["sitsmesh.stall"].attributes == {"sitsmesh.stall_ms": 2000.0}
    assert spans["sitsmesh.token_stream guard"].parent == llm.parent  # one request's parent


def test_closed_chains_waiting_are_bounded_the_oldest_joined_with_what_came() -> None:
    clock = Clock()
    assembler, join = joined(clock, max_waiting=2)
    for i in range(3):  # only the LLM hops report: each chain waits for its guard's
        join.report(f"w{i}", "chat", "llm", summary(0.1))
        add_chain(assembler, f"w{i}", 0.01, 0.1)
    assert join.waiting() == (2, 2) and join.joined == 1
    assert join.dropped == {"expired": 0, "max_pending": 0}
