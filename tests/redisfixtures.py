"""A redis-server per test (fixture `redis_server`) and an admin client on it (`admin`),
for the tests of Redis-backed stores (rate-limit counters, token-budget ledgers), and a
Redis Cluster (`redis_cluster`, `cluster`, and `shared_redis` for both): import the
functions; the fixtures keep the short names."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sitsmesh.dev import redis as redisproc
from sitsmesh.dev import rediscluster


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path: Path) -> Iterator[redisproc.RedisServer]:
    with redisproc.redis_server(tmp_path / "redis") as server:
        yield server


@pytest.fixture(name="admin")
async def redis_admin_fixture(redis_server: redisproc.RedisServer) -> AsyncIterator[Redis]:
    # Built from host/port, not a URL, so it keeps redis-py's default retries
    # and reconnects by itself after a restart.
    client = Redis(host="127.0.0.1", port=redis_server.port, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture(name="redis_cluster", scope="session")
def redis_cluster_fixture(tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[rediscluster.RedisClusterNodes]:
    """A real 3-master Redis Cluster with a replica per master, shared by the session's
    tests (it takes seconds to form); `cluster` empties it for each test. Tests that
    kill nodes make their own (`rediscluster.redis_cluster`)."""
    with rediscluster.redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as nodes:
        yield nodes


@pytest.fixture(name="cluster")
def cluster_fixture(redis_cluster: rediscluster.RedisClusterNodes
                    ) -> rediscluster.RedisClusterNodes:
    redis_cluster.flush()
    return redis_cluster


@pytest.fixture(name="shared_redis", params=["server", "cluster"])
def shared_redis_fixture(request: pytest.FixtureRequest, tmp_path: Path
                         ) -> Iterator[redisproc.RedisServer | rediscluster.RedisClusterNodes]:
    """The same test on one redis-server and on a Redis Cluster: anything with `.url`."""
    if request.param == "cluster":
        yield request.getfixturevalue("cluster")
        return
    with redisproc.redis_server(tmp_path / "redis") as server:
        yield server
