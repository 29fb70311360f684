"""In-process budget ledger: one process's counters and reservations, bounded, with
ended windows freed.

The event loop runs every call to completion without awaiting, so no lock is needed
and reserve's check-then-add is atomic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from sitsmesh.budgets.counting import LedgerFull, check_amount, spent, window_start
from sitsmesh.budgets.ledger import AlreadyReserved, Spent
from sitsmesh.budgets.model import Counter

DEFAULT_MAX_RESERVATIONS = 1_000_000
DEFAULT_MAX_WINDOWS = 1_000_000

_Window = tuple[str, int]  # (counter key, window start)


class MemoryLedger:
    """A BudgetLedger in this process: right for one replica, or for tests."""

    name = "memory"

    def __init__(self, max_reservations: int = DEFAULT_MAX_RESERVATIONS,
                 max_windows: int = DEFAULT_MAX_WINDOWS) -> None:
        self._max_reservations = max_reservations
        # Counter keys embed API key ids and model names callers chose, so the number
        # of live windows is bounded too, not only the reservations.
        self._max_windows = max_windows
        self._used: dict[_Window, int] = {}
        # (window end, window): ended windows leave in end order, whatever their size.
        self._ends: list[tuple[int, _Window]] = []
        # request id -> (its windows, amount, deadline).
        self._held: dict[str, tuple[tuple[_Window, ...], int, float]] = {}
        # (deadline, request id); entries settled since are skipped when popped.
        self._deadlines: list[tuple[float, str]] = []

    def __len__(self) -> int:
        """Reservations held."""
        return len(self._held)

    @property
    def windows(self) -> int:
        return len(self._used)

    def _drop_ended(self, now: float) -> None:
        ends = self._ends
        while ends and ends[0][0] <= now:
            self._used.pop(heapq.heappop(ends)[1], None)

    async def reserve(self, request_id: str, counters: Sequence[Counter], amount: int,
                      now: float, hold_s: float) -> Spent:
        check_amount("amount", amount)
        if not counters:
            raise ValueError("a reservation needs at least one counter")
        if request_id in self._held:
            raise AlreadyReserved(f"request {request_id!r} already holds a reservation")
        self._drop_ended(now)
        windows = tuple((c.key, window_start(now, c.window_s)) for c in counters)
        used = [self._used.get(w, 0) for w in windows]
        answer = spent(counters, used, amount, now)
        if not answer.ok:
            return answer
        if len(self._held) >= self._max_reservations:
            raise LedgerFull(f"{len(self._held)} budget reservations held, the most "
                             "allowed; settle or expire some first")
        new = sum(1 for w in windows if w not in self._used)
        if new and len(self._used) + new > self._max_windows:
            raise LedgerFull(f"{len(self._used)} budget windows live, the most allowed")
        for counter, window, before in zip(counters, windows, used, strict=True):
            if window not in self._used:
                heapq.heappush(self._ends, (window[1] + counter.window_s, window))
            self._used[window] = before + amount
        deadline = now + hold_s
        self._held[request_id] = (windows, amount, deadline)
        heapq.heappush(self._deadlines, (deadline, request_id))
        if len(self._deadlines) > 2 * len(self._held) + 1024:
            # Settled reservations leave their deadline behind; rebuilt now and then so
            # the heap stays within twice the reservations held, expire() or not.
            self._deadlines = [(entry[2], rid) for rid, entry in self._held.items()]
            heapq.heapify(self._deadlines)
        return answer

    async def settle(self, request_id: str, actual: int, now: float) -> int | None:
        check_amount("actual", actual)
        held = self._held.get(request_id)
        if held is None:
            return None
        del self._held[request_id]
        windows, amount, _ = held
        delta = actual - amount
        if delta:
            for window in windows:
                # An ended window that was freed is read by nobody: nothing to correct.
                before = self._used.get(window)
                if before is not None:
                    self._used[window] = max(0, before + delta)
        return amount

    async def usage(self, counters: Sequence[Counter], now: float) -> list[int]:
        return [self._used.get((c.key, window_start(now, c.window_s)), 0) for c in counters]

    async def expire(self, now: float) -> int:
        self._drop_ended(now)
        lost = 0
        deadlines, held = self._deadlines, self._held
        while deadlines and deadlines[0][0] < now:
            deadline, request_id = heapq.heappop(deadlines)
            entry = held.get(request_id)
            if entry is not None and entry[2] == deadline:
                del held[request_id]
                lost += 1
        return lost

    async def close(self) -> None:
        self._used.clear()
        self._ends.clear()
        self._held.clear()
        self._deadlines.clear()
