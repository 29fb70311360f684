"""Token budgets: what a tenant's LLM requests may spend in tokens per minute, hour and
day, and how a request's tokens are weighed. Validation and the counters a request
touches; no I/O.

A budget is stored under the name of the tenant it governs (as an ApiKeyPolicy is).
Each of its limits counts one of:
- `each: tenant`: the tenant's requests together;
- `each: api_key`: each of the tenant's keys on its own;
- `each: model`: each model on its own (the tenant x model budget);
and only requests for models matching its `models` globs (default: every model).
Tokens are weighed `input` x prompt + `output` x completion + `cached_input` x cached
prompt tokens (default 1 / 1 / 0): what the request costs every limit it counts in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sitsmesh import globs
from sitsmesh.authz.model import InvalidObject

BUDGET_KIND = "token-budget"
# What Check tells the request's later hops: the input tokens its budget reserved for.
ESTIMATE_HEADER = "x-sits-token-estimate"
WINDOWS = {"minute": 60, "hour": 3600, "day": 86400}
EACH = ("tenant", "api_key", "model")
MAX_LIMITS = 16
MAX_TOKENS = 10**12
MAX_WEIGHT = 100.0
# The output estimate where a request sets no max_tokens, and the ceiling of a request's
# own: past it, max_tokens is refused as absurd rather than reserved.
DEFAULT_MAX_TOKENS = 4096
MAX_OUTPUT_TOKENS = 1_000_000
_TENANT_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_SPEC_KEYS = {"limits", "weights", "default_max_tokens", "chars_per_token"}
_LIMIT_KEYS = {"tokens", "per", "each", "models"}
_WEIGHTS = ("input", "output", "cached_input")


def estimate_from_header(value: str) -> int:
    """ESTIMATE_HEADER as Check set it; 0 where absent or not a small count (a header
    anyone upstream could have written is read, never trusted past 12 digits)."""
    return int(value) if value.isdigit() and len(value) <= 12 else 0


@dataclass(frozen=True, slots=True)
class Weights:
    input: float = 1.0
    output: float = 1.0
    cached_input: float = 0.0

    def cost(self, prompt: int, completion: int, cached: int = 0) -> int:
        """The weighed tokens, rounded up: cached prompt tokens are weighed as cached,
        the rest of the prompt as input."""
        cached = min(cached, prompt)
        return int(-(-(self.input * (prompt - cached) + self.cached_input * cached
                       + self.output * completion) // 1))


@dataclass(frozen=True, slots=True)
class Limit:
    tokens: int
    per: str
    each: str = "tenant"
    models: tuple[str, ...] = ("*",)
    _globs: globs.Globs = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_globs", globs.Globs((self.models,)))

    @property
    def window_s(self) -> int:
        return WINDOWS[self.per]

    def counts(self, model: str) -> bool:
        return self._globs.matches(model)

    def to_body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "per": self.per, "each": self.each,
                "models": list(self.models)}


@dataclass(frozen=True, slots=True)
class Counter:
    """One counter a request spends in: its key (without the window), the limit's
    size and window, and which limit of the budget it is."""

    key: str
    limit: int
    window_s: int
    index: int


@dataclass(frozen=True, slots=True)
class TokenBudget:
    tenant: str
    limits: tuple[Limit, ...]
    weights: Weights = Weights()
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    chars_per_token: float = 4.0

    def counters(self, key_id: str, model: str) -> list[Counter]:
        """The counters a request of this key for this model spends in. Keys share the
        tenant's hash tag, so one Redis Cluster slot holds all of a tenant's counters."""
        out = []
        for i, limit in enumerate(self.limits):
            if not limit.counts(model):
                continue
            who = "" if limit.each == "tenant" else key_id if limit.each == "api_key" \
                else model
            out.append(Counter(f"tb:{{{self.tenant}}}:{i}:{limit.per}:{who}", limit.tokens,
                               limit.window_s, i))
        return out

    def describe(self, index: int, key_id: str, model: str) -> str:
        """A limit as the 429 names it."""
        limit = self.limits[index]
        whose = {"tenant": f"tenant {self.tenant}", "api_key": f"API key {key_id}",
                 "model": f"tenant {self.tenant}, model {model}"}[limit.each]
        return f"{limit.tokens} tokens per {limit.per} for {whose}"

    def to_body(self) -> dict[str, Any]:
        return {"limits": [limit.to_body() for limit in self.limits],
                "weights": {"input": self.weights.input, "output": self.weights.output,
                            "cached_input": self.weights.cached_input},
                "default_max_tokens": self.default_max_tokens,
                "chars_per_token": self.chars_per_token}


def budget_from(tenant: str, body: Mapping[str, Any]) -> TokenBudget:
    """Build and validate a budget; raises InvalidObject naming the field."""
    where = f"token budget {tenant}"
    if not isinstance(tenant, str) or not _TENANT_NAME.match(tenant):
        raise InvalidObject(f"token budget {tenant!r}: name it after its tenant (1-63 "
                            "lowercase letters, digits, '.', '_' or '-')")
    _known(body, _SPEC_KEYS, where)
    raw_limits = body.get("limits")
    if not isinstance(raw_limits, list | tuple) or not 1 <= len(raw_limits) <= MAX_LIMITS:
        raise InvalidObject(f"{where}: limits must be a list of 1 to {MAX_LIMITS} limits")
    limits = tuple(_limit(raw, f"{where}: limits[{i}]") for i, raw in enumerate(raw_limits))
    raw_weights = body.get("weights") or {}
    if not isinstance(raw_weights, Mapping):
        raise InvalidObject(f"{where}: weights must map input, output, cached_input to "
                            "numbers")
    _known(raw_weights, set(_WEIGHTS), f"{where}: weights")
    weights = {}
    for name, default in zip(_WEIGHTS, (1.0, 1.0, 0.0), strict=True):
        value = raw_weights.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not 0 <= value <= MAX_WEIGHT:
            raise InvalidObject(f"{where}: weights.{name} must be a number from 0 to "
                                f"{MAX_WEIGHT:g}")
        weights[name] = float(value)
    default_max = body.get("default_max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(default_max, bool) or not isinstance(default_max, int) or \
            not 1 <= default_max <= MAX_OUTPUT_TOKENS:
        raise InvalidObject(f"{where}: default_max_tokens must be an integer from 1 to "
                            f"{MAX_OUTPUT_TOKENS}")
    chars = body.get("chars_per_token", 4.0)
    if isinstance(chars, bool) or not isinstance(chars, int | float) or not 1 <= chars <= 16:
        raise InvalidObject(f"{where}: chars_per_token must be a number from 1 to 16")
    return TokenBudget(tenant, limits, Weights(**weights), default_max, float(chars))


def _limit(raw: Any, where: str) -> Limit:
    if not isinstance(raw, Mapping):
        raise InvalidObject(f"{where} must be a mapping with tokens and per")
    _known(raw, _LIMIT_KEYS, where)
    tokens = raw.get("tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or \
            not 1 <= tokens <= MAX_TOKENS:
        raise InvalidObject(f"{where}: tokens must be an integer from 1 to {MAX_TOKENS}")
    per = raw.get("per")
    if per not in WINDOWS:
        raise InvalidObject(f"{where}: per must be one of {', '.join(WINDOWS)}, got {per!r}")
    each = raw.get("each", "tenant")
    if each not in EACH:
        raise InvalidObject(f"{where}: each must be one of {', '.join(EACH)}, got {each!r}")
    models = raw.get("models", ["*"])
    if not isinstance(models, list | tuple) or not models or not all(
            isinstance(m, str) and m for m in models):
        raise InvalidObject(f"{where}: models must be a non-empty list of globs")
    try:
        globs.check(models, where)
    except globs.GlobError as exc:
        raise InvalidObject(str(exc)) from None
    return Limit(tokens, per, each, tuple(models))


def _known(body: Mapping[str, Any], keys: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in body if k not in keys)
    if unknown:
        raise InvalidObject(f"{where}: unknown key '{unknown[0]}' (known: "
                            f"{', '.join(sorted(keys))})")
