"""PostgreSQL schema for the state store: versioned migrations, applied at start.

Each migration runs once, in order, in the same transaction as the row that
records it; an advisory lock makes concurrent starters (workers, replicas) take
turns, so exactly one applies each step. A database that a newer sitsmesh has
migrated further is refused: this code would not know what the new steps mean.
"""

from __future__ import annotations

from typing import Any

from sitsmesh.errors import StartupError

CHANNEL = "sitsmesh_state"
# Any constant works; it only has to be the same for every sitsmesh process.
_MIGRATION_LOCK = 0x5175_6D65_7368
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, """
CREATE TABLE sitsmesh_objects (
    kind text NOT NULL,
    name text NOT NULL,
    body jsonb NOT NULL,
    revision bigint NOT NULL,
    updated_at double precision NOT NULL,
    PRIMARY KEY (kind, name)
);
-- One row: the store-wide revision. Updating it is also the store-wide write lock,
-- so revisions follow commit order exactly as SQLite's single writer gives them.
CREATE TABLE sitsmesh_revision (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    value bigint NOT NULL
);
INSERT INTO sitsmesh_revision (value) VALUES (0);
"""),
)
LATEST = MIGRATIONS[-1][0]


async def current_version(conn: Any) -> int:
    cur = await conn.execute("SELECT to_regclass('sitsmesh_schema_version') IS NOT NULL")
    row = await cur.fetchone()
    if not row[0]:
        return 0
    cur = await conn.execute("SELECT coalesce(max(version), 0) FROM sitsmesh_schema_version")
    row = await cur.fetchone()
    return int(row[0])


async def migrate(conn: Any, where: str, migrations: tuple[tuple[int, str], ...] = MIGRATIONS
                  ) -> int:
    """Bring the schema to the last of `migrations`; returns the version it is at."""
    latest = migrations[-1][0]
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        await conn.execute("CREATE TABLE IF NOT EXISTS sitsmesh_schema_version ("
                           "version integer PRIMARY KEY, "
                           "applied_at timestamptz NOT NULL DEFAULT now())")
        version = await current_version(conn)
        if version > latest:
            raise StartupError(f"{where}: state schema version {version} is newer than this "
                               f"sitsmesh supports ({latest}); upgrade sitsmesh")
        for step, sql in migrations:
            if step > version:
                await conn.execute(sql)
                await conn.execute("INSERT INTO sitsmesh_schema_version (version) VALUES (%s)",
                                   (step,))
    return latest
