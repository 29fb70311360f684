"""PostgreSQL-backed StateStore: every replica and worker shares one database.

Writes take the one-row revision counter first: it numbers them in commit order
and serialises writers, as SQLite's single writer does. Each write sends a
NOTIFY with its revision inside its transaction, so listeners hear of it exactly
when it commits. One connection (behind a lock) serves reads and writes; admin
traffic is light, and one connection keeps the order of this process's calls.
A second connection only LISTENs; when it drops it reconnects, then reads the
revision (a NOTIFY sent while it was away is lost, the revision is not).

When the server cannot be reached, calls raise UnavailableError; views keep the
snapshot they hold (see watch.RevisionFollower) and catch up once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import psycopg

from sitsmesh import logs
from sitsmesh.errors import ConflictError, NotFoundError, StartupError, UnavailableError
from sitsmesh.settingvalues import redact_url
from sitsmesh.state import pgschema
from sitsmesh.state.changes import ChangeSignal
from sitsmesh.state.contract import Delete, Put, Record, check_expected

CONNECT_TIMEOUT_S = 3
# Admin calls take milliseconds; this only bounds a server that stopped answering.
OP_TIMEOUT_S = 5.0
# Without the listener (it is reconnecting), changes are found by reading the revision.
POLL_S = 0.2
RECONNECT_MAX_S = 1.0
_CONNECT_ARGS: dict[str, Any] = {
    "autocommit": True,
    "connect_timeout": CONNECT_TIMEOUT_S,
    "application_name": "sitsmesh",
    # A server that vanished without closing the socket is noticed within ~10 s.
    "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
}
_COLUMNS = "kind, name, body, revision, updated_at"
_UPSERT = ("INSERT INTO sitsmesh_objects (kind, name, body, revision, updated_at) "
           "VALUES (%s, %s, %s::jsonb, %s, %s) ON CONFLICT (kind, name) DO UPDATE SET "
           "body = EXCLUDED.body, revision = EXCLUDED.revision, "
           "updated_at = EXCLUDED.updated_at")
_log = logs.get("sitsmesh.state.postgres")
T = TypeVar("T")
Conn = psycopg.AsyncConnection[Any]


def _blob(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _reason(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


async def _bump(conn: Conn) -> int:
    """The next revision; holds the store-wide write lock until the transaction ends."""
    cur = await conn.execute("UPDATE sitsmesh_revision SET value = value + 1 RETURNING value")
    row = await cur.fetchone()
    assert row is not None  # migration 1 inserts the row
    revision = int(row[0])
    await conn.execute("SELECT pg_notify(%s, %s)", (pgschema.CHANNEL, str(revision)))
    return revision


async def _stored_revision(conn: Conn, kind: str, name: str) -> int | None:
    cur = await conn.execute(
        "SELECT revision FROM sitsmesh_objects WHERE kind = %s AND name = %s", (kind, name))
    row = await cur.fetchone()
    return None if row is None else int(row[0])


async def _read_revision(conn: Conn) -> int:
    cur = await conn.execute("SELECT value FROM sitsmesh_revision")
    row = await cur.fetchone()
    assert row is not None  # migration 1 inserts the row
    return int(row[0])


class PostgresStore:
    def __init__(self, url: str, conn: Conn) -> None:
        self._url = url
        self.where = redact_url(url)
        self._conn: Conn | None = conn
        self._lock = asyncio.Lock()
        self._changes = ChangeSignal()
        self._seen = -1         # the newest revision the listener heard of
        self._listening = False
        self._listener: asyncio.Task[None] | None = None
        self._closed = False
        self.op_timeout_s = OP_TIMEOUT_S

    @classmethod
    async def open(cls, url: str) -> PostgresStore:
        """Connect and migrate; StartupError when the server cannot be used."""
        where = redact_url(url)
        try:
            conn = await psycopg.AsyncConnection.connect(url, **_CONNECT_ARGS)
        except psycopg.Error as exc:
            raise StartupError(f"{where}: cannot connect to the state database: "
                               f"{_reason(exc)}") from None
        try:
            await pgschema.migrate(conn, where)
        except psycopg.Error as exc:
            await conn.close()
            raise StartupError(f"{where}: cannot migrate the state database: "
                               f"{_reason(exc)}") from None
        except BaseException:
            await conn.close()
            raise
        return cls(url, conn)

    async def _connection(self) -> Conn:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self._conn = None
            if conn is not None:
                await conn.close()
            self._conn = conn = await psycopg.AsyncConnection.connect(self._url, **_CONNECT_ARGS)
        return conn

    async def _run(self, op: Callable[[Conn], Awaitable[T]], *, write: bool) -> T:
        if self._closed:
            raise UnavailableError(f"{self.where}: the state store is closed")
        what = "write not acknowledged" if write else "read failed"
        async with self._lock:
            try:
                # A frozen server keeps its sockets open and TCP never gives up on it.
                # (On the timeout psycopg tries a server-side cancel for up to 10 s more,
                # then drops the connection; the next call reconnects.)
                async with asyncio.timeout(self.op_timeout_s):
                    return await op(await self._connection())
            except TimeoutError:
                raise UnavailableError(f"state database unavailable ({what}): no answer "
                                       f"within {self.op_timeout_s:g} s") from None
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                # Either way the call was not acknowledged; a commit whose reply was lost
                # is applied or not as a whole, never half (the caller may re-read).
                raise UnavailableError(f"state database unavailable ({what}): "
                                       f"{_reason(exc)}") from None

    # --- reads ----------------------------------------------------------------

    async def get(self, kind: str, name: str) -> Record | None:
        async def op(conn: Conn) -> Record | None:
            cur = await conn.execute(f"SELECT {_COLUMNS} FROM sitsmesh_objects "  # noqa: S608
                                     "WHERE kind = %s AND name = %s", (kind, name))
            row = await cur.fetchone()
            return None if row is None else Record(*row)
        return await self._run(op, write=False)

    async def list(self, kind: str) -> list[Record]:
        async def op(conn: Conn) -> list[Record]:
            cur = await conn.execute(f"SELECT {_COLUMNS} FROM sitsmesh_objects "  # noqa: S608
                                     "WHERE kind = %s ORDER BY name COLLATE \"C\"", (kind,))
            return [Record(*row) for row in await cur.fetchall()]
        return await self._run(op, write=False)

    async def revision(self) -> int:
        return await self._run(_read_revision, write=False)

    # --- writes ---------------------------------------------------------------

    async def _put(self, kind: str, name: str, body: dict[str, Any], *, create: bool,
                   expect_revision: int | None) -> Record:
        blob = _blob(body)

        async def op(conn: Conn) -> Record:
            async with conn.transaction():
                revision = await _bump(conn)
                stored = await _stored_revision(conn, kind, name)
                if create and stored is not None:
                    raise ConflictError(f"{kind} '{name}' already exists")
                check_expected(kind, name, stored, expect_revision)
                now = time.time()
                await conn.execute(_UPSERT, (kind, name, blob, revision, now))
            return Record(kind, name, json.loads(blob), revision, now)
        return await self._run(op, write=True)

    async def create(self, kind: str, name: str, body: dict[str, Any]) -> Record:
        return await self._put(kind, name, body, create=True, expect_revision=None)

    async def put(
        self, kind: str, name: str, body: dict[str, Any], *, expect_revision: int | None = None
    ) -> Record:
        return await self._put(kind, name, body, create=False, expect_revision=expect_revision)

    async def delete(self, kind: str, name: str) -> bool:
        async def op(conn: Conn) -> bool:
            # The revision lock comes first in every write, so writers never deadlock.
            async with conn.transaction():
                await _bump(conn)
                cur = await conn.execute(
                    "DELETE FROM sitsmesh_objects WHERE kind = %s AND name = %s", (kind, name))
                if not cur.rowcount:
                    raise psycopg.Rollback  # nothing changed: no revision, no NOTIFY
            return bool(cur.rowcount)
        return await self._run(op, write=True)

    async def apply(self, writes: Sequence[Put | Delete]) -> int:
        batch = [(w, _blob(w.body) if isinstance(w, Put) else "") for w in writes]

        async def op(conn: Conn) -> int:
            async with conn.transaction():
                revision = await _bump(conn)
                now = time.time()
                for write, blob in batch:
                    stored = await _stored_revision(conn, write.kind, write.name)
                    if isinstance(write, Delete):
                        if stored is None:
                            raise NotFoundError(f"{write.kind} '{write.name}' does not exist")
                        await conn.execute("DELETE FROM sitsmesh_objects WHERE kind = %s "
                                           "AND name = %s", (write.kind, write.name))
                        continue
                    check_expected(write.kind, write.name, stored, write.expect_revision)
                    await conn.execute(_UPSERT, (write.kind, write.name, blob, revision, now))
            return revision
        return await self._run(op, write=True)

    # --- change propagation ---------------------------------------------------

    async def wait_for_change(self, after: int, within_s: float) -> int:
        if self._listener is None and not self._closed:
            self._listener = asyncio.get_running_loop().create_task(self._listen())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                # Also a safety net: a lost NOTIFY costs at most one interval.
                return await self.revision()
            if self._listening:
                if self._seen > after:
                    return self._seen
                await self._changes.wait(remaining)
                continue
            revision = await self.revision()
            if revision != after:
                return revision
            await self._changes.wait(min(remaining, POLL_S))

    def _heard(self, revision: int) -> None:
        if revision > self._seen:
            self._seen = revision
            self._changes.notify()

    async def _listen(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                conn = await psycopg.AsyncConnection.connect(self._url, **_CONNECT_ARGS)
                async with conn:
                    await conn.execute(f"LISTEN {pgschema.CHANNEL}")
                    # Resync: whatever was sent while no one listened shows in the revision.
                    self._seen = -1
                    self._heard(await _read_revision(conn))
                    self._listening = True
                    delay = 0.05
                    _log.info("state change listener connected", store=self.where,
                              revision=self._seen)
                    async for notice in conn.notifies():
                        with contextlib.suppress(ValueError):
                            self._heard(int(notice.payload))
            except (psycopg.Error, OSError) as exc:
                if self._listening:
                    _log.warning("state change listener lost; polling until it reconnects",
                                 store=self.where, error=_reason(exc))
            finally:
                self._listening = False
            if not self._closed:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)

    async def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        async with self._lock:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
