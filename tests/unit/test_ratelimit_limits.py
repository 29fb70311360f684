"""Bounds on what one ShouldRateLimit may carry, and on what the limiter keeps for it."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from sitsmesh.ratelimit import config as rlconfig
from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.limiter import (
    ConfigHolder,
    Descriptor,
    RateLimiter,
    RequestError,
    RequestLimits,
)
from sitsmesh.ratelimit.memory import ENTRY_BYTES, MemoryStore
from sitsmesh.ratelimit.metrics import RuleMetrics
from sitsmesh.ratelimit.store import Hit

CONFIG = """
domain: edge
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
  - key: shared
    rate_limit: {unit: hour, requests_per_unit: 10000000}
"""
NOW = 1_000_000.0


def _limiter(*, cache_bytes: int = 16 << 20,
             limits: RequestLimits | None = None) -> tuple[RateLimiter, MemoryStore]:
    store = MemoryStore()
    limiter = RateLimiter(ConfigHolder(rlconfig.build([("c.yaml", CONFIG)])), store,
                          RuleMetrics(CollectorRegistry()), clock=lambda: NOW,
                          cache_bytes=cache_bytes, limits=limits)
    return limiter, store


def d(*pairs: str, addend: int | None = None) -> Descriptor:
    it = iter(pairs)
    return Descriptor(tuple(zip(it, it, strict=True)), addend)


@pytest.mark.parametrize(("descs", "hits_addend", "message"), [
    ([d(*["user", "a"] * 17)], 0, "descriptor 0 has 17 entries, more than 16"),
    ([d("user", "a"), d("u" * 257, "a")], 0, r"descriptor 1: entry key or value too long "
                                              r"\(257 and 1 characters; at most 256 and 1024\)"),
    ([d("user", "v" * 1025)], 0, r"descriptor 0: entry key or value too long"),
    ([d("shared", "x")], 1_000_001, "hits_addend 1000001 exceeds 1000000"),
    ([d("user", "a"), d("shared", "x", addend=1_000_001)], 0,
     "descriptor 1: hits_addend 1000001 exceeds 1000000"),
])
async def test_oversized_requests_get_invalid_argument_and_count_nothing(
    descs: list[Descriptor], hits_addend: int, message: str
) -> None:
    limiter, store = _limiter()
    with pytest.raises(RequestError, match=message):
        await limiter.check("edge", descs, hits_addend)
    assert len(store) == 0 and limiter.cache_bytes == 0


async def test_domain_longer_than_a_key_is_refused() -> None:
    limiter, _ = _limiter()
    with pytest.raises(RequestError, match="domain is 257 characters, more than 256"):
        await limiter.check("d" * 257, [d("user", "a")])


async def test_a_huge_addend_cannot_put_another_user_over() -> None:
    limiter, _ = _limiter()
    with pytest.raises(RequestError):
        await limiter.check("edge", [d("shared", "x")], hits_addend=9_999_999)
    other = await limiter.check("edge", [d("shared", "x")])
    assert not other.over and other.statuses[0].remaining == 10_000_000 - 1


async def test_limits_are_settings() -> None:
    limiter, _ = _limiter(limits=RequestLimits(entries=2, value_length=4, hits_addend=10))
    assert not (await limiter.check("edge", [d("user", "abcd")], 10)).over
    for descs, addend in (([d("user", "abcde")], 0), ([d(*["user", "a"] * 3)], 0),
                          ([d("user", "a")], 11)):
        with pytest.raises(RequestError):
            await limiter.check("edge", descs, addend)


async def test_misses_are_not_cached() -> None:
    limiter, store = _limiter()
    for i in range(100):
        await limiter.check("nobody", [d("user", f"{i:0>1000}")])
        await limiter.check("edge", [d("nokey", f"{i:0>1000}")])
    assert limiter.cache_bytes == 0 and len(store) == 0


async def test_match_cache_is_bounded_in_bytes() -> None:
    budget = 256 << 10
    limiter, _ = _limiter(cache_bytes=budget)
    seen = 0
    for i in range(2000):
        await limiter.check("edge", [d("user", f"{i:0>1000}")])
        seen = max(seen, limiter.cache_bytes)
    # 2000 distinct 1 KB values would hold ~2.5 MB; the budget holds.
    assert 0 < seen <= budget
    assert not (await limiter.check("edge", [d("user", "0" * 1000)])).over


async def test_a_descriptor_bigger_than_the_cache_is_answered_uncached() -> None:
    limiter, _ = _limiter(cache_bytes=100)
    assert not (await limiter.check("edge", [d("user", "x" * 500)])).over
    assert limiter.cache_bytes == 0


def test_memory_store_is_bounded_in_bytes() -> None:
    store = MemoryStore(max_bytes=1 << 20)
    for i in range(1000):
        store.hit_sync([Hit(f"{i:0>10000}", Algorithm.FIXED_WINDOW, 5, 3600, 1)], NOW)
        assert store.bytes <= 1 << 20
    assert store.evicted > 0
    store.sweep(NOW + 7200, budget=10_000)
    assert len(store) == 0 and store.bytes == 0


def test_memory_store_evicts_oldest_first_by_bytes() -> None:
    store = MemoryStore(max_bytes=10 * (ENTRY_BYTES + 1000))
    for i in range(20):
        store.hit_sync([Hit(f"{i:0>995}", Algorithm.FIXED_WINDOW, 5, 3600, 1)], NOW)
    newest = store.hit_sync([Hit(f"{19:0>995}", Algorithm.FIXED_WINDOW, 5, 3600, 0)], NOW)
    assert newest[0].used == 1  # the newest window survived
    oldest = store.hit_sync([Hit(f"{0:0>995}", Algorithm.FIXED_WINDOW, 5, 3600, 0)], NOW)
    assert oldest[0].used == 0  # the oldest was evicted


def test_limit_settings_parse_with_defaults_and_name_a_bad_source() -> None:
    from sitsmesh.config import load_settings
    from sitsmesh.errors import ConfigError

    settings = load_settings({}, env={})
    assert (settings.max_check_message_bytes, settings.ratelimit_max_hits_addend,
            settings.chain_max_bytes) == (1 << 20, 1_000_000, 32 << 20)
    flags = {"ratelimit_max_value_length": "64", "max_concurrent_rpcs": "10"}
    assert load_settings(flags, env={}).ratelimit_max_value_length == 64
    with pytest.raises(ConfigError, match="environment SITSMESH_RATELIMIT_MAX_HITS_ADDEND: "
                                          "must be between 1 and 4294967295, got 0"):
        load_settings({}, env={"SITSMESH_RATELIMIT_MAX_HITS_ADDEND": "0"})
    with pytest.raises(ConfigError, match="--max-check-message-bytes: expected an integer"):
        load_settings({"max_check_message_bytes": "1M"}, env={})


async def test_override_keys_past_the_metric_bounds_count_as_overflow() -> None:
    from sitsmesh.ratelimit import metrics as rlmetrics

    registry = CollectorRegistry()
    rule_metrics = RuleMetrics(registry)
    limiter = RateLimiter(ConfigHolder(rlconfig.build([("c.yaml", CONFIG)])), MemoryStore(),
                          rule_metrics, clock=lambda: NOW)
    n = rlmetrics.MAX_KEY_BYTES // 900 + 50
    for i in range(n):
        await limiter.check("edge", [Descriptor((("k", f"{i:0>900}"),), None, (10, 4))])
    rule_metrics.flush()
    overflow = registry.get_sample_value("sitsmesh_ratelimit_hits_total",
                                         {"key": "overflow", "outcome": "total_hits"})
    assert overflow is not None and 0 < overflow < n
    labelled = {s.labels["key"] for m in registry.collect() for s in m.samples
                if s.name == "sitsmesh_ratelimit_hits_total"}
    assert sum(map(len, labelled)) <= rlmetrics.MAX_KEY_BYTES + len("overflow")


def test_ratelimit_headers_describe_the_least_remaining_or_the_last_one_over() -> None:
    """envoyproxy/ratelimit's choice for RateLimit-*: the least remaining among statuses
    with a limit (the first on a tie), replaced by the last non-quota one over."""
    from sitsmesh.ratelimit.config import Rule, Unit
    from sitsmesh.ratelimit.limiter import Status
    from sitsmesh.transport.ratelimit import header_status

    def rule(quota: bool = False, unlimited: bool = False) -> Rule:
        return Rule("d.k", 10, Unit.MINUTE, 60, quota_mode=quota, unlimited=unlimited)

    a, b = Status(False, rule(), 3, 1.0), Status(False, rule(), 3, 2.0)
    free = Status(False, rule(unlimited=True), 0, 0.0)
    assert header_status([Status(False, None, 0, 0.0), free]) is None
    assert header_status([free, a, b]) is a
    over_quota, over = Status(True, rule(quota=True), 0, 5.0), Status(True, rule(), 0, 6.0)
    assert header_status([a, over_quota]) is over_quota  # least remaining, quota or not
    last = Status(True, rule(), 0, 7.0)
    assert header_status([over, a, over_quota, last]) is last


def test_dynamic_metadata_has_the_reference_shape_and_merges_passed_descriptors() -> None:
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2

    from sitsmesh.ratelimit.config import Rule, Unit
    from sitsmesh.ratelimit.limiter import Decision, Status
    from sitsmesh.transport.ratelimit import dynamic_metadata

    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    request = rls_pb2.RateLimitRequest(domain="d", hits_addend=2, descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[entry(key="a", value="1")]),
        ratelimit_pb2.RateLimitDescriptor(entries=[entry(key="b", value="2"),
                                                   entry(key="c", value="")]),
        ratelimit_pb2.RateLimitDescriptor(entries=[entry(key="x", value="y")])])
    request.descriptors[1].hits_addend.value = 3
    rule = Rule("d.a", 1, Unit.MINUTE, 60)
    decision = Decision(True, [Status(False, rule, 0, 1.0), Status(False, rule, 0, 1.0),
                               Status(True, rule, 0, 1.0)],
                        {0: {"plan": "gold", "tier": {"a": 1}},
                         1: {"plan": "silver", "tier": {"a": 2, "b": 2}},
                         2: {"over": True}})
    assert dynamic_metadata(request, decision) == {
        "domain": "d", "hitsAddend": 2,
        "descriptors": [{"entries": ["a=1"]}, {"entries": ["b=2", "c="], "hitsAddend": 3},
                        {"entries": ["x=y"]}],
        "metadata": {"plan": "gold", "tier": {"a": 1, "b": 2}},  # the first value wins
    }
