"""deploy/istio/stats-sink.yaml through a real Envoy (issue 26, item 7): the stage's
proxy gets its workload certificate and root CA over SDS, as Istio's pilot-agent serves
them (a gRPC SDS server on a Unix socket, secrets `default` and `ROOTCA`), and pushes its
stats over mTLS to a sitsmesh that, like its STRICT sidecar, takes only mTLS, and only
from the stage's identity. The flushes arrive; a proxy with another identity is refused.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.protobuf.any_pb2 import Any as AnyProto

from sitsmesh.dev import envoyconf, harness
from tests.istiofilters import istio_docs, kube_docs
from tests.security import tlsnode
from tests.security.pki import Ca, Pair, make_ca
from tests.unit.test_istio_stats_sink import sink_patch, sitsmesh_identity, stage_bootstrap

pytestmark = pytest.mark.integration

STAGE_ID = "spiffe://cluster.local/ns/inference/sa/stage"
PIPELINE = """name: demo
models: ["bert"]
stages:
  - name: model
    match: {upstream_cluster: upstream}
"""


class Sds(sds_pb2_grpc.SecretDiscoveryServiceServicer):  # type: ignore[misc]
    """State-of-the-world SDS: each request naming secrets not yet sent on its stream
    gets all it names; acknowledgements get nothing."""

    def __init__(self, secrets: dict[str, secret_pb2.Secret]) -> None:
        self._secrets = secrets
        self.asked: set[str] = set()
        self._lock = threading.Lock()

    def StreamSecrets(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        sent: set[str] = set()
        for n, request in enumerate(requests):
            names = set(request.resource_names)
            with self._lock:
                self.asked |= names
            if names <= sent:
                continue
            sent |= names
            resources = []
            for name in sorted(names & self._secrets.keys()):
                packed = AnyProto()
                packed.Pack(self._secrets[name])
                resources.append(packed)
            yield discovery_pb2.DiscoveryResponse(version_info="1", nonce=str(n),
                                                  type_url=request.type_url,
                                                  resources=resources)


def _source(path: Path) -> base_pb2.DataSource:
    return base_pb2.DataSource(inline_bytes=path.read_bytes())


def istio_secrets(ca: Ca, pair: Pair) -> dict[str, secret_pb2.Secret]:
    """What pilot-agent serves a sidecar: its workload certificate and the mesh root."""
    return {"default": secret_pb2.Secret(name="default", tls_certificate=common_pb2.TlsCertificate(
                certificate_chain=_source(pair.cert), private_key=_source(pair.key))),
            "ROOTCA": secret_pb2.Secret(name="ROOTCA", validation_context=(
                common_pb2.CertificateValidationContext(trusted_ca=_source(ca.cert))))}


@contextlib.contextmanager
def sds_server(socket: Path, secrets: dict[str, secret_pb2.Secret]) -> Iterator[Sds]:
    servicer = Sds(secrets)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sds_pb2_grpc.add_SecretDiscoveryServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    try:
        yield servicer
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Ca:
    return make_ca(tmp_path_factory.mktemp("pki"), "mesh-root")


@pytest.fixture
def procs() -> Iterator[list[harness.Proc]]:
    started: list[harness.Proc] = []
    yield started
    for proc in started:
        proc.kill()


def _stage_proxy(work: Path, node: harness.Sitsmesh, upstream: int) -> harness.Envoy:
    """A stage's sidecar: its bootstrap with the EnvoyFilter's patch, the sink's cluster
    pointed at this sitsmesh instead of the Service name (the rest unchanged)."""
    listen, admin = harness.free_port(), harness.free_port()
    config = stage_bootstrap(sink_patch(istio_docs()), upstream, listen, admin,
                             str(work / "sds.sock"))
    [cluster] = [c for c in config["static_resources"]["clusters"]
                 if c["name"] == "sitsmesh_stats"]
    host, _, port = node.data_addr.rpartition(":")
    [group] = cluster["load_assignment"]["endpoints"]
    group["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] = {
        "address": host, "port_value": int(port)}
    path = envoyconf.write(config, work / "envoy.yaml")
    return harness.launch_envoy(path, listen, admin, work / "envoy.log")


def _call_the_stage(proxy: harness.Envoy) -> None:
    """One request through the proxy to its upstream: Envoy sends only stats it used."""
    with urllib.request.urlopen(proxy.url("/v2/models/bert/infer"), timeout=5) as reply:
        assert reply.status == 200


def _flushes(node: harness.Sitsmesh) -> float:
    return harness.metric_value(node.metrics(), "sitsmesh_envoy_stats_flushes_total")


def _refused(node: harness.Sitsmesh) -> float:
    return harness.metric_value(node.metrics(), "sitsmesh_data_calls_refused_total",
                                service="metrics")


def test_the_stats_sink_reaches_sitsmesh_over_mesh_mtls(tmp_path: Path, ca: Ca,
                                                        procs: list[harness.Proc]) -> None:
    identity = sitsmesh_identity(kube_docs())
    server = ca.issue("sitsmesh", "IP:127.0.0.1", f"URI:{identity}")
    stage = ca.issue("stage", f"URI:{STAGE_ID}")
    intruder = ca.issue("intruder", "URI:spiffe://cluster.local/ns/apps/sa/intruder")
    # Stands in for sitsmesh's sidecar under STRICT and the ALLOW policy: mTLS only, the
    # metrics service only for the stage's identity.
    node = tlsnode.start(
        tmp_path, "--data-tls-cert-file", str(server.cert), "--data-tls-key-file",
        str(server.key), "--data-tls-client-ca-file", str(ca.cert),
        "--data-callers", f"metrics={STAGE_ID}", data=(ca.cert, stage))
    procs.append(node)
    (tmp_path / "demo.yaml").write_text(PIPELINE)
    done = node.cli("pipelines", "apply", str(tmp_path / "demo.yaml"))
    assert done.returncode == 0, done.stderr
    assert tlsnode.health(node.data_addr) is None, "plaintext, as the old sink sent, is refused"

    with harness.echo_upstream() as upstream:
        work = tmp_path / "stage"
        work.mkdir()
        with sds_server(work / "sds.sock", istio_secrets(ca, stage)) as sds:
            proxy = _stage_proxy(work, node, upstream)
            procs.append(proxy)
            _call_the_stage(proxy)
            harness.wait_until(lambda: _flushes(node) >= 2, 20,
                               "the stage proxy's stats to reach sitsmesh over mTLS")
            assert sds.asked == {"default", "ROOTCA"}
            assert _refused(node) == 0
            proxy.kill()

        # Another workload's identity from the same mesh CA: taken by TLS, refused by
        # the caller list, as the ALLOW policy would refuse it.
        other = tmp_path / "other"
        other.mkdir()
        with sds_server(other / "sds.sock", istio_secrets(ca, intruder)):
            proxy = _stage_proxy(other, node, upstream)
            procs.append(proxy)
            _call_the_stage(proxy)
            harness.wait_until(lambda: _refused(node) >= 1, 20,
                               "the other identity's stats to be refused")
