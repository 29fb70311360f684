"""In-process counter store: the embedded default. Bounded, and expired windows are freed.

The event loop runs every call to completion without awaiting, so no lock is
needed and nothing blocks the request path.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.store import Count, Hit, fixed_window, gcra, sliding_window

DEFAULT_MAX_KEYS = 200_000
DEFAULT_MAX_BYTES = 64 << 20
EVICT_BATCH = 1024
# A dict slot, the (value, expires_at) tuple with its two floats, and the key's str header:
# what one counter costs beyond its key's characters.
ENTRY_BYTES = 200


class MemoryStore:
    name = "memory"

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS,
                 max_bytes: int = DEFAULT_MAX_BYTES, *, count_rejected: bool = True) -> None:
        self._count_rejected = count_rejected
        # key -> (value, expires_at); insertion order doubles as age for eviction.
        self._data: dict[str, tuple[float, float]] = {}
        self._max_keys = max_keys
        # Keys embed descriptor values the caller chose, so a count bound alone is no
        # memory bound: the estimated bytes are bounded too.
        self._max_bytes = max_bytes
        self.bytes = 0
        self._ops = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._data)

    def _get(self, key: str, now: float) -> float:
        entry = self._data.get(key)
        if entry is None or entry[1] <= now:
            return 0.0
        return entry[0]

    def _set(self, key: str, value: float, expires_at: float) -> None:
        if key not in self._data:
            cost = ENTRY_BYTES + len(key)
            while self._data and (len(self._data) >= self._max_keys
                                  or self.bytes + cost > self._max_bytes):
                self._make_room()
            self.bytes += cost
        self._data[key] = (value, expires_at)

    def _make_room(self) -> None:
        # Oldest first: under a flood of distinct keys the newest windows survive.
        # In batches: finding a dict's oldest entry scans the slots deleted before it,
        # so one scan should pay for many evictions.
        batch = list(islice(self._data, max(1, min(EVICT_BATCH, len(self._data) // 100))))
        for key in batch:
            del self._data[key]
            self.bytes -= ENTRY_BYTES + len(key)
        self.evicted += len(batch)

    def sweep(self, now: float, budget: int = 1000) -> int:
        """Free up to `budget` expired entries, oldest first. Returns how many were freed."""
        freed = 0
        for key, (_, expires_at) in list(self._data.items())[:budget]:
            if expires_at <= now:
                del self._data[key]
                self.bytes -= ENTRY_BYTES + len(key)
                freed += 1
        return freed

    def hit_sync(self, hits: Sequence[Hit], now: float) -> list[Count]:
        self._ops += 1
        if self._ops % 4096 == 0:
            self.sweep(now)
        out: list[Count] = []
        for hit in hits:
            window = hit.window_s
            if hit.algorithm is Algorithm.FIXED_WINDOW:
                start = now - now % window
                key = f"{hit.key}:{int(start)}"
                current = int(self._get(key, now))
                value, count = fixed_window(current, hit, now,
                                            count_rejected=self._count_rejected)
                if value != current:
                    self._set(key, value, start + window)
            elif hit.algorithm is Algorithm.SLIDING_WINDOW:
                start = now - now % window
                key = f"{hit.key}:{int(start)}"
                previous = int(self._get(f"{hit.key}:{int(start - window)}", now))
                value, count = sliding_window(previous, int(self._get(key, now)), hit, now)
                if hit.addend and not count.over:
                    self._set(key, value, start + 2 * window)
            else:
                tat, count = gcra(self._get(hit.key, now), hit, now)
                if hit.addend and not count.over:
                    self._set(hit.key, tat, tat)
            out.append(count)
        return out

    async def hit(self, hits: Sequence[Hit], now: float) -> list[Count]:
        return self.hit_sync(hits, now)

    async def close(self) -> None:
        self._data.clear()
        self.bytes = 0
