"""A stage's recent work as per-bin sums, which add up across the replicas that own
parts of it.

With chains partitioned by request id (sitsmesh.shared.partbus) a replica sees every
hop of the requests it owns and none of the others'. It turns them into what
StageJudge reads from one process's hops (requests present, ended and failed, their
own time, the service times of requests that found a server free), summed per
10 ms bin of wall-clock time. Every owner's sums added up are the fleet's, so the
controller takes them instead of every hop, and what each replica decodes no longer
grows with the traffic. Within a bin presence is an average: busy time capped at
the stage's parallelism is read per bin, not per instant, which is never less than
the exact figure and close to it while service times are long against a bin.

Pure: plain data, and a ledger that bins each hop once, as it arrives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sitsmesh.pressure import estimate

WORK_BIN_S = 0.01
# One bin's sums, in this order: request-seconds present (own time, queueing at the
# stage included), requests ended, of them failed, their own time, then the requests
# that started in the bin (and ended in the window) as service-time samples: count,
# sum and sum of squares of their own time.
PRESENT, ENDED, FAILED, OWN, SAMPLES, SUM, SQUARES = range(7)
COLUMNS = 7
MAX_BINS = 1_000  # a record spans at most this many bins (10 s): a bound on what one costs
KEEP_S = 5.0      # work kept: the window, the longest log delay and then some
MAX_REQUESTS = 100_000  # requests whose hops are kept for nesting (a few seconds' worth)
MAX_HOPS = 64     # hops of one request kept for nesting
Bins = dict[int, list[float]]
HopRow = tuple[str, float, float, bool]  # (request id, start, end, failed)
OwnRow = tuple[Sequence[tuple[float, float]], float, bool]  # (own segments, end, failed)
# A hop kept for nesting: stage, start, end, failed, own segments.
_Kept = tuple[str, float, float, bool, tuple[tuple[float, float], ...]]


@dataclass(frozen=True, slots=True)
class Window:
    """A stage's work over one window, as StageJudge learns from it."""

    done: int
    failed: int
    busy: float       # server-seconds: at most `servers` requests at once
    samples: int      # service times of requests that found a server free
    mean: float       # their mean (0 with none)
    variance: float
    own_mean: float   # mean own time of the requests that ended in it (0 with none)


def bin_of(at: float) -> int:
    # Division, not //: 100.0 // 0.01 is 9999.0, a bin early.
    return math.floor(at / WORK_BIN_S)


def add_hop(bins: Bins, hop: OwnRow, sign: int = 1) -> None:
    """One hop's own segments into `bins` (or, with `sign` -1, taken out again). The
    rules are estimate.occupancy's. Once per hop on the owner: written for speed (local
    names, no helper calls per bin)."""
    segments, ended, failed = hop
    get = bins.get
    own = 0.0
    for a, b in segments:
        own += b - a
    index = math.floor(ended / WORK_BIN_S)
    row = get(index) or bins.setdefault(index, [0.0] * COLUMNS)
    row[ENDED] += sign
    row[FAILED] += sign * failed
    row[OWN] += sign * own
    if segments:
        index = math.floor(segments[0][0] / WORK_BIN_S)
        row = get(index) or bins.setdefault(index, [0.0] * COLUMNS)
        row[SAMPLES] += sign
        row[SUM] += sign * own
        row[SQUARES] += sign * own * own
    for first, last in segments:
        _present(bins, first, last, sign)


def _present(bins: Bins, at: float, until: float, sign: int) -> None:
    get = bins.get
    index = math.floor(at / WORK_BIN_S)
    while at < until:
        edge = max(at, min(until, (index + 1) * WORK_BIN_S))
        row = get(index) or bins.setdefault(index, [0.0] * COLUMNS)
        row[PRESENT] += sign * (edge - at)
        at = edge
        index += 1


def _carve(bins: Bins, segments: tuple[tuple[float, float], ...], ended: float,
           start: float, end: float) -> tuple[tuple[float, float], ...]:
    """A binned hop's own `segments` less [start, end) (a hop nested in it that came
    later), its bins changed by the difference only: what add_hop of the new segments
    after add_hop(-1) of the old would do, for a fraction of the work."""
    kept: list[tuple[float, float]] = []
    cut = 0.0
    for a, b in segments:
        low, high = max(a, start), min(b, end)
        if low >= high:
            kept.append((a, b))
            continue
        cut += high - low
        _present(bins, low, high, -1)
        if a < low:
            kept.append((a, low))
        if high < b:
            kept.append((high, b))
    if not cut:
        return segments
    own = 0.0
    for a, b in segments:
        own += b - a
    now = own - cut
    index = math.floor(ended / WORK_BIN_S)
    row = bins.get(index) or bins.setdefault(index, [0.0] * COLUMNS)
    row[OWN] += now - own
    # Its service-time sample sits where its first segment starts.
    index = math.floor(segments[0][0] / WORK_BIN_S)
    row = bins.get(index) or bins.setdefault(index, [0.0] * COLUMNS)
    if kept and kept[0][0] == segments[0][0]:
        row[SUM] += now - own
        row[SQUARES] += now * now - own * own
        return tuple(kept)
    row[SAMPLES] -= 1
    row[SUM] -= own
    row[SQUARES] -= own * own
    if kept:
        index = math.floor(kept[0][0] / WORK_BIN_S)
        row = bins.get(index) or bins.setdefault(index, [0.0] * COLUMNS)
        row[SAMPLES] += 1
        row[SUM] += now
        row[SQUARES] += now * now
    return tuple(kept)


def segmented(stages: Sequence[str], hops_of: Callable[[str], Iterable[HopRow]],
              since: Callable[[str], float]) -> dict[str, list[OwnRow]]:
    """Each stage's hops that ended after `since(stage)` as (own segments, ended,
    failed). A stage's own time excludes the stages nested in it (those it called and
    waited on), found among the same requests' hops: a partition holds all of a
    request's. Only other stages nest in a hop: a call of the same stage beside it is a
    sibling of a fan-out (or a retry), running in parallel, not called by it."""
    recent: dict[str, list[HopRow]] = {}
    spans: dict[str, list[tuple[str, float, float]]] = {}
    for name in stages:
        rows = recent[name] = [h for h in hops_of(name) if h[2] >= since(name)]
        for request_id, started, ended, _ in rows:
            spans.setdefault(request_id, []).append((name, started, ended))
    return {name: [(estimate.own_segments(started, ended, (
                        (s, e) for other, s, e in spans.get(request_id, ()) if other != name)),
                    ended, failed) for request_id, started, ended, failed in rows]
            for name, rows in recent.items()}


class WorkLedger:
    """One pipeline's stages' work over the last KEEP_S, binned as each hop arrives: the
    hops of the requests this replica owns, in wall-clock time. A hop that arrives after
    a hop of another stage it is nested in takes its time out of that one's own time,
    as reading them together would (`segmented`). Memory is bounded by KEEP_S and
    MAX_REQUESTS; a request past MAX_HOPS hops is binned without nesting."""

    def __init__(self) -> None:
        self.bins: dict[str, Bins] = {}
        # request id -> its hops, by arrival
        self._requests: dict[str, tuple[_Kept, ...]] = {}
        self._low: dict[str, float] = {}  # per stage, the earliest time changed since `take`

    def add(self, stage: str, request_id: str, start: float, end: float,
            failed: bool) -> None:
        requests = self._requests
        hops = requests.get(request_id, ())
        if not hops and len(requests) >= MAX_REQUESTS:
            del requests[next(iter(requests))]
        others = [(h[1], h[2]) for h in hops if h[0] != stage]
        segments = (tuple(estimate.own_segments(start, end, others)) if others
                    else ((start, end),))
        add_hop(self.bins.setdefault(stage, {}), (segments, end, failed))
        low = self._low
        if start < low.get(stage, math.inf):
            low[stage] = start
        if len(hops) >= MAX_HOPS:
            return
        if others:
            hops = self._nest(hops, stage, start, end)
        # Tuples of plain values: the collector stops tracking them, and a ledger holds
        # a few seconds of hops (a third of the time went to collections with lists).
        requests[request_id] = (*hops, (stage, start, end, failed, segments))

    def _nest(self, hops: tuple[_Kept, ...], stage: str, start: float,
              end: float) -> tuple[_Kept, ...]:
        """`hops`, each of another stage that the new hop is nested in with its own time
        less the new hop's, in its bins too."""
        out = list(hops)
        for i, (name, began, ended, failed, segments) in enumerate(hops):
            if name != stage and (start >= began - estimate.EPSILON_S
                                  and end <= ended + estimate.EPSILON_S):
                out[i] = (name, began, ended, failed,
                          _carve(self.bins.setdefault(name, {}), segments, ended, start, end))
                if began < self._low.get(name, math.inf):  # its sample sits at its start
                    self._low[name] = began
        return tuple(out)

    def window(self, stage: str, start: float, now: float) -> Bins:
        """The bins of `stage` from `start`, after letting go of what is older than
        KEEP_S before `now`."""
        self._prune(now)
        low = bin_of(start)
        return {i: row for i, row in self.bins.get(stage, {}).items() if i >= low}

    def take(self, stage: str, start: float, now: float, *, full: bool) -> tuple[int, Bins] | None:
        """What to send of `stage`: (first bin, the bins from it on), from the earliest
        bin changed since the last take (or `start`, if later); from `start` when `full`.
        None when nothing changed. A receiver replaces its copy from that bin on."""
        touched = self._low.pop(stage, math.inf)
        since = start if full else max(start, touched)
        if since == math.inf:
            return None
        return bin_of(since), self.window(stage, since, now)

    def _prune(self, now: float) -> None:
        horizon = now - KEEP_S
        requests = self._requests
        while requests:
            oldest = next(iter(requests))
            if max(h[2] for h in requests[oldest]) >= horizon:
                break
            del requests[oldest]
        first = bin_of(horizon)
        for bins in self.bins.values():
            for index in [i for i in bins if i < first]:
                del bins[index]


def replace_from(bins: Bins, merged: Bins, first: int, rows: Mapping[int, list[float]],
                 *, whole: bool = False) -> None:
    """An owner's `bins` from bin `first` on become `rows` (all of them, with `whole`),
    and `merged`, the sum over owners, follows by the difference: each tick reads the
    sum without adding every owner's bins up again."""
    for index in [i for i in bins if whole or i >= first]:
        old = bins.pop(index)
        if index in merged:  # else already pruned from the sum
            _add_row(merged, index, old, -1)
    for index, row in rows.items():
        bins[index] = row
        _add_row(merged, index, row)


def merge(parts: Iterable[Bins]) -> Bins:
    total: Bins = {}
    for bins in parts:
        for index, row in bins.items():
            _add_row(total, index, row)
    return total


def _add_row(total: Bins, index: int, row: Sequence[float], sign: int = 1) -> None:
    mine = total.get(index)
    if mine is None:
        total[index] = [sign * value for value in row]
    else:
        for column, value in enumerate(row):
            mine[column] += sign * value


def read(bins: Mapping[int, Sequence[float]], start: float, end: float,
         servers: int) -> Window:
    """The window [start, end) (wall clock) of merged bins. A bin's samples count when
    its mean presence leaves a server free: a standing queue keeps it above."""
    done = failed = samples = 0
    busy = own = total = squares = 0.0
    cap = servers * WORK_BIN_S * (1 + 1e-9)
    for index in range(bin_of(start), bin_of(end)):
        row = bins.get(index)
        if row is None:
            continue
        present = row[PRESENT]
        busy += min(present, servers * WORK_BIN_S)
        done += int(row[ENDED])
        failed += int(row[FAILED])
        own += row[OWN]
        if row[SAMPLES] and present <= cap:
            samples += int(row[SAMPLES])
            total += row[SUM]
            squares += row[SQUARES]
    mean = total / samples if samples else 0.0
    return Window(done, failed, busy, samples, mean,
                  max(0.0, squares / samples - mean * mean) if samples else 0.0,
                  own / done if done else 0.0)


def exact(hops: Iterable[OwnRow], start: float, end: float, servers: int) -> Window:
    """The same window from one process's hops (own segments, ended, failed), exactly."""
    rows = list(hops)
    work = estimate.occupancy(rows, start, end, servers)
    ended = [sum(e - s for s, e in segments) for segments, at, _ in rows if start <= at < end]
    services = work.services
    mean = sum(services) / len(services) if services else 0.0
    variance = (sum((x - mean) ** 2 for x in services) / len(services)) if services else 0.0
    return Window(work.completions, work.failures, work.busy, len(services), mean, variance,
                  sum(ended) / len(ended) if ended else 0.0)


# --- on the wire: microseconds as integers, the bins sparse ------------------------

_WIRE = ((PRESENT, 1e6), (ENDED, 1), (FAILED, 1), (OWN, 1e6), (SAMPLES, 1), (SUM, 1e6),
         (SQUARES, 1e12))


def encode(bins: Bins) -> list[Any]:
    if not bins:
        return []
    first = min(bins)
    # Taking a hop out again may leave rounding residue: never below zero on the wire.
    return [first, *([index - first, *(max(0, round(row[c] * scale)) for c, scale in _WIRE)]
                     for index, row in bins.items())]


def decode(raw: Any) -> Bins:
    """ValueError when it is not what encode gives, or spans more than MAX_BINS."""
    if not isinstance(raw, list):
        raise ValueError("stage work is a list")
    if not raw:
        return {}
    first, *rows = raw
    if not isinstance(first, int) or len(rows) > MAX_BINS:
        raise ValueError("stage work is [first bin, rows...], at most MAX_BINS rows")
    bins: Bins = {}
    for row in rows:
        if (not isinstance(row, list) or len(row) != COLUMNS + 1
                or not all(isinstance(v, int) and v >= 0 for v in row)
                or row[0] >= MAX_BINS):
            raise ValueError("a bin is [offset, then seven counts and sums, none negative]")
        offset, present, ended, failed, own, samples, total, squares = row
        bins[first + offset] = [present / 1e6, float(ended), float(failed), own / 1e6,
                                float(samples), total / 1e6, squares / 1e12]
    return bins
