"""Which rule a descriptor gets, as envoyproxy/ratelimit matches (spec §0-§2): nesting,
key-only defaults, wildcards and their precedence, names and replaces, unlimited,
share_threshold counters, and the stats key each rule is counted under. Each fact holds
on the memory store and on a real Redis."""

from __future__ import annotations

import pytest

from sitsmesh.dev import harness
from tests.parity.rls import (
    OK,
    OVER,
    UNIT,
    UNLIMITED_REMAINING,
    Fleet,
    ask,
    desc,
    fresh,
    hits,
    limit_of,
    stats_keys,
    wait_for_keys,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def node(fleet: Fleet, store: str) -> harness.Sitsmesh:
    return fleet.get(store)


def _limit(node: harness.Sitsmesh, domain: str, *pairs: tuple[str, str]) -> int | None:
    return limit_of(ask(node, domain, desc(*pairs)))


# (request entries, requests_per_unit of the rule that applies; None: no limit)
NESTED = [
    ([("tenant", "acme"), ("plan", "gold")], 70),
    ([("tenant", "acme"), ("plan", "silver")], 7),     # the key-only node under acme
    ([("tenant", "acme")], None),                      # ends on a node with no rate_limit
    ([("tenant", "other"), ("plan", "gold")], None),   # no such first level
    ([("region", "us")], 40),                          # key-only default
    ([("region", "eu")], 45),                          # exact value beats the default
    ([("region", "internal")], None),                  # exact value with no limit: allowed
    ([("region", "us"), ("city", "x")], None),         # deeper than the config
    ([("bundle", "alpha")], 12),                       # a limit on a node with children
    ([("bundle", "alpha"), ("item", "one")], 24),
    ([("bundle", "alpha"), ("item", "two")], None),
    ([("bundle", "alpha"), ("item", "one"), ("extra", "z")], None),
]


@pytest.mark.parametrize(("entries", "expected"), NESTED, ids=[
    "nested", "nested-default", "ends-without-limit", "unknown-first-level", "default",
    "exact-beats-default", "exact-without-limit", "deeper-than-config", "limit-with-children",
    "child", "no-such-child", "deeper-than-leaf"])
def test_nested_and_default_matching(node: harness.Sitsmesh, entries: list[tuple[str, str]],
                                     expected: int | None) -> None:
    assert _limit(node, "catalog", *entries) == expected


WILDCARDS = [
    ("/img/", 11),            # * matches nothing too
    ("/img/cat.jpg", 11),     # trailing *
    ("/img/big/photo", 11),   # /img/* comes before /img/big*: first in load order wins
    ("/img/logo.png", 12),    # exact beats wildcard
    ("/v1/users", 13),        # middle *
    ("/v/users", 13),
    ("/v22/users", 13),
    ("/v1/users/x", 16),      # suffix missing: the key-only default, not the wildcard
    ("/a1/b2/c", 14),         # several *
    ("/a/b/c", 14),
    ("/a1/c", 16),            # middle part missing
    ("/ab/c", 16),
    ("/x/a/b/c", 16),         # prefix missing
    ("/plain", 16),           # wildcards beat the default only when they match
]


@pytest.mark.parametrize(("path", "expected"), WILDCARDS, ids=[w[0] for w in WILDCARDS])
def test_wildcard_values(node: harness.Sitsmesh, path: str, expected: int) -> None:
    assert _limit(node, "routes", ("path", path)) == expected


@pytest.mark.parametrize("value", ["GET", "", "x*y"])
def test_a_bare_star_matches_any_value_even_empty(node: harness.Sitsmesh, value: str) -> None:
    assert _limit(node, "routes", ("method", value)) == 17


def test_a_nested_wildcard(node: harness.Sitsmesh) -> None:
    assert _limit(node, "routes", ("svc", "front"), ("op", "getUser")) == 18
    assert _limit(node, "routes", ("svc", "front"), ("op", "put")) is None


def test_the_limit_carries_its_name_and_unit(node: harness.Sitsmesh) -> None:
    status = ask(node, "catalog", desc(("team", fresh()))).statuses[0]
    assert (status.current_limit.name, status.current_limit.requests_per_unit,
            status.current_limit.unit) == ("team_cap", 9, UNIT.HOUR)
    unnamed = ask(node, "catalog", desc(("region", fresh()))).statuses[0]
    assert (unnamed.current_limit.name, unnamed.current_limit.unit) == ("", UNIT.DAY)


def test_a_limit_named_in_replaces_is_dropped(node: harness.Sitsmesh) -> None:
    reply = ask(node, "catalog", desc(("team", "core")), desc(("team", fresh())))
    assert reply.statuses[0].current_limit.name == "core_cap"
    assert not reply.statuses[1].HasField("current_limit")
    assert (reply.statuses[1].code, reply.statuses[1].limit_remaining) == (OK, 0)


def test_unlimited_is_ok_with_max_remaining_and_no_limit(node: harness.Sitsmesh) -> None:
    partner = fresh()
    for _ in range(3):
        reply = ask(node, "catalog", desc(("probe", partner)), desc(("nomatch", "x")),
                    desc(("partner", partner)))
        assert reply.overall_code == OK
    probe, nomatch, unlimited = reply.statuses
    assert (probe.code, probe.limit_remaining, probe.current_limit.requests_per_unit) == (
        OK, 7, 10)
    assert (nomatch.code, nomatch.limit_remaining, nomatch.HasField("current_limit")) == (
        OK, 0, False)
    assert (unlimited.code, unlimited.limit_remaining) == (OK, UNLIMITED_REMAINING)
    assert not unlimited.HasField("current_limit")
    assert not unlimited.HasField("duration_until_reset")


def test_values_under_one_share_threshold_pattern_share_a_counter(
        node: harness.Sitsmesh) -> None:
    codes = [ask(node, "assets", desc(("file", f"docs/{n}"))).statuses[0]
             for n in ("a.pdf", "b.csv", "c.txt", "d/e.txt")]
    assert [(s.code, s.limit_remaining) for s in codes] == [
        (OK, 2), (OK, 1), (OK, 0), (OVER, 0)]
    # An exact value beside the shared pattern keeps its own counter and limit.
    exact = ask(node, "assets", desc(("file", "docs/readme"))).statuses[0]
    assert (exact.code, exact.limit_remaining, exact.current_limit.requests_per_unit) == (
        OK, 4, 5)


def test_without_share_threshold_each_value_counts_alone(node: harness.Sitsmesh) -> None:
    remaining = [ask(node, "assets", desc(("file", f"pics/{fresh()}"))).statuses[0]
                 .limit_remaining for _ in range(4)]
    assert remaining == [2, 2, 2, 2]


def test_a_shared_pattern_with_several_wildcards(node: harness.Sitsmesh) -> None:
    codes = [ask(node, "assets", desc(("bucket", b))).overall_code
             for b in ("b1-x-prod", "b22--prod", "bq-y-prod")]
    assert codes == [OK, OK, OVER]
    assert limit_of(ask(node, "assets", desc(("bucket", "b1-x-dev")))) is None


def test_a_shared_pattern_above_the_limit_shares_per_entry(node: harness.Sitsmesh) -> None:
    def remaining(owner: str, action: str) -> tuple[int, int]:
        s = ask(node, "assets", desc(("owner", owner), ("action", action))).statuses[0]
        return s.code, s.limit_remaining

    assert remaining("team/a", "read") == (OK, 1)
    assert remaining("team/b", "read") == (OK, 0)
    assert remaining("team/c", "read") == (OVER, 0)
    # The entry after the shared one keeps its own value in the counter.
    assert remaining("team/a", "write") == (OK, 1)


# request (domain, entries) -> the stats key the reference counts it under.
STATS_KEYS = [
    ("catalog", [("region", "us")], "catalog.region"),
    ("catalog", [("region", "eu")], "catalog.region_eu"),
    ("catalog", [("tenant", "acme"), ("plan", "silver")], "catalog.tenant_acme.plan"),
    ("routes", [("path", "/img/dog.png")], "routes.path_/img/*"),
    ("routes", [("path", "/v9/users")], "routes.path_/v*/users"),
    ("routes", [("path", "/a5/b6/c")], "routes.path_/a*/b*/c"),
    ("routes", [("svc", "front"), ("op", "getAll")], "routes.svc_front.op_get*"),
    ("labels", [("api", "v7")], "labels.api_v7"),
    ("labels", [("stage", "s1"), ("step", "p2")], "labels.stage_s1.step_p2"),
    ("labels", [("stage", "s1"), ("step", "final")], "labels.stage_s1.step_final"),
    ("labels", [("route", "draw"), ("verb", "GET"), ("caller", "u1")],
     "labels.route_draw.verb_GET.caller"),
    ("labels", [("route", ""), ("verb", ""), ("caller", "u1")], "labels.route.verb.caller"),
    ("labels", [("zone", "z1"), ("rack", "r2"), ("host", "h3")], "labels.zone.rack_r2.host"),
    ("labels", [("stack", "web"), ("layer", "dbmain"), ("shard", "s0")],
     "labels.stack_web.layer_dbmain.shard"),
    ("labels", [("pool", "p1"), ("member", "m2")], "labels.pool_p1.member_m2"),
    ("labels", [("cell", "c42"), ("tier", "t5"), ("slot", "x")], "labels.cell_c*.tier_t5.slot"),
    ("assets", [("route", "api/v1"), ("verb", "GET")], "assets.route_api/*.verb"),
    ("assets", [("owner", "team/z"), ("action", "list")], "assets.owner_team/*.action"),
]


@pytest.fixture(scope="module")
def stats_text(node: harness.Sitsmesh) -> str:
    """Every STATS_KEYS request once, then one scrape once all are counted."""
    for domain, entries, _ in STATS_KEYS:
        ask(node, domain, desc(*entries))
    return wait_for_keys(node, [key for _, _, key in STATS_KEYS], {})


@pytest.mark.parametrize(("domain", "entries", "key"), STATS_KEYS,
                         ids=[k for _, _, k in STATS_KEYS])
def test_the_stats_key_of_a_match(node: harness.Sitsmesh, stats_text: str, domain: str,
                                  entries: list[tuple[str, str]], key: str) -> None:
    counted = hits(node, key, stats_text)["total_hits"]
    seen = sorted(stats_keys(stats_text, domain + "."))
    assert counted >= 1, f"no hits under {key!r}; keys seen: {seen}"
