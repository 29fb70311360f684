"""The service around the counters, as envoyproxy/ratelimit answers (spec §4): bad
requests, unknown domains, request-level limit overrides, per-rule shadow mode, quota
mode per descriptor and globally, global shadow mode. Each fact holds on the memory
store and on a real Redis."""

from __future__ import annotations

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from sitsmesh.dev import harness
from tests.parity.rls import (
    DAY,
    OK,
    OVER,
    UNIT,
    Fleet,
    ask,
    desc,
    fresh,
    limit_of,
    refused,
    settled,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def node(fleet: Fleet, store: str) -> harness.Sitsmesh:
    return fleet.get(store)


@pytest.fixture(scope="module")
def global_quota(fleet: Fleet, store: str) -> harness.Sitsmesh:
    return fleet.get(store, "--ratelimit-quota-mode", "true")


@pytest.fixture(scope="module")
def global_shadow(fleet: Fleet, store: str) -> harness.Sitsmesh:
    return fleet.get(store, "--ratelimit-shadow-mode", "true")


def _codes(reply: rls_pb2.RateLimitResponse) -> tuple[int, list[int]]:
    return reply.overall_code, [s.code for s in reply.statuses]


def _used_up(node: harness.Sitsmesh, domain: str, key: str) -> str:
    """A fresh value whose one-per-day counter is spent."""
    value = fresh(key)
    assert ask(node, domain, desc((key, value))).statuses[0].code == OK
    return value


def test_an_empty_domain_is_an_error(node: harness.Sitsmesh) -> None:
    err = refused(node, "", desc(("calls", "x")))
    assert err.details() == "rate limit domain must not be empty"


def test_an_empty_descriptor_list_is_an_error(node: harness.Sitsmesh) -> None:
    err = refused(node, "gate")
    assert err.details() == "rate limit descriptor list must not be empty"


def test_a_descriptor_with_no_entries_is_ok_with_no_limit(node: harness.Sitsmesh) -> None:
    reply = ask(node, "gate", ratelimit_pb2.RateLimitDescriptor())
    assert _codes(reply) == (OK, [OK])
    assert limit_of(reply) is None and reply.statuses[0].limit_remaining == 0


def test_an_unknown_domain_is_ok_with_no_limit(node: harness.Sitsmesh) -> None:
    reply = ask(node, "nobody-configures-this", desc(("calls", "x")), desc(("a", "b")))
    assert _codes(reply) == (OK, [OK, OK])
    assert [limit_of(reply, 0), limit_of(reply, 1)] == [None, None]


def test_unknown_domains_are_counted_once_per_descriptor(node: harness.Sitsmesh) -> None:
    metric = "sitsmesh_ratelimit_unknown_domain_total"
    before = settled(node, metric)
    ask(node, "nobody-configures-this", desc(("a", "1")), desc(("b", "2")), desc(("c", "3")))
    assert settled(node, metric) - before == 3


def test_an_override_applies_where_no_rule_matches(node: harness.Sitsmesh) -> None:
    capped = desc(("nomatch", fresh()), override=(2, DAY))
    replies = [ask(node, "gate", capped) for _ in range(3)]
    assert [(r.statuses[0].code, r.statuses[0].limit_remaining) for r in replies] == [
        (OK, 1), (OK, 0), (OVER, 0)]
    limit = replies[0].statuses[0].current_limit
    assert (limit.requests_per_unit, limit.unit, limit.name) == (2, UNIT.DAY, "")


def test_an_override_replaces_the_config_limit(node: harness.Sitsmesh) -> None:
    reply = ask(node, "gate", desc(("calls", fresh()), override=(3, DAY)))
    assert (limit_of(reply), reply.statuses[0].limit_remaining) == (3, 2)


def test_an_override_applies_to_a_descriptor_with_no_entries(node: harness.Sitsmesh) -> None:
    empty = ratelimit_pb2.RateLimitDescriptor()
    empty.limit.requests_per_unit, empty.limit.unit = 1_000_000, DAY
    assert limit_of(ask(node, "gate", empty)) == 1_000_000


def test_an_override_on_an_unknown_domain_limits_nothing(node: harness.Sitsmesh) -> None:
    capped = desc(("calls", fresh()), override=(1, DAY))
    for _ in range(3):
        reply = ask(node, "nobody-configures-this", capped)
        assert _codes(reply) == (OK, [OK]) and limit_of(reply) is None


def test_one_descriptor_over_makes_the_answer_over(node: harness.Sitsmesh) -> None:
    spent = _used_up(node, "gate", "calls")
    assert _codes(ask(node, "gate", desc(("calls", spent)), desc(("nomatch", "x")))) == (
        OVER, [OVER, OK])
    assert _codes(ask(node, "gate", desc(("nomatch", "x")), desc(("calls", spent)))) == (
        OVER, [OK, OVER])


def test_per_rule_shadow_mode_reports_ok_but_keeps_the_limit(node: harness.Sitsmesh) -> None:
    trial = fresh()
    ask(node, "dryrun", desc(("trial", trial)))
    reply = ask(node, "dryrun", desc(("trial", trial)))
    assert _codes(reply) == (OK, [OK])
    status = reply.statuses[0]
    assert (status.limit_remaining, status.current_limit.requests_per_unit) == (0, 1)
    assert status.duration_until_reset.seconds > 0


def test_a_shadow_rule_does_not_hide_an_enforced_one(node: harness.Sitsmesh) -> None:
    trial, paid = fresh(), fresh()
    ask(node, "dryrun", desc(("trial", trial)), desc(("paid", paid)))
    reply = ask(node, "dryrun", desc(("trial", trial)), desc(("paid", paid)))
    assert _codes(reply) == (OVER, [OK, OVER])


def test_quota_mode_all_quota_descriptors_over_is_over(node: harness.Sitsmesh) -> None:
    a, b = _used_up(node, "gate", "credits"), _used_up(node, "gate", "credits")
    reply = ask(node, "gate", desc(("credits", a)), desc(("credits", b)))
    assert _codes(reply) == (OVER, [OVER, OVER])
    assert [s.limit_remaining for s in reply.statuses] == [0, 0]
    assert [limit_of(reply, 0), limit_of(reply, 1)] == [1, 1]


def test_quota_mode_some_quota_descriptors_over_is_ok(node: harness.Sitsmesh) -> None:
    spent = _used_up(node, "gate", "credits")
    reply = ask(node, "gate", desc(("credits", spent)), desc(("credits", fresh())))
    assert _codes(reply) == (OK, [OVER, OK])


def test_quota_mode_a_plain_descriptor_over_is_over(node: harness.Sitsmesh) -> None:
    spent = _used_up(node, "gate", "calls")
    reply = ask(node, "gate", desc(("calls", spent)), desc(("credits", fresh())))
    assert _codes(reply) == (OVER, [OVER, OK])


def test_quota_mode_the_only_quota_descriptor_over_is_over(node: harness.Sitsmesh) -> None:
    spent = _used_up(node, "gate", "credits")
    reply = ask(node, "gate", desc(("calls", fresh())), desc(("credits", spent)))
    assert _codes(reply) == (OVER, [OK, OVER])


def test_quota_mode_nothing_over_is_ok(node: harness.Sitsmesh) -> None:
    reply = ask(node, "gate", desc(("calls", fresh())), desc(("credits", fresh())))
    assert _codes(reply) == (OK, [OK, OK])


def test_global_quota_mode_all_over_is_over(global_quota: harness.Sitsmesh) -> None:
    a, b = _used_up(global_quota, "gate", "calls"), _used_up(global_quota, "gate", "calls")
    reply = ask(global_quota, "gate", desc(("calls", a)), desc(("calls", b)))
    assert _codes(reply) == (OVER, [OVER, OVER])


def test_global_quota_mode_some_over_is_ok(global_quota: harness.Sitsmesh) -> None:
    spent = _used_up(global_quota, "gate", "calls")
    reply = ask(global_quota, "gate", desc(("calls", spent)), desc(("calls", fresh())))
    assert _codes(reply) == (OK, [OVER, OK])


def test_global_shadow_mode_answers_ok_and_keeps_the_statuses(
        global_shadow: harness.Sitsmesh) -> None:
    metric = "sitsmesh_ratelimit_global_shadow_mode_total"
    before = settled(global_shadow, metric)
    spent = _used_up(global_shadow, "gate", "calls")
    reply = ask(global_shadow, "gate", desc(("calls", spent)), desc(("nomatch", "x")))
    assert _codes(reply) == (OK, [OVER, OK])
    assert settled(global_shadow, metric) - before == 1


@pytest.mark.parametrize("second", ["credits", "calls"], ids=["all-quota", "mixed"])
def test_global_shadow_mode_covers_quota_mode(global_shadow: harness.Sitsmesh,
                                               second: str) -> None:
    a, b = _used_up(global_shadow, "gate", "credits"), _used_up(global_shadow, "gate", second)
    reply = ask(global_shadow, "gate", desc(("credits", a)), desc((second, b)))
    assert _codes(reply) == (OK, [OVER, OVER])


def test_request_errors_come_before_the_config(node: harness.Sitsmesh) -> None:
    # An unknown domain does not hide a bad request.
    with pytest.raises(grpc.RpcError) as err:
        ask(node, "nobody-configures-this")
    assert err.value.details() == "rate limit descriptor list must not be empty"
