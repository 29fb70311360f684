"""The BudgetLedger contract, as tests every store must pass.

A store's test module subclasses LedgerContract and provides one fixture, `ledger`: an
empty ledger. Every call passes `now`, so windows roll and holds pass without waiting.
The suite lives outside test_*.py so pytest collects it only through those subclasses.
"""

from __future__ import annotations

import pytest

from sitsmesh.budgets.ledger import AlreadyReserved, BudgetLedger, Spent
from sitsmesh.budgets.model import budget_from

# A day's start: every window (minute, hour, day) starts here, so offsets read plainly.
T0 = 1_700_006_400.0
HOLD = 600.0

BUDGET = budget_from("acme", {"limits": [
    {"tokens": 100, "per": "minute"},
    {"tokens": 150, "per": "hour", "each": "api_key"},
    {"tokens": 1000, "per": "day", "each": "model"},
]})
# minute (tenant) and hour (this API key)
TWO = BUDGET.counters("k1", "m1")[:2]
MINUTE = TWO[:1]
HOUR = TWO[1:]


class LedgerContract:
    async def test_reserve_is_all_or_none(self, ledger: BudgetLedger) -> None:
        # The minute counter is the tightest after it: 40 left, against 90.
        assert await ledger.reserve("a", TWO, 60, T0 + 1, HOLD) == Spent(True, -1, 100, 40,
                                                                          59.0)
        # The hour counter has room, the minute one not: neither is charged.
        assert await ledger.reserve("b", TWO, 60, T0 + 2, HOLD) == Spent(False, 0, 100, 40,
                                                                          58.0)
        assert await ledger.usage(TWO, T0 + 2) == [60, 60]
        assert await ledger.settle("b", 10, T0 + 3) is None  # a refusal holds nothing
        assert await ledger.reserve("c", TWO, 40, T0 + 3, HOLD) == Spent(True, -1, 100, 0,
                                                                          57.0)
        assert await ledger.usage(TWO, T0 + 3) == [100, 100]
        assert (await ledger.reserve("d", TWO, 1, T0 + 4, HOLD)).ok is False

    async def test_refusal_names_the_counter_and_its_figures(
            self, ledger: BudgetLedger) -> None:
        assert (await ledger.reserve("a", TWO, 100, T0, HOLD)).ok
        # Next minute: the minute counter is empty, the hour one has 50 left.
        now = T0 + 65
        assert await ledger.reserve("b", TWO, 60, now, HOLD) == Spent(False, 1, 150, 50,
                                                                       3535.0)
        # Reserved: the hour counter, 5 left, is tighter than the minute's 55.
        assert await ledger.reserve("c", TWO, 45, now, HOLD) == Spent(True, -1, 150, 5,
                                                                       3535.0)
        # Both refuse: the hour counter is named, a retry within the minute is refused too.
        assert await ledger.reserve("d", TWO, 60, now + 1, HOLD) == Spent(False, 1, 150, 5,
                                                                           3534.0)
        # The position in the counters asked for, whatever the order.
        reversed_two = [TWO[1], TWO[0]]
        assert (await ledger.reserve("e", reversed_two, 6, now, HOLD)).index == 0
        assert await ledger.usage(TWO, now) == [45, 145]

    async def test_windows_roll_over_at_the_epoch_boundary(self, ledger: BudgetLedger) -> None:
        assert await ledger.reserve("a", MINUTE, 100, T0 + 59.5, HOLD) == Spent(
            True, -1, 100, 0, 0.5)
        refused = await ledger.reserve("b", MINUTE, 1, T0 + 59.999, HOLD)
        assert (refused.ok, refused.index, refused.remaining) == (False, 0, 0)
        assert refused.reset_s == pytest.approx(0.001, abs=1e-5)
        assert await ledger.reserve("c", MINUTE, 100, T0 + 60, HOLD) == Spent(
            True, -1, 100, 0, 60.0)
        assert await ledger.usage(MINUTE, T0 + 60) == [100]
        assert await ledger.usage(MINUTE, T0 + 120) == [0]
        # The hour rolls at its own boundary.
        spent = await ledger.reserve("h1", HOUR, 150, T0 + 3599.9, HOLD)
        assert (spent.ok, spent.remaining) == (True, 0)
        assert spent.reset_s == pytest.approx(0.1, abs=1e-5)
        assert await ledger.usage(TWO, T0 + 3599.9) == [0, 150]
        assert await ledger.usage(TWO, T0 + 3600) == [0, 0]
        assert await ledger.reserve("h2", HOUR, 150, T0 + 3600, HOLD) == Spent(
            True, -1, 150, 0, 3600.0)

    async def test_settle_charges_actual_in_the_reservation_windows(
            self, ledger: BudgetLedger) -> None:
        assert (await ledger.reserve("a", TWO, 50, T0 + 10, HOLD)).ok
        assert (await ledger.reserve("b", TWO, 30, T0 + 50, HOLD)).ok
        assert await ledger.usage(TWO, T0 + 50) == [80, 80]
        # Settled in the next minute: the reservation's minute is corrected, not this one.
        assert await ledger.settle("a", 70, T0 + 70) == 50
        assert await ledger.usage(TWO, T0 + 70) == [0, 100]
        assert await ledger.settle("b", 5, T0 + 71) == 30
        assert await ledger.usage(TWO, T0 + 71) == [0, 75]
        # What was produced is charged, past the limit too; then nothing more fits.
        assert (await ledger.reserve("c", TWO, 10, T0 + 72, HOLD)).ok
        assert await ledger.settle("c", 120, T0 + 73) == 10
        assert await ledger.usage(TWO, T0 + 73) == [120, 195]
        spent = await ledger.reserve("d", TWO, 1, T0 + 74, HOLD)
        assert (spent.ok, spent.remaining) == (False, 0)
        # Settling what was reserved changes nothing.
        assert (await ledger.reserve("e", MINUTE, 0, T0 + 120, HOLD)).ok
        assert await ledger.settle("e", 0, T0 + 121) == 0
        assert await ledger.usage(TWO, T0 + 121) == [0, 195]

    async def test_settle_twice_or_unknown_is_none(self, ledger: BudgetLedger) -> None:
        assert (await ledger.reserve("a", TWO, 20, T0, HOLD)).ok
        assert await ledger.settle("a", 10, T0 + 1) == 20
        assert await ledger.settle("a", 99, T0 + 2) is None
        assert await ledger.settle("never", 5, T0 + 2) is None
        assert await ledger.usage(TWO, T0 + 2) == [10, 10]

    async def test_expire_forgets_only_unsettled(self, ledger: BudgetLedger) -> None:
        for request_id in ("a", "b", "c"):
            assert (await ledger.reserve(request_id, TWO, 10, T0, 30.0)).ok
        assert (await ledger.reserve("long", TWO, 10, T0, 300.0)).ok
        assert await ledger.settle("b", 4, T0 + 5) == 10
        assert await ledger.expire(T0 + 20) == 0
        # Settled past its hold but before expire forgot it: still settled.
        assert await ledger.settle("c", 10, T0 + 31) == 10
        assert await ledger.expire(T0 + 31) == 1  # "a"
        assert await ledger.expire(T0 + 32) == 0
        # A lost end stays charged at its estimate, and can no longer be settled.
        assert await ledger.usage(TWO, T0 + 32) == [34, 34]
        assert await ledger.settle("a", 0, T0 + 33) is None
        assert await ledger.usage(TWO, T0 + 33) == [34, 34]
        assert await ledger.settle("long", 1, T0 + 34) == 10
        assert await ledger.expire(T0 + 400) == 0

    async def test_a_request_id_holds_one_reservation(self, ledger: BudgetLedger) -> None:
        assert (await ledger.reserve("a", TWO, 10, T0, HOLD)).ok
        with pytest.raises(AlreadyReserved, match="already holds"):
            await ledger.reserve("a", TWO, 10, T0 + 1, HOLD)
        assert await ledger.usage(TWO, T0 + 1) == [10, 10]
        assert await ledger.settle("a", 10, T0 + 2) == 10
        assert (await ledger.reserve("a", TWO, 10, T0 + 3, HOLD)).ok  # free again
        assert await ledger.usage(TWO, T0 + 3) == [20, 20]

    async def test_bad_arguments_are_refused(self, ledger: BudgetLedger) -> None:
        with pytest.raises(ValueError, match="amount"):
            await ledger.reserve("a", TWO, -1, T0, HOLD)
        with pytest.raises(ValueError, match="counter"):
            await ledger.reserve("a", [], 1, T0, HOLD)
        with pytest.raises(ValueError, match="actual"):
            await ledger.settle("a", -5, T0)
        assert await ledger.usage(TWO, T0) == [0, 0]
