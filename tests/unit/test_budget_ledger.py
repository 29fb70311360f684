"""MemoryLedger: the ledger contract (tests/ledger_contract.py), and its own bounds.
Redis: tests/integration/test_budget_redis.py runs the same contract."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sitsmesh.budgets.counting import LedgerFull
from sitsmesh.budgets.memory import MemoryLedger
from sitsmesh.errors import Code
from tests.ledger_contract import BUDGET, HOLD, MINUTE, T0, TWO, LedgerContract


class TestMemoryLedger(LedgerContract):
    @pytest.fixture
    async def ledger(self) -> AsyncIterator[MemoryLedger]:
        memory = MemoryLedger()
        yield memory
        await memory.close()


async def test_reservations_are_capped() -> None:
    ledger = MemoryLedger(max_reservations=2)
    assert (await ledger.reserve("a", TWO, 1, T0, HOLD)).ok
    assert (await ledger.reserve("b", TWO, 1, T0, HOLD)).ok
    with pytest.raises(LedgerFull, match="reservations") as caught:
        await ledger.reserve("c", TWO, 1, T0, HOLD)
    assert caught.value.code is Code.RESOURCE_EXHAUSTED
    assert await ledger.usage(TWO, T0) == [2, 2]  # the refused one charged nothing
    # A refusal for want of tokens is still an answer, not an error.
    assert not (await ledger.reserve("c", TWO, 1000, T0, HOLD)).ok
    assert await ledger.settle("a", 1, T0 + 1) == 1
    assert (await ledger.reserve("c", TWO, 1, T0 + 1, HOLD)).ok
    # Expired ones make room too.
    assert await ledger.expire(T0 + HOLD + 2) == 2
    assert len(ledger) == 0


async def test_windows_are_capped_and_ended_ones_freed() -> None:
    ledger = MemoryLedger(max_windows=2)
    assert (await ledger.reserve("a", TWO, 1, T0, 10 * HOLD)).ok  # a minute and an hour
    with pytest.raises(LedgerFull, match="windows"):
        # Another key's hour (the minute is the tenant's, shared): one window too many.
        await ledger.reserve("b", BUDGET.counters("k2", "m1")[:2], 1, T0, HOLD)
    assert (ledger.windows, len(ledger)) == (2, 1)
    assert (await ledger.reserve("c", MINUTE, 1, T0 + 60, HOLD)).ok  # the old minute ended
    assert ledger.windows == 2
    assert await ledger.expire(T0 + 3600) == 1  # "c"; "a" is still held
    assert ledger.windows == 0
    # A settle after its windows ended corrects nothing and recreates nothing.
    assert await ledger.settle("a", 50, T0 + 3600) == 1
    assert ledger.windows == 0

