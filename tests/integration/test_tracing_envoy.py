"""Tracing end to end: real Envoy (ext_authz + ratelimit) in front of a real `sitsmesh
serve` that exports OTLP/gRPC to a real TraceService receiver in the test."""

from __future__ import annotations

import json
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc

from sitsmesh.dev import envoyconf, harness
from tests import otlpcollector
from tests.otlpcollector import ReceivedSpan

Start = Callable[..., harness.Sitsmesh]
RATELIMIT = harness.REPO / "filters" / "local" / "ratelimit"
CHECK = "envoy.service.auth.v3.Authorization/Check"
SHOULD_RATE_LIMIT = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
SERVER = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
ERROR = 2   # Status.STATUS_CODE_ERROR
# Export every 100 ms instead of the SDK's 5 s: the assertions wait less.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}




def _key(node: harness.Sitsmesh) -> str:
    assert node.cli("tenants", "create", "acme", "--models", "llama-*").returncode == 0
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    assert made.returncode == 0, made.stderr
    key: str = json.loads(made.stdout)["key"]
    return key


def _traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def _one(collector: otlpcollector.Collector, name: str, trace_id: str) -> ReceivedSpan:
    def found() -> bool:
        return any(s.trace_id == trace_id for s in collector.named(name))

    harness.wait_until(found, 15, f"a {name} span of trace {trace_id}")
    [span] = [s for s in collector.named(name) if s.trace_id == trace_id]
    return span


def test_check_and_ratelimit_spans_reach_a_real_otlp_receiver_parented_by_traceparent(
        tmp_path: Path, start_sitsmesh: Start, upstream: int) -> None:
    with otlpcollector.running() as (collector, endpoint):
        node = start_sitsmesh("--otlp-endpoint", endpoint, "--ratelimit-config",
                              str(RATELIMIT), "--reload-interval-seconds", "0.2",
                              env=FAST_EXPORT)
        key = _key(node)
        envoy = harness.start_envoy(tmp_path, node.data_addr, upstream,
                                    fragments=["ext_authz", "ratelimit"])
        try:
            harness.wait_until(lambda: envoy.post_status("/v2/models/llama-3/infer",
                                                         {"x-api-key": key}) == 200, 10, "the key")
            allowed, allowed_trace, allowed_parent = _traceparent()
            sent_at = time.time_ns()
            assert envoy.post_status("/v2/models/llama-3/infer", {
                "x-api-key": key, "traceparent": allowed, "x-user": "alice",
                "x-request-id": "trace-req-1"}) == 200
            answered_at = time.time_ns()
            denied, denied_trace, denied_parent = _traceparent()
            assert envoy.post_status("/v2/models/secret/infer",
                                     {"x-api-key": key, "traceparent": denied}) == 403
            unsampled, unsampled_trace, _ = _traceparent()
            assert envoy.post_status("/v2/models/llama-3/infer", {
                "x-api-key": key, "traceparent": unsampled[:-2] + "00"}) == 200

            span = _one(collector, CHECK, allowed_trace)
            assert span.parent_span_id == allowed_parent
            assert span.kind == SERVER
            assert sent_at <= span.start_ns <= span.end_ns <= answered_at
            assert span.attributes["sitsmesh.decision"] == "allow"
            assert span.attributes["sitsmesh.reason"] == "ok"
            assert span.attributes["http.response.status_code"] == 200
            assert span.attributes["sitsmesh.tenant"] == "acme"
            assert span.attributes["sitsmesh.model"] == "llama-3"
            assert span.attributes["sitsmesh.request_id"] == "trace-req-1"
            assert span.attributes["rpc.method"] == "Check"
            assert span.resource["service.name"] == "sitsmesh"
            assert span.resource["sitsmesh.role"] == "single"
            assert span.resource["service.version"]

            deny = _one(collector, CHECK, denied_trace)
            assert deny.parent_span_id == denied_parent
            assert deny.attributes["sitsmesh.decision"] == "deny"
            assert deny.attributes["sitsmesh.reason"] == "model_not_allowed"
            assert deny.attributes["http.response.status_code"] == 403
            assert deny.attributes["sitsmesh.tenant"] == "acme"
            assert deny.status_code != ERROR  # a deny is an answer, not a failure

            # Envoy's ratelimit call carries no traceparent without Envoy's tracer: the
            # ShouldRateLimit spans are roots, sampled at the default ratio of 1.
            harness.wait_until(lambda: any(
                s.attributes.get("sitsmesh.ratelimit.descriptors") == ("user=alice",)
                for s in collector.named(SHOULD_RATE_LIMIT)), 15, "a ShouldRateLimit span")
            limited = next(s for s in collector.named(SHOULD_RATE_LIMIT)
                           if s.attributes.get("sitsmesh.ratelimit.descriptors")
                           == ("user=alice",))
            assert limited.kind == SERVER and limited.parent_span_id == ""
            assert limited.attributes["sitsmesh.ratelimit.domain"] == "sitsmesh-local"
            assert limited.attributes["sitsmesh.decision"] == "ok"
        finally:
            envoy.kill()
        # The unsampled request's flag was honoured: nothing of its trace was exported,
        # even after the flush a stop does.
        assert node.stop() == 0
        assert not [s for s in collector.spans if s.trace_id == unsampled_trace]


def test_a_dead_collector_costs_no_answer_and_a_few_log_lines(
        tmp_path: Path, start_sitsmesh: Start, upstream: int) -> None:
    closed = harness.free_port()  # nothing listens there
    node = start_sitsmesh("--otlp-endpoint", f"http://127.0.0.1:{closed}",
                          "--reload-interval-seconds", "0.2", env=FAST_EXPORT)
    key = _key(node)
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream, fragments=["ext_authz"])
    try:
        harness.wait_until(lambda: envoy.post_status("/v2/models/llama-3/infer",
                                                     {"x-api-key": key}) == 200, 10, "the key")
        started = time.monotonic()
        codes = [envoy.post_status("/v2/models/llama-3/infer",
                                   {"x-api-key": key, "traceparent": _traceparent()[0]})
                 for _ in range(200)]
        took = time.monotonic() - started
        assert codes == [200] * 200
        # Exports fail in the background for as long as the requests run, and past it.
        time.sleep(2)
        assert envoy.post_status("/v2/models/llama-3/infer", {"x-api-key": key}) == 200
    finally:
        envoy.kill()
    stopping = time.monotonic()
    assert node.stop() == 0
    # Drain 0.5 s + the bounded flush (5 s): a dead collector does not hold the stop.
    assert time.monotonic() - stopping < 10
    output = node.output()
    trouble = [line for line in output.splitlines() if "trace export trouble" in line]
    assert 1 <= len(trouble) <= 3, (took, trouble)
    assert f"127.0.0.1:{closed}" in trouble[0]
    # The SDK's own per-attempt lines were held back, as was anything per request; the
    # stop says once that the last batch could not leave.
    others = [json.loads(line)["event"] for line in output.splitlines()
              if ("export" in line or "opentelemetry" in line) and line not in trouble]
    assert others in ([], ["trace export did not finish in time; spans may be lost"])


def test_sigterm_flushes_spans_still_queued(tmp_path: Path, start_sitsmesh: Start,
                                            upstream: int) -> None:
    with otlpcollector.running() as (collector, endpoint):
        # A schedule longer than the test: only the stop's flush can export the span.
        node = start_sitsmesh("--otlp-endpoint", endpoint, "--reload-interval-seconds", "0.2",
                              env={"OTEL_BSP_SCHEDULE_DELAY": "600000"})
        key = _key(node)
        envoy = harness.start_envoy(tmp_path, node.data_addr, upstream,
                                    fragments=["ext_authz"])
        try:
            harness.wait_until(lambda: envoy.post_status("/v2/models/llama-3/infer",
                                                         {"x-api-key": key}) == 200, 10, "the key")
            header, trace_id, _ = _traceparent()
            assert envoy.post_status("/v2/models/llama-3/infer",
                                     {"x-api-key": key, "traceparent": header}) == 200
            time.sleep(0.5)
            assert not [s for s in collector.spans if s.trace_id == trace_id]
        finally:
            envoy.kill()
        assert node.stop(signal.SIGTERM) == 0
        assert [s.name for s in collector.spans if s.trace_id == trace_id] == [CHECK]


def _envoy_with_tracer(tmp_path: Path, node: harness.Sitsmesh, upstream: int,
                       collector_port: int) -> harness.Envoy:
    """Envoy whose own OpenTelemetry tracer reports to the same receiver and propagates
    the trace to its ext_authz and ratelimit calls (in their gRPC metadata)."""
    listen, admin = harness.free_port(), harness.free_port()
    values = harness.envoy_values(node.data_addr, upstream, listen, admin, "0.02s")
    bootstrap = envoyconf.render(harness.REPO / "filters" / "local" / "bootstrap.yaml",
                                 values, ["ext_authz", "ratelimit"])
    envoyconf.http_connection_manager(bootstrap)["tracing"] = {"provider": {
        "name": "envoy.tracers.opentelemetry",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
            "grpc_service": {"envoy_grpc": {"cluster_name": "otlp"}, "timeout": "1s"},
            "service_name": "envoy"}}}
    bootstrap["static_resources"]["clusters"].append({
        "name": "otlp", "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                         "HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": "otlp", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": collector_port}}}}]}]}})
    config = envoyconf.write(bootstrap, tmp_path / "envoy-traced.yaml")
    return harness.launch_envoy(config, listen, admin, tmp_path / "envoy-traced.log")


def test_envoys_tracer_parents_check_and_ratelimit_spans_in_the_clients_trace(
        tmp_path: Path, start_sitsmesh: Start, upstream: int) -> None:
    with otlpcollector.running() as (collector, endpoint):
        node = start_sitsmesh("--otlp-endpoint", endpoint, "--ratelimit-config",
                              str(RATELIMIT), "--reload-interval-seconds", "0.2",
                              env=FAST_EXPORT)
        key = _key(node)
        envoy = _envoy_with_tracer(tmp_path, node, upstream, int(endpoint.rpartition(":")[2]))
        try:
            harness.wait_until(lambda: envoy.post_status("/v2/models/llama-3/infer",
                                                         {"x-api-key": key}) == 200, 10, "the key")
            header, trace_id, client_parent = _traceparent()
            assert envoy.post_status("/v2/models/llama-3/infer", {
                "x-api-key": key, "traceparent": header, "x-user": "bob"}) == 200
            check = _one(collector, CHECK, trace_id)
            limited = _one(collector, SHOULD_RATE_LIMIT, trace_id)

            def envoys_spans() -> dict[str, ReceivedSpan]:
                return {s.span_id: s for s in collector.spans
                        if s.trace_id == trace_id and s.resource.get("service.name") == "envoy"}

            # Envoy exports its spans of the trace too; each sitsmesh span's parent is one
            # of them (Envoy's client span of that call), and they lead to the client's.
            harness.wait_until(lambda: {check.parent_span_id, limited.parent_span_id}
                               <= set(envoys_spans()), 15, "Envoy's spans")
            spans = envoys_spans()
            for ours in (check, limited):
                assert ours.parent_span_id != client_parent
                hop, seen = spans[ours.parent_span_id], 0
                while hop.parent_span_id in spans and seen < 10:
                    hop, seen = spans[hop.parent_span_id], seen + 1
                assert hop.parent_span_id == client_parent
            assert limited.attributes["sitsmesh.ratelimit.descriptors"] == ("user=bob",)
        finally:
            envoy.kill()


def test_each_worker_traces_its_checks_from_grpc_metadata(start_sitsmesh: Start) -> None:
    """--workers 2: every worker process exports its own spans (resource role `worker`,
    its own instance id); a traceparent in the call's gRPC metadata parents them."""
    with otlpcollector.running() as (collector, endpoint):
        node = start_sitsmesh("--workers", "2", "--otlp-endpoint", endpoint, env=FAST_EXPORT)
        sent: dict[str, str] = {}
        request = external_auth_pb2.CheckRequest()
        request.attributes.request.http.path = "/v2/models/llama-3/infer"

        def check() -> None:
            header, trace_id, parent = _traceparent()
            sent[trace_id] = parent
            # A connection of its own (no shared subchannel): the kernel spreads new
            # connections over the workers by hash.
            with grpc.insecure_channel(node.data_addr,
                                       options=[("grpc.use_local_subchannel_pool", 1)]
                                       ) as channel:
                external_auth_pb2_grpc.AuthorizationStub(channel).Check(
                    request, metadata=(("traceparent", header),), timeout=5)

        def from_both() -> bool:
            check()
            ours = [s for s in collector.named(CHECK) if s.trace_id in sent]
            return len({s.resource["service.instance.id"] for s in ours}) == 2

        harness.wait_until(from_both, 20, "spans from both workers", interval=0.1)
        spans = [s for s in collector.named(CHECK) if s.trace_id in sent]
        assert all(s.parent_span_id == sent[s.trace_id] for s in spans)
        assert all(s.attributes["sitsmesh.reason"] == "unauthenticated" for s in spans)
        assert {s.resource["sitsmesh.role"] for s in spans} == {"worker"}
        assert node.stop() == 0
