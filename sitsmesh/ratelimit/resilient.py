"""A counter store that keeps answering when its primary (Redis) fails or stalls.

Every primary call is bounded by `timeout_s`. After a failure the primary is
left alone for `backoff_s`, so an outage costs one timeout per backoff period
rather than one per request; then a single call probes it, and a successful
probe puts it back in use. On a Redis Cluster (a primary that is `sharded`) each
master is left alone and probed on its own: while one fails over, the hits on the
others are still counted. While it is down, `policy` answers:

- ALLOW: every hit passes (fail open).
- DENY: every hit is over the limit (fail closed).
- LOCAL: an in-process MemoryStore counts, with each limit split evenly
  across `replicas`: `limit // replicas`, never below 0. Rounding down keeps
  the sum over all replicas within the global limit; the cost is that a limit
  smaller than `replicas` denies every hit on every replica until recovery.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from sitsmesh import logs
from sitsmesh.ratelimit.memory import MemoryStore
from sitsmesh.ratelimit.store import Count, CounterStore, Hit

_log = logs.get("sitsmesh.ratelimit.store")


class ShardedStore(CounterStore, Protocol):
    """A primary whose failures belong to one shard each (RedisStore on a cluster)."""

    def shard_of(self, hit: Hit) -> str: ...

    async def hit_each(self, hits: Sequence[Hit], now: float) -> list[Count | Exception]: ...


class StoreErrorPolicy(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    LOCAL = "local"


class ResilientStore:
    """Wraps a primary CounterStore; `name` is the primary's, so metrics name the backend.

    `errors` counts failed primary calls (exceptions and timeouts); `fallbacks`
    counts `hit()` calls answered by the policy instead of the primary.
    """

    __slots__ = ("_backoff_s", "_clock", "_down", "_healthy", "_local", "_on_health",
                 "_policy", "_primary", "_replicas", "_retry_at", "_sharded", "_timeout_s",
                 "errors", "fallbacks", "name")

    name: str

    def __init__(self, primary: CounterStore, policy: StoreErrorPolicy, *,
                 timeout_s: float | None = 0.05, replicas: int = 1, backoff_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_health: Callable[[bool], None] | None = None,
                 count_rejected: bool = True) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        self.name = primary.name
        self._primary = primary
        self._policy = policy
        self._timeout_s = timeout_s
        self._replicas = replicas
        self._backoff_s = backoff_s
        self._clock = clock
        self._on_health = on_health
        # The fallback counts as the primary does (ratelimit_count_rejected_hits).
        self._local = (MemoryStore(count_rejected=count_rejected)
                       if policy is StoreErrorPolicy.LOCAL else None)
        self._healthy = True
        # While unhealthy: the clock time at which the next call may probe the primary.
        self._retry_at = 0.0
        # A cluster's masters, each with its own back-off: shard -> next probe time.
        self._sharded = bool(getattr(primary, "sharded", False))
        self._down: dict[str, float] = {}
        self.errors = 0
        self.fallbacks = 0

    @property
    def healthy(self) -> bool:
        return self._healthy

    async def hit(self, hits: Sequence[Hit], now: float) -> list[Count]:
        if self._sharded:
            return await self._hit_sharded(hits, now)
        probing = not self._healthy
        if probing:
            if self._clock() < self._retry_at:
                return self._fallback(hits, now)
            # Claim the probe: calls arriving while it is in flight keep falling back.
            self._retry_at = self._clock() + self._backoff_s
        try:
            if self._timeout_s is None:  # the primary bounds its own calls
                counts = await self._primary.hit(hits, now)
            else:
                async with asyncio.timeout(self._timeout_s):
                    counts = await self._primary.hit(hits, now)
        except Exception as exc:
            self._failed(exc)
            return self._fallback(hits, now)
        # Only a probe may declare recovery: a slow call that began before the
        # outage and succeeds after it proves nothing and would make health flap.
        if probing and not self._healthy:
            self._set_healthy(True)
            _log.info("counter store recovered", store=self.name)
        return counts

    async def _hit_sharded(self, hits: Sequence[Hit], now: float) -> list[Count]:
        primary = cast("ShardedStore", self._primary)
        shards = [primary.shard_of(h) for h in hits]
        clock = self._clock()
        down = self._down
        probes: set[str] = set()
        send = []
        for i, shard in enumerate(shards):
            retry_at = down.get(shard)
            if retry_at is not None and shard not in probes:
                if clock < retry_at:
                    continue
                down[shard] = clock + self._backoff_s  # claim the probe
                probes.add(shard)
            send.append(i)
        counts: list[Count | None] = [None] * len(hits)
        if send:
            try:
                async with asyncio.timeout(self._timeout_s):
                    got: list[Count | Exception] = await primary.hit_each(
                        [hits[i] for i in send], now)
            except Exception as exc:
                got = [exc] * len(send)
            for i, result in zip(send, got, strict=True):
                if isinstance(result, Exception):
                    self._shard_failed(shards[i], result)
                else:
                    counts[i] = result
                    if shards[i] in probes and down.pop(shards[i], None) is not None:
                        _log.info("counter store recovered", store=self.name,
                                  shard=shards[i])
                        if not down:
                            self._set_healthy(True)
        missing = [i for i, count in enumerate(counts) if count is None]
        if missing:
            for i, count in zip(missing, self._fallback([hits[i] for i in missing], now),
                                strict=True):
                counts[i] = count
        return cast("list[Count]", counts)

    def _shard_failed(self, shard: str, exc: Exception) -> None:
        self.errors += 1
        fresh = shard not in self._down
        self._down[shard] = self._clock() + self._backoff_s
        if fresh:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            _log.warning("counter store unavailable", store=self.name, shard=shard,
                         error=error, policy=self._policy.value, backoff_s=self._backoff_s)
            if self._healthy:
                self._set_healthy(False)

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        self._retry_at = self._clock() + self._backoff_s
        if self._healthy:
            self._set_healthy(False)
            # A timeout has an empty message; the type alone says what happened.
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            _log.warning("counter store unavailable", store=self.name, error=error,
                         policy=self._policy.value, backoff_s=self._backoff_s)

    def _set_healthy(self, healthy: bool) -> None:
        self._healthy = healthy
        if self._on_health is not None:
            self._on_health(healthy)

    def _fallback(self, hits: Sequence[Hit], now: float) -> list[Count]:
        self.fallbacks += 1
        if self._local is not None:
            replicas = self._replicas
            return self._local.hit_sync(
                [Hit(h.key, h.algorithm, max(0, h.limit // replicas), h.window_s, h.addend)
                 for h in hits], now)
        if self._policy is StoreErrorPolicy.ALLOW:
            return [Count(False, h.limit, float(h.window_s), 0) for h in hits]
        # `used` reads as a full window, so near-limit accounting sees it as spent.
        return [Count(True, 0, float(h.window_s), h.limit) for h in hits]

    async def close(self) -> None:
        try:
            await self._primary.close()
        finally:
            if self._local is not None:
                await self._local.close()
