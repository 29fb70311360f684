"""Budget ledger on Redis or Redis Cluster: every replica spends from the same counters.

Reserve is one EVALSHA over all of a request's window keys: they share the tenant's
hash tag (see TokenBudget.counters), so one cluster slot holds them and the script's
check-then-add is atomic; two replicas can never both spend the last tokens. The
script returns each count as read, and `counting.spent` figures the answer as
MemoryLedger does. Window starts are computed in Python from the caller's `now` and
expiry is relative to it (as in ratelimit/redis_store.py): the caller's clock need not
agree with the server's.

The reservation record is its own key, `<prefix>res:{<request id>}`. On one Redis
server, reserve (check, charge, write the record) and settle (claim the record, adjust
its windows) are one script each: one round trip apiece, measured to halve what a
reservation adds to Check (bench/token_budgets.py). On Redis Cluster the record sits in
the request's slot, not the tenant's, and no script or MULTI may touch two slots, so
each takes two round trips there. Order keeps a failure on the safe side: reserve
charges first and then writes the record, so a failure in between leaves the
estimate charged (as a lost end would be), never a record for tokens not charged;
settle claims the record with GETDEL first, so of two settles only one adjusts (and a
failure after the claim leaves the estimate charged).

A record lives `RECORD_GRACE_S` past its hold: were it to vanish at the hold, the
reserving process's expire() would find nothing to count. Until expire() forgets it,
a settle past the hold still charges what was produced, as MemoryLedger's does.

Errors (redis.exceptions.ConnectionError and the rest) are raised, never absorbed:
the caller decides to fail open or closed.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError

from sitsmesh import redisclients
from sitsmesh.budgets.counting import check_amount, spent, window_start
from sitsmesh.budgets.ledger import AlreadyReserved, Spent
from sitsmesh.budgets.model import Counter

DEFAULT_PREFIX = "sitsmesh:tb:"
# Window keys outlive their window by this much: a replica whose clock runs behind
# still finds the window it is in, and a late settle still finds the window it
# corrects.
WINDOW_SLACK_S = 60
# A record outlives its hold by this much, so the reserving process's expire() can
# still claim and count it; a record whose process died leaves with its TTL.
RECORD_GRACE_S = 300.0
DEFAULT_MAX_TRACKED = 1_000_000

# KEYS: the windows. ARGV[1] amount, then limit and ttl_ms of each key. Returns the
# counts as read; adds `amount` to every key only when each has room for it.
_RESERVE_LUA = """
local amount = tonumber(ARGV[1])
local used = {}
local fits = true
for i, key in ipairs(KEYS) do
  used[i] = tonumber(redis.call('GET', key) or '0')
  if used[i] + amount > tonumber(ARGV[2 * i]) then fits = false end
end
if fits and amount > 0 then
  for i, key in ipairs(KEYS) do
    redis.call('INCRBY', key, amount)
    redis.call('PEXPIRE', key, ARGV[2 * i + 1])
  end
end
return used
"""

# KEYS: the windows a reservation was made in. ARGV[1] the delta. A window that has
# expired is read by nobody and is not recreated; INCRBY keeps a key's TTL.
_ADJUST_LUA = """
local delta = tonumber(ARGV[1])
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    local after = redis.call('INCRBY', key, delta)
    if after < 0 then redis.call('INCRBY', key, -after) end
  end
end
return 0
"""


# One server: reserve in one script. KEYS: the windows, then the record. ARGV[1] amount,
# then limit and ttl_ms of each window, then the record and its ttl_ms. Returns the
# counts as read, then 1 (reserved), 0 (no room) or -1 (the id holds a reservation).
_RESERVE_ONE_LUA = """
local n = #KEYS - 1
local amount = tonumber(ARGV[1])
local used = {}
local fits = true
for i = 1, n do
  used[i] = tonumber(redis.call('GET', KEYS[i]) or '0')
  if used[i] + amount > tonumber(ARGV[2 * i]) then fits = false end
end
if not fits then
  used[n + 1] = 0
  return used
end
if not redis.call('SET', KEYS[n + 1], ARGV[2 * n + 2], 'NX', 'PX', ARGV[2 * n + 3]) then
  used[n + 1] = -1
  return used
end
if amount > 0 then
  for i = 1, n do
    redis.call('INCRBY', KEYS[i], amount)
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i + 1])
  end
end
used[n + 1] = 1
return used
"""

# One server: settle in one script. KEYS[1] the record; ARGV[1] the actual cost. Claims
# the record and adjusts the windows it names (standalone Redis lets a script reach
# keys it was not given; only a cluster needs them declared). -1: no record.
_SETTLE_ONE_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return -1 end
redis.call('DEL', KEYS[1])
local record = cjson.decode(raw)
local amount = tonumber(record[1])
local delta = tonumber(ARGV[1]) - amount
if delta ~= 0 then
  for _, key in ipairs(record[2]) do
    if redis.call('EXISTS', key) == 1 then
      local after = redis.call('INCRBY', key, delta)
      if after < 0 then redis.call('INCRBY', key, -after) end
    end
  end
end
return amount
"""


class _Script:
    __slots__ = ("sha", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


_RESERVE = _Script(_RESERVE_LUA)
_ADJUST = _Script(_ADJUST_LUA)
_RESERVE_ONE = _Script(_RESERVE_ONE_LUA)
_SETTLE_ONE = _Script(_SETTLE_ONE_LUA)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


class RedisLedger:
    """A BudgetLedger on Redis or Redis Cluster, shared by every replica.

    `expire` counts only this process's lost ends: it keeps the ids and deadlines of
    the reservations it made (at most `max_tracked`; past that the oldest are no
    longer tracked, which costs only their count, their records expire by TTL).
    """

    __slots__ = ("_client", "_deadlines", "_max_tracked", "_one_trip", "_prefix",
                 "_record_grace_s", "_tracked", "untracked")

    name = "redis"

    def __init__(self, client: Redis | RedisCluster, *, prefix: str = DEFAULT_PREFIX,
                 max_tracked: int = DEFAULT_MAX_TRACKED,
                 record_grace_s: float = RECORD_GRACE_S) -> None:
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would become the hash tag and split a tenant's
            # counters across slots.
            raise ValueError(f"redis key prefix must not contain braces: {prefix!r}")
        self._client = client
        # One server: each call is one script; a cluster splits what touches two slots.
        self._one_trip = not isinstance(client, RedisCluster)
        self._prefix = prefix
        self._max_tracked = max_tracked
        self._record_grace_s = record_grace_s
        # request id -> deadline, and (deadline, request id) in deadline order.
        self._tracked: dict[str, float] = {}
        self._deadlines: list[tuple[float, str]] = []
        self.untracked = 0

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = 0.05) -> RedisLedger:
        # As RedisStore.from_url: no retries (the caller's error policy answers), and
        # RESP2 so pooled connections a restarted server closed are noticed.
        client = redisclients.connect(url, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0), protocol=2)
        return cls(client, prefix=prefix)

    def record_key(self, request_id: str) -> str:
        return f"{self._prefix}res:{{{request_id}}}"

    def window_key(self, counter: Counter, now: float) -> str:
        return f"{self._prefix}{counter.key}:{window_start(now, counter.window_s)}"

    async def _run(self, script: _Script, keys: Sequence[str],
                   args: Sequence[int | str]) -> object:
        try:
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            # The server lost its script cache (restart, failover, SCRIPT FLUSH): a
            # NOSCRIPT ran nothing, so running the text is safe, and caches it again.
            return await self._client.eval(script.text, len(keys), *keys, *args)

    async def reserve(self, request_id: str, counters: Sequence[Counter], amount: int,
                      now: float, hold_s: float) -> Spent:
        check_amount("amount", amount)
        if not counters:
            raise ValueError("a reservation needs at least one counter")
        keys = [self.window_key(c, now) for c in counters]
        args = [amount]
        for counter in counters:
            end = window_start(now, counter.window_s) + counter.window_s
            args += [counter.limit, _ms(end - now + WINDOW_SLACK_S)]
        record = json.dumps([amount, keys], separators=(",", ":"))
        if self._one_trip:
            return await self._reserve_one(request_id, counters, keys, args=args,
                                           record=record, when=(amount, now, hold_s))
        reply = await self._run(_RESERVE, keys, args)
        if not isinstance(reply, list) or len(reply) != len(keys):
            raise TypeError(f"unexpected reserve reply from redis: {reply!r}")
        answer = spent(counters, [int(v) for v in reply], amount, now)
        if not answer.ok:
            return answer
        # A failure here leaves the estimate charged and the record maybe written
        # (its TTL removes it): no request id is tracked that may not be held.
        created = await self._client.set(self.record_key(request_id), record, nx=True,
                                         px=_ms(hold_s + self._record_grace_s))
        if not created:
            # Another process holds this id: undo this charge; the counters were
            # over by it only for this round trip.
            await self._run(_ADJUST, keys, [-amount])
            raise AlreadyReserved(f"request {request_id!r} already holds a reservation")
        self._track(request_id, now + hold_s)
        return answer

    async def _reserve_one(self, request_id: str, counters: Sequence[Counter],
                           keys: list[str], *, args: list[int], record: str,
                           when: tuple[int, float, float]) -> Spent:
        amount, now, hold_s = when
        reply = await self._run(
            _RESERVE_ONE, [*keys, self.record_key(request_id)],
            [*args, record, _ms(hold_s + self._record_grace_s)])
        if not isinstance(reply, list) or len(reply) != len(keys) + 1:
            raise TypeError(f"unexpected reserve reply from redis: {reply!r}")
        status = int(reply[-1])
        if status < 0:
            raise AlreadyReserved(f"request {request_id!r} already holds a reservation")
        answer = spent(counters, [int(v) for v in reply[:-1]], amount, now)
        if status:
            self._track(request_id, now + hold_s)
        return answer

    def _track(self, request_id: str, deadline: float) -> None:
        tracked = self._tracked
        while len(tracked) >= self._max_tracked:
            del tracked[next(iter(tracked))]
            self.untracked += 1
        tracked[request_id] = deadline
        heapq.heappush(self._deadlines, (deadline, request_id))
        if len(self._deadlines) > 2 * len(tracked) + 1024:
            # Settled ones leave their deadline behind; rebuilt now and then so the
            # heap stays within twice the reservations tracked.
            self._deadlines = [(d, rid) for rid, d in tracked.items()]
            heapq.heapify(self._deadlines)

    async def settle(self, request_id: str, actual: int, now: float) -> int | None:
        check_amount("actual", actual)
        if self._one_trip:
            reply = await self._run(_SETTLE_ONE, [self.record_key(request_id)], [actual])
            self._tracked.pop(request_id, None)
            return None if int(reply) < 0 else int(reply)  # type: ignore[call-overload]
        raw = await self._client.getdel(self.record_key(request_id))
        self._tracked.pop(request_id, None)
        if raw is None:
            return None
        amount, keys = json.loads(raw)
        if actual != amount:
            await self._run(_ADJUST, keys, [actual - amount])
        return int(amount)

    async def usage(self, counters: Sequence[Counter], now: float) -> list[int]:
        if not counters:
            return []
        # One MGET: the keys share one slot.
        values = await self._client.mget([self.window_key(c, now) for c in counters])
        return [int(v) if v is not None else 0 for v in values]

    async def expire(self, now: float) -> int:
        due: list[tuple[float, str]] = []
        deadlines, tracked = self._deadlines, self._tracked
        while deadlines and deadlines[0][0] < now:
            entry = heapq.heappop(deadlines)
            if tracked.get(entry[1]) == entry[0]:
                due.append(entry)
        if not due:
            return 0
        # Records are in their own slots: a pipeline, which a cluster client splits
        # by node. Settled ones are gone already; what is left was never settled.
        pipe = self._client.pipeline(transaction=False)
        for _, request_id in due:
            pipe.getdel(self.record_key(request_id))
        try:
            replies = await pipe.execute()
        except BaseException:
            for entry in due:  # counted by the next expire() instead
                heapq.heappush(deadlines, entry)
            raise
        for _, request_id in due:
            tracked.pop(request_id, None)  # a settle may have come meanwhile
        return sum(1 for raw in replies if raw is not None)

    async def close(self) -> None:
        await self._client.aclose()
