"""One leader among replicas: a Redis lease with a fencing token.

The holder renews the lease well inside its time to live; if it dies (or stalls
past the TTL) another replica takes the key and gets a higher token. Everything
the leader writes goes through `publish`, which Redis refuses when the writer's
token is no longer the newest: a stalled ex-leader that wakes up cannot
overwrite its successor's decision. Redis's own single-threaded scripts make the
check and the write one step.

On Redis Cluster the lease, its token counter and everything published under it
share one hash tag, so they live in one slot on one master and each script stays
one atomic step. A failover can lose the newest writes to that master (replication
is asynchronous), the token's INCR among them, so a token alone could repeat; a
write is therefore also refused unless the lease key still names the writer.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sitsmesh import logs

_log = logs.get("sitsmesh.shared.lease")
# Failover within a second: the lease lapses 0.6 s after its last renewal, and a
# follower tries every 0.2 s.
DEFAULT_TTL_MS = 600

# KEYS[1] lease, KEYS[2] token counter. ARGV: holder, ttl_ms. Returns the new token
# when the lease was free (0 when someone holds it, -1 when it is ours: renewed).
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return -1
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""

# KEYS[1] token counter, KEYS[2] value, KEYS[3] lease. ARGV: token, value, ttl_ms,
# holder. 1 when written.
_PUBLISH = """
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= tonumber(ARGV[1]) then return 0 end
if redis.call('GET', KEYS[3]) ~= ARGV[4] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""

# KEYS[1] lease. ARGV: holder. Frees the lease only if it is still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def holder_id() -> str:
    """This process, as the lease names it: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Lease:
    def __init__(self, client: Redis | RedisCluster, name: str, *, ttl_ms: int = DEFAULT_TTL_MS,
                 holder: str | None = None,
                 on_change: Callable[[bool], None] | None = None,
                 announce: bool = True) -> None:
        if "{" in name or "}" in name:
            raise ValueError(f"lease name must not contain braces: {name!r}")
        self._client = client
        self._tag = f"sitsmesh:{{{name}}}:"
        self._key = self.key("lease")
        self._tokens = self.key("lease:token")
        self._ttl_ms = ttl_ms
        self.holder = holder or holder_id()
        self._on_change = on_change
        self._announce = announce  # log taking and losing it (not for the many small ones)
        self.token = 0          # the fencing token while we lead, else 0
        self.terms = 0          # how many times this process became leader

    def key(self, suffix: str) -> str:
        """A key in the lease's hash slot: what `publish` may write."""
        return self._tag + suffix

    @property
    def leading(self) -> bool:
        return self.token > 0

    async def step(self) -> bool:
        """Take or renew the lease once; True while this process leads."""
        try:
            got = int(await self._client.eval(_ACQUIRE, 2, self._key, self._tokens,
                                              self.holder, self._ttl_ms))
        except Exception as exc:
            # Redis unreachable: a leader that cannot renew must assume it lost the
            # lease (another may take it once the TTL runs out).
            _log.warning("lease step failed", lease=self._key, error=str(exc))
            got = 0
        if got > 0:
            self.token = got
            self.terms += 1
            if self._announce:
                _log.info("leading", lease=self._key, holder=self.holder, token=got)
            if self._on_change is not None:
                self._on_change(True)
        elif got == 0 and self.token:
            self.token = 0
            if self._announce:
                _log.info("lost the lease", lease=self._key, holder=self.holder)
            if self._on_change is not None:
                self._on_change(False)
        return self.leading

    async def run(self) -> None:
        """Renew three times per TTL: a missed renewal or two still keeps the lease."""
        try:
            while True:
                await self.step()
                await asyncio.sleep(self._ttl_ms / 3000)
        finally:
            if self.token:
                await self.release()

    async def release(self) -> None:
        """Free the lease now if it is ours (else its TTL does)."""
        self.token = 0
        try:
            await self._client.eval(_RELEASE, 1, self._key, self.holder)
        except Exception as exc:  # the TTL frees it anyway
            _log.debug("lease release failed", error=str(exc))

    async def publish(self, key: str, value: str | bytes, ttl_ms: int) -> bool:
        """Write `value` only while our token is the newest and the lease is ours
        (fencing). `key` comes from `key()`: one slot with the lease."""
        if not self._may_publish(key):
            return False
        return bool(await self._client.eval(_PUBLISH, 3, self._tokens, key, self._key,
                                            self.token, value, ttl_ms, self.holder))

    def publish_on(self, pipe: Any, key: str, value: str | bytes, ttl_ms: int) -> bool:
        """As `publish`, queued on a pipeline the caller executes (its reply 1 when
        written); False, and nothing queued, while this process does not hold it."""
        if not self._may_publish(key):
            return False
        pipe.eval(_PUBLISH, 3, self._tokens, key, self._key, self.token, value, ttl_ms,
                  self.holder)
        return True

    def _may_publish(self, key: str) -> bool:
        if not key.startswith(self._tag):
            raise ValueError(f"{key!r} is outside the lease's slot {self._tag!r}")
        return bool(self.token)
