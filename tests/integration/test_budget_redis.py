"""RedisLedger against a real redis-server: the ledger contract (tests/ledger_contract.py,
which MemoryLedger passes too) on a plain server and on a Redis Cluster node, two
replicas spending from one budget, the lost script cache, and an outage and restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis
from redis.asyncio import Redis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from sitsmesh.budgets.ledger import AlreadyReserved
from sitsmesh.budgets.model import budget_from
from sitsmesh.budgets.redis_ledger import RECORD_GRACE_S, WINDOW_SLACK_S, RedisLedger
from sitsmesh.dev import harness
from sitsmesh.dev import redis as redisproc
from sitsmesh.dev.rediscluster import RedisClusterNodes
from tests.ledger_contract import HOLD, T0, TWO, LedgerContract
from tests.redisfixtures import (  # noqa: F401 - fixtures
    cluster_fixture,
    redis_admin_fixture,
    redis_cluster_fixture,
    redis_server_fixture,
)

pytestmark = pytest.mark.integration

OpenLedger = Callable[[], Awaitable[RedisLedger]]


@pytest.fixture
async def open_ledger(redis_server: redisproc.RedisServer) -> AsyncIterator[OpenLedger]:
    """Another replica's ledger: its own client on the same server."""
    opened: list[RedisLedger] = []

    async def open_one() -> RedisLedger:
        # Generous timeout: these tests are about answers, not about a slow CI box.
        ledger = RedisLedger.from_url(redis_server.url, timeout_s=2.0)
        opened.append(ledger)
        return ledger

    yield open_one
    for ledger in opened:
        await ledger.close()


class TestRedisLedger(LedgerContract):
    @pytest.fixture
    async def ledger(self, open_ledger: OpenLedger) -> RedisLedger:
        return await open_ledger()


@pytest.fixture(scope="module")
def cluster_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A one-node Redis Cluster holding every slot: one process, yet Redis refuses any
    script or command whose keys span slots (CROSSSLOT), as a real cluster does. Shared
    by the module: a new node takes seconds to call its cluster ok."""
    port = harness.free_port()
    workdir = tmp_path_factory.mktemp("cluster")
    proc = harness.spawn(
        [redisproc.redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no",
         "--logfile", "", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"],
        workdir / "redis.log")
    try:
        harness.wait_until(lambda: redisproc.ping(port), 10, "redis cluster node")
        with redis.Redis(host="127.0.0.1", port=port, decode_responses=True) as setup:
            setup.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            harness.wait_until(lambda: "cluster_state:ok" in str(
                setup.execute_command("CLUSTER", "INFO")), 10, "cluster state ok")
        yield port
    finally:
        proc.kill()


@pytest.fixture
def cluster_url(cluster_node: int) -> str:
    with redis.Redis(host="127.0.0.1", port=cluster_node) as setup:
        setup.flushall()
    return f"redis+cluster://127.0.0.1:{cluster_node}"


def test_the_cluster_node_refuses_keys_across_slots(cluster_node: int) -> None:
    # What makes the cluster runs below mean something.
    with redis.Redis(host="127.0.0.1", port=cluster_node) as client, pytest.raises(
            redis.ResponseError, match="same slot"):
        client.mget("{a}x", "{b}y")


class TestRedisClusterLedger(LedgerContract):
    @pytest.fixture
    async def ledger(self, cluster_url: str) -> AsyncIterator[RedisLedger]:
        ledger = RedisLedger.from_url(cluster_url, timeout_s=2.0)
        yield ledger
        await ledger.close()


class TestThreeMasterClusterLedger(LedgerContract):
    """The same contract on a real 3-master cluster with replicas (redis+cluster://)."""

    @pytest.fixture
    async def ledger(self, cluster: RedisClusterNodes) -> AsyncIterator[RedisLedger]:
        ledger = RedisLedger.from_url(cluster.url, timeout_s=2.0)
        yield ledger
        await ledger.close()


async def test_cluster_replicas_settle_each_others_reservations(cluster_url: str) -> None:
    a = RedisLedger.from_url(cluster_url, timeout_s=2.0)
    b = RedisLedger.from_url(cluster_url, timeout_s=2.0)
    try:
        for i in range(10):
            assert (await (a if i % 2 else b).reserve(f"r{i}", TWO, 10, T0, 30.0)).ok
        assert not (await a.reserve("r10", TWO, 10, T0, 30.0)).ok
        for i in range(0, 10, 3):
            assert await (b if i % 2 else a).settle(f"r{i}", 1, T0 + 1) == 10
        assert await a.usage(TWO, T0 + 1) == [64, 64]
        # Records in many slots, claimed in one pipeline the cluster client splits.
        assert await a.expire(T0 + 31) + await b.expire(T0 + 31) == 6
    finally:
        await a.close()
        await b.close()


async def test_two_replicas_never_spend_past_the_limit(open_ledger: OpenLedger) -> None:
    a, b = await open_ledger(), await open_ledger()
    counters = budget_from("race", {"limits": [{"tokens": 1000, "per": "day"}]}).counters(
        "k", "m")
    answers = await asyncio.gather(*(
        (a if i % 2 else b).reserve(f"r{i}", counters, 10, T0 + 1, HOLD)
        for i in range(200)))
    assert sum(spent.ok for spent in answers) == 100
    assert await a.usage(counters, T0 + 2) == [1000]
    refused = [spent for spent in answers if not spent.ok]
    assert {(s.index, s.remaining) for s in refused} == {(0, 0)}


async def test_any_replica_settles_and_only_the_reserver_counts_lost_ends(
        open_ledger: OpenLedger) -> None:
    a, b = await open_ledger(), await open_ledger()
    assert (await a.reserve("x", TWO, 40, T0, 30.0)).ok
    assert (await a.reserve("lost-a", TWO, 5, T0, 30.0)).ok
    assert (await b.reserve("lost-b", TWO, 5, T0, 30.0)).ok
    assert await b.settle("x", 10, T0 + 5) == 40
    assert await a.settle("x", 10, T0 + 6) is None
    assert await a.usage(TWO, T0 + 6) == [20, 20]
    # Each process counts the lost ends it reserved; the settled one is not lost.
    assert await a.expire(T0 + 31) == 1
    assert await b.expire(T0 + 31) == 1
    assert await b.usage(TWO, T0 + 31) == [20, 20]


async def test_a_request_id_is_held_once_across_replicas(open_ledger: OpenLedger) -> None:
    a, b = await open_ledger(), await open_ledger()
    assert (await a.reserve("dup", TWO, 10, T0, HOLD)).ok
    with pytest.raises(AlreadyReserved, match="already holds"):
        await b.reserve("dup", TWO, 10, T0, HOLD)
    assert await a.usage(TWO, T0) == [10, 10]  # the second charge was undone
    assert await b.settle("dup", 10, T0 + 1) == 10


async def test_keys_share_the_tenant_slot_and_expire_from_the_callers_clock(
        open_ledger: OpenLedger, admin: Redis) -> None:
    ledger = await open_ledger()
    now = T0 + 15
    assert (await ledger.reserve("req-1", TWO, 10, now, 30.0)).ok
    minute, hour = (f"sitsmesh:tb:{c.key}:{int(T0)}" for c in TWO)
    record = "sitsmesh:tb:res:{req-1}"
    assert sorted([key async for key in admin.scan_iter("*")]) == sorted(
        [minute, hour, record])
    assert key_slot(minute.encode()) == key_slot(hour.encode()) == key_slot(b"acme")
    # Relative to the caller's `now`, not the server's clock: the minute ends 45 s on.
    assert 44_000 + WINDOW_SLACK_S * 1000 < await admin.pttl(minute) <= (
        45_000 + WINDOW_SLACK_S * 1000)
    assert 3_584_000 + WINDOW_SLACK_S * 1000 < await admin.pttl(hour) <= (
        3_585_000 + WINDOW_SLACK_S * 1000)
    grace_ms = int(RECORD_GRACE_S * 1000)
    assert 29_000 + grace_ms < await admin.pttl(record) <= 30_000 + grace_ms
    # A settle's correction keeps the window's expiry.
    assert await ledger.settle("req-1", 3, now + 1) == 10
    assert await admin.get(minute) == "3"
    assert await admin.pttl(minute) > 40_000 + WINDOW_SLACK_S * 1000
    assert not await admin.exists(record)


async def test_refusals_write_nothing(open_ledger: OpenLedger, admin: Redis) -> None:
    ledger = await open_ledger()
    assert not (await ledger.reserve("big", TWO, 101, T0, HOLD)).ok
    assert await ledger.usage(TWO, T0) == [0, 0]
    assert await admin.dbsize() == 0


async def test_lost_script_cache_is_reloaded(open_ledger: OpenLedger, admin: Redis) -> None:
    ledger = await open_ledger()
    await admin.script_flush()
    assert (await ledger.reserve("a", TWO, 30, T0, HOLD)).ok
    await admin.script_flush()
    assert await ledger.settle("a", 50, T0 + 1) == 30  # the adjust script, reloaded
    await admin.script_flush()
    assert not (await ledger.reserve("b", TWO, 51, T0 + 2, HOLD)).ok
    assert await ledger.usage(TWO, T0 + 2) == [50, 50]


async def test_outage_raises_and_restart_recovers(
        open_ledger: OpenLedger, redis_server: redisproc.RedisServer) -> None:
    ledger = await open_ledger()
    assert (await ledger.reserve("before", TWO, 10, T0, 30.0)).ok
    redis_server.kill()
    # The caller decides to fail open or closed: the ledger only says it cannot answer.
    with pytest.raises(RedisConnectionError):
        await ledger.reserve("during", TWO, 10, T0 + 1, 30.0)
    with pytest.raises(RedisConnectionError):
        await ledger.settle("before", 5, T0 + 1)
    with pytest.raises(RedisConnectionError):
        await ledger.usage(TWO, T0 + 1)
    with pytest.raises(RedisConnectionError):
        await ledger.expire(T0 + 31)
    redis_server.start()
    # A fresh server (no persistence): counters and records are gone, spending resumes.
    spent = await ledger.reserve("after", TWO, 10, T0 + 2, 30.0)
    assert (spent.ok, spent.remaining) == (True, 90)
    assert await ledger.settle("after", 4, T0 + 3) == 10
    assert await ledger.usage(TWO, T0 + 3) == [4, 4]
    assert await ledger.settle("before", 5, T0 + 3) is None  # its record died with Redis
    assert await ledger.expire(T0 + 31) == 0


async def test_on_one_server_reserve_and_settle_are_one_round_trip_each(
        open_ledger: OpenLedger, admin: Redis) -> None:
    """One script each (the record with the counters): what the Check waits for is one
    round trip; counted from the server's own command statistics."""
    ledger = await open_ledger()
    counters = TWO
    await admin.config_resetstat()
    for i in range(10):
        assert (await ledger.reserve(f"r{i}", counters, 10, T0, HOLD)).ok
        assert await ledger.settle(f"r{i}", 4, T0 + 1) == 10
    stats = await admin.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()}
    # 20 scripts (the first use of each also loads it: NOSCRIPT, then EVAL once); the
    # SET, GET, INCRBY inside them are not round trips of their own.
    assert calls.get("evalsha", 0) == 20 and calls.get("eval", 0) <= 2
    assert "getdel" not in calls and calls.get("set", 0) <= 10  # SETs inside the script
    assert await ledger.usage(counters, T0 + 1) == [40, 40]
