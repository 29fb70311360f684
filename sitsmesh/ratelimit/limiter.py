"""ShouldRateLimit as plain Python: match descriptors to rules, count, decide.

No grpc here: the transport turns protobuf into `Descriptor`s and the
`Decision` back into a response. The config is read through a holder whose
reference is swapped on reload, so a request sees one whole snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sitsmesh.errors import Code, SitsmeshError
from sitsmesh.pressure.gate import PressureGate
from sitsmesh.ratelimit.config import (
    NOT_LOADED,
    UNIT_SECONDS,
    Algorithm,
    RateLimitConfig,
    Rule,
    Unit,
)
from sitsmesh.ratelimit.match import detailed_key, match
from sitsmesh.ratelimit.metrics import RuleMetrics
from sitsmesh.ratelimit.store import Count, CounterStore, Hit

DEFAULT_MAX_HITS_ADDEND = 1_000_000
UNLIMITED_REMAINING = 2**32 - 1


class RequestError(SitsmeshError):
    code = Code.INVALID_ARGUMENT


class NoConfigError(SitsmeshError):
    """No rate-limit config has loaded yet; the reference answers every call with this
    plain (UNKNOWN) error until one does."""

    code = Code.UNKNOWN


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what one ShouldRateLimit may carry; beyond them INVALID_ARGUMENT."""

    descriptors: int = 64
    entries: int = 16
    key_length: int = 256
    value_length: int = 1024
    hits_addend: int = DEFAULT_MAX_HITS_ADDEND


@dataclass(slots=True)
class Descriptor:
    entries: Sequence[tuple[str, str]]
    # Per-descriptor hits_addend when the request set one (0 = check without counting).
    addend: int | None = None
    # Envoy's per-route limit override: (requests_per_unit, unit).
    override: tuple[int, int] | None = None


@dataclass(slots=True)
class Status:
    over: bool
    rule: Rule | None
    remaining: int
    reset_s: float


@dataclass(slots=True)
class Decision:
    over: bool
    statuses: list[Status]
    # The config `metadata` of each descriptor's matched node, by descriptor index.
    metadata: dict[int, Any] | None = None
    # Quota-mode descriptors that went over (None: no quota-mode descriptor matched).
    violations: list[int] | None = None


class ConfigHolder:
    """The live snapshot. Reload swaps `current` in one assignment."""

    __slots__ = ("current",)

    def __init__(self, config: RateLimitConfig) -> None:
        self.current = config


# A matched descriptor: the rules that apply with their counter keys and stats keys ("": the
# rule's own), and the node's metadata.
_Match = tuple[tuple[tuple[Rule, str, str], ...], "dict[str, Any] | None"]
_NO_MATCH: _Match = ((), None)
MATCH_CACHE_SIZE = 65_536
DEFAULT_CACHE_BYTES = 16 << 20
# CPython object overheads for the cache's estimate: a dict slot with its key tuple,
# one (key, value) pair with two str headers, one counter-key str with its rule tuple.
_ENTRY_BYTES = 250
_PAIR_BYTES = 170
_KEY_BYTES = 130


def _cache_cost(domain: str, entries: tuple[tuple[str, str], ...], found: _Match) -> int:
    cost = _ENTRY_BYTES + len(domain)
    for key, value in entries:
        cost += _PAIR_BYTES + len(key) + len(value)
    for _, counter_key, stats_key in found[0]:
        cost += _KEY_BYTES + len(counter_key) + len(stats_key)
    return cost


class RateLimiter:
    __slots__ = ("_cache", "_cache_budget", "_cache_bytes", "_cache_config", "_clock", "_gate",
                 "_global_quota", "_global_shadow", "_holder", "_limits", "_metrics",
                 "_stop_increment", "_store")

    def __init__(self, holder: ConfigHolder, store: CounterStore, metrics: RuleMetrics,
                 *, clock: Callable[[], float] = time.time, global_shadow: bool = False,
                 max_descriptors: int = 64, gate: PressureGate | None = None,
                 limits: RequestLimits | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, quota_mode: bool = False,
                 stop_increment_when_over: bool = False) -> None:
        self._holder = holder
        self._gate = gate
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._global_shadow = global_shadow
        self._global_quota = quota_mode
        self._stop_increment = stop_increment_when_over
        self._limits = limits or RequestLimits(descriptors=max_descriptors)
        # (domain, entries) -> match; the tree walk and key building happen once per
        # distinct descriptor and snapshot, not once per request. Only matches are kept,
        # and only up to a byte budget: descriptor values are the caller's, and a count
        # bound alone let 60 KB values hold gigabytes.
        self._cache: dict[tuple[str, tuple[tuple[str, str], ...]], _Match] = {}
        self._cache_config: RateLimitConfig | None = None
        self._cache_bytes = 0
        self._cache_budget = cache_bytes

    @property
    def cache_bytes(self) -> int:
        """The match cache's estimated size."""
        return self._cache_bytes

    def _lookup(self, config: RateLimitConfig, domain: str,
                entries: tuple[tuple[str, str], ...]) -> _Match:
        if config is not self._cache_config:
            self._cache.clear()
            self._cache_bytes = 0
            self._cache_config = config
        cache_key = (domain, entries)
        found = self._cache.get(cache_key)
        if found is not None:
            return found
        root = config.domains.get(domain)
        if root is None:
            return _NO_MATCH
        node, parts, named = match(root, entries)
        if node is None:
            return _NO_MATCH
        base = f"{domain}_{'_'.join(parts)}"
        stats = f"{domain}." + ".".join(named) if named is not None else ""
        found = (tuple((rule, f"{base}#{rule.index}" if rule.index else base,
                        detailed_key(domain, entries, parts) if rule.detailed_metric
                        else stats if stats != rule.stats_key else "")
                       for rule in node.rules),
                 dict(node.metadata) if node.metadata else None)
        cost = _cache_cost(domain, entries, found)
        if (self._cache_bytes + cost > self._cache_budget
                or len(self._cache) >= MATCH_CACHE_SIZE):
            # Cleared whole, not trimmed: refilling costs one tree walk per descriptor.
            self._cache.clear()
            self._cache_bytes = 0
        if cost <= self._cache_budget:
            self._cache[cache_key] = found
            self._cache_bytes += cost
        return found

    async def check(self, domain: str, descriptors: Sequence[Descriptor],
                    hits_addend: int = 0) -> Decision:
        if not domain:
            raise RequestError("rate limit domain must not be empty")
        count_in = len(descriptors)
        if not count_in:
            raise RequestError("rate limit descriptor list must not be empty")
        limits = self._limits
        if count_in > limits.descriptors:
            raise RequestError(f"too many descriptors: {count_in} > {limits.descriptors}")
        if hits_addend > limits.hits_addend:
            raise RequestError(f"hits_addend {hits_addend} exceeds {limits.hits_addend}")
        if len(domain) > limits.key_length:
            raise RequestError(f"domain is {len(domain)} characters, more than "
                               f"{limits.key_length}")
        config = self._holder.current
        if config is NOT_LOADED:
            raise NoConfigError("no rate limit configuration loaded")
        matched, metadata = self._collect(config, domain, descriptors,
                                          hits_addend if hits_addend > 1 else 1)
        statuses = [Status(False, None, 0, 0.0) for _ in descriptors]
        hits: list[Hit] = []
        counted: list[tuple[int, Rule, int, str]] = []
        oversized: dict[int, Count] = {}
        arrived: set[str] | None = None  # pipelines this request counted as an arrival at
        for i, rule, key, addend, stats in matched:
            if rule.unlimited:
                if statuses[i].rule is None:
                    statuses[i] = Status(False, rule, UNLIMITED_REMAINING, 0.0)
                continue
            limit = rule.requests_per_unit
            if rule.adaptive_pipeline:
                arrived = arrived if arrived is not None else set()
                limit = self._adaptive(rule, limit, arrived)
            if addend > limit and rule.algorithm is not Algorithm.FIXED_WINDOW:
                # Can never fit, and these algorithms never count a rejected hit: answer
                # without the round trip. (A fixed window counts it, as the reference does,
                # unless count_rejected_hits is off.)
                oversized[len(counted)] = Count(True, 0, float(rule.window_s), addend)
            else:
                hits.append(Hit(key, rule.algorithm, limit, rule.window_s, addend))
            counted.append((i, rule, addend, stats))
        now = self._clock()
        if self._stop_increment and len(hits) > 1:
            await self._spare_the_others(hits, now)
        counts = await self._store.hit(hits, now) if hits else []
        if oversized:
            stored = iter(counts)
            counts = [oversized[n] if n in oversized else next(stored)
                      for n in range(len(counted))]
        over_any, violations = self._decide(descriptors, counted, counts, statuses)
        if over_any and self._global_shadow:
            self._metrics.global_shadow()
            over_any = False
        return Decision(over_any, statuses, metadata, violations)

    async def _spare_the_others(self, hits: list[Hit], now: float) -> None:
        """STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT: when some counter would go over, only
        the counters that would go over are incremented, so a rejected request does not use
        up the quota of its other descriptors. Costs a read round trip first, as in the
        reference (which reads before it increments, not atomically)."""
        peeked = await self._store.hit(
            [Hit(h.key, h.algorithm, h.limit, h.window_s, 0) for h in hits], now)
        over = [h.algorithm is Algorithm.FIXED_WINDOW and c.used + h.addend > h.limit
                for h, c in zip(hits, peeked, strict=True)]
        if any(over):
            for hit, goes_over in zip(hits, over, strict=True):
                if not goes_over:
                    hit.addend = 0

    def _adaptive(self, rule: Rule, limit: int, arrived: set[str]) -> int:
        """The rule's limit scaled by its pipeline's admitted fraction (at least 1). The
        request counts once as an arrival at each pipeline, however many rules name it."""
        gate = self._gate
        if gate is None:
            return limit
        pipeline = rule.adaptive_pipeline
        if pipeline not in arrived:
            arrived.add(pipeline)
            gate.rate_limited(pipeline)
        return max(1 if limit else 0, int(limit * gate.fraction(pipeline)))

    def _collect(self, config: RateLimitConfig, domain: str, descriptors: Sequence[Descriptor],
                 default_addend: int
                 ) -> tuple[list[tuple[int, Rule, str, int, str]], dict[int, Any] | None]:
        """(descriptor index, rule, counter key, addend, stats key) for every rule that
        applies."""
        self._validate(descriptors)
        matched: list[tuple[int, Rule, str, int, str]] = []
        metadata: dict[int, Any] | None = None
        for i, d in enumerate(descriptors):
            entries = d.entries
            addend = d.addend
            if addend is None:
                addend = default_addend
            if d.override is not None:
                # As envoyproxy/ratelimit: the domain is checked first, so an override on a
                # domain with no config limits nothing (one with config applies it, even
                # where no rule matches and on a descriptor with no entries).
                if domain in config.domains:
                    matched.append((i, _override_rule(domain, d),
                                    f"{domain}_{_plain_key(entries)}", addend, ""))
                continue
            if type(entries) is not tuple:
                entries = tuple(entries)
            rules, node_metadata = self._lookup(config, domain, entries)
            if node_metadata:
                metadata = metadata or {}
                metadata[i] = node_metadata
            for rule, key, stats in rules:
                matched.append((i, rule, key, addend, stats))
        if domain not in config.domains:
            self._metrics.unknown_domain(len(descriptors))  # once per descriptor, as there
        if len(matched) > 1:
            replaced = {name for _, rule, _, _, _ in matched for name in rule.replaces}
            if replaced:
                matched = [m for m in matched if m[1].name not in replaced]
        if metadata:
            # As the reference: only a limit that counts (not unlimited, not replaced)
            # brings its node's metadata.
            counting = {m[0] for m in matched if not m[1].unlimited}
            metadata = {i: m for i, m in metadata.items() if i in counting} or None
        return matched, metadata

    def _validate(self, descriptors: Sequence[Descriptor]) -> None:
        """Every bound, before anything is matched or cached: bad input changes nothing."""
        limits = self._limits
        max_key, max_value = limits.key_length, limits.value_length
        for i, d in enumerate(descriptors):
            entries = d.entries
            # A descriptor with no entries matches nothing: OK, no limit (as the reference).
            if len(entries) > limits.entries:
                raise RequestError(f"descriptor {i} has {len(entries)} entries, more than "
                                   f"{limits.entries}")
            for key, value in entries:
                if len(key) > max_key or len(value) > max_value:
                    raise RequestError(
                        f"descriptor {i}: entry key or value too long ({len(key)} and "
                        f"{len(value)} characters; at most {max_key} and {max_value})")
            if d.addend is not None and d.addend > limits.hits_addend:
                raise RequestError(f"descriptor {i}: hits_addend {d.addend} exceeds "
                                   f"{limits.hits_addend}")

    def _decide(self, descriptors: Sequence[Descriptor],
                counted: list[tuple[int, Rule, int, str]],
                counts: list[Count], statuses: list[Status]) -> tuple[bool, list[int] | None]:
        """Fold each rule's count into its descriptor's status; the tightest rule wins.

        As envoyproxy/ratelimit: a quota-mode descriptor that went over still says
        OVER_LIMIT, but the whole answer is OVER_LIMIT only when some other descriptor
        is over, or every quota-mode descriptor of the request is."""
        over_any = False
        violations: set[int] = set()
        quota: set[int] = set()
        for (i, rule, addend, stats), count in zip(counted, counts, strict=True):
            over = count.over
            self._metrics.record(rule, addend, count, stats_key=stats)
            if over and rule.shadow_mode:
                over = False
            if rule.quota_mode or self._global_quota:
                quota.add(i)
                if over:
                    violations.add(i)
            elif over:
                over_any = True
            current = statuses[i]
            if (current.rule is None or current.rule.unlimited
                    or (over and not current.over)
                    or (over == current.over and count.remaining < current.remaining)):
                statuses[i] = Status(over, rule, 0 if over else count.remaining, count.reset_s)
        if quota and violations >= quota:
            over_any = True
        return over_any, (sorted(violations) if quota else None)


def _plain_key(entries: Sequence[tuple[str, str]]) -> str:
    return "_".join(f"{k}_{v}" if v else k for k, v in entries)


def _override_rule(domain: str, d: Descriptor) -> Rule:
    assert d.override is not None
    rpu, unit_value = d.override
    try:
        unit = Unit(unit_value)
    except ValueError:
        raise RequestError(f"limit override has an invalid unit {unit_value}") from None
    stats_key = f"{domain}.{'.'.join(f'{k}_{v}' if v else k for k, v in d.entries)}"
    return Rule(stats_key=stats_key, requests_per_unit=rpu, unit=unit,
                window_s=UNIT_SECONDS[unit], algorithm=Algorithm.FIXED_WINDOW)
