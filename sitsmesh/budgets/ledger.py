"""Where token budgets are spent: the ledger contract every store keeps alike.

Reserve, then settle. At Check a request reserves its estimate in every counter its
budget names, all or none, atomically (two replicas can never both spend the last
tokens). When its stream ends it is settled: charged what it really cost instead, in
the same windows it reserved in. A reservation never settled (its end was lost) is
forgotten after its hold and stays charged at the estimate; such ones are counted.

Counters are fixed windows aligned to the epoch (a minute counter's window starts at
each whole minute), kept under the counter's key and the window's start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sitsmesh.budgets.model import Counter


class AlreadyReserved(ValueError):
    """The request id holds a reservation already (a retry through the entry again)."""


@dataclass(frozen=True, slots=True)
class Spent:
    """A reservation's answer. `ok`: reserved. Else `index` is the counter that did not
    have room (its position in the counters asked for). `limit`, `remaining` and
    `reset_s` are of the tightest counter (the refusing one when refused): what the
    OpenAI-style x-ratelimit-*-tokens headers say."""

    ok: bool
    index: int
    limit: int
    remaining: int
    reset_s: float


class BudgetLedger(Protocol):
    name: str

    async def reserve(self, request_id: str, counters: Sequence[Counter], amount: int,
                      now: float, hold_s: float) -> Spent:
        """If every counter has room for `amount` in its current window, add it to each
        and hold the reservation under `request_id` for `hold_s`; else change nothing.
        A request id already holding a reservation is refused with AlreadyReserved."""
        ...

    async def settle(self, request_id: str, actual: int, now: float) -> int | None:
        """Charge `actual` in place of the reservation (in the windows it was made in)
        and forget it; the reserved amount it replaced, or None where no reservation is
        held (never made, settled already, or forgotten past its hold)."""
        ...

    async def usage(self, counters: Sequence[Counter], now: float) -> list[int]:
        """Each counter's spend in its current window (reservations included)."""
        ...

    async def expire(self, now: float) -> int:
        """Forget this process's reservations past their hold that were never settled
        (they stay charged at their estimate); how many."""
        ...

    async def close(self) -> None: ...
