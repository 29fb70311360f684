"""Divide one global rate among the Envoys that ask for it, by their recent demand.

Envoy 1.40 enforces a token bucket per bucket id and Envoy process, refilled
continuously at tokens_per_fill / fill_interval, and reads fill_interval in whole
seconds (a smaller one divides by zero). So a share is a whole number of tokens per
fill of whole seconds; the fill is chosen per rule, once, long enough that every
Envoy gets at least one token per fill, and the Envoys' tokens add up to the rule's
rate exactly.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

# Tokens per fill across all Envoys at least this many: coarser shares round badly.
RESOLUTION = 100
# An Envoy whose demand is tiny (or just arrived) still gets this fraction of an equal
# share, so a burst on it is not refused until its next report, 5 s later.
FLOOR = 0.1
# The bucket holds about this long of its rate, and at least MIN_BURST tokens: a bucket
# of one token loses whatever accrues while it is full (an Envoy with one token a
# second and a request every 1/3 s admitted 0.75 a second), and a new assignment
# starts full, so a big one overshoots.
BURST_S = 1.0
MIN_BURST = 2


@dataclass(frozen=True, slots=True)
class TokenShare:
    tokens_per_fill: int
    fill_s: int
    max_tokens: int

    @property
    def rate(self) -> float:
        return self.tokens_per_fill / self.fill_s


def fill_seconds(rate: float, envoys: int, window_s: int) -> int:
    """Whole seconds per fill for a global `rate` (requests/s): at least RESOLUTION
    tokens per fill in all and one per Envoy, never longer than the rule's window."""
    if rate <= 0:
        return 1
    wanted = math.ceil(max(RESOLUTION, envoys) / rate)
    return max(1, min(wanted, max(1, window_s)))


def weights(rate: float, demands: Mapping[str, float | None]) -> dict[str, float]:
    """Each Envoy's weight: its demand (requests/s), an equal share when not yet known,
    and never below FLOOR of an equal share."""
    if not demands:
        return {}
    equal = rate / len(demands)
    floor = max(FLOOR * equal, 1e-9)
    return {envoy: max(floor, equal if demand is None else demand)
            for envoy, demand in demands.items()}


def split(rate: float, window_s: int, demands: Mapping[str, float | None],
          burst_s: float = BURST_S) -> dict[str, TokenShare]:
    """Each Envoy's token bucket for a global `rate` (requests/s) over `window_s`-second
    windows, in proportion to `weights`. The tokens per fill add up to the rate (one
    per Envoy at least: a bucket of zero would refuse everything until a report)."""
    envoys = sorted(demands)
    if not envoys:
        return {}
    fill = fill_seconds(rate, len(envoys), window_s)
    total = max(len(envoys), round(rate * fill))
    weight = weights(rate, demands)
    whole = sum(weight.values())
    exact = [total * weight[e] / whole for e in envoys]
    floors = [math.floor(x) for x in exact]
    tokens = dict(zip(envoys, floors, strict=True))
    # Largest remainders take what the floors left, ties by name (stable across calls).
    # Sorted as plain tuples: a key function per Envoy was most of a 1 000-Envoy split.
    left = total - sum(floors)
    gaps = [f - x for f, x in zip(floors, exact, strict=True)]
    for _, e in sorted(zip(gaps, envoys, strict=True))[:left]:
        tokens[e] += 1
    _no_zero(envoys, tokens)
    # One TokenShare per distinct token count: most Envoys share a few, and the caller
    # interns each once.
    made: dict[int, TokenShare] = {}
    shares = {}
    for e, t in tokens.items():
        share = made.get(t)
        if share is None:
            share = made[t] = TokenShare(t, fill, max(MIN_BURST, math.ceil(t / fill * burst_s)))
        shares[e] = share
    return shares


def _no_zero(envoys: list[str], tokens: dict[str, int]) -> None:
    """Give each Envoy left with no token one (zero would refuse everything until its
    next report), taken from the Envoy with the most (the last by name among equals).
    A heap, not a scan per zero: 1 000 Envoys sharing 100 requests/s left hundreds of
    zeros, and the scans took 16 ms of the event loop per split. The tokens add up to
    at least one per Envoy, so while a zero is left the most is at least two: the one
    taken from keeps one, and an Envoy given its one is never the most."""
    zeros = [e for e in envoys if tokens[e] == 0]
    if not zeros:
        return
    # (-tokens, -rank): the most tokens first, then the last name (envoys is sorted).
    heap = [(-tokens[e], -rank, e) for rank, e in enumerate(envoys) if tokens[e]]
    heapq.heapify(heap)
    for e in zeros:
        top = heapq.heappop(heap)
        tokens[top[2]] -= 1
        heapq.heappush(heap, (top[0] + 1, top[1], top[2]))
        tokens[e] = 1  # never the most while a zero is left: not in the heap


def equal_share(rate: float, window_s: int, envoys: int,
                burst_s: float = BURST_S) -> TokenShare:
    """One Envoy's share when `envoys` split `rate` evenly: what a bucket that joins a
    rate gets at once, until the next split places it by demand."""
    envoys = max(1, envoys)
    fill = fill_seconds(rate, envoys, window_s)
    tokens = max(1, round(rate * fill / envoys))
    return TokenShare(tokens, fill, max(MIN_BURST, math.ceil(tokens / fill * burst_s)))
