"""Inference Extension headers: which objective and fairness id a decision carries, and
that a client-sent one never survives."""

from __future__ import annotations

import pytest

from sitsmesh.authz.admission import Admission, AdmissionPolicy
from sitsmesh.authz.check import Allowed, Authorizer, AuthzSettings, AuthzSnapshot, CheckInput
from sitsmesh.authz.gie import (
    FAIRNESS_HEADER,
    OBJECTIVE_HEADER,
    GieHeaders,
    GieSettings,
    header,
    priority_objectives,
)
from sitsmesh.authz.model import ApiKey, Tenant, digest, new_key
from sitsmesh.config import load_settings
from sitsmesh.errors import ConfigError

PLAIN = Tenant("plain", ("*",), priority=3, max_priority=9)
LABELLED = Tenant("gold", ("*",), priority=1, labels={"inference-objective": "premium"})
KEY_ID, KEY = new_key()
GOLD_ID, GOLD = new_key()


def test_label_wins_over_the_priority_map() -> None:
    table = GieHeaders(GieSettings(priority_objectives={0: "batch", 5: "interactive"}))
    assert table.objective(LABELLED, 7) == "premium"
    assert table.objective(PLAIN, 0) == "batch"
    assert table.objective(PLAIN, 4) == "batch"
    assert table.objective(PLAIN, 5) == "interactive"
    assert table.objective(PLAIN, 9) == "interactive"


def test_no_objective_below_the_lowest_priority_or_without_a_map() -> None:
    assert GieHeaders(GieSettings(priority_objectives={3: "std"})).objective(PLAIN, 2) == ""
    assert GieHeaders(GieSettings()).objective(PLAIN, 9) == ""


@pytest.mark.parametrize("value", ["Premium", "has space", "a\r\nx-evil: 1", "-x", "x" * 254])
def test_a_label_that_cannot_name_an_objective_falls_back(value: str) -> None:
    tenant = Tenant("odd", ("*",), labels={"inference-objective": value})
    table = GieHeaders(GieSettings(priority_objectives={0: "batch"}))
    assert table.objective(tenant, 0) == "batch"


def test_the_label_key_is_configurable() -> None:
    tenant = Tenant("t", ("*",), labels={"objective": "fast", "inference-objective": "slow"})
    assert GieHeaders(GieSettings(objective_label="objective")).objective(tenant, 0) == "fast"


def test_decide_sets_both_or_strips_a_sent_objective() -> None:
    table = GieHeaders(GieSettings())
    sent = {OBJECTIVE_HEADER: "premium", FAIRNESS_HEADER: "someone-else"}
    assert table.decide(LABELLED, 1, sent) == (
        ((FAIRNESS_HEADER, "gold"), (OBJECTIVE_HEADER, "premium")), ())
    assert table.decide(PLAIN, 1, sent) == (((FAIRNESS_HEADER, "plain"),), (OBJECTIVE_HEADER,))
    assert table.decide(PLAIN, 1, {}) == (((FAIRNESS_HEADER, "plain"),), ())


def _authorizer(gie: GieSettings) -> Authorizer:
    keys = {KEY_ID: ApiKey(KEY_ID, "plain", digest(KEY), 0.0),
            GOLD_ID: ApiKey(GOLD_ID, "gold", digest(GOLD), 0.0)}
    snapshot = AuthzSnapshot({"plain": PLAIN, "gold": LABELLED}, keys)
    return Authorizer(snapshot, AuthzSettings(gie=gie), Admission(AdmissionPolicy(), hold_s=5))


def _allowed(a: Authorizer, headers: dict[str, str]) -> Allowed:
    decision = a.check(CheckInput(headers, "/v2/models/bert/infer"))
    assert isinstance(decision, Allowed), decision
    return decision


FORGED = {OBJECTIVE_HEADER: "premium", FAIRNESS_HEADER: "gold"}


def test_check_overwrites_forged_values_with_its_own() -> None:
    a = _authorizer(GieSettings(priority_objectives={0: "batch", 6: "interactive"}))
    ok = _allowed(a, {"x-api-key": KEY, "x-priority": "7", **FORGED})
    got = dict(ok.set_headers)
    assert got[FAIRNESS_HEADER] == "plain" and got[OBJECTIVE_HEADER] == "interactive"
    assert got["x-sits-tenant"] == "plain", "x-sits-* headers are still set"
    gold = _allowed(a, {"x-api-key": GOLD, **FORGED})
    assert dict(gold.set_headers)[OBJECTIVE_HEADER] == "premium"


def test_check_strips_a_forged_objective_when_it_has_none() -> None:
    ok = _allowed(_authorizer(GieSettings()), {"x-api-key": KEY, **FORGED})
    assert dict(ok.set_headers)[FAIRNESS_HEADER] == "plain"
    assert OBJECTIVE_HEADER not in dict(ok.set_headers)
    assert OBJECTIVE_HEADER in ok.remove_headers


def test_off_leaves_both_headers_alone() -> None:
    ok = _allowed(_authorizer(GieSettings(enabled=False)), {"x-api-key": KEY, **FORGED})
    names = {name for name, _ in ok.set_headers} | set(ok.remove_headers)
    assert not names & {OBJECTIVE_HEADER, FAIRNESS_HEADER}


def test_custom_header_names() -> None:
    a = _authorizer(GieSettings(objective_header="x-objective", fairness_header="x-flow"))
    ok = _allowed(a, {"x-api-key": GOLD})
    got = dict(ok.set_headers)
    assert got["x-flow"] == "gold" and got["x-objective"] == "premium"
    assert FAIRNESS_HEADER not in got


def test_priority_objectives_parses_yaml_and_flag_forms() -> None:
    assert priority_objectives({0: "batch", "5": "interactive"}) == {0: "batch",
                                                                      5: "interactive"}
    assert priority_objectives("0=batch, 5=interactive") == {0: "batch", 5: "interactive"}


@pytest.mark.parametrize(("raw", "message"), [
    ("10=x", "priority '10': expected an integer from 0 to 9"),
    ("-1=x", "priority '-1': expected an integer from 0 to 9"),
    ({True: "x"}, "priority True: expected an integer from 0 to 9"),
    ("1=x,01=y", "priority 1 is given twice"),
    ("batch", "expected priority=objective, got 'batch'"),
    ("1=Batch", "objective 'Batch': expected an InferenceObjective name"),
    (["x"], "expected a mapping of priority to objective"),
])
def test_priority_objectives_rejects_bad_input(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        priority_objectives(raw)


@pytest.mark.parametrize(("raw", "message"), [
    ("x-sits-objective", "x-sits-objective: x-sits-\\* headers are sitsmesh's own"),
    ("bad header", "not a valid header name"),
    ("", "expected a header name"),
])
def test_header_rejects_bad_names(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        header(raw)


def test_settings_from_environment_and_their_errors() -> None:
    settings = load_settings(env={"SITSMESH_GIE_PRIORITY_OBJECTIVES": "0=batch,5=interactive",
                                  "SITSMESH_GIE_OBJECTIVE_HEADER": "X-Objective"})
    assert settings.gie_headers is True
    assert settings.gie_priority_objectives == {0: "batch", 5: "interactive"}
    assert settings.gie_objective_header == "x-objective"
    with pytest.raises(ConfigError, match=r"^environment SITSMESH_GIE_PRIORITY_OBJECTIVES: "
                                          r"priority '12'"):
        load_settings(env={"SITSMESH_GIE_PRIORITY_OBJECTIVES": "12=x"})
    with pytest.raises(ConfigError, match="name the same header x-flow"):
        load_settings(env={"SITSMESH_GIE_OBJECTIVE_HEADER": "x-flow",
                           "SITSMESH_GIE_FAIRNESS_HEADER": "x-flow"})
