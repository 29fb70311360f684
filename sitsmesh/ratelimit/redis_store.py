"""Redis counter store: every counter of one request in one pipelined round trip (on a
Redis Cluster, one per master the request's counters live on).

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
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError

from sitsmesh import redisclients
from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.rediswire import Call, node_of, script, send_node, send_single
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
# Per master of a cluster: one batch out at a time makes each master's batches larger
# (fewer writes, reads and tasks a request) and measured faster than two (bench/RESULTS.md
# issue 31, per-master batching); a cluster still has one batch out per master.
MAX_IN_FLIGHT_PER_MASTER = 1

Send = Callable[[list[Call]], Awaitable[list[object]]]


class Batcher:
    """Calls queued in one event-loop turn go out as one batch through `send`: one round
    trip (one send/recv pair) for all of them instead of one each.

    While `limit` batches are on the wire, new calls wait for the next batch:
    under load batches grow with the arrival rate; when idle a call goes out at once,
    so batching adds no latency. A failed batch is every one of its callers' error.
    """

    __slots__ = ("_in_flight", "_limit", "_pending", "_scheduled", "_send")

    def __init__(self, send: Send, limit: int = MAX_IN_FLIGHT) -> None:
        self._send = send
        self._limit = limit
        self._pending: list[tuple[list[Call], asyncio.Future[list[object]]]] = []
        self._scheduled = False
        self._in_flight = 0

    def queue(self, calls: list[Call]) -> asyncio.Future[list[object]]:
        """A future of `calls`' replies, in order."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[object]] = loop.create_future()
        self._pending.append((calls, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._scheduled = False
        if self._in_flight >= self._limit or not self._pending:
            return  # a finishing batch flushes again
        batch, self._pending = self._pending, []
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._run(batch))
        _IN_FLIGHT.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        _IN_FLIGHT.discard(task)
        self._in_flight -= 1
        if self._pending and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def _run(self, batch: list[tuple[list[Call], asyncio.Future[list[object]]]]
                   ) -> None:
        queued = batch[0][0] if len(batch) == 1 else [
            call for calls, _ in batch for call in calls]
        try:
            replies = await self._send(queued)
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


class RedisStore:
    """A CounterStore on Redis or Redis Cluster. Errors are raised, never absorbed.

    Keys are `<prefix>{<hit.key>}:<window start>` (GCRA: `<prefix>{<hit.key>}`):
    the hash tag puts every key of one counter in one cluster slot.
    """

    __slots__ = ("_client", "_cluster", "_count_rejected", "_jitter_s", "_masters",
                 "_single", "_tag_open", "_timeout_s")

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
        # On a cluster each master batches on its own (by name, "" for keys whose master
        # is unknown): its batches fill with its own calls, go out when it is free, and
        # one that stalls holds up no other master's calls.
        self._cluster = None if isinstance(client, Redis) else client
        self._single = Batcher(self._send_single) if self._cluster is None else None
        self._masters: dict[str, Batcher] = {}

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
        return self._cluster is not None

    def shard_of(self, hit: Hit) -> str:
        """The master that holds a hit's counters now, by name ('' when unknown)."""
        if self._cluster is None:
            return ""
        node = node_of(self._cluster, f"{self._tag_open}{hit.key}}}")
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
        cluster = self._cluster
        if cluster is None:
            assert self._single is not None
            return await self._single.queue(queued)
        if len(queued) == 1:  # the usual request: one counter, one master
            master = self._master(node_of(cluster, queued[0][1][0]))
        else:
            groups: dict[ClusterNode | None, list[int]] = {}
            for i, (_, args) in enumerate(queued):  # KEYS[1]: the counter's slot
                groups.setdefault(node_of(cluster, args[0]), []).append(i)
            if len(groups) > 1:
                return await self._queue_parts(queued, groups)
            master = self._master(next(iter(groups)))
        try:
            return await master.queue(queued)
        except Exception as exc:  # that master's batch failed: each call's reply
            return [exc] * len(queued)

    async def _queue_parts(self, queued: list[Call],
                           groups: dict[ClusterNode | None, list[int]]) -> list[object]:
        parts = [(indices, self._master(node).queue([queued[i] for i in indices]))
                 for node, indices in groups.items()]
        replies: list[object] = [None] * len(queued)
        try:
            for indices, future in parts:
                try:
                    got = await future
                except Exception as exc:  # that master's batch failed: its calls only
                    got = [exc] * len(indices)
                for i, reply in zip(indices, got, strict=True):
                    replies[i] = reply
        except BaseException:  # cancelled: the other parts are nobody's now
            for _, future in parts:
                if not future.cancel() and not future.cancelled():
                    future.exception()  # retrieved, so asyncio logs nothing
            raise
        return replies

    def _master(self, node: ClusterNode | None) -> Batcher:
        name = "" if node is None else node.name
        batcher = self._masters.get(name)
        if batcher is None:
            batcher = self._masters[name] = Batcher(partial(self._send_master, name),
                                                    MAX_IN_FLIGHT_PER_MASTER)
        return batcher

    async def _send_single(self, calls: list[Call]) -> list[object]:
        assert isinstance(self._client, Redis)
        async with asyncio.timeout(self._timeout_s):
            replies = await send_single(self._client, calls)
            missing = _noscript(replies)
            if missing:
                await self._reload(calls, replies, missing)
        return replies

    async def _send_master(self, name: str, calls: list[Call]) -> list[object]:
        cluster = self._cluster
        assert cluster is not None
        await cluster.initialize()  # the slot table, once; a refresh an error asked for
        # By name at send time: after a failover the name may be gone (None: the
        # pipeline finds the new master) or be a replica (MOVED: the same).
        node = cluster.get_node(node_name=name) if name else None
        replies = await send_node(cluster, node, calls, self._timeout_s)
        missing = _noscript(replies)
        if missing:
            await self._reload(calls, replies, missing)
        return replies

    async def _reload(self, queued: list[Call], replies: list[object],
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


def _noscript(replies: list[object]) -> list[int]:
    return [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]


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
