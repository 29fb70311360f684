"""deploy/istio/stats-sink.yaml under STRICT mTLS (issue 26, item 7): the stats sink
dialled sitsmesh in plaintext (Google gRPC by name), which STRICT refuses. It now goes
through a static cluster that speaks TLS with the sidecar's workload certificate and
root CA from Istio's SDS (`sds-grpc`, secrets `default` and `ROOTCA`) and accepts only
sitsmesh's SPIFFE id. Checked here as data, and with the real Envoy (`--mode validate`)
in a bootstrap laid out as Istio's; tests/security/test_stats_sink_mtls.py runs it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from sitsmesh.dev import envoyconf, harness
from tests.istiofilters import DELETE, Doc, break_at, istio_docs, kube_docs, one, validate

SDS_CLUSTER = "sds-grpc"
# Where Istio's bootstrap has its SDS server (pilot-agent's, or SPIRE's).
SDS_SOCKET = "./var/run/secrets/workload-spiffe-uds/socket"
TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


def sink_patch(istio: Sequence[Doc]) -> Doc:
    """The BOOTSTRAP patch value that adds the metrics_service stats sink."""
    values: list[Doc] = [p["patch"]["value"] for d in istio if d["kind"] == "EnvoyFilter"
                         for p in d["spec"]["configPatches"]
                         if p["applyTo"] == "BOOTSTRAP" and "stats_sinks" in p["patch"]["value"]]
    [value] = values
    return value


def sitsmesh_identity(kube: Sequence[Doc]) -> str:
    """sitsmesh's SPIFFE id in the default trust domain: its namespace and account."""
    namespace = one(kube, "Kustomization").get("namespace") or "default"
    account = one(kube, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    return f"spiffe://cluster.local/ns/{namespace}/sa/{account}"


def _from_istio_sds(config: Doc, secret: str) -> None:
    assert config["name"] == secret, f"Istio's SDS serves {secret!r}"
    source = config["sds_config"]["api_config_source"]
    assert source["api_type"] == "GRPC"
    assert source["grpc_services"] == [{"envoy_grpc": {"cluster_name": SDS_CLUSTER}}]


def check_sink_tls(kube: Sequence[Doc], istio: Sequence[Doc]) -> None:
    """The sink reaches sitsmesh through one static cluster that speaks mesh mTLS: the
    workload certificate and root CA from Istio's SDS, sitsmesh's identity required."""
    value = sink_patch(istio)
    [sink] = value["stats_sinks"]
    grpc_service = sink["typed_config"]["grpc_service"]
    assert "google_grpc" not in grpc_service, "Google gRPC by name dials in plaintext"
    name = grpc_service["envoy_grpc"]["cluster_name"]
    clusters = [c for c in value.get("static_resources", {}).get("clusters", [])
                if c["name"] == name]
    assert len(clusters) == 1, "the sink's cluster is static (sinks start before CDS)"
    [cluster] = clusters
    http = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in http["explicit_http_config"], "gRPC needs HTTP/2"
    socket = cluster.get("transport_socket")
    assert socket is not None and socket["typed_config"]["@type"] == TLS, "no TLS"
    common = socket["typed_config"]["common_tls_context"]
    assert "h2" in common["alpn_protocols"]
    [certificate] = common["tls_certificate_sds_secret_configs"]
    _from_istio_sds(certificate, "default")
    validation = common["combined_validation_context"]
    _from_istio_sds(validation["validation_context_sds_secret_config"], "ROOTCA")
    sans = validation["default_validation_context"]["match_typed_subject_alt_names"]
    assert sans == [{"san_type": "URI", "matcher": {"exact": sitsmesh_identity(kube)}}], \
        "only sitsmesh's identity is accepted"


def test_the_stats_sink_speaks_mesh_mtls() -> None:
    check_sink_tls(kube_docs(), istio_docs())


_V = "spec.configPatches.0.patch.value"
_C = f"{_V}.static_resources.clusters.0"
_T = f"{_C}.transport_socket.typed_config.common_tls_context"
SINK_BREAKS: list[tuple[str, object]] = [
    (f"{_C}.transport_socket", DELETE),
    (f"{_V}.stats_sinks.0.typed_config.grpc_service",
     {"google_grpc": {"target_uri": "sitsmesh.sitsmesh.svc.cluster.local:50051",
                      "stat_prefix": "sitsmesh_stats"}}),
    (f"{_V}.static_resources", DELETE),
    (f"{_T}.tls_certificate_sds_secret_configs.0.name", "workload"),
    (f"{_T}.tls_certificate_sds_secret_configs.0.sds_config.api_config_source."
     "grpc_services.0.envoy_grpc.cluster_name", "xds-grpc"),
    (f"{_T}.combined_validation_context.validation_context_sds_secret_config.name", "CA"),
    (f"{_T}.combined_validation_context.default_validation_context."
     "match_typed_subject_alt_names.0.matcher.exact",
     "spiffe://cluster.local/ns/inference/sa/default"),
    (f"{_T}.combined_validation_context.default_validation_context", DELETE),
    (f"{_T}.alpn_protocols", ["http/1.1"]),
    (f"{_C}.typed_extension_protocol_options", {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "explicit_http_config": {"http_protocol_options": {}}}}),
]


@pytest.mark.parametrize(("path", "value"), SINK_BREAKS,
                         ids=[".".join(p.split(".")[-2:]) for p, _ in SINK_BREAKS])
def test_the_check_rejects_a_sink_that_would_not_pass_strict(path: str, value: object
                                                             ) -> None:
    kube, istio = kube_docs(), istio_docs()
    envoy_filter = next(d for d in istio if d["kind"] == "EnvoyFilter"
                        and d["metadata"]["name"] == "sitsmesh-stats-sink")
    break_at(envoy_filter, path, value)
    with pytest.raises((AssertionError, KeyError)):
        check_sink_tls(kube, istio)


def merge(into: Doc, patch: Doc) -> None:
    """Istio's BOOTSTRAP MERGE (protobuf merge): messages merge field by field, repeated
    fields append, scalars replace."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key].extend(copy.deepcopy(value))
        else:
            into[key] = copy.deepcopy(value)


def sds_cluster(path: str = SDS_SOCKET) -> Doc:
    """Istio's bootstrap cluster for its SDS server, as the proxy has it."""
    return {"name": SDS_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                             "HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": SDS_CLUSTER, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": path}}}}]}]}}


def stage_bootstrap(value: Doc, upstream_port: int = 18080, listen_port: int = 10000,
                    admin_port: int = 9901, sds_socket: str = SDS_SOCKET) -> Doc:
    """A stage's sidecar bootstrap as Istio lays it out (a listener, an upstream, the
    SDS cluster, node id and cluster) with the EnvoyFilter's patch merged in."""
    values = harness.envoy_values("127.0.0.1:50051", upstream_port, listen_port, admin_port)
    config: Doc = envoyconf.render(harness.REPO / "filters" / "local" / "bootstrap.yaml",
                                   values, [])
    clusters: list[Any] = config["static_resources"]["clusters"]
    config["static_resources"]["clusters"] = [c for c in clusters
                                              if c["name"] != "sitsmesh_data"]
    config["static_resources"]["clusters"].append(sds_cluster(sds_socket))
    config["node"] = {"id": "sidecar~10.0.0.7~stage-0.inference~inference.svc.cluster.local",
                      "cluster": "stage.inference"}
    config["stats_flush_interval"] = "0.25s"  # the pod annotation's statsFlushInterval
    merge(config, value)
    return config


def test_the_patched_bootstrap_passes_the_real_envoy(tmp_path: Path) -> None:
    config = stage_bootstrap(sink_patch(istio_docs()))
    names = [c["name"] for c in config["static_resources"]["clusters"]]
    assert names == ["upstream", SDS_CLUSTER, "sitsmesh_stats"]
    result = validate(config, tmp_path / "stage.yaml")
    assert result.returncode == 0, result.stderr[-3000:]


def test_envoy_validation_reads_the_tls_context(tmp_path: Path) -> None:
    """The check above can fail: a bad field deep in the TLS context is refused."""
    value = copy.deepcopy(sink_patch(istio_docs()))
    common = value["static_resources"]["clusters"][0]["transport_socket"]["typed_config"][
        "common_tls_context"]
    common["tls_params"]["tls_maximum_protocol_version"] = "TLSv1_9"
    result = validate(stage_bootstrap(value), tmp_path / "broken.yaml")
    assert result.returncode != 0
    assert "TLSv1_9" in result.stderr + result.stdout


def test_envoy_refuses_a_sink_without_its_static_cluster(tmp_path: Path) -> None:
    """What the static cluster is for: a sink naming a cluster the bootstrap lacks (as
    one from CDS would be when sinks start) does not load."""
    value = copy.deepcopy(sink_patch(istio_docs()))
    del value["static_resources"]
    result = validate(stage_bootstrap(value), tmp_path / "no-cluster.yaml")
    assert result.returncode != 0
    assert "Unknown gRPC client cluster 'sitsmesh_stats'" in result.stderr
