"""Counter scripts on the wire: batches of EVALSHA packed by hand, sent to one Redis or
to one master of a Redis Cluster on one of its connections.

redis-py's command packing and its cluster pipeline cost more CPU than the round trip
they drive (bench/redis_batch_cost.py: a one-hit batch took 115 µs through the cluster
pipeline against 65 µs on one server). These commands have a fixed shape, so they
are packed here and written to each master's connection directly; redis-py still
parses the replies (hiredis) and still handles everything about topology: a reply
that says the slot moved, and a master that cannot be reached, go back through its
cluster pipeline, which follows redirects and reloads the slot table.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

# Replies that mean the slot table is stale or the slot is busy moving: nothing ran.
_ELSEWHERE = (MovedError, AskError, ClusterDownError, TryAgainError)


@dataclass(frozen=True, slots=True)
class Script:
    text: str
    sha: str
    numkeys: int
    # "*<argc>\r\n$7\r\nEVALSHA\r\n$40\r\n<sha>\r\n$n\r\n<numkeys>\r\n", argc left open.
    head: bytes


def script(text: str, numkeys: int) -> Script:
    sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
    keys = b"%d" % numkeys
    head = (b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n" + sha.encode()
            + b"\r\n$%d\r\n" % len(keys) + keys + b"\r\n")
    return Script(text, sha, numkeys, head)


Call = tuple[Script, tuple[str | int | float, ...]]


def _encode(arg: str | int | float) -> bytes:
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int):
        return b"%d" % arg
    return repr(arg).encode()  # shortest exact form, as redis-py writes floats


def pack(calls: Sequence[Call]) -> bytes:
    """RESP for a batch of EVALSHA commands (redis-py's pack_command costs ~30 µs a
    command in pure Python, more than the round trip itself)."""
    out: list[bytes] = []
    for found, args in calls:
        out.append(found.head % (len(args) + 3))
        for arg in args:
            raw = _encode(arg)
            out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


async def _exchange(conn: Connection, calls: Sequence[Call]) -> list[object]:
    await conn.send_packed_command(pack(calls))
    replies: list[object] = []
    for _ in calls:
        try:
            replies.append(await conn.read_response())
        except ResponseError as exc:  # NOSCRIPT, MOVED and script errors, per command
            replies.append(exc)
    return replies


async def send_single(client: Redis, calls: Sequence[Call]) -> list[object]:
    pool = client.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        return await _exchange(conn, calls)
    except BaseException:
        # Replies may still be on the wire: never hand this socket to another caller.
        await conn.disconnect()
        raise
    finally:
        await pool.release(conn)


class _NotSent(Exception):
    """The master could not be reached: nothing was written, so a resend is safe."""


async def _write_node(node: ClusterNode, calls: Sequence[Call]) -> list[object]:
    try:
        conn = node.acquire_connection()
    except (RedisError, RedisClusterException) as exc:  # its pool is spent
        raise _NotSent from exc
    if not conn.is_connected:
        try:
            await conn.connect()  # type: ignore[no-untyped-call]
        except (RedisError, OSError) as exc:
            node.release(conn)
            raise _NotSent from exc
    try:
        return await _exchange(conn, calls)
    except BaseException:
        await conn.disconnect()
        raise
    finally:
        node.release(conn)


async def _send_pipeline(client: RedisCluster, calls: Sequence[Call]) -> list[object]:
    pipe = client.pipeline(transaction=False)
    for found, args in calls:
        pipe.evalsha(found.sha, found.numkeys, *args)
    replies: list[object] = await pipe.execute(raise_on_error=False)
    return replies


def node_of(client: RedisCluster, key: str | int | float) -> ClusterNode | None:
    """The master that serves `key` by the client's slot table; None when it cannot say
    (no table yet, slot not covered): the pipeline then finds out, or says why not."""
    try:
        return client.get_node_from_key(str(key))
    except (RedisError, RedisClusterException):
        return None


async def send_node(client: RedisCluster, node: ClusterNode | None, calls: Sequence[Call],
                    timeout_s: float) -> list[object]:
    """Calls whose keys `node` serves (None: unknown, through redis-py's pipeline), with
    a deadline of their own. Never raises an Exception: a failure is every call's reply,
    so a master that fails or stalls costs only its own counters."""
    try:
        async with asyncio.timeout(timeout_s):
            try:
                got = (await _write_node(node, calls) if node is not None
                       else await _send_pipeline(client, calls))
            except _NotSent:
                got = await _send_pipeline(client, calls)
            moved = [k for k, reply in enumerate(got) if isinstance(reply, _ELSEWHERE)]
            if moved:
                again = await _send_pipeline(client, [calls[k] for k in moved])
                for k, reply in zip(moved, again, strict=True):
                    got[k] = reply
    except Exception as exc:
        got = [exc] * len(calls)
    return got
