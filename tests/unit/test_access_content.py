"""Ownership by content, pure: when a written glob lies within a scope entry, what an
operator may write of tenants, token budgets and pipelines, reserved labels, bounded
refusals; and the gate's tenant filter (a pipeline admits only the tenants it governs)."""

from __future__ import annotations

import pytest

from sitsmesh.access import content
from sitsmesh.access.credentials import Credential, within
from sitsmesh.budgets.model import TokenBudget, budget_from
from sitsmesh.chains.pipeline import Pipeline, pipeline_from
from sitsmesh.pressure.gate import PressureGate
from sitsmesh.pressure.signals import Signals

OPERATOR = Credential("team-a", "operator", {"tenants": frozenset({"team-a"}),
                                              "models": frozenset({"team-a-*", "bert"})})
ADMIN = Credential("root", "admin")


@pytest.mark.parametrize(("pattern", "scope", "inside"), [
    ("anything", "*", True), ("*", "*", True),
    ("team-a-llm", "team-a-*", True), ("team-a-*", "team-a-*", True),
    ("team-a-x*", "team-a-*", True), ("team-a-[xy]", "team-a-*", True),
    ("bert", "bert", True), ("bert", "ber?", True),
    ("team-a*", "team-a-*", False), ("team-*", "team-a-*", False), ("*", "team-a-*", False),
    ("team-b-llm", "team-a-*", False), ("ber?", "bert", False), ("bert*", "bert", False),
    ("x-*", "[xy]-*", False),   # the entry is not a literal prefix: refused, conservatively
    ("team-a-llm", "team-?-*", True),  # a plain name: the entry's own match decides
])
def test_within(pattern: str, scope: str, inside: bool) -> None:
    assert within(pattern, scope) is inside


def test_credential_scopes_take_prefix_globs() -> None:
    assert OPERATOR.covers("models", "team-a-llm")
    assert not OPERATOR.covers("models", "team-b-llm")
    assert OPERATOR.covers("tenants", "team-a") and not OPERATOR.covers("tenants", "team-ab")


def test_a_tenant_s_models_and_labels_within_scope_or_kept() -> None:
    assert content.tenant(OPERATOR, "team-a", ["team-a-llm", "bert"], {}) is None
    assert content.tenant(OPERATOR, "team-a", ["team-b-llm"], {}) == (
        "credential 'team-a' (operator) may not write tenant 'team-a': models[0] "
        "'team-b-llm' is not within its models scope")
    # What the stored tenant holds (an admin's grant) may stay.
    assert content.tenant(OPERATOR, "team-a", ["legacy", "bert"], {},
                          before_models=("legacy",)) is None
    assert content.tenant(ADMIN, "team-a", ["*"], {"sitsmesh.io/x": "y"}) is None
    refused = content.tenant(OPERATOR, "team-a", ["bert"],
                             {"sitsmesh.io/managed-by": "team-b"})
    assert refused is not None and "'sitsmesh.io/managed-by=team-b' is reserved" in refused
    assert content.tenant(OPERATOR, "team-a", ["bert"],
                          {"sitsmesh.io/managed-by": "team-a", "team": "x"}) is None
    assert content.tenant(OPERATOR, "team-a", ["bert"], {"sitsmesh.io/tier": "gold"},
                          before_labels={"sitsmesh.io/tier": "gold"}) is None


def test_a_token_budget_s_limit_models_within_scope_or_kept() -> None:
    def budget(*models: list[str]) -> TokenBudget:
        return budget_from("team-a", {"limits": [
            {"tokens": 10, "per": "minute", **({"models": m} if m else {})} for m in models]})

    assert content.budget_problems(OPERATOR, budget(["team-a-*"], ["bert"]), None) == []
    assert content.budget_problems(OPERATOR, budget(["bert"], ["team-b-llm"]), None) == [
        "limits[1].models[0] 'team-b-llm' is not within its models scope"]
    # The default `*` reaches every model: an operator names its own instead.
    assert content.budget_problems(OPERATOR, budget([]), None) == [
        "limits[0].models[0] '*' is not within its models scope"]
    # What the stored budget holds (an admin's) may stay; an admin writes anything.
    assert content.budget_problems(OPERATOR, budget(["*"], ["bert"]), budget([])) == []
    assert content.budget_problems(ADMIN, budget([]), None) == []


def test_a_pipeline_s_models_stage_models_and_tenants() -> None:
    def pipe(triton: str = "bert", **body: object) -> Pipeline:
        return pipeline_from("p", {"stages": [{"name": "s", "match": {"route_name": "r"},
                                               "triton_model": triton}], **body})

    ok = pipe(models=["team-a-*"], tenants=["team-a"])
    assert content.pipeline(OPERATOR, ok, None) is None
    refused = content.pipeline(OPERATOR, pipe(models=["team-b-*"], triton="team-b-llm",
                                              tenants=["team-b"]), None)
    assert refused == (
        "credential 'team-a' (operator) may not write pipeline 'p': models[0] 'team-b-*' is "
        "not within its models scope; stages[0].triton_model 'team-b-llm' is not within its "
        "models scope; tenants[0] 'team-b' is not within its tenants scope")
    every = content.pipeline(OPERATOR, pipe(models=["bert"]), None)
    assert every is not None and "would govern every tenant's requests" in every
    assert content.governed_default(OPERATOR) == ["team-a"]
    assert content.governed_default(ADMIN) is None


def test_a_refusal_names_a_bounded_number_of_problems() -> None:
    refused = content.tenant(OPERATOR, "team-a", [f"x-{i}" for i in range(100)], {})
    assert refused is not None and refused.endswith("; and 80 more")
    assert refused.count("is not within") == content.MAX_NAMED
    long = content.tenant(OPERATOR, "team-a", ["y" * 10_000], {})
    assert long is not None and len(long) < 400 and "(10000 characters)" in long


def test_the_gate_enters_only_a_pipeline_that_governs_the_tenant() -> None:
    gate = PressureGate(Signals())
    stage = {"name": "s", "match": {"route_name": "r"}}
    gate.set_pipelines({
        "pipe-a": pipeline_from("pipe-a", {"stages": [stage], "models": ["shared"],
                                           "tenants": ["team-a"]}),
        "pipe-b": pipeline_from("pipe-b", {"stages": [stage], "models": ["shared", "b-*"],
                                           "tenants": ["team-b*"]}),
        "open": pipeline_from("open", {"stages": [stage], "models": ["o"]})})
    assert gate.pipeline_of("", "shared", "team-a") == "pipe-a"
    assert gate.pipeline_of("", "shared", "team-b") == "pipe-b"
    assert gate.pipeline_of("", "shared", "team-c") == ""
    assert gate.pipeline_of("pipe-a", "shared", "team-b") == "pipe-b"  # hint ignored
    assert gate.pipeline_of("pipe-a", "b-1", "team-b2") == "pipe-b"
    assert gate.pipeline_of("", "o", "") == "open"  # lists no tenants: governs all
    assert gate.pipeline_of("", "shared", "") == ""
    assert gate.governs("pipe-b", "team-b7") and not gate.governs("pipe-b", "team-a")
