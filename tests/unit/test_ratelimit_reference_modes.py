"""The reference's global switches, as pure logic: quota mode for every descriptor, sparing
the other counters of a request that goes over, counting rejected hits, no config yet."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from sitsmesh.ratelimit import config as rlconfig
from sitsmesh.ratelimit.limiter import ConfigHolder, Descriptor, NoConfigError, RateLimiter
from sitsmesh.ratelimit.memory import MemoryStore
from sitsmesh.ratelimit.metrics import RuleMetrics

CONFIG = """
domain: d
descriptors:
  - key: a
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: gcra
    rate_limit: {unit: hour, requests_per_unit: 2, algorithm: gcra}
"""
NOW = 3600.0 * 1000 + 10


def _limiter(store: MemoryStore | None = None, *, quota_mode: bool = False,
             stop_increment_when_over: bool = False) -> RateLimiter:
    holder = ConfigHolder(rlconfig.build([("c.yaml", CONFIG)]))
    return RateLimiter(holder, MemoryStore() if store is None else store,
                       RuleMetrics(CollectorRegistry()), clock=lambda: NOW,
                       quota_mode=quota_mode, stop_increment_when_over=stop_increment_when_over)


def one(key: str, value: str, addend: int | None = None) -> Descriptor:
    return Descriptor(((key, value),), addend)


async def test_global_quota_mode_makes_every_descriptor_a_quota_descriptor() -> None:
    limiter = _limiter(quota_mode=True)
    await limiter.check("d", [one("b", "x", 2)])
    # b is over, a is not: with every descriptor in quota mode, the answer is OK...
    mixed = await limiter.check("d", [one("a", "x"), one("b", "x")])
    assert not mixed.over and mixed.statuses[1].over and mixed.violations == [1]
    # ...until every one of them is over.
    both = await limiter.check("d", [one("a", "x", 5), one("b", "x")])
    assert both.over and both.violations == [0, 1]
    plain = _limiter()
    await plain.check("d", [one("b", "x", 2)])
    assert (await plain.check("d", [one("a", "x"), one("b", "x")])).over


async def test_stop_increment_spares_the_other_counters_of_a_request_that_goes_over() -> None:
    store = MemoryStore()
    limiter = _limiter(store, stop_increment_when_over=True)
    await limiter.check("d", [one("b", "y", 2)])  # b is full
    for _ in range(3):
        answer = await limiter.check("d", [one("a", "y"), one("b", "y")])
        assert answer.over and not answer.statuses[0].over
        assert answer.statuses[0].remaining == 5  # a's quota untouched
    alone = await limiter.check("d", [one("a", "y")])
    assert alone.statuses[0].remaining == 4
    # By default (the reference's), each rejected request used one of a's five.
    default = _limiter()
    await default.check("d", [one("b", "y", 2)])
    for _ in range(3):
        await default.check("d", [one("a", "y"), one("b", "y")])
    assert (await default.check("d", [one("a", "y")])).statuses[0].remaining == 1


async def test_stop_increment_still_counts_the_descriptor_that_goes_over() -> None:
    store = MemoryStore()
    limiter = _limiter(store, stop_increment_when_over=True)
    await limiter.check("d", [one("a", "z"), one("b", "z", 3)])
    # b took its 3 (over its 2); a was spared.
    assert (await limiter.check("d", [one("b", "z", 0)])).statuses[0].over
    assert (await limiter.check("d", [one("a", "z", 0)])).statuses[0].remaining == 5


@pytest.mark.parametrize(("count_rejected", "after"), [(True, True), (False, False)])
async def test_an_addend_past_the_remaining_quota(count_rejected: bool, after: bool) -> None:
    limiter = _limiter(MemoryStore(count_rejected=count_rejected))
    await limiter.check("d", [one("a", "w", 3)])
    assert (await limiter.check("d", [one("a", "w", 4)])).over  # 3 + 4 > 5
    # Counted (the reference), the next single hit is over too; not counted, it fits.
    assert (await limiter.check("d", [one("a", "w")])).over is after


async def test_an_addend_larger_than_the_limit_is_counted_by_default() -> None:
    limiter = _limiter()
    assert (await limiter.check("d", [one("a", "v", 9)])).over
    zero = await limiter.check("d", [one("a", "v", 0)])
    assert zero.over and zero.statuses[0].remaining == 0


async def test_other_algorithms_never_count_a_rejected_hit() -> None:
    limiter = _limiter()
    assert (await limiter.check("d", [one("gcra", "v", 9)])).over
    assert not (await limiter.check("d", [one("gcra", "v")])).over


async def test_no_config_loaded_yet_fails_every_call_with_the_reference_message() -> None:
    limiter = RateLimiter(ConfigHolder(rlconfig.NOT_LOADED), MemoryStore(),
                          RuleMetrics(CollectorRegistry()))
    with pytest.raises(NoConfigError, match=r"^no rate limit configuration loaded$"):
        await limiter.check("d", [one("a", "x")])
    # An empty but loaded config is no error: every domain is unknown, so OK.
    loaded = RateLimiter(ConfigHolder(rlconfig.EMPTY), MemoryStore(),
                         RuleMetrics(CollectorRegistry()))
    assert not (await loaded.check("d", [one("a", "x")])).over


DETAILED = """
domain: d
descriptors:
  - key: k1
    descriptors:
      - key: k2
        detailed_metric: true
        rate_limit: {unit: hour, requests_per_unit: 5}
  - key: files
    value: up/*
    share_threshold: true
    descriptors:
      - key: who
        detailed_metric: true
        rate_limit: {unit: hour, requests_per_unit: 5}
"""


@pytest.mark.parametrize(("entries", "key"), [
    # Every entry's key_value, whichever node matched (k1 matched by its key alone).
    ((("k1", "a"), ("k2", "b")), "d.k1_a.k2_b"),
    ((("k1", "a"), ("k2", "")), "d.k1_a.k2_"),
    # A share_threshold pattern keeps its pattern; then an empty value writes the key.
    ((("files", "up/x"), ("who", "me")), "d.files_up/*.who_me"),
    ((("files", "up/x"), ("who", "")), "d.files_up/*.who"),
])
async def test_detailed_metric_keys_like_the_reference(entries: tuple[tuple[str, str], ...],
                                                       key: str) -> None:
    registry = CollectorRegistry()
    metrics = RuleMetrics(registry)
    limiter = RateLimiter(ConfigHolder(rlconfig.build([("c.yaml", DETAILED)])), MemoryStore(),
                          metrics, clock=lambda: NOW)
    await limiter.check("d", [Descriptor(entries)])
    metrics.flush()
    assert registry.get_sample_value("sitsmesh_ratelimit_hits_total",
                                     {"key": key, "outcome": "total_hits"}) == 1
