from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
from structlog.testing import capture_logs

from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.memory import MemoryStore
from sitsmesh.ratelimit.resilient import ResilientStore, StoreErrorPolicy
from sitsmesh.ratelimit.store import Count, Hit

NOW = 1_000.0


class FakePrimary:
    """A primary that answers from a MemoryStore, or fails the way it is told to."""

    name = "fake"

    def __init__(self) -> None:
        self.calls = 0
        self.closed = False
        self.cancelled = 0
        self.fail: Exception | None = None
        self.delay_s = 0.0
        self.gate: asyncio.Event | None = None
        self._memory = MemoryStore()

    async def hit(self, hits: Sequence[Hit], now: float) -> list[Count]:
        self.calls += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail is not None:
            raise self.fail
        return self._memory.hit_sync(hits, now)

    async def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def fixed(key: str = "k", limit: int = 10, window_s: int = 60, addend: int = 1) -> Hit:
    return Hit(key, Algorithm.FIXED_WINDOW, limit, window_s, addend)


def make(policy: StoreErrorPolicy, *, timeout_s: float = 0.05, replicas: int = 1,
         backoff_s: float = 1.0) -> tuple[ResilientStore, FakePrimary, Clock, list[bool]]:
    primary, clock, health = FakePrimary(), Clock(), list[bool]()
    store = ResilientStore(primary, policy, timeout_s=timeout_s, replicas=replicas,
                           backoff_s=backoff_s, clock=clock, on_health=health.append)
    return store, primary, clock, health


async def test_healthy_primary_answers() -> None:
    store, primary, _, health = make(StoreErrorPolicy.DENY)
    assert await store.hit([fixed(limit=2), fixed(limit=2)], NOW) == [
        Count(False, 1, 20.0, 1), Count(False, 0, 20.0, 2)]
    assert primary.calls == 1
    assert store.healthy
    assert (store.errors, store.fallbacks, health) == (0, 0, [])
    assert store.name == "fake"


async def test_allow_policy_passes_every_hit() -> None:
    store, primary, _, _ = make(StoreErrorPolicy.ALLOW)
    primary.fail = ConnectionError("refused")
    hits = [fixed(limit=7, window_s=60), Hit("g", Algorithm.GCRA, 3, 1, 5)]
    assert await store.hit(hits, NOW) == [Count(False, 7, 60.0, 0), Count(False, 3, 1.0, 0)]
    assert (store.errors, store.fallbacks, store.healthy) == (1, 1, False)


async def test_deny_policy_rejects_every_hit() -> None:
    store, primary, _, _ = make(StoreErrorPolicy.DENY)
    primary.fail = ConnectionError("refused")
    hits = [fixed(limit=7, window_s=60), Hit("s", Algorithm.SLIDING_WINDOW, 3, 10, 0)]
    assert await store.hit(hits, NOW) == [Count(True, 0, 60.0, 7), Count(True, 0, 10.0, 3)]
    assert (store.errors, store.fallbacks, store.healthy) == (1, 1, False)


async def test_local_policy_counts_in_process_with_limit_split_across_replicas() -> None:
    store, primary, _, _ = make(StoreErrorPolicy.LOCAL, replicas=3)
    primary.fail = ConnectionError("refused")
    # 10 // 3 == 3 per replica: three pass, the fourth is over.
    answers = [(await store.hit([fixed(limit=10)], NOW + i))[0] for i in range(4)]
    assert [(a.over, a.remaining, a.used) for a in answers] == [
        (False, 2, 1), (False, 1, 2), (False, 0, 3), (True, 0, 4)]
    assert store.fallbacks == 4


async def test_local_policy_limit_below_replicas_rounds_down_to_zero() -> None:
    store, primary, _, _ = make(StoreErrorPolicy.LOCAL, replicas=3)
    primary.fail = ConnectionError("refused")
    [answer] = await store.hit([Hit("g", Algorithm.GCRA, 2, 60, 1)], NOW)
    assert answer.over


async def test_local_policy_with_one_replica_keeps_the_limit() -> None:
    store, primary, _, _ = make(StoreErrorPolicy.LOCAL)
    primary.fail = ConnectionError("refused")
    answers = await store.hit([fixed(limit=2, addend=2), fixed("other", limit=2, addend=3)], NOW)
    assert [(a.over, a.remaining) for a in answers] == [(False, 0), (True, 0)]


def test_replicas_must_be_positive() -> None:
    with pytest.raises(ValueError, match="replicas"):
        ResilientStore(FakePrimary(), StoreErrorPolicy.LOCAL, replicas=0)


async def test_slow_primary_times_out_and_is_cancelled() -> None:
    store, primary, _, health = make(StoreErrorPolicy.DENY, timeout_s=0.01)
    primary.delay_s = 5.0
    started = time.monotonic()
    [answer] = await store.hit([fixed()], NOW)
    assert time.monotonic() - started < 0.5
    assert answer.over
    assert (primary.cancelled, store.errors, health) == (1, 1, [False])


async def test_unhealthy_primary_is_skipped_until_backoff_then_probed() -> None:
    store, primary, clock, health = make(StoreErrorPolicy.ALLOW, backoff_s=1.0)
    primary.fail = ConnectionError("refused")
    await store.hit([fixed()], NOW)
    for _ in range(5):
        clock.t += 0.19
        await store.hit([fixed()], NOW)
    assert (primary.calls, store.errors, store.fallbacks) == (1, 1, 6)

    clock.t += 0.1  # 1.05 s after the failure
    await store.hit([fixed()], NOW)
    assert (primary.calls, store.errors, store.fallbacks) == (2, 2, 7)
    assert not store.healthy

    # A failed probe starts a new backoff period.
    clock.t += 0.5
    await store.hit([fixed()], NOW)
    assert primary.calls == 2

    primary.fail = None
    clock.t += 0.5
    [answer] = await store.hit([fixed(limit=5)], NOW)
    assert answer == Count(False, 4, 20.0, 1)
    assert store.healthy
    assert health == [False, True]
    assert (primary.calls, store.errors, store.fallbacks) == (3, 2, 8)

    await store.hit([fixed(limit=5)], NOW)
    assert primary.calls == 4


async def test_health_callback_and_log_fire_once_per_transition() -> None:
    store, primary, clock, health = make(StoreErrorPolicy.ALLOW, backoff_s=1.0)
    with capture_logs() as logs:
        for _ in range(3):
            primary.fail = ConnectionError("refused")
            for _ in range(4):
                await store.hit([fixed()], NOW)
                clock.t += 2.0
            primary.fail = None
            for _ in range(3):
                await store.hit([fixed()], NOW)
    assert health == [False, True] * 3
    assert [entry["event"] for entry in logs] == [
        "counter store unavailable", "counter store recovered"] * 3
    assert logs[0]["error"] == "ConnectionError: refused"
    assert logs[0]["log_level"] == "warning"
    assert store.errors == 12


async def test_timeout_is_logged_by_type() -> None:
    store, primary, _, _ = make(StoreErrorPolicy.ALLOW, timeout_s=0.01)
    primary.delay_s = 5.0
    with capture_logs() as logs:
        await store.hit([fixed()], NOW)
    assert logs[0]["error"] == "TimeoutError"


async def test_one_probe_at_a_time() -> None:
    store, primary, clock, health = make(StoreErrorPolicy.DENY, timeout_s=5.0, backoff_s=1.0)
    primary.fail = ConnectionError("refused")
    await store.hit([fixed()], NOW)
    primary.fail = None
    primary.gate = asyncio.Event()
    clock.t += 1.0
    probe = asyncio.create_task(store.hit([fixed()], NOW))
    await asyncio.sleep(0)
    assert primary.calls == 2
    # While the probe is in flight the others keep falling back.
    [answer] = await store.hit([fixed()], NOW)
    assert answer.over
    assert primary.calls == 2
    primary.gate.set()
    [probed] = await probe
    assert not probed.over
    assert store.healthy
    assert health == [False, True]


async def test_late_success_of_a_call_begun_before_the_outage_does_not_flip_health() -> None:
    store, primary, _, health = make(StoreErrorPolicy.DENY, timeout_s=5.0)
    gate = primary.gate = asyncio.Event()
    slow = asyncio.create_task(store.hit([fixed()], NOW))
    await asyncio.sleep(0)
    primary.gate = None
    primary.fail = ConnectionError("refused")
    await store.hit([fixed()], NOW)
    assert not store.healthy
    primary.fail = None
    gate.set()
    [answer] = await slow
    assert not answer.over
    assert not store.healthy
    assert health == [False]


async def test_cancellation_of_the_caller_propagates() -> None:
    store, primary, _, health = make(StoreErrorPolicy.ALLOW, timeout_s=5.0)
    primary.delay_s = 5.0
    task = asyncio.create_task(store.hit([fixed()], NOW))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (store.errors, store.fallbacks, health) == (0, 0, [])
    assert store.healthy


async def test_close_closes_the_primary() -> None:
    store, primary, _, _ = make(StoreErrorPolicy.LOCAL)
    await store.close()
    assert primary.closed


class FakeCluster(FakePrimary):
    """A sharded primary: a hit's shard is its key's first letter; `down` shards fail."""

    sharded = True

    def __init__(self) -> None:
        super().__init__()
        self.down: set[str] = set()
        self.sent: list[list[str]] = []

    def shard_of(self, hit: Hit) -> str:
        return hit.key[0]

    async def hit_each(self, hits: Sequence[Hit], now: float) -> list[Count | Exception]:
        self.sent.append([h.key for h in hits])
        return [ConnectionError(f"master {h.key[0]} is down") if h.key[0] in self.down
                else self._memory.hit_sync([h], now)[0] for h in hits]


async def test_a_cluster_master_down_costs_only_its_own_counters() -> None:
    primary, clock = FakeCluster(), Clock()
    health: list[bool] = []
    store = ResilientStore(primary, StoreErrorPolicy.DENY, clock=clock, backoff_s=1.0,
                           on_health=health.append)
    primary.down = {"a"}
    counts = await store.hit([fixed("a1"), fixed("b1")], NOW)
    assert [c.over for c in counts] == [True, False]  # the policy for a, b counted
    assert counts[1].used == 1 and health == [False] and not store.healthy
    # Within the back-off, a's hits are not sent at all; b's still are.
    primary.sent.clear()
    counts = await store.hit([fixed("a1"), fixed("b1")], NOW)
    assert primary.sent == [["b1"]] and [c.over for c in counts] == [True, False]
    assert counts[1].used == 2
    # After it, one call probes a; while a is still down, it stays down.
    clock.t += 1.0
    assert [c.over for c in await store.hit([fixed("a1")], NOW)] == [True]
    assert primary.sent[-1] == ["a1"] and not store.healthy
    # Back up: the next probe counts, and the store is healthy again.
    primary.down.clear()
    clock.t += 1.0
    assert [c.used for c in await store.hit([fixed("a1"), fixed("b1")], NOW)] == [1, 3]
    assert store.healthy and health == [False, True]
    assert store.errors == 2 and store.fallbacks == 3


async def test_a_probe_of_a_cluster_master_is_claimed_by_one_call() -> None:
    primary, clock = FakeCluster(), Clock()
    store = ResilientStore(primary, StoreErrorPolicy.ALLOW, clock=clock, backoff_s=1.0)
    primary.down = {"a"}
    await store.hit([fixed("a1")], NOW)
    clock.t += 1.0
    primary.sent.clear()
    await asyncio.gather(*(store.hit([fixed("a1")], NOW) for _ in range(5)))
    assert primary.sent == [["a1"]]  # one probe; the other four answered by the policy
