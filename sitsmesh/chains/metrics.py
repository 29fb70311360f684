"""Prometheus histograms of finished latency chains: each stage's own time and end to end."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sitsmesh.chains.pipeline import Pipeline

STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0)


class ChainMetrics:
    """`observe` is the assembler's on_chain callback."""

    __slots__ = ("_dropped", "_e2e", "_e2e_children", "_evicted", "_stage", "_stage_children")

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._stage = Histogram("sitsmesh_stage_latency_seconds",
                                "Own time of each pipeline stage per finished chain.",
                                ["pipeline", "stage"], registry=registry, buckets=STAGE_BUCKETS)
        self._e2e = Histogram("sitsmesh_pipeline_latency_seconds",
                              "End-to-end time of each finished chain.", ["pipeline"],
                              registry=registry, buckets=STAGE_BUCKETS)
        # labels() costs more than observe(); pipelines and stages are few, so the
        # children are looked up once and kept.
        self._stage_children: dict[tuple[str, str], Any] = {}
        self._e2e_children: dict[str, Any] = {}
        self._evicted = Counter("sitsmesh_chains_evicted_total",
                                "Open chains closed early to stay within a bound (max_open: "
                                "the count, max_bytes: chain_max_bytes), oldest first.",
                                ["reason"], registry=registry)
        self._dropped = Counter("sitsmesh_accesslog_entries_dropped_total",
                                "Access-log entries refused before they were stored.",
                                ["reason"], registry=registry)

    def evicted(self, reason: str) -> None:
        """The assembler's on_evict callback."""
        self._evicted.labels(reason).inc()

    def dropped(self, reason: str) -> None:
        """The access-log servicer's on_drop callback."""
        self._dropped.labels(reason).inc()

    def observe(self, pipeline: str, own: dict[str, float], total: float) -> None:
        for stage, seconds in own.items():
            child = self._stage_children.get((pipeline, stage))
            if child is None:
                child = self._stage_children[pipeline, stage] = self._stage.labels(pipeline,
                                                                                   stage)
            child.observe(seconds)
        child = self._e2e_children.get(pipeline)
        if child is None:
            child = self._e2e_children[pipeline] = self._e2e.labels(pipeline)
        child.observe(total)


class StageSlas(Collector):
    """`sitsmesh_stage_sla_seconds{pipeline,stage}`: each stage's p99 SLA, read from the
    live pipelines at scrape time, so an alert can compare a stage's p99 with its own
    SLA and a deleted pipeline leaves no series behind."""

    def __init__(self, pipelines: Callable[[], Mapping[str, Pipeline]]) -> None:
        self._pipelines = pipelines

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("sitsmesh_stage_sla_seconds",
                                   "A stage's p99 latency SLA (sla_p99_ms of its pipeline); "
                                   "no series for a stage without one.",
                                   labels=["pipeline", "stage"])
        for pipeline in self._pipelines().values():
            for stage in pipeline.stages:
                if stage.sla_p99_ms is not None:
                    family.add_metric([pipeline.name, stage.name], stage.sla_p99_ms / 1000)
        yield family
