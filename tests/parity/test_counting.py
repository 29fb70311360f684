"""Fixed-window counting as envoyproxy/ratelimit does it (spec §5): remaining after each
hit, request and per-descriptor hits_addend, hits larger than what is left, a zero
limit, whole-second resets, STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT, and the per-rule
counters (total, within, near, over, shadow). Each fact holds on the memory store and
on a real Redis."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest

from sitsmesh.dev import harness
from tests.parity.rls import (
    OK,
    OVER,
    UNIT,
    UNIT_SECONDS,
    Fleet,
    ask,
    desc,
    fresh,
    hits,
    wait_for_keys,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def node(fleet: Fleet, store: str) -> harness.Sitsmesh:
    return fleet.get(store)


@pytest.fixture(scope="module")
def uncounted(fleet: Fleet, store: str) -> harness.Sitsmesh:
    return fleet.get(store, "--ratelimit-count-rejected-hits", "false")


@pytest.fixture(scope="module")
def stopping(fleet: Fleet, store: str) -> harness.Sitsmesh:
    return fleet.get(store, "--ratelimit-stop-increment-when-over", "true")


def _hit(node: harness.Sitsmesh, key: str, value: str, *, hits_addend: int = 0,
         addend: int | None = None) -> tuple[int, int]:
    status = ask(node, "meter", desc((key, value), addend=addend),
                 hits_addend=hits_addend).statuses[0]
    return status.code, status.limit_remaining


def test_remaining_after_each_hit(node: harness.Sitsmesh) -> None:
    value = fresh()
    answers = [ask(node, "meter", desc(("basic", value))) for _ in range(7)]
    assert [(a.overall_code, a.statuses[0].limit_remaining) for a in answers] == [
        (OK, 4), (OK, 3), (OK, 2), (OK, 1), (OK, 0), (OVER, 0), (OVER, 0)]
    for answer in answers:
        limit = answer.statuses[0].current_limit
        assert (limit.requests_per_unit, limit.unit) == (5, UNIT.DAY)


def test_a_request_hits_addend_counts_that_many(node: harness.Sitsmesh) -> None:
    value = fresh()
    assert _hit(node, "basic", value, hits_addend=3) == (OK, 2)
    assert _hit(node, "basic", value, hits_addend=2) == (OK, 0)
    assert _hit(node, "basic", value) == (OVER, 0)


def test_a_request_hits_addend_of_zero_counts_one(node: harness.Sitsmesh) -> None:
    value = fresh()
    assert _hit(node, "basic", value, hits_addend=0) == (OK, 4)
    assert _hit(node, "basic", value, hits_addend=0) == (OK, 3)


def test_a_descriptor_hits_addend_overrides_the_request(node: harness.Sitsmesh) -> None:
    value = fresh()
    assert _hit(node, "basic", value, hits_addend=4, addend=1) == (OK, 4)
    # The other descriptor of the same request still uses the request's addend.
    other = fresh()
    reply = ask(node, "meter", desc(("basic", value), addend=2), desc(("basic", other)),
                hits_addend=3)
    assert [s.limit_remaining for s in reply.statuses] == [2, 2]


def test_a_descriptor_hits_addend_of_zero_only_checks(node: harness.Sitsmesh) -> None:
    value = fresh()
    assert _hit(node, "basic", value, addend=0) == (OK, 5)
    assert _hit(node, "basic", value, addend=0) == (OK, 5)
    assert _hit(node, "basic", value) == (OK, 4)


def test_a_hit_larger_than_what_is_left_is_counted(node: harness.Sitsmesh) -> None:
    value = fresh()
    assert _hit(node, "basic", value, hits_addend=3) == (OK, 2)
    assert _hit(node, "basic", value, hits_addend=4) == (OVER, 0)
    assert _hit(node, "basic", value) == (OVER, 0)  # 8 counted of 5


def test_a_hit_larger_than_the_whole_limit_is_counted(node: harness.Sitsmesh) -> None:
    value = fresh()
    assert _hit(node, "basic", value, hits_addend=6) == (OVER, 0)
    assert _hit(node, "basic", value) == (OVER, 0)


def test_rejected_hits_are_not_counted_when_asked(uncounted: harness.Sitsmesh) -> None:
    value = fresh()
    assert _hit(uncounted, "basic", value, hits_addend=3) == (OK, 2)
    assert _hit(uncounted, "basic", value, hits_addend=4) == (OVER, 0)
    assert _hit(uncounted, "basic", value) == (OK, 1)
    whole = fresh()
    assert _hit(uncounted, "basic", whole, hits_addend=6) == (OVER, 0)
    assert _hit(uncounted, "basic", whole) == (OK, 4)


def test_a_zero_limit_is_always_over(node: harness.Sitsmesh) -> None:
    value = fresh()
    for _ in range(2):
        reply = ask(node, "meter", desc(("none", value)))
        assert (reply.overall_code, reply.statuses[0].limit_remaining) == (OVER, 0)
        assert reply.statuses[0].current_limit.requests_per_unit == 0


@pytest.mark.parametrize("unit", ["second", "minute", "hour", "day", "week", "month", "year"])
def test_duration_until_reset_is_whole_seconds_to_the_window_end(node: harness.Sitsmesh,
                                                                  unit: str) -> None:
    length = UNIT_SECONDS[getattr(UNIT, unit.upper())]
    before = math.floor(time.time())
    status = ask(node, "meter", desc((f"per_{unit}", fresh()))).statuses[0]
    after = math.floor(time.time())
    assert status.current_limit.unit == getattr(UNIT, unit.upper())
    assert status.duration_until_reset.nanos == 0
    # Windows start at multiples of their length since the epoch; the reset is never 0.
    assert status.duration_until_reset.seconds in {length - (t % length)
                                                   for t in range(before, after + 1)}


def _pair(node: harness.Sitsmesh, value: str) -> list[tuple[int, int]]:
    reply = ask(node, "meter", desc(("wide", value)), desc(("narrow", value)))
    return [(s.code, s.limit_remaining) for s in reply.statuses]


def test_by_default_a_rejected_request_uses_up_its_other_descriptors(
        node: harness.Sitsmesh) -> None:
    value = fresh()
    assert [_pair(node, value) for _ in range(4)] == [
        [(OK, 3), (OK, 1)], [(OK, 2), (OK, 0)], [(OK, 1), (OVER, 0)], [(OK, 0), (OVER, 0)]]
    assert _hit(node, "wide", value) == (OVER, 0)


def test_stop_increment_leaves_the_other_descriptors_quota(stopping: harness.Sitsmesh) -> None:
    value = fresh()
    assert [_pair(stopping, value) for _ in range(4)] == [
        [(OK, 3), (OK, 1)], [(OK, 2), (OK, 0)], [(OK, 2), (OVER, 0)], [(OK, 2), (OVER, 0)]]
    assert _hit(stopping, "wide", value) == (OK, 1)
    # The descriptor that went over was still counted: a smaller addend now fits no more.
    assert _hit(stopping, "narrow", value, addend=0) == (OVER, 0)


@dataclass(frozen=True)
class Row:
    key: str
    addends: tuple[int, ...]
    total: int
    within: int
    near: int
    over: int
    shadow: int = 0


# near threshold = floor(limit * 0.8); see spec §5 for how each counter moves.
ROWS = [
    Row("gauge20a", (3,), total=3, within=3, near=0, over=0),          # below near
    Row("gauge8", (5, 2), total=7, within=7, near=1, over=0),          # crosses near (6)
    Row("gauge20b", (16, 3), total=19, within=19, near=3, over=0),     # already past near
    Row("gauge20c", (18, 3), total=21, within=18, near=4, over=1),     # crosses the limit
    Row("gauge4", (5, 2), total=7, within=0, near=1, over=3),          # over, then over again
    Row("shadow2", (3, 1), total=4, within=0, near=1, over=2, shadow=2),
    Row("free", (1, 1, 1), total=0, within=0, near=0, over=0),         # unlimited: not counted
]


@pytest.fixture(scope="module")
def counted(node: harness.Sitsmesh) -> str:
    """Every ROWS sequence once (one value per row), then one scrape once all are in."""
    for row in ROWS:
        value = fresh()
        for addend in row.addends:
            ask(node, "meter", desc((row.key, value)), hits_addend=addend)
    return wait_for_keys(node, [], {f"meter.{r.key}": r.total for r in ROWS})


@pytest.mark.parametrize("row", ROWS, ids=[r.key for r in ROWS])
def test_the_per_rule_counters(node: harness.Sitsmesh, counted: str, row: Row) -> None:
    got = hits(node, f"meter.{row.key}", counted)
    assert got == {"total_hits": row.total, "within_limit": row.within,
                   "near_limit": row.near, "over_limit": row.over, "shadow_mode": row.shadow}


def test_the_near_limit_ratio_setting(fleet: Fleet, store: str) -> None:
    halfway = fleet.get(store, "--ratelimit-near-limit-ratio", "0.5")
    value = fresh()
    for addend in (4, 2):  # limit 10, near 5: the second hit is 1 past it
        ask(halfway, "meter", desc(("gauge10", value)), hits_addend=addend)
    text = wait_for_keys(halfway, [], {"meter.gauge10": 6})
    assert hits(halfway, "meter.gauge10", text) == {
        "total_hits": 6, "within_limit": 6, "near_limit": 1, "over_limit": 0, "shadow_mode": 0}
