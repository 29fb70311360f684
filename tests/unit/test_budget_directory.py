"""The tenant directory keeps `budgets` (tenant -> TokenBudget) current from the state
store (a real SQLite store): a stored budget appears, a changed one is replaced, a
deleted one disappears, an invalid one is skipped; another process's directory follows
the store's revision and calls its on_budgets listeners."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

from sitsmesh.authz.directory import TenantDirectory
from sitsmesh.budgets.model import BUDGET_KIND, TokenBudget, budget_from
from sitsmesh.state import SqliteStore

BUDGET = {"limits": [{"tokens": 1000, "per": "minute"}]}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "state.db")
    yield opened
    await opened.close()


async def test_a_stored_budget_appears_and_a_deleted_one_disappears(
        store: SqliteStore) -> None:
    directory = TenantDirectory(store)
    seen: list[Mapping[str, TokenBudget]] = []
    directory.on_budgets(seen.append)
    await directory.refresh()
    assert dict(directory.budgets) == {}

    await store.put(BUDGET_KIND, "acme", budget_from("acme", BUDGET).to_body())
    await directory.refresh()
    assert dict(directory.budgets) == {"acme": budget_from("acme", BUDGET)}
    assert seen[-1] is directory.budgets

    doubled = {"limits": [{"tokens": 2000, "per": "hour", "each": "api_key"}]}
    await store.put(BUDGET_KIND, "acme", doubled)
    await directory.refresh()
    assert directory.budgets["acme"] == budget_from("acme", doubled)

    await store.delete(BUDGET_KIND, "acme")
    await directory.refresh()
    assert "acme" not in directory.budgets and dict(seen[-1]) == {}


async def test_an_invalid_stored_budget_is_skipped_and_the_rest_load(
        store: SqliteStore) -> None:
    await store.put(BUDGET_KIND, "acme", BUDGET)
    await store.put(BUDGET_KIND, "broken", {"limits": [{"tokens": 1, "per": "week"}]})
    directory = TenantDirectory(store)
    await directory.refresh()
    assert set(directory.budgets) == {"acme"}


async def test_another_process_s_directory_follows_the_store(store: SqliteStore) -> None:
    writer, follower = TenantDirectory(store), TenantDirectory(store)
    await follower.refresh()
    changed = asyncio.Event()
    follower.on_budgets(lambda budgets: changed.set() if "acme" in budgets else None)
    watching = asyncio.create_task(follower.watch(0.05))
    try:
        await store.put(BUDGET_KIND, "acme", BUDGET)
        await writer.refresh()
        await asyncio.wait_for(changed.wait(), 10)
        assert follower.budgets["acme"].limits[0].tokens == 1000
    finally:
        watching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watching
