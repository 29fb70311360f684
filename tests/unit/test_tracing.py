"""Tracing: spans built after the fact, parented by a W3C traceparent, checked with the
SDK's in-memory exporter; and nothing of the SDK when tracing is off."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sitsmesh.authz.check import Allowed, CheckInput, Denied
from sitsmesh.config import Settings, load_settings
from sitsmesh.errors import ConfigError, StartupError
from sitsmesh.pressure.controller import Decision, Snapshot, StagePressure
from sitsmesh.ratelimit.limiter import Decision as RateLimitDecision
from sitsmesh.ratelimit.limiter import Descriptor, Status
from sitsmesh.swap.manager import SwapManager
from sitsmesh.swap.override import SwapOptions
from sitsmesh.swap.record import SwapHistory
from sitsmesh.telemetry import tracing
from sitsmesh.telemetry.decisions import Telemetry
from tests.unit.test_swap import FakeTriton, history  # noqa: F401 - the fixture

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-01"
NOT_SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-00"


@pytest.fixture
def memory() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def _tracing(exporter: InMemorySpanExporter, ratio: float = 1.0) -> tracing.Tracing:
    return tracing.build(Settings(trace_sample_ratio=ratio), "single", exporter)


def _one(exporter: InMemorySpanExporter) -> ReadableSpan:
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


class Context:
    """What the hook reads of a grpc call's context: its invocation metadata."""

    def __init__(self, *metadata: tuple[str, str]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


ALLOWED = Allowed("acme", 3, "llama-3", "infer", (), ())


def _check(tracer: tracing.Tracing, headers: dict[str, str],
           decision: Allowed | Denied = ALLOWED, context: Any = None) -> None:
    tracer.check(CheckInput(headers, request_id="req-1"), decision, 0.00025, context)


def test_check_span_is_parented_by_the_traceparent_and_ends_when_decided(
        memory: InMemorySpanExporter) -> None:
    tracer = _tracing(memory)
    tracer.pipeline_of = lambda model, tenant: {"llama-3": "chat"}.get(model, "")
    before = time.time_ns()
    _check(tracer, {"traceparent": SAMPLED, "tracestate": "vendor=1"})
    after = time.time_ns()
    span = _one(memory)
    assert span.name == tracing.CHECK
    assert span.kind is SpanKind.SERVER
    assert span.context is not None and span.parent is not None
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    assert span.parent.is_remote
    assert span.context.trace_state.get("vendor") == "1"
    assert span.start_time is not None and span.end_time is not None
    assert before <= span.end_time <= after
    assert span.end_time - span.start_time == 250_000  # the time the hook was given
    assert dict(span.attributes or {}) == {
        "rpc.system": "grpc", "rpc.service": "envoy.service.auth.v3.Authorization",
        "rpc.method": "Check", "sitsmesh.decision": "allow", "sitsmesh.reason": "ok",
        "http.response.status_code": 200, "sitsmesh.tenant": "acme",
        "sitsmesh.model": "llama-3", "sitsmesh.pipeline": "chat", "sitsmesh.priority": 3,
        "sitsmesh.request_class": "infer", "sitsmesh.request_id": "req-1"}
    assert span.status.status_code is StatusCode.UNSET
    assert span.resource.attributes["service.name"] == "sitsmesh"
    assert span.resource.attributes["sitsmesh.role"] == "single"


def test_a_deny_is_an_answer_not_an_error(memory: InMemorySpanExporter) -> None:
    _check(_tracing(memory), {"traceparent": SAMPLED},
           Denied(429, "over_capacity", "busy", 1.0, tenant="acme"))
    span = _one(memory)
    assert span.status.status_code is StatusCode.UNSET
    assert {k: v for k, v in (span.attributes or {}).items() if k.startswith(("sits", "http"))
            } == {"sitsmesh.decision": "deny", "sitsmesh.reason": "over_capacity",
                  "http.response.status_code": 429, "sitsmesh.tenant": "acme",
                  "sitsmesh.request_id": "req-1"}


def test_caller_chosen_values_are_bounded(memory: InMemorySpanExporter) -> None:
    tracer = _tracing(memory)
    tracer.check(CheckInput({"traceparent": SAMPLED}, request_id="r" * 60_000), ALLOWED,
                 0.001)
    tracer.ratelimit("d" * 60_000, [], None, 0.001, error="no domain " + "d" * 60_000)
    check, limited = memory.get_finished_spans()
    assert dict(check.attributes or {})["sitsmesh.request_id"] == "r" * 256
    assert dict(limited.attributes or {})["sitsmesh.ratelimit.domain"] == "d" * 256
    assert len(limited.status.description or "") == 256


def test_grpc_metadata_wins_over_the_http_headers(memory: InMemorySpanExporter) -> None:
    other = f"00-{'1' * 32}-{'2' * 16}-01"
    assert tracing.carrier({"traceparent": SAMPLED}, (("traceparent", other),)) == (other, "")
    assert tracing.carrier({"traceparent": SAMPLED}, (("x-request-id", "a"),)) == (SAMPLED, "")
    assert tracing.carrier({}, None) == ("", "")
    _check(_tracing(memory), {"traceparent": SAMPLED}, context=Context(("traceparent", other)))
    span = _one(memory)
    assert span.parent is not None and format(span.parent.span_id, "016x") == "2" * 16


def test_an_unsampled_parent_is_not_recorded_and_a_bad_one_starts_a_root(
        memory: InMemorySpanExporter) -> None:
    tracer = _tracing(memory)
    _check(tracer, {"traceparent": NOT_SAMPLED})
    assert memory.get_finished_spans() == ()
    _check(tracer, {"traceparent": "00-zz-00f067aa0ba902b7-01"})
    assert _one(memory).parent is None


def test_the_ratio_applies_to_roots_only(memory: InMemorySpanExporter) -> None:
    tracer = _tracing(memory, ratio=0.0)
    _check(tracer, {})
    assert memory.get_finished_spans() == ()
    _check(tracer, {"traceparent": SAMPLED})
    assert len(memory.get_finished_spans()) == 1


def test_ratelimit_span_names_domain_and_descriptors_and_marks_errors(
        memory: InMemorySpanExporter) -> None:
    tracer = _tracing(memory)
    descriptors = [Descriptor((("tenant", "acme"),)), Descriptor((("path", "x" * 1000),))]
    decision = RateLimitDecision(True, [Status(False, None, 5, 1.0), Status(True, None, 0, 1.0)])
    tracer.ratelimit("edge", descriptors, decision, 0.001,
                     context=Context(("traceparent", SAMPLED)))
    tracer.ratelimit("edge", descriptors, None, 0.001, error="no rate-limit domain 'edge'")
    over, failed = memory.get_finished_spans()
    assert over.name == tracing.SHOULD_RATE_LIMIT and over.kind is SpanKind.SERVER
    assert over.parent is not None and format(over.parent.span_id, "016x") == PARENT_ID
    attributes = dict(over.attributes or {})
    assert attributes["sitsmesh.decision"] == "over_limit"
    assert attributes["sitsmesh.ratelimit.domain"] == "edge"
    assert attributes["sitsmesh.ratelimit.codes"] == ("OK", "OVER_LIMIT")
    listed = attributes["sitsmesh.ratelimit.descriptors"]
    assert isinstance(listed, tuple) and listed[0] == "tenant=acme"
    assert len(listed[1]) == tracing.MAX_ATTRIBUTE_CHARS
    assert over.status.status_code is StatusCode.UNSET
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "no rate-limit domain 'edge'"
    assert dict(failed.attributes or {})["sitsmesh.decision"] == "error"


def test_the_decision_hook_emits_only_when_tracing_is_on(
        memory: InMemorySpanExporter) -> None:
    hook = Telemetry(None, None)
    hook.check(CheckInput({"traceparent": SAMPLED}), ALLOWED, time.perf_counter())
    assert memory.get_finished_spans() == ()
    hook.tracer = _tracing(memory)
    hook.check(CheckInput({"traceparent": SAMPLED}), ALLOWED, time.perf_counter())
    hook.ratelimit("edge", [], None, time.perf_counter(), error="bad", context=Context())
    assert [s.name for s in memory.get_finished_spans()] == [tracing.CHECK,
                                                             tracing.SHOULD_RATE_LIMIT]


async def test_a_swap_is_one_span_with_a_child_per_phase_at_its_real_times(
        memory: InMemorySpanExporter, history: SwapHistory) -> None:  # noqa: F811
    prod = FakeTriton("prod")
    prod.ready = {1: True}
    prod.fail_load = {3}
    manager = SwapManager([tracing_endpoint()], history, lambda *a: prod, None)
    manager.on_end = _tracing(memory).swap
    good = manager.begin("m", 2, "", SwapOptions(verify_probes=3), traceparent=SAMPLED)
    assert good.task is not None
    record = await good.task
    spans = memory.get_finished_spans()
    root = next(s for s in spans if s.name == tracing.SWAP)
    phases = [s for s in spans if s.name != tracing.SWAP]
    assert [s.name for s in phases] == [f"sitsmesh.swap.{s.phase}" for s in record.steps]
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    assert root.context is not None
    for span, step in zip(phases, record.steps, strict=True):
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert span.start_time == tracing.wall_ns(step.started_at)
        assert step.ended_at is not None and span.end_time == tracing.wall_ns(step.ended_at)
    assert root.start_time == tracing.wall_ns(record.started_at)
    attributes = dict(root.attributes or {})
    assert attributes["sitsmesh.swap.outcome"] == "succeeded"
    assert attributes["sitsmesh.swap.from_version"] == 1
    assert attributes["sitsmesh.swap.to_version"] == 2
    assert attributes["sitsmesh.swap.endpoint"] == "prod"
    assert root.status.status_code is StatusCode.UNSET

    memory.clear()
    bad = manager.begin("m", 3, "", SwapOptions(verify_probes=3))
    assert bad.task is not None and (await bad.task).state == "rolled_back"
    spans = memory.get_finished_spans()
    root = next(s for s in spans if s.name == tracing.SWAP)
    assert root.parent is None  # no traceparent on the call: a root
    assert root.status.status_code is StatusCode.ERROR
    assert "did not become READY" in (root.status.description or "")
    load = next(s for s in spans if s.name == "sitsmesh.swap.load")
    assert load.status.status_code is StatusCode.ERROR
    assert any(s.name == "sitsmesh.swap.rollback" for s in spans)
    await manager.stop()


def tracing_endpoint() -> Any:
    from sitsmesh.config import TritonEndpoint

    return TritonEndpoint("prod", "127.0.0.1:1")


def _decision(fraction: float, bottleneck: str = "model", reason: str = "") -> Decision:
    view = StagePressure("model", "overloaded" if fraction < 1 else "ok", 1.0, 10, 5, 1, 3,
                         0.5, 100, 100, 0, False, reason)
    return Decision("chat", "backpressure", fraction, 0.0, 4, 9, 1, bottleneck,
                    view.level, 10.0, (view,), 0.0)


def test_controller_decisions_make_a_span_only_when_they_change(
        memory: InMemorySpanExporter) -> None:
    tracer = _tracing(memory)
    feed = [_decision(1.0), _decision(1.0, "pre"), _decision(0.8, reason="standing"),
            _decision(0.801), _decision(0.8, "pre"), _decision(1.0)]
    for decision in feed:
        tracer.decisions(Snapshot({"chat": decision}))
    spans = memory.get_finished_spans()
    # Calm bottleneck moves are noise; 0.8 -> 0.801 rounds to the same share.
    assert [(dict(s.attributes or {})["sitsmesh.fraction.old"],
             dict(s.attributes or {})["sitsmesh.fraction.new"],
             dict(s.attributes or {})["sitsmesh.bottleneck.new"]) for s in spans] == [
        (1.0, 0.8, "model"), (0.801, 0.8, "pre"), (0.8, 1.0, "model")]
    first = dict(spans[0].attributes or {})
    assert first["sitsmesh.pipeline"] == "chat" and first["sitsmesh.reason"] == "standing"
    assert all(s.name == tracing.CONTROLLER_DECISION and s.parent is None for s in spans)


def test_sdk_log_lines_are_throttled(caplog: pytest.LogCaptureFixture,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    throttle = tracing.Throttle(3600)
    logger = logging.getLogger("test.tracing.throttle")
    logger.addFilter(throttle)
    try:
        for _ in range(50):
            logger.warning("Failed to export traces to 127.0.0.1:1, error code: UNAVAILABLE")
    finally:
        logger.removeFilter(throttle)
    assert caplog.records == []   # the SDK's own lines never pass
    captured = capsys.readouterr()  # (structlog's default prints to stdout, serve's to stderr)
    assert (captured.out + captured.err).count("trace export trouble") == 1
    assert throttle.held == 49


@pytest.mark.parametrize(("raw", "message"), [
    ("collector:4317", "expected http://HOST:PORT (plaintext) or https://HOST:PORT (TLS)"),
    ("grpc://collector:4317", "expected http://HOST:PORT"),
    ("http://collector", "expected http://HOST:PORT"),
    ("http://collector:4317/v1/traces", "expected only a scheme, host and port"),
    ("https://user:pw@collector:4317", "expected only a scheme, host and port"),
])
def test_a_bad_endpoint_is_named(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"--otlp-endpoint: {message}")):
        load_settings({"otlp_endpoint": raw}, env={})


def test_settings_read_flags_and_environment() -> None:
    settings = load_settings({"otlp_endpoint": "http://collector:4317/"},
                             env={"SITSMESH_TRACE_SAMPLE_RATIO": "0.25"})
    assert settings.otlp_endpoint == "http://collector:4317"
    assert settings.trace_sample_ratio == 0.25
    with pytest.raises(ConfigError, match="SITSMESH_TRACE_SAMPLE_RATIO: must be between 0"):
        load_settings({}, env={"SITSMESH_TRACE_SAMPLE_RATIO": "2"})


def test_a_ca_file_needs_https_and_must_be_readable(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="otlp_endpoint is not https://"):
        tracing.build(Settings(otlp_endpoint="http://c:4317", otlp_ca_file=tmp_path / "ca"),
                      "single")
    with pytest.raises(StartupError, match=r"otlp_ca_file .*ca.pem: cannot read"):
        tracing.build(Settings(otlp_endpoint="https://c:4317",
                               otlp_ca_file=tmp_path / "ca.pem"), "single")


NO_SDK = """
import sys
from sitsmesh.app import compose, server  # everything serve imports
from sitsmesh.config import Settings
assert compose.tracing_for(Settings(), compose.Role.SINGLE) is None
# (redis-py imports parts of the SDK for its own metrics: the tracing half must not load.)
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace",
                                                     "opentelemetry.exporter"))))
"""


def test_tracing_off_loads_no_tracing_sdk() -> None:
    done = subprocess.run([sys.executable, "-c", NO_SDK], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_the_controller_hands_every_live_snapshot_to_its_hook() -> None:
    from sitsmesh.pressure.runtime import PressureRuntime

    runtime = PressureRuntime(None)
    seen: list[Snapshot] = []
    runtime.tick()  # no hook: nothing to call
    runtime.on_decisions = seen.append
    live = runtime.tick()
    assert seen == [live]


def test_an_exporter_that_does_not_load_is_a_startup_error_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # As when xds-protos' old opentelemetry/proto replaced opentelemetry-proto's modules.
    from sitsmesh.app import compose

    monkeypatch.setitem(sys.modules, "sitsmesh.telemetry.tracing", None)
    monkeypatch.delattr("sitsmesh.telemetry.tracing", raising=False)
    settings = Settings(otlp_endpoint="http://127.0.0.1:4317")
    with pytest.raises(StartupError, match="reinstall it last: pip install --force-reinstall "
                                           "--no-deps opentelemetry-proto"):
        compose.tracing_for(settings, compose.Role.SINGLE)
    assert compose.tracing_for(Settings(), compose.Role.SINGLE) is None
