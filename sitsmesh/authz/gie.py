"""Gateway API Inference Extension headers: what an endpoint picker (GIE's EPP, llm-d)
behind sitsmesh reads to schedule a request, filled from the decision sitsmesh made.

The EPP reads `x-gateway-inference-fairness-id` (requests with one id share capacity under
its fairness policy; absent, they fall into `default-flow`) and
`x-gateway-inference-objective` (the name of an InferenceObjective in the InferencePool's
namespace, whose priority it applies). Both are scheduling decisions, so a client never
chooses them: sitsmesh overwrites them, or strips them when it has no value to give.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sitsmesh.authz.model import MAX_PRIORITY, Tenant
from sitsmesh.keyvalues import split_pairs

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_LABEL = "inference-objective"
_RESERVED_PREFIX = "x-sits-"
# An InferenceObjective is named like any Kubernetes object (a DNS subdomain); anything
# else could never match one, and must not reach a header.
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_TOKEN = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")


@dataclass(frozen=True, slots=True)
class GieSettings:
    enabled: bool = True
    objective_header: str = OBJECTIVE_HEADER
    fairness_header: str = FAIRNESS_HEADER
    # The tenant label naming its objective; it wins over priority_objectives.
    objective_label: str = OBJECTIVE_LABEL
    # Lowest priority -> objective name: a request gets the entry with the highest key
    # at or below its priority, none below the lowest key.
    priority_objectives: Mapping[int, str] = field(default_factory=dict)


def header(raw: Any) -> str:
    """A GIE header name setting: a lowercase HTTP token outside sitsmesh's x-sits-*."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"expected a header name, got {raw!r}")
    name = raw.strip().lower()
    if not _TOKEN.fullmatch(name):
        raise ValueError(f"not a valid header name: {raw!r}")
    if name.startswith(_RESERVED_PREFIX):
        raise ValueError(f"{name}: x-sits-* headers are sitsmesh's own; pick another name")
    return name


def objective_name(raw: Any) -> str:
    if not isinstance(raw, str) or not _OBJECT_NAME.fullmatch(raw):
        raise ValueError(f"objective {raw!r}: expected an InferenceObjective name "
                         "(lowercase letters, digits, '-' and '.', at most 253)")
    return raw


def priority_objectives(raw: Any) -> dict[int, str]:
    """A YAML mapping {priority: objective}, or 'priority=objective,...' from a flag or
    the environment."""
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, str):
        items = split_pairs(raw, "priority=objective")
    else:
        raise ValueError(f"expected a mapping of priority to objective, got {raw!r}")
    table: dict[int, str] = {}
    for key, value in items:
        text = str(key)
        if isinstance(key, bool) or not text.isdigit() or int(text) > MAX_PRIORITY:
            raise ValueError(f"priority {key!r}: expected an integer from 0 to {MAX_PRIORITY}")
        if int(text) in table:
            raise ValueError(f"priority {int(text)} is given twice")
        table[int(text)] = objective_name(value)
    return table


class GieHeaders:
    """Built once per Authorizer; per request one dict lookup, a bounded regex and a
    table index."""

    __slots__ = ("_by_priority", "_fairness", "_label", "_objective")

    def __init__(self, settings: GieSettings) -> None:
        self._objective = settings.objective_header
        self._fairness = settings.fairness_header
        self._label = settings.objective_label
        by_priority: list[str] = []
        current = ""
        for priority in range(MAX_PRIORITY + 1):
            current = settings.priority_objectives.get(priority, current)
            by_priority.append(current)
        self._by_priority = tuple(by_priority)

    def objective(self, tenant: Tenant, priority: int) -> str:
        """The tenant's labelled objective, else the one its priority maps to, else ""."""
        labelled = tenant.labels.get(self._label, "")
        if labelled and len(labelled) <= 253 and _OBJECT_NAME.fullmatch(labelled):
            return labelled
        return self._by_priority[min(max(priority, 0), MAX_PRIORITY)]

    def decide(self, tenant: Tenant, priority: int, sent: Mapping[str, str]
               ) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
        """(headers to set, headers to remove). Tenant names are already header-safe."""
        objective = self.objective(tenant, priority)
        if objective:
            return ((self._fairness, tenant.name), (self._objective, objective)), ()
        # No objective to give: a client-sent one must not reach the picker either.
        strip = (self._objective,) if self._objective in sent else ()
        return ((self._fairness, tenant.name),), strip
