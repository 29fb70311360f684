"""deploy/ manifests parse, and the Deployment agrees with the Service and sitsmesh's defaults."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
PORTS = {"grpc-data": 50051, "grpc-admin": 50052, "http-metrics": 9464}
DRAIN_DEFAULT, GRACE_DEFAULT = 5.0, 10.0

Doc = dict[str, Any]


def _yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def _docs(path: Path) -> list[Doc]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _one(kind: str) -> Doc:
    found = [d for p in KUBE.glob("*.yaml") for d in _docs(p) if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in {KUBE}, found {len(found)}"
    return found[0]


def _container() -> Doc:
    containers: list[Doc] = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env() -> dict[str, Doc]:
    return {e["name"]: e for e in _container()["env"]}


def test_deploy_has_manifests() -> None:
    assert (KUBE / "kustomization.yaml").is_file()
    assert _yaml_files()


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_document_names_its_kind(path: Path) -> None:
    docs = _docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict), path
        assert doc.get("apiVersion"), path
        assert doc.get("kind"), path
        if doc["kind"] != "Kustomization":  # kustomize's own file needs no name
            assert doc.get("metadata", {}).get("name"), path


@pytest.mark.parametrize("kustomization", sorted(DEPLOY.rglob("kustomization.yaml")),
                         ids=lambda p: str(p.parent.relative_to(DEPLOY)))
def test_kustomization_lists_every_manifest_beside_it(kustomization: Path) -> None:
    resources = _docs(kustomization)[0]["resources"]
    listed = {r for r in resources if not r.startswith("../")}
    present = {p.name for p in kustomization.parent.glob("*.y*ml")} - {kustomization.name}
    left_out = NOT_RESOURCES.get(str(kustomization.parent.relative_to(DEPLOY)), set())
    assert listed == present - left_out
    assert all((kustomization.parent / r).is_dir() for r in resources if r.startswith("../"))


# Beside deploy/istio's kustomization.yaml but not applied by it (its header says why):
# mesh config for the Istio install, token streams (copied by ext_proc or timed in
# Envoy), applied only where responses stream, and per-message checks, applied where
# gRPC streams enter (each needs its port or workload edited).
NOT_RESOURCES = {"istio": {"extension-provider.yaml", "ext-proc.yaml", "token-timing.yaml",
                           "grpc-stream-check.yaml"}}


def test_service_ports_match_container_ports_and_defaults() -> None:
    service = _one("Service")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert {n: p["port"] for n, p in service_ports.items()} == PORTS
    assert all(p["targetPort"] in (p["name"], p["port"]) for p in service_ports.values())

    container_ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    assert container_ports == PORTS

    template_labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= template_labels.items()


def test_listen_addresses_match_ports() -> None:
    env = _env()
    assert env["SITSMESH_DATA_ADDR"]["value"] == f"0.0.0.0:{PORTS['grpc-data']}"
    assert env["SITSMESH_ADMIN_ADDR"]["value"] == f"0.0.0.0:{PORTS['grpc-admin']}"
    assert env["SITSMESH_METRICS_ADDR"]["value"] == f"0.0.0.0:{PORTS['http-metrics']}"


def test_probes_use_native_grpc_on_the_data_port() -> None:
    probes = {k: v for k, v in _container().items() if k.endswith("Probe")}
    assert {"readinessProbe", "livenessProbe"} <= probes.keys()
    for name, probe in probes.items():
        assert probe["grpc"]["port"] == PORTS["grpc-data"], name



def test_runs_locked_down() -> None:
    pod = _one("Deployment")["spec"]["template"]["spec"]
    container = _container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    assert {"cpu", "memory"} <= container["resources"]["limits"].keys()


def test_admin_token_comes_from_a_secret() -> None:
    token = _env()["SITSMESH_ADMIN_TOKEN"]
    assert "value" not in token
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]
    committed = [d for p in _yaml_files() for d in _docs(p) if d.get("kind") == "Secret"]
    assert not committed, "never commit the admin token Secret"


# --- zero-downtime operation (issue 15) ----------------------------------------------
# Each check takes the kube documents, so the tests at the end can break copies of them.

SUPERVISOR_MARGIN = 5.0  # with workers, the supervisor waits drain + grace + 5 for them


def _kube() -> list[Doc]:
    return [d for p in sorted(KUBE.glob("*.yaml")) for d in _docs(p)]


def _of(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _pod(docs: list[Doc]) -> Doc:
    pod: Doc = _of(docs, "Deployment")["spec"]["template"]["spec"]
    return pod


def _env_of(docs: list[Doc]) -> dict[str, Doc]:
    return {e["name"]: e for e in _pod(docs)["containers"][0]["env"]}


def _env_seconds(docs: list[Doc], name: str, default: float) -> float:
    return float(_env_of(docs).get(name, {}).get("value", default))


def _pod_labels(docs: list[Doc]) -> dict[str, str]:
    labels: dict[str, str] = _of(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    return labels


def check_rollout(docs: list[Doc]) -> None:
    """Three or more replicas, replaced one at a time by a Ready pod first."""
    spec = _of(docs, "Deployment")["spec"]
    assert spec["replicas"] >= 3
    assert spec["strategy"]["type"] == "RollingUpdate"
    rolling = spec["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0, "a rollout must never go below the replica count"
    assert rolling["maxSurge"] == 1


def check_disruption_budget(docs: list[Doc]) -> None:
    """A PDB selects exactly sitsmesh's pods and lets drains through one pod at a time."""
    replicas = _of(docs, "Deployment")["spec"]["replicas"]
    pdb = _of(docs, "PodDisruptionBudget")["spec"]
    selector = pdb["selector"]["matchLabels"]
    assert selector and selector.items() <= _pod_labels(docs).items()
    assert selector == _of(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    if "maxUnavailable" in pdb:
        assert pdb["maxUnavailable"] == 1
    else:
        assert 2 <= pdb["minAvailable"] < replicas, "at least two up, and drains not blocked"


def check_probes(docs: list[Doc]) -> None:
    """Readiness and liveness are gRPC health on the data port, overall status (service
    ""), which goes NOT_SERVING during the drain; liveness tolerates a whole drain."""
    container = _pod(docs)["containers"][0]
    drain = _env_seconds(docs, "SITSMESH_DRAIN_SECONDS", DRAIN_DEFAULT)
    grace = _env_seconds(docs, "SITSMESH_GRACE_SECONDS", GRACE_DEFAULT)
    for name in ("readinessProbe", "livenessProbe"):
        probe = container[name]
        assert probe["grpc"]["port"] == PORTS["grpc-data"], name
        assert probe["grpc"].get("service", "") == "", f"{name}: overall health"
    live = container["livenessProbe"]
    assert live.get("periodSeconds", 10) * live.get("failureThreshold", 3) > drain + grace


def check_shutdown(docs: list[Doc]) -> None:
    """preStop sleeps drain_seconds, and the pod's grace period (which counts from the
    preStop) outlasts preStop + drain + grace + the supervisor's margin."""
    pod = _pod(docs)
    drain = _env_seconds(docs, "SITSMESH_DRAIN_SECONDS", DRAIN_DEFAULT)
    grace = _env_seconds(docs, "SITSMESH_GRACE_SECONDS", GRACE_DEFAULT)
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop == drain
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain + grace + SUPERVISOR_MARGIN
    annotations = _of(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    istio = yaml.safe_load(annotations["proxy.istio.io/config"])
    sidecar = float(str(istio["terminationDrainDuration"]).removesuffix("s"))
    assert sidecar >= pre_stop + drain + grace, "the sidecar would cut calls mid-drain"


def check_spread(docs: list[Doc]) -> None:
    """Replicas prefer different nodes."""
    terms = _pod(docs)["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    by_host = [t["podAffinityTerm"] for t in terms
               if t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"]
    assert by_host
    assert by_host[0]["labelSelector"]["matchLabels"].items() <= _pod_labels(docs).items()


def check_shared_state(docs: list[Doc]) -> None:
    """Every replica reads one admin state (PostgreSQL) and one rate-limit store (Redis),
    both URLs from Secrets; no per-pod volume holds state."""
    env = _env_of(docs)
    for name in ("SITSMESH_STATE_URL", "SITSMESH_REDIS_URL"):
        assert "value" not in env[name], f"{name} carries a password: use a Secret"
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] and ref["key"]
    assert env["SITSMESH_RATELIMIT_STORE"]["value"] == "redis"
    assert env["SITSMESH_SHARED_RUNTIME"]["value"] == "redis", "chains, holds, controller"
    replicas = _of(docs, "Deployment")["spec"]["replicas"]
    assert int(env["SITSMESH_STORE_REPLICAS"]["value"]) == replicas
    assert not [v for v in _pod(docs)["volumes"] if "persistentVolumeClaim" in v]
    assert not [d for d in docs if d.get("kind") == "PersistentVolumeClaim"]


ZERO_DOWNTIME_CHECKS = [check_rollout, check_disruption_budget, check_probes, check_shutdown,
                        check_spread, check_shared_state]


@pytest.mark.parametrize("check", ZERO_DOWNTIME_CHECKS, ids=lambda c: c.__name__)
def test_zero_downtime(check: Any) -> None:
    check(_kube())


_POD = "spec.template.spec"
_C = f"{_POD}.containers.0"
DELETE = object()
ZERO_DOWNTIME_BREAKS: list[tuple[str, str, object]] = [
    ("Deployment", "spec.replicas", 2),
    ("Deployment", "spec.strategy", {"type": "Recreate"}),
    ("Deployment", "spec.strategy.rollingUpdate.maxUnavailable", 1),
    ("Deployment", "spec.strategy.rollingUpdate.maxUnavailable", "25%"),
    ("PodDisruptionBudget", "spec.selector.matchLabels", {"app": "other"}),
    ("PodDisruptionBudget", "spec.maxUnavailable", 3),
    ("PodDisruptionBudget", "spec.maxUnavailable", DELETE),
    ("Deployment", f"{_C}.readinessProbe", {"tcpSocket": {"port": 50051}}),
    ("Deployment", f"{_C}.livenessProbe.grpc.port", 50052),
    ("Deployment", f"{_C}.readinessProbe.grpc.service", "sitsmesh.ratelimit.store"),
    ("Deployment", f"{_C}.livenessProbe.failureThreshold", 1),
    ("Deployment", f"{_C}.lifecycle", DELETE),
    ("Deployment", f"{_C}.lifecycle.preStop.sleep.seconds", 1),
    ("Deployment", f"{_POD}.terminationGracePeriodSeconds", 20),
    ("Deployment", "spec.template.metadata.annotations.proxy\\.istio\\.io/config",
     "terminationDrainDuration: 5s"),
    ("Deployment", f"{_POD}.affinity", DELETE),
    ("Deployment", f"{_C}.env", [{"name": "SITSMESH_STATE_URL", "value": "postgresql://x"}]),
    ("Deployment", f"{_POD}.volumes.0", {"name": "state", "persistentVolumeClaim": {
        "claimName": "sitsmesh-state"}}),
]


def _break(doc: Doc, path: str, value: object) -> None:
    """Set `path` (dotted, `\\.` for a dot in a key; digits index lists) to value, or
    remove it if DELETE."""
    steps = [s.replace("\0", ".") for s in path.replace("\\.", "\0").split(".")]
    node: Any = doc
    for step in steps[:-1]:
        node = node[int(step)] if isinstance(node, list) else node[step]
    key: int | str = int(steps[-1]) if isinstance(node, list) else steps[-1]
    if value is DELETE:
        del node[key]
    else:
        node[key] = value


@pytest.mark.parametrize(("kind", "path", "value"), ZERO_DOWNTIME_BREAKS,
                         ids=[f"{k}:{p}={'-' if v is DELETE else v}"
                              for k, p, v in ZERO_DOWNTIME_BREAKS])
def test_zero_downtime_checks_reject_a_broken_manifest(kind: str, path: str,
                                                       value: object) -> None:
    docs = copy.deepcopy(_kube())
    _break(_of(docs, kind), path, value)
    failed = 0
    for check in ZERO_DOWNTIME_CHECKS:
        try:
            check(docs)
        except (AssertionError, KeyError):
            failed += 1
    assert failed, f"no check noticed {path} = {value!r}"
