"""Every kustomize overlay under deploy/ renders (`kubectl kustomize`, the kustomize built
into kubectl), each rendered object validates (core kinds against the Kubernetes schemas
of kubernetes-validate, istio.io kinds against Istio's own CRD schemas), and the names,
namespaces, ports and labels the objects use to reach each other agree after rendering.
Broken overlays written to tmp_path fail, so each check can fail.

Without kubectl the rendering tests skip (CI may not have it); the files themselves are
still checked one by one by test_deploy_validation.py and test_istio_crds.py."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from sitsmesh import config, redisclients
from tests.unit.test_deploy_validation import KUBERNETES_VERSION

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ISTIO_VALIDATOR = ROOT / "tests" / "istio" / "validate.mjs"
ISTIO_SCHEMAS = ROOT / "tests" / "istio" / "node_modules" / "@kubernetes-models" / "istio"
OVERLAYS = {"base": "kubernetes", "dev": "overlays/dev",
            "production-ha": "overlays/production-ha", "istio": "istio",
            "production-redis-cluster": "overlays/production-redis-cluster",
            "istio-rlqs": "overlays/istio-rlqs"}
# Values for the Secret-backed variables, so sitsmesh's own parser reads the rest.
SECRET_STANDINS = {"SITSMESH_STATE_URL": "postgresql://u:p@db:5432/sitsmesh",
                   "SITSMESH_REDIS_URL": "redis://redis:6379/0"}
NOT_SETTINGS = {"SITSMESH_ADMIN_TOKEN"}  # read by the admin token loader, not config
RATELIMIT = "envoy.filters.http.ratelimit"
QUOTA = "envoy.filters.http.rate_limit_quota"

Doc = dict[str, Any]


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("!!! kubectl NOT FOUND: deploy/'s kustomize overlays were NOT rendered "
                    "or checked; install kubectl (1.27+, built-in kustomize v5) to run them")
    return found


@functools.cache
def _rendered(directory: str) -> str:
    done = subprocess.run([_kubectl(), "kustomize", directory], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return done.stdout


def render(directory: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(_rendered(str(directory))) if d]


def pyproject_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


# --- validation of each rendered object ------------------------------------------------

def schema_problems(objects: Sequence[Doc], scratch: Path) -> list[str]:
    """'Kind/name: message' for every object its schema refuses."""
    problems, istio = [], []
    for doc in objects:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if ".istio.io/" in doc.get("apiVersion", ""):
            istio.append(doc)
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError,
                kubernetes_validate.SchemaNotFoundError) as e:
            problems.append(f"{where}: {e.message}")
    if istio:
        assert ISTIO_SCHEMAS.is_dir(), \
            "Istio's CRD schemas are missing: run `npm ci` in tests/istio (`make test` does)"
        objects_file = scratch / "istio-objects.json"
        objects_file.write_text(json.dumps(istio))
        done = subprocess.run(["node", str(ISTIO_VALIDATOR), str(objects_file)],
                              capture_output=True, text=True, timeout=60, check=False,
                              cwd=ISTIO_VALIDATOR.parent)
        assert not done.stderr, done.stderr
        lines = done.stdout.splitlines()
        assert len(lines) == len(istio), lines
        problems += [line for line in lines if not line.startswith("ok ")]
    return problems


# --- cross-references after rendering --------------------------------------------------

def _only(objects: Sequence[Doc], kind: str) -> Doc:
    found = [d for d in objects if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def _env(container: Doc) -> dict[str, str]:
    return {e["name"]: e.get("value", SECRET_STANDINS.get(e["name"], "set"))
            for e in container["env"]}


def _settings(deployment: Doc) -> config.Settings:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return config.load_settings(env=_env(container))


def check_sitsmesh(objects: Sequence[Doc]) -> None:
    """sitsmesh's own objects reach each other, name the release image, and its settings
    are ones sitsmesh accepts and that fit the replica count."""
    deployment, service = _only(objects, "Deployment"), _only(objects, "Service")
    namespace = deployment["metadata"]["namespace"]
    assert _only(objects, "Namespace")["metadata"]["name"] == namespace
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert _selects(deployment["spec"]["selector"]["matchLabels"], labels)
    assert service["metadata"]["namespace"] == namespace
    assert _selects(service["spec"]["selector"], labels), "the Service selects no pod"
    [container] = pod["spec"]["containers"]
    container_ports = {p["name"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in container_ports, f"targetPort {port['targetPort']}"
    account = _only(objects, "ServiceAccount")
    assert account["metadata"]["namespace"] == namespace
    assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
    for kind, path in (("PodDisruptionBudget", ("spec", "selector", "matchLabels")),
                       ("NetworkPolicy", ("spec", "podSelector", "matchLabels"))):
        for doc in (d for d in objects if d["kind"] == kind):
            selector: Any = doc
            for step in path:
                selector = selector[step]
            assert doc["metadata"]["namespace"] == namespace, kind
            assert _selects(selector, labels), f"the {kind} selects no sitsmesh pod"

    name, _, tag = container["image"].partition("@")[0].rpartition(":")
    assert name.rsplit("/", 1)[-1] == "sitsmesh" and tag == pyproject_version(), \
        f"image {container['image']}: the release is {pyproject_version()} (pyproject.toml)"

    env = _env(container)
    unknown = {n for n in env if n.startswith("SITSMESH_")} - NOT_SETTINGS - {
        config.env_name(key) for key in config.PARSERS}
    assert not unknown, f"not sitsmesh settings: {sorted(unknown)}"
    settings = config.load_settings(env=env)
    for addr in (a for a in (settings.data_addr, settings.admin_addr, settings.rlqs_addr)
                 if a is not None):
        assert str(addr.port) in {str(p["containerPort"]) for p in container["ports"]}, \
            f"{addr}: no container port"
    replicas = deployment["spec"].get("replicas", 1)
    assert settings.store_replicas == replicas, \
        f"SITSMESH_STORE_REPLICAS {settings.store_replicas}, replicas {replicas}"
    if replicas > 1:  # each replica would keep its own keys, counts and pressure
        assert settings.state_url and settings.ratelimit_store == "redis" \
            and settings.shared_runtime == "redis", "several replicas need shared state"


def _mesh_providers() -> dict[str, Doc]:
    """The extensionProviders deploy/istio's README has the mesh register."""
    [operator] = yaml.safe_load_all((DEPLOY / "istio" / "extension-provider.yaml").read_text())
    return {p["name"]: p for p in operator["spec"]["meshConfig"]["extensionProviders"]}


def check_istio(objects: Sequence[Doc], providers: dict[str, Doc]) -> None:
    """The Istio objects and the mesh's providers point at the rendered sitsmesh Service's
    data port and pods, and the entry workload's filters sit where its ext_authz is."""
    deployment, service = _only(objects, "Deployment"), _only(objects, "Service")
    namespace = service["metadata"]["namespace"]
    host = f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    service_ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    port = service_ports["grpc-data"]
    settings = _settings(deployment)
    # RLQS streams go to the RLQS process's port when it has one (rlqs_addr).
    quota_port = service_ports["grpc-rlqs"] if settings.rlqs_addr is not None else port
    if settings.rlqs_addr is not None:
        assert quota_port == settings.rlqs_addr.port, \
            f"grpc-rlqs {quota_port}, SITSMESH_RLQS_ADDR {settings.rlqs_addr}"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    container_ports = {str(p["containerPort"]) for c in
                       deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    istio = [d for d in objects if ".istio.io/" in d["apiVersion"]]

    for name, provider in providers.items():
        [target] = [value for key, value in provider.items() if key != "name"]
        assert target["service"].rpartition("/")[2] == host, \
            f"{name}: {target['service']}, the Service is {host}"
        assert target["port"] == port, f"{name}: port {target['port']}, data port {port}"
    [entry] = [d for d in istio if d["kind"] == "AuthorizationPolicy"
               and d["spec"]["action"] == "CUSTOM"]
    assert "envoyExtAuthzGrpc" in providers.get(entry["spec"]["provider"]["name"], {}), \
        f"no ext_authz provider {entry['spec']['provider']['name']}"
    entry_ns = entry["metadata"]["namespace"]
    entry_labels = entry["spec"]["selector"]["matchLabels"]
    assert entry_ns != namespace or not _selects(entry_labels, labels), "ext_authz on sitsmesh"
    for telemetry in (d for d in istio if d["kind"] == "Telemetry"):
        assert telemetry["metadata"]["namespace"] == entry_ns, "logs of another namespace"
        for log in telemetry["spec"]["accessLogging"]:
            for p in log["providers"]:
                assert "envoyHttpAls" in providers.get(p["name"], {}), f"no ALS {p['name']}"

    for text in _strings(istio):
        for found in re.findall(rf"\b{service['metadata']['name']}\.[a-z0-9-]+\.svc\.cluster"
                                r"\.local(?::\d+)?", text):
            assert found in (host, f"{host}:{port}"), f"{found}: the Service is {host}:{port}"
        if text.startswith("outbound|"):
            assert text in {f"outbound|{p}||{host}" for p in (port, quota_port)}, \
                f"{text}: no such cluster"
    filters = [d for d in istio if d["kind"] == "EnvoyFilter"]
    added = {p["patch"]["value"].get("name"): d for d in filters for p in d["spec"]["configPatches"]
             if p["patch"]["operation"] == "INSERT_AFTER"}
    assert (RATELIMIT in added) != (QUOTA in added), "one of rate-limit(-quota).yaml"
    if QUOTA in added:
        [server] = [p["patch"]["value"]["typed_config"]["rlqs_server"]
                    for p in added[QUOTA]["spec"]["configPatches"]
                    if p["patch"]["value"].get("name") == QUOTA]
        assert server["envoy_grpc"]["cluster_name"] == f"outbound|{quota_port}||{host}", \
            f"the quota filter streams to {server}, sitsmesh serves RLQS on {quota_port}"
        assert settings.admission == "rlqs", "the quota filter and Check would both shed"
    for doc in added.values():
        assert doc["metadata"]["namespace"] == entry_ns, "the filter misses the entry workload"
        assert doc["spec"]["workloadSelector"]["labels"] == entry_labels, \
            "the filter lands on a workload without ext_authz"
    for patch in (p for d in filters for p in d["spec"]["configPatches"]
                  if p["applyTo"] == "CLUSTER"):
        assert patch["match"]["cluster"]["service"] == host
        assert patch["match"]["cluster"]["portNumber"] in (port, quota_port)
    rule = _only(istio, "DestinationRule")
    assert rule["spec"]["host"] == host

    for doc in istio:
        if doc["kind"] == "PeerAuthentication" or doc["spec"].get("action") == "ALLOW":
            assert doc["metadata"]["namespace"] == namespace, doc["metadata"]["name"]
            assert _selects(doc["spec"]["selector"]["matchLabels"], labels), \
                f"{doc['metadata']['name']} selects no sitsmesh pod"
            ports = set(doc["spec"].get("portLevelMtls", {})) | {
                p for r in doc["spec"].get("rules", []) for t in r.get("to", [])
                for p in t["operation"].get("ports", [])}
            assert ports <= container_ports, f"{doc['metadata']['name']}: ports {ports}"


def check(directory: Path, scratch: Path) -> list[Doc]:
    objects = render(directory)
    problems = schema_problems(objects, scratch)
    assert not problems, "\n".join(problems)
    check_sitsmesh(objects)
    if any(".istio.io/" in d["apiVersion"] for d in objects):
        check_istio(objects, _mesh_providers())
    return objects


# --- the overlays as shipped ----------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_validates_and_its_references_agree(overlay: str,
                                                            tmp_path: Path) -> None:
    check(DEPLOY / OVERLAYS[overlay], tmp_path)


def test_each_overlay_is_what_it_says(tmp_path: Path) -> None:
    def settings(objects: Sequence[Doc]) -> tuple[int, Any]:
        deployment = _only(objects, "Deployment")
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value", SECRET_STANDINS.get(e["name"], "set"))
               for e in container["env"]}
        return deployment["spec"]["replicas"], config.load_settings(env=env)

    dev = render(DEPLOY / OVERLAYS["dev"])
    replicas, s = settings(dev)
    assert (replicas, s.ratelimit_store, s.shared_runtime, s.state_url, s.log_level) == \
        (1, "memory", "off", "", "debug")
    assert not [d for d in dev if d["kind"] == "PodDisruptionBudget"]
    ha = render(DEPLOY / OVERLAYS["production-ha"])
    replicas, s = settings(ha)
    assert replicas >= 3 and s.ratelimit_store == s.shared_runtime == "redis" and s.state_url
    spec = _only(ha, "Deployment")["spec"]
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert spec["template"]["spec"]["topologySpreadConstraints"]
    assert _only(ha, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    secrets = {e["valueFrom"]["secretKeyRef"]["name"]
               for e in spec["template"]["spec"]["containers"][0]["env"] if "valueFrom" in e}
    assert secrets == {"sitsmesh-admin-token", "sitsmesh-state", "sitsmesh-redis"}
    cluster = render(DEPLOY / OVERLAYS["production-redis-cluster"])
    replicas, s = settings(cluster)
    assert replicas >= 3 and s.ratelimit_store == s.shared_runtime == "redis"
    target = redisclients.parse(s.redis_url)
    assert target.cluster and len(target.seeds) == 3 and target.url.startswith("rediss://")
    pod = _only(cluster, "Deployment")["spec"]["template"]["spec"]
    [mount] = [m for m in pod["containers"][0]["volumeMounts"]
               if str(s.redis_password_file).startswith(m["mountPath"] + "/")]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "sitsmesh-redis-cluster"
    assert volume["secret"]["defaultMode"] & 0o040, "the pod's fsGroup must read it"
    istio = render(DEPLOY / OVERLAYS["istio"])
    kinds = {d["kind"] for d in istio}
    assert {"AuthorizationPolicy", "Telemetry", "EnvoyFilter", "PeerAuthentication",
            "DestinationRule"} <= kinds
    added = {p["patch"]["value"].get("name") for d in istio if d["kind"] == "EnvoyFilter"
             for p in d["spec"]["configPatches"]}
    assert RATELIMIT in added
    assert any("stats_sinks" in p["patch"]["value"] for d in istio if d["kind"] == "EnvoyFilter"
               for p in d["spec"]["configPatches"])
    quota = render(DEPLOY / OVERLAYS["istio-rlqs"])
    _, s = settings(quota)
    assert s.admission == "rlqs" and s.rlqs_addr is not None and s.rlqs_addr.port == 50053
    patches = [p for d in quota if d["kind"] == "EnvoyFilter" for p in d["spec"]["configPatches"]]
    added = {p["patch"]["value"].get("name") for p in patches}
    assert QUOTA in added and RATELIMIT not in added
    assert {p["match"]["cluster"]["portNumber"] for p in patches
            if p["applyTo"] == "CLUSTER"} == {50051, 50053}, "health checks on both ports"
    callers = next(d for d in quota if d["kind"] == "AuthorizationPolicy"
                   and d["spec"].get("action") == "ALLOW")
    assert callers["spec"]["rules"][0]["to"][0]["operation"]["ports"] == ["50051", "50053"]
    ingress = _only(quota, "NetworkPolicy")["spec"]["ingress"][0]["ports"]
    assert [p["port"] for p in ingress] == [50051, 50053]


def test_the_image_tag_is_set_in_one_place() -> None:
    """deploy/kubernetes's `images:` names the release; every overlay inherits it."""
    setting = {}
    for path in sorted(DEPLOY.rglob("kustomization.yaml")):
        for image in yaml.safe_load(path.read_text()).get("images", []):
            if image["name"] == "sitsmesh":
                setting[str(path.relative_to(DEPLOY))] = image.get("newTag")
    assert setting == {"kubernetes/kustomization.yaml": pyproject_version()}


# --- broken overlays: each check can fail ---------------------------------------------

def _patch(kind: str, name: str, ops: list[Doc]) -> Doc:
    return {"target": {"kind": kind, "name": name}, "patch": yaml.safe_dump(ops)}


_CONTAINER = "/spec/template/spec/containers/0"
BROKEN = [
    ("kubernetes", {"patches": [_patch("Deployment", "sitsmesh", [
        {"op": "add", "path": f"{_CONTAINER}/imagePullPolicyy", "value": "Always"}])]},
     "Deployment/sitsmesh: Additional properties are not allowed"),
    ("istio", {"patches": [_patch("EnvoyFilter", "sitsmesh-stats-sink", [
        {"op": "replace", "path": "/spec/configPatches/0/applyTo", "value": "BOOTSTRAPP"}])]},
     "invalid EnvoyFilter sitsmesh-stats-sink: data/spec/configPatches/0/applyTo"),
    ("istio", {"namespace": "elsewhere"},
     "sitsmesh-ext-authz: sitsmesh.sitsmesh.svc.cluster.local, the Service is "
     "sitsmesh.elsewhere.svc.cluster.local"),
    ("istio", {"patches": [_patch("Service", "sitsmesh", [
        {"op": "replace", "path": "/spec/ports/0/port", "value": 50061}])]},
     "port 50051, data port 50061"),
    ("istio", {"patches": [_patch("Deployment", "sitsmesh", [
        {"op": "replace", "path": "/spec/template/metadata/labels",
         "value": {"app.kubernetes.io/name": "sitsmesh-v2"}},
        {"op": "replace", "path": "/spec/selector/matchLabels",
         "value": {"app.kubernetes.io/name": "sitsmesh-v2"}}])]},
     "the Service selects no pod"),
    ("istio", {"patches": [_patch("EnvoyFilter", "sitsmesh-rate-limit", [
        {"op": "replace", "path": "/spec/workloadSelector/labels", "value": {"app": "other"}}])]},
     "the filter lands on a workload without ext_authz"),
    ("overlays/istio-rlqs", {"patches": [_patch("EnvoyFilter", "sitsmesh-rate-limit-quota", [
        {"op": "replace", "path": "/spec/configPatches/0/patch/value/typed_config/rlqs_server/"
         "envoy_grpc/cluster_name",
         "value": "outbound|50051||sitsmesh.sitsmesh.svc.cluster.local"}])]},
     "sitsmesh serves RLQS on 50053"),
    ("overlays/istio-rlqs", {"patches": [_patch("Deployment", "sitsmesh", [
        {"op": "remove", "path": f"{_CONTAINER}/env/-1"}])]},
     "outbound|50053||sitsmesh.sitsmesh.svc.cluster.local: no such cluster"),
    ("overlays/istio-rlqs", {"patches": [_patch("Service", "sitsmesh", [
        {"op": "replace", "path": "/spec/ports/3/port", "value": 50054}])]},
     "grpc-rlqs 50054, SITSMESH_RLQS_ADDR 0.0.0.0:50053"),
    ("istio", {"patches": [_patch("AuthorizationPolicy", "sitsmesh-callers", [
        {"op": "replace", "path": "/spec/rules/0/to/0/operation/ports", "value": ["50061"]}])]},
     "sitsmesh-callers: ports"),
    ("overlays/dev", {"images": [{"name": "sitsmesh", "newTag": "9.9.9"}]},
     "image sitsmesh:9.9.9"),
    ("overlays/dev", {"replicas": [{"name": "sitsmesh", "count": 2}]},
     "SITSMESH_STORE_REPLICAS 1, replicas 2"),
    ("overlays/production-ha", {"patches": [_patch("Deployment", "sitsmesh", [
        {"op": "add", "path": f"{_CONTAINER}/env/-",
         "value": {"name": "SITSMESH_LOG_LEVL", "value": "debug"}}])]},
     "not sitsmesh settings: ['SITSMESH_LOG_LEVL']"),
    ("overlays/production-ha", {"patches": [_patch("Deployment", "sitsmesh", [
        {"op": "add", "path": f"{_CONTAINER}/env/-",
         "value": {"name": "SITSMESH_RATELIMIT_STORE", "value": "memory"}}])]},
     "several replicas need shared state"),
]


@pytest.mark.parametrize(("base", "change", "error"), BROKEN,
                         ids=[f"{b}:{e[:40]}" for b, _, e in BROKEN])
def test_a_broken_overlay_fails(base: str, change: Doc, error: str, tmp_path: Path) -> None:
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    overlay = tmp_path / "deploy" / "overlays" / "broken"
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"../../{base}"], **copy.deepcopy(change)}))
    with pytest.raises(AssertionError, match=re.escape(error)):
        check(overlay, tmp_path)


def test_listing_both_rate_limit_filters_fails(tmp_path: Path) -> None:
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    kustomization = tmp_path / "deploy" / "istio" / "kustomization.yaml"
    quota = (DEPLOY / "overlays" / "istio-rlqs" / "rate-limit-quota.yaml").read_text()
    (kustomization.parent / "rate-limit-quota.yaml").write_text(  # on the data port
        quota.replace("outbound|50053|", "outbound|50051|"))
    kustomization.write_text(kustomization.read_text() + "  - rate-limit-quota.yaml\n")
    with pytest.raises(AssertionError, match="one of rate-limit"):
        check(kustomization.parent, tmp_path)
