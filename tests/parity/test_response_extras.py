"""What envoyproxy/ratelimit adds to an answer when asked (spec §6): the RateLimit-*
response headers (LIMIT_RESPONSE_HEADERS_ENABLED, custom names) and dynamic metadata
(RESPONSE_DYNAMIC_METADATA). Each fact holds on the memory store and on a real Redis."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf.json_format import MessageToDict

from sitsmesh.dev import harness
from tests.parity.rls import DAY, OK, OVER, Fleet, ask, desc, fresh

pytestmark = pytest.mark.integration

DEFAULT_NAMES = ("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset")
# The reference's fields; sitsmesh documents two additions for quota mode.
REFERENCE_FIELDS = {"domain", "descriptors", "hitsAddend", "metadata"}
SITSMESH_ADDITIONS = {"quotaModeEnabled", "quotaModeViolations"}


@pytest.fixture(scope="module")
def plain(fleet: Fleet, store: str) -> harness.Sitsmesh:
    return fleet.get(store)


@pytest.fixture(scope="module")
def extras(fleet: Fleet, store: str) -> harness.Sitsmesh:
    return fleet.get(store, "--ratelimit-response-headers", "true",
                     "--ratelimit-response-dynamic-metadata", "true")


def _headers(reply: rls_pb2.RateLimitResponse) -> list[tuple[str, str]]:
    return [(h.key, h.value) for h in reply.response_headers_to_add]


def _shown(reply: rls_pb2.RateLimitResponse) -> tuple[str, str]:
    """(limit, remaining) the default headers show; their names and order checked."""
    names = [name for name, _ in _headers(reply)]
    assert names == list(DEFAULT_NAMES), _headers(reply)
    values = dict(_headers(reply))
    return values["RateLimit-Limit"], values["RateLimit-Remaining"]


def test_no_headers_by_default(plain: harness.Sitsmesh) -> None:
    assert not ask(plain, "meter", desc(("basic", fresh()))).response_headers_to_add


def test_headers_show_the_descriptor_with_least_remaining(extras: harness.Sitsmesh) -> None:
    value = fresh()
    reply = ask(extras, "meter", desc(("basic", value)), desc(("narrow", value)))
    assert _shown(reply) == ("2", "1")
    reset = int(dict(_headers(reply))["RateLimit-Reset"])
    assert reset == reply.statuses[1].duration_until_reset.seconds
    assert 1 <= reset <= 3600


def test_headers_on_a_tie_show_the_first(extras: harness.Sitsmesh) -> None:
    value = fresh()
    reply = ask(extras, "meter", desc(("basic", value), addend=4), desc(("narrow", value)))
    assert [s.limit_remaining for s in reply.statuses] == [1, 1]
    assert _shown(reply) == ("5", "1")


def test_headers_never_show_unlimited_or_unmatched(extras: harness.Sitsmesh) -> None:
    reply = ask(extras, "meter", desc(("free", "x")), desc(("nomatch", "y")),
                desc(("basic", fresh())))
    assert _shown(reply) == ("5", "4")
    for alone in (desc(("free", "x")), desc(("nomatch", "y"))):
        assert not ask(extras, "meter", alone).response_headers_to_add


def test_headers_show_a_descriptor_over_the_limit(extras: harness.Sitsmesh) -> None:
    value = fresh()
    ask(extras, "meter", desc(("narrow", value)), hits_addend=2)
    # Both have 0 left: the first would win the tie, but the one over the limit is shown.
    reply = ask(extras, "meter", desc(("basic", value), addend=5), desc(("narrow", value)))
    assert [(s.code, s.limit_remaining) for s in reply.statuses] == [(OK, 0), (OVER, 0)]
    assert _shown(reply) == ("2", "0")


@pytest.mark.parametrize(("order", "shown"), [(("basic", "narrow"), "2"),
                                              (("narrow", "basic"), "5")])
def test_headers_show_the_last_of_several_over(extras: harness.Sitsmesh,
                                               order: tuple[str, str], shown: str) -> None:
    value = fresh()
    reply = ask(extras, "meter", *(desc((k, value), addend=6) for k in order))
    assert reply.overall_code == OVER
    assert _shown(reply) == (shown, "0")


def test_headers_do_not_show_a_quota_descriptor_for_being_over(
        extras: harness.Sitsmesh) -> None:
    value = fresh()
    ask(extras, "meter", desc(("quota", value)))
    reply = ask(extras, "meter", desc(("basic", value), addend=5), desc(("quota", value)))
    assert [(s.code, s.limit_remaining) for s in reply.statuses] == [(OK, 0), (OVER, 0)]
    assert _shown(reply) == ("5", "0")


def test_header_names_can_be_changed(fleet: Fleet) -> None:
    renamed = fleet.get("memory", "--ratelimit-response-headers", "true",
                        "--ratelimit-limit-header", "X-Cap",
                        "--ratelimit-remaining-header", "X-Left",
                        "--ratelimit-reset-header", "X-Reset-In")
    reply = ask(renamed, "meter", desc(("narrow", fresh())))
    assert [name for name, _ in _headers(reply)] == ["X-Cap", "X-Left", "X-Reset-In"]
    assert [value for _, value in _headers(reply)][:2] == ["2", "1"]


def _metadata(reply: rls_pb2.RateLimitResponse) -> dict[str, Any]:
    assert reply.HasField("dynamic_metadata")
    found: dict[str, Any] = MessageToDict(reply.dynamic_metadata)
    return found


def test_no_dynamic_metadata_by_default(plain: harness.Sitsmesh) -> None:
    assert not ask(plain, "tagged", desc(("svc", f"ledger-{fresh()}"))).HasField(
        "dynamic_metadata")


def test_dynamic_metadata_shape(extras: harness.Sitsmesh) -> None:
    value = f"ledger-{fresh()}"
    found = _metadata(ask(extras, "tagged", desc(("svc", value))))
    assert found == {"domain": "tagged", "descriptors": [{"entries": [f"svc={value}"]}],
                     "metadata": {"auditor": "internal"}}


def test_dynamic_metadata_carries_the_hits_addends(extras: harness.Sitsmesh) -> None:
    first, second = f"ledger-{fresh()}", f"ledger-{fresh()}"
    found = _metadata(ask(extras, "tagged", desc(("svc", first), addend=1),
                          desc(("svc", second), ("extra", "e")), hits_addend=2))
    assert found["hitsAddend"] == 2
    assert found["descriptors"] == [{"entries": [f"svc={first}"], "hitsAddend": 1},
                                    {"entries": [f"svc={second}", "extra=e"]}]


def test_dynamic_metadata_has_no_fields_beyond_the_references(
        extras: harness.Sitsmesh) -> None:
    found = _metadata(ask(extras, "tagged", desc(("credit", fresh())),
                          desc(("svc", f"ledger-{fresh()}"), addend=1), hits_addend=1))
    assert set(found) <= REFERENCE_FIELDS | SITSMESH_ADDITIONS
    for item in found["descriptors"]:
        assert set(item) <= {"entries", "hitsAddend"}


def test_metadata_merges_in_request_order_first_value_wins(extras: harness.Sitsmesh) -> None:
    value = fresh()
    found = _metadata(ask(extras, "tagged", desc(("svc", f"billing-{value}")),
                          desc(("svc", f"search-{value}"))))
    assert found["metadata"] == {"owner": "payments", "tags": ["fast", "cached"],
                                 "limits": {"tier": 2, "zone": "eu", "burst": True}}


def test_metadata_leaves_out_a_descriptor_over_the_limit(extras: harness.Sitsmesh) -> None:
    billing = f"billing-{fresh()}"
    ask(extras, "tagged", desc(("svc", billing)))
    reply = ask(extras, "tagged", desc(("svc", billing)), desc(("svc", f"ledger-{fresh()}")))
    assert reply.overall_code == OVER
    assert _metadata(reply)["metadata"] == {"auditor": "internal"}


def test_metadata_leaves_out_a_quota_descriptor_over_the_limit(
        extras: harness.Sitsmesh) -> None:
    credit = fresh()
    ask(extras, "tagged", desc(("credit", credit)))
    reply = ask(extras, "tagged", desc(("credit", credit)), desc(("svc", f"ledger-{fresh()}")))
    assert _metadata(reply)["metadata"] == {"auditor": "internal"}


def test_metadata_keeps_a_shadow_descriptor_over_the_limit(extras: harness.Sitsmesh) -> None:
    preview = fresh()
    ask(extras, "tagged", desc(("preview", preview)))
    reply = ask(extras, "tagged", desc(("preview", preview)))
    assert reply.overall_code == OK and reply.statuses[0].limit_remaining == 0
    assert _metadata(reply)["metadata"] == {"mode": "preview"}


@pytest.mark.parametrize("kind", ["unlimited", "override"])
def test_metadata_comes_only_from_limits_that_count(extras: harness.Sitsmesh,
                                                    kind: str) -> None:
    d = (desc(("svc", f"free-{fresh()}")) if kind == "unlimited"
         else desc(("svc", f"ledger-{fresh()}"), override=(10, DAY)))
    assert "metadata" not in _metadata(ask(extras, "tagged", d))


def test_metadata_comes_from_the_matched_node_only(extras: harness.Sitsmesh) -> None:
    found = _metadata(ask(extras, "tagged", desc(("org", "main"), ("user", fresh()))))
    assert found["metadata"] == {"level": "user"}


def test_metadata_keeps_a_date_like_value_as_text(extras: harness.Sitsmesh) -> None:
    # The reference reads config YAML with Go's yaml.v2, which keeps an unquoted
    # timestamp as its text when decoding into metadata's free-form map.
    found = _metadata(ask(extras, "tagged", desc(("build", f"nightly-{fresh()}"))))
    assert found["metadata"] == {"since": "2024-01-01", "owner": "ci"}
