"""Finished chains tallied per pipeline and time slot, and the report built from tallies.

A tally is mergeable: its histograms add, its slowest chains are bounded heaps whose
union keeps the same top. So a report over the tallies of several replicas, each of
which assembled a disjoint share of the chains, is the report one process that
assembled them all would give. `encode`/`decode` carry a tally between replicas as
compact JSON-ready lists (histograms as their non-empty buckets only).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from sitsmesh.chains.histogram import BUCKETS, Histogram
from sitsmesh.chains.pipeline import Pipeline
from sitsmesh.chains.slowest import SlowChain, Slowest, SlowStage, slowest_of

# (e2e seconds, sequence, {stage: own seconds}): the slowest chains of a slot.
SlowEntry = tuple[float, int, dict[str, float]]


@dataclass(slots=True)
class Tally:
    """One pipeline's finished chains in one time slot."""

    # its slowest chains kept whole (request id, trace id, waterfall)
    kept: Slowest
    chains: int = 0
    incomplete: int = 0
    failed: int = 0
    e2e: Histogram = field(default_factory=Histogram)
    queue: dict[str, Histogram] = field(default_factory=dict)
    own: dict[str, Histogram] = field(default_factory=dict)
    ttfb: dict[str, Histogram] = field(default_factory=dict)
    total: dict[str, Histogram] = field(default_factory=dict)
    # min-heap of SlowEntry, at most the assembler's top_k
    slowest: list[SlowEntry] = field(default_factory=list)

    def merge(self, other: Tally, top_k: int) -> None:
        """Add another share of the same slot, keeping `top_k` slowest as one process
        would have kept over both shares."""
        self.chains += other.chains
        self.incomplete += other.incomplete
        self.failed += other.failed
        self.e2e.merge(other.e2e)
        for target, source in ((self.own, other.own), (self.ttfb, other.ttfb),
                               (self.total, other.total), (self.queue, other.queue)):
            for name, hist in source.items():
                target.setdefault(name, Histogram()).merge(hist)
        top = heapq.nlargest(top_k, self.slowest + other.slowest, key=_key)
        top.reverse()  # ascending: a valid min-heap
        self.slowest = top
        # Two replicas' sequences may tie too: ranked by key, never by the chains.
        kept = heapq.nlargest(self.kept.limit, self.kept.heap + other.kept.heap,
                              key=lambda e: (e[0], e[1]))
        kept.reverse()
        self.kept.heap = kept


def _key(entry: SlowEntry) -> tuple[float, int]:
    # Never the dict: two replicas' sequences may tie.
    return entry[0], entry[1]


@dataclass(frozen=True, slots=True)
class StageReport:
    name: str
    p50_ms: float
    p90_ms: float
    p99_ms: float
    ttfb_p99_ms: float | None
    total_p99_ms: float | None
    queue_p99_ms: float | None  # before the hop's first byte went upstream, where known
    attributed_ms: float       # mean own time in the slowest 1 % of chains
    share_of_e2e_p99: float    # attributed_ms / mean end-to-end time of those chains


@dataclass(frozen=True, slots=True)
class StageHistogram:
    name: str
    buckets: tuple[tuple[float, int], ...]  # non-empty: (upper bound ms, count), ascending


@dataclass(frozen=True, slots=True)
class ChainReport:
    pipeline: str
    window_s: int
    chains: int
    incomplete: int
    failed: int                # finished chains with a failed hop
    e2e_p50_ms: float
    e2e_p99_ms: float
    stages: tuple[StageReport, ...]
    bottleneck: str
    slowest: tuple[SlowChain, ...] = ()         # slowest first
    histograms: tuple[StageHistogram, ...] = ()  # own time, in the pipeline's stage order


def build_report(pipeline: Pipeline, window_s: int, slots: list[Tally],
                 keep: int) -> ChainReport:
    """The report over a window's tallies (each slot's, shares of one slot merged first)."""
    e2e = Histogram()
    chains = incomplete = failed = 0
    own: dict[str, Histogram] = {}
    ttfb: dict[str, Histogram] = {}
    total: dict[str, Histogram] = {}
    queue: dict[str, Histogram] = {}
    slowest: list[SlowEntry] = []
    for slot in slots:
        chains += slot.chains
        incomplete += slot.incomplete
        failed += slot.failed
        e2e.merge(slot.e2e)
        for target, source in ((own, slot.own), (ttfb, slot.ttfb), (total, slot.total),
                               (queue, slot.queue)):
            for name, hist in source.items():
                target.setdefault(name, Histogram()).merge(hist)
        slowest.extend(slot.slowest)
    # Critical path over the slowest 1 % (at least one chain).
    slow = heapq.nlargest(max(1, math.ceil(chains / 100)), slowest, key=_key)
    slow_e2e = sum(c[0] for c in slow) / len(slow) if slow else 0.0
    stages: list[StageReport] = []
    for stage in pipeline.stages:
        hist = own.get(stage.name, Histogram())
        attributed = sum(c[2].get(stage.name, 0.0) for c in slow) / len(slow) if slow else 0.0
        stage_ttfb = ttfb.get(stage.name)
        stage_total = total.get(stage.name)
        stage_queue = queue.get(stage.name)
        stages.append(StageReport(
            stage.name, ms(hist.quantile(0.5)), ms(hist.quantile(0.9)),
            ms(hist.quantile(0.99)),
            ms(stage_ttfb.quantile(0.99)) if stage_ttfb and stage_ttfb.total else None,
            ms(stage_total.quantile(0.99)) if stage_total and stage_total.total else None,
            ms(stage_queue.quantile(0.99)) if stage_queue and stage_queue.total else None,
            round(attributed * 1000, 3),
            round(attributed / slow_e2e, 4) if slow_e2e else 0.0))
    bottleneck = max(stages, key=lambda s: s.attributed_ms).name if chains else ""
    kept = slowest_of((s.kept for s in slots), keep)
    histograms = tuple(
        StageHistogram(stage.name, tuple((ms(upper), n) for upper, n in hist.buckets()))
        for stage in pipeline.stages
        for hist in (own.get(stage.name, Histogram()),))
    return ChainReport(pipeline.name, window_s, chains, incomplete, failed,
                       ms(e2e.quantile(0.5)), ms(e2e.quantile(0.99)), tuple(stages),
                       bottleneck, kept, histograms)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# --- between replicas ---------------------------------------------------------------


def encode(tally: Tally) -> list[Any]:
    return [tally.chains, tally.incomplete, tally.failed, _hist_out(tally.e2e),
            {name: _hist_out(h) for name, h in tally.own.items()},
            {name: _hist_out(h) for name, h in tally.ttfb.items()},
            {name: _hist_out(h) for name, h in tally.total.items()},
            {name: _hist_out(h) for name, h in tally.queue.items()},
            [[e2e, sequence, own] for e2e, sequence, own in tally.slowest],
            [[e2e, -negative, _chain_out(chain)] for e2e, negative, chain in tally.kept.heap]]


def decode(value: Any, keep: int) -> Tally:
    """A tally from `encode`; ValueError (or TypeError) when malformed: another replica's
    word is trusted as much as Redis, but a bad entry must cost that entry only."""
    if not isinstance(value, list) or len(value) != 10:
        raise ValueError("a tally is a list of 10")
    chains, incomplete, failed, e2e, own, ttfb, total, queue, slowest, kept = value
    tally = Tally(Slowest(keep), _count(chains), _count(incomplete), _count(failed),
                  _hist_in(e2e), _hists_in(queue), _hists_in(own), _hists_in(ttfb),
                  _hists_in(total))
    for e2e_s, sequence, stage_own in slowest:
        if not isinstance(stage_own, dict):
            raise ValueError("own times are a map")
        tally.slowest.append((_real(e2e_s), _count(sequence),
                              {str(k): _real(v) for k, v in stage_own.items()}))
    heapq.heapify(tally.slowest)
    for e2e_s, sequence, chain in kept:
        tally.kept.push(_real(e2e_s), _count(sequence), _chain_in(chain))
    return tally


def _hist_out(hist: Histogram) -> list[Any]:
    flat: list[Any] = [hist.sum]
    for i, n in enumerate(hist.counts):
        if n:
            flat += (i, n)
    return flat


def _hist_in(value: Any) -> Histogram:
    if not isinstance(value, list) or len(value) % 2 != 1:
        raise ValueError("a histogram is [sum, index, count, ...]")
    hist = Histogram()
    hist.sum = _real(value[0])
    counts = hist.counts
    for position in range(1, len(value), 2):
        index, n = _count(value[position]), _count(value[position + 1])
        if index >= BUCKETS:
            raise ValueError("bucket out of range")
        counts[index] += n
        hist.total += n
    return hist


def _hists_in(value: Any) -> dict[str, Histogram]:
    if not isinstance(value, dict):
        raise ValueError("histograms are a map")
    return {str(name): _hist_in(hist) for name, hist in value.items()}


def _chain_out(chain: SlowChain) -> list[Any]:
    return [chain.request_id, chain.trace_id, chain.e2e_ms, chain.failed,
            [[s.name, s.offset_ms, s.own_ms, s.total_ms] for s in chain.stages]]


def _chain_in(value: Any) -> SlowChain:
    request_id, trace_id, e2e_ms, failed, stages = value
    return SlowChain(str(request_id), str(trace_id), _real(e2e_ms),
                     tuple(SlowStage(str(n), _real(o), _real(w), _real(t))
                           for n, o, w, t in stages), bool(failed))


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


def _real(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a number: {value!r}")
    return float(value)
