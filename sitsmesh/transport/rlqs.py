"""envoy.service.rate_limit_quota.v3.RateLimitQuotaService: Envoy's rate_limit_quota
filter reports usage per bucket; sitsmesh answers, and pushes, quota assignments.

Each stream gets an outbox: the report reader and the refresh both put updates in
it and one writer sends them, since a gRPC call takes one write at a time. Updates
waiting for the writer are merged by bucket (the newest wins), so a stream holds at
most one pending update per bucket, however often the refresh pushes. A caller that
reads nothing leaves the writer inside `context.write` for good (HTTP/2 flow
control): the stream is ended once MAX_QUEUED reports came in during one write, or a
write has waited WRITE_S, so its reader stops and its buckets are freed. Its status
reaches the caller only if it reads again (the data queued before it comes first).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from envoy.type.v3 import ratelimit_strategy_pb2, token_bucket_pb2
from google.protobuf import duration_pb2, wrappers_pb2
from google.protobuf.message import DecodeError
from grpc import aio

from sitsmesh import logs
from sitsmesh.errors import FailedPreconditionError, InvalidArgumentError
from sitsmesh.quota.buckets import Kind
from sitsmesh.quota.service import Assignment, QuotaService, Update
from sitsmesh.transport.errors import abort
from sitsmesh.transport.streams import OpenStreams
from sitsmesh.turns import Turns

SERVICE_NAME = rlqs_pb2.DESCRIPTOR.services_by_name["RateLimitQuotaService"].full_name
REFRESH_S = 0.05
MAX_QUEUED = 64  # reports answered while one write waits; past it the stream is ended
WRITE_S = 30.0   # a reply not taken this long: the caller is not reading
# Buckets taken from a report, or put in a reply, between two yields to the loop: a
# report of 1 000 buckets costs ~8 ms of Python, and Check shares the loop (100 a
# slice put 1-2 ms slices in front of Checks; 25, ~0.3 ms).
CHUNK = 25
MAX_REPLY = 200  # updates in one reply; the rest follow in the next
MAX_ENCODED = 2_000  # encoded ids kept per stream (its buckets, and some left behind)
# Buckets held across streams grown by this much since the last gc.freeze(): freeze
# again. The collector's full passes walk every object of the process: as 100
# streams of 1 000 buckets joined, 7-8 passes of 45-185 ms each (growing with the
# heap), Check waiting behind each. Frozen objects are skipped (with this rule, 3
# passes of 5-66 ms). They are still freed by their reference counts, but a cycle
# that reaches one is never collected (an ended stream's task, frame and exception),
# so once this many buckets have left with their streams, the freeze is undone and
# done again only after the next full pass has collected what died meanwhile.
FREEZE_BUCKETS = 10_000
LOG_EVERY_S = 60.0

_Response = rlqs_pb2.RateLimitQuotaResponse
_Action = _Response.BucketAction
_Strategy = ratelimit_strategy_pb2.RateLimitStrategy
_log = logs.get("sitsmesh.transport.rlqs")


def _strategy(assignment: Assignment) -> Any:
    if assignment.kind is Kind.ALLOW:
        return _Strategy(blanket_rule=_Strategy.ALLOW_ALL)
    if assignment.kind is Kind.DENY or assignment.share is None:
        return _Strategy(blanket_rule=_Strategy.DENY_ALL)
    share = assignment.share
    return _Strategy(token_bucket=token_bucket_pb2.TokenBucket(
        max_tokens=share.max_tokens,
        tokens_per_fill=wrappers_pb2.UInt32Value(value=share.tokens_per_fill),
        fill_interval=duration_pb2.Duration(seconds=share.fill_s)))


def response(updates: Sequence[Update], ttl_s: int) -> Any:
    return _Response(bucket_action=_actions(updates, ttl_s, {}))


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class _Encoder:
    """One stream's replies from wire bytes made once: each bucket's id, each distinct
    assignment. Building a BucketAction message per bucket and reply cost ~4 µs a
    bucket, the largest part of RLQS's time on the loop. Serialized messages
    concatenated merge, so an action is its id's bytes then its assignment's."""

    __slots__ = ("_actions", "_by_id", "_fresh", "_ids", "_ttl_s", "_wire")

    def __init__(self, ttl_s: int) -> None:
        self._ttl_s = ttl_s
        # A report's BucketId bytes -> the id dict made from them, the object the
        # service keeps: the next report of the bucket costs a lookup, not a dict and
        # a key. And id(that dict) -> (it, its bytes) for the replies; holding the
        # dict keeps id() its own. One bytes object serves both.
        self._wire: dict[bytes, dict[str, str]] = {}
        self._ids: dict[int, tuple[dict[str, str], bytes]] = {}
        self._actions: dict[Assignment | None, bytes] = {}
        self._by_id: dict[int, tuple[Assignment | None, bytes]] = {}
        self._fresh: dict[int, tuple[dict[str, str], bytes]] = {}

    def bucket_id(self, wire: bytes, message: Any) -> dict[str, str]:
        """The id dict of a report's BucketId (`wire`: its bytes)."""
        known = self._wire.get(wire)
        if known is not None:
            return known
        made = dict(message.bucket)
        self._fresh[id(made)] = (made, wire)
        return made

    def kept(self, updates: Sequence[Update]) -> None:
        """Remember the new ids the service kept (an assignment, not an abandon): only
        those, so the service's byte bounds bound this too."""
        fresh, self._fresh = self._fresh, {}
        if not fresh:
            return
        for bucket_id, assignment in updates:
            entry = fresh.get(id(bucket_id))
            if assignment is None or entry is None or entry[0] is not bucket_id:
                continue
            if len(self._wire) >= MAX_ENCODED:
                self._wire.clear()
                self._ids.clear()
            self._wire[entry[1]] = bucket_id
            self._ids[id(bucket_id)] = entry

    def _bucket(self, bucket_id: dict[str, str]) -> bytes:
        """The BucketAction bytes of its bucket_id field."""
        hit = self._ids.get(id(bucket_id))
        if hit is not None and hit[0] is bucket_id:
            wire = hit[1]
        else:
            wire = rlqs_pb2.BucketId(bucket=bucket_id).SerializeToString()
        return b"\x0a" + _varint(len(wire)) + wire

    def _action(self, assignment: Assignment | None) -> bytes:
        # By identity first: the service interns assignments, and hashing a frozen
        # dataclass (and its share) per bucket showed in the profile.
        hit = self._by_id.get(id(assignment))
        if hit is not None and hit[0] is assignment:
            return hit[1]
        encoded = self._actions.get(assignment)
        if encoded is None:
            [action] = _actions([({}, assignment)], self._ttl_s, {})
            action.ClearField("bucket_id")
            encoded = self._actions[assignment] = action.SerializeToString()
            if len(self._actions) > MAX_ENCODED:
                self._actions.clear()
        if len(self._by_id) >= MAX_ENCODED:
            self._by_id.clear()
        self._by_id[id(assignment)] = (assignment, encoded)  # holding it keeps its id
        return encoded

    def response(self, updates: Sequence[Update]) -> Any:
        parts = []
        for bucket_id, assignment in updates:
            body = self._bucket(bucket_id) + self._action(assignment)
            parts.append(b"\x0a" + _varint(len(body)) + body)
        return _Response.FromString(b"".join(parts))

    def forget(self) -> None:
        self._ids.clear()
        self._wire.clear()


def _actions(updates: Sequence[Update], ttl_s: int,
             made: dict[Assignment | None, Any]) -> list[Any]:
    """The replies' actions; `made` keeps each distinct assignment's, as a stream's
    buckets share a few."""
    actions = []
    for bucket_id, assignment in updates:
        action = made.get(assignment)
        if action is None:
            if assignment is None:
                action = {"abandon_action": _Action.AbandonAction()}
            else:
                action = {"quota_assignment_action": _Action.QuotaAssignmentAction(
                    assignment_time_to_live=duration_pb2.Duration(seconds=ttl_s),
                    rate_limit_strategy=_strategy(assignment))}
            made[assignment] = action
        actions.append(_Action(bucket_id=rlqs_pb2.BucketId(bucket=bucket_id), **action))
    return actions


class _Outbox:
    """What one stream's writer has to send."""

    __slots__ = ("done", "encoder", "pending", "ready", "stuck", "waiting")

    def __init__(self, ttl_s: int) -> None:
        self.encoder = _Encoder(ttl_s)
        # id(bucket id) -> update: the id dict is kept alive by the update itself, so
        # its id names it while it waits; a bucket's ids are one object in its life.
        self.pending: dict[int, Update] = {}
        self.ready = asyncio.Event()
        self.stuck = asyncio.Event()
        self.waiting = 0     # reports answered since the writer last took the pending
        self.done = False    # the reader has ended

    def put(self, updates: Sequence[Update], *, report: bool) -> None:
        pending = self.pending
        for update in updates:
            pending[id(update[0])] = update
        if report:
            self.waiting += 1
            if self.waiting > MAX_QUEUED:
                # A caller that reads nothing: end its stream rather than answer into
                # the void (an Envoy opens a new one at its next report).
                self.stuck.set()
        self.ready.set()

    def take(self) -> list[Update]:
        """At most MAX_REPLY updates, oldest first: one reply of every bucket's long
        id cost its size several times over while being built and sent."""
        pending = self.pending
        if len(pending) <= MAX_REPLY:
            updates = list(pending.values())
            pending.clear()
        else:
            keys = list(itertools.islice(pending, MAX_REPLY))
            updates = [pending.pop(key) for key in keys]
        self.waiting = 0
        return updates


class RateLimitQuotaServicer(rlqs_pb2_grpc.RateLimitQuotaServiceServicer):  # type: ignore[misc]
    def __init__(self, service: QuotaService, ttl_s: int,
                 streams: OpenStreams | None = None) -> None:
        self._service = service
        # Envoy 1.40 reads the TTL's whole seconds, and 0 expires at once.
        self._ttl_s = max(1, ttl_s)
        self.streams = streams or OpenStreams()
        self._outboxes: dict[str, _Outbox] = {}
        # Every RLQS slice on the loop (a report's chunk, a reply, a refresh step) takes
        # a turn: one runs a pass, so Check waits for one at most.
        self.turns = Turns()
        self.not_reading = 0  # streams ended because their caller did not read
        self._frozen_at = 0   # buckets held at the last gc.freeze()
        self._left = 0        # buckets gone with their streams since the last thaw
        self._thawed_at: int | None = None  # full passes counted at the thaw, until the next

    async def StreamRateLimitQuotas(self, request_iterator: AsyncIterator[Any],
                                    context: aio.ServicerContext[Any, Any]) -> None:
        try:
            await self.streams.run(self._serve(request_iterator, context))
        except DecodeError:
            await abort(context, InvalidArgumentError(
                "a RateLimitQuotaUsageReports could not be parsed"))

    async def _serve(self, request_iterator: AsyncIterator[Any],
                     context: aio.ServicerContext[Any, Any]) -> None:
        stream = self._service.open()
        box = self._outboxes[stream.name] = _Outbox(self._ttl_s)
        reader = asyncio.ensure_future(self._read(request_iterator, stream, box))
        try:
            while True:
                if not box.pending:
                    if box.done:  # what the reader left was sent: the stream ends
                        break
                    box.ready.clear()
                    await box.ready.wait()
                    continue
                await self.turns.take()
                reply = box.encoder.response(box.take())
                if not await self._write(context, reply, box.stuck):
                    self.not_reading += 1
                    _log.warning("RLQS stream not reading; ended it", stream=stream.name)
                    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                    context.set_details("the RLQS stream did not read its replies")
                    return
            await reader  # raises what ended the reading, if anything
        finally:
            reader.cancel()
            self._outboxes.pop(stream.name, None)
            box.encoder.forget()
            self._left += len(stream.buckets)
            self._service.close(stream)

    @staticmethod
    async def _write(context: aio.ServicerContext[Any, Any], reply: Any,
                     stuck: asyncio.Event) -> bool:
        """Send one reply; False if the caller took none of it in WRITE_S, or too many
        reports came in meanwhile."""
        write = asyncio.ensure_future(context.write(reply))
        full = asyncio.ensure_future(stuck.wait())
        try:
            done, _ = await asyncio.wait((write, full), timeout=WRITE_S,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            full.cancel()
            if not write.done():
                write.cancel()
        if write not in done:
            return False
        write.result()  # raises what failed the write (the call ended), if anything
        return True

    async def _read(self, request_iterator: AsyncIterator[Any], stream: Any,
                    box: _Outbox) -> None:
        try:
            async for reports in request_iterator:
                # Where a per-message byte charge (one budget across every stream)
                # would take the decoded report's size: reports.ByteSize().
                every = reports.bucket_quota_usages
                updates: list[Update] = []
                id_of = box.encoder.bucket_id
                # One iterator across the chunks: islice(every, start, ...) walked (and
                # wrapped) every earlier usage again for each chunk.
                rest = iter(every)
                for _ in range(0, len(every), CHUNK):
                    await self.turns.take()
                    usages = []
                    for u in itertools.islice(rest, CHUNK):
                        message = u.bucket_id
                        elapsed = u.time_elapsed
                        usages.append((id_of(message.SerializeToString(), message),
                                       u.num_requests_allowed, u.num_requests_denied,
                                       elapsed.seconds + elapsed.nanos * 1e-9))
                    answered = self._service.report(stream, reports.domain, usages)
                    box.encoder.kept(answered)
                    updates += answered
                box.put(updates, report=True)
        finally:
            box.done = True
            box.ready.set()

    def push(self) -> int:
        """Send every stream what changed since it was last told; returns how many."""
        self._collector()
        pushes = self._service.refresh()
        for name, updates in pushes.items():
            box = self._outboxes.get(name)
            if box is not None:
                box.put(updates, report=False)
        return len(pushes)

    def _collector(self) -> None:
        """Freeze what the process holds once many buckets joined; thaw once many left
        (FREEZE_BUCKETS says why)."""
        held = sum(len(s.buckets) for s in self._service.streams.values())
        if self._left >= FREEZE_BUCKETS:
            gc.unfreeze()
            self._left, self._frozen_at = 0, 0
            self._thawed_at = gc.get_stats()[2]["collections"]
        if self._thawed_at is not None:
            if gc.get_stats()[2]["collections"] == self._thawed_at:
                return  # the dead cycles are not collected yet: freezing would keep them
            self._thawed_at = None
        if held >= self._frozen_at + FREEZE_BUCKETS:
            gc.freeze()
            self._frozen_at = held


class ServedElsewhere(rlqs_pb2_grpc.RateLimitQuotaServiceServicer):  # type: ignore[misc]
    """The data port's RLQS when RLQS has a process of its own (rlqs_addr): an Envoy
    still streaming here is refused with where to stream, and the log says so at most
    once a minute, rather than UNIMPLEMENTED, which fails open like any outage."""

    def __init__(self, rlqs_addr: str) -> None:
        self._error = FailedPreconditionError(
            f"RLQS is served on rlqs_addr {rlqs_addr}, by a process of its own: point this "
            "Envoy's rate_limit_quota rlqs_server there")
        self._logged = -LOG_EVERY_S

    async def StreamRateLimitQuotas(self, request_iterator: AsyncIterator[Any],
                                    context: aio.ServicerContext[Any, Any]) -> None:
        now = asyncio.get_running_loop().time()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            _log.warning("an Envoy streams RLQS to the data port", peer=context.peer(),
                         error=self._error.message)
        await abort(context, self._error)
