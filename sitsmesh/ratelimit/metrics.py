"""Per-rule Prometheus counters, as the reference service keeps them.

The request path only adds to plain lists; `flush()` (every second, from a
background task) moves the sums into prometheus-client, whose increments take
a lock each. Scrapes therefore lag by at most a flush interval.

Label values come from the config (a rule's stats key), so cardinality is
bounded by the config; a descriptor value becomes part of a label only for
rules with `detailed_metric` and for Envoy's per-route limit overrides (whose
key is the descriptor itself). Those come from the caller, so every key past
MAX_KEYS or MAX_KEY_BYTES is counted under the one key `overflow`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from sitsmesh import logs
from sitsmesh.ratelimit.config import Rule
from sitsmesh.ratelimit.store import Count

MAX_DETAILED_KEYS = 1000
MAX_KEYS = 10_000
MAX_KEY_BYTES = 1 << 20
OVERFLOW_KEY = "overflow"
_log = logs.get("sitsmesh.ratelimit")
OUTCOMES = ("total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode")
DEFAULT_NEAR_LIMIT_RATIO = 0.8
# Limits seen with their near thresholds; per-route overrides bring caller-chosen limits.
MAX_NEAR_THRESHOLDS = 4096
_FLOAT32 = struct.Struct("f")


def _float32(x: float) -> float:
    return float(_FLOAT32.unpack(_FLOAT32.pack(x))[0])


def near_threshold(limit: int, ratio: float) -> int:
    """envoyproxy/ratelimit's `floor(float32(limit) * ratio)`: the product is taken in
    float32 there, so large limits and ratios like 0.7 land where the reference puts them."""
    return math.floor(_float32(_float32(float(limit)) * _float32(ratio)))


class RuleMetrics:
    def __init__(self, registry: CollectorRegistry | None,
                 near_ratio: float = DEFAULT_NEAR_LIMIT_RATIO) -> None:
        self._near_ratio = near_ratio
        self._near: dict[int, int] = {}
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
        self._pending: dict[str, list[int]] = {}
        self._detailed: set[str] = set()
        self._keys: set[str] = set()
        self._key_bytes = 0
        self._unknown_pending = 0
        self._global_shadow_pending = 0

    def _for(self, key: str) -> tuple[Any, ...]:
        children = self._children.get(key)
        if children is None:
            children = tuple(self._hits.labels(key, o) for o in OUTCOMES)
            self._children[key] = children
        return children

    def _near_for(self, limit: int) -> int:
        if len(self._near) >= MAX_NEAR_THRESHOLDS:
            self._near.clear()
        near = self._near[limit] = near_threshold(limit, self._near_ratio)
        return near

    def record(self, rule: Rule, addend: int, count: Count, *, stats_key: str = "") -> None:
        """One rule's hit, in the reference's amounts (its base_limiter): a hit that
        crosses the near threshold or the limit is split between the outcomes."""
        key = stats_key or rule.stats_key
        if rule.detailed_metric and stats_key:
            # The request's values name the key: at most MAX_DETAILED_KEYS of them.
            if stats_key in self._detailed or len(self._detailed) < MAX_DETAILED_KEYS:
                self._detailed.add(stats_key)
            else:
                key = rule.stats_key
        acc = self._pending.get(key)
        if acc is None:
            # Once per key and flush: a key's first sight decides whether it gets a label.
            if key not in self._keys:
                if len(self._keys) >= MAX_KEYS or self._key_bytes + len(key) > MAX_KEY_BYTES:
                    key = OVERFLOW_KEY
                else:
                    self._keys.add(key)
                    self._key_bytes += len(key)
                acc = self._pending.get(key)
            if acc is None:
                acc = self._pending[key] = [0, 0, 0, 0, 0]
        acc[0] += addend
        limit = rule.requests_per_unit
        after = count.used
        before = after - addend
        near = self._near.get(limit)
        if near is None:
            near = self._near_for(limit)
        if count.over:
            if before >= limit or after <= limit:
                # after <= limit: the store did not count the rejected hit (sliding window,
                # gcra) or an adaptive limit was below the configured one; all of it was over.
                over = addend
            else:
                over = after - limit
                acc[2] += limit - max(near, before)
            acc[1] += over
            if rule.shadow_mode:
                acc[4] += over
        else:
            acc[3] += addend
            if after > near:
                acc[2] += addend if before >= near else after - near

    def unknown_domain(self, descriptors: int = 1) -> None:
        self._unknown_pending += descriptors

    def global_shadow(self) -> None:
        self._global_shadow_pending += 1

    def flush(self) -> None:
        """Move the sums gathered on the request path into prometheus-client."""
        pending, self._pending = self._pending, {}
        for key, acc in pending.items():
            for child, amount in zip(self._for(key), acc, strict=True):
                if amount:
                    child.inc(amount)
            if acc[4]:
                # Shadow decisions are logged here, summed per flush, not once per request.
                _log.info("shadow mode let over-limit hits through", key=key, hits=acc[4])
        if self._unknown_pending:
            self._unknown.inc(self._unknown_pending)
            self._unknown_pending = 0
        if self._global_shadow_pending:
            _log.info("global shadow mode let over-limit requests through",
                      requests=self._global_shadow_pending)
            self._global_shadow.inc(self._global_shadow_pending)
            self._global_shadow_pending = 0


class _Tallied(Protocol):
    errors: int
    fallbacks: int


class StoreCounters(Collector):
    """Reads the resilient store's own tallies at scrape time: nothing on the hot path."""

    def __init__(self, store: _Tallied) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        errors = CounterMetricFamily("sitsmesh_ratelimit_store_errors",
                                     "Counter-store calls that failed or timed out.")
        errors.add_metric([], self._store.errors)
        fallbacks = CounterMetricFamily(
            "sitsmesh_ratelimit_store_fallbacks",
            "ShouldRateLimit calls answered by on_store_error instead of the store.")
        fallbacks.add_metric([], self._store.fallbacks)
        yield errors
        yield fallbacks


def store_up_gauge(registry: CollectorRegistry | None) -> Gauge:
    """1 while the shared store answers; the lowest value wins across worker processes."""
    up = Gauge("sitsmesh_ratelimit_store_up", "1 while the shared counter store answers.",
               registry=registry, multiprocess_mode="min")
    up.set(1)
    return up
