"""Pipelines as data: stages and how an access-log entry is matched to one."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sitsmesh import globs
from sitsmesh.errors import Code, SitsmeshError

PIPELINE_KIND = "pipeline"
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
MATCH_KEYS = ("upstream_cluster", "route_name", "header")
# A stage's stall threshold (token streams): under 10 ms every gap of a busy engine would
# count; over 60 s is past Envoy's stream_idle_timeout (filters/local/bootstrap.yaml),
# which cuts the stream before such a gap could end with a token.
STALL_MS_MIN, STALL_MS_MAX = 10, 60_000


class InvalidPipeline(SitsmeshError):
    code = Code.INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    match_key: str    # upstream_cluster, route_name or header (x-sits-stage value)
    match_value: str
    sla_p99_ms: float | None = None
    ttfb_p99_ms: float | None = None
    triton_model: str = ""      # the Triton model behind the stage: its queue is scraped
    # A gap between two tokens of its streams longer than this is a stall; None: learned
    # from the stage's own time per token (tokens/stalls.py).
    stall_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Pipeline:
    name: str
    stages: tuple[Stage, ...]
    # Glob patterns (fnmatch) of the models whose requests enter this pipeline, for
    # Check to find the pipeline when no x-sits-pipeline-hint header names it.
    models: tuple[str, ...] = ()
    # Glob patterns of the tenants whose requests it governs (admits, sheds, counts);
    # None: every tenant's. A pipeline an operator writes governs only its own tenants.
    tenants: tuple[str, ...] | None = None

    def triton_models(self) -> tuple[str, ...]:
        return tuple(s.triton_model for s in self.stages if s.triton_model)

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"stages": [
            {"name": s.name, "match": {s.match_key: s.match_value},
             **({"sla_p99_ms": s.sla_p99_ms} if s.sla_p99_ms is not None else {}),
             **({"ttfb_p99_ms": s.ttfb_p99_ms} if s.ttfb_p99_ms is not None else {}),
             **({"triton_model": s.triton_model} if s.triton_model else {}),
             **({"stall_ms": s.stall_ms} if s.stall_ms is not None else {})}
            for s in self.stages]}
        if self.models:
            body["models"] = list(self.models)
        if self.tenants is not None:
            body["tenants"] = list(self.tenants)
        return body


def _number(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidPipeline(f"{where} must be a positive number of milliseconds")
    return float(value)


def _stall_ms(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not STALL_MS_MIN <= value <= STALL_MS_MAX):
        raise InvalidPipeline(f"{where} must be a number of milliseconds from "
                              f"{STALL_MS_MIN} to {STALL_MS_MAX}")
    return float(value)


def pipeline_from(name: str, body: Mapping[str, Any], source: str = "pipeline") -> Pipeline:
    """Validate a pipeline document; errors name the source and the field."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidPipeline(f"{source}: name {name!r}: use 1-63 lowercase letters, digits, "
                              "'.', '_' or '-'")
    unknown = set(body) - {"name", "stages", "models", "tenants"}
    if unknown:
        raise InvalidPipeline(f"{source}: unknown key '{sorted(unknown)[0]}'")
    stages_raw = body.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise InvalidPipeline(f"{source}: stages must be a non-empty list")
    stages: list[Stage] = []
    seen: set[str] = set()
    for i, raw in enumerate(stages_raw):
        where = f"{source}: stages[{i}]"
        if not isinstance(raw, dict):
            raise InvalidPipeline(f"{where} must be a mapping")
        extra = set(raw) - {"name", "match", "sla_p99_ms", "ttfb_p99_ms", "triton_model",
                            "stall_ms"}
        if extra:
            raise InvalidPipeline(f"{where}: unknown key '{sorted(extra)[0]}'")
        stage_name = raw.get("name")
        if not isinstance(stage_name, str) or not _NAME.match(stage_name):
            raise InvalidPipeline(f"{where}: name must be a lowercase identifier")
        if stage_name in seen:
            raise InvalidPipeline(f"{where}: duplicate stage name '{stage_name}'")
        seen.add(stage_name)
        match = raw.get("match")
        if not isinstance(match, dict) or len(match) != 1:
            raise InvalidPipeline(f"{where}: match must have exactly one of "
                                  f"{', '.join(MATCH_KEYS)}")
        ((key, value),) = match.items()
        if key not in MATCH_KEYS or not isinstance(value, str) or not value:
            raise InvalidPipeline(f"{where}: match must have exactly one of "
                                  f"{', '.join(MATCH_KEYS)} with a non-empty string")
        triton_model = raw.get("triton_model", "")
        if not isinstance(triton_model, str):
            raise InvalidPipeline(f"{where}: triton_model must be a model name")
        stages.append(Stage(stage_name, key, value,
                            _number(raw.get("sla_p99_ms"), f"{where}.sla_p99_ms"),
                            _number(raw.get("ttfb_p99_ms"), f"{where}.ttfb_p99_ms"),
                            triton_model, _stall_ms(raw.get("stall_ms"), f"{where}.stall_ms")))
    models = body.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise InvalidPipeline(f"{source}: models must be a list of model name patterns")
    try:
        globs.check(models, source)
    except globs.GlobError as exc:
        raise InvalidPipeline(str(exc)) from None
    tenants = body.get("tenants")
    if tenants is not None and (not isinstance(tenants, list) or not tenants or not all(
            isinstance(t, str) and t for t in tenants)):
        raise InvalidPipeline(f"{source}: tenants must be a non-empty list of tenant name "
                              "patterns (leave it out to govern every tenant's requests)")
    if tenants is not None:
        try:
            globs.check(tenants, f"{source}: tenants")
        except globs.GlobError as exc:
            raise InvalidPipeline(str(exc)) from None
    return Pipeline(name, tuple(stages), tuple(models),
                    tuple(tenants) if tenants is not None else None)
