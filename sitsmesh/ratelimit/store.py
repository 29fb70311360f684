"""The counter-store contract, and the counting rules every store implements alike.

A store receives every counter a request touches in one call, so a remote
store can answer them in one round trip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sitsmesh.ratelimit.config import Algorithm


@dataclass(slots=True)
class Hit:
    key: str
    algorithm: Algorithm
    limit: int
    window_s: int
    addend: int


@dataclass(slots=True)
class Count:
    over: bool
    # Hits left in the window after this one (0 when over).
    remaining: int
    # Seconds until the window resets (fixed, sliding) or the next hit fits (gcra).
    reset_s: float
    # Hits used in the window including this one, for near-limit accounting.
    used: int


class CounterStore(Protocol):
    name: str

    async def hit(self, hits: Sequence[Hit], now: float) -> list[Count]: ...

    async def close(self) -> None: ...


def fixed_window(current: int, hit: Hit, now: float, *, count_rejected: bool = True
                 ) -> tuple[int, Count]:
    """`current` is the count before this hit; returns (new count, answer).

    As in the reference service, the hit is counted even when it is over the limit,
    unless `count_rejected` is off; and the reset is in whole seconds
    (window - now mod window, never 0), as the reference's clock ticks in seconds.
    """
    after = current + hit.addend
    window = hit.window_s
    over = after > hit.limit
    return (current if over and not count_rejected else after,
            Count(over, 0 if over else hit.limit - after, float(window - int(now) % window),
                  after))


def sliding_window(previous: int, current: int, hit: Hit, now: float) -> tuple[int, Count]:
    """Two-window estimate; a rejected hit is not counted. Returns (new current, answer)."""
    start = now - now % hit.window_s
    weight = 1.0 - (now - start) / hit.window_s
    estimate = previous * weight + current
    after = estimate + hit.addend
    reset = start + hit.window_s - now
    if after > hit.limit:
        return current, Count(True, 0, reset, math.ceil(estimate))
    return current + hit.addend, Count(False, int(hit.limit - after), reset, math.ceil(after))


def gcra(tat: float, hit: Hit, now: float) -> tuple[float, Count]:
    """Generic cell rate: `tat` is the theoretical arrival time. Returns (new tat, answer)."""
    if hit.limit <= 0:
        return tat, Count(True, 0, float(hit.window_s), 0)
    interval = hit.window_s / hit.limit
    base = max(tat, now)
    new_tat = base + interval * hit.addend
    if new_tat - now > hit.window_s:
        used = min(hit.limit, math.ceil((base - now) / interval))
        return tat, Count(True, 0, new_tat - now - hit.window_s, used)
    remaining = int((hit.window_s - (new_tat - now)) / interval + 1e-9)
    return new_tat, Count(False, remaining, new_tat - now, hit.limit - remaining)
