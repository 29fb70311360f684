"""deploy/observability's ServiceMonitor and PodMonitor reach sitsmesh's /metrics.

Their schemas (tests/unit/monitoring_crds.py) are checked with every other manifest in
test_deploy_validation.py; this checks what a schema cannot: the ServiceMonitor selects
the sitsmesh Service in its namespace and names a port the Service has, which leads to
the container port sitsmesh serves /metrics on; the PodMonitor selects the Deployment's
pods and names a container port. Broken copies show each check can fail.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from tests.unit.monitoring_crds import MONITORING_SCHEMAS

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OBS = ROOT / "deploy" / "observability"
METRICS_PATH = "/metrics"

Doc = dict[str, Any]


def _one(directory: Path, kind: str) -> Doc:
    found = [d for p in sorted(directory.glob("*.yaml"))
             for d in yaml.safe_load_all(p.read_text()) if d and d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in {directory}, found {len(found)}"
    doc: Doc = found[0]
    return doc


def _metrics_port() -> int:
    """The port sitsmesh serves /metrics on, from the Deployment's SITSMESH_METRICS_ADDR."""
    [container] = _one(KUBE, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    return int(env["SITSMESH_METRICS_ADDR"].rsplit(":", 1)[1])


def _matches(selector: Doc, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels is checked here"
    wanted: dict[str, str] = selector.get("matchLabels", {})
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def check_service_monitor(monitor: Doc, service: Doc, deployment: Doc) -> None:
    spec = monitor["spec"]
    assert _matches(spec["selector"], service["metadata"].get("labels", {})), \
        "the selector does not match the Service's labels"
    namespaces = spec.get("namespaceSelector", {}).get("matchNames",
                                                       [monitor["metadata"]["namespace"]])
    assert service["metadata"]["namespace"] in namespaces, "the Service's namespace is not watched"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert spec["endpoints"], "no endpoint"
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in ports, f"the Service has no port {endpoint['port']}"
        target = ports[endpoint["port"]]["targetPort"]
        target = container_ports[target] if isinstance(target, str) else target
        assert target == _metrics_port(), "the port does not lead to sitsmesh's metrics"
        assert endpoint.get("path", METRICS_PATH) == METRICS_PATH


def check_pod_monitor(monitor: Doc, deployment: Doc) -> None:
    spec = monitor["spec"]
    template = deployment["spec"]["template"]
    assert _matches(spec["selector"], template["metadata"]["labels"]), \
        "the selector does not match the pods' labels"
    namespaces = spec.get("namespaceSelector", {}).get("matchNames",
                                                       [monitor["metadata"]["namespace"]])
    assert deployment["metadata"]["namespace"] in namespaces, "the pods' namespace is not watched"
    [container] = template["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert spec["podMetricsEndpoints"], "no endpoint"
    for endpoint in spec["podMetricsEndpoints"]:
        assert container_ports.get(endpoint["port"]) == _metrics_port(), \
            f"container port {endpoint['port']} is not sitsmesh's metrics port"
        assert endpoint.get("path", METRICS_PATH) == METRICS_PATH


def _docs() -> tuple[Doc, Doc, Doc, Doc]:
    return (_one(OBS, "ServiceMonitor"), _one(OBS, "PodMonitor"), _one(KUBE, "Service"),
            _one(KUBE, "Deployment"))


def test_service_monitor_scrapes_the_service_metrics_port() -> None:
    monitor, _, service, deployment = _docs()
    check_service_monitor(monitor, service, deployment)


def test_pod_monitor_scrapes_the_pods_metrics_port() -> None:
    _, monitor, _, deployment = _docs()
    check_pod_monitor(monitor, deployment)


def test_monitors_and_rule_live_in_sitsmesh_namespace() -> None:
    namespace = _one(KUBE, "Service")["metadata"]["namespace"]
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert _one(OBS, kind)["metadata"]["namespace"] == namespace, kind


@pytest.mark.parametrize(("which", "path", "value"), [
    ("service", "spec.selector.matchLabels", {"app": "sitsmesh"}),
    ("service", "spec.selector.matchLabels", {}),
    ("service", "spec.namespaceSelector.matchNames", ["default"]),
    ("service", "spec.endpoints.0.port", "metrics"),
    ("service", "spec.endpoints.0.port", "grpc-data"),
    ("service", "spec.endpoints.0.path", "/stats"),
    ("pod", "spec.selector.matchLabels", {"app.kubernetes.io/name": "envoy"}),
    ("pod", "spec.podMetricsEndpoints.0.port", "grpc-admin"),
    ("pod", "spec.podMetricsEndpoints.0.path", "/metric"),
])
def test_the_checks_reject_a_monitor_that_misses(which: str, path: str, value: object) -> None:
    service_monitor, pod_monitor, service, deployment = copy.deepcopy(_docs())
    doc = service_monitor if which == "service" else pod_monitor
    node: Any = doc
    *parents, last = path.split(".")
    for step in parents:
        node = node[int(step)] if isinstance(node, list) else node[step]
    node[last] = value
    with pytest.raises((AssertionError, KeyError)):
        if which == "service":
            check_service_monitor(doc, service, deployment)
        else:
            check_pod_monitor(doc, deployment)


@pytest.mark.parametrize(("kind", "path", "value"), [
    ("ServiceMonitor", "spec.endpoints.0.interval", "15 s"),
    ("ServiceMonitor", "spec.endpoints.0.scheme", "grpc"),
    ("ServiceMonitor", "spec.endpoint", []),
    ("PodMonitor", "spec.podMetricsEndpoints", []),
    ("PrometheusRule", "spec.groups.0.rules.0.for", "2 minutes"),
    ("PrometheusRule", "spec.groups.0.rules.0.severity", "critical"),
    ("PrometheusRule", "spec.groups.0.rules.0.record", "x"),
])
def test_the_schemas_reject_a_broken_object(kind: str, path: str, value: object) -> None:
    doc = copy.deepcopy(_one(OBS, kind))
    schema = MONITORING_SCHEMAS["monitoring.coreos.com/v1", kind]
    jsonschema.Draft202012Validator(schema).validate(doc)
    node: Any = doc
    *parents, last = path.split(".")
    for step in parents:
        node = node[int(step)] if isinstance(node, list) else node[step]
    node[int(last) if isinstance(node, list) else last] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(doc)
