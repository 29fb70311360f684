"""Hypothesis fuzz of the data-plane RPCs through a real `sitsmesh serve`.

Random bytes, mutated valid messages and random well-formed messages go to
Check, ShouldRateLimit, StreamAccessLogs and MetricsService/StreamMetrics as
raw bytes. Every call must end with a gRPC status from the server (never a
lost connection or a hang), no Check may be admitted unless it carries the one
valid API key (the seed Check does; mutations of it may keep it or break it),
and the server must still serve at the end. The run lasts
SITSMESH_FUZZ_SECONDS (20 when unset, to keep `make test` near 10 minutes; set it
higher for a deeper run) in batches.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.auth.v3 import external_auth_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sitsmesh.dev import harness
from sitsmesh.transport.metrics import StreamMetricsMessage

pytestmark = pytest.mark.integration

FUZZ_SECONDS = float(os.environ.get("SITSMESH_FUZZ_SECONDS") or 20)
BATCH = 40
CALL_TIMEOUT_S = 20.0
# Statuses the server gives on purpose. UNAVAILABLE (connection lost), DEADLINE_EXCEEDED
# (a hang), UNKNOWN (an exception escaped a servicer, or grpc's own answer to a message
# that did not parse) and INTERNAL are failures.
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
CONFIG = """\
domain: edge
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: path
    value: /api/*
    rate_limit: {unit: second, requests_per_unit: 2, algorithm: gcra}
"""


@dataclass(frozen=True)
class Method:
    path: str
    streaming: bool
    seeds: tuple[bytes, ...]


def _check_seed(key: str) -> bytes:
    request = external_auth_pb2.CheckRequest()
    http = request.attributes.request.http
    http.path, http.method = "/v2/models/bert/infer", "POST"
    http.headers.update({"x-api-key": key, "x-request-id": "r1", "x-priority": "1"})
    http.body = '{"model": "bert"}'
    request.attributes.source.principal = "spiffe://cluster.local/ns/a/sa/b"
    return bytes(request.SerializeToString())


def _ratelimit_seed() -> bytes:
    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    descriptor = ratelimit_pb2.RateLimitDescriptor(
        entries=[entry(key="user", value="alice")])
    descriptor.hits_addend.value = 2
    return bytes(rls_pb2.RateLimitRequest(domain="edge", descriptors=[
        descriptor, ratelimit_pb2.RateLimitDescriptor(entries=[entry(key="path", value="/api/x")])
    ], hits_addend=1).SerializeToString())


def _accesslog_seed() -> bytes:
    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.log_name = "fuzz"
    entry = message.http_logs.log_entry.add()
    entry.common_properties.start_time.FromSeconds(int(time.time()))
    entry.common_properties.time_to_last_downstream_tx_byte.FromMilliseconds(5)
    entry.common_properties.upstream_cluster = "pre"
    entry.request.request_id = "r1"
    entry.request.request_headers["x-sits-stage"] = "pre"
    entry.response.response_code.value = 200
    return bytes(message.SerializeToString())


def _metrics_seed() -> bytes:
    message = StreamMetricsMessage()
    message.identifier.node.id = "envoy-1"
    family = message.envoy_metrics.add(name="cluster.triton.upstream_rq_active")
    metric = family.metric.add(timestamp_ms=int(time.time() * 1000))
    metric.gauge.value = 3.0
    return bytes(message.SerializeToString())


CHECK = "/envoy.service.auth.v3.Authorization/Check"
OTHER_METHODS = (
    Method("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", False,
           (_ratelimit_seed(),)),
    Method("/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs", True,
           (_accesslog_seed(),)),
    Method("/envoy.service.metrics.v3.MetricsService/StreamMetrics", True, (_metrics_seed(),)),
)
_text = st.text(max_size=64)


@st.composite
def _mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(("set", "insert", "delete", "truncate")))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        else:
            del data[at:]
    return bytes(data)


@st.composite
def _structured(draw: st.DrawFn, method: Method) -> bytes:
    name = method.path.rsplit("/", 1)[1]
    if name == "Check":
        request = external_auth_pb2.CheckRequest()
        http = request.attributes.request.http
        http.path = draw(st.sampled_from(("/v2/models/bert/infer", "/v1/chat/completions",
                                          "/inference.GRPCInferenceService/ModelInfer"))
                         | _text)
        http.headers.update(draw(st.dictionaries(_text, _text, max_size=8)))
        http.raw_body = draw(st.binary(max_size=256))
        request.attributes.source.principal = draw(_text)
        return bytes(request.SerializeToString())
    if name == "ShouldRateLimit":
        entry = ratelimit_pb2.RateLimitDescriptor.Entry
        descriptors = []
        for _ in range(draw(st.integers(0, 70))):
            d = ratelimit_pb2.RateLimitDescriptor(entries=[
                entry(key=draw(st.sampled_from(("user", "path")) | _text), value=draw(_text))
                for _ in range(draw(st.integers(0, 3)))])
            if draw(st.booleans()):
                d.hits_addend.value = draw(st.integers(0, 2**64 - 1))
            if draw(st.booleans()):
                d.limit.requests_per_unit = draw(st.integers(0, 2**32 - 1))
                d.limit.unit = draw(st.integers(0, 10))
            descriptors.append(d)
        return bytes(rls_pb2.RateLimitRequest(
            domain=draw(st.sampled_from(("edge", "")) | _text), descriptors=descriptors,
            hits_addend=draw(st.integers(0, 2**32 - 1))).SerializeToString())
    if name == "StreamAccessLogs":
        message = als_pb2.StreamAccessLogsMessage()
        for _ in range(draw(st.integers(0, 5))):
            entry = message.http_logs.log_entry.add()
            common = entry.common_properties
            common.start_time.seconds = draw(st.integers(0, 2**40))
            common.start_time.nanos = draw(st.integers(0, 999_999_999))
            common.duration.seconds = draw(st.integers(0, 2**40))
            common.upstream_cluster = draw(st.sampled_from(("pre", "model")) | _text)
            common.intermediate_log_entry = draw(st.booleans())
            entry.request.request_id = draw(st.text(max_size=300))
            entry.response.response_code.value = draw(st.integers(0, 2**32 - 1))
        return bytes(message.SerializeToString())
    message = StreamMetricsMessage()
    for _ in range(draw(st.integers(0, 5))):
        family = message.envoy_metrics.add(name=draw(
            st.sampled_from(("cluster.a.upstream_rq_active", "cluster.upstream_rq_pending_active",
                             "cluster.b.upstream_rq_completed")) | _text))
        metric = family.metric.add(timestamp_ms=draw(st.integers(-2**63, 2**63 - 1)))
        metric.gauge.value = draw(st.floats())
        metric.counter.value = draw(st.floats())
        metric.label.add(name="envoy.cluster_name", value=draw(_text))
    return bytes(message.SerializeToString())


@st.composite
def _call(draw: st.DrawFn, methods: tuple[Method, ...]) -> tuple[Method, list[bytes]]:
    method = draw(st.sampled_from(methods))
    one = st.binary(max_size=2048) | _mutated(method.seeds[0]) | _structured(method)
    count = draw(st.integers(0, 3)) if method.streaming else 1
    return method, [draw(one) for _ in range(count)]


def _invoke(channel: grpc.Channel, method: Method, payloads: list[bytes]) -> bytes:
    # No serializers: the payloads go out as the raw bytes they are.
    call: Any = (channel.stream_unary(method.path) if method.streaming
                 else channel.unary_unary(method.path))
    reply: bytes = call(iter(payloads) if method.streaming else payloads[0],
                        timeout=CALL_TIMEOUT_S)
    return reply


@pytest.fixture
def node(tmp_path: Path) -> Iterator[harness.Sitsmesh]:
    config = tmp_path / "edge.yaml"
    config.write_text(CONFIG)
    started = harness.start_sitsmesh(tmp_path, "--ratelimit-config", str(config),
                                     "--reload-interval-seconds", "0.2")
    yield started
    started.kill()


def _api_key(node: harness.Sitsmesh) -> str:
    created = node.cli("tenants", "create", "acme", "--models", "*")
    assert created.returncode == 0, created.stderr
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    assert made.returncode == 0, made.stderr
    key: str = json.loads(made.stdout)["key"]
    return key


def _admitted(channel: grpc.Channel, payload: bytes) -> bool:
    reply = _invoke(channel, Method(CHECK, False, ()), [payload])
    code: int = external_auth_pb2.CheckResponse.FromString(reply).status.code
    return code == 0


def test_fuzzed_data_plane_rpcs_always_get_a_status_and_admit_only_the_key(
    node: harness.Sitsmesh,
) -> None:
    key = _api_key(node)
    seed = _check_seed(key)
    methods = (Method(CHECK, False, (seed,)), *OTHER_METHODS)
    seen: dict[str, set[grpc.StatusCode]] = {m.path: set() for m in methods}
    admitted = 0
    with grpc.insecure_channel(node.data_addr) as channel:
        # The property below means something only once the key is live.
        harness.wait_until(lambda: _admitted(channel, seed), 10, "the seed Check admitted")

        @settings(max_examples=BATCH, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_call(methods))
        def batch(call: tuple[Method, list[bytes]]) -> None:
            nonlocal admitted
            method, payloads = call
            try:
                reply = _invoke(channel, method, payloads)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                reply, code = None, exc.code()
            seen[method.path].add(code)
            assert code in ANSWERS, f"{method.path}: {code} for {payloads!r:.300}"
            if (reply is not None and method.path == CHECK
                    and external_auth_pb2.CheckResponse.FromString(reply).status.code == 0):
                assert key.encode() in payloads[0], f"admitted without the key: {payloads!r}"
                admitted += 1

        deadline = time.monotonic() + FUZZ_SECONDS
        batches = 0
        while time.monotonic() < deadline:
            batch()
            batches += 1
    print(f"\n{batches * BATCH} fuzzed calls, {admitted} Checks admitted; statuses seen: "
          f"{ {m.rsplit('/', 1)[1]: sorted(c.name for c in codes) for m, codes in seen.items()} }")
    assert node.proc.poll() is None, node.output()[-3000:]
    assert harness.health_status(node.data_addr) == health_pb2.HealthCheckResponse.SERVING
    assert all(seen.values()), f"a method was never called: {seen}"
