"""Chain assembly with an injected clock: own time, TTL, duplicates, attribution."""

from __future__ import annotations

import pytest

from sitsmesh.chains.assembler import Assembler, Hop, own_times
from sitsmesh.chains.histogram import Histogram
from sitsmesh.chains.pipeline import InvalidPipeline, pipeline_from

DEMO = pipeline_from("demo", {"stages": [
    {"name": "pre", "match": {"upstream_cluster": "pre"}, "sla_p99_ms": 50},
    {"name": "feat", "match": {"upstream_cluster": "feat"}},
    {"name": "model", "match": {"upstream_cluster": "model"}, "ttfb_p99_ms": 80},
]})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _hops(rid: str, t0: float, pre: float, feat: float, model: float,
          ttfb: float | None = None) -> list[Hop]:
    # Nested: pre's hop contains feat's, which contains model's.
    return [Hop(rid, t0, pre, upstream_cluster="pre"),
            Hop(rid, t0 + 0.001, feat, upstream_cluster="feat"),
            Hop(rid, t0 + 0.002, model, ttfb=ttfb, upstream_cluster="model")]


def test_own_time_subtracts_nested_spans() -> None:
    hops = {h.upstream_cluster: h for h in _hops("r", 0.0, 0.300, 0.250, 0.100)}
    own, e2e = own_times(hops)
    assert e2e == pytest.approx(0.300)
    assert own == pytest.approx({"pre": 0.050, "feat": 0.150, "model": 0.100})


def test_complete_chains_report_and_the_delayed_stage_is_the_bottleneck() -> None:
    clock = Clock()
    asm = Assembler({"demo": DEMO}, clock=clock)
    for i in range(200):
        delay = 0.120 if i % 10 == 0 else 0.0  # the slowest 10 % carry the delay
        for hop in reversed(_hops(f"r{i}", 0.0, 0.030 + delay, 0.020 + delay, 0.010,
                                  ttfb=0.004)):
            asm.add(hop)  # out of order: the innermost hop first
    report = asm.report("demo", 60)
    assert report is not None
    assert report.chains == 200 and report.incomplete == 0
    assert report.bottleneck == "feat"
    feat = next(s for s in report.stages if s.name == "feat")
    assert feat.attributed_ms == pytest.approx(130, rel=0.05)  # 10 ms own + 120 ms delay
    model = next(s for s in report.stages if s.name == "model")
    assert model.ttfb_p99_ms == pytest.approx(4, rel=0.05)
    assert model.total_p99_ms == pytest.approx(10, rel=0.05)
    assert report.e2e_p99_ms == pytest.approx(150, rel=0.05)


def test_missing_hop_expires_as_incomplete_and_duplicates_are_ignored() -> None:
    clock = Clock()
    asm = Assembler({"demo": DEMO}, clock=clock, ttl_s=5)
    pre, feat, _ = _hops("lost", 0.0, 0.03, 0.02, 0.01)
    asm.add(pre)
    asm.add(feat)
    asm.add(feat)
    assert asm.duplicates == 1 and asm.open_chains() == 1
    clock.now += 4.9
    assert asm.expire() == 0
    clock.now += 0.2
    assert asm.expire() == 1 and asm.open_chains() == 0
    report = asm.report("demo", 60)
    assert report is not None and report.incomplete == 1 and report.chains == 0
    assert report.bottleneck == ""


def test_open_chains_are_bounded() -> None:
    asm = Assembler({"demo": DEMO}, clock=Clock(), max_open=100)
    for i in range(1000):
        asm.add(Hop(f"r{i}", 0.0, 0.01, upstream_cluster="pre"))
    assert asm.open_chains() == 100
    report = asm.report("demo", 60)
    assert report is not None and report.incomplete == 900


def test_windows_drop_old_slots() -> None:
    clock = Clock()
    asm = Assembler({"demo": DEMO}, clock=clock)
    for hop in _hops("old", 0.0, 0.03, 0.02, 0.01):
        asm.add(hop)
    clock.now += 120
    report_1m = asm.report("demo", 60)
    report_5m = asm.report("demo", 300)
    assert report_1m is not None and report_1m.chains == 0
    assert report_5m is not None and report_5m.chains == 1


def test_stage_reports_join_by_name_and_unknown_entries_are_counted() -> None:
    asm = Assembler({"demo": DEMO}, clock=Clock())
    asm.add(Hop("r", 0.0, 0.03, upstream_cluster="pre"))
    asm.add(Hop("r", 0.001, 0.02, upstream_cluster="feat"))
    asm.add(Hop("r", 0.002, 0.01, pipeline="demo", stage="model"))
    asm.add(Hop("x", 0.0, 0.01, upstream_cluster="elsewhere"))
    report = asm.report("demo", 60)
    assert report is not None and report.chains == 1 and asm.unmatched == 1


def test_histogram_quantiles_are_within_bucket_error() -> None:
    hist = Histogram()
    for ms in range(1, 1001):
        hist.add(ms / 1000)
    assert hist.quantile(0.5) == pytest.approx(0.5, rel=0.05)
    assert hist.quantile(0.99) == pytest.approx(0.99, rel=0.05)
    other = Histogram()
    other.add(5.0)
    hist.merge(other)
    assert hist.total == 1001 and hist.quantile(1.0) == pytest.approx(5.0, rel=0.05)


@pytest.mark.parametrize(("body", "message"), [
    ({"stages": []}, "stages must be a non-empty list"),
    ({"stages": [{"name": "a", "match": {"cluster": "x"}}]}, "match must have exactly one of"),
    ({"stages": [{"name": "a", "match": {"upstream_cluster": "x"}},
                 {"name": "a", "match": {"route_name": "y"}}]}, "duplicate stage name 'a'"),
    ({"stages": [{"name": "a", "match": {"upstream_cluster": "x"}, "sla": 5}]},
     "unknown key 'sla'"),
    ({"stages": [{"name": "a", "match": {"upstream_cluster": "x"}, "sla_p99_ms": -1}]},
     "sla_p99_ms must be a positive number"),
])
def test_pipeline_validation(body: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidPipeline, match=message):
        pipeline_from("demo", body, "demo.yaml")


def test_a_hop_resent_after_its_chain_closed_is_a_duplicate() -> None:
    clock = Clock()
    asm = Assembler({"demo": DEMO}, clock=clock, ttl_s=5)
    hops = _hops("r", 0.0, 0.03, 0.02, 0.01)
    for hop in hops:
        asm.add(hop)
    asm.add(hops[1])
    clock.now += 10
    assert asm.expire() == 0 and asm.duplicates == 1
    report = asm.report("demo", 60)
    assert report is not None and (report.chains, report.incomplete) == (1, 0)


def test_backpressure_sees_every_hop_the_chain_keeps_one_per_stage() -> None:
    """A fan-out calls a stage twice per request: the chain keeps the first call, but the
    stage did both, so backpressure must count both (or it halves the stage's work)."""
    clock = Clock()
    asm = Assembler({"demo": DEMO}, clock=clock, ttl_s=5)
    seen: list[tuple[str, float]] = []
    asm.on_hop = lambda pipeline, stage, hop: seen.append((stage, hop.start))
    pre, feat, model = _hops("r", 0.0, 0.05, 0.04, 0.02)
    sibling = Hop("r", 0.0025, 0.02, upstream_cluster="model")
    late = Hop("r", 0.03, 0.001, upstream_cluster="model")  # after the chain closed
    for hop in (model, sibling, feat, pre, late):
        asm.add(hop)
    assert seen == [("model", 0.002), ("model", 0.0025), ("feat", 0.001), ("pre", 0.0),
                    ("model", 0.03)]
    assert asm.duplicates == 2  # the chain itself still keeps one hop per stage
    report = asm.report("demo", 60)
    assert report is not None and report.chains == 1


def test_failed_hops_and_queue_times_are_reported() -> None:
    asm = Assembler({"demo": DEMO}, clock=Clock())
    for i in range(10):
        hops = _hops(f"r{i}", 0.0, 0.03, 0.02, 0.01)
        hops[2].queue = 0.004
        hops[2].failed = i < 3
        for hop in hops:
            asm.add(hop)
    report = asm.report("demo", 60)
    assert report is not None and report.failed == 3 and report.chains == 10
    model = next(s for s in report.stages if s.name == "model")
    assert model.queue_p99_ms == pytest.approx(4, rel=0.05)
    assert next(s for s in report.stages if s.name == "pre").queue_p99_ms is None


def test_stages_match_by_route_name_and_stage_header() -> None:
    pipeline = pipeline_from("p", {"stages": [
        {"name": "edge", "match": {"route_name": "ingress"}},
        {"name": "worker", "match": {"header": "embed"}},
    ]})
    asm = Assembler({"p": pipeline}, clock=Clock())
    asm.add(Hop("r", 0.0, 0.05, route_name="ingress"))
    asm.add(Hop("r", 0.01, 0.02, stage_header="embed"))
    report = asm.report("p", 60)
    assert report is not None and report.chains == 1
    assert {s.name: s.p50_ms for s in report.stages} == pytest.approx(
        {"edge": 30, "worker": 20}, rel=0.05)


def test_open_chains_are_bounded_in_bytes_oldest_evicted_first() -> None:
    evicted: list[str] = []
    asm = Assembler({"demo": DEMO}, clock=Clock(), max_bytes=1 << 20, on_evict=evicted.append)
    # Half chains (pre only) with 4 KB stage headers: each holds ~5 KB until its TTL.
    for i in range(1000):
        asm.add(Hop(f"r{i}", 0.0, 0.1, upstream_cluster="pre", stage_header="h" * 4096))
        assert asm.open_bytes() <= 1 << 20
    assert asm.evicted["max_bytes"] == len(evicted) > 0 and set(evicted) == {"max_bytes"}
    assert asm.open_chains() == 1000 - len(evicted)
    # The newest chains survived: r999's missing hops complete it.
    for hop in _hops("r999", 0.0, 0.3, 0.2, 0.1)[1:]:
        asm.add(hop)
    report = asm.report("demo", 60)
    assert report is not None and report.chains == 1
    assert report.incomplete == len(evicted)


def test_eviction_by_count_is_counted_apart() -> None:
    evicted: list[str] = []
    asm = Assembler({"demo": DEMO}, clock=Clock(), max_open=10, on_evict=evicted.append)
    for i in range(15):
        asm.add(Hop(f"r{i}", 0.0, 0.1, upstream_cluster="pre"))
    assert evicted == ["max_open"] * 5 and asm.evicted == {"max_open": 5, "max_bytes": 0}


def test_closed_ids_are_bounded_in_bytes() -> None:
    asm = Assembler({"demo": DEMO}, clock=Clock(), max_bytes=1 << 20)
    for i in range(2000):
        for hop in _hops(f"{i:0>2000}", 0.0, 0.3, 0.2, 0.1):
            asm.add(hop)
    report = asm.report("demo", 60)
    assert report is not None and report.chains == 2000
    assert asm.open_bytes() == 0
    # 2000 closed 2 KB ids would be 4 MB; a quarter of the 1 MiB budget holds them.
    assert asm.closed_bytes() <= (1 << 20) // 4


def test_each_pipeline_reports_only_its_own_chains_even_with_stage_names_alike() -> None:
    other = pipeline_from("other", {"stages": [
        {"name": "pre", "match": {"upstream_cluster": "pre2"}},
        {"name": "model", "match": {"upstream_cluster": "model2"}},
    ]})
    asm = Assembler({"demo": DEMO, "other": other}, clock=Clock())
    for i in range(5):
        for hop in _hops(f"d{i}", 0.0, 0.030, 0.020, 0.010):
            asm.add(hop)
    for i in range(3):
        asm.add(Hop(f"o{i}", 0.0, 0.900, upstream_cluster="pre2"))
        asm.add(Hop(f"o{i}", 0.1, 0.700, upstream_cluster="model2"))
    demo, theirs = asm.report("demo", 60), asm.report("other", 60)
    assert demo is not None and theirs is not None
    assert (demo.chains, theirs.chains) == (5, 3)
    assert {s.name: s.p50_ms for s in demo.stages}["model"] == pytest.approx(10, rel=0.05)
    assert {s.name: s.p50_ms for s in theirs.stages}["model"] == pytest.approx(700, rel=0.05)
    assert demo.e2e_p99_ms == pytest.approx(30, rel=0.05)
    assert [c.request_id[0] for c in theirs.slowest] == ["o", "o", "o"]
