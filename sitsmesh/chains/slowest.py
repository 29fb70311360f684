"""The slowest finished chains of a pipeline, kept whole: request id, trace id and
each stage's place in the waterfall, so a person can find those requests again.

A bounded min-heap per pipeline and time slot: a chain that is not slower than the
fastest one kept costs one comparison, and one that is costs O(log N), N <= 20.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_SLOWEST = 10
MAX_SLOWEST = 20


@dataclass(frozen=True, slots=True)
class SlowStage:
    name: str
    offset_ms: float   # from the start of the chain's earliest hop
    own_ms: float      # its hop minus the hops it waited on
    total_ms: float    # its whole hop


@dataclass(frozen=True, slots=True)
class SlowChain:
    request_id: str
    trace_id: str      # 32 hex digits from the request's traceparent, or ""
    e2e_ms: float
    stages: tuple[SlowStage, ...]  # in the pipeline's stage order
    failed: bool = False


def checked_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SLOWEST:
        raise ValueError(f"slowest chains kept must be 1..{MAX_SLOWEST}, got {limit!r}")
    return limit


@dataclass(slots=True)
class Slowest:
    """Up to `limit` chains, slowest kept; ties keep the earlier chain."""

    limit: int
    # (e2e seconds, sequence, chain): the sequence breaks ties, chains never compare.
    heap: list[tuple[float, int, SlowChain]] = field(default_factory=list)

    def admits(self, e2e: float) -> bool:
        """Whether a chain this slow would be kept: ask before building one."""
        return len(self.heap) < self.limit or e2e > self.heap[0][0]

    def push(self, e2e: float, sequence: int, chain: SlowChain) -> None:
        entry = (e2e, -sequence, chain)
        if len(self.heap) < self.limit:
            heapq.heappush(self.heap, entry)
        elif e2e > self.heap[0][0]:
            heapq.heapreplace(self.heap, entry)


def slowest_of(parts: Iterable[Slowest], limit: int) -> tuple[SlowChain, ...]:
    """The `limit` slowest over several slots, slowest first (exact: each slot kept its own
    top `limit`, and the top of a union is among the tops of its parts)."""
    entries = [entry for part in parts for entry in part.heap]
    return tuple(entry[2] for entry in heapq.nlargest(limit, entries,
                                                      key=lambda e: (e[0], e[1])))
