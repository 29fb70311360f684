"""The limiter with the memory store and an injected clock: reference answers and extensions."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from sitsmesh.ratelimit import config as rlconfig
from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.limiter import (
    UNLIMITED_REMAINING,
    ConfigHolder,
    Decision,
    Descriptor,
    RateLimiter,
    RequestError,
)
from sitsmesh.ratelimit.memory import MemoryStore
from sitsmesh.ratelimit.metrics import RuleMetrics
from sitsmesh.ratelimit.store import Hit, fixed_window

CONFIG = """
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: {unit: day, requests_per_unit: 2}
  - key: path
    value: /api/*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: file
    value: f*
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: soft
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: quota
    quota_mode: true
    metadata: {plan: gold}
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: ldap
    rate_limit: {unlimited: true}
  - key: tenant
    rate_limits:
      - {unit: second, requests_per_unit: 2, name: burst}
      - {unit: minute, requests_per_unit: 3, name: sustained}
  - key: k1
    value: v1
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 1, name: specific}
  - key: k2
    value: v2
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 5, replaces: [{name: specific}]}
  - key: win
    rate_limit: {unit: second, unit_multiplier: 30, requests_per_unit: 2}
"""


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FlushingRegistry(CollectorRegistry):
    """Flushes the limiter's pending metric sums before each read, as the flush task would."""

    metrics: RuleMetrics

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None
                         ) -> float | None:
        self.metrics.flush()
        return super().get_sample_value(name, labels)


def _limiter(clock: Clock, *, shadow: bool = False) -> tuple[RateLimiter, CollectorRegistry]:
    registry = FlushingRegistry()
    registry.metrics = RuleMetrics(registry)
    holder = ConfigHolder(rlconfig.build([("c.yaml", CONFIG)]))
    return RateLimiter(holder, MemoryStore(), registry.metrics, clock=clock,
                       global_shadow=shadow), registry


def d(*pairs: str, addend: int | None = None) -> Descriptor:
    it = iter(pairs)
    return Descriptor(tuple(zip(it, it, strict=True)), addend)


async def _codes(limiter: RateLimiter, n: int, *descs: Descriptor) -> list[Decision]:
    return [await limiter.check("edge", descs) for _ in range(n)]


async def test_key_only_rule_counts_each_value_apart_and_exact_value_wins() -> None:
    limiter, registry = _limiter(Clock())
    results = await _codes(limiter, 4, d("remote_address", "1.1.1.1"))
    assert [r.over for r in results] == [False, False, False, True]
    assert [r.statuses[0].remaining for r in results] == [2, 1, 0, 0]
    assert results[0].statuses[0].rule is not None
    assert results[0].statuses[0].rule.requests_per_unit == 3
    assert not (await limiter.check("edge", [d("remote_address", "2.2.2.2")])).over
    assert (await limiter.check("edge", [d("remote_address", "50.0.0.5")])).over
    assert registry.get_sample_value("sitsmesh_ratelimit_hits_total",
                                     {"key": "edge.remote_address", "outcome": "over_limit"}) == 1


async def test_window_resets_and_duration_until_reset() -> None:
    clock = Clock(1_000_000.25)
    limiter, _ = _limiter(clock)
    for _ in range(3):
        await limiter.check("edge", [d("remote_address", "a")])
    over = await limiter.check("edge", [d("remote_address", "a")])
    # Whole seconds, as the reference's clock ticks: 1 s window - (now mod 1) = 1, not 0.75.
    assert over.over and over.statuses[0].reset_s == 1.0
    clock.now += 1
    assert not (await limiter.check("edge", [d("remote_address", "a")])).over


async def test_nested_descriptor_and_depth_mismatch() -> None:
    limiter, _ = _limiter(Clock())
    nested = d("message_type", "marketing", "to_number", "206")
    assert [r.over for r in await _codes(limiter, 3, nested)] == [False, False, True]
    # One entry only: the config needs two levels, so no limit applies.
    shallow = await limiter.check("edge", [d("message_type", "marketing")])
    assert shallow.statuses[0].rule is None and not shallow.over


async def test_wildcards_share_or_split_counters() -> None:
    limiter, _ = _limiter(Clock())
    shared = [await limiter.check("edge", [d("path", f"/api/{n}")]) for n in ("a", "b", "c")]
    assert [r.over for r in shared] == [False, False, True]
    split = [await limiter.check("edge", [d("file", f"f{n}")]) for n in ("1", "2", "1")]
    assert [r.over for r in split] == [False, False, True]


async def test_shadow_mode_reports_ok_and_counts() -> None:
    limiter, registry = _limiter(Clock())
    results = await _codes(limiter, 3, d("soft", "x"))
    assert not any(r.over for r in results)
    assert registry.get_sample_value("sitsmesh_ratelimit_hits_total",
                                     {"key": "edge.soft", "outcome": "shadow_mode"}) == 2


async def test_global_shadow_mode_never_enforces() -> None:
    limiter, registry = _limiter(Clock(), shadow=True)
    results = await _codes(limiter, 5, d("remote_address", "z"))
    assert not any(r.over for r in results)
    assert registry.get_sample_value("sitsmesh_ratelimit_global_shadow_mode_total") == 2


async def test_quota_mode_reports_violations_and_denies_only_when_every_quota_is_over(
) -> None:
    """As envoyproxy/ratelimit: an over quota-mode descriptor says OVER_LIMIT; the answer
    is OVER_LIMIT when every quota-mode descriptor is over, or any other one is."""
    limiter, _ = _limiter(Clock())
    first, second = await _codes(limiter, 2, d("quota", "q"))
    assert not first.over and second.over  # its only quota descriptor is over
    assert first.metadata == {0: {"plan": "gold"}} and first.violations == []
    assert second.violations == [0]
    assert second.statuses[0].over
    # One quota descriptor over, another still within: allowed, the status says which.
    mixed = await limiter.check("edge", [d("quota", "q"), d("quota", "fresh")])
    assert not mixed.over and [s.over for s in mixed.statuses] == [True, False]
    # Both over: denied.
    both = await limiter.check("edge", [d("quota", "q"), d("quota", "fresh")])
    assert both.over and [s.over for s in both.statuses] == [True, True]
    # A plain rule over denies whatever the quota descriptors say.
    await limiter.check("edge", [d("win", "w")])
    await limiter.check("edge", [d("win", "w")])
    plain = await limiter.check("edge", [d("quota", "new"), d("win", "w")])
    assert plain.over and [s.over for s in plain.statuses] == [False, True]


WILD = """
domain: wild
descriptors:
  - key: route
    value: bar*b
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: route
    value: foo*bar*baz
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: route
    value: "*"
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: route
    value: barb
    rate_limit: {unit: minute, requests_per_unit: 9}
  - key: svc*
    rate_limit: {unit: minute, requests_per_unit: 3}
"""


@pytest.mark.parametrize(("value", "limit"), [
    ("bar123b", 1), ("barb", 9), ("barb1", 5), ("fooXbarYbaz", 2), ("foobarbaz", 2),
    ("foobazbar", 5), ("", 5), ("anything", 5)])
async def test_wildcards_in_the_middle_and_several_match_like_the_reference(
        value: str, limit: int) -> None:
    """Each `*` is any run of characters; an exact value wins, then the first wildcard
    in config order, then the key alone."""
    limiter = RateLimiter(ConfigHolder(rlconfig.build([("w.yaml", WILD)])), MemoryStore(),
                          RuleMetrics(CollectorRegistry()), clock=Clock())
    rule = (await limiter.check("wild", [d("route", value)])).statuses[0].rule
    assert rule is not None and rule.requests_per_unit == limit


async def test_a_shared_threshold_on_a_middle_wildcard_shares_one_counter() -> None:
    limiter = RateLimiter(ConfigHolder(rlconfig.build([("w.yaml", WILD)])), MemoryStore(),
                          RuleMetrics(CollectorRegistry()), clock=Clock())
    first = await limiter.check("wild", [d("route", "fooAbarBbaz")])
    second = await limiter.check("wild", [d("route", "foo-bar-baz")])
    third = await limiter.check("wild", [d("route", "foo1bar2baz")])
    assert [first.over, second.over, third.over] == [False, False, True]
    # Without share_threshold each value counts on its own (the key wildcard here).
    assert not (await limiter.check("wild", [d("svc-a", "x")])).over
    assert not (await limiter.check("wild", [d("svc-b", "x")])).over


VALUED = """
domain: d
descriptors:
  - key: k1
    value_to_metric: true
    descriptors:
      - key: k2
        rate_limit: {unit: minute, requests_per_unit: 5}
  - key: a
    descriptors:
      - key: b
        value_to_metric: true
        descriptors:
          - key: c
            rate_limit: {unit: minute, requests_per_unit: 5}
  - key: route
    value: dr*
    value_to_metric: true
    descriptors:
      - key: http_method
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit: {unit: minute, requests_per_unit: 5}
  - key: detailed
    value_to_metric: true
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 5}
"""


@pytest.mark.parametrize(("entries", "stats_key"), [
    ((("k1", "A"), ("k2", "B")), "d.k1_A.k2"),
    ((("a", "X"), ("b", "Y"), ("c", "Z")), "d.a.b_Y.c"),
    ((("route", "draw"), ("http_method", "GET"), ("subject_id", "9")),
     "d.route_draw.http_method_GET.subject_id"),
    ((("detailed", "v"),), "d.detailed_v"),  # detailed_metric's own name wins
])
async def test_value_to_metric_names_the_request_value_like_the_reference(
        entries: tuple[tuple[str, str], ...], stats_key: str) -> None:
    registry = CollectorRegistry()
    metrics = RuleMetrics(registry)
    limiter = RateLimiter(ConfigHolder(rlconfig.build([("v.yaml", VALUED)])), MemoryStore(),
                          metrics, clock=Clock())
    assert (await limiter.check("d", [Descriptor(entries)])).statuses[0].rule is not None
    metrics.flush()
    keys = {s.labels["key"] for m in registry.collect() for s in m.samples
            if s.name == "sitsmesh_ratelimit_hits_total"}
    assert keys == {stats_key}


async def test_unlimited_and_unknown_domain_and_no_match() -> None:
    limiter, registry = _limiter(Clock())
    r = await limiter.check("edge", [d("ldap", "x")])
    assert r.statuses[0].remaining == UNLIMITED_REMAINING and not r.over
    unknown = await limiter.check("nope", [d("a", "b")])
    assert not unknown.over and unknown.statuses[0].rule is None
    assert registry.get_sample_value("sitsmesh_ratelimit_unknown_domain_total") == 1


async def test_several_limits_on_one_descriptor_tightest_wins() -> None:
    clock = Clock(1_000_000.0)
    limiter, _ = _limiter(clock)
    a = await _codes(limiter, 3, d("tenant", "t"))
    assert [r.over for r in a] == [False, False, True]  # burst of 2 per second
    assert a[0].statuses[0].rule is not None and a[0].statuses[0].rule.name == "burst"
    clock.now += 1
    b = await limiter.check("edge", [d("tenant", "t")])
    assert b.over, "the burst rule counted the over-limit hit too, so sustained (3/min) is spent"
    assert b.statuses[0].rule is not None and b.statuses[0].rule.name == "sustained"


async def test_replaces_drops_the_replaced_rule() -> None:
    limiter, _ = _limiter(Clock())
    both = [d("k1", "v1", "user", "u"), d("k2", "v2", "user", "u")]
    results = [await limiter.check("edge", both) for _ in range(3)]
    assert not any(r.over for r in results), "specific (1/s) was replaced by 5/s"
    assert results[0].statuses[0].rule is None
    alone = await _codes(limiter, 2, d("k1", "v1", "user", "u"))
    assert [r.over for r in alone] == [False, True], "replaced rule's own count was untouched"


async def test_hits_addend_request_and_per_descriptor() -> None:
    limiter, _ = _limiter(Clock())
    assert not (await limiter.check("edge", [d("remote_address", "h")], hits_addend=3)).over
    peek = await limiter.check("edge", [d("remote_address", "h", addend=0)])
    assert not peek.over and peek.statuses[0].remaining == 0, "0 checks without counting"
    assert (await limiter.check("edge", [d("remote_address", "h", addend=1)])).over


async def test_window_multiplier() -> None:
    clock = Clock(1_000_020.0)  # 1_000_020 % 30 == 0
    limiter, _ = _limiter(clock)
    assert [r.over for r in await _codes(limiter, 3, d("win", "w"))] == [False, False, True]
    clock.now += 29
    assert (await limiter.check("edge", [d("win", "w")])).over
    clock.now += 1
    assert not (await limiter.check("edge", [d("win", "w")])).over


async def test_limit_override_from_envoy() -> None:
    limiter, _ = _limiter(Clock())
    desc = Descriptor([("any", "thing")], override=(1, 1))
    assert [r.over for r in [await limiter.check("edge", [desc]) for _ in range(2)]] == [
        False, True]


async def test_like_the_reference_an_override_on_an_unknown_domain_limits_nothing() -> None:
    limiter, registry = _limiter(Clock())
    desc = Descriptor([("any", "thing")], override=(1, 1))
    answers = [await limiter.check("nope", [desc]) for _ in range(3)]
    assert not any(r.over for r in answers)
    assert all(r.statuses[0].rule is None for r in answers)
    assert registry.get_sample_value("sitsmesh_ratelimit_unknown_domain_total") == 3


async def test_like_the_reference_a_descriptor_with_no_entries_is_ok_with_no_limit() -> None:
    limiter, _ = _limiter(Clock())
    empty = await limiter.check("edge", [Descriptor([]), d("ldap", "x")])
    assert not empty.over and empty.statuses[0].rule is None
    # On a domain with config, a request-level override still applies to it.
    capped = Descriptor([], override=(1, 1))
    assert [(await limiter.check("edge", [capped])).over for _ in range(2)] == [False, True]


@pytest.mark.parametrize(("domain", "descs", "message"), [
    ("", [d("a", "b")], "rate limit domain must not be empty"),
    ("edge", [], "rate limit descriptor list must not be empty"),
    ("edge", [d("a", "b")] * 10_000, "too many descriptors: 10000 > 64"),
    ("edge", [d("a", "b", addend=2**40)], "descriptor 0: hits_addend 1099511627776 exceeds"),
])
async def test_bad_requests_are_rejected_and_count_nothing(
    domain: str, descs: list[Descriptor], message: str
) -> None:
    limiter, _ = _limiter(Clock())
    with pytest.raises(RequestError, match=message):
        await limiter.check(domain, descs)


async def test_huge_addend_is_over_without_poisoning_later_requests() -> None:
    clock = Clock(1_000_000.0)
    limiter, _ = _limiter(clock)
    huge = await limiter.check("edge", [d("remote_address", "p")], hits_addend=1_000_000)
    assert huge.over
    clock.now += 1
    assert not (await limiter.check("edge", [d("remote_address", "p")])).over


@pytest.mark.parametrize(("algorithm", "steps", "expected"), [
    # (time offset, addend) -> over?
    (Algorithm.FIXED_WINDOW, [(0, 1), (0.1, 1), (0.2, 1), (1.0, 1)], [False, False, True, False]),
    # Sliding: half-way into the next window, half the previous count still weighs.
    (Algorithm.SLIDING_WINDOW, [(0, 1), (0.1, 1), (1.5, 1), (1.6, 1)],
     [False, False, False, True]),
    # GCRA 2 per second: an interval of 0.5 s, a burst of 2.
    (Algorithm.GCRA, [(0, 1), (0, 1), (0, 1), (0.5, 1), (0.5, 1)],
     [False, False, True, False, True]),
])
def test_algorithms_in_the_memory_store(
    algorithm: Algorithm, steps: list[tuple[float, int]], expected: list[bool]
) -> None:
    store = MemoryStore()
    base = 2_000_000.0
    got = [store.hit_sync([Hit("k", algorithm, 2, 1, addend)], base + t)[0].over
           for t, addend in steps]
    assert got == expected


def test_memory_store_is_bounded_and_frees_expired_windows() -> None:
    store = MemoryStore(max_keys=100)
    for i in range(500):
        store.hit_sync([Hit(f"k{i}", Algorithm.FIXED_WINDOW, 5, 1, 1)], 10.0)
    assert len(store) == 100 and store.evicted == 400
    assert store.sweep(12.0) == 100
    assert len(store) == 0


async def test_shadow_decisions_are_logged_at_flush() -> None:
    from structlog.testing import capture_logs

    limiter, registry = _limiter(Clock())
    await _codes(limiter, 3, d("soft", "x"))
    with capture_logs() as logs:
        registry.get_sample_value("sitsmesh_ratelimit_hits_total",
                                  {"key": "edge.soft", "outcome": "shadow_mode"})
    assert {"event": "shadow mode let over-limit hits through", "key": "edge.soft", "hits": 2,
            "log_level": "info", "component": "sitsmesh.ratelimit"} in logs


@pytest.mark.parametrize(("now", "reset"), [(6000.0, 60.0), (6000.9, 60.0), (6059.5, 1.0),
                                            (6030.2, 30.0)])
def test_fixed_window_reset_is_whole_seconds_never_zero(now: float, reset: float) -> None:
    hit = Hit("k", Algorithm.FIXED_WINDOW, 10, 60, 1)
    assert fixed_window(0, hit, now)[1].reset_s == reset


def test_a_rejected_fixed_window_hit_is_counted_unless_told_not_to() -> None:
    hit = Hit("k", Algorithm.FIXED_WINDOW, 10, 60, 4)
    assert fixed_window(8, hit, 6000.0)[0] == 12  # the reference counts it
    assert fixed_window(8, hit, 6000.0, count_rejected=False)[0] == 8
    assert fixed_window(6, hit, 6000.0, count_rejected=False)[0] == 10  # fits: counted
