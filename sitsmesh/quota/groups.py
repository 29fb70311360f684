"""The groups of RLQS buckets that share one rate (a rule's target, or a pipeline's
priority) and their verdicts: which group a bucket joins, which groups an input change
touches, and each group's split of its rate. Only what moved is recomputed (see
sitsmesh.quota.service); QuotaService adds the streams and reports on top.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping

from sitsmesh.pressure.controller import Decision
from sitsmesh.quota import buckets
from sitsmesh.quota.buckets import Kind
from sitsmesh.quota.records import ALLOWED, DENIED, Assignment, Bucket, Group, Stream
from sitsmesh.quota.split import TokenShare, equal_share, split
from sitsmesh.ratelimit.config import Node

# its demand in all, else RESPLIT_S after its last split (shares move by CHANGE
# before they are sent anyway).
DRIFT = 0.1
RESPLIT_S = 5.0
DRIFT_SCAN_S = 0.5
MAX_INTERNED = 10_000


class GroupBook:
    """Groups and their verdicts, for the buckets of `streams`."""

    def __init__(self, domains: Callable[[], Mapping[str, Node]],
                 decisions: Callable[[], Mapping[str, Decision]],
                 pipeline_for: Callable[[str, str, str], str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._domains = domains
        self._decisions = decisions
        self._pipeline_for = pipeline_for
        self._clock = clock
        self.streams: dict[str, Stream] = {}
        self.visits = 0             # bucket visits so far (work done, for tests and bench)
        # The groups, by what they share; the shared ones also by their rate's name
        # (what the other replicas' demand is keyed by).
        self._rules: dict[tuple[str, tuple[str, ...]], Group] = {}
        self._admissions: dict[tuple[str, int], Group] = {}
        self._named: dict[str, Group] = {}
        self._dirty: dict[Group, None] = {}       # to recompute, in order
        self._drifting: dict[Group, float] = {}   # to recompute at that time
        self._drift_scan = 0.0
        self._interned: dict[TokenShare, Assignment] = {}
        self._changed: dict[Bucket, None] = {}    # `due` may have moved since last sent
        self._unsettled: dict[Bucket, None] = {}  # `due` to compute again
        self._stale: list[Bucket] = []            # to match again (config or pipelines)
        self._domains_seen: Mapping[str, Node] | None = None
        self._decisions_now: Mapping[str, Decision] = {}
        self._by_pipeline: dict[str, dict[Group, None]] = {}  # groups that follow it
        self._seen: dict[str, Decision | None] = {}
        self._fraction: dict[str, float] = {}
        self._remote: Mapping[str, Mapping[str, float | None]] = {}
        # Groups whose shares were resent in part: the rest follow at the next refresh.
        self._regroup: set[str] = set()


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

    def _match(self, root: Node | None, domain: str, bucket: Bucket) -> None:
        """Which groups `bucket` belongs to; moving it marks both groups."""
        self.visits += 1
        reached = buckets.target(domain, root, bucket.id)
        rule = None
        if reached is not None:
            rule = self._rules.get((domain, reached.parts))
            if rule is None or rule.target != reached:
                rule = self._rules[domain, reached.parts] = Group(target=reached)
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
                    admission = self._admissions[pipeline, priority] = Group(
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
            bucket.due, bucket.groups = ALLOWED, ()
            self._changed[bucket] = None

    def _follow(self, pipeline: str, group: Group) -> None:
        """`group` follows `pipeline`'s decision."""
        self._by_pipeline.setdefault(pipeline, {})[group] = None
        if pipeline not in self._seen:
            decision = self._seen[pipeline] = self._decisions_now.get(pipeline)
            if decision is not None:
                self._fraction[pipeline] = decision.fraction

    def _leave(self, bucket: Bucket) -> None:
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

    def _forget(self, group: Group) -> None:
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

    def _touch(self, bucket: Bucket, before: float | None, now: float) -> None:
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

    def _recompute(self, groups: list[Group]) -> None:
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
                # split() hands out one TokenShare per distinct share, so each is
                # interned once here, by identity, not hashed once per member.
                once: dict[int, TokenShare] = {}
                shares = split(verdict.rate, verdict.window_s, demands, verdict.burst_s)
                for m, share in shares.items():
                    interned = once.get(id(share))
                    if interned is None:
                        interned = once[id(share)] = self._share(share)
                    shares[m] = interned
                group.shares = shares
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

    def _settle(self, limit: int | None = None) -> None:
        """The assignments of the buckets whose groups moved: the stricter of their
        groups'. At most `limit` of them (the oldest); the rest stay unsettled."""
        unsettled = self._unsettled
        if limit is None or len(unsettled) <= limit:
            self._unsettled = {}
        else:
            unsettled = dict.fromkeys(itertools.islice(unsettled, limit))
            for bucket in unsettled:
                del self._unsettled[bucket]
        for bucket in unsettled:
            self._settle_one(bucket)

    def _settle_these(self, these: Iterable[Bucket]) -> None:
        """Settle these buckets now if they are unsettled (a report's, whose replies
        need their assignments); the others wait for the refresh's steps."""
        unsettled = self._unsettled
        for bucket in these:
            if unsettled.pop(bucket, 0) is None:
                self._settle_one(bucket)

    def _settle_one(self, bucket: Bucket) -> None:
        groups = [g for g in (bucket.rule, bucket.admission) if g is not None]
        bucket.groups = tuple(g.verdict.group for g in groups
                              if g.verdict.kind is Kind.SHARED)
        bucket.due = self._stricter(groups, bucket.member)

    def _stricter(self, groups: list[Group], member: str) -> Assignment:
        result = ALLOWED
        for group in groups:
            verdict = group.verdict
            if verdict.kind is Kind.DENY:
                return DENIED
            if verdict.kind is Kind.SHARED:
                share = group.shares.get(member) or equal_share(
                    verdict.rate, verdict.window_s,
                    len(group.members) + len(self._remote.get(verdict.group, ())),
                    verdict.burst_s)
                if result.share is None or share.rate < result.share.rate:
                    result = self._interned.get(share) or Assignment(Kind.SHARED, share)
        return result

