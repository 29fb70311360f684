"""Token streams joined to their requests' latency chains by request id, and per pipeline
the request-level TTFT and ITL and the stage that owns TTFT in the slowest 1 %.

A stream's report and its chain come in either order: Envoy logs a hop at the stream's
end and flushes the log up to an interval later, while ext_proc reports at the last
chunk (or, for a cut stream, a close delay after it). So reports wait for their chain
(bounded in count and age; those whose chain never comes are dropped and counted), and a
closed chain of a pipeline that streams waits up to GRACE_S for the reports of its other
hops, unless every hop has reported. A pipeline "streams" once a report named it (for
STREAMING_S after the last): before that, a chain that closes ahead of its first report
is not held, so the first request of a pipeline may go unjoined. Plain Python with an
injected clock; the sweeps run from the calls themselves, so nothing needs a timer.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from sitsmesh.chains.assembler import Hop
from sitsmesh.chains.histogram import Histogram
from sitsmesh.chains.pipeline import Pipeline
from sitsmesh.chains.ttft import RequestTokens, owner, request_tokens
from sitsmesh.tokens.timing import StreamSummary

GRACE_S = 2.0          # a closed chain waits this long for its hops' reports
PENDING_TTL_S = 30.0   # a report waits this long for its chain (the chain's own TTL)
MAX_PENDING = 20_000   # reports waiting, by request
MAX_WAITING = 20_000   # closed chains waiting for reports
SWEEP_S = 0.25
STREAMING_S = 300.0    # a pipeline counts as streaming this long after its last report
TOP_K = 64             # per slot, the slowest requests by TTFT (enough for the slowest 1 %)
KEEP = 20              # per slot, the slowest requests by end to end kept whole
T = TypeVar("T")


@dataclass(slots=True)
class _Waiting:
    pipeline: str
    order: tuple[str, ...]
    hops: Mapping[str, Hop]
    e2e: float
    trace_id: str
    deadline: float


@dataclass(slots=True)
class _Tally:
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    chains: int = 0
    # min-heap (ttft, sequence, shares): the slot's slowest requests by TTFT
    slow_ttft: list[tuple[float, int, Mapping[str, float]]] = field(default_factory=list)
    # min-heap (e2e, sequence, request): the slot's slowest requests kept whole
    kept: list[tuple[float, int, RequestTokens]] = field(default_factory=list)
    stall_max_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenChainReport:
    chains: int                       # chains joined to a stream with a first token
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    ttft_owner: str                   # the stage owning TTFT in the slowest 1 %
    attributed_ms: Mapping[str, float]  # stage -> mean TTFT part over the slowest 1 %
    share: Mapping[str, float]        # stage -> that part / their mean TTFT
    stall_max_ms: Mapping[str, float]  # stage -> its longest stall in the window
    requests: Mapping[str, RequestTokens]  # the slowest requests' figures, by request id
    dropped: int                      # reports whose chain never came, since the start


class TokenJoin:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, slot_s: int = 10,
                 slots: int = 30, grace_s: float = GRACE_S, ttl_s: float = PENDING_TTL_S,
                 max_pending: int = MAX_PENDING, max_waiting: int = MAX_WAITING,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self._clock = clock
        self._slot_s = slot_s
        self._slots = slots
        self._grace_s = grace_s
        self._ttl_s = ttl_s
        self._max_pending = max_pending
        self._max_waiting = max_waiting
        self._on_drop = on_drop
        # Each joined request goes to these (pipeline, figures): metrics, trace spans.
        self._listeners: list[Callable[[str, RequestTokens], None]] = []
        # request id -> (first report's time, {stage: summary}); oldest first
        self._pending: OrderedDict[str, tuple[float, dict[str, StreamSummary]]] = OrderedDict()
        self._waiting: OrderedDict[str, _Waiting] = OrderedDict()
        self._streaming: dict[str, float] = {}  # pipeline -> when it last reported a stream
        # slot index -> pipeline -> tally
        self._tallies: dict[int, dict[str, _Tally]] = {}
        self._sequence = 0
        self._next_sweep = 0.0
        self.dropped: dict[str, int] = {"expired": 0, "max_pending": 0}
        self.joined = 0

    def report(self, request_id: str, pipeline: str, stage: str,
               summary: StreamSummary) -> None:
        """A finished stream of `stage` of `pipeline`, for request `request_id`."""
        if not request_id:
            return
        now = self._clock()
        self._streaming[pipeline] = now
        waiting = self._waiting.get(request_id)
        if waiting is not None:
            pending = self._pending.get(request_id)
            streams = pending[1] if pending is not None else {}
            streams.setdefault(stage, summary)
            if all(name in streams for name in waiting.hops):
                del self._waiting[request_id]
                self._pending.pop(request_id, None)
                self._finish(request_id, waiting, streams)
            elif pending is None:
                self._pending[request_id] = (now, streams)
        else:
            entry = self._pending.get(request_id)
            if entry is None:
                if len(self._pending) >= self._max_pending:
                    self._pending.popitem(last=False)
                    self._dropped("max_pending")
                entry = self._pending[request_id] = (now, {})
            entry[1].setdefault(stage, summary)  # a retried stream: the first one stands
        self._sweep(now)

    def closed(self, request_id: str, pipeline: Pipeline, hops: Mapping[str, Hop],
               e2e: float, trace_id: str) -> None:
        """A complete chain closed (the assembler's on_close)."""
        pending = self._pending.get(request_id)
        if pending is None and pipeline.name not in self._streaming:
            return  # a pipeline that does not stream: two dict look-ups
        now = self._clock()
        waiting = _Waiting(pipeline.name, tuple(s.name for s in pipeline.stages), hops, e2e,
                           trace_id, now + self._grace_s)
        if pending is not None and all(name in pending[1] for name in hops):
            del self._pending[request_id]
            self._finish(request_id, waiting, pending[1])
        else:
            if len(self._waiting) >= self._max_waiting:
                self._expire_waiting(next(iter(self._waiting)))
            self._waiting[request_id] = waiting
        self._sweep(now)

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        due = []
        for rid, waiting in self._waiting.items():
            if waiting.deadline > now:
                break  # in deadline order: the rest wait longer
            due.append(rid)
        for rid in due:
            self._expire_waiting(rid)
        stale = now - self._ttl_s
        while self._pending:
            rid, (seen, _) = next(iter(self._pending.items()))
            if seen > stale:
                break
            del self._pending[rid]
            self._dropped("expired")
        for name in [p for p, at in self._streaming.items() if at < now - STREAMING_S]:
            del self._streaming[name]

    def _expire_waiting(self, request_id: str) -> None:
        waiting = self._waiting.pop(request_id)
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._finish(request_id, waiting, pending[1])

    def _finish(self, request_id: str, waiting: _Waiting,
                streams: Mapping[str, StreamSummary]) -> None:
        figures = request_tokens(request_id, waiting.trace_id, waiting.hops, streams,
                                 waiting.e2e, order=waiting.order)
        if figures is None or figures.ttft_s is None:
            return
        self.joined += 1
        tally = self._tally(waiting.pipeline)
        tally.chains += 1
        tally.ttft.add(figures.ttft_s)
        if figures.itl_p50_s is not None:
            tally.itl.add(figures.itl_p50_s)
        self._sequence += 1
        _push(tally.slow_ttft, TOP_K, (figures.ttft_s, self._sequence, figures.shares))
        _push(tally.kept, KEEP, (figures.e2e_s, self._sequence, figures))
        for stream in figures.streams:
            for _, length in stream.stalls:
                if length > tally.stall_max_ms.get(stream.stage, 0.0):
                    tally.stall_max_ms[stream.stage] = length
        for listener in self._listeners:
            listener(waiting.pipeline, figures)

    def listen(self, listener: Callable[[str, RequestTokens], None]) -> None:
        self._listeners.append(listener)

    def _dropped(self, reason: str) -> None:
        self.dropped[reason] += 1
        if self._on_drop is not None:
            self._on_drop(reason)

    def _tally(self, pipeline: str) -> _Tally:
        index = int(self._clock() // self._slot_s)
        slot = self._tallies.get(index)
        if slot is None:
            slot = self._tallies[index] = {}
            for old in [i for i in self._tallies if i <= index - self._slots]:
                del self._tallies[old]
        tally = slot.get(pipeline)
        if tally is None:
            tally = slot[pipeline] = _Tally()
        return tally

    def waiting(self) -> tuple[int, int]:
        """(reports waiting for their chain, closed chains waiting for reports)."""
        return len(self._pending), len(self._waiting)

    def report_for(self, pipeline: str, window_s: int) -> TokenChainReport:
        self._next_sweep = 0.0
        self._sweep(self._clock())
        newest = int(self._clock() // self._slot_s)
        oldest = newest - max(1, window_s // self._slot_s) + 1
        tallies = [slot[pipeline] for index, slot in self._tallies.items()
                   if oldest <= index <= newest and pipeline in slot]
        ttft, itl = Histogram(), Histogram()
        chains = 0
        stall_max: dict[str, float] = {}
        for tally in tallies:
            chains += tally.chains
            ttft.merge(tally.ttft)
            itl.merge(tally.itl)
            for stage, length in tally.stall_max_ms.items():
                stall_max[stage] = max(length, stall_max.get(stage, 0.0))
        slow = heapq.nlargest(max(1, math.ceil(chains / 100)),
                              (e for t in tallies for e in t.slow_ttft))
        attributed = attribution(entry[2] for entry in slow)
        mean_ttft = sum(e[0] for e in slow) / len(slow) if slow else 0.0
        kept = heapq.nlargest(KEEP, (e for t in tallies for e in t.kept))
        return TokenChainReport(
            chains, _q(ttft, 0.5), _q(ttft, 0.99), _q(itl, 0.5), _q(itl, 0.99),
            owner(attributed),
            {name: round(s * 1000, 3) for name, s in attributed.items()},
            {name: round(s / mean_ttft, 4) if mean_ttft else 0.0
             for name, s in attributed.items()},
            stall_max, {e[2].request_id: e[2] for e in kept}, sum(self.dropped.values()))


def attribution(shares: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Each stage's mean part of TTFT over the given requests (a stage absent from a
    request counts 0 there)."""
    total: dict[str, float] = {}
    count = 0
    for one in shares:
        count += 1
        for name, seconds in one.items():
            total[name] = total.get(name, 0.0) + seconds
    return {name: seconds / count for name, seconds in total.items()} if count else {}


def _push(heap: list[tuple[float, int, T]], limit: int, entry: tuple[float, int, T]) -> None:
    """A bounded min-heap of the largest; the sequence breaks ties, payloads never compare."""
    if len(heap) < limit:
        heapq.heappush(heap, entry)
    elif entry[0] > heap[0][0]:
        heapq.heapreplace(heap, entry)


def _q(hist: Histogram, q: float) -> float | None:
    return round(hist.quantile(q) * 1000, 3) if hist.total else None
