"""What every ledger store figures alike from the counts it read: window starts and the
Spent answer. Stores only read and write; these decide, so two stores given the same
counts cannot disagree on a Spent."""

from __future__ import annotations

from collections.abc import Sequence

from sitsmesh.budgets.ledger import Spent
from sitsmesh.budgets.model import Counter
from sitsmesh.errors import Code, SitsmeshError


class LedgerFull(SitsmeshError):
    """The ledger holds as many reservations (or windows) as it may; nothing was
    reserved. Bounded memory beats admitting work nobody can account for."""

    code = Code.RESOURCE_EXHAUSTED


def window_start(now: float, window_s: int) -> int:
    """The start of the epoch-aligned window holding `now`."""
    return int(now // window_s) * window_s


def check_amount(name: str, amount: int) -> None:
    if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {amount!r}")


def spent(counters: Sequence[Counter], used: Sequence[int], amount: int,
          now: float) -> Spent:
    """The answer for `amount` given each counter's spend before it, in the current
    windows. Reserved when every counter has room.

    Refused: of the counters without room, the one whose window resets last (ties: the
    first), since a retry before it resets is refused again. Reserved: the counter with
    least left after the reservation (ties: the first)."""
    best = -1
    best_remaining = 0
    best_reset = 0.0
    refused = False
    for i, (counter, before) in enumerate(zip(counters, used, strict=True)):
        window = counter.window_s
        reset = window_start(now, window) + window - now
        over = before + amount > counter.limit
        if over:
            if not refused or reset > best_reset:
                refused = True
                best, best_remaining, best_reset = i, max(0, counter.limit - before), reset
        elif not refused:
            remaining = counter.limit - before - amount
            if best < 0 or remaining < best_remaining:
                best, best_remaining, best_reset = i, remaining, reset
    if best < 0:
        raise ValueError("a reservation needs at least one counter")
    return Spent(not refused, best if refused else -1, counters[best].limit,
                 best_remaining, best_reset)
