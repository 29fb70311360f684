"""ConfigService sits behind the admin mTLS allowlist like Admin: a certificate not on
--admin-clients is refused before anything is read, and the audit of a declarative
threshold change names the credential, the header only as an 'on behalf of' note."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc, config_pb2, config_pb2_grpc
from sitsmesh.dev import harness
from tests.security import tlsnode
from tests.security.pki import Ca, Pair, make_ca

pytestmark = pytest.mark.integration

THRESHOLDS = """apiVersion: sitsmesh.io/v1alpha1
kind: Thresholds
metadata: {name: demo}
spec: {policy: seed}
"""


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[harness.Sitsmesh, Ca, Pair, Pair]]:
    ca = make_ca(tmp_path / "pki")
    server = ca.issue("server", "DNS:localhost", "IP:127.0.0.1")
    sre = ca.issue("sre", "URI:spiffe://test/sre")
    intern = ca.issue("intern", "URI:spiffe://test/intern")
    started = tlsnode.start(
        tmp_path, "--admin-tls-cert-file", str(server.cert), "--admin-tls-key-file",
        str(server.key), "--admin-tls-client-ca-file", str(ca.cert), "--admin-clients",
        "spiffe://test/sre", admin=(ca.cert, sre))
    yield started, ca, sre, intern
    started.kill()


def test_config_service_is_behind_the_admin_allowlist_and_audits_the_certificate(
        node: tuple[harness.Sitsmesh, Ca, Pair, Pair]) -> None:
    sitsmesh, ca, sre, intern = node
    request = config_pb2.ApplyRequest(
        files=[config_pb2.ApplyFile(name="t.yaml", documents=THRESHOLDS)])
    metadata = (*sitsmesh.admin_metadata(), ("x-sitsmesh-actor", "root@somewhere"))
    with tlsnode.channel(sitsmesh.admin_addr, ca.cert, intern) as ch, \
            pytest.raises(grpc.RpcError) as refused:
        config_pb2_grpc.ConfigServiceStub(ch).Apply(request, metadata=metadata, timeout=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with tlsnode.channel(sitsmesh.admin_addr, ca.cert, sre) as ch:
        reply = config_pb2_grpc.ConfigServiceStub(ch).Apply(request, metadata=metadata,
                                                            timeout=5)
        assert reply.applied
        changes = admin_pb2_grpc.AdminServiceStub(ch).ListThresholdChanges(
            admin_pb2.ListThresholdChangesRequest(pipeline="demo"),
            metadata=sitsmesh.admin_metadata(), timeout=5).changes
    assert [c.actor for c in changes] == ["admin via spiffe://test/sre (on behalf of "
                                          "root@somewhere)"]
