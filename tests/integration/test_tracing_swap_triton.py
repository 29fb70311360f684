"""A swap through `sitsmesh serve` against a real Triton, traced: one span for the swap,
parented by the admin call's traceparent, and one child per phase at the phase's real
times (real OTLP receiver). The fixtures are test_swap_triton's."""

from __future__ import annotations

import secrets
from pathlib import Path

import grpc

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from sitsmesh.dev.triton import TritonServer
from tests import otlpcollector
from tests.integration.test_swap_triton import MODEL, repo, triton  # noqa: F401 - fixtures

PHASES = ["precheck", "preflight", "load", "verify", "promote", "drain", "retire"]


def test_a_swap_is_a_span_with_a_child_per_phase(tmp_path: Path,
                                                 triton: TritonServer) -> None:  # noqa: F811
    with otlpcollector.running() as (collector, endpoint):
        node = harness.start_sitsmesh(tmp_path, "--triton-url", triton.grpc_url,
                                      "--triton-metrics-url", triton.metrics_url,
                                      "--otlp-endpoint", endpoint,
                                      env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
        try:
            trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
            with grpc.insecure_channel(node.admin_addr) as channel:
                events = list(admin_pb2_grpc.AdminServiceStub(channel).SwapModel(
                    admin_pb2.SwapModelRequest(model=MODEL, target_version=2),
                    metadata=(*node.admin_metadata(),
                              ("traceparent", f"00-{trace_id}-{parent}-01")),
                    timeout=120))
            record = events[-1].swap
            assert record.state == admin_pb2.SWAP_STATE_SUCCEEDED, record.error
            harness.wait_until(lambda: len([s for s in collector.spans
                                            if s.trace_id == trace_id]) == 1 + len(PHASES),
                               15, "the swap's spans")
        finally:
            assert node.stop() == 0
    spans = {s.name: s for s in collector.spans if s.trace_id == trace_id}
    swap = spans.pop("sitsmesh.swap")
    assert swap.parent_span_id == parent
    assert swap.attributes["sitsmesh.swap.outcome"] == "succeeded"
    assert swap.attributes["sitsmesh.swap.from_version"] == 1
    assert swap.attributes["sitsmesh.swap.to_version"] == 2
    assert swap.attributes["sitsmesh.swap.id"] == record.id
    assert sorted(spans) == sorted(f"sitsmesh.swap.{p}" for p in PHASES)
    steps = {word(admin_pb2.SwapPhase, step.phase): step for step in record.steps}
    for phase in PHASES:
        span, step = spans[f"sitsmesh.swap.{phase}"], steps[phase]
        assert span.parent_span_id == swap.span_id
        started = step.started_at.seconds * 10**9 + step.started_at.nanos
        assert abs(span.start_ns - started) < 1000  # the record's time, to the µs
        assert swap.start_ns <= span.start_ns <= span.end_ns <= swap.end_ns
        assert span.attributes["sitsmesh.swap.phase_state"] == word(admin_pb2.StepState, step.state)
    assert spans["sitsmesh.swap.load"].end_ns - spans["sitsmesh.swap.load"].start_ns > 0
