"""Shared by the tests of deploy/istio's EnvoyFilters: the manifests, a bootstrap laid out
as Istio's would be around a patched filter, Envoy's own validation, and breaking a
document at a dotted path to show a check can fail."""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from sitsmesh.dev import envoyconf, harness

DEPLOY = harness.REPO / "deploy"
AUTHZ = "envoy.filters.http.ext_authz"
HCM = "envoy.filters.network.http_connection_manager"
DELETE = object()

Doc = dict[str, Any]


def docs(path: Path) -> list[Doc]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def kube_docs() -> list[Doc]:
    return [d for p in sorted((DEPLOY / "kubernetes").glob("*.yaml")) for d in docs(p)]


def istio_docs() -> list[Doc]:
    return [d for p in sorted((DEPLOY / "istio").glob("*.yaml")) for d in docs(p)]


def one(found_in: Sequence[Doc], kind: str) -> Doc:
    found = [d for d in found_in if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def sitsmesh_cluster(kube_docs: Sequence[Doc], port: int | None = None) -> str:
    """Istio's outbound cluster for the sitsmesh Service's grpc-data port (or `port`)."""
    service = one(kube_docs, "Service")
    namespace = one(kube_docs, "Kustomization").get("namespace") or "default"
    host = f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    data_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc-data"]
    return f"outbound|{port or data_port}||{host}"


def entry_policy(istio_docs: Sequence[Doc], envoy_filter: Doc) -> Doc:
    """The CUSTOM ext_authz policy on the EnvoyFilter's workload, which must cover every
    request: one it skips keeps the x-sits-* headers its client sent."""
    labels = envoy_filter["spec"]["workloadSelector"]["labels"]
    assert labels, "select the entry workload; no namespace-wide filter"
    policies = [d for d in istio_docs if d["kind"] == "AuthorizationPolicy"
                and d["spec"].get("action") == "CUSTOM"
                and d["metadata"]["namespace"] == envoy_filter["metadata"]["namespace"]
                and d["spec"].get("selector", {}).get("matchLabels") == labels]
    assert len(policies) == 1, "a CUSTOM ext_authz policy with the same workload selector"
    assert policies[0]["spec"].get("rules") == [{}], \
        "requests the policy skips keep client-sent x-sits-* headers"
    return policies[0]


def istio_like_bootstrap(patch_value: Doc, cluster_name: str) -> Doc:
    """The local bootstrap with ext_authz, the patch inserted after it as Istio's
    INSERT_AFTER would, and a copy of the sitsmesh cluster under Istio's name."""
    values = harness.envoy_values("127.0.0.1:50051", 18080, 10000, 9901)
    config = envoyconf.render(harness.REPO / "filters" / "local" / "bootstrap.yaml", values,
                              ["ext_authz"])
    filters = envoyconf.http_connection_manager(config)["http_filters"]
    at = [f["name"] for f in filters].index(AUTHZ) + 1
    filters.insert(at, copy.deepcopy(patch_value))
    [cluster] = [c for c in config["static_resources"]["clusters"]
                 if c["name"] == "sitsmesh_data"]
    istio_cluster = copy.deepcopy(cluster)
    istio_cluster["name"] = cluster_name
    istio_cluster["load_assignment"]["cluster_name"] = cluster_name
    config["static_resources"]["clusters"].append(istio_cluster)
    return config


def validate(config: Doc, out: Path) -> subprocess.CompletedProcess[str]:
    envoyconf.write(config, out)
    return subprocess.run([harness.ENVOY, "--mode", "validate", "-c", str(out),
                           "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60, check=False)


def break_at(doc: Doc, path: str, value: object) -> None:
    """Set `path` (dotted; digits index lists) in doc to value, or remove it if DELETE."""
    node: Any = doc
    *parents, last = path.split(".")
    for step in parents:
        node = node[int(step)] if isinstance(node, list) else node[step]
    key: int | str = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
