"""Per-rule counters in the amounts envoyproxy/ratelimit counts (its base_limiter, spec §5)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from sitsmesh.ratelimit.config import Algorithm, Rule, Unit
from sitsmesh.ratelimit.metrics import OUTCOMES, RuleMetrics, near_threshold
from sitsmesh.ratelimit.store import Count


def _rule(limit: int, *, shadow: bool = False) -> Rule:
    return Rule(stats_key="d.k", requests_per_unit=limit, unit=Unit.MINUTE, window_s=60,
                algorithm=Algorithm.FIXED_WINDOW, shadow_mode=shadow)


def _amounts(registry: CollectorRegistry, key: str = "d.k") -> dict[str, float]:
    return {o: registry.get_sample_value("sitsmesh_ratelimit_hits_total",
                                         {"key": key, "outcome": o}) or 0.0
            for o in OUTCOMES}


def _one(limit: int, before: int, addend: int, *, shadow: bool = False,
         ratio: float = 0.8) -> dict[str, float]:
    """A fixed-window hit: the store counted it, so used = before + addend."""
    registry = CollectorRegistry()
    metrics = RuleMetrics(registry, ratio)
    after = before + addend
    over = after > limit
    metrics.record(_rule(limit, shadow=shadow), addend,
                   Count(over, 0 if over else limit - after, 1.0, after))
    metrics.flush()
    return _amounts(registry)


# limit 10, ratio 0.8: near threshold 8.
@pytest.mark.parametrize(("before", "addend", "total", "within", "near", "over"), [
    (0, 1, 1, 1, 0, 0),     # far from the limit
    (7, 1, 1, 1, 0, 0),     # reaching 8 is not past the threshold
    (8, 1, 1, 1, 1, 0),     # past it: the whole hit is near
    (6, 3, 3, 3, 1, 0),     # crosses near: only after - near (9 - 8) is near
    (9, 1, 1, 1, 1, 0),     # the limit itself is still within
    (10, 1, 1, 0, 0, 1),    # already at the limit: all over, nothing near
    (12, 4, 4, 0, 0, 4),    # already over: all over
    (9, 3, 3, 0, 1, 2),     # crosses the limit: after - limit over, limit - before near
    (5, 10, 10, 0, 2, 5),   # crosses near and the limit in one hit: limit - near is near
    (0, 25, 25, 0, 2, 15),  # one hit bigger than the limit
    (5, 0, 0, 0, 0, 0),     # hits_addend 0 checks without counting anything
    (11, 0, 0, 0, 0, 0),    # ... even when over
])
def test_amounts_follow_the_reference(before: int, addend: int, total: int, within: int,
                                      near: int, over: int) -> None:
    assert _one(10, before, addend) == {"total_hits": total, "over_limit": over,
                                        "near_limit": near, "within_limit": within,
                                        "shadow_mode": 0}


@pytest.mark.parametrize(("before", "addend", "over", "near"), [
    (9, 3, 2, 1),   # crosses the limit: only after - limit is shadowed
    (12, 2, 2, 0),  # already over: the whole addend
])
def test_shadow_mode_counts_what_was_over(before: int, addend: int, over: int,
                                          near: int) -> None:
    assert _one(10, before, addend, shadow=True) == {
        "total_hits": addend, "over_limit": over, "near_limit": near, "within_limit": 0,
        "shadow_mode": over}


def test_shadow_mode_stays_zero_within_the_limit() -> None:
    assert _one(10, 0, 3, shadow=True)["shadow_mode"] == 0


def test_zero_limit_is_always_over() -> None:
    assert _one(0, 0, 2) == {"total_hits": 2, "over_limit": 2, "near_limit": 0,
                             "within_limit": 0, "shadow_mode": 0}


def test_a_rejected_hit_the_store_did_not_count_is_all_over() -> None:
    # sliding_window and gcra do not count a rejected hit: `used` is the count before it.
    registry = CollectorRegistry()
    metrics = RuleMetrics(registry)
    metrics.record(_rule(10), 3, Count(True, 0, 1.0, 9))
    metrics.flush()
    assert _amounts(registry) == {"total_hits": 3, "over_limit": 3, "near_limit": 0,
                                  "within_limit": 0, "shadow_mode": 0}


@pytest.mark.parametrize(("limit", "ratio", "near"), [
    (10, 0.8, 8),
    (3, 0.5, 1),
    (90, 0.7, 63),   # float32 arithmetic, as the reference: float64 would give 62
    (16_777_217, 1.0, 16_777_216),  # float32(limit) rounds
    (5, 0.0, 0),
    (0, 0.8, 0),
])
def test_near_threshold_is_computed_in_float32(limit: int, ratio: float, near: int) -> None:
    assert near_threshold(limit, ratio) == near


def test_the_ratio_setting_moves_the_near_threshold() -> None:
    # ratio 0.5 of 10: threshold 5, so a hit from 4 to 7 has 2 near hits.
    assert _one(10, 4, 3, ratio=0.5)["near_limit"] == 2
    assert _one(10, 4, 3, ratio=0.8)["near_limit"] == 0
    # 90 at 0.7: threshold 63 (float32), so reaching 63 is not yet near.
    assert _one(90, 62, 1, ratio=0.7)["near_limit"] == 0


def test_amounts_add_up_over_a_window() -> None:
    registry = CollectorRegistry()
    metrics = RuleMetrics(registry)
    rule, used = _rule(10), 0
    for addend in (3, 3, 3, 3):  # 3, 6, 9, 12
        used += addend
        metrics.record(rule, addend, Count(used > 10, max(10 - used, 0), 1.0, used))
    metrics.flush()
    # near: 9 - 8 = 1 on the third, 10 - 9 = 1 on the fourth; over: 12 - 10.
    assert _amounts(registry) == {"total_hits": 12, "over_limit": 2, "near_limit": 2,
                                  "within_limit": 9, "shadow_mode": 0}
