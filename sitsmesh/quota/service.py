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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from sitsmesh.pressure.controller import Decision
from sitsmesh.quota import buckets
from sitsmesh.quota.buckets import Kind, Target, Verdict
from sitsmesh.quota.split import TokenShare, equal_share, split
from sitsmesh.ratelimit.config import Node

MAX_BUCKETS = 1_000    # per stream; past it new buckets are abandoned, not kept
IDLE_S = 300.0         # a bucket with no requests this long is abandoned (Envoy frees it)
CHANGE = 0.2           # a share that moved less than this is not worth a new bucket
SMOOTHING = 0.5        # weight of the newest report in a demand estimate
# Bytes a stored bucket id costs, as counted by `id_bytes`: its text three times (the
# id, its key, and its wire form the RLQS transport keeps), and the objects around
# each entry and each bucket. Long ids cost ~25 MB a
# stream before these bounds (issue 26); 2 MiB still holds 1 000 ids of the fragment's
# four entries (~0.6 KiB each).
MAX_STREAM_ID_BYTES = 2 * 1024 * 1024
# Across every stream: 100 Envoys of 1 000 such buckets fit (~75 MiB counted), and
# ids of the longest kind stop at ~130 MB of a 512 Mi pod.
MAX_ID_BYTES = 96 * 1024 * 1024
ENTRY_BYTES = 96
BUCKET_BYTES = 256
# Bucket visits (matching, or taking a group's verdict and share) per refresh step,
# and its time: Check waits behind a step, so a step is short and the next one
# follows soon while work is pending.
WORK_PER_STEP = 5_000
STEP_S = 0.001
# A group is split again at once when its members' demands moved by this fraction of
# its demand in all, else RESPLIT_S after its last split (shares move by CHANGE
# before they are sent anyway).
DRIFT = 0.1
RESPLIT_S = 5.0
DRIFT_SCAN_S = 0.5


def id_bytes(bucket_id: Mapping[str, str]) -> int:
    """What keeping `bucket_id` costs, charged against the per-stream and global bounds."""
    text = sum(len(k) + len(v) for k, v in bucket_id.items())
    return 3 * text + ENTRY_BYTES * len(bucket_id) + BUCKET_BYTES


@dataclass(frozen=True, slots=True)
class Assignment:
    kind: Kind
    share: TokenShare | None = None

    def close_to(self, other: Assignment | None) -> bool:
        """Close enough not to send: Envoy starts a changed token bucket full, so every
        new share costs a burst."""
        if other is None or other.kind is not self.kind:
            return False
        if self.share is None or other.share is None:
            return self.share == other.share
        if self.share.fill_s != other.share.fill_s:
            return False
        return abs(self.share.rate - other.share.rate) <= CHANGE * other.share.rate


_ALLOWED = Assignment(Kind.ALLOW)
_DENIED = Assignment(Kind.DENY)
MAX_INTERNED = 10_000


@dataclass(eq=False, slots=True)
class _Group:
    """Buckets that share one verdict: a rule's target, or a pipeline's priority."""

    target: Target | None = None             # a rule's group
    pipeline: str = ""                       # or a pipeline's priority
    priority: int = 0
    members: dict[str, _Bucket] = field(default_factory=dict)  # member name -> bucket
    verdict: Verdict = buckets.ALLOW
    shares: dict[str, TokenShare] = field(default_factory=dict)
    computed: bool = False
    demand: float = 0.0  # requests/s of every member, at the last split
    drift: float = 0.0   # how far the members' demands moved since (requests/s)
    since: float = 0.0   # when it was last computed


@dataclass(eq=False, slots=True)
class _Bucket:
    id: dict[str, str]
    key: str
    stream: str = ""
    cost: int = 0
    demand: float | None = None  # requests/s this stream's Envoy saw, smoothed
    last_used: float = 0.0
    sent: Assignment | None = None
    due: Assignment | None = None  # what the last pass computed
    groups: tuple[str, ...] = ()   # the shared rates it takes part in
    rule: _Group | None = None
    admission: _Group | None = None

    @property
    def member(self) -> str:
        return f"{self.stream}\x1f{self.key}"


@dataclass
class Stream:
    """One Envoy's RLQS stream (one per Envoy and domain)."""

    name: str
    domain: str = ""
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    by_id: dict[int, _Bucket] = field(default_factory=dict)  # id(bucket.id) -> bucket
    id_bytes: int = 0
    root: Node | None = None  # the domain's tree its buckets were matched against


# (bucket id, what to send); None sends abandon_action: Envoy drops the bucket.
Update = tuple[dict[str, str], Assignment | None]


class QuotaService:
    def __init__(self, domains: Callable[[], Mapping[str, Node]],
                 decisions: Callable[[], Mapping[str, Decision]],
                 pipeline_for: Callable[[str, str, str], str],
                 clock: Callable[[], float] = time.monotonic, *,
                 max_stream_id_bytes: int = MAX_STREAM_ID_BYTES,
                 max_id_bytes: int = MAX_ID_BYTES,
                 work_per_step: int = WORK_PER_STEP, step_s: float = STEP_S,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self._domains = domains
        self._decisions = decisions
        self._pipeline_for = pipeline_for
        self._clock = clock
        self._names = itertools.count(1)
        self.streams: dict[str, Stream] = {}
        self._max_stream_id_bytes = max_stream_id_bytes
        self._max_id_bytes = max_id_bytes
        self._work_per_step = work_per_step
        self._step_s = step_s
        self._timer = timer
        self.id_bytes = 0           # held by every stream's bucket ids
        self.refused_ids = 0        # new buckets abandoned for the id bounds
        self.visits = 0             # bucket visits so far (work done, for tests and bench)
        # The groups, by what they share; the shared ones also by their rate's name
        # (what the other replicas' demand is keyed by).
        self._rules: dict[tuple[str, tuple[str, ...]], _Group] = {}
        self._admissions: dict[tuple[str, int], _Group] = {}
        self._named: dict[str, _Group] = {}
        self._dirty: dict[_Group, None] = {}       # to recompute, in order
        self._drifting: dict[_Group, float] = {}   # to recompute at that time
        self._drift_scan = 0.0
        self._interned: dict[TokenShare, Assignment] = {}
        self._changed: dict[_Bucket, None] = {}    # `due` may have moved since last sent
        self._unsettled: dict[_Bucket, None] = {}  # `due` to compute again
        self._stale: list[_Bucket] = []            # to match again (config or pipelines)
        self._domains_seen: Mapping[str, Node] | None = None
        self._decisions_now: Mapping[str, Decision] = {}
        self._by_pipeline: dict[str, dict[_Group, None]] = {}  # groups that follow it
        self._seen: dict[str, Decision | None] = {}
        self._fraction: dict[str, float] = {}
        self._remote: Mapping[str, Mapping[str, float | None]] = {}
        # Groups whose shares were resent in part: the rest follow at the next refresh.
        self._regroup: set[str] = set()

    # -- streams -------------------------------------------------------------------

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
        reported: list[_Bucket] = []
        joined: list[_Bucket] = []
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
        self._settle()
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
              now: float) -> _Bucket | None:
        """A new bucket, if the bounds let the stream keep it."""
        if buckets.check(bucket_id) or len(stream.buckets) >= MAX_BUCKETS:
            return None
        cost = id_bytes(bucket_id)
        if (stream.id_bytes + cost > self._max_stream_id_bytes
                or self.id_bytes + cost > self._max_id_bytes):
            self.refused_ids += 1
            return None
        bucket = _Bucket(bucket_id, key, stream.name, cost, last_used=now)
        stream.buckets[key] = bucket
        stream.by_id[id(bucket_id)] = bucket  # the bucket keeps its id alive
        stream.id_bytes += cost
        self.id_bytes += cost
        return bucket

    def _join(self, stream: Stream, joined: list[_Bucket]) -> None:
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

    def _moved(self, bucket: _Bucket) -> bool:
        """Worth sending: its own assignment moved enough, or another share of a rate it
        takes part in did. Shares go out together, from one computation: kept apart,
        each Envoy held a share from a different pass, and they added up to 114 % of
        the rate (bench/rlqs_envoy.py)."""
        if bucket.due is None or bucket.due == bucket.sent:
            return False
        return not bucket.due.close_to(bucket.sent) or not self._regroup.isdisjoint(
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
        self._settle()
        while self._dirty and budget > 0 and self._timer() <= until:
            group = next(iter(self._dirty))
            self._recompute([group])
            self._settle()
            budget -= len(group.members) + 1
        candidates = dict(self._changed)
        self._changed.clear()
        for bucket in candidates:
            if bucket.due is not None and not bucket.due.close_to(bucket.sent):
                self._regroup.update(bucket.groups)
        for name in self._regroup:
            shared = self._named.get(name)
            if shared is not None:
                candidates.update(dict.fromkeys(shared.members.values()))
        pushes: dict[str, list[Update]] = {}
        for bucket in candidates:
            if (bucket.stream in self.streams and self._moved(bucket)
                    and bucket.due is not None):
                bucket.sent = bucket.due
                pushes.setdefault(bucket.stream, []).append((bucket.id, bucket.due))
        self.visits += len(candidates)
        self._regroup.clear()
        return pushes

    def pipelines_changed(self) -> None:
        """The pipelines (and so the models they take) changed: match every bucket's
        pipeline again, a step at a time."""
        self._stale = [b for s in self.streams.values() for b in s.buckets.values()]

    @property
    def pending(self) -> int:
        """Buckets and groups still waiting to be matched or recomputed."""
        return len(self._stale) + len(self._dirty)

    # -- the work ------------------------------------------------------------------

    def _notice_inputs(self) -> None:
        """Mark what the rate-limit config and the decisions changed since last time."""
        domains = self._domains()
        if domains is not self._domains_seen:
            self._domains_seen = domains
            for stream in self.streams.values():
                root = domains.get(stream.domain)
                if root is not stream.root:
                    stream.root = root
                    self._stale.extend(stream.buckets.values())
        # The groups that follow each pipeline's decision are few (pipelines x
        # priorities, adaptive rules): compared one by one, as a test or a controller
        # may change a decision inside the same mapping.
        decisions = self._decisions()
        self._decisions_now = decisions
        for pipeline, groups in self._by_pipeline.items():
            decision = decisions.get(pipeline)
            seen = self._seen.get(pipeline)
            if decision is seen or decision == seen:
                continue
            self._seen[pipeline] = decision
            if decision is None:
                self._fraction.pop(pipeline, None)
            else:
                self._fraction[pipeline] = decision.fraction
            self._dirty.update(groups)

    def _match(self, root: Node | None, domain: str, bucket: _Bucket) -> None:
        """Which groups `bucket` belongs to; moving it marks both groups."""
        self.visits += 1
        reached = buckets.target(domain, root, bucket.id)
        rule = None
        if reached is not None:
            rule = self._rules.get((domain, reached.parts))
            if rule is None or rule.target != reached:
                rule = self._rules[domain, reached.parts] = _Group(target=reached)
                for pipeline in reached.adaptive:
                    self._follow(pipeline, rule)
        admission = None
        priority = buckets.priority_of(bucket.id)
        if priority is not None:
            pipeline = self._pipeline_for(bucket.id.get("pipeline", ""),
                                          bucket.id.get("model", ""),
                                          bucket.id.get("tenant", ""))
            if pipeline:
                admission = self._admissions.get((pipeline, priority))
                if admission is None:
                    admission = self._admissions[pipeline, priority] = _Group(
                        pipeline=pipeline, priority=priority)
                    self._follow(pipeline, admission)
        if rule is bucket.rule and admission is bucket.admission and bucket.due:
            return
        self._leave(bucket)
        bucket.rule, bucket.admission = rule, admission
        member = bucket.member
        for group in (rule, admission):
            if group is not None:
                group.members[member] = bucket
                self._dirty[group] = None
        if rule is None and admission is None:
            bucket.due, bucket.groups = _ALLOWED, ()
            self._changed[bucket] = None

    def _follow(self, pipeline: str, group: _Group) -> None:
        """`group` follows `pipeline`'s decision."""
        self._by_pipeline.setdefault(pipeline, {})[group] = None
        if pipeline not in self._seen:
            decision = self._seen[pipeline] = self._decisions_now.get(pipeline)
            if decision is not None:
                self._fraction[pipeline] = decision.fraction

    def _leave(self, bucket: _Bucket) -> None:
        member = bucket.member
        for group in (bucket.rule, bucket.admission):
            if group is not None and group.members.pop(member, None) is not None:
                if group.members:
                    self._dirty[group] = None
                else:
                    self._forget(group)
        bucket.rule = bucket.admission = None
        self._changed.pop(bucket, None)
        self._unsettled.pop(bucket, None)

    def _forget(self, group: _Group) -> None:
        self._dirty.pop(group, None)
        self._drifting.pop(group, None)
        if self._named.get(group.verdict.group) is group:
            del self._named[group.verdict.group]
        pipelines = group.target.adaptive if group.target is not None else {group.pipeline}
        for pipeline in pipelines:
            following = self._by_pipeline.get(pipeline, {})
            following.pop(group, None)
            if not following:
                self._by_pipeline.pop(pipeline, None)
                self._seen.pop(pipeline, None)
                self._fraction.pop(pipeline, None)
        if group.target is not None:
            key = (group.target.domain, group.target.parts)
            if self._rules.get(key) is group:
                del self._rules[key]
        elif self._admissions.get((group.pipeline, group.priority)) is group:
            del self._admissions[group.pipeline, group.priority]

    def _drop(self, stream: Stream, bucket: _Bucket) -> None:
        self._leave(bucket)
        del stream.buckets[bucket.key]
        if stream.by_id.get(id(bucket.id)) is bucket:
            del stream.by_id[id(bucket.id)]
        stream.id_bytes -= bucket.cost
        self.id_bytes -= bucket.cost

    def _touch(self, bucket: _Bucket, before: float | None, now: float) -> None:
        """Its demand moved: the shares of the rates it takes part in follow, at once
        when its first demand arrives or the group's demand drifted by DRIFT since its
        last split, else within RESPLIT_S. Every Envoy reports every bucket each 5 s,
        so re-splitting a rate on each report cost (Envoys x buckets) per report."""
        # A rule's verdict does not depend on demand, its split does. A pipeline's may
        # (the arrivals of a cut priority come from reports when the decision has
        # none), but never when it allows: protected, over the level or no decision.
        assert bucket.demand is not None
        delta = bucket.demand - (before or 0.0)
        for group in (bucket.rule, bucket.admission):
            kind = group.verdict.kind if group is not None else Kind.ALLOW
            if group is None or kind is Kind.ALLOW or (
                    group.target is not None and kind is not Kind.SHARED):
                continue
            group.drift += abs(delta)
            if before is None or group.drift > DRIFT * group.demand:
                self._dirty[group] = None
            elif group.drift > 0 and group not in self._dirty:
                self._drifting.setdefault(group, group.since + RESPLIT_S)

    def _recompute(self, groups: list[_Group]) -> None:
        """Each group's verdict and shares; its members' assignments follow."""
        decisions = self._decisions_now
        now = self._clock()
        for group in groups:
            if not group.members:
                continue
            self._dirty.pop(group, None)
            self.visits += len(group.members)
            if group.target is not None:
                verdict = group.target.verdict(self._fraction)
            else:
                name = buckets.admission_group(group.pipeline, group.priority)
                demand = sum(b.demand or 0.0 for b in group.members.values()) + sum(
                    d or 0.0 for d in self._remote.get(name, {}).values())
                verdict = buckets.admission_verdict(
                    group.pipeline, decisions.get(group.pipeline), group.priority, demand)
                group.demand = demand
            if self._named.get(group.verdict.group) is group:
                del self._named[group.verdict.group]
            group.verdict = verdict
            group.computed = True
            group.since, group.drift = now, 0.0
            self._drifting.pop(group, None)
            if verdict.kind is Kind.SHARED:
                self._named[verdict.group] = group
                demands = {**self._remote.get(verdict.group, {}),
                           **{m: b.demand for m, b in group.members.items()}}
                group.demand = sum(d or 0.0 for d in demands.values())
                # Shares and assignments are interned: a bucket holds the same few
                # objects as its neighbours, not two of its own for the GC to walk.
                group.shares = {m: self._share(s) for m, s in split(
                    verdict.rate, verdict.window_s, demands, verdict.burst_s).items()}
            else:
                group.shares = {}
            self._changed.update(dict.fromkeys(group.members.values()))
            self._unsettled.update(dict.fromkeys(group.members.values()))

    def _share(self, share: TokenShare) -> TokenShare:
        assignment = self._interned.get(share)
        if assignment is None:
            if len(self._interned) >= MAX_INTERNED:
                self._interned.clear()
            assignment = self._interned[share] = Assignment(Kind.SHARED, share)
        return assignment.share or share

    def _settle(self) -> None:
        """The assignments of the buckets whose groups moved: the stricter of their
        groups'."""
        unsettled, self._unsettled = self._unsettled, {}
        for bucket in unsettled:
            groups = [g for g in (bucket.rule, bucket.admission) if g is not None]
            bucket.groups = tuple(g.verdict.group for g in groups
                                  if g.verdict.kind is Kind.SHARED)
            bucket.due = self._stricter(groups, bucket.member)

    def _stricter(self, groups: list[_Group], member: str) -> Assignment:
        result = _ALLOWED
        for group in groups:
            verdict = group.verdict
            if verdict.kind is Kind.DENY:
                return _DENIED
            if verdict.kind is Kind.SHARED:
                share = group.shares.get(member) or equal_share(
                    verdict.rate, verdict.window_s,
                    len(group.members) + len(self._remote.get(verdict.group, ())),
                    verdict.burst_s)
                if result.share is None or share.rate < result.share.rate:
                    result = self._interned.get(share) or Assignment(Kind.SHARED, share)
        return result
