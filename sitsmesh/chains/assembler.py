"""Chain assembly: hops with one request id -> one chain -> per-stage own time.

Plain Python with an injected clock. Memory is bounded: open chains are
capped in count and in estimated bytes (the oldest evicted first) and expire
after a TTL, recently closed ids likewise, and finished chains only feed fixed-size
histograms in time slots plus a small top-K of the slowest chains per slot
(enough to attribute the slowest 1 %), and per pipeline the few slowest chains
kept whole, with their request and trace ids, for a person to look up.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from sitsmesh.chains.histogram import Histogram
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.chains.slowest import DEFAULT_SLOWEST, SlowChain, Slowest, SlowStage, checked_limit
from sitsmesh.chains.tally import ChainReport, Tally, build_report, ms

EPSILON_S = 0.0005  # Envoy timestamps are microseconds; tolerate rounding at the edges
DEFAULT_MAX_BYTES = 32 << 20
# CPython costs beyond the strings' characters, for the byte estimate: an open chain (its
# _Chain, hops dict and OrderedDict node), one hop (a slotted Hop, its str headers and
# dict slot), one remembered closed id.
CHAIN_BYTES = 600
HOP_BYTES = 500
CLOSED_BYTES = 150


@dataclass(slots=True)
class Hop:
    request_id: str
    start: float                 # absolute, seconds
    duration: float              # the whole hop, to its last byte back
    ttfb: float | None = None    # to the first byte back
    queue: float | None = None   # before the first byte went upstream
    upstream_cluster: str = ""
    route_name: str = ""
    stage_header: str = ""       # x-sits-stage, for stages matched by header
    pipeline: str = ""           # set by stage reports, which name their stage
    stage: str = ""
    failed: bool = False         # a 5xx answer, or Envoy response flags (reset, timeout...)
    trace_id: str = ""           # 32 hex digits from a valid traceparent, else ""

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(slots=True)
class _Chain:
    pipeline: Pipeline
    hops: dict[str, Hop]
    opened: float
    size: int = CHAIN_BYTES
    trace_id: str = ""  # the first hop that carries one names the chain's trace


def _hop_bytes(hop: Hop) -> int:
    return (HOP_BYTES + len(hop.request_id) + len(hop.upstream_cluster) + len(hop.route_name)
            + len(hop.stage_header) + len(hop.pipeline) + len(hop.stage) + len(hop.trace_id))


@dataclass(slots=True)
class _Slot:
    index: int
    # Per pipeline: two pipelines may name stages alike, and each reports only its own.
    pipelines: dict[str, Tally] = field(default_factory=dict)


def own_times(hops: Mapping[str, Hop]) -> tuple[dict[str, float], float]:
    """Each stage's span minus the spans nested in it that it waited on; and end to end."""
    ordered = sorted(hops.items(), key=lambda kv: -kv[1].duration)
    own = {name: hop.duration for name, hop in ordered}
    for i, (_, hop) in enumerate(ordered):
        # The parent is the shortest longer hop that contains this one.
        for parent_name, parent in reversed(ordered[:i]):
            if (parent.start - EPSILON_S <= hop.start
                    and hop.end <= parent.end + EPSILON_S):
                own[parent_name] -= hop.duration
                break
    e2e = ordered[0][1].duration if ordered else 0.0
    return {name: max(0.0, value) for name, value in own.items()}, e2e


class Assembler:
    def __init__(self, pipelines: Mapping[str, Pipeline], *,
                 clock: Callable[[], float] = time.monotonic, ttl_s: float = 30.0,
                 slot_s: int = 10, slots: int = 30, max_open: int = 100_000,
                 top_k: int = 64, max_bytes: int = DEFAULT_MAX_BYTES,
                 slowest: int = DEFAULT_SLOWEST,
                 on_chain: Callable[[str, dict[str, float], float], None] | None = None,
                 on_evict: Callable[[str], None] | None = None) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._slot_s = slot_s
        self._slots: list[_Slot | None] = [None] * slots
        self._max_open = max_open
        self._top_k = top_k
        self._keep = checked_limit(slowest)
        self._on_chain = on_chain
        self._on_evict = on_evict
        # Request ids and header values are the sender's: bound the bytes, not only the count.
        self._max_bytes = max_bytes
        self._open_bytes = 0
        self._closed_bytes = 0
        self.evicted: dict[str, int] = {"max_open": 0, "max_bytes": 0}
        # OrderedDict, not dict: both are trimmed from the oldest end, and a plain dict
        # scans its deleted slots from the front on every such trim.
        self._open: OrderedDict[str, _Chain] = OrderedDict()
        # Recently finished request ids: a hop that arrives after its chain closed (a
        # resent entry) must not open a new chain that would expire as incomplete.
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._sequence = 0
        # Backpressure reads every hop as work its stage did, the calls of a fan-out and
        # retries included (the chain keeps one per stage; the stage did them all).
        self.on_hop: Callable[[str, str, Hop], None] | None = None
        # Each complete chain whole (request id, pipeline, its hops, e2e, trace id): token
        # streams join it there (sitsmesh.chains.tokenjoin).
        self.on_close: Callable[[str, Pipeline, Mapping[str, Hop], float, str], None] | None \
            = None
        # The other replicas' tallies of (pipeline, oldest slot, newest slot), by slot index,
        # when each assembles a share of the chains (sitsmesh.shared.partitions).
        self.shares: Callable[[str, int, int], Iterable[tuple[int, Tally]]] | None = None
        self.duplicates = 0
        self.unmatched = 0
        self.set_pipelines(pipelines)

    def set_pipelines(self, pipelines: Mapping[str, Pipeline]) -> None:
        """Swap the pipeline set; lookups are precomputed so matching is one dict hit."""
        index: dict[tuple[str, str], tuple[Pipeline, Stage]] = {}
        for pipeline in pipelines.values():
            for stage in pipeline.stages:
                index.setdefault((stage.match_key, stage.match_value), (pipeline, stage))
                index.setdefault(("report:" + pipeline.name, stage.name), (pipeline, stage))
        self._index = index
        self.pipelines = dict(pipelines)

    def match(self, hop: Hop) -> tuple[Pipeline, Stage] | None:
        index = self._index
        if hop.stage:
            return index.get(("report:" + hop.pipeline, hop.stage))
        return (index.get(("upstream_cluster", hop.upstream_cluster))
                or index.get(("route_name", hop.route_name))
                or (index.get(("header", hop.stage_header)) if hop.stage_header else None))

    def add(self, hop: Hop) -> None:
        matched = self.match(hop)
        if matched is None or not hop.request_id:
            self.unmatched += 1
            return
        pipeline, stage = matched
        if self.on_hop is not None:
            self.on_hop(pipeline.name, stage.name, hop)
        if hop.request_id in self._closed:
            self.duplicates += 1
            return
        chain = self._open.get(hop.request_id)
        if chain is None:
            if len(self._open) >= self._max_open:
                self._evict("max_open")
            chain = self._open[hop.request_id] = _Chain(pipeline, {}, self._clock())
            self._open_bytes += CHAIN_BYTES
        if hop.trace_id and not chain.trace_id:
            chain.trace_id = hop.trace_id
        if stage.name in chain.hops:
            self.duplicates += 1  # a retried hop or a resent entry: the first one stands
            return
        chain.hops[stage.name] = hop
        cost = _hop_bytes(hop)
        chain.size += cost
        self._open_bytes += cost
        if len(chain.hops) == len(pipeline.stages):
            self._close(hop.request_id, complete=True)
        while self._open_bytes > self._max_bytes and self._open:
            self._evict("max_bytes")

    def _evict(self, reason: str) -> None:
        """Close the oldest open chain as incomplete to make room."""
        self._close(next(iter(self._open)), complete=False)
        self.evicted[reason] += 1
        if self._on_evict is not None:
            self._on_evict(reason)

    def expire(self) -> int:
        """Close chains older than the TTL as incomplete. Returns how many."""
        deadline = self._clock() - self._ttl_s
        expired = []
        for rid, chain in self._open.items():
            if chain.opened > deadline:
                break  # opened in order: the rest are younger
            expired.append(rid)
        for rid in expired:
            self._close(rid, complete=False)
        return len(expired)

    def open_chains(self) -> int:
        return len(self._open)

    def open_request_ids(self) -> list[str]:
        return list(self._open)

    def open_bytes(self) -> int:
        """The open chains' estimated size."""
        return self._open_bytes

    def closed_bytes(self) -> int:
        """The recently closed ids' estimated size."""
        return self._closed_bytes

    def _slot(self) -> _Slot:
        index = int(self._clock() // self._slot_s)
        position = index % len(self._slots)
        slot = self._slots[position]
        if slot is None or slot.index != index:
            slot = self._slots[position] = _Slot(index)
        return slot

    def _close(self, request_id: str, *, complete: bool) -> None:
        chain = self._open.pop(request_id)
        self._open_bytes -= chain.size
        cost = CLOSED_BYTES + len(request_id)
        # The closed ids get a quarter of the byte budget: they only catch resent entries.
        while self._closed and (len(self._closed) >= self._max_open
                                or self._closed_bytes + cost > self._max_bytes // 4):
            self._closed_bytes -= CLOSED_BYTES + len(self._closed.popitem(last=False)[0])
        self._closed[request_id] = None
        self._closed_bytes += cost
        pipelines = self._slot().pipelines
        tally = pipelines.get(chain.pipeline.name)
        if tally is None:
            tally = pipelines[chain.pipeline.name] = Tally(Slowest(self._keep))
        if not complete:
            tally.incomplete += 1
            return
        own, e2e = own_times(chain.hops)
        tally.chains += 1
        failed = any(hop.failed for hop in chain.hops.values())
        if failed:
            tally.failed += 1
        tally.e2e.add(e2e)
        for name, seconds in own.items():
            hop = chain.hops[name]
            _hist(tally.own, name).add(seconds)
            _hist(tally.total, name).add(hop.duration)
            if hop.ttfb is not None:
                _hist(tally.ttfb, name).add(hop.ttfb)
            if hop.queue is not None:
                _hist(tally.queue, name).add(hop.queue)
        self._sequence += 1
        entry = (e2e, self._sequence, own)
        if len(tally.slowest) < self._top_k:
            heapq.heappush(tally.slowest, entry)
        elif e2e > tally.slowest[0][0]:
            heapq.heapreplace(tally.slowest, entry)
        kept = tally.kept
        if kept.admits(e2e):  # built only when kept: most chains stop at this comparison
            kept.push(e2e, self._sequence, _slow_chain(request_id, chain, own, e2e, failed))
        if self._on_chain is not None:
            self._on_chain(chain.pipeline.name, own, e2e)
        if self.on_close is not None:
            self.on_close(request_id, chain.pipeline, chain.hops, e2e, chain.trace_id)

    def report(self, pipeline_name: str, window_s: int) -> ChainReport | None:
        pipeline = self.pipelines.get(pipeline_name)
        if pipeline is None:
            return None
        newest = int(self._clock() // self._slot_s)
        oldest = newest - max(1, window_s // self._slot_s) + 1
        slots = [(s.index, tally) for s in self._slots
                 if s is not None and oldest <= s.index <= newest
                 for tally in (s.pipelines.get(pipeline_name),) if tally is not None]
        if self.shares is not None:
            slots = self._merged(slots, self.shares(pipeline_name, oldest, newest))
        return build_report(pipeline, window_s, [tally for _, tally in slots], self._keep)

    def _merged(self, mine: list[tuple[int, Tally]],
                theirs: Iterable[tuple[int, Tally]]) -> list[tuple[int, Tally]]:
        """Each slot's shares in one tally, as one process would have kept it."""
        by_index: dict[int, Tally] = {}
        for index, tally in (*mine, *theirs):
            into = by_index.get(index)
            if into is None:
                into = by_index[index] = Tally(Slowest(self._keep))
            into.merge(tally, self._top_k)
        return sorted(by_index.items())

    def tallies(self, oldest: int) -> list[tuple[int, dict[str, Tally]]]:
        """This assembler's slots from index `oldest` on, for the other replicas."""
        return [(s.index, s.pipelines) for s in self._slots if s is not None and s.index >= oldest]

    def slot_index(self) -> int:
        return int(self._clock() // self._slot_s)

    def slot_count(self) -> int:
        return len(self._slots)

    @property
    def kept_limit(self) -> int:
        """Slowest chains kept whole per pipeline and slot."""
        return self._keep


def _slow_chain(request_id: str, chain: _Chain, own: Mapping[str, float], e2e: float,
                failed: bool) -> SlowChain:
    first = min(hop.start for hop in chain.hops.values())
    stages = tuple(SlowStage(stage.name, ms(hop.start - first), ms(own.get(stage.name, 0.0)),
                             ms(hop.duration))
                   for stage in chain.pipeline.stages
                   for hop in (chain.hops.get(stage.name),) if hop is not None)
    return SlowChain(request_id, chain.trace_id, ms(e2e), stages, failed)


def _hist(table: dict[str, Histogram], name: str) -> Histogram:
    hist = table.get(name)
    if hist is None:
        hist = table[name] = Histogram()
    return hist


