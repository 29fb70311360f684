"""Per-rule Prometheus counters, as the reference service keeps them.

Label values come from the config (a rule's stats key), so cardinality is
bounded by the config; a descriptor value becomes part of a label only for
rules with `detailed_metric`, and those are capped too.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from sitsmesh.ratelimit.config import Rule
from sitsmesh.ratelimit.store import Count

MAX_DETAILED_KEYS = 1000
OUTCOMES = ("total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode")


class RuleMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._hits = Counter(
            "sitsmesh_ratelimit_hits_total",
            "Hits per rate-limit rule (stats key) and outcome, counted as the reference does.",
            ["key", "outcome"], registry=registry)
        self._unknown = Counter("sitsmesh_ratelimit_unknown_domain_total",
                                "Requests for a domain no config defines.", registry=registry)
        self._global_shadow = Counter(
            "sitsmesh_ratelimit_global_shadow_mode_total",
            "Requests over limit let through by global shadow mode.", registry=registry)
        self._children: dict[str, tuple[Any, ...]] = {}
        self._detailed = 0

    def _for(self, key: str) -> tuple[Any, ...]:
        children = self._children.get(key)
        if children is None:
            children = tuple(self._hits.labels(key, o) for o in OUTCOMES)
            self._children[key] = children
        return children

    def record(self, rule: Rule, value: str, addend: int, count: Count, *, near: bool) -> None:
        key = rule.stats_key
        if rule.detailed_metric:
            detailed = f"{key}_{value}"
            if detailed in self._children or self._detailed < MAX_DETAILED_KEYS:
                if detailed not in self._children:
                    self._detailed += 1
                key = detailed
        total, over, near_c, within, shadow = self._for(key)
        total.inc(addend)
        if count.over:
            over.inc(addend)
            if rule.shadow_mode:
                shadow.inc(addend)
        else:
            within.inc(addend)
            if near:
                near_c.inc(addend)

    def unknown_domain(self) -> None:
        self._unknown.inc()

    def global_shadow(self) -> None:
        self._global_shadow.inc()
