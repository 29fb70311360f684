"""RedisStore against a real redis-server: same answers as MemoryStore, one round trip,
cluster-ready keys, and ResilientStore's fallback and recovery when Redis dies or hangs.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from sitsmesh.dev import harness
from sitsmesh.dev import redis as redisproc
from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.memory import MemoryStore
from sitsmesh.ratelimit.redis_store import RedisStore
from sitsmesh.ratelimit.resilient import ResilientStore, StoreErrorPolicy
from sitsmesh.ratelimit.store import Count, Hit
from tests.redisfixtures import redis_admin_fixture, redis_server_fixture  # noqa: F401 - fixtures

# A window boundary for every window used below, so tables read in offsets.
T0 = 1_700_006_400.0
FIXED, SLIDING, GCRA = Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW, Algorithm.GCRA


@pytest.fixture
async def store(redis_server: redisproc.RedisServer) -> AsyncIterator[RedisStore]:
    # Generous timeout: these tests are about answers, not about a slow CI box.
    redis_store = RedisStore.from_url(redis_server.url, timeout_s=2.0)
    yield redis_store
    await redis_store.close()


def assert_same(got: Sequence[Count], want: Sequence[Count], context: object) -> None:
    assert len(got) == len(want), context
    for g, w in zip(got, want, strict=True):
        assert (g.over, g.remaining, g.used) == (w.over, w.remaining, w.used), (context, g, w)
        assert g.reset_s == pytest.approx(w.reset_s, abs=1e-6), (context, g, w)


# (algorithm, limit, window_s, [(offset from T0, addend), ...]) -- one key per table.
TABLES: list[tuple[Algorithm, int, int, list[tuple[float, int]]]] = [
    (FIXED, 3, 10, [(0.0, 1), (0.5, 1), (1.25, 0), (2.0, 1), (3.0, 1), (3.5, 2), (9.5, 0),
                    (10.0, 1), (15.3, 5), (15.4, 0), (25.1, 0), (25.2, 1)]),
    (FIXED, 0, 60, [(1.0, 1), (2.0, 0), (61.0, 1)]),
    (FIXED, 100, 3600, [(0.1, 40), (0.2, 40), (0.3, 40), (0.4, 1), (3600.7, 99)]),
    (SLIDING, 4, 10, [(0.0, 1), (1.0, 2), (2.0, 1), (3.0, 1), (9.5, 0), (10.0, 1), (12.5, 1),
                      (13.0, 1), (17.5, 2), (18.0, 0), (25.0, 1), (40.0, 1), (40.0, 3),
                      (40.0, 1)]),
    (SLIDING, 10, 60, [(0.7, 9), (59.3, 1), (60.1, 1), (66.6, 1), (75.0, 3), (90.3, 4),
                       (119.9, 2), (120.0, 10)]),
    (SLIDING, 1, 10, [(0.0, 0), (0.0, 2), (0.0, 1), (5.0, 1), (10.0, 1), (19.99, 1)]),
    (GCRA, 5, 10, [(0.0, 1), (0.1, 1), (0.2, 3), (0.3, 1), (1.0, 0), (5.5, 2), (30.0, 1),
                   (30.0, 5), (30.0, 1), (31.7, 0), (45.0, 6)]),
    (GCRA, 3, 60, [(0.3, 1), (0.3, 1), (0.3, 1), (0.3, 1), (20.3, 0), (20.4, 1), (100.0, 2)]),
    (GCRA, 0, 10, [(0.0, 1), (1.0, 0)]),
]


@pytest.mark.parametrize(("algorithm", "limit", "window_s", "steps"), TABLES)
async def test_tables_match_memory_store(store: RedisStore, algorithm: Algorithm, limit: int,
                                         window_s: int, steps: list[tuple[float, int]]) -> None:
    memory = MemoryStore()
    for offset, addend in steps:
        hits = [Hit("svc", algorithm, limit, window_s, addend)]
        now = T0 + offset
        assert_same(await store.hit(hits, now), await memory.hit(hits, now), (offset, addend))


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_sequences_match_memory_store(store: RedisStore, seed: int) -> None:
    rng = random.Random(seed)
    counters = [(f"k{i}", rng.choice(list(Algorithm)), rng.randint(0, 6),
                 rng.choice([10, 30, 60])) for i in range(12)]
    memory = MemoryStore()
    # A quarter-second grid keeps every TTL Redis is given far above the real time
    # the test takes between two calls in one window.
    now = T0 + 0.1
    for step in range(300):
        now += rng.choice([0.0, 0.0, 0.25, 0.5, 1.75, 4.0, 13.25, 30.0])
        hits = [Hit(key, algorithm, limit, window_s, rng.choice([0, 1, 1, 1, 2, 3]))
                for key, algorithm, limit, window_s in rng.sample(counters, rng.randint(1, 5))]
        assert_same(await store.hit(hits, now), await memory.hit(hits, now), (step, now, hits))


# Commands the scripts run count in commandstats too; anything else (SCRIPT
# EXISTS/LOAD, EVAL, a bare GET) would mean the store did more than EVALSHA.
SCRIPT_INNER = {"cmdstat_get", "cmdstat_incrby", "cmdstat_pexpire", "cmdstat_set"}
ADMIN = {"cmdstat_info", "cmdstat_config|resetstat"}


async def evalsha_only(admin: Redis) -> int:
    """EVALSHA calls since CONFIG RESETSTAT, after checking nothing else was sent."""
    stats = {name: value["calls"] for name, value in (await admin.info("commandstats")).items()}
    assert set(stats) - SCRIPT_INNER - ADMIN == {"cmdstat_evalsha"}, stats
    calls: int = stats["cmdstat_evalsha"]
    return calls


async def test_one_round_trip_for_fifty_hits(store: RedisStore, admin: Redis,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    hits = [Hit(f"svc{i}", list(Algorithm)[i % 3], 10, 60, 1) for i in range(50)]
    # Warm up: connect, and load the scripts into the server's cache.
    await store.hit(hits, T0)

    writes = 0
    original = AbstractConnection.send_packed_command

    async def counting(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        nonlocal writes
        writes += 1
        await original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    await admin.config_resetstat()
    writes = 0
    counts = await store.hit(hits, T0 + 1)
    assert writes == 1
    monkeypatch.undo()

    assert [c.used for c in counts] == [2] * 50
    assert await evalsha_only(admin) == 50


async def test_lost_script_cache_is_reloaded(store: RedisStore, admin: Redis) -> None:
    hits = [Hit("f", FIXED, 3, 60, 1), Hit("s", SLIDING, 3, 60, 1), Hit("g", GCRA, 3, 60, 1)]
    memory = MemoryStore()
    for step in range(5):
        await admin.script_flush()
        now = T0 + step
        assert_same(await store.hit(hits, now), await memory.hit(hits, now), step)
    await store.hit(hits, T0 + 10)
    await admin.config_resetstat()
    await store.hit(hits, T0 + 11)
    assert await evalsha_only(admin) == 3


async def test_keys_share_a_hash_tag_and_expire_with_their_window(
        store: RedisStore, admin: Redis) -> None:
    now = T0 + 15.0
    await store.hit([Hit("a:b", FIXED, 5, 60, 1), Hit("sl", SLIDING, 5, 60, 1),
                     Hit("g", GCRA, 5, 60, 2)], now)
    await store.hit([Hit("sl", SLIDING, 5, 60, 1)], now + 60)
    keys = sorted([key async for key in admin.scan_iter("*")])
    start = int(T0)
    assert keys == ["sitsmesh:rl:{a:b}:" + str(start), "sitsmesh:rl:{g}",
                    "sitsmesh:rl:{sl}:" + str(start), "sitsmesh:rl:{sl}:" + str(start + 60)]
    for tag in ("a:b", "g", "sl"):
        assert {key_slot(k.encode()) for k in keys if f"{{{tag}}}" in k} == {
            key_slot(tag.encode())}

    # TTLs follow the caller's clock: the fixed window ends 45 s after `now`.
    fixed_ttl = await admin.pttl(keys[0])
    assert 40_000 < fixed_ttl <= 45_000
    # GCRA lives until its theoretical arrival time: 2 hits * 12 s.
    assert 23_000 < await admin.pttl(keys[1]) <= 24_000
    # Sliding keys outlive their window by one more, to serve as "previous".
    assert 100_000 < await admin.pttl(keys[2]) <= 105_000
    assert 100_000 < await admin.pttl(keys[3]) <= 105_000


async def test_reads_and_rejections_write_nothing(store: RedisStore, admin: Redis) -> None:
    reads = [Hit("f", FIXED, 5, 60, 0), Hit("s", SLIDING, 5, 60, 0), Hit("g", GCRA, 5, 60, 0)]
    assert [c.over for c in await store.hit(reads, T0)] == [False, False, False]
    too_big = [Hit("s", SLIDING, 5, 60, 6), Hit("g", GCRA, 5, 60, 6)]
    assert [c.over for c in await store.hit(too_big, T0)] == [True, True]
    assert await admin.dbsize() == 0


async def test_prefix_is_configurable(redis_server: redisproc.RedisServer, admin: Redis) -> None:
    custom = RedisStore.from_url(redis_server.url, prefix="app:limits:", timeout_s=2.0)
    try:
        await custom.hit([Hit("x", GCRA, 5, 60, 1)], T0)
    finally:
        await custom.close()
    assert [key async for key in admin.scan_iter("*")] == ["app:limits:{x}"]


def test_prefix_with_a_brace_is_refused() -> None:
    with pytest.raises(ValueError, match="braces"):
        RedisStore.from_url("redis://127.0.0.1:1/0", prefix="a{b}:")


async def test_script_errors_propagate(store: RedisStore, admin: Redis) -> None:
    await admin.set(f"sitsmesh:rl:{{f}}:{int(T0)}", "not a number")
    with pytest.raises(ResponseError, match="not an integer"):
        await store.hit([Hit("f", FIXED, 5, 60, 1)], T0)


async def test_unreachable_redis_raises() -> None:
    unreachable = RedisStore.from_url(f"redis://127.0.0.1:{harness.free_port()}/0")
    try:
        with pytest.raises(RedisConnectionError):
            await unreachable.hit([Hit("f", FIXED, 5, 60, 1)], T0)
    finally:
        await unreachable.close()


async def test_restart_while_idle_costs_no_failed_call(
        store: RedisStore, redis_server: redisproc.RedisServer) -> None:
    hit = [Hit("idle", FIXED, 100, 60, 1)]
    # Several pooled connections, all closed by the server when it dies.
    await asyncio.gather(*(store.hit(hit, T0) for _ in range(6)))
    redis_server.restart()
    await asyncio.sleep(0.1)  # let the event loop see the closed sockets
    answers = await asyncio.gather(*(store.hit(hit, T0) for _ in range(8)))
    assert sorted(a[0].used for a in answers) == list(range(1, 9))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def probe_until_healthy(resilient: ResilientStore, clock: Clock) -> None:
    # Recovery is the behaviour under test; how many probes a busy machine needs is not.
    for _ in range(5):
        clock.t += 1.0
        await resilient.hit([Hit("probe", FIXED, 1000, 60, 0)], T0)
        if resilient.healthy:
            return
    raise AssertionError(f"not healthy after 5 probes, errors={resilient.errors}")


def expected_fallback(policy: StoreErrorPolicy, used: int) -> Count:
    # limit 4 over 2 replicas leaves 2 per replica for LOCAL.
    if policy is StoreErrorPolicy.ALLOW:
        return Count(False, 4, 60.0, 0)
    if policy is StoreErrorPolicy.DENY:
        return Count(True, 0, 60.0, 4)
    return Count(used > 2, max(0, 2 - used), 45.0, used)


@pytest.mark.parametrize("policy", list(StoreErrorPolicy))
async def test_killed_redis_falls_back_fast_and_recovers_after_restart(
        redis_server: redisproc.RedisServer, admin: Redis, policy: StoreErrorPolicy) -> None:
    clock, health = Clock(), list[bool]()
    resilient = ResilientStore(RedisStore.from_url(redis_server.url), policy, replicas=2,
                               backoff_s=1.0, clock=clock, on_health=health.append)
    hit = [Hit("api", FIXED, 4, 60, 1)]
    now = T0 + 15.0
    key = f"sitsmesh:rl:{{api}}:{int(T0)}"
    try:
        assert (await resilient.hit(hit, now))[0].used == 1
        assert await admin.get(key) == "1"

        redis_server.kill()
        for used in (1, 2, 3):
            started = time.monotonic()
            [answer] = await resilient.hit(hit, now)
            assert time.monotonic() - started < 0.5
            assert answer == expected_fallback(policy, used)
        assert not resilient.healthy
        assert health == [False]
        # Only the first call tried Redis; the others were inside the backoff.
        assert (resilient.errors, resilient.fallbacks) == (1, 3)

        port = redis_server.port
        redis_server.restart()
        assert redis_server.port == port
        clock.t += 0.5
        await resilient.hit(hit, now)
        assert await admin.dbsize() == 0, "still inside the backoff: Redis must not be hit"

        await probe_until_healthy(resilient, clock)
        assert health == [False, True]
        # Redis came back empty (no persistence): counting starts again there.
        assert (await resilient.hit(hit, now))[0].used == 1
        assert (await resilient.hit(hit, now))[0].used == 2
        assert await admin.get(key) == "2"
    finally:
        await resilient.close()


async def test_hung_redis_times_out_and_connection_stays_in_sync(
        redis_server: redisproc.RedisServer, admin: Redis) -> None:
    clock, health = Clock(), list[bool]()
    resilient = ResilientStore(RedisStore.from_url(redis_server.url), StoreErrorPolicy.DENY,
                               backoff_s=1.0, clock=clock, on_health=health.append)
    try:
        assert (await resilient.hit([Hit("before", GCRA, 5, 60, 1)], T0))[0].used == 1
        redis_server.pause()
        try:
            started = time.monotonic()
            [answer] = await resilient.hit([Hit("during", FIXED, 5, 60, 1)], T0)
            assert time.monotonic() - started < 0.5
            assert answer.over
            assert health == [False]
        finally:
            redis_server.resume()

        await probe_until_healthy(resilient, clock)
        # A reply left over from the abandoned call would show up here as a wrong answer.
        for used in (1, 2, 3):
            counts = await resilient.hit([Hit("after", SLIDING, 5, 60, 1),
                                          Hit("before", GCRA, 5, 60, 0)], T0)
            assert [(c.over, c.used) for c in counts] == [(False, used), (False, 1)]
        assert health == [False, True]
    finally:
        await resilient.close()


@pytest.mark.parametrize("seed", [4, 5])
async def test_not_counting_rejected_hits_matches_memory_store(
        redis_server: redisproc.RedisServer, seed: int) -> None:
    rng = random.Random(seed)
    strict = RedisStore.from_url(redis_server.url, prefix="strict:", timeout_s=2.0,
                                 count_rejected=False)
    memory = MemoryStore(count_rejected=False)
    now = T0 + 0.1
    try:
        for step in range(200):
            now += rng.choice([0.0, 0.0, 0.5, 7.0])
            hits = [Hit(f"k{rng.randint(0, 3)}", FIXED, 4, 30, rng.choice([0, 1, 2, 5]))]
            assert_same(await strict.hit(hits, now), await memory.hit(hits, now), (step, hits))
    finally:
        await strict.close()
    # Over the limit and not counted: the counter never passes it.
    assert await strict_max(redis_server) <= 4


async def strict_max(redis_server: redisproc.RedisServer) -> int:
    client = Redis(host="127.0.0.1", port=redis_server.port, decode_responses=True)
    try:
        values = [int(await client.get(key) or 0) async for key in client.scan_iter("strict:*")]
    finally:
        await client.aclose()
    assert values, "the sequence counted something"
    return max(values)


async def test_expiry_jitter_lengthens_ttls_within_its_bound(
        redis_server: redisproc.RedisServer, admin: Redis) -> None:
    jittered = RedisStore.from_url(redis_server.url, prefix="j:", timeout_s=2.0, jitter_s=30)
    try:
        # Now + a little: the caller's clock and the server's need not agree.
        now = time.time()
        await jittered.hit([Hit(f"k{i}", FIXED, 5, 10, 1) for i in range(40)], now)
    finally:
        await jittered.close()
    window_left = 10 - now % 10
    ttls = [await admin.pttl(key) async for key in admin.scan_iter("j:*")]
    assert len(ttls) == 40
    assert all(ttl <= (window_left + 30) * 1000 for ttl in ttls)
    assert max(ttls) > window_left * 1000 + 5000, "some key got jitter"
