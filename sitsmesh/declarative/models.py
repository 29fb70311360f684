"""One definition per declarative kind: the pydantic models behind `sitsmesh apply`, the
published JSON Schemas and the CRDs.

The models describe the shape (for editors, schemas and CRDs); the rules stay in the
domain validators (tenant_from, budget_from, pipeline_from, thresholds_from, parse_domain),
which a `before` validator runs first, so a document fails with exactly the message the
imperative admin RPCs give. A document that passes becomes its domain's canonical body.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from sitsmesh.authz.keypolicy import MAX_KEYS, MAX_TTL_S, key_policy_from
from sitsmesh.authz.model import MAX_PRIORITY, tenant_from
from sitsmesh.budgets.model import (
    DEFAULT_MAX_TOKENS,
    MAX_LIMITS,
    MAX_OUTPUT_TOKENS,
    MAX_TOKENS,
    MAX_WEIGHT,
    budget_from,
)
from sitsmesh.chains.pipeline import STALL_MS_MAX, STALL_MS_MIN, pipeline_from
from sitsmesh.errors import SitsmeshError
from sitsmesh.pressure.thresholds import thresholds_from
from sitsmesh.ratelimit.config import parse_domain

API_VERSION = "sitsmesh.io/v1alpha1"
GROUP, VERSION = API_VERSION.split("/")
_NAME = r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Metadata(_Strict):
    name: Annotated[str, Field(pattern=_NAME, max_length=63)]
    labels: dict[str, str] = Field(default_factory=dict)


# --- specs: the shape the admin RPCs accept ------------------------------------------

class TenantSpec(_Strict):
    models: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    priority: Annotated[int, Field(ge=0, le=MAX_PRIORITY)] = 0
    max_priority: Annotated[int, Field(ge=0, le=MAX_PRIORITY)] = 0
    max_concurrency: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    labels: dict[str, str] = Field(default_factory=dict)


class ApiKeyPolicySpec(_Strict):
    """What the keys of the tenant metadata.name may be (checked when a key is made)."""
    max_ttl_s: Annotated[int, Field(ge=0, le=MAX_TTL_S)] = 0
    max_active_keys: Annotated[int, Field(ge=0, le=MAX_KEYS)] = 0


class BudgetLimit(_Strict):
    tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)]
    per: Literal["minute", "hour", "day"]
    each: Literal["tenant", "api_key", "model"] = "tenant"
    models: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] = \
        Field(default_factory=lambda: ["*"])


_Weight = Annotated[float, Field(ge=0, le=MAX_WEIGHT)]


class BudgetWeights(_Strict):
    input: _Weight = 1.0
    output: _Weight = 1.0
    cached_input: _Weight = 0.0


class TokenBudgetSpec(_Strict):
    """The tokens the tenant metadata.name's LLM requests may spend (checked at Check)."""
    limits: Annotated[list[BudgetLimit], Field(min_length=1, max_length=MAX_LIMITS)]
    weights: BudgetWeights = Field(default_factory=BudgetWeights)
    default_max_tokens: Annotated[int, Field(ge=1, le=MAX_OUTPUT_TOKENS)] = DEFAULT_MAX_TOKENS
    chars_per_token: Annotated[float, Field(ge=1, le=16)] = 4.0


class StageMatch(_Strict):
    upstream_cluster: str | None = None
    route_name: str | None = None
    header: str | None = None


class PipelineStage(_Strict):
    name: Annotated[str, Field(pattern=_NAME)]
    match: StageMatch
    sla_p99_ms: Annotated[float, Field(gt=0)] | None = None
    ttfb_p99_ms: Annotated[float, Field(gt=0)] | None = None
    triton_model: str | None = None
    stall_ms: Annotated[float, Field(ge=STALL_MS_MIN, le=STALL_MS_MAX)] | None = None


class PipelineSpec(_Strict):
    stages: Annotated[list[PipelineStage], Field(min_length=1)]
    models: list[str] | None = None
    tenants: list[str] | None = None


class StageThresholdsSpec(_Strict):
    sla_multiplier: Annotated[float, Field(ge=0.1, le=100)] | None = None
    queue_fill_high: Annotated[float, Field(ge=0, le=1)] | None = None
    queue_fill_low: Annotated[float, Field(ge=0, le=1)] | None = None
    queue_capacity: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    parallelism: Annotated[int, Field(ge=1, le=100_000)] | None = None
    fanout: Annotated[float, Field(ge=0.01, le=1000)] | None = None


class ThresholdsSpec(StageThresholdsSpec):
    policy: Literal["sitsmesh", "seed", "off"] | None = None
    tick_ms: Annotated[int, Field(ge=10, le=10_000)] | None = None
    hysteresis_ticks: Annotated[int, Field(ge=0, le=1000)] | None = None
    step_alarm_s: Annotated[float, Field(ge=0.01, le=10)] | None = None
    entry_wait_ms: Annotated[int, Field(ge=0, le=10_000)] | None = None
    min_concurrency: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_concurrency: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    shed_priorities: list[Annotated[int, Field(ge=0, le=9)]] | None = None
    stages: dict[str, StageThresholdsSpec] | None = None


class RateLimit(_Strict):
    unit: str | None = None
    requests_per_unit: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    unlimited: bool | None = None
    name: str | None = None
    replaces: list[dict[str, str]] | None = None
    algorithm: Literal["fixed_window", "sliding_window", "gcra"] | None = None
    unit_multiplier: Annotated[int, Field(ge=1)] | None = None
    adaptive: bool | None = None
    pipeline: str | None = None


class Descriptor(_Strict):
    key: str
    value: str | None = None
    rate_limit: RateLimit | None = None
    rate_limits: list[RateLimit] | None = None
    descriptors: list[Descriptor] | None = None
    shadow_mode: bool | None = None
    detailed_metric: bool | None = None
    quota_mode: bool | None = None
    share_threshold: dict[str, Any] | None = None
    value_to_metric: bool | None = None
    metadata: dict[str, Any] | None = None


class RateLimitConfigSpec(_Strict):
    """envoyproxy/ratelimit's file, its domain being metadata.name."""
    descriptors: list[Descriptor] | None = None


# --- documents -------------------------------------------------------------------------

def _fail(message: str) -> PydanticCustomError:
    # The template is only "{message}", so braces in the domain's message stay as written.
    return PydanticCustomError("sitsmesh", "{message}", {"message": message})


class Document(_Strict):
    """apiVersion, kind, metadata, spec: the envelope every kind shares."""

    KIND: ClassVar[str] = ""
    PLURAL: ClassVar[str] = ""
    api_version: Literal["sitsmesh.io/v1alpha1"] = Field(alias="apiVersion")
    metadata: Metadata

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @classmethod
    def canonical(cls, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """The stored body of a valid spec; raises the domain's error otherwise."""
        raise NotImplementedError

    @classmethod
    def spec_of(cls, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """The spec a stored body reads back as (apply accepts it unchanged)."""
        return dict(body)

    @model_validator(mode="before")
    @classmethod
    def _domain_rules(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("metadata"), dict):
            return data  # the model's own errors name what is missing
        name, spec = data["metadata"].get("name"), data.get("spec", {})
        if not isinstance(name, str) or not isinstance(spec, dict):
            return data
        try:
            body = cls.canonical(name, spec)
        except SitsmeshError as exc:
            raise _fail(exc.message) from None
        # The keys as written (so the model still refuses unknown ones), each with the
        # value the domain settled on (YAML's bare `off` read as false, say).
        settled = cls.spec_of(name, body)
        return {**data, "spec": {k: settled.get(k, v) for k, v in spec.items()}}

    def body(self) -> dict[str, Any]:
        spec: BaseModel = getattr(self, "spec")  # noqa: B009 - each kind declares its own
        return self.canonical(self.metadata.name,
                              spec.model_dump(mode="json", exclude_none=True))


class TenantDocument(Document):
    KIND = "Tenant"
    PLURAL = "tenants"
    kind: Literal["Tenant"]
    spec: TenantSpec

    @classmethod
    def canonical(cls, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return tenant_from(name, {**spec, "uid": ""}).to_body()

    @classmethod
    def spec_of(cls, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in body.items() if k != "uid"}  # the store's, never a file's


class ApiKeyPolicyDocument(Document):
    KIND = "ApiKeyPolicy"
    PLURAL = "apikeypolicies"
    kind: Literal["ApiKeyPolicy"]
    spec: ApiKeyPolicySpec

    @classmethod
    def canonical(cls, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return key_policy_from(name, spec).to_body()


class TokenBudgetDocument(Document):
    KIND = "TokenBudget"
    PLURAL = "tokenbudgets"
    kind: Literal["TokenBudget"]
    spec: TokenBudgetSpec

    @classmethod
    def canonical(cls, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return budget_from(name, spec).to_body()


class PipelineDocument(Document):
    KIND = "Pipeline"
    PLURAL = "pipelines"
    kind: Literal["Pipeline"]
    spec: PipelineSpec

    @classmethod
    def canonical(cls, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return pipeline_from(name, spec, f"pipeline {name}").to_body()


class ThresholdsDocument(Document):
    """Backpressure thresholds of the pipeline metadata.name."""
    KIND = "Thresholds"
    PLURAL = "thresholds"
    kind: Literal["Thresholds"]
    spec: ThresholdsSpec

    @classmethod
    def canonical(cls, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return thresholds_from(spec, f"thresholds {name}").to_body()


class RateLimitConfigDocument(Document):
    KIND = "RateLimitConfig"
    PLURAL = "ratelimitconfigs"
    kind: Literal["RateLimitConfig"]
    spec: RateLimitConfigSpec

    @classmethod
    def canonical(cls, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        text = yaml.safe_dump({"domain": name, **spec}, sort_keys=False)
        parse_domain(f"api:{name}", text)
        return {"source": f"api:{name}", "yaml": text}

    @classmethod
    def spec_of(cls, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if "yaml" not in body:
            return dict(body)
        parsed = yaml.safe_load(body["yaml"]) or {}
        return {k: v for k, v in parsed.items() if k != "domain"}


KINDS: dict[str, type[Document]] = {
    d.KIND: d for d in (TenantDocument, ApiKeyPolicyDocument, TokenBudgetDocument,
                        PipelineDocument, ThresholdsDocument, RateLimitConfigDocument)}
