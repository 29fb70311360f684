"""One throwaway PostgreSQL cluster per test session, a fresh database per test.

Test modules import the fixtures they use from here (tests/integration/conftest.py
is shared with other areas).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from sitsmesh.dev.postgres import PostgresServer, postgres_server

_names = itertools.count()


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresServer]:
    # fsync off: tests that kill the server kill processes, not the machine, so the
    # page cache keeps every commit; the benchmark runs with fsync on.
    with postgres_server(fsync=False) as server:
        yield server


@pytest.fixture
def pg_url(pg_cluster: PostgresServer) -> str:
    """A new, empty database on the session's cluster (started again if a test stopped it)."""
    if not pg_cluster.running:
        pg_cluster.start()
    return pg_cluster.create_database(f"test_{next(_names)}")
