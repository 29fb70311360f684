"""The StateStore contract, migrations and outages on a real PostgreSQL server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import psycopg
import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.postgres import postgres_server
from sitsmesh.errors import StartupError, UnavailableError
from sitsmesh.state import StateStore, pgschema
from sitsmesh.state.open import open_store
from sitsmesh.state.postgres import PostgresStore
from sitsmesh.state.watch import RevisionFollower
from tests.pgcluster import pg_cluster, pg_url  # noqa: F401 - fixtures
from tests.state_contract import OpenStore, StateContract


class TestPostgresContract(StateContract):
    @pytest.fixture
    async def open_store(self, pg_url: str) -> AsyncIterator[OpenStore]:  # noqa: F811
        opened: list[PostgresStore] = []

        async def open_one() -> PostgresStore:
            opened.append(await PostgresStore.open(pg_url))
            return opened[-1]

        yield open_one
        for store in opened:
            await store.close()


def _versions(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute(
            "SELECT version FROM sitsmesh_schema_version ORDER BY version")]


async def test_a_fresh_database_is_migrated_once_by_concurrent_openers(
        pg_url: str) -> None:  # noqa: F811
    stores = await asyncio.gather(*(PostgresStore.open(pg_url) for _ in range(4)))
    assert _versions(pg_url) == [pgschema.LATEST]
    await stores[0].create("tenant", "acme", {})
    for store in stores:
        assert await store.revision() == 1
        await store.close()
    again = await open_store(pg_url, harness.REPO)  # the state_url factory, re-opening
    assert isinstance(again, PostgresStore)
    assert await again.revision() == 1 and _versions(pg_url) == [pgschema.LATEST]
    await again.close()


async def test_later_migrations_apply_in_order_on_an_older_schema(
        pg_url: str) -> None:  # noqa: F811
    await (await PostgresStore.open(pg_url)).close()  # at version 1, as an old sitsmesh left it
    step2 = (*pgschema.MIGRATIONS,
             (pgschema.LATEST + 1, "ALTER TABLE sitsmesh_objects ADD COLUMN note text"))
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        assert await pgschema.migrate(conn, "db", step2) == pgschema.LATEST + 1
        assert await pgschema.migrate(conn, "db", step2) == pgschema.LATEST + 1  # idempotent
    assert _versions(pg_url) == [pgschema.LATEST, pgschema.LATEST + 1]


async def test_a_newer_schema_is_refused_and_left_alone(pg_url: str) -> None:  # noqa: F811
    store = await PostgresStore.open(pg_url)
    await store.create("tenant", "acme", {})
    await store.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("INSERT INTO sitsmesh_schema_version (version) VALUES (99)")
    with pytest.raises(StartupError, match=r"state schema version 99 is newer than this "
                                           r"sitsmesh supports \(1\); upgrade sitsmesh"):
        await PostgresStore.open(pg_url)
    assert _versions(pg_url) == [1, 99]


async def test_an_unreachable_server_is_a_startup_error_without_the_password() -> None:
    url = f"postgresql://app:hunter2@127.0.0.1:{harness.free_port()}/db"
    with pytest.raises(StartupError, match="cannot connect to the state database") as err:
        await open_store(url, harness.REPO)
    assert "hunter2" not in err.value.message and "app:***@" in err.value.message


class Names(RevisionFollower):
    """The smallest view: the tenant names, rebuilt whole on every change."""

    def __init__(self, state: StateStore) -> None:
        super().__init__(state)
        self.names: list[str] = []

    async def _rebuild(self) -> None:
        self.names = [r.name for r in await self._state.list("tenant")]


async def _eventually(predicate: object, within_s: float) -> float:
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - start < within_s, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def test_a_restart_keeps_reads_fails_writes_cleanly_and_loses_nothing() -> None:
    with postgres_server(fsync=False) as pg:
        url = pg.create_database("restart")
        writer, reader = await PostgresStore.open(url), await PostgresStore.open(url)
        view = Names(reader)
        await view.refresh()
        watch = asyncio.create_task(view.watch(0.5))
        acked: list[str] = []

        async def write_forever() -> None:
            i = 0
            while True:
                try:
                    await writer.create("tenant", f"t{i:05d}", {})
                except UnavailableError:
                    await asyncio.sleep(0.02)
                    continue
                acked.append(f"t{i:05d}")  # acknowledged: the commit returned
                i += 1
                await asyncio.sleep(0.005)

        writing = asyncio.create_task(write_forever())
        try:
            await _eventually(lambda: len(acked) >= 20 and view.names[-1:] == acked[-1:], 5)
            await asyncio.to_thread(pg.kill)  # a crash, mid-write
            await asyncio.sleep(0.3)
            before = list(view.names)
            assert len(before) >= 20
            with pytest.raises(UnavailableError, match="state database unavailable"):
                await writer.put("tenant", "during", {})
            await asyncio.sleep(0.6)  # the view's watch fails meanwhile ...
            assert view.names == before  # ... and it keeps serving its last snapshot
            await asyncio.to_thread(pg.start)
            during = len(acked)
            # Writes resume, and the view follows them (listener reconnected, resynced).
            await _eventually(lambda: len(acked) > during + 20, 10)
            await _eventually(lambda: view.names[-1:] == acked[-1:], 2)
        finally:
            writing.cancel()
            watch.cancel()
            await asyncio.gather(writing, watch, return_exceptions=True)
        stored = {r.name for r in await reader.list("tenant")}
        assert [name for name in acked if name not in stored] == []
        await writer.close()
        await reader.close()


async def test_a_frozen_server_fails_calls_after_the_timeout_then_recovers() -> None:
    with postgres_server(fsync=False) as pg:
        store = await PostgresStore.open(pg.create_database("frozen"))
        await store.create("tenant", "before", {})
        store.op_timeout_s = 0.3
        pg.pause()  # sockets stay open; nothing answers, TCP never gives up
        try:
            start = time.monotonic()
            with pytest.raises(UnavailableError, match=r"\(write not acknowledged\): no "
                                                       r"answer within 0.3 s"):
                await store.put("tenant", "frozen", {})
            # psycopg's own cancel attempt adds at most 10 s; the call is bounded.
            assert time.monotonic() - start < 12
        finally:
            pg.resume()
        await store.create("tenant", "after", {})
        assert [r.name for r in await store.list("tenant")] == ["after", "before"]
        await store.close()
