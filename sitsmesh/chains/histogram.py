"""A fixed-bucket, mergeable latency histogram: memory does not grow with traffic.

Buckets grow geometrically (ratio 2^(1/16), ~4.4 % relative error) from 10 µs
to about an hour, so quantiles come back within that error whatever the load.
"""

from __future__ import annotations

import math

MIN_S = 1e-5
RATIO = 2 ** (1 / 16)
BUCKETS = 16 * 29  # 1e-5 * 2^29 s ~ 1.5 h
_PER_MIN = 1 / MIN_S


def _index(seconds: float) -> int:
    if seconds <= MIN_S:
        return 0
    # log2 * 16 is log base 2^(1/16): one call, no division.
    return min(BUCKETS - 1, int(math.log2(seconds * _PER_MIN) * 16) + 1)


def _upper(index: int) -> float:
    return MIN_S * RATIO ** index


class Histogram:
    __slots__ = ("counts", "sum", "total")

    def __init__(self) -> None:
        self.counts = [0] * BUCKETS
        self.total = 0
        self.sum = 0.0

    def add(self, seconds: float) -> None:
        self.counts[_index(seconds)] += 1
        self.total += 1
        self.sum += seconds

    def merge(self, other: Histogram) -> None:
        counts = self.counts
        for i, n in enumerate(other.counts):
            if n:
                counts[i] += n
        self.total += other.total
        self.sum += other.sum

    def buckets(self) -> list[tuple[float, int]]:
        """The non-empty buckets, ascending: (upper bound in seconds, count). A bucket holds
        the samples above the bound below it (upper / RATIO) up to its upper bound."""
        return [(_upper(i), n) for i, n in enumerate(self.counts) if n]

    def quantile(self, q: float) -> float:
        """The q-quantile in seconds (bucket upper bound); 0.0 when empty."""
        if not self.total:
            return 0.0
        rank = max(1, math.ceil(q * self.total))
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return _upper(i)
        return _upper(BUCKETS - 1)
