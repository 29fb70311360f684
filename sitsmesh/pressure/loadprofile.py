"""The simulator's load profiles (`sitsmesh simulate --load`): parsed and validated, and
the service-time distributions its stages draw from (shared with the benchmarks' stages,
sitsmesh.dev.stagesvc, so a simulation and a real run serve the same work).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sitsmesh.chains.pipeline import Pipeline
from sitsmesh.errors import Code, SitsmeshError
from sitsmesh.pressure.thresholds import PRIORITIES

SCRAPE_S = 0.25
LOG_FLUSH_S = 1.0   # Envoy's default access-log buffer flush, which Istio keeps


class InvalidProfile(SitsmeshError):
    code = Code.INVALID_ARGUMENT


# Service-time distributions, each with mean `service_ms` (issue 29's scenarios):
# fixed; exponential; log-normal with sigma 1 (a heavy right tail: p99 ~ 5x the mean);
# bimodal, BIMODAL_SLOW_SHARE of requests BIMODAL_SLOW x slower than the rest (a cache
# miss, a long prompt): 80 % at 0.5x and 20 % at 3x the mean.
SERVICE_KINDS = ("fixed", "exp", "lognormal", "bimodal")
LOGNORMAL_SIGMA = 1.0
BIMODAL_SLOW_SHARE = 0.2
BIMODAL_SLOW = 6.0


def service_time(rng: random.Random, kind: str, mean_s: float) -> float:
    """One service time of `kind` with mean `mean_s`."""
    if kind == "exp":
        return rng.expovariate(1 / mean_s)
    if kind == "lognormal":
        # E[exp(N(mu, s))] = exp(mu + s^2 / 2): mu puts the mean at mean_s.
        return rng.lognormvariate(math.log(mean_s) - LOGNORMAL_SIGMA ** 2 / 2,
                                  LOGNORMAL_SIGMA)
    if kind == "bimodal":
        fast = mean_s / (1 - BIMODAL_SLOW_SHARE + BIMODAL_SLOW_SHARE * BIMODAL_SLOW)
        return fast * BIMODAL_SLOW if rng.random() < BIMODAL_SLOW_SHARE else fast
    return mean_s


@dataclass(frozen=True, slots=True)
class LoadProfile:
    duration_s: float
    steps: tuple[tuple[float, float], ...]          # (at_s, rps), linear in between
    priorities: tuple[tuple[int, float], ...]        # (priority, weight)
    service_ms: Mapping[str, float]
    service: str = "fixed"                           # one of SERVICE_KINDS
    sla_ms: float = 0.0                              # end to end; 0 = sum of stage SLAs
    seed: int = 1
    log_flush_s: float = LOG_FLUSH_S                 # access-log entries arrive this late
    scrape_s: float = SCRAPE_S                       # Triton stages' /metrics
    stats_flush_s: float = 0.0                       # Envoy's gauges; 0 = not sent

    def rate(self, t: float) -> float:
        steps = self.steps
        if t <= steps[0][0]:
            return steps[0][1]
        for (t0, r0), (t1, r1) in itertools.pairwise(steps):
            if t0 <= t <= t1:
                return r0 + (r1 - r0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return steps[-1][1]


def profile_from(body: Mapping[str, Any], pipeline: Pipeline,
                 source: str = "profile") -> LoadProfile:
    def number(key: str, raw: Any, low: float, high: float) -> float:
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not low <= raw <= high:
            raise InvalidProfile(f"{source}: {key} must be a number from {low:g} to {high:g}, "
                                 f"got {raw!r}")
        return float(raw)

    if not isinstance(body, Mapping):
        raise InvalidProfile(f"{source}: expected a mapping")
    unknown = set(body) - {"duration_s", "steps", "priorities", "service_ms", "service",
                           "sla_ms", "seed", "log_flush_s", "scrape_s", "stats_flush_s"}
    if unknown:
        raise InvalidProfile(f"{source}: unknown key '{sorted(unknown)[0]}'")
    duration = number("duration_s", body.get("duration_s", 30), 1, 3600)
    raw_steps = body.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise InvalidProfile(f"{source}: steps must be a list of {{at_s, rps}}")
    steps = []
    for i, step in enumerate(raw_steps):
        if not isinstance(step, Mapping) or set(step) != {"at_s", "rps"}:
            raise InvalidProfile(f"{source}: steps[{i}] must be {{at_s, rps}}")
        steps.append((number(f"steps[{i}].at_s", step["at_s"], 0, 3600),
                      number(f"steps[{i}].rps", step["rps"], 0, 100_000)))
    if [s[0] for s in steps] != sorted(s[0] for s in steps):
        raise InvalidProfile(f"{source}: steps must be in time order")
    raw_mix = body.get("priorities", {0: 1.0})
    if not isinstance(raw_mix, Mapping) or not raw_mix:
        raise InvalidProfile(f"{source}: priorities must map priority to weight")
    mix = []
    for key, weight in raw_mix.items():
        if not isinstance(key, int) or not 0 <= key < PRIORITIES:
            raise InvalidProfile(f"{source}: priority {key!r} is not 0-{PRIORITIES - 1}")
        mix.append((key, number(f"priorities.{key}", weight, 0, 1e9)))
    raw_service = body.get("service_ms")
    names = [s.name for s in pipeline.stages]
    if not isinstance(raw_service, Mapping) or set(raw_service) != set(names):
        raise InvalidProfile(f"{source}: service_ms must give a time for each stage: "
                             f"{', '.join(names)}")
    service = {k: number(f"service_ms.{k}", v, 0.001, 600_000) for k, v in raw_service.items()}
    kind = body.get("service", "fixed")
    if kind not in SERVICE_KINDS:
        raise InvalidProfile(f"{source}: service must be one of {', '.join(SERVICE_KINDS)}, "
                             f"got {kind!r}")
    seed = body.get("seed", 1)
    if not isinstance(seed, int):
        raise InvalidProfile(f"{source}: seed must be an integer")
    return LoadProfile(duration, tuple(steps), tuple(mix), service, kind,
                       number("sla_ms", body.get("sla_ms", 0), 0, 3_600_000), seed,
                       number("log_flush_s", body.get("log_flush_s", LOG_FLUSH_S), 0, 60),
                       number("scrape_s", body.get("scrape_s", SCRAPE_S), 0.01, 60),
                       number("stats_flush_s", body.get("stats_flush_s", 0), 0, 60))
