"""Traces to an https:// receiver leave over TLS and only to a receiver whose certificate
the configured CA signed: a receiver with another CA's certificate gets nothing, and
sitsmesh answers as before (real `sitsmesh serve`, real OTLP/gRPC receiver)."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import grpc
import pytest
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc

from sitsmesh.dev import harness
from tests import otlpcollector
from tests.security.pki import make_ca

pytestmark = pytest.mark.integration
CHECK = "envoy.service.auth.v3.Authorization/Check"


def _check(node: harness.Sitsmesh) -> str:
    """One Check carrying a sampled traceparent in its metadata; its trace id."""
    trace_id = secrets.token_hex(16)
    request = external_auth_pb2.CheckRequest()
    request.attributes.request.http.path = "/v2/models/m/infer"
    with grpc.insecure_channel(node.data_addr) as channel:
        reply = external_auth_pb2_grpc.AuthorizationStub(channel).Check(
            request, timeout=5,
            metadata=(("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),))
    assert reply.denied_response.status.code == 401  # answered: no key
    return trace_id


@pytest.mark.parametrize("trusted", [True, False], ids=["our-ca", "another-ca"])
def test_spans_reach_only_a_receiver_the_ca_vouches_for(tmp_path: Path, trusted: bool) -> None:
    ours = make_ca(tmp_path / "ours", "ours")
    signer = ours if trusted else make_ca(tmp_path / "theirs", "theirs")
    pair = signer.issue("collector", "DNS:localhost", "IP:127.0.0.1")
    with otlpcollector.running((pair.cert, pair.key)) as (collector, endpoint):
        node = harness.start_sitsmesh(tmp_path, "--otlp-endpoint", endpoint,
                                      "--otlp-ca-file", str(ours.cert),
                                      env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
        try:
            trace_id = _check(node)
            if trusted:
                harness.wait_until(lambda: any(s.trace_id == trace_id
                                               for s in collector.named(CHECK)),
                                   15, "the span over TLS")
            else:
                time.sleep(3)  # some thirty export rounds
                assert collector.exports == 0
                _check(node)  # still answering
        finally:
            assert node.stop() == 0
    if not trusted:
        assert "trace export trouble" in node.output()
