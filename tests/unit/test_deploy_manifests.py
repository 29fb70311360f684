"""deploy/ manifests parse, and the Deployment agrees with the Service and sitsmesh's defaults."""

from __future__ import annotations

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
    listed = set(_docs(kustomization)[0]["resources"])
    present = {p.name for p in kustomization.parent.glob("*.y*ml")} - {kustomization.name}
    assert listed == present


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


def test_single_replica_with_state_on_a_claim() -> None:
    deployment = _one("Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"

    state_dir = _env()["SITSMESH_STATE_DIR"]["value"]
    mounts = {m["mountPath"]: m["name"] for m in _container()["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    claim = volumes[mounts[state_dir]]["persistentVolumeClaim"]["claimName"]
    assert claim == _one("PersistentVolumeClaim")["metadata"]["name"]


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


def test_termination_grace_outlasts_drain_and_grace() -> None:
    env = _env()
    drain = float(env.get("SITSMESH_DRAIN_SECONDS", {}).get("value", DRAIN_DEFAULT))
    grace = float(env.get("SITSMESH_GRACE_SECONDS", {}).get("value", GRACE_DEFAULT))
    pod = _one("Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > drain + grace


def test_admin_token_comes_from_a_secret() -> None:
    token = _env()["SITSMESH_ADMIN_TOKEN"]
    assert "value" not in token
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]
    committed = [d for p in _yaml_files() for d in _docs(p) if d.get("kind") == "Secret"]
    assert not committed, "never commit the admin token Secret"
