"""The quotas of every connected Envoy: demand from their usage reports, verdicts from
the rate-limit config and the backpressure decisions, and what to send each stream.

One event loop owns it (the RLQS servicer's streams and a periodic refresh), so it
needs no lock. Nothing here is on Envoy's request path: Envoy enforces the
assignments itself and reports every 5 s. Every pass recomputes all buckets (they
number tenants x priorities x models per Envoy, and MAX_BUCKETS bounds them).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from sitsmesh.pressure.controller import Decision
from sitsmesh.quota import buckets
from sitsmesh.quota.buckets import Kind, Verdict
from sitsmesh.quota.split import TokenShare, split
from sitsmesh.ratelimit.config import Node

MAX_BUCKETS = 1_000    # per stream; past it new buckets are abandoned, not kept
IDLE_S = 300.0         # a bucket with no requests this long is abandoned (Envoy frees it)
CHANGE = 0.2           # a share that moved less than this is not worth a new bucket
SMOOTHING = 0.5        # weight of the newest report in a demand estimate


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



@dataclass
class _Bucket:
    id: dict[str, str]
    key: str
    demand: float | None = None  # requests/s this stream's Envoy saw, smoothed
    last_used: float = 0.0
    sent: Assignment | None = None
    due: Assignment | None = None  # what the last pass computed
    groups: tuple[str, ...] = ()   # the shared rates it takes part in


@dataclass
class Stream:
    """One Envoy's RLQS stream (one per Envoy and domain)."""

    name: str
    domain: str = ""
    buckets: dict[str, _Bucket] = field(default_factory=dict)


# (bucket id, what to send); None sends abandon_action: Envoy drops the bucket.
Update = tuple[dict[str, str], Assignment | None]
_Member = tuple[str, _Bucket]  # (stream name, bucket)


class QuotaService:
    def __init__(self, domains: Callable[[], Mapping[str, Node]],
                 decisions: Callable[[], Mapping[str, Decision]],
                 pipeline_for: Callable[[str, str, str], str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._domains = domains
        self._decisions = decisions
        self._pipeline_for = pipeline_for
        self._clock = clock
        self._names = itertools.count(1)
        self.streams: dict[str, Stream] = {}
        # Shared rates' members here (what the other replicas read), and theirs
        # (sitsmesh.quota.peers): group -> member -> demand.
        self.local_members: dict[str, dict[str, float | None]] = {}
        self.remote: Mapping[str, Mapping[str, float | None]] = {}
        # Groups whose shares were resent in part: the rest follow at the next refresh.
        self._regroup: set[str] = set()

    def open(self) -> Stream:
        stream = Stream(f"envoy-{next(self._names)}")
        self.streams[stream.name] = stream
        return stream

    def close(self, stream: Stream) -> None:
        self.streams.pop(stream.name, None)

    def report(self, stream: Stream, domain: str,
               usages: Iterable[tuple[dict[str, str], int, int, float]]) -> list[Update]:
        """Take one usage report (bucket id, allowed, denied, seconds it covers); return
        what to send this stream: every bucket it reported (a reply renews the TTLs)
        and abandons for idle or refused ones. Other streams' shares move too: the
        next `refresh` pushes them."""
        now = self._clock()
        if domain and not stream.domain:
            stream.domain = domain
        reported: list[_Bucket] = []
        abandon: list[Update] = []
        for bucket_id, allowed, denied, elapsed in usages:
            key = buckets.key_of(stream.domain, bucket_id)
            bucket = stream.buckets.get(key)
            if bucket is None:
                if buckets.check(bucket_id) or len(stream.buckets) >= MAX_BUCKETS:
                    abandon.append((bucket_id, None))
                    continue
                bucket = _Bucket(bucket_id, key, last_used=now)
                stream.buckets[key] = bucket
            if allowed or denied:
                bucket.last_used = now
            if elapsed > 0:
                rate = (allowed + denied) / elapsed
                bucket.demand = rate if bucket.demand is None else (
                    SMOOTHING * rate + (1 - SMOOTHING) * bucket.demand)
            if now - bucket.last_used > IDLE_S:
                del stream.buckets[key]
                abandon.append((bucket_id, None))
                continue
            reported.append(bucket)
        self._compute()
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
        one Envoy's report moves every other Envoy's share."""
        self._compute()
        everyone = [b for stream in self.streams.values() for b in stream.buckets.values()]
        for bucket in everyone:
            if bucket.due is not None and not bucket.due.close_to(bucket.sent):
                self._regroup.update(bucket.groups)
        pushes: dict[str, list[Update]] = {}
        for stream in self.streams.values():
            for bucket in stream.buckets.values():
                if self._moved(bucket) and bucket.due is not None:
                    bucket.sent = bucket.due
                    pushes.setdefault(stream.name, []).append((bucket.id, bucket.due))
        self._regroup.clear()
        return pushes

    def _compute(self) -> None:
        """Every bucket's `due` assignment: the stricter of its rule's and its
        pipeline's verdicts, a shared rate split among the group's buckets by demand."""
        decisions = self._decisions()
        domains = self._domains()
        fraction = {name: d.fraction for name, d in decisions.items()}
        verdicts: dict[tuple[str, str], list[Verdict]] = {}
        groups: dict[str, list[_Member]] = {}
        admission: dict[tuple[str, int], list[_Member]] = {}
        for stream in self.streams.values():
            root = domains.get(stream.domain)
            for bucket in stream.buckets.values():
                verdict = buckets.rule_verdict(stream.domain, root, bucket.id, fraction)
                verdicts[stream.name, bucket.key] = [verdict]
                if verdict.kind is Kind.SHARED:
                    groups.setdefault(verdict.group, []).append((stream.name, bucket))
                priority = buckets.priority_of(bucket.id)
                pipeline = self._pipeline_for(bucket.id.get("pipeline", ""),
                                              bucket.id.get("model", ""),
                                              bucket.id.get("tenant", ""))
                if pipeline and priority is not None:
                    admission.setdefault((pipeline, priority), []).append(
                        (stream.name, bucket))
        for (pipeline, priority), members in admission.items():
            group = buckets.admission_group(pipeline, priority)
            demand = sum(b.demand or 0.0 for _, b in members) + sum(
                d or 0.0 for d in self.remote.get(group, {}).values())
            verdict = buckets.admission_verdict(pipeline, decisions.get(pipeline),
                                                priority, demand)
            for name, bucket in members:
                verdicts[name, bucket.key].append(verdict)
            if verdict.kind is Kind.SHARED:
                groups[verdict.group] = members
        self.local_members = {group: {f"{n}\x1f{b.key}": b.demand for n, b in members}
                              for group, members in groups.items()}
        shares = {group: self._split(group, members, verdicts)
                  for group, members in groups.items()}
        for stream in self.streams.values():
            for bucket in stream.buckets.values():
                bucket.groups = tuple(v.group for v in verdicts[stream.name, bucket.key]
                                      if v.kind is Kind.SHARED)
                bucket.due = _stricter(verdicts[stream.name, bucket.key], shares,
                                       f"{stream.name}\x1f{bucket.key}")

    def _split(self, group: str, members: list[_Member],
               verdicts: Mapping[tuple[str, str], list[Verdict]]) -> dict[str, TokenShare]:
        """The group's rate across its members here and on the other replicas."""
        name, first = members[0]
        verdict = next(v for v in verdicts[name, first.key] if v.group == group)
        demands = {**self.remote.get(group, {}), **self.local_members[group]}
        return split(verdict.rate, verdict.window_s, demands, verdict.burst_s)


def _stricter(verdicts: list[Verdict], shares: Mapping[str, Mapping[str, TokenShare]],
              member: str) -> Assignment:
    result = Assignment(Kind.ALLOW)
    for verdict in verdicts:
        if verdict.kind is Kind.DENY:
            return Assignment(Kind.DENY)
        if verdict.kind is Kind.SHARED:
            share = shares[verdict.group][member]
            if result.share is None or share.rate < result.share.rate:
                result = Assignment(Kind.SHARED, share)
    return result
