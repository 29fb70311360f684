"""Estimates from samples stamped with when they happened, not when they arrived.

Access-log entries reach sitsmesh up to a flush interval after their request
ended (Envoy's default is 1 s). Counting a request in flight until its entry
*arrives* would count every millisecond of log buffering as queueing. These
functions read each sample as of its own time instead:

- `in_flight`: requests admitted at the entry whose end is not known yet are
  weighed by how likely they still run, given the recent latency distribution
  and the watermark up to which every end has been seen;
- `occupancy`: over a window that ends at the watermark, how much work a stage
  did and how often it finished, from the start and end of each hop, which
  gives its service time whether or not a queue stood.

Pure functions on plain data: the controller and the simulator share them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

BIN_S = 0.01  # admission times are kept in 10 ms bins


def survival(ordered: Sequence[float], age: float) -> float:
    """P(latency > age) from recent latencies sorted ascending; 1.0 with no samples."""
    if not ordered:
        return 1.0
    return 1.0 - bisect.bisect_right(ordered, age) / len(ordered)


def in_flight(open_bins: Mapping[int, int], now: float, watermark: float,
              latencies: Sequence[float]) -> float:
    """Expected requests still running among those admitted and not yet seen to end.

    `open_bins` maps an admission bin (seconds // BIN_S) to how many requests
    admitted in it have no end yet; `watermark` is the time up to which every
    end has arrived, so a request admitted before it and still open is known
    to have run at least that long. `latencies` are recent admission-to-end
    times, sorted ascending.
    """
    if not latencies:
        return float(sum(open_bins.values()))  # no distribution yet: count them all
    expected = 0.0
    for index, count in open_bins.items():
        admitted = (index + 0.5) * BIN_S
        alive_now = survival(latencies, now - admitted)
        seen_alive = watermark - admitted
        if seen_alive > 0:
            known = survival(latencies, seen_alive)
            # Open past anything seen lately: most likely an entry that never came (an
            # Envoy that went away). The hold timeout ends it; until then it is not
            # counted, or one lost batch would read as a standing queue for a minute.
            # A backlog that does build shows in the fluid estimate from admissions.
            alive_now = alive_now / known if known > 0 else 0.0
        expected += count * alive_now
    return expected


EPSILON_S = 0.0005  # Envoy's timestamps are microseconds; tolerate rounding at the edges


def own_segments(started: float, ended: float,
                 nested: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """[started, ended) less the spans nested in it: the time a stage spent on a request
    itself, not waiting on the stages it called."""
    segments = []
    cursor = started
    for child_start, child_end in sorted(nested):
        if child_start < started - EPSILON_S or child_end > ended + EPSILON_S:
            continue  # not nested: a sibling or a retry
        if child_start > cursor:
            segments.append((cursor, child_start))
        cursor = max(cursor, child_end)
    if cursor < ended:
        segments.append((cursor, ended))
    return segments


@dataclass(frozen=True, slots=True)
class Occupancy:
    completions: int
    failures: int
    busy: float                  # server-seconds: at most `servers` requests at once
    services: tuple[float, ...]  # own times of requests that found a server free


def occupancy(hops: Iterable[tuple[Sequence[tuple[float, float]], float, bool]],
              start: float, end: float, servers: int) -> Occupancy:
    """A stage's work over [start, end) from (own segments, ended, failed) of its hops.

    Busy time counts at most `servers` requests at once: the rest were waiting,
    so busy / completions is the mean service time, queue or no queue. A request
    that started while a server was free did not wait: its own time is a sample
    of the service time itself (its spread tells chance queues from overload).
    """
    completions = failures = 0
    edges: list[tuple[float, int, float]] = []
    for segments, ended, failed in hops:
        if start <= ended < end:
            completions += 1
            failures += failed
        own = sum(e - s for s, e in segments)
        for i, (seg_start, seg_end) in enumerate(segments):
            if seg_end <= start or seg_start >= end:
                continue
            # The first segment's start carries the hop's own time, to sample it there.
            edges.append((max(seg_start, start), 1, own if i == 0 and seg_start >= start
                          and start <= ended < end else -1.0))
            edges.append((min(seg_end, end), -1, -1.0))
    edges.sort()
    busy = 0.0
    present = 0
    last = start
    services = []
    for at, step, own in edges:
        busy += min(present, servers) * (at - last)
        if own >= 0 and present < servers:
            services.append(own)
        present += step
        last = at
    return Occupancy(completions, failures, busy, tuple(services))


def present_at(at: float, open_bins: Mapping[int, int],
               ended: Iterable[tuple[float, float]]) -> int:
    """Requests in flight at `at` (at or before the watermark): the open ones admitted by
    then, and the ended ones that spanned it."""
    last = int(at // BIN_S)
    still = sum(count for index, count in open_bins.items() if index <= last)
    return still + sum(1 for admitted, done in ended if admitted <= at < done)


def backlog(start: float, at_start: float, admit_bins: Mapping[int, int], now: float,
            rate: float) -> float:
    """A fluid queue from `start` to `now`: what was there, plus every admission as it
    happened, drained at `rate` (the bottleneck's capacity) whenever there is work.

    It cannot see chance queues (service times vary), only the ones arrivals past
    capacity build; that is what it is for, while access-log entries are on the way.
    """
    first, last = int(start // BIN_S), int(now // BIN_S)
    queued = at_start
    drain = rate * BIN_S
    for index in range(first + 1, last + 1):
        queued = max(0.0, queued + admit_bins.get(index, 0) - drain)
    return queued


def quantile_of(values: Iterable[float], q: float) -> float:
    """The q-quantile (nearest rank) of values; 0.0 when there are none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
