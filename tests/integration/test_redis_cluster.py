"""Rate-limit counters and RLQS peers on a real 3-master Redis Cluster: spread over
every master, one request's counters on several masters answered in order, a stalled
master that holds up and fails only its own counters, and a master killed under load.
Redis replicates asynchronously, so a crash can lose what its replica had not received
yet: the counts of the other masters lose nothing, the killed master's lose at most what
was acknowledged in the second before its death (README "Redis Cluster"), and counting
resumes on the promoted replica by itself."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc import aio

from sitsmesh import redisclients
from sitsmesh.dev import harness, rediscluster
from sitsmesh.dev.rediscluster import RedisClusterNodes
from sitsmesh.quota.peers import QuotaPeers
from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.memory import MemoryStore
from sitsmesh.ratelimit.redis_store import DEFAULT_PREFIX, MAX_IN_FLIGHT, RedisStore
from sitsmesh.ratelimit.store import Count, Hit
from tests.redisfixtures import cluster_fixture, redis_cluster_fixture  # noqa: F401 - fixtures

Start = Callable[..., harness.Sitsmesh]
OK = rls_pb2.RateLimitResponse.OK
USERS = [f"user-{n}" for n in range(30)]
HOUR = 3600


def _hit(user: str, addend: int = 1, algorithm: Algorithm = Algorithm.FIXED_WINDOW,
         limit: int = 10**9) -> Hit:
    return Hit(f"bench_user_{user}", algorithm, limit, HOUR, addend)


def _masters(nodes: RedisClusterNodes, users: list[str], now: float) -> dict[str, int]:
    start = int(now - now % HOUR)
    return {u: nodes.master_of(f"{DEFAULT_PREFIX}{{bench_user_{u}}}:{start}") for u in users}


async def test_counters_spread_over_every_master_and_hold_their_limits(
        cluster: RedisClusterNodes) -> None:
    store = RedisStore.from_url(cluster.url, timeout_s=2.0)
    try:
        now = time.time()
        assert len(set(_masters(cluster, USERS, now).values())) == 3
        for algorithm in Algorithm:
            # Each algorithm its own counters (the windows would share keys).
            hits = [_hit(f"{u}-{algorithm.value}", algorithm=algorithm, limit=3) for u in USERS]
            counts = [await store.hit(hits, now) for _ in range(4)]
            assert [[c.over for c in batch] for batch in counts] == \
                [[False] * 30, [False] * 30, [False] * 30, [True] * 30], algorithm
    finally:
        await store.close()


async def test_concurrent_requests_over_every_master_match_memory_store(
        cluster: RedisClusterNodes) -> None:
    """Each master batches on its own: a request's counters on three masters come back
    as three parts, and every reply must land in its own request, in its own place."""
    store = RedisStore.from_url(cluster.url, timeout_s=2.0)
    memory = MemoryStore()
    rng = random.Random(31)
    counters = [(f"bench_user_{u}", rng.choice(list(Algorithm)), rng.randint(0, 25),
                 rng.choice([3600, 7200])) for u in USERS]
    now = 1_700_006_400.1  # a window boundary: every TTL stays far above the test's time
    try:
        assert len(set(_masters(cluster, USERS, now).values())) == 3
        for step in range(40):
            now += rng.choice([0.0, 0.25, 1.0])
            requests = [[Hit(key, algorithm, limit, window, rng.choice([0, 1, 1, 2]))
                         for key, algorithm, limit, window in rng.sample(counters,
                                                                         rng.randint(1, 8))]
                        for _ in range(rng.randint(1, 6))]
            # One event-loop turn: the requests share each master's batch, in order.
            got = await asyncio.gather(*(store.hit_each(hits, now) for hits in requests))
            for n, (hits, answers) in enumerate(zip(requests, got, strict=True)):
                want = await memory.hit(hits, now)
                assert [(a.over, a.used, a.remaining) if isinstance(a, Count) else a
                        for a in answers] == [(w.over, w.used, w.remaining) for w in want], \
                    (step, n, hits)
    finally:
        await store.close()


async def test_a_stalled_master_holds_up_and_fails_only_its_own_counters(
        cluster: RedisClusterNodes) -> None:
    store = RedisStore.from_url(cluster.url, timeout_s=0.5)
    now = time.time()
    masters = _masters(cluster, USERS, now)
    stalled = masters[USERS[0]]
    mine = [u for u in USERS if masters[u] == stalled]
    others = [u for u in USERS if masters[u] != stalled]
    process = cluster.procs[stalled].proc
    try:
        await store.hit([_hit(u) for u in USERS], now)  # connections, scripts everywhere
        # Well under the cluster's 1 s node timeout each time: no failover.
        process.send_signal(signal.SIGSTOP)
        try:
            # More batches than may be in flight, all waiting on the stalled master...
            stuck = []
            for user in mine[:MAX_IN_FLIGHT + 1]:
                stuck.append(asyncio.create_task(store.hit_each([_hit(user)], now)))
                for _ in range(5):  # each its own batch
                    await asyncio.sleep(0)
            # ...and the other masters' counters do not queue behind them.
            elsewhere = asyncio.create_task(store.hit_each([_hit(u) for u in others], now))
            done, _ = await asyncio.wait([elsewhere, *stuck],
                                         return_when=asyncio.FIRST_COMPLETED)
            assert done == {elsewhere}
            assert [c.used for c in elsewhere.result() if isinstance(c, Count)] == \
                [2] * len(others)
        finally:
            process.send_signal(signal.SIGCONT)
        await asyncio.gather(*stuck)

        process.send_signal(signal.SIGSTOP)
        try:
            answers = await store.hit_each([_hit(u) for u in USERS], now)
        finally:
            process.send_signal(signal.SIGCONT)
        for user, answer in zip(USERS, answers, strict=True):
            if masters[user] == stalled:
                assert isinstance(answer, TimeoutError), (user, answer)
            else:
                assert isinstance(answer, Count) and answer.used == 3, (user, answer)
        # The stalled master's connection was dropped with its replies still due: the
        # next call must read its own replies, not the late ones.
        after = await store.hit_each([_hit(u, addend=0) for u in others + mine], now)
        assert [a.used if isinstance(a, Count) else a for a in after[:len(others)]] == \
            [3] * len(others)
        assert all(isinstance(a, Count) for a in after[len(others):]), after
    finally:
        await store.close()
        harness.wait_until(cluster.healthy, 15, "the cluster ok after the stall")


async def test_a_master_killed_under_load_loses_only_its_last_second(tmp_path: Path) -> None:
    with rediscluster.redis_cluster(tmp_path / "cluster") as nodes:
        store = RedisStore.from_url(nodes.url, timeout_s=0.5)
        now = time.time()  # one fixed window for the whole test
        masters = _masters(nodes, USERS, now)
        victim = masters[USERS[0]]
        acked = dict.fromkeys(USERS, 0)
        tried = dict.fromkeys(USERS, 0)
        last_second: list[float] = []   # when the victim's hits were acknowledged
        killed_at = 0.0
        try:
            async def load(users: list[str]) -> None:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and (
                        not killed_at or time.monotonic() - killed_at < 1.0
                        or not recovered.is_set()):
                    for user in users:
                        tried[user] += 1
                        try:
                            await store.hit([_hit(user)], now)
                        except Exception:  # a master is failing over
                            await asyncio.sleep(0.01)
                            continue
                        acked[user] += 1
                        if masters[user] == victim:
                            last_second.append(time.monotonic())
                            # (a hit that was on the wire as the master died is no sign)
                            if killed_at and time.monotonic() - killed_at > 0.2:
                                recovered.set()

            recovered = asyncio.Event()
            workers = [asyncio.create_task(load(USERS[i::3])) for i in range(3)]
            await asyncio.sleep(1.5)
            nodes.kill(victim)
            killed_at = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*workers), 70)
            assert recovered.is_set(), "the killed master's keys never counted again"
            in_last_second = sum(1 for t in last_second if killed_at - 1.0 <= t < killed_at)
            stored = {u: (await store.hit([_hit(u, addend=0)], now))[0].used for u in USERS}
            assert time.monotonic() - killed_at < 30, "counting took over 30 s to resume"
        finally:
            await store.close()
        lost_elsewhere = {u: acked[u] - stored[u] for u in USERS if masters[u] != victim}
        assert all(v <= 0 for v in lost_elsewhere.values()), lost_elsewhere
        assert all(stored[u] <= tried[u] for u in USERS)  # nothing counted twice
        lost = sum(acked[u] - stored[u] for u in USERS if masters[u] == victim)
        # A hit whose reply the kill cut off may still have landed (and reached the
        # replica): counted without an acknowledgement, as many as failed at most.
        unacked = sum(tried[u] - acked[u] for u in USERS if masters[u] == victim)
        assert -unacked <= lost <= in_last_second, (lost, unacked, in_last_second)


async def test_rlqs_replicas_read_each_others_demand_on_the_cluster(
        cluster: RedisClusterNodes) -> None:
    """Each replica's demand hash and the replica index live in different slots: the
    cluster pipeline splits the write, and each replica reads the other's."""
    a = QuotaPeers(redisclients.connect(cluster.url), "replica-a")
    b = QuotaPeers(redisclients.connect(cluster.url), "replica-b")
    try:
        assert await a.sync({"tenant-x": {"envoy-1": 4.0}}) == {}
        seen_by_b = await b.sync({"tenant-x": {"envoy-2": 1.0, "envoy-3": None}})
        assert seen_by_b == {"tenant-x": {"replica-a\x1fenvoy-1": 4.0}}
        assert await a.sync({"tenant-x": {"envoy-1": 5.0}}) == {
            "tenant-x": {"replica-b\x1fenvoy-2": 1.0, "replica-b\x1fenvoy-3": None}}
    finally:
        await a.close()
        await b.close()


CONFIG = """\
domain: fleet
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 100000}
"""


def _ask(user: str) -> rls_pb2.RateLimitRequest:
    return rls_pb2.RateLimitRequest(domain="fleet", descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[
            ratelimit_pb2.RateLimitDescriptor.Entry(key="user", value=user)])])


async def test_serve_rides_out_a_master_failover(start_sitsmesh: Start, tmp_path: Path) -> None:
    """`sitsmesh serve --redis-url redis+cluster://...` with on_store_error deny: while a
    master fails over, only its own counters answer by the policy; the other masters'
    keep counting, and the killed master's count again, without a restart."""
    with rediscluster.redis_cluster(tmp_path / "cluster") as nodes:
        config = tmp_path / "fleet.yaml"
        config.write_text(CONFIG)
        node = start_sitsmesh("--ratelimit-config", str(config), "--ratelimit-store", "redis",
                              "--redis-url", nodes.url, "--on-store-error", "deny",
                              "--redis-timeout-ms", "300", name="fleet")
        window = time.time()
        start = int(window - window % HOUR)
        masters = {u: nodes.master_of(f"{DEFAULT_PREFIX}{{fleet_user_{u}}}:{start}")
                   for u in USERS}
        assert len(set(masters.values())) == 3
        victim = masters[USERS[0]]
        async with aio.insecure_channel(node.data_addr) as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)

            async def codes() -> dict[str, int]:
                answered = {}
                for i in range(0, len(USERS), 10):  # within sitsmesh's streams per connection
                    users = USERS[i:i + 10]
                    replies = await asyncio.gather(*(stub.ShouldRateLimit(_ask(u), timeout=5)
                                                     for u in users))
                    answered.update({u: r.overall_code
                                     for u, r in zip(users, replies, strict=True)})
                return answered

            assert set((await codes()).values()) == {OK}
            nodes.kill(victim)
            killed = time.monotonic()
            denied: set[str] = set()
            while True:
                answered = await codes()
                denied |= {u for u, code in answered.items() if code != OK}
                if denied and set(answered.values()) == {OK}:
                    break
                assert time.monotonic() - killed < 30, f"still denied: {answered}"
                await asyncio.sleep(0.1)
        assert denied, "the killed master's counters never answered by the policy"
        assert all(masters[u] == victim for u in denied), \
            {u: masters[u] for u in denied}
