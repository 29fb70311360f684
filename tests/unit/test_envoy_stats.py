"""Envoy's stats sink (MetricsService) decoded into per-cluster queue samples."""

from __future__ import annotations

from typing import Any

import pytest

from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.pressure.runtime import MAX_ENVOYS, PressureRuntime
from sitsmesh.pressure.signals import EnvoySample
from sitsmesh.transport.metrics import StreamMetricsMessage, samples_from


def _message(*families: tuple[str, str, list[tuple[dict[str, str], float]]]) -> Any:
    message = StreamMetricsMessage()
    message.identifier.node.id = "sidecar-1"
    for name, kind, metrics in families:
        family = message.envoy_metrics.add(name=name)
        for labels, value in metrics:
            metric = family.metric.add(timestamp_ms=1_700_000_000_250)
            for key, label in labels.items():
                metric.label.add(name=key, value=label)
            getattr(metric, kind).value = value
    return message


def test_both_stat_name_styles_are_read_and_the_rest_is_skipped() -> None:
    wire = _message(
        ("cluster.upstream_rq_active", "gauge",
         [({"envoy.cluster_name": "outbound|80||svc.ns.svc.cluster.local"}, 7.0)]),
        ("cluster.svc.upstream_rq_pending_active", "gauge", [({}, 2.0)]),
        ("cluster.svc.upstream_rq_completed", "counter", [({}, 120.0)]),
        ("cluster.svc.upstream_rq_5xx", "counter", [({}, 3.0)]),
        ("cluster.svc.upstream_rq_timeout", "counter", [({}, 1.0)]),
        ("cluster.svc.upstream_cx_total", "counter", [({}, 99.0)]),   # not read
        ("http.ingress.downstream_rq_total", "counter", [({}, 5.0)]),  # not a cluster
    ).SerializeToString()
    samples = samples_from(StreamMetricsMessage.FromString(wire))
    assert set(samples) == {"outbound|80||svc.ns.svc.cluster.local", "svc"}
    assert samples["outbound|80||svc.ns.svc.cluster.local"].active == 7.0
    svc = samples["svc"]
    assert (svc.pending, svc.completed, svc.errors) == (2.0, 120.0, 4.0)
    assert svc.at == pytest.approx(1_700_000_000.25)


def test_samples_reach_the_stages_that_call_the_cluster_in_monotonic_time() -> None:
    runtime = PressureRuntime(None, clock=lambda: 100.0, wall=lambda: 1_000_100.0)
    runtime.set_pipelines({"p": pipeline_from("p", {"stages": [
        {"name": "svc", "match": {"upstream_cluster": "svc"}},
        {"name": "other", "match": {"route_name": "svc"}}]})})
    runtime.on_envoy("sidecar-1", {"svc": EnvoySample(1_000_099.5, 4.0, 1.0),
                                   "unrelated": EnvoySample(1_000_099.5, 9.0, 0.0)})
    seen = runtime.signals.stage("p", "svc").envoy["sidecar-1"]
    assert (seen.at, seen.active, seen.pending) == (99.5, 4.0, 1.0)
    assert runtime.signals.stage("p", "other").envoy == {}


def test_the_envoys_one_stage_keeps_are_bounded() -> None:
    runtime = PressureRuntime(None, clock=lambda: 1.0, wall=lambda: 1.0)
    runtime.set_pipelines({"p": pipeline_from("p", {"stages": [
        {"name": "svc", "match": {"upstream_cluster": "svc"}}]})})
    for i in range(MAX_ENVOYS + 10):
        runtime.on_envoy(f"node-{i}", {"svc": EnvoySample(1.0, 1.0, 0.0)})
    reports = runtime.signals.stage("p", "svc").envoy
    assert len(reports) == MAX_ENVOYS and "node-0" not in reports


def test_one_message_reports_on_a_bounded_number_of_clusters() -> None:
    """A caller pushing a flood of made-up clusters costs at most MAX_CLUSTERS samples."""
    from sitsmesh.transport.metrics import MAX_CLUSTERS

    flood: list[tuple[str, str, list[tuple[dict[str, str], float]]]] = [
        (f"cluster.c{i}.upstream_rq_active", "gauge", [({}, 1.0)])
             for i in range(MAX_CLUSTERS + 50)]
    samples = samples_from(_message(*flood))
    assert len(samples) == MAX_CLUSTERS
