"""The quotas of every connected Envoy: demand from their usage reports, verdicts from
the rate-limit config and the backpressure decisions, and what to send each stream.

One event loop owns it (the RLQS servicer's streams and a periodic refresh), so it
needs no lock. Nothing here is on Envoy's request path, but it shares the loop with
Check: recomputing every bucket of every stream on each report and each 50 ms
refresh put Check's p50 at 683 ms with 30 streams of 1 000 buckets (issue 26). So
the work follows change. Buckets that share a rate form a group (a rule's target, or
a pipeline's priority), and a group is recomputed only when something it depends on
moved: a member joined, left or reported demand, its pipeline's decision or admitted
fraction changed, the other replicas' demand for it changed. A bucket's rule target
and pipeline are matched once, and again only when the rate-limit config or the
pipelines change. A refresh does at most WORK_PER_STEP bucket visits; the rest waits
for the next one, so Check is never behind a long pass.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from sitsmesh.pressure.controller import Decision
from sitsmesh.quota import buckets
from sitsmesh.quota.groups import DRIFT_SCAN_S, RESPLIT_S, GroupBook
from sitsmesh.quota.records import (
    MAX_ID_BYTES,
    MAX_STREAM_ID_BYTES,
    Assignment,
    Bucket,
    Stream,
    Update,
    id_bytes,
)
from sitsmesh.ratelimit.config import Node

__all__ = ["MAX_BUCKETS", "RESPLIT_S", "Assignment", "QuotaService", "Stream", "Update",
           "id_bytes"]

MAX_BUCKETS = 1_000    # per stream; past it new buckets are abandoned, not kept
IDLE_S = 300.0         # a bucket with no requests this long is abandoned (Envoy frees it)
CHANGE = 0.2           # a share that moved less than this is not worth a new bucket
SMOOTHING = 0.5        # weight of the newest report in a demand estimate
# Bucket visits (matching, or taking a group's verdict and share) per refresh step,
# and its time: Check waits behind a step, so a step is short and the next one
# follows soon while work is pending.
WORK_PER_STEP = 5_000
STEP_S = 0.0003
SETTLE_STEP = 250   # buckets settled per step (~0.25 ms)
# A group is split again at once when its members' demands moved by this fraction of


class QuotaService(GroupBook):
    def __init__(self, domains: Callable[[], Mapping[str, Node]],
                 decisions: Callable[[], Mapping[str, Decision]],
                 pipeline_for: Callable[[str, str, str], str],
                 clock: Callable[[], float] = time.monotonic, *,
                 max_stream_id_bytes: int = MAX_STREAM_ID_BYTES,
                 max_id_bytes: int = MAX_ID_BYTES,
                 work_per_step: int = WORK_PER_STEP, step_s: float = STEP_S,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(domains, decisions, pipeline_for, clock)
        self._names = itertools.count(1)
        self._max_stream_id_bytes = max_stream_id_bytes
        self._max_id_bytes = max_id_bytes
        self._work_per_step = work_per_step
        self._step_s = step_s
        self._timer = timer
        # What to consider pushing, oldest first: single buckets (True: its group was
        # regrouped), whole groups by name, and the members left of the one being sent.
        self._outgoing: OrderedDict[Bucket, bool] = OrderedDict()
        self._regroups: OrderedDict[str, None] = OrderedDict()
        self._sending: list[Bucket] = []
        self.id_bytes = 0           # held by every stream's bucket ids
        self.refused_ids = 0        # new buckets abandoned for the id bounds


    def open(self) -> Stream:
        stream = Stream(f"envoy-{next(self._names)}")
        self.streams[stream.name] = stream
        return stream

    def close(self, stream: Stream) -> None:
        if self.streams.pop(stream.name, None) is None:
            return
        for bucket in stream.buckets.values():
            self._leave(bucket)
        self.id_bytes -= stream.id_bytes
        stream.id_bytes = 0
        stream.buckets.clear()
        stream.by_id.clear()

    # -- what the other replicas ask -----------------------------------------------

    @property
    def remote(self) -> Mapping[str, Mapping[str, float | None]]:
        return self._remote

    @remote.setter
    def remote(self, value: Mapping[str, Mapping[str, float | None]]) -> None:
        """The other replicas' members by rate: only the rates whose members moved are
        split again."""
        old, self._remote = self._remote, value
        for name in set(old) | set(value):
            group = self._named.get(name)
            if group is not None and old.get(name) != value.get(name):
                self._dirty[group] = None

    @property
    def local_members(self) -> dict[str, dict[str, float | None]]:
        """Shared rates' members here (what the other replicas read): rate -> member ->
        demand."""
        return {name: {m: b.demand for m, b in group.members.items()}
                for name, group in self._named.items()}

    # -- reports -------------------------------------------------------------------

    def report(self, stream: Stream, domain: str,
               usages: Iterable[tuple[dict[str, str], int, int, float]]) -> list[Update]:
        """Take one usage report (bucket id, allowed, denied, seconds it covers); return
        what to send this stream: every bucket it reported (a reply renews the TTLs)
        and abandons for idle or refused ones. A new bucket gets its verdict now;
        demand that moved other shares is pushed by the next `refresh`."""
        now = self._clock()
        if domain and not stream.domain:
            stream.domain = domain
        reported: list[Bucket] = []
        joined: list[Bucket] = []
        abandon: list[Update] = []
        by_id = stream.by_id
        for bucket_id, allowed, denied, elapsed in usages:
            # A caller that hands back the id object a bucket keeps (the RLQS transport
            # does, from the report's bytes) skips building its key.
            bucket = by_id.get(id(bucket_id))
            if bucket is None or bucket.id is not bucket_id:
                key = buckets.key_of(stream.domain, bucket_id)
                bucket = stream.buckets.get(key)
                if bucket is None:
                    bucket = self._keep(stream, bucket_id, key, now)
                    if bucket is None:
                        abandon.append((bucket_id, None))
                        continue
                    joined.append(bucket)
            if allowed or denied:
                bucket.last_used = now
            if elapsed > 0:
                rate = (allowed + denied) / elapsed
                before = bucket.demand
                bucket.demand = rate if before is None else (
                    SMOOTHING * rate + (1 - SMOOTHING) * before)
                self._touch(bucket, before, now)
            if now - bucket.last_used > IDLE_S:
                self._drop(stream, bucket)
                abandon.append((bucket_id, None))
                continue
            reported.append(bucket)
        if joined:
            self._join(stream, joined)
        self._settle_these(itertools.chain(joined, reported))
        updates: list[Update] = []
        for bucket in reported:
            # A reply repeats what Envoy has unless it moved enough: the same token
            # bucket sent again keeps its tokens, a new one starts full.
            if self._moved(bucket):
                bucket.sent = bucket.due
                self._regroup.update(bucket.groups)
            if bucket.sent is not None:
                updates.append((bucket.id, bucket.sent))
        return updates + abandon

    def _keep(self, stream: Stream, bucket_id: dict[str, str], key: str,
              now: float) -> Bucket | None:
        """A new bucket, if the bounds let the stream keep it."""
        if buckets.check(bucket_id) or len(stream.buckets) >= MAX_BUCKETS:
            return None
        cost = id_bytes(bucket_id)
        if (stream.id_bytes + cost > self._max_stream_id_bytes
                or self.id_bytes + cost > self._max_id_bytes):
            self.refused_ids += 1
            return None
        bucket = Bucket(bucket_id, key, stream.name, cost, last_used=now)
        stream.buckets[key] = bucket
        stream.by_id[id(bucket_id)] = bucket  # the bucket keeps its id alive
        stream.id_bytes += cost
        self.id_bytes += cost
        return bucket

    def _join(self, stream: Stream, joined: list[Bucket]) -> None:
        """New buckets are answered at once. A new group is computed now (all its
        members are new); one that exists keeps its verdict, a newcomer gets an equal
        share of it, and the group is split again by the next refresh (splitting a
        rate of 1 000 members for each of them was quadratic)."""
        self._notice_inputs()
        if stream.root is None:
            stream.root = self._domains().get(stream.domain)
        for bucket in joined:
            self._match(stream.root, stream.domain, bucket)
        fresh = {g: None for b in joined for g in (b.rule, b.admission)
                 if g is not None and not g.computed}
        self._recompute(list(fresh))
        self._unsettled.update(dict.fromkeys(joined))
        self._changed.update(dict.fromkeys(joined))

    def _drop(self, stream: Stream, bucket: Bucket) -> None:
        self._leave(bucket)
        del stream.buckets[bucket.key]
        if stream.by_id.get(id(bucket.id)) is bucket:
            del stream.by_id[id(bucket.id)]
        stream.id_bytes -= bucket.cost
        self.id_bytes -= bucket.cost

    def _moved(self, bucket: Bucket, regrouped: bool = False) -> bool:
        """Worth sending: its own assignment moved enough, or another share of a rate it
        takes part in did (`regrouped`, or one of its groups is in `_regroup`). Shares go
        out together, from one computation: kept apart, each Envoy held a share from a
        different pass, and they added up to 114 % of the rate (bench/rlqs_envoy.py)."""
        due = bucket.due
        # Assignments are interned, so `is` settles most: a dataclass `==` on every
        # reported bucket was ~12 % of the loop's RLQS time under 100 streams (py-spy).
        if due is None or due is bucket.sent or due == bucket.sent:
            return False
        return regrouped or not due.close_to(bucket.sent) or not self._regroup.isdisjoint(
            bucket.groups)

    def refresh(self) -> dict[str, list[Update]]:
        """What changed enough to push, stream by stream: decisions move every tick and
        one Envoy's report moves every other Envoy's share. Does a bounded step of the
        pending work; what is left waits for the next call."""
        self._notice_inputs()
        now = self._clock()
        if self._drifting and now >= self._drift_scan:
            # Scanned every DRIFT_SCAN_S, not every step: there may be many such groups.
            self._drift_scan = now + DRIFT_SCAN_S
            due = [g for g, at in self._drifting.items() if at <= now]
            for group in due:
                del self._drifting[group]
                self._dirty[group] = None
        budget = self._work_per_step
        until = self._timer() + self._step_s
        while self._stale and budget > 0:
            bucket = self._stale.pop()
            stream = self.streams.get(bucket.stream)
            if stream is not None and stream.buckets.get(bucket.key) is bucket:
                self._match(stream.root, stream.domain, bucket)
            budget -= 1
            if budget % 64 == 0 and self._timer() > until:
                break
        # Settling (a bucket's assignment from its groups') and recomputing a group take
        # turns with Check too: settling the 1 000 members of a recomputed group in one
        # go took ~1 ms, so a step settles SETTLE_STEP and recomputes only once all is
        # settled; nothing is sent while buckets are unsettled (their `due` is stale).
        self._settle(SETTLE_STEP)
        # A group is recomputed only early in a step (a large one takes ~0.6 ms on its
        # own), and settled now only if time is left: otherwise in the next steps.
        fresh = until - self._step_s * 0.75
        while (not self._unsettled and self._dirty and budget > 0
               and self._timer() <= fresh):
            group = next(iter(self._dirty))
            self._recompute([group])
            budget -= len(group.members) + 1
            if self._timer() <= until:
                self._settle(SETTLE_STEP)
        if self._unsettled:
            return {}
        changed, self._changed = self._changed, {}
        for bucket in changed:
            if bucket.due is not None and not bucket.due.close_to(bucket.sent):
                self._regroup.update(bucket.groups)
        for bucket in changed:
            if self._regroup.isdisjoint(bucket.groups):  # else its group brings it
                self._outgoing.setdefault(bucket, False)
        # Whole groups are queued by name, and their members taken a step at a time:
        # every report regroups a tenant's group of 1 000 members, and listing every
        # member of every regrouped group took a refresh 20-60 ms of Check's loop.
        self._regroups.update(dict.fromkeys(self._regroup))
        self._regroup.clear()
        # Some progress every step, even when matching and groups took its budget.
        return self._send(max(budget, 256), until)

    def _next(self) -> tuple[Bucket, bool] | None:
        """The next candidate to push (True: its group's shares all go out, see _moved):
        the rest of the group being sent, then single buckets, then the next group."""
        while True:
            if self._sending:
                return self._sending.pop(), True
            if self._outgoing:
                return self._outgoing.popitem(last=False)
            if not self._regroups:
                return None
            name, _ = self._regroups.popitem(last=False)
            shared = self._named.get(name)
            if shared is not None:
                self._sending = list(shared.members.values())

    def _send(self, budget: int, until: float) -> dict[str, list[Update]]:
        """What to push: a bounded step of the candidates, oldest first."""
        pushes: dict[str, list[Update]] = {}
        visited = 0
        while visited < budget:
            found = self._next()
            if found is None:
                break
            bucket, regrouped = found
            visited += 1
            if visited % 64 == 0 and self._timer() > until:
                break
            stream = self.streams.get(bucket.stream)
            if (stream is not None and stream.buckets.get(bucket.key) is bucket
                    and self._moved(bucket, regrouped)):
                bucket.sent = bucket.due
                pushes.setdefault(bucket.stream, []).append((bucket.id, bucket.due))
        self.visits += visited
        return pushes

    def pipelines_changed(self) -> None:
        """The pipelines (and so the models they take) changed: match every bucket's
        pipeline again, a step at a time."""
        self._stale = [b for s in self.streams.values() for b in s.buckets.values()]

    @property
    def pending(self) -> int:
        """Buckets and groups still waiting to be matched or recomputed."""
        return (len(self._stale) + len(self._dirty) + len(self._outgoing)
                + len(self._regroups) + len(self._sending) + len(self._unsettled))

    # -- the work ------------------------------------------------------------------
