"""What any admission controller could reach on a FIFO stage: an oracle that knows the
true number of requests in flight at every instant caps low priority at K in flight
(protected requests are never refused and count toward K), on the scenario of
bench/pressure_sim.py at twice capacity (one server, 20 ms mean, 30 % protected, SLA
250 ms, 14 s). Per service-time distribution and K: the share of protected requests
late because of the low priority ahead of them (late, where the stage serving
protected work alone with the same service times would have been in time), and the
goodput against capacity.

The controller cannot beat this frontier: it sees the in-flight count a log flush or
a stats flush late and the step a few ticks late. Where no K gives both a late share
under 0.1 % and goodput over 95 %, the issue-29 targets cannot both be met by
admission alone on that distribution; only a stage that serves high priority first
(a priority queue at the stage, or requests held at the gate) could.

    PYTHONPATH=. .venv/bin/python bench/pressure_frontier.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from collections.abc import Sequence

from sitsmesh.pressure.loadprofile import SERVICE_KINDS, service_time

RATE, CAPACITY, MEAN_S, SLA_S, HIGH, SECONDS = 100.0, 50.0, 0.02, 0.25, 0.3, 14.0


def run(kind: str, cap: int, seed: int) -> tuple[float, float]:
    """(late because of others / protected, goodput / capacity) for one seeded run."""
    arrivals = random.Random(seed)
    work = random.Random(seed * 1_000_003 + 17)
    now = free_at = alone_free = 0.0
    ends: list[float] = []
    protected = late = good = 0
    while now < SECONDS:
        now += arrivals.expovariate(RATE)
        service = service_time(work, kind, MEAN_S)
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        high = arrivals.random() < HIGH
        if not high and len(ends) >= cap:
            continue
        free_at = max(now, free_at) + service
        heapq.heappush(ends, free_at)
        good += free_at - now <= SLA_S
        if high:
            protected += 1
            alone_free = max(now, alone_free) + service
            late += free_at - now > SLA_S >= alone_free - now
    return late / protected, good / SECONDS / CAPACITY


def held(kind: str, cap: int, seed: int, lag_s: float) -> tuple[float, float]:
    """The same with low priority held at the gate instead of refused: each waits (up to
    half the SLA, then it is refused) and goes in, oldest first, when the in-flight
    count the gate knows of drops under `cap`; the gate learns of an end `lag_s` after
    it (a log or stats flush). Protected requests are never held."""
    arrivals = random.Random(seed)
    work = random.Random(seed * 1_000_003 + 17)
    events: list[tuple[float, int, float]] = []   # (at, 0 arrival / 1 end known, service)
    now = free_at = alone_free = 0.0
    known = 0            # in flight as the gate knows it
    waiting: list[tuple[float, float]] = []       # (arrived, service) of held low priority
    protected = late = good = 0

    def admit(arrived: float, service: float, high: bool) -> None:
        nonlocal free_at, known, good, late, alone_free, protected
        free_at = max(now, free_at) + service
        known += 1
        heapq.heappush(events, (free_at + lag_s, 1, 0.0))
        good += free_at - arrived <= SLA_S
        if high:
            protected += 1
            alone_free = max(arrived, alone_free) + service
            late += free_at - arrived > SLA_S >= alone_free - arrived

    heapq.heappush(events, (arrivals.expovariate(RATE), 0, 0.0))
    while events:
        now, kind_of, _ = heapq.heappop(events)
        if kind_of == 1:
            known -= 1
        elif now < SECONDS:
            heapq.heappush(events, (now + arrivals.expovariate(RATE), 0, 0.0))
            service = service_time(work, kind, MEAN_S)
            if arrivals.random() < HIGH:
                admit(now, service, True)
            else:
                waiting.append((now, service))
        waiting = [w for w in waiting if now - w[0] <= SLA_S / 2]
        while waiting and known < cap:
            arrived, service = waiting.pop(0)
            admit(arrived, service, False)
    return late / protected, good / SECONDS / CAPACITY


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--caps", default="1,2,3,4,6,8")
    args = p.parse_args(argv)
    caps = [int(c) for c in args.caps.split(",")]
    print("| service | " + " | ".join(f"K={k}: late by others, goodput" for k in caps) + " |")
    print("|---|" + "---:|" * len(caps))
    for kind in SERVICE_KINDS:
        cells = []
        for cap in caps:
            runs = [run(kind, cap, seed) for seed in range(1, args.seeds + 1)]
            cells.append(f"{statistics.median(r[0] for r in runs):.2%}, "
                         f"{statistics.median(r[1] for r in runs):.2f}")
        print(f"| {kind} | " + " | ".join(cells) + " |", flush=True)
    print("\nHeld at the gate instead (the end known `lag` after it happens):\n")
    lags = (0.0, 0.005, 0.02, 0.25)
    print("| service | K | " + " | ".join(f"lag {lag * 1000:g} ms" for lag in lags) + " |")
    print("|---|---:|" + "---:|" * len(lags))
    for kind in SERVICE_KINDS:
        for cap in (1, 2):
            cells = []
            for lag in lags:
                runs = [held(kind, cap, seed, lag) for seed in range(1, args.seeds + 1)]
                cells.append(f"{statistics.median(r[0] for r in runs):.2%}, "
                             f"{statistics.median(r[1] for r in runs):.2f}")
            print(f"| {kind} | {cap} | " + " | ".join(cells) + " |", flush=True)
    print("\nMedians over seeds. Targets (issue 29): late by others <= 0.1 %, goodput >= 0.95.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
