"""Redis counter store: every counter of one request in one pipelined round trip.

Each counter is one EVALSHA of a small Lua script, so its read-decide-write
is atomic in Redis, and the script returns the state it read so the answer is
computed by the same functions in `store.py` that MemoryStore uses: the two
stores cannot disagree on a `Count` for the same state. Values that decide
the outcome (window start, sliding weight, GCRA interval) are computed in
Python exactly as the reference does and passed in, because Lua 5.1's `%`
rounds differently from Python's at window edges.

Expiry is relative (PEXPIRE / SET PX, computed from the caller's `now`), not
absolute: the caller's clock need not agree with the Redis server's, and a
key set with an absolute time in the server's past would vanish at once.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from sitsmesh import redisclients
from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.rediswire import Call, script, send_cluster, send_single
from sitsmesh.ratelimit.store import Count, Hit, fixed_window, gcra, sliding_window

DEFAULT_PREFIX = "sitsmesh:rl:"

# KEYS[1] counter. ARGV: addend, ttl_ms, limit (-1: count hits over it too, as the
# reference does). Returns the count before this hit; addend 0 only reads.
_FIXED_LUA = """
local addend = tonumber(ARGV[1])
local limit = tonumber(ARGV[3])
if addend == 0 or limit >= 0 then
  local current = tonumber(redis.call('GET', KEYS[1]) or '0')
  if addend == 0 or current + addend > limit then
    return current
  end
end
local after = redis.call('INCRBY', KEYS[1], addend)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return after - addend
"""

# KEYS[1] current window, KEYS[2] previous window. ARGV: addend, limit, weight,
# ttl_ms. Returns {previous, current} as read; a rejected hit is not counted.
# The expression keeps sliding_window's operation order so the doubles match.
_SLIDING_LUA = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local previous = tonumber(redis.call('GET', KEYS[2]) or '0')
local addend = tonumber(ARGV[1])
if addend ~= 0 and previous * tonumber(ARGV[3]) + current + addend <= tonumber(ARGV[2]) then
  redis.call('INCRBY', KEYS[1], addend)
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return {previous, current}
"""

# KEYS[1] theoretical arrival time. ARGV: now, interval, addend, window_s.
# Returns the stored TAT as read (nil when absent). %.17g round-trips a double.
_GCRA_LUA = """
local raw = redis.call('GET', KEYS[1])
local addend = tonumber(ARGV[3])
if addend ~= 0 then
  local now = tonumber(ARGV[1])
  local base = now
  if raw then base = math.max(tonumber(raw), now) end
  local tat = base + tonumber(ARGV[2]) * addend
  if tat - now <= tonumber(ARGV[4]) then
    local ttl = math.max(1, math.ceil((tat - now) * 1000))
    redis.call('SET', KEYS[1], string.format('%.17g', tat), 'PX', ttl)
  end
end
return raw
"""


_FIXED = script(_FIXED_LUA, 1)
_SLIDING = script(_SLIDING_LUA, 2)
_GCRA = script(_GCRA_LUA, 1)


def _ttl_ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


# Batches being sent; held so the event loop does not drop the tasks.
_IN_FLIGHT: set[asyncio.Task[None]] = set()
MAX_IN_FLIGHT = 2


class RedisStore:
    """A CounterStore on Redis or Redis Cluster. Errors are raised, never absorbed.

    Keys are `<prefix>{<hit.key>}:<window start>` (GCRA: `<prefix>{<hit.key>}`):
    the hash tag puts every key of one counter in one cluster slot.
    """

    __slots__ = ("_client", "_count_rejected", "_flush_scheduled", "_in_flight", "_jitter_s",
                 "_pending", "_tag_open", "_timeout_s")

    name = "redis"

    def __init__(self, client: Redis | RedisCluster, *, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = 0.05, count_rejected: bool = True,
                 jitter_s: int = 0) -> None:
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would become the hash tag and split counters across slots.
            raise ValueError(f"redis key prefix must not contain braces: {prefix!r}")
        self._client = client
        self._count_rejected = count_rejected
        # Spreads the expiry of keys written in one window over jitter_s seconds, so
        # Redis does not expire a whole window's keys in the same instant.
        self._jitter_s = jitter_s
        self._tag_open = prefix + "{"
        # One deadline per batch, not per request: a caller waits at most for the
        # batch ahead of it and its own, so 2 x timeout_s.
        self._timeout_s = timeout_s
        # Requests that arrive in one event-loop turn share one pipeline: one round
        # trip (and one send/recv pair) for all of them instead of one each.
        # While MAX_IN_FLIGHT batches are on the wire, new requests wait for the next
        # batch: under load batches grow with the arrival rate; when idle a request
        # goes out at once, so batching adds no latency.
        self._pending: list[tuple[list[Call], asyncio.Future[list[object]]]] = []
        self._flush_scheduled = False
        self._in_flight = 0

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, timeout_s: float = 0.05,
                 count_rejected: bool = True, jitter_s: int = 0) -> RedisStore:
        """A store on the server or cluster `url` names (sitsmesh.redisclients)."""
        # No retries: a retry would multiply the time a request waits on a sick
        # Redis; the caller's error policy answers instead. RESP2: under RESP3,
        # redis-py 8 turns on maintenance notifications and then skips its check
        # for pooled connections the server closed, so after a Redis restart
        # every idle pooled connection would fail one request.
        client = redisclients.connect(url, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0), protocol=2)
        return cls(client, prefix=prefix, timeout_s=timeout_s, count_rejected=count_rejected,
                   jitter_s=jitter_s)

    def _call(self, hit: Hit, now: float) -> Call | None:
        window = hit.window_s
        if hit.algorithm is Algorithm.GCRA:
            if hit.limit <= 0:
                return None
            return _GCRA, (f"{self._tag_open}{hit.key}}}", now, window / hit.limit,
                           hit.addend, window)
        start = now - now % window
        base = f"{self._tag_open}{hit.key}}}:"
        # Spread, not secrecy: a plain PRNG is right here.
        jitter = random.randrange(self._jitter_s) if self._jitter_s else 0  # noqa: S311
        if hit.algorithm is Algorithm.FIXED_WINDOW:
            return _FIXED, (f"{base}{int(start)}", hit.addend,
                            _ttl_ms(start + window + jitter - now),
                            -1 if self._count_rejected else hit.limit)
        weight = 1.0 - (now - start) / window
        return _SLIDING, (f"{base}{int(start)}", f"{base}{int(start - window)}", hit.addend,
                          hit.limit, weight, _ttl_ms(start + 2 * window + jitter - now))

    @property
    def sharded(self) -> bool:
        """On a Redis Cluster: a failure belongs to one master (see shard_of)."""
        return not isinstance(self._client, Redis)

    def shard_of(self, hit: Hit) -> str:
        """The master that holds a hit's counters now, by name ('' when unknown)."""
        client = self._client
        if isinstance(client, Redis):
            return ""
        try:
            node = client.get_node_from_key(f"{self._tag_open}{hit.key}}}")
        except (RedisError, RedisClusterException):  # no slot table yet, or no master
            return ""
        return node.name if node is not None else ""

    async def hit(self, hits: Sequence[Hit], now: float) -> list[Count]:
        calls = [self._call(hit, now) for hit in hits]
        queued = [call for call in calls if call is not None]
        replies = await self._queue(queued) if queued else []
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        answers = iter(replies)
        return [_count(hit, now, None if call is None else next(answers))
                for hit, call in zip(hits, calls, strict=True)]

    async def hit_each(self, hits: Sequence[Hit], now: float) -> list[Count | Exception]:
        """As `hit`, with a failed hit's error in its place instead of raised: on a
        cluster, the hits on the other masters still count."""
        calls = [self._call(hit, now) for hit in hits]
        queued = [call for call in calls if call is not None]
        answers = iter(await self._queue(queued) if queued else [])
        out: list[Count | Exception] = []
        for hit, call in zip(hits, calls, strict=True):
            reply = None if call is None else next(answers)
            out.append(reply if isinstance(reply, Exception) else _count(hit, now, reply))
        return out

    async def _queue(self, queued: list[Call]) -> list[object]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[object]] = loop.create_future()
        self._pending.append((queued, future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._in_flight >= MAX_IN_FLIGHT or not self._pending:
            return  # a finishing batch flushes again
        batch, self._pending = self._pending, []
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._send(batch))
        _IN_FLIGHT.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        _IN_FLIGHT.discard(task)
        self._in_flight -= 1
        if self._pending and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def _send(self, batch: list[tuple[list[Call], asyncio.Future[list[object]]]]
                    ) -> None:
        queued = [call for calls, _ in batch for call in calls]
        try:
            # On a cluster each master's share has its own deadline (send_cluster):
            # one master that stalls must not time out the others' counters.
            async with asyncio.timeout(None if self.sharded else self._timeout_s):
                replies = await self._exchange(queued)
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception)
                                         else ConnectionError("redis call cancelled"))
            if not isinstance(exc, Exception):
                raise
            return
        start = 0
        for calls, future in batch:
            if not future.done():  # the caller may have given up
                future.set_result(replies[start:start + len(calls)])
            start += len(calls)

    async def _exchange(self, queued: list[Call]) -> list[object]:
        replies: list[object]
        if isinstance(self._client, Redis):
            replies = await send_single(self._client, queued)
        else:
            replies = await send_cluster(self._client, queued, self._timeout_s)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            await self._resend(queued, replies, missing)
        return replies

    async def _resend(self, queued: list[Call], replies: list[object],
                      missing: list[int]) -> None:
        # The server lost its script cache (restart, failover, SCRIPT FLUSH). A
        # NOSCRIPT reply ran nothing, so resending only those is safe; EVAL goes
        # to the key's own node and caches the script there for later EVALSHAs.
        pipe = self._client.pipeline(transaction=False)
        for i in missing:
            script, args = queued[i]
            pipe.eval(script.text, script.numkeys, *args)
        for i, reply in zip(missing, await pipe.execute(raise_on_error=False), strict=True):
            replies[i] = reply

    async def close(self) -> None:
        await self._client.aclose()


def _count(hit: Hit, now: float, reply: object) -> Count:
    if hit.algorithm is Algorithm.FIXED_WINDOW:
        return fixed_window(_int(reply), hit, now)[1]
    if hit.algorithm is Algorithm.SLIDING_WINDOW:
        if not isinstance(reply, list) or len(reply) != 2:
            raise TypeError(f"unexpected sliding window reply: {reply!r}")
        return sliding_window(_int(reply[0]), _int(reply[1]), hit, now)[1]
    tat = 0.0 if reply is None else float(_text(reply))
    return gcra(tat, hit, now)[1]


def _int(value: object) -> int:
    if isinstance(value, int):
        return value
    return int(_text(value))


def _text(value: object) -> str | bytes:
    if isinstance(value, str | bytes):
        return value
    raise TypeError(f"unexpected reply from redis: {value!r}")
