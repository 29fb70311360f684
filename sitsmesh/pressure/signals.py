"""Per-pipeline and per-stage signals: plain counters the request path bumps, no locks.

Writers (Check, ShouldRateLimit, access logs, the Triton scraper) only add to
counters and stamp times; the controller reads the counters once per tick and
works out rates from the differences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sitsmesh.chains.histogram import Histogram
from sitsmesh.pressure.thresholds import PRIORITIES


class PipelineSignals:
    """Arrivals at a pipeline's entry, by priority, and what is in flight inside it."""

    __slots__ = ("admitted", "arrivals", "by_priority", "in_flight", "rl_arrivals", "shed")

    def __init__(self) -> None:
        self.arrivals = 0
        # Seen by ShouldRateLimit: the same stream when both filters run, so the
        # controller takes the larger of the two rates.
        self.rl_arrivals = 0
        self.admitted = 0
        self.shed = 0
        self.by_priority = [0] * PRIORITIES
        self.in_flight = 0

    def arrive(self, priority: int) -> None:
        self.arrivals += 1
        self.by_priority[priority if 0 <= priority < PRIORITIES else 0] += 1


@dataclass(slots=True)
class TritonSample:
    """One scrape of one model: cumulative counters and the pending gauge, with its time."""

    at: float
    pending: int
    success: float
    failure: float
    queue_us: float
    request_us: float = 0.0  # queue and compute: the service time is the difference


class StageSignals:
    """Completions, latency and errors from access logs; queue state from Triton."""

    __slots__ = ("completions", "errors", "expects_triton", "last_completion", "latency",
                 "service", "triton")

    def __init__(self) -> None:
        # Set when the stage names a Triton model that is scraped: until a sample comes
        # (and whenever the last one is old) the stage counts as saturated.
        self.expects_triton = False
        self.completions = 0
        self.errors = 0
        self.last_completion = 0.0
        self.latency = Histogram()      # swapped out by the controller every tick
        self.service = 0.0              # sum of seconds spent past the queue, this tick
        self.triton: list[TritonSample] = []  # the last two scrapes

    def complete(self, now: float, seconds: float, queue_s: float | None, failed: bool) -> None:
        self.completions += 1
        if failed:
            self.errors += 1
        self.last_completion = now
        self.latency.add(seconds)
        self.service += seconds - (queue_s or 0.0)

    def scraped(self, sample: TritonSample) -> None:
        self.triton = [*self.triton[-1:], sample]


@dataclass(slots=True)
class Signals:
    """Everything the controller reads, keyed by pipeline and (pipeline, stage)."""

    pipelines: dict[str, PipelineSignals] = field(default_factory=dict)
    stages: dict[tuple[str, str], StageSignals] = field(default_factory=dict)

    def pipeline(self, name: str) -> PipelineSignals:
        found = self.pipelines.get(name)
        if found is None:
            found = self.pipelines[name] = PipelineSignals()
        return found

    def stage(self, pipeline: str, stage: str) -> StageSignals:
        key = (pipeline, stage)
        found = self.stages.get(key)
        if found is None:
            found = self.stages[key] = StageSignals()
        return found
