"""budget_from: every refusal names its field, and a TokenBudget document is refused with
exactly the domain's message; a valid body reads back as its canonical form."""

from __future__ import annotations

from typing import Any

import pytest

from sitsmesh.authz.model import InvalidObject
from sitsmesh.budgets.model import MAX_LIMITS, budget_from
from sitsmesh.declarative import documents
from sitsmesh.errors import InvalidArgumentError

LIMIT = {"tokens": 1000, "per": "minute"}


def body(**changes: Any) -> dict[str, Any]:
    return {"limits": [LIMIT], **changes}


def limit(**changes: Any) -> dict[str, Any]:
    return body(limits=[{**LIMIT, **changes}])


REFUSALS = [
    (body(limits=[{**LIMIT, "per": "week"}]),
     "token budget acme: limits[0]: per must be one of minute, hour, day, got 'week'"),
    (limit(per=None), "limits[0]: per must be one of minute, hour, day, got None"),
    (limit(each="key"), "limits[0]: each must be one of tenant, api_key, model, got 'key'"),
    (limit(tokens=0), "limits[0]: tokens must be an integer from 1 to 1000000000000"),
    (limit(tokens=True), "limits[0]: tokens must be an integer from 1 to 1000000000000"),
    (limit(tokens=10**12 + 1), "limits[0]: tokens must be an integer from 1 to 1000000000000"),
    (limit(tokens=10.0), "limits[0]: tokens must be an integer from 1 to 1000000000000"),
    ({"limits": [LIMIT, {"per": "day"}]},
     "limits[1]: tokens must be an integer from 1 to 1000000000000"),
    (limit(window="minute"),
     "limits[0]: unknown key 'window' (known: each, models, per, tokens)"),
    (body(limit=1), "token budget acme: unknown key 'limit' (known: chars_per_token, "
     "default_max_tokens, limits, weights)"),
    (body(limits=["1000/minute"]), "limits[0] must be a mapping with tokens and per"),
    ({}, "token budget acme: limits must be a list of 1 to 16 limits"),
    (body(limits=[]), "limits must be a list of 1 to 16 limits"),
    (body(limits=[LIMIT] * (MAX_LIMITS + 1)), "limits must be a list of 1 to 16 limits"),
    (body(weights={"input": -1}), "token budget acme: weights.input must be a number from "
     "0 to 100"),
    (body(weights={"output": 101}), "weights.output must be a number from 0 to 100"),
    (body(weights={"cached_input": True}), "weights.cached_input must be a number from 0 "
     "to 100"),
    (body(weights={"output": "1"}), "weights.output must be a number from 0 to 100"),
    (body(weights={"output": float("nan")}), "weights.output must be a number from 0 to 100"),
    (body(weights={"prompt": 1}), "token budget acme: weights: unknown key 'prompt' (known: "
     "cached_input, input, output)"),
    (body(weights=[1, 1, 0]), "weights must map input, output, cached_input to numbers"),
    (limit(models=[]), "limits[0]: models must be a non-empty list of globs"),
    (limit(models="llama*"), "limits[0]: models must be a non-empty list of globs"),
    (limit(models=["llama", ""]), "limits[0]: models must be a non-empty list of globs"),
    (limit(models=["x" * 1025]), "token budget acme: limits[0]: model glob 'xxxx"),
    (body(default_max_tokens=0), "default_max_tokens must be an integer from 1 to 1000000"),
    (body(default_max_tokens=1_000_001), "default_max_tokens must be an integer from 1 to "
     "1000000"),
    (body(chars_per_token=0.5), "chars_per_token must be a number from 1 to 16"),
    (body(chars_per_token=False), "chars_per_token must be a number from 1 to 16"),
]


@pytest.mark.parametrize(("raw", "message"), REFUSALS)
def test_each_refusal_names_its_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidObject) as refused:
        budget_from("acme", raw)
    assert message in refused.value.message


def test_the_name_must_be_a_tenant_s() -> None:
    with pytest.raises(InvalidObject, match="token budget 'Acme!': name it after its tenant"):
        budget_from("Acme!", body())


def test_a_valid_budget_reads_back_canonical_with_its_defaults() -> None:
    budget = budget_from("acme", body(limits=[
        LIMIT, {"tokens": 5, "per": "day", "each": "model", "models": ["llama-*"]}],
        weights={"output": 3}))
    assert budget.to_body() == {
        "limits": [{"tokens": 1000, "per": "minute", "each": "tenant", "models": ["*"]},
                   {"tokens": 5, "per": "day", "each": "model", "models": ["llama-*"]}],
        "weights": {"input": 1.0, "output": 3.0, "cached_input": 0.0},
        "default_max_tokens": 4096, "chars_per_token": 4.0}
    assert budget_from("acme", budget.to_body()) == budget


def _declared(raw: dict[str, Any]) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as declared:
        documents.validate([{"apiVersion": "sitsmesh.io/v1alpha1", "kind": "TokenBudget",
                             "metadata": {"name": "acme"}, "spec": raw}])
    return declared.value


@pytest.mark.parametrize(("raw", "message"), REFUSALS)
def test_document_messages_are_the_domain_s(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidObject) as domain:
        budget_from("acme", raw)
    assert _declared(raw).message == \
        f"document 0 (TokenBudget/acme): {domain.value.message}"


def test_a_document_becomes_the_canonical_body() -> None:
    [doc] = documents.validate([{"apiVersion": "sitsmesh.io/v1alpha1", "kind": "TokenBudget",
                                 "metadata": {"name": "acme"},
                                 "spec": body(weights={"input": 2}, chars_per_token=3)}])
    assert doc.body() == budget_from("acme", body(weights={"input": 2},
                                                  chars_per_token=3)).to_body()
