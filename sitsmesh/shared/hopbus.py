"""Hold releases, stage completions and the replicas' reports, shared by every replica
and worker through one broadcast Redis stream.

Envoy sends a request's Check to one sitsmesh process and the access-log entries
of its hops (over one long-lived stream per Envoy) to whichever process that
stream reached, and stage reports come through any replica's admin API. So every
process publishes what every other one needs, and every process reads the whole
stream back and applies it, its own entries included: it frees the admission holds
it owns, whichever process the access-log entry reached, and feeds its controller.
The hops themselves go to their partition's owner (sitsmesh.shared.partbus, which
extends this bus); a hop on this stream (a replica from before partitions) is
assembled by every reader.

Publishing only appends to a list; a background task sends the batch with one
XADD per event-loop turn, and a reader task applies entries in stream order.
When Redis fails, a batch is applied here instead (this process's own chains
and holds stay right) and counted; nothing blocks the request path.

A release is the one event every reader decodes for every access-log entry of the
fleet, so, with `quiet_s` set, it is sent only while some process holds requests:
one that told the fleet, within `quiet_s` (the hold timeout, the longest a hold
lives), that it admitted one (`holds_seen`). Otherwise releases wait in a bounded
ring, and the first such report sends them: a hold whose request ended before its
report came still ends by its entry.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sitsmesh import logs
from sitsmesh.chains.assembler import Hop
from sitsmesh.chains.trace import valid_trace_id
from sitsmesh.tasks import run_together

DEFAULT_KEY = "sitsmesh:bus:hops"
# Entries the stream keeps (approximately): minutes of hops at thousands a second, so a
# reader that lost its connection for a moment resumes where it was.
STREAM_LENGTH = 200_000
MAX_PENDING = 50_000      # events buffered while Redis is slow; past it, applied here
HIGH_WATER = 20_000       # past it, access-log streams wait (gRPC flow control to Envoy)
MAX_BATCH = 1_000         # events in one stream entry
READ_COUNT = 200
READ_BLOCK_MS = 500
RETRY_S = 0.2
# Releases kept while no process holds requests, for the holds taken just before a
# report of them came: the last UNSENT_S, at most MAX_UNSENT (a second or more at tens of
# thousands of entries a second). A hold whose release was dropped waits for its timeout.
UNSENT_S = 5.0
MAX_UNSENT = 32_768
_log = logs.get("sitsmesh.shared.hopbus")

_Event = list[Any]


def encode_hop(hop: Hop) -> _Event:
    event = ["h", hop.request_id, hop.start, hop.duration, hop.ttfb, hop.queue,
             hop.upstream_cluster, hop.route_name, hop.stage_header, hop.pipeline, hop.stage,
             hop.failed]
    if hop.trace_id:  # only then: a replica not yet upgraded reads the other hops as before
        event.append(hop.trace_id)
    return event


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def _optional(value: Any) -> float | None:
    return None if value is None else _number(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"not a string: {value!r}")
    return value


def decode(event: Any) -> Hop | tuple[str, float | None]:
    """A hop, or a release (request id, wall-clock end); ValueError when malformed. The
    stream is as trusted as Redis, but a bad entry must cost one entry, not the reader."""
    if not isinstance(event, list) or not event:
        raise ValueError("an event is a non-empty list")
    if event[0] == "r" and len(event) == 3:
        return _text(event[1]), _optional(event[2])
    # 13 fields when the hop has a trace id, else 12 (as before trace ids).
    if event[0] == "h" and len(event) in (12, 13):
        if not isinstance(event[11], bool):
            raise ValueError("failed must be a boolean")
        trace = _text(event[12]) if len(event) == 13 else ""
        if trace and not valid_trace_id(trace):
            raise ValueError("trace_id must be 32 hex digits")
        return Hop(_text(event[1]), _number(event[2]), _number(event[3]),
                   ttfb=_optional(event[4]), queue=_optional(event[5]),
                   upstream_cluster=_text(event[6]), route_name=_text(event[7]),
                   stage_header=_text(event[8]), pipeline=_text(event[9]),
                   stage=_text(event[10]), failed=event[11], trace_id=trace)
    raise ValueError(f"unknown event {str(event[0])[:20]!r}")


class HopBus:
    """Stands where the assembler and the hold release stood: `add` and `release`."""

    def __init__(self, client: Redis | RedisCluster, *, deliver: Callable[[Hop], None],
                 release: Callable[[str, float | None], bool], key: str = DEFAULT_KEY,
                 quiet_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._deliver = deliver
        self._release = release
        self._key = key
        self._pending: list[_Event] = []
        # Other kinds of event the bus carries (a replica's pressure report), by kind.
        self._handlers: dict[str, Callable[[list[Any]], None]] = {}
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._quiet_s = quiet_s  # None: every release is sent
        self._clock = clock
        self._holds_until = -math.inf  # releases go out until then (monotonic)
        self._unsent: deque[tuple[float, str, float | None]] = deque(maxlen=MAX_UNSENT)
        self.kept = 0          # releases kept back: no process held requests
        self.published = 0
        self.applied = 0
        self.fallbacks = 0     # events applied here because Redis did not take them
        self.overflowed = 0    # events applied here because the buffer was full
        self.malformed = 0
        self.failed = 0        # events whose handler raised something else (a fault here)

    # --- the ingestion path: no I/O -----------------------------------------

    def add(self, hop: Hop) -> None:
        self._push(encode_hop(hop))

    def release(self, request_id: str, ended_wall: float | None) -> bool:
        if self._quiet_s is not None and (now := self._clock()) >= self._holds_until:
            self._unsent.append((now, request_id, ended_wall))
            self.kept += 1
            return True
        self._push(["r", request_id, ended_wall])
        return True

    def holds_seen(self) -> None:
        """A process admitted a request it holds (this one included): send releases for
        the next `quiet_s`, and the ones kept since the fleet went quiet."""
        if self._quiet_s is None:
            return
        now = self._clock()
        if now >= self._holds_until:
            unsent, self._unsent = self._unsent, deque(maxlen=MAX_UNSENT)
            for at, request_id, ended_wall in unsent:
                if now - at <= UNSENT_S:
                    self._push(["r", request_id, ended_wall])
        self._holds_until = now + self._quiet_s

    @property
    def client(self) -> Redis | RedisCluster:
        return self._client

    def on(self, kind: str, handler: Callable[[list[Any]], None]) -> None:
        """Events `[kind, ...]` go to `handler` (ValueError: malformed, skipped)."""
        self._handlers[kind] = handler

    def publish(self, event: _Event) -> None:
        self._push(event)

    def _push(self, event: _Event) -> None:
        pending = self._pending
        if len(pending) >= MAX_PENDING:
            # Never lost: applied here, as when Redis is down (this process's own chains
            # and holds stay right), and counted.
            self.overflowed += 1
            self._apply([event])
            return
        pending.append(event)
        self._wake.set()

    async def room(self) -> None:
        """Wait while the publisher is behind: a stream that calls this between messages
        slows its sender (Envoy) through gRPC flow control instead of growing the buffer."""
        while self.queued() > HIGH_WATER:
            self._drained.clear()
            await self._drained.wait()

    def queued(self) -> int:
        """Events waiting to be published."""
        return len(self._pending)

    def pending_events(self) -> list[_Event]:
        """The events waiting to be published, oldest first."""
        return list(self._pending)

    def caught_up(self) -> None:
        """Let paced streams go on once the publisher is back under the high water."""
        if self.queued() <= HIGH_WATER:
            self._drained.set()

    # --- background ------------------------------------------------------------

    async def run(self) -> None:
        """Publish and read until cancelled."""
        # Not gather: one part failing must not leave the other running (sitsmesh.tasks).
        await run_together(self._publish_forever(), self._read_forever())

    async def _publish_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = self._pending[:MAX_BATCH]
                del self._pending[:MAX_BATCH]
                body = json.dumps(batch)
                try:
                    await self._client.xadd(self._key, {"b": body},
                                            maxlen=STREAM_LENGTH, approximate=True)
                    self.published += len(batch)
                    self.caught_up()
                except Exception as exc:  # Redis down or slow: keep this process right
                    self.fallbacks += len(batch)
                    _log.warning("hop bus publish failed; applying here only",
                                 events=len(batch), error=str(exc))
                    self._apply(batch)
                    self._drained.set()

    async def _read_forever(self) -> None:
        last = "$"
        while True:
            try:
                if last == "$":
                    # Start after what the stream holds now, and remember where, so a
                    # reconnect resumes there rather than at the new end.
                    newest = await self._client.xrevrange(self._key, count=1)
                    last = _id(newest[0][0]) if newest else "0-0"
                replies: Any = await self._client.xread({self._key: last}, count=READ_COUNT,
                                                        block=READ_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                _log.warning("hop bus read failed; retrying", error=str(exc))
                await asyncio.sleep(RETRY_S)
                continue
            for _, entries in replies or ():
                for entry_id, fields in entries:
                    last = _id(entry_id)
                    self._apply_raw(fields)

    def apply_raw(self, fields: Any) -> None:
        """A stream entry's batch of events, applied."""
        self._apply_raw(fields)

    def _apply_raw(self, fields: Any) -> None:
        try:
            batch = json.loads(fields.get(b"b", fields.get("b")))
            if not isinstance(batch, list):
                raise ValueError("a batch is a list")
        except (AttributeError, TypeError, ValueError):
            self.malformed += 1
            return
        self._apply(batch)

    def _apply(self, batch: list[Any]) -> None:
        for event in batch:
            handler = (self._handlers.get(event[0])
                       if isinstance(event, list) and event and isinstance(event[0], str)
                       else None)
            try:
                if handler is not None:
                    handler(event)
                    continue
                found = decode(event)
                if isinstance(found, Hop):
                    self._deliver(found)
                else:
                    self._release(*found)
            except (ValueError, TypeError, KeyError, IndexError):
                self.malformed += 1
                continue
            except Exception as exc:
                # A fault behind a handler costs this event, not the reader: a reader
                # that died assembled nothing more on this replica until it restarted.
                self._failed(exc)
                continue
            self.applied += 1

    def _failed(self, exc: Exception) -> None:
        self.failed += 1
        if not self.failed & (self.failed - 1):  # the 1st, 2nd, 4th, 8th...: no flood
            _log.error("hop bus event failed; skipped", failed=self.failed, error=repr(exc))


def _id(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
