"""Pipelines through the CLI and admin API, persisted; chain show over stage reports."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness

PIPELINE = """
name: demo
stages:
  - name: preprocess
    match: {upstream_cluster: pre}
    sla_p99_ms: 50
  - name: model
    match: {upstream_cluster: triton}
    sla_p99_ms: 200
    ttfb_p99_ms: 80
"""


def _stamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def test_pipelines_apply_list_get_delete_and_chain_show(
    tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh]
) -> None:
    node = start_sitsmesh("--reload-interval-seconds", "0.2")
    path = tmp_path / "demo.yaml"
    path.write_text(PIPELINE)
    applied = node.cli("pipelines", "apply", str(path))
    assert applied.returncode == 0, applied.stderr
    assert node.cli("pipelines", "list").stdout.split() == ["demo"]
    assert "ttfb_p99_ms: 80" in node.cli("pipelines", "get", "demo").stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nstages: [{name: a, match: {cluster: x}}]\n")
    rejected = node.cli("pipelines", "apply", str(bad))
    assert rejected.returncode == 1
    assert f"{bad}: stages[0]: match must have exactly one of" in rejected.stderr

    # A stage behind no Envoy reports itself; two stages of one request form a chain.
    now = time.time()

    def reports() -> Iterator[admin_pb2.ReportStageLatencyRequest]:
        for i in range(20):
            rid = f"req-{i}"
            yield admin_pb2.ReportStageLatencyRequest(
                request_id=rid, pipeline="demo", stage="model", start=_stamp(now + 0.010),
                end=_stamp(now + 0.090), first_byte=_stamp(now + 0.020))
            # The entry stage passes on the request's traceparent (one of them malformed).
            traceparent = (f"00-{i + 1:032x}-00f067aa0ba902b7-01" if i != 18
                           else "00-not-a-trace-01")
            yield admin_pb2.ReportStageLatencyRequest(
                request_id=rid, pipeline="demo", stage="preprocess", start=_stamp(now),
                end=_stamp(now + 0.100 + i / 1000), traceparent=traceparent)
        yield admin_pb2.ReportStageLatencyRequest(request_id="", stage="model")  # rejected: no id

    with grpc.insecure_channel(node.admin_addr) as channel:
        reply = admin_pb2_grpc.AdminServiceStub(channel).ReportStageLatency(
            reports(), metadata=node.admin_metadata(), timeout=10)
    assert (reply.accepted, reply.rejected) == (40, 1)

    shown = node.cli("chain", "show", "demo", "--output", "json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["chains"] == 20 and doc["bottleneck"] == "model"
    stages = {s["name"]: s for s in doc["stages"]}
    assert abs(stages["model"]["p99_ms"] - 80) / 80 < 0.06
    assert abs(stages["preprocess"]["p50_ms"] - 30) / 30 < 0.1
    assert abs(stages["model"]["ttfb_p99_ms"] - 10) / 10 < 0.06
    assert abs(doc["e2e_p99_ms"] - 119) / 119 < 0.06
    # The slowest chains name their traces (req-19 took longest); a bad traceparent none.
    traces = {c["request_id"]: c["trace_id"] for c in doc["slowest"]}
    assert traces["req-19"] == f"{20:032x}" and traces["req-17"] == f"{18:032x}"
    assert traces["req-18"] == ""
    assert doc["slowest"][0]["request_id"] == "req-19"
    assert set(stages["model"]) >= {"name", "p50_ms", "p99_ms", "ttfb_p99_ms",
                                    "share_of_e2e_p99"}
    metrics = node.metrics()
    assert harness.metric_value(metrics, "sitsmesh_stage_latency_seconds_count",
                                pipeline="demo", stage="model") == 20
    assert harness.metric_value(metrics, "sitsmesh_pipeline_latency_seconds_count",
                                pipeline="demo") == 20
    table = node.cli("chain", "show", "demo")
    assert "bottleneck: model" in table.stdout

    assert node.cli("chain", "show", "nope").returncode == 1
    assert node.cli("pipelines", "delete", "demo").returncode == 0
    assert node.cli("pipelines", "get", "demo").returncode == 1
