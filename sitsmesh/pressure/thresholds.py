"""SRE-tunable thresholds per pipeline, with per-stage overrides: parsed, validated, frozen.

A document looks like:

    policy: sitsmesh            # sitsmesh, seed or off
    tick_ms: 50
    hysteresis_ticks: 3
    step_alarm_s: 0.12
    entry_wait_ms: 0
    sla_multiplier: 1.0
    queue_fill_high: 0.7
    queue_fill_low: 0.3
    min_concurrency: 1
    max_concurrency: 1000
    shed_priorities: [0, 1, 2, 3, 4]
    stages:
      model: {sla_multiplier: 1.2, queue_capacity: 32, parallelism: 1, fanout: 1}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sitsmesh.errors import Code, SitsmeshError

THRESHOLDS_KIND = "thresholds"
AUDIT_KIND = "thresholds-audit"
POLICIES = ("sitsmesh", "seed", "off")
PRIORITIES = 10  # 0 (lowest) .. 9, as ext_authz assigns them
# A surge that starts between two ticks builds a queue until the next one: at 2x a
# 50 rps stage, 5 requests per 100 ms. Half that keeps a step within the SLA.
TICK_MS = 50
ENTRY_WAIT_MS = 0
MAX_ENTRY_WAIT_MS = 10_000


class InvalidThresholds(SitsmeshError):
    code = Code.INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class StageThresholds:
    sla_multiplier: float = 1.0
    queue_fill_high: float = 0.7
    queue_fill_low: float = 0.3
    queue_capacity: int = 64       # requests the stage may queue before it counts as full
    parallelism: int = 1           # requests it serves at once (Triton instances x batch)
    fanout: float = 1.0            # calls to this stage per pipeline request


@dataclass(frozen=True, slots=True)
class Thresholds:
    policy: str = "sitsmesh"
    tick_ms: int = TICK_MS
    hysteresis_ticks: int = 3
    # Arrivals past capacity, in seconds of capacity (at least STEP_ALARM_MIN requests),
    # that count as a step before the rates confirm it (see pressure.headroom).
    step_alarm_s: float = 0.12
    # How long Check may hold a request that meets the in-flight cap, waiting for room,
    # before it refuses it (0: refused at once). Keep it under Envoy's ext_authz timeout.
    entry_wait_ms: int = ENTRY_WAIT_MS
    min_concurrency: int = 1
    max_concurrency: int = 1000
    shed_priorities: tuple[int, ...] = (0, 1, 2, 3, 4)
    defaults: StageThresholds = field(default_factory=StageThresholds)
    stages: Mapping[str, StageThresholds] = field(default_factory=dict)
    # Stages whose parallelism the document sets ("*": all of them, set at the top):
    # elsewhere a Triton model's instance count may stand in for it.
    explicit_parallelism: frozenset[str] = frozenset()

    def stage(self, name: str) -> StageThresholds:
        return self.stages.get(name, self.defaults)

    def with_parallelism(self, stage: str, servers: int) -> Thresholds:
        """These thresholds with `servers` as the stage's parallelism, unless the document
        set it (an SRE's number wins over what Triton reports)."""
        if {"*", stage} & self.explicit_parallelism or self.stage(stage).parallelism == servers:
            return self
        stages = {**self.stages, stage: replace(self.stage(stage), parallelism=servers)}
        return replace(self, stages=stages)

    @property
    def protected_from(self) -> int:
        """The lowest priority that is never shed (PRIORITIES when every one may be)."""
        return min((p for p in range(PRIORITIES) if p not in self.shed_priorities),
                   default=PRIORITIES)

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "policy": self.policy, "tick_ms": self.tick_ms,
            "hysteresis_ticks": self.hysteresis_ticks, "step_alarm_s": self.step_alarm_s,
            "entry_wait_ms": self.entry_wait_ms,
            "min_concurrency": self.min_concurrency, "max_concurrency": self.max_concurrency,
            "shed_priorities": list(self.shed_priorities), **asdict(self.defaults)}
        # A parallelism nobody set stays unset, so Triton's instance count can fill it.
        if "*" not in self.explicit_parallelism:
            del body["parallelism"]
        if self.stages:
            body["stages"] = {}
            for name, stage in sorted(self.stages.items()):
                diff = _stage_diff(stage, self.defaults)
                if name in self.explicit_parallelism:
                    diff["parallelism"] = stage.parallelism
                body["stages"][name] = diff
        return body


def _stage_diff(stage: StageThresholds, defaults: StageThresholds) -> dict[str, Any]:
    mine, base = asdict(stage), asdict(defaults)
    return {k: v for k, v in mine.items() if v != base[k]}


_STAGE_KEYS = {f for f in StageThresholds.__dataclass_fields__}
_TOP_KEYS = {"policy", "tick_ms", "hysteresis_ticks", "step_alarm_s", "entry_wait_ms",
             "min_concurrency",
             "max_concurrency", "shed_priorities", "stages"} | _STAGE_KEYS


def _num(raw: Any, where: str, low: float, high: float, integer: bool = False) -> Any:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or math.isnan(raw):
        raise InvalidThresholds(f"{where} must be a number, got {raw!r}")
    if integer and int(raw) != raw:
        raise InvalidThresholds(f"{where} must be a whole number, got {raw!r}")
    if not low <= raw <= high:
        raise InvalidThresholds(f"{where} must be between {low:g} and {high:g}, got {raw!r}")
    return int(raw) if integer else float(raw)


_STAGE_RANGES: dict[str, tuple[float, float, bool]] = {
    "sla_multiplier": (0.1, 100.0, False),
    "queue_fill_high": (0.0, 1.0, False),
    "queue_fill_low": (0.0, 1.0, False),
    "queue_capacity": (1, 1_000_000, True),
    "parallelism": (1, 100_000, True),
    "fanout": (0.01, 1000.0, False),
}


def _stage(raw: Any, base: StageThresholds, where: str) -> StageThresholds:
    if not isinstance(raw, Mapping):
        raise InvalidThresholds(f"{where} must be a mapping")
    unknown = set(raw) - _STAGE_KEYS
    if unknown:
        raise InvalidThresholds(f"{where}: unknown key '{sorted(unknown)[0]}'")
    values = {k: _num(v, f"{where}.{k}", *_STAGE_RANGES[k]) for k, v in raw.items()}
    stage = replace(base, **values)
    if stage.queue_fill_low >= stage.queue_fill_high:
        raise InvalidThresholds(f"{where}: queue_fill_low ({stage.queue_fill_low:g}) must be "
                                f"below queue_fill_high ({stage.queue_fill_high:g})")
    return stage


def thresholds_from(body: Mapping[str, Any], source: str = "thresholds") -> Thresholds:
    """Validate a thresholds document; errors name the source and the key."""
    if not isinstance(body, Mapping):
        raise InvalidThresholds(f"{source}: expected a mapping of keys")
    unknown = set(body) - _TOP_KEYS
    if unknown:
        raise InvalidThresholds(f"{source}: unknown key '{sorted(unknown)[0]}'")
    policy = body.get("policy", "sitsmesh")
    if policy is False:
        policy = "off"  # YAML 1.1 reads a bare `off` as false; that is what was meant
    if policy not in POLICIES:
        raise InvalidThresholds(f"{source}: policy must be one of {', '.join(POLICIES)}, "
                                f"got {policy!r}")
    tick_ms = _num(body.get("tick_ms", TICK_MS), f"{source}: tick_ms", 10, 10_000, True)
    hysteresis = _num(body.get("hysteresis_ticks", 3), f"{source}: hysteresis_ticks", 0, 1000,
                      True)
    step = _num(body.get("step_alarm_s", 0.12), f"{source}: step_alarm_s", 0.01, 10.0)
    wait = _num(body.get("entry_wait_ms", ENTRY_WAIT_MS), f"{source}: entry_wait_ms", 0,
                MAX_ENTRY_WAIT_MS, True)
    low = _num(body.get("min_concurrency", 1), f"{source}: min_concurrency", 1, 1_000_000, True)
    high = _num(body.get("max_concurrency", 1000), f"{source}: max_concurrency", 1, 1_000_000,
                True)
    if low > high:
        raise InvalidThresholds(f"{source}: min_concurrency ({low}) is above max_concurrency "
                                f"({high})")
    shed = body.get("shed_priorities", [0, 1, 2, 3, 4])
    if not isinstance(shed, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p < PRIORITIES
            for p in shed):
        raise InvalidThresholds(f"{source}: shed_priorities must be a list of priorities "
                                f"0-{PRIORITIES - 1}, got {shed!r}")
    defaults = _stage({k: v for k, v in body.items() if k in _STAGE_KEYS},
                      StageThresholds(), source)
    stages_raw = body.get("stages", {}) or {}
    if not isinstance(stages_raw, Mapping):
        raise InvalidThresholds(f"{source}: stages must be a mapping of stage name to "
                                "overrides")
    stages = {str(name): _stage(raw, defaults, f"{source}: stages.{name}")
              for name, raw in stages_raw.items()}
    explicit = {str(name) for name, raw in stages_raw.items()
                if isinstance(raw, Mapping) and "parallelism" in raw}
    if "parallelism" in body:
        explicit.add("*")
    return Thresholds(policy, tick_ms, hysteresis, step, wait, low, high,
                      tuple(sorted(set(shed))), defaults, stages, frozenset(explicit))
