"""The published JSON Schemas and CRDs: fresh, valid Kubernetes objects, and they accept
the documents `apply` accepts (and refuse what it refuses for shape)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from sitsmesh.declarative import schemas
from sitsmesh.declarative.models import KINDS

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.30.0"

SAMPLES: dict[str, dict[str, Any]] = {
    "Tenant": {"models": ["resnet*"], "priority": 3, "max_concurrency": 8},
    "ApiKeyPolicy": {"max_ttl_s": 86400, "max_active_keys": 2},
    "TokenBudget": {"limits": [{"tokens": 100000, "per": "minute"},
                               {"tokens": 10**9, "per": "day", "each": "model",
                                "models": ["llama-*"]}],
                    "weights": {"output": 3, "cached_input": 0.25}, "chars_per_token": 3.5},
    "Pipeline": {"stages": [{"name": "pre", "match": {"upstream_cluster": "pre"}},
                            {"name": "model", "match": {"header": "model"},
                             "sla_p99_ms": 40, "triton_model": "resnet"}]},
    "Thresholds": {"policy": "sitsmesh", "tick_ms": 100,
                   "stages": {"model": {"queue_capacity": 32}}},
    "RateLimitConfig": {"descriptors": [{"key": "tenant", "value": "team-a",
                                         "rate_limit": {"unit": "second",
                                                        "requests_per_unit": 50}}]},
}


def sample(kind: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "sitsmesh.io/v1alpha1", "kind": kind,
            "metadata": {"name": "sample", "namespace": "sitsmesh",
                         "labels": {"sitsmesh.io/managed-by": "team-a"}},
            "spec": {**SAMPLES[kind], **spec}}


def test_committed_schemas_and_crds_are_fresh() -> None:
    stale = [rel for rel, text in schemas.rendered().items()
             if not (ROOT / rel).exists() or (ROOT / rel).read_text(encoding="utf-8") != text]
    assert not stale, f"stale generated files {stale}: run `sitsmesh schemas write .`"


def test_every_kind_has_a_schema_and_a_crd() -> None:
    rendered = schemas.rendered()
    for kind in KINDS:
        assert f"schemas/{kind}.json" in rendered
        assert f"deploy/crds/{kind.lower()}.yaml" in rendered


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_crd_is_a_valid_kubernetes_object(kind: str) -> None:
    doc = yaml.safe_load((ROOT / "deploy/crds" / f"{kind.lower()}.yaml").read_text())
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert doc["spec"]["group"] == "sitsmesh.io"
    assert doc["spec"]["versions"][0]["name"] == "v1alpha1"


def _crd_schema(kind: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "deploy/crds" / f"{kind.lower()}.yaml").read_text())
    schema: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sample_resource_matches_its_crd_and_json_schema(kind: str) -> None:
    jsonschema.Draft4Validator(_crd_schema(kind)).validate(sample(kind))
    published = schemas.json_schema(kind)
    doc = sample(kind)
    del doc["metadata"]["namespace"]  # a file for `apply`, not a Kubernetes object
    jsonschema.Draft202012Validator(published).validate(doc)


@pytest.mark.parametrize(("kind", "spec"), [
    ("Tenant", {"priority": 12}),
    ("Tenant", {"models": []}),
    ("ApiKeyPolicy", {"max_ttl_s": -1}),
    ("TokenBudget", {"limits": [{"tokens": 10, "per": "week"}]}),
    ("TokenBudget", {"limits": [{"tokens": 0, "per": "day"}]}),
    ("TokenBudget", {"weights": {"output": 101}}),
    ("TokenBudget", {"limits": []}),
    ("Pipeline", {"stages": [{"name": "Bad Name", "match": {"header": "x"}}]}),
    ("Thresholds", {"tick_ms": 5}),
    ("RateLimitConfig", {"descriptors": [{"value": "no-key"}]}),
])
def test_schemas_refuse_a_bad_spec(kind: str, spec: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(_crd_schema(kind)).validate(sample(kind, **spec))
    doc = sample(kind, **spec)
    del doc["metadata"]["namespace"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schemas.json_schema(kind)).validate(doc)


def test_json_schema_refuses_unknown_keys() -> None:
    doc = sample("Tenant", colour="blue")
    del doc["metadata"]["namespace"]
    with pytest.raises(jsonschema.ValidationError, match="colour"):
        jsonschema.Draft202012Validator(schemas.json_schema("Tenant")).validate(doc)
