"""The StateStore contract, as tests every backend must pass.

A backend's test module subclasses StateContract and provides one fixture,
`open_store`: a factory that opens another store on the same database (each test
gets a fresh, empty database). The suite lives outside test_*.py so pytest
collects it only through those subclasses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from sitsmesh.errors import ConflictError, NotFoundError
from sitsmesh.state import Delete, Put, StateStore
from sitsmesh.state.contract import ABSENT

OpenStore = Callable[[], Awaitable[StateStore]]


class StateContract:
    @pytest.fixture
    async def store(self, open_store: OpenStore) -> StateStore:
        return await open_store()

    async def test_create_get_list_put_delete_bump_the_revision(self, store: StateStore) -> None:
        assert await store.revision() == 0
        a = await store.create("tenant", "acme", {"priority": 1})
        assert (a.revision, a.body) == (1, {"priority": 1})
        await store.create("tenant", "beta", {})
        await store.create("pipeline", "demo", {"stages": []})
        assert [r.name for r in await store.list("tenant")] == ["acme", "beta"]
        updated = await store.put("tenant", "acme", {"priority": 2})
        assert updated.revision == 4
        got = await store.get("tenant", "acme")
        assert got is not None and got.body == {"priority": 2} and got.revision == 4
        assert await store.delete("tenant", "acme") is True
        assert await store.delete("tenant", "acme") is False
        assert await store.get("tenant", "acme") is None
        assert await store.revision() == 5

    async def test_list_orders_by_name_bytewise(self, store: StateStore) -> None:
        for name in ("b", "B", "a-1", "a_1", "A"):
            await store.create("tenant", name, {})
        assert [r.name for r in await store.list("tenant")] == ["A", "B", "a-1", "a_1", "b"]

    async def test_bodies_round_trip(self, store: StateStore) -> None:
        body = {"n": 1, "f": 2.5, "s": "é", "l": [1, {"x": None}], "b": True, "nested": {}}
        made = await store.create("tenant", "acme", body)
        got = await store.get("tenant", "acme")
        assert made.body == body and got is not None and got.body == body

    async def test_create_refuses_an_existing_record_and_changes_nothing(
            self, store: StateStore) -> None:
        await store.create("tenant", "acme", {"v": 1})
        with pytest.raises(ConflictError, match="tenant 'acme' already exists"):
            await store.create("tenant", "acme", {"v": 2})
        got = await store.get("tenant", "acme")
        assert got is not None and got.body == {"v": 1}
        assert await store.revision() == 1

    async def test_put_with_expected_revision_is_compare_and_swap(
            self, store: StateStore) -> None:
        first = await store.create("tenant", "acme", {"v": 1})
        await store.put("tenant", "acme", {"v": 2}, expect_revision=first.revision)
        with pytest.raises(ConflictError, match="is at revision 2, not at revision 1"):
            await store.put("tenant", "acme", {"v": 3}, expect_revision=first.revision)
        with pytest.raises(ConflictError, match="is absent"):
            await store.put("tenant", "ghost", {}, expect_revision=1)
        got = await store.get("tenant", "acme")
        assert got is not None and got.body == {"v": 2}
        assert await store.revision() == 2

    async def test_expect_absent_creates_only_what_does_not_exist(
            self, store: StateStore) -> None:
        await store.put("tenant", "new", {"v": 1}, expect_revision=ABSENT)
        with pytest.raises(ConflictError, match="tenant 'new' exists \\(at revision 1\\), "
                           "expected none"):
            await store.apply([Put("tenant", "other", {}, expect_revision=ABSENT),
                               Put("tenant", "new", {"v": 2}, expect_revision=ABSENT)])
        assert await store.get("tenant", "other") is None
        got = await store.get("tenant", "new")
        assert got is not None and got.body == {"v": 1}
        assert await store.revision() == 1

    async def test_apply_writes_all_or_nothing(self, store: StateStore) -> None:
        acme = await store.create("tenant", "acme", {"v": 1})
        key = await store.create("apikey", "k1", {"tenant": "acme"})
        revision = await store.apply([Delete("tenant", "acme"),
                                      Put("apikey", "k1", {"tenant": "acme", "revoked": True},
                                          expect_revision=key.revision)])
        assert revision == await store.revision() == 3  # one transaction, one revision
        assert await store.get("tenant", "acme") is None
        got = await store.get("apikey", "k1")
        assert got is not None and got.body["revoked"] and got.revision == 3
        # A failed write undoes the ones before it in the same batch.
        await store.create("tenant", "acme", {"v": 2})
        with pytest.raises(ConflictError, match="not at revision 1"):
            await store.apply([Delete("tenant", "acme"),
                               Put("apikey", "k1", {}, expect_revision=acme.revision)])
        with pytest.raises(NotFoundError, match="tenant 'ghost' does not exist"):
            await store.apply([Put("apikey", "k2", {}), Delete("tenant", "ghost")])
        assert await store.get("tenant", "acme") is not None
        assert await store.get("apikey", "k2") is None
        assert await store.revision() == 4

    async def test_concurrent_writers_get_distinct_consecutive_revisions(
            self, open_store: OpenStore) -> None:
        a, b = await open_store(), await open_store()
        records = await asyncio.gather(*(s.put("item", f"{i}", {"i": i})
                                         for i in range(20) for s in (a, b)))
        assert sorted(r.revision for r in records) == list(range(1, 41))
        assert await a.revision() == await b.revision() == 40

    async def test_survives_reopen(self, open_store: OpenStore) -> None:
        first = await open_store()
        await first.create("tenant", "acme", {"v": 1})
        await first.close()
        again = await open_store()
        got = await again.get("tenant", "acme")
        assert got is not None and got.body == {"v": 1}
        assert await again.revision() == 1

    async def test_wait_for_change_returns_at_once_when_behind(self, store: StateStore) -> None:
        await store.create("tenant", "acme", {})
        assert await asyncio.wait_for(store.wait_for_change(0, 30), 1) == 1

    async def test_wait_for_change_times_out_unchanged(self, store: StateStore) -> None:
        start = time.monotonic()
        assert await store.wait_for_change(await store.revision(), 0.3) == 0
        assert 0.25 <= time.monotonic() - start < 2

    async def test_a_write_through_another_store_wakes_the_waiter(
            self, open_store: OpenStore) -> None:
        writer, follower = await open_store(), await open_store()
        seen = await follower.revision()
        await follower.wait_for_change(seen, 0.05)  # starts a listener where there is one
        waiting = asyncio.create_task(follower.wait_for_change(seen, 30))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        start = time.monotonic()
        await writer.create("tenant", "acme", {})
        assert await asyncio.wait_for(waiting, 1) == 1
        assert time.monotonic() - start < 1
