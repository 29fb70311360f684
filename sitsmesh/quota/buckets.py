"""What governs one RLQS bucket, and the verdicts across all Envoys. Pure.

A bucket id is a map Envoy builds per request (filters/fragments/rate_limit_quota.yaml
builds tenant, priority and model from the headers ext_authz sets). Two things can
govern it, and the stricter wins:
- the rule of the stream's domain, in envoyproxy/ratelimit's format, that its
  entries reach down the descriptor tree (a map has no order: the tree gives it;
  entries the tree does not ask for are left out, and `name` is a label);
- with `priority` and `model` (or `pipeline`) entries, that pipeline's backpressure
  decision for the priority.
Buckets that reach the same rule (or the same pipeline and priority) share one
global rate, whichever Envoy reports them. A bucket nothing governs is allowed, as
the reference allows a descriptor with no limit.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from sitsmesh.pressure.admit import BURST_S
from sitsmesh.pressure.controller import Decision
from sitsmesh.ratelimit.config import Node, Rule
from sitsmesh.ratelimit.match import match, step

LABEL = "name"
BRAKE = 2.0
MAX_ENTRIES = 16
MAX_TEXT = 256


class Kind(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    SHARED = "shared"  # a global rate, split across the Envoys that report the bucket


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: Kind
    rate: float = 0.0   # requests/s across every Envoy (SHARED)
    window_s: int = 1   # the rule's window: the longest a fill may last
    why: str = ""       # the rule's stats key, or the pipeline
    group: str = ""     # buckets of one group share the rate
    burst_s: float = 1.0  # the token bucket holds this long of its rate


ALLOW = Verdict(Kind.ALLOW)


def key_of(domain: str, bucket: Mapping[str, str]) -> str:
    """One string per bucket and domain, the same whatever order the map came in."""
    return "\x1f".join([domain, *(f"{k}\x1e{v}" for k, v in sorted(bucket.items()))])


def check(bucket: Mapping[str, str]) -> str:
    """Why a bucket id is refused ('' when it is fine): ids are kept per stream."""
    if not bucket:
        return "a bucket_id has no entries"
    if len(bucket) > MAX_ENTRIES:
        return f"a bucket_id has {len(bucket)} entries (at most {MAX_ENTRIES})"
    for key, value in bucket.items():
        if len(key) > MAX_TEXT or len(value) > MAX_TEXT:
            return f"a bucket_id entry is longer than {MAX_TEXT} characters"
    return ""


def admission_group(pipeline: str, priority: int) -> str:
    """The shared rate of one pipeline's priority, whichever Envoys report it."""
    return f"pipeline\x1f{pipeline}\x1f{priority}"


def priority_of(bucket: Mapping[str, str]) -> int | None:
    text = bucket.get("priority", "")
    return int(text) if text.isdigit() and len(text) < 3 else None


def walk(root: Node, bucket: Mapping[str, str]) -> list[tuple[str, str]]:
    """The bucket's entries the descriptor tree reaches, in the tree's order."""
    remaining = {k: v for k, v in bucket.items() if k != LABEL}
    ordered: list[tuple[str, str]] = []
    level = root
    while remaining:
        for key in sorted(remaining):
            value = remaining[key]
            node, _ = step(level, key, f"{key}_{value}")
            if node is not None:
                ordered.append((key, value))
                del remaining[key]
                level = node
                break
        else:
            break
    return ordered


@dataclass(frozen=True, slots=True)
class Target:
    """The rules a bucket reaches in one domain's tree: buckets with one target share
    its rate. The verdict depends on nothing else but the pipelines' admitted
    fractions, so it is computed once per target, not per bucket."""

    domain: str
    parts: tuple[str, ...]
    rules: tuple[Rule, ...]

    @property
    def adaptive(self) -> frozenset[str]:
        return frozenset(r.adaptive_pipeline for r in self.rules if r.adaptive_pipeline)

    def verdict(self, fraction: Mapping[str, float]) -> Verdict:
        if not self.rules or any(r.shadow_mode for r in self.rules):
            return ALLOW
        rule = min(self.rules, key=lambda r: _rate(r, fraction))
        rate = _rate(rule, fraction)
        group = "\x1f".join(("rule", self.domain, *self.parts, str(rule.index)))
        if rate <= 0:
            return Verdict(Kind.DENY, why=rule.stats_key, group=group)
        return Verdict(Kind.SHARED, rate, rule.window_s, rule.stats_key, group)


def target(domain: str, root: Node | None, bucket: Mapping[str, str]) -> Target | None:
    """The target `bucket` reaches in one domain's tree; None: no rule governs it."""
    if root is None:
        return None
    ordered = walk(root, bucket)
    if not ordered:
        return None
    node, parts, _ = match(root, ordered)
    rules = tuple(r for r in (node.rules if node is not None else ()) if not r.unlimited)
    if not rules or any(r.shadow_mode for r in rules):
        return None
    return Target(domain, tuple(parts), rules)


def rule_verdict(domain: str, root: Node | None, bucket: Mapping[str, str],
                 fraction: Mapping[str, float]) -> Verdict:
    """The verdict of the rule `bucket` reaches in one domain's tree. `fraction`: the
    admitted fraction of each pipeline, for adaptive rules."""
    reached = target(domain, root, bucket)
    return ALLOW if reached is None else reached.verdict(fraction)


def _rate(rule: Rule, fraction: Mapping[str, float]) -> float:
    scale = fraction.get(rule.adaptive_pipeline, 1.0) if rule.adaptive_pipeline else 1.0
    return rule.requests_per_unit * scale / max(1, rule.window_s)


def admission_verdict(pipeline: str, decision: Decision | None, priority: int,
                      demand: float) -> Verdict:
    """A priority's verdict from its pipeline's decision, as Check would apply it.

    Protected: allowed. While the requests in flight are at BRAKE times the decision's
    cap: denied.
    Over the admission level: allowed. Under it: the level's share of
    its arrivals, or what the bottleneck's budget (the decision's admit rate) leaves
    after every priority over it, whichever is more; nothing left: denied. Arrivals
    come from the decision (counted where Check runs) or, without them, from the
    buckets' reported `demand` (requests/s, all Envoys)."""
    group = admission_group(pipeline, priority)
    if decision is None or priority >= decision.protected_from:
        return Verdict(Kind.ALLOW, why=pipeline, group=group)
    if decision.concurrency and decision.in_flight >= BRAKE * decision.concurrency:
        # An emergency brake for what Check's in-flight cap does per request: a quota is
        # a rate, and a surge queued past the SLA before the level caught up. At the cap
        # itself a tick-long DENY_ALL flapped on and off and starved the priority.
        return Verdict(Kind.DENY, why=pipeline, group=group)
    if decision.cutoff <= priority:
        return Verdict(Kind.ALLOW, why=pipeline, group=group)
    rates = decision.priority_rates
    arriving = rates[priority] if priority < len(rates) and rates[priority] > 0 else demand
    admitted = max(0.0, priority + 1 - decision.cutoff) * arriving
    if decision.admit_rate > 0 and rates:
        admitted = max(admitted, decision.admit_rate - sum(rates[priority + 1:]))
    if admitted < 0.5:
        return Verdict(Kind.DENY, why=pipeline, group=group)
    # A small burst, as Check's budget (pressure.admit.BURST_S): Envoy starts every new
    # token bucket full, and a second's worth on each change queued at the bottleneck.
    return Verdict(Kind.SHARED, admitted, 1, pipeline, group, BURST_S)
