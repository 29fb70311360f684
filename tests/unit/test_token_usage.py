"""GetTokenUsage over a real SQLite store and a small in-test ledger: one row per limit of
the tenant's budget, per unrevoked key (each api_key) and per literal model the limit
counts (each model), with used, remaining and the window's reset; refused where budgets
are not enabled or the tenant has none; bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from grpc import aio

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.authz.directory import TenantDirectory
from sitsmesh.budgets.ledger import BudgetLedger, Spent
from sitsmesh.budgets.model import BUDGET_KIND, Counter, budget_from
from sitsmesh.budgets.usage import usage
from sitsmesh.errors import FailedPreconditionError, NotFoundError
from sitsmesh.state import SqliteStore
from sitsmesh.transport.admin.paging import PageTokens
from sitsmesh.transport.admin.tenants import TenantAdmin

NOW = 1_800_000_030.0  # 30 s into a minute and an hour, 28,830 s into a UTC day
BUDGET = {"limits": [{"tokens": 1000, "per": "minute"},
                     {"tokens": 500, "per": "hour", "each": "api_key"},
                     {"tokens": 9000, "per": "day", "each": "model", "models": ["llama-*"]}]}


class Ledger:
    """Fixed windows as the contract says, without holds: enough to read usage back."""

    name = "test"

    def __init__(self) -> None:
        self.spent: dict[tuple[str, int], int] = {}
        self.asked: list[int] = []

    def _window(self, counter: Counter, now: float) -> tuple[str, int]:
        return counter.key, int(now // counter.window_s)

    async def reserve(self, request_id: str, counters: Sequence[Counter], amount: int,
                      now: float, hold_s: float) -> Spent:
        for counter in counters:
            at = self._window(counter, now)
            self.spent[at] = self.spent.get(at, 0) + amount
        return Spent(True, -1, 0, 0, 0.0)

    async def settle(self, request_id: str, actual: int, now: float) -> int | None:
        return None

    async def usage(self, counters: Sequence[Counter], now: float) -> list[int]:
        self.asked.append(len(counters))
        return [self.spent.get(self._window(c, now), 0) for c in counters]

    async def expire(self, now: float) -> int:
        return 0

    async def close(self) -> None:
        return None


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "state.db")
    yield opened
    await opened.close()


async def admin(store: SqliteStore, ledger: BudgetLedger | None) -> tuple[TenantAdmin, Any]:
    directory = TenantDirectory(store, clock=lambda: NOW)
    await directory.create_tenant("acme", {"models": ["llama-8b", "llama-*", "bert"]})
    return TenantAdmin(directory, PageTokens(key=bytes(32)), ledger=ledger,
                       clock=lambda: NOW), directory


# The servicer reads nothing of the context; the gRPC server's own is not needed here.
CONTEXT = cast(aio.ServicerContext[Any, Any], None)


def rows(reply: admin_pb2.GetTokenUsageResponse) -> list[tuple[Any, ...]]:
    return [(u.limit_index, u.per, u.each, u.subject, u.tokens, u.used, u.remaining,
             u.reset_s) for u in reply.usage]


async def test_each_limit_s_counters_with_used_remaining_and_reset(
        store: SqliteStore) -> None:
    ledger = Ledger()
    servicer, directory = await admin(store, ledger)
    await store.put(BUDGET_KIND, "acme", BUDGET)
    first, _ = await directory.create_key("acme")
    second, _ = await directory.create_key("acme")
    gone, _ = await directory.create_key("acme")
    await directory.revoke_key(gone.id)
    budget = budget_from("acme", BUDGET)
    # What Check would reserve: 300 tokens of llama-8b through the first key.
    await ledger.reserve("r1", budget.counters(first.id, "llama-8b"), 300, NOW, 60)
    await ledger.reserve("r2", budget.counters(second.id, "bert"), 700, NOW, 60)

    reply = await servicer.GetTokenUsage(admin_pb2.GetTokenUsageRequest(tenant="acme"), CONTEXT)
    assert reply.tenant == "acme" and not reply.truncated
    low, high = sorted((first.id, second.id))
    used = {first.id: 300, second.id: 700}
    assert rows(reply) == [
        (0, "minute", "tenant", "acme", 1000, 1000, 0, 30.0),
        (1, "hour", "api_key", low, 500, used[low], max(0, 500 - used[low]), 3570.0),
        (1, "hour", "api_key", high, 500, used[high], max(0, 500 - used[high]), 3570.0),
        # bert is not counted by the llama-* limit; the glob llama-* names no one model.
        (2, "day", "model", "llama-8b", 9000, 300, 8700, 57570.0)]
    assert [list(u.models) for u in reply.usage] == [["*"], ["*"], ["*"], ["llama-*"]]
    assert ledger.asked == [4]  # one ledger read for every counter


async def test_refused_without_a_ledger_or_a_budget(store: SqliteStore) -> None:
    servicer, _ = await admin(store, None)
    with pytest.raises(FailedPreconditionError, match="token budgets are not enabled"):
        await servicer.GetTokenUsage(admin_pb2.GetTokenUsageRequest(tenant="acme"), CONTEXT)
    servicer, _ = await admin(SqliteStore(store.path.with_name("other.db")), Ledger())
    with pytest.raises(NotFoundError, match="tenant acme has no TokenBudget"):
        await servicer.GetTokenUsage(admin_pb2.GetTokenUsageRequest(tenant="acme"), CONTEXT)
    with pytest.raises(NotFoundError, match="tenant nobody does not exist"):
        await servicer.GetTokenUsage(admin_pb2.GetTokenUsageRequest(tenant="nobody"), CONTEXT)


async def test_an_answer_is_bounded_and_says_so() -> None:
    budget = budget_from("acme", {"limits": [{"tokens": 10, "per": "minute"},
                                             {"tokens": 10, "per": "day", "each": "api_key"}]})
    ledger = Ledger()
    found, truncated = await usage(budget, [f"k{i}" for i in range(50)], [], ledger, NOW,
                                   max_rows=20)
    assert truncated and len(found) == 20 and ledger.asked == [20]
    assert [u.subject for u in found[:3]] == ["acme", "k0", "k1"]
    found, truncated = await usage(budget, ["k0"], [], ledger, NOW, max_rows=2)
    assert not truncated and len(found) == 2
