"""Every manifest under deploy/ validates, and the Istio ext_authz wiring reaches sitsmesh.

Core Kubernetes objects are checked against the Kubernetes OpenAPI schemas shipped by
kubernetes-validate, in strict mode (unknown fields fail). kubernetes-validate has no
schemas for Istio's CRDs or kustomize, so those get the schemas below, written the same
way: required fields, allowed keys only. Tests at the end break copies of the manifests
to show that every check can fail.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from tests.istiofilters import DELETE, break_at
from tests.unit.monitoring_crds import MONITORING_SCHEMAS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
ISTIO = DEPLOY / "istio"
KUBERNETES_VERSION = "1.30.0"  # oldest Kubernetes the manifests are meant for
DATA_PORT_NAME = "grpc-data"
MAX_CHECK_TIMEOUT_S = 1.0  # failOpen: false, so a slow sitsmesh holds every request
MIN_BODY_BYTES, MAX_BODY_BYTES = 4 << 10, 1 << 20  # 1 MiB: sitsmesh parses no more JSON

Doc = dict[str, Any]
Schema = dict[str, Any]

# --- schemas for the objects kubernetes-validate does not know ------------------------

STR: Schema = {"type": "string", "minLength": 1}
STRS: Schema = {"type": "array", "items": STR}
BOOL: Schema = {"type": "boolean"}
STR_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
PORT: Schema = {"type": "integer", "minimum": 1, "maximum": 65535}
DURATION: Schema = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]{1,9})?s$"}  # protobuf JSON


def _obj(properties: dict[str, Schema], required: Sequence[str] = ()) -> Schema:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


def _list(items: Schema, min_items: int = 0) -> Schema:
    return {"type": "array", "items": items, "minItems": min_items}


def _top(api_version: str, kind: str, spec: Schema, namespaced: bool = True) -> Schema:
    metadata = _obj({"name": STR, "namespace": STR, "labels": STR_MAP, "annotations": STR_MAP},
                    ["name", "namespace"] if namespaced else ["name"])
    return _obj({"apiVersion": {"const": api_version}, "kind": {"const": kind},
                 "metadata": metadata, "spec": spec},
                ["apiVersion", "kind", "metadata", "spec"])


# istio.mesh.v1alpha1 MeshConfig.ExtensionProvider, envoy_ext_authz_grpc only.
EXT_AUTHZ_GRPC = _obj({
    "service": STR,
    "port": PORT,
    "timeout": DURATION,
    "failOpen": BOOL,
    "statusOnError": {"type": "string", "pattern": "^[1-5][0-9][0-9]$"},
    "includeRequestBodyInCheck": _obj({
        "maxRequestBytes": {"type": "integer", "minimum": 1, "maximum": 2**32 - 1},
        "allowPartialMessage": BOOL,
        "packAsBytes": BOOL,
    }),
}, ["service", "port"])

# istio.mesh.v1alpha1 MeshConfig.ExtensionProvider, envoy_http_als (gRPC access logs, v3).
HTTP_ALS = _obj({
    "service": STR,
    "port": PORT,
    "logName": STR,
    "filterStateObjectsToLog": STRS,
    "additionalRequestHeadersToLog": STRS,
    "additionalResponseHeadersToLog": STRS,
    "additionalResponseTrailersToLog": STRS,
}, ["service", "port"])

ISTIO_OPERATOR = _top("install.istio.io/v1alpha1", "IstioOperator", _obj({
    "meshConfig": _obj({
        "extensionProviders": _list({"oneOf": [
            _obj({"name": STR, "envoyExtAuthzGrpc": EXT_AUTHZ_GRPC}, ["name", "envoyExtAuthzGrpc"]),
            _obj({"name": STR, "envoyHttpAls": HTTP_ALS}, ["name", "envoyHttpAls"]),
        ]}, min_items=1),
    }, ["extensionProviders"]),
}, ["meshConfig"]))

_SELECTOR = _obj({"matchLabels": STR_MAP}, ["matchLabels"])

# telemetry.istio.io/v1 Telemetry, access logging only.
TELEMETRY = _top("telemetry.istio.io/v1", "Telemetry", _obj({
    "selector": _SELECTOR,
    "accessLogging": _list(_obj({
        "providers": _list(_obj({"name": STR}, ["name"]), min_items=1),
        "disabled": BOOL,
        "match": _obj({"mode": {"enum": ["CLIENT_AND_SERVER", "CLIENT", "SERVER"]}}),
        "filter": _obj({"expression": STR}, ["expression"]),
    }, ["providers"]), min_items=1),
}, ["accessLogging"]))

# networking.istio.io/v1alpha3 EnvoyFilter; the patch value is Envoy's own config.
ENVOY_FILTER = _top("networking.istio.io/v1alpha3", "EnvoyFilter", _obj({
    "workloadSelector": _obj({"labels": STR_MAP}, ["labels"]),
    "priority": {"type": "integer"},
    "configPatches": _list(_obj({
        "applyTo": {"enum": ["BOOTSTRAP", "CLUSTER", "LISTENER", "HTTP_FILTER",
                             "NETWORK_FILTER", "ROUTE_CONFIGURATION", "VIRTUAL_HOST",
                             "HTTP_ROUTE", "EXTENSION_CONFIG", "FILTER_CHAIN",
                             "LISTENER_FILTER"]},
        "match": {"type": "object"},
        "patch": _obj({"operation": {"enum": ["MERGE", "ADD", "REMOVE", "INSERT_BEFORE",
                                              "INSERT_AFTER", "INSERT_FIRST", "REPLACE"]},
                       "value": {"type": "object"}}, ["operation"]),
    }, ["applyTo", "patch"]), min_items=1),
}, ["configPatches"]))

# networking.istio.io/v1 DestinationRule, outlier detection and the fields beside it.
DESTINATION_RULE = _top("networking.istio.io/v1", "DestinationRule", _obj({
    "host": STR,
    "exportTo": STRS,
    "trafficPolicy": _obj({
        "outlierDetection": _obj({
            "consecutiveGatewayErrors": {"type": "integer", "minimum": 0},
            "consecutive5xxErrors": {"type": "integer", "minimum": 0},
            "consecutiveLocalOriginFailures": {"type": "integer", "minimum": 0},
            "splitExternalLocalOriginErrors": BOOL,
            "interval": DURATION,
            "baseEjectionTime": DURATION,
            "maxEjectionPercent": {"type": "integer", "minimum": 0, "maximum": 100},
            "minHealthPercent": {"type": "integer", "minimum": 0, "maximum": 100},
        }),
        "connectionPool": {"type": "object"},
        "loadBalancer": {"type": "object"},
        "tls": {"type": "object"},
    }),
}, ["host"]))

_TARGET_REF = _obj({"group": {"type": "string"}, "kind": STR, "name": STR, "namespace": STR},
                   ["kind", "name"])


def _lists_and_nots(*keys: str) -> Schema:
    """An object of string lists: each key, and its notKey."""
    return _obj({k: STRS for key in keys for k in (key, "not" + key[0].upper() + key[1:])})


AUTHORIZATION_POLICY = _top("security.istio.io/v1", "AuthorizationPolicy", _obj({
    "selector": _obj({"matchLabels": STR_MAP}, ["matchLabels"]),
    "targetRef": _TARGET_REF,
    "targetRefs": _list(_TARGET_REF),
    "action": {"enum": ["ALLOW", "DENY", "AUDIT", "CUSTOM"]},
    "provider": _obj({"name": STR}, ["name"]),
    "rules": _list(_obj({
        "from": _list(_obj({"source": _lists_and_nots(
            "principals", "requestPrincipals", "namespaces", "ipBlocks", "remoteIpBlocks")})),
        "to": _list(_obj({"operation": _lists_and_nots("hosts", "ports", "methods", "paths")})),
        "when": _list(_obj({"key": STR, "values": STRS, "notValues": STRS}, ["key"])),
    })),
}, ["action"]))

_MTLS_MODE = _obj({"mode": {"enum": ["UNSET", "DISABLE", "PERMISSIVE", "STRICT"]}}, ["mode"])

PEER_AUTHENTICATION = _top("security.istio.io/v1", "PeerAuthentication", _obj({
    "selector": _obj({"matchLabels": STR_MAP}, ["matchLabels"]),
    "mtls": _MTLS_MODE,
    "portLevelMtls": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                      "additionalProperties": _MTLS_MODE},
}, ["mtls"]))

KUSTOMIZATION = _obj({
    "apiVersion": {"const": "kustomize.config.k8s.io/v1beta1"},
    "kind": {"const": "Kustomization"},
    "namespace": STR,
    "resources": _list(STR, min_items=1),
    "images": _list(_obj({"name": STR, "newName": STR, "newTag": STR, "digest": STR}, ["name"])),
    # Other kustomize fields are allowed unchecked; misspellings of them still fail.
    **{key: {} for key in (
        "metadata", "namePrefix", "nameSuffix", "labels", "commonLabels", "commonAnnotations",
        "components", "configMapGenerator", "secretGenerator", "generatorOptions", "patches",
        "replicas", "replacements", "buildMetadata", "sortOptions")},
}, ["apiVersion", "kind", "resources"])

SCHEMAS: dict[tuple[str, str], Schema] = {
    ("install.istio.io/v1alpha1", "IstioOperator"): ISTIO_OPERATOR,
    ("security.istio.io/v1", "AuthorizationPolicy"): AUTHORIZATION_POLICY,
    ("security.istio.io/v1", "PeerAuthentication"): PEER_AUTHENTICATION,
    ("telemetry.istio.io/v1", "Telemetry"): TELEMETRY,
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): ENVOY_FILTER,
    ("networking.istio.io/v1", "DestinationRule"): DESTINATION_RULE,
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"): KUSTOMIZATION,
    **MONITORING_SCHEMAS,  # deploy/observability
}


# --- loading and checks --------------------------------------------------------------

def _docs(path: Path) -> list[Doc]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _manifests() -> list[tuple[str, Doc]]:
    paths = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    return [(f"{p.relative_to(DEPLOY)}#{i}", d) for p in paths for i, d in enumerate(_docs(p))]


def validate_manifest(doc: Doc) -> None:
    """Raise jsonschema.ValidationError (or SchemaNotFoundError) unless doc is valid."""
    schema = SCHEMAS.get((doc.get("apiVersion", ""), doc.get("kind", "")))
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _only(docs: Sequence[Doc], kind: str) -> Doc:
    """The one document of `kind`, written Kind or Kind/name."""
    kind, _, name = kind.partition("/")
    found = [d for d in docs if d.get("kind") == kind
             and (not name or d.get("metadata", {}).get("name") == name)]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _seconds(duration: object) -> float:
    assert isinstance(duration, str), duration
    assert re.fullmatch(DURATION["pattern"], duration), f"not a protobuf duration: {duration}"
    return float(duration.removesuffix("s"))


def check_ext_authz_wiring(kube: Sequence[Doc], istio: Sequence[Doc]) -> None:
    """Each CUSTOM policy's provider reaches the sitsmesh Service's data port, fails closed,
    sends raw bodies, and the policy selects some workload other than sitsmesh."""
    kustomization = _only(kube, "Kustomization")
    service = _only(kube, "Service")
    namespace = (kustomization.get("namespace") or service["metadata"].get("namespace")
                 or "default")
    host = f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    data_port = {p.get("name"): p["port"] for p in service["spec"]["ports"]}[DATA_PORT_NAME]
    pod_labels = _only(kube, "Deployment")["spec"]["template"]["metadata"]["labels"]

    providers = {p["name"]: p for d in istio if d["kind"] == "IstioOperator"
                 for p in d["spec"]["meshConfig"]["extensionProviders"]
                 if "envoyExtAuthzGrpc" in p}
    # ALLOW policies guard sitsmesh itself (check_callers_are_limited).
    policies = [d for d in istio if d["kind"] == "AuthorizationPolicy"
                and d["spec"].get("action") == "CUSTOM"]
    assert policies, "no CUSTOM AuthorizationPolicy"
    for policy in policies:
        spec = policy["spec"]
        assert spec["action"] == "CUSTOM"
        name = spec.get("provider", {}).get("name")
        assert name in providers, f"provider {name!r} is not in extensionProviders"
        grpc = providers[name]["envoyExtAuthzGrpc"]
        prefix, _, service_host = grpc["service"].rpartition("/")  # [<Namespace>/]<Hostname>
        assert service_host == host and prefix in ("", namespace), grpc["service"]
        assert grpc["port"] == data_port
        assert grpc.get("failOpen") is False, "fail closed, and say so"
        assert "timeout" in grpc, "Istio's default is 600s"
        assert 0 < _seconds(grpc["timeout"]) <= MAX_CHECK_TIMEOUT_S
        body = grpc.get("includeRequestBodyInCheck", {})
        assert body.get("packAsBytes") is True, "sitsmesh reads raw_body (gRPC frames)"
        assert body.get("allowPartialMessage") is True, "else large bodies get 413"
        assert MIN_BODY_BYTES <= body.get("maxRequestBytes", 0) <= MAX_BODY_BYTES

        labels = spec.get("selector", {}).get("matchLabels", {})
        assert labels, "select the inference workload; no namespace- or mesh-wide policy"
        assert policy["metadata"]["namespace"] != namespace or not labels.items() <= \
            pod_labels.items(), "the policy must not select sitsmesh itself"


def check_callers_are_limited(kube: Sequence[Doc], istio: Sequence[Doc]) -> None:
    """Only named callers reach sitsmesh (issue 13): under Istio, STRICT mTLS on its pod
    and an ALLOW policy naming principals for the data port; without Istio, a
    NetworkPolicy that opens the data port to named sources and the admin port to none."""
    service = _only(kube, "Service")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    data, admin = ports[DATA_PORT_NAME], ports["grpc-admin"]
    pod_labels = _only(kube, "Deployment")["spec"]["template"]["metadata"]["labels"]
    namespace = _only(kube, "Kustomization").get("namespace")

    peer = _only(istio, "PeerAuthentication")
    assert peer["metadata"]["namespace"] == namespace
    assert peer["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert peer["spec"]["mtls"]["mode"] == "STRICT"
    relaxed = {int(p) for p, m in peer["spec"].get("portLevelMtls", {}).items()
               if m["mode"] != "STRICT"}
    assert not relaxed & {data, admin}, f"ports {relaxed} accept plaintext"

    allow = [d for d in istio if d["kind"] == "AuthorizationPolicy"
             and d["spec"].get("action") == "ALLOW"]
    assert len(allow) == 1, "one ALLOW policy on sitsmesh's pod"
    spec = allow[0]["spec"]
    assert allow[0]["metadata"]["namespace"] == namespace
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    for rule in spec.get("rules", []):
        rule_ports = {int(p) for t in rule.get("to", []) for p in t["operation"].get("ports", [])}
        assert rule_ports, "a rule without ports opens every port"
        if data in rule_ports:
            principals = [p for f in rule.get("from", []) for p in f["source"].get("principals",
                                                                                   [])]
            assert rule.get("from") and all(
                f["source"].keys() == {"principals"} for f in rule["from"]), \
                "the data port admits named principals only"
            assert principals and "*" not in principals

    policy = _only(kube, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    opened: set[int] = set()
    for rule in policy["spec"].get("ingress", []):
        rule_ports = {p["port"] for p in rule.get("ports", [])}
        assert rule_ports, "an ingress rule without ports opens every port"
        assert rule.get("from"), "an ingress rule without sources admits everyone"
        opened |= rule_ports
    assert data in opened and admin not in opened


def check_signal_wiring(kube: Sequence[Doc], istio: Sequence[Doc]) -> None:
    """Backpressure's signals reach sitsmesh: a Telemetry resource enables an access-log
    provider that points at the data port, and the stats sink dials the same place."""
    service = _only(kube, "Service")
    namespace = _only(kube, "Kustomization").get("namespace") or "default"
    host = f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    data_port = {p.get("name"): p["port"] for p in service["spec"]["ports"]}[DATA_PORT_NAME]
    logs = {p["name"]: p["envoyHttpAls"] for d in istio if d["kind"] == "IstioOperator"
            for p in d["spec"]["meshConfig"]["extensionProviders"] if "envoyHttpAls" in p}
    enabled = {provider["name"] for d in istio if d["kind"] == "Telemetry"
               for entry in d["spec"]["accessLogging"] for provider in entry["providers"]}
    assert enabled and enabled <= set(logs), f"Telemetry enables {enabled}, defined {set(logs)}"
    for name in enabled:
        assert logs[name]["service"].rpartition("/")[2] == host
        assert logs[name]["port"] == data_port
        assert "x-sits-stage" in logs[name].get("additionalRequestHeadersToLog", [])
    patches = [patch["patch"]["value"] for d in istio if d["kind"] == "EnvoyFilter"
               for patch in d["spec"]["configPatches"] if patch["applyTo"] == "BOOTSTRAP"
               and "stats_sinks" in patch["patch"]["value"]]
    sinks = [sink for value in patches for sink in value["stats_sinks"]]
    assert [s["name"] for s in sinks] == ["envoy.stat_sinks.metrics_service"]
    # Through a static cluster of the same patch (test_istio_stats_sink.py checks its TLS).
    name = sinks[0]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    clusters = [c for c in patches[0]["static_resources"]["clusters"] if c["name"] == name]
    assert len(clusters) == 1, f"the sink's cluster {name} is one static cluster of the patch"
    [cluster] = clusters
    [[endpoint]] = [[e["endpoint"] for e in group["lb_endpoints"]]
                    for group in cluster["load_assignment"]["endpoints"]]
    address = endpoint["address"]["socket_address"]
    assert f"{address['address']}:{address['port_value']}" == f"{host}:{data_port}"


def _kube_docs() -> list[Doc]:
    return [d for p in sorted(KUBE.glob("*.yaml")) for d in _docs(p)]


def _istio_docs() -> list[Doc]:
    # deploy/istio's kustomization.yaml lists these files; the namespace checks read
    # deploy/kubernetes's (test_kustomize.py checks the rendered overlay).
    return [d for p in sorted(ISTIO.glob("*.yaml")) for d in _docs(p)
            if d.get("kind") != "Kustomization"]


# --- the manifests as they are -------------------------------------------------------

def test_own_schemas_are_valid_json_schema() -> None:
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize(("where", "doc"), _manifests(), ids=[w for w, _ in _manifests()])
def test_manifest_validates(where: str, doc: Doc) -> None:
    try:
        validate_manifest(doc)
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{where}: no schema: {e.message}; add one to SCHEMAS")
    except jsonschema.ValidationError as e:
        pytest.fail(f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}")


def test_ext_authz_wiring() -> None:
    check_ext_authz_wiring(_kube_docs(), _istio_docs())


def test_only_named_callers_reach_sitsmesh() -> None:
    check_callers_are_limited(_kube_docs(), _istio_docs())


def test_access_logs_and_stats_reach_the_data_port() -> None:
    check_signal_wiring(_kube_docs(), _istio_docs())


@pytest.mark.parametrize(("kind", "path", "value"), [
    ("Telemetry", "spec.accessLogging.0.providers.0.name", "elsewhere"),
    ("EnvoyFilter/sitsmesh-stats-sink",
     "spec.configPatches.0.patch.value.static_resources.clusters.0.load_assignment."
     "endpoints.0.lb_endpoints.0.endpoint.address.socket_address.address",
     "sitsmesh.other.svc.cluster.local"),
    ("EnvoyFilter/sitsmesh-stats-sink",
     "spec.configPatches.0.patch.value.stats_sinks.0.typed_config.grpc_service."
     "envoy_grpc.cluster_name", "elsewhere"),
])
def test_signal_wiring_check_rejects_a_broken_setup(kind: str, path: str,
                                                    value: object) -> None:
    kube, istio = _kube_docs(), _istio_docs()
    break_at(_only(istio, kind), path, value)
    with pytest.raises(AssertionError):
        check_signal_wiring(kube, istio)


# --- and broken copies of them --------------------------------------------------------

_CONTAINER = "spec.template.spec.containers.0"
_GRPC = "spec.meshConfig.extensionProviders.0.envoyExtAuthzGrpc"

SCHEMA_BREAKS = [
    ("Deployment", f"{_CONTAINER}.imagePullPolicyy", "Always"),  # unknown field
    ("Deployment", f"{_CONTAINER}.ports.0.containerPort", "50051"),
    ("Deployment", "spec.replicas", "1"),
    ("Deployment", "spec.template.spec.securityContext.runAsNonroot", True),
    ("Service", "spec.ports.0.port", "50051"),
    ("Service", "spec.portz", []),
    ("Namespace", "metadata.label", {}),
    ("ServiceAccount", "automountToken", False),
    ("PodDisruptionBudget", "spec.maxUnavailabel", 1),
    ("PodDisruptionBudget", "spec.selector.matchLabel", {}),
    ("Deployment", f"{_CONTAINER}.lifecycle.preStop.sleep.seconds", "5"),
    ("Deployment", "spec.strategy.rollingUpdate.maxUnavailble", 0),
    ("Deployment", "apiVersion", "apps/v1beta9"),  # no schema at all
    ("IstioOperator", "apiVersion", "install.istio.io/v1"),
    ("IstioOperator", "spec.meshconfig", {}),
    ("IstioOperator", "spec.meshConfig.extensionProviders.0.envoyExtAuthzHttp", {}),
    ("IstioOperator", f"{_GRPC}.failopen", False),
    ("IstioOperator", f"{_GRPC}.port", "50051"),
    ("IstioOperator", f"{_GRPC}.timeout", "500ms"),
    ("IstioOperator", f"{_GRPC}.service", DELETE),
    ("IstioOperator", f"{_GRPC}.includeRequestBodyInCheck.packAsByte", True),
    ("AuthorizationPolicy/sitsmesh-ext-authz", "kind", "AuthorisationPolicy"),
    ("AuthorizationPolicy/sitsmesh-ext-authz", "spec.providers", {}),
    ("AuthorizationPolicy/sitsmesh-ext-authz", "spec.action", "custom"),
    ("AuthorizationPolicy/sitsmesh-ext-authz", "spec.provider.nam", "x"),
    ("AuthorizationPolicy/sitsmesh-ext-authz", "spec.rules.0.to", [{"operation": {"path": ["/"]}}]),
    ("AuthorizationPolicy/sitsmesh-ext-authz", "metadata.namespace", DELETE),
    ("Telemetry", "spec.accessLogging.0.provider", []),
    ("EnvoyFilter/sitsmesh-stats-sink", "spec.configPatches.0.applyTo", "bootstrap"),
    ("EnvoyFilter/sitsmesh-stats-sink", "spec.configPatches.0.patch.operation", "merge"),
    ("EnvoyFilter/sitsmesh-resilience", "spec.configPatches.1.applyTo", "HTTPFILTER"),
    ("DestinationRule", "spec.trafficPolicy.outlierDetection.interval", "1000ms"),
    ("DestinationRule", "spec.trafficPolicy.outlierDetection.consecutiveGatewayError", 2),
    ("DestinationRule", "spec.hosts", ["sitsmesh"]),
    ("Kustomization", "resource", []),
    ("Kustomization", "images.0.newtag", "1"),
]


@pytest.mark.parametrize(("kind", "path", "value"), SCHEMA_BREAKS,
                         ids=[f"{k}:{p}" for k, p, _ in SCHEMA_BREAKS])
def test_validation_rejects_a_broken_manifest(kind: str, path: str, value: object) -> None:
    doc = _only(_kube_docs() + _istio_docs(), kind)
    try:
        validate_manifest(doc)
    except (jsonschema.ValidationError, kubernetes_validate.SchemaNotFoundError):
        pytest.skip(f"the {kind} is invalid as it is: see test_manifest_validates")
    break_at(doc, path, value)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.SchemaNotFoundError)):
        validate_manifest(doc)


WIRING_BREAKS = [
    ("AuthorizationPolicy/sitsmesh-ext-authz", "spec.action", "ALLOW"),
    ("AuthorizationPolicy/sitsmesh-ext-authz", "spec.provider.name", "other-ext-authz"),
    ("AuthorizationPolicy/sitsmesh-ext-authz", "spec.selector", DELETE),
    # with sitsmesh's labels, below
    ("AuthorizationPolicy/sitsmesh-ext-authz", "metadata.namespace", "sitsmesh"),
    ("IstioOperator", f"{_GRPC}.service", "sitsmesh.default.svc.cluster.local"),
    ("IstioOperator", f"{_GRPC}.service", "sitsmesh.sitsmesh"),
    ("IstioOperator", f"{_GRPC}.service", "default/sitsmesh.sitsmesh.svc.cluster.local"),
    ("IstioOperator", f"{_GRPC}.port", 50052),
    ("IstioOperator", f"{_GRPC}.failOpen", True),
    ("IstioOperator", f"{_GRPC}.failOpen", DELETE),
    ("IstioOperator", f"{_GRPC}.timeout", DELETE),
    ("IstioOperator", f"{_GRPC}.timeout", "600s"),
    ("IstioOperator", f"{_GRPC}.includeRequestBodyInCheck", DELETE),
    ("IstioOperator", f"{_GRPC}.includeRequestBodyInCheck.packAsBytes", False),
    ("IstioOperator", f"{_GRPC}.includeRequestBodyInCheck.allowPartialMessage", False),
    ("IstioOperator", f"{_GRPC}.includeRequestBodyInCheck.maxRequestBytes", 16 << 20),
    ("Service", "spec.ports.0.port", 50061),
    ("Kustomization", "namespace", "elsewhere"),
]


@pytest.mark.parametrize(("kind", "path", "value"), WIRING_BREAKS,
                         ids=[f"{k}:{p}={v if v is not DELETE else '-'}"
                              for k, p, v in WIRING_BREAKS])
def test_wiring_check_rejects_a_broken_setup(kind: str, path: str, value: object) -> None:
    kube, istio = _kube_docs(), _istio_docs()
    try:
        check_ext_authz_wiring(kube, istio)
    except AssertionError:
        pytest.skip("the wiring is broken as it is: see test_ext_authz_wiring")
    doc = _only(kube + istio, kind)
    break_at(doc, path, value)
    if kind.startswith("AuthorizationPolicy") and path == "metadata.namespace":
        pod_labels = _only(kube, "Deployment")["spec"]["template"]["metadata"]["labels"]
        break_at(doc, "spec.selector.matchLabels", dict(pod_labels))
    with pytest.raises(AssertionError):
        check_ext_authz_wiring(kube, istio)


CALLER_BREAKS = [
    ("PeerAuthentication", "spec.mtls.mode", "PERMISSIVE"),
    ("PeerAuthentication", "spec.portLevelMtls", {"50051": {"mode": "PERMISSIVE"}}),
    ("PeerAuthentication", "spec.selector.matchLabels", {"app": "other"}),
    ("AuthorizationPolicy/sitsmesh-callers", "spec.rules.0.from", DELETE),
    ("AuthorizationPolicy/sitsmesh-callers", "spec.rules.0.from.0.source",
     {"namespaces": ["inference"]}),
    ("AuthorizationPolicy/sitsmesh-callers", "spec.rules.0.from.0.source.principals", ["*"]),
    ("AuthorizationPolicy/sitsmesh-callers", "spec.rules.2.to", DELETE),
    ("NetworkPolicy", "spec.ingress.0.from", DELETE),
    ("NetworkPolicy", "spec.ingress.1.ports.0.port", 50052),
    ("NetworkPolicy", "spec.ingress.0.ports", DELETE),
]


@pytest.mark.parametrize(("kind", "path", "value"), CALLER_BREAKS,
                         ids=[f"{k}:{p}" for k, p, _ in CALLER_BREAKS])
def test_callers_check_rejects_an_open_setup(kind: str, path: str, value: object) -> None:
    kube, istio = _kube_docs(), _istio_docs()
    break_at(_only(kube + istio, kind), path, value)
    with pytest.raises(AssertionError):
        check_callers_are_limited(kube, istio)


# --- the mesh's proxies and several sitsmesh replicas (issue 15) ----------------------

RETRY_ON = {"unavailable", "reset", "connect-failure"}


def _patches(istio: Sequence[Doc], apply_to: str) -> list[Doc]:
    return [patch for d in istio if d["kind"] == "EnvoyFilter"
            for patch in d["spec"]["configPatches"] if patch["applyTo"] == apply_to]


def check_resilience_wiring(kube: Sequence[Doc], istio: Sequence[Doc]) -> None:
    """Under Istio, the proxies that call sitsmesh eject a dead replica (DestinationRule
    outlier detection), health-check the replicas over gRPC with health changes applied
    at once (an EnvoyFilter on the sitsmesh cluster), and retry ext_authz calls on
    another replica within the provider's timeout."""
    service = _only(kube, "Service")
    namespace = _only(kube, "Kustomization").get("namespace") or "default"
    host = f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    data_port = {p.get("name"): p["port"] for p in service["spec"]["ports"]}[DATA_PORT_NAME]

    rules = [d for d in istio if d["kind"] == "DestinationRule" and d["spec"]["host"] == host]
    assert len(rules) == 1, f"one DestinationRule for {host}"
    outlier = rules[0]["spec"]["trafficPolicy"]["outlierDetection"]
    assert outlier.get("consecutiveGatewayErrors", 0) >= 1
    assert 0 < outlier.get("maxEjectionPercent", 10) <= 50, "never eject a majority"

    clusters = [p for p in _patches(istio, "CLUSTER")
                if p["match"].get("cluster", {}).get("service") == host]
    assert len(clusters) == 1, f"one CLUSTER patch for {host}"
    assert clusters[0]["match"]["cluster"].get("portNumber") == data_port
    value = clusters[0]["patch"]["value"]
    [check] = value["health_checks"]
    assert "grpc_health_check" in check
    assert _seconds(check["interval"]) <= 5
    assert value["common_lb_config"]["update_merge_window"] == "0s"

    provider_timeout = min(_seconds(p["envoyExtAuthzGrpc"]["timeout"])
                           for d in istio if d["kind"] == "IstioOperator"
                           for p in d["spec"]["meshConfig"]["extensionProviders"]
                           if "envoyExtAuthzGrpc" in p)
    authz = [p for p in _patches(istio, "HTTP_FILTER")
             if p["patch"]["value"].get("name") == "envoy.filters.http.ext_authz"]
    assert len(authz) == 1, "one HTTP_FILTER patch for ext_authz"
    policy = authz[0]["patch"]["value"]["typed_config"]["grpc_service"]["retry_policy"]
    assert set(policy["retry_on"].split(",")) >= RETRY_ON
    assert policy["num_retries"] >= 1
    # Envoy's gRPC client takes the back-off's max_interval as the per-try timeout.
    assert 0 < _seconds(policy["retry_back_off"]["max_interval"]) < provider_timeout
    assert [p["name"] for p in policy["retry_host_predicate"]] == [
        "envoy.retry_host_predicates.previous_hosts"]


def test_proxies_eject_health_check_and_retry_sitsmesh_replicas() -> None:
    check_resilience_wiring(_kube_docs(), _istio_docs())


_RES = "EnvoyFilter/sitsmesh-resilience"
_RETRY = "spec.configPatches.1.patch.value.typed_config.grpc_service.retry_policy"
RESILIENCE_BREAKS = [
    ("DestinationRule", "spec.host", "sitsmesh.default.svc.cluster.local"),
    ("DestinationRule", "spec.trafficPolicy.outlierDetection.consecutiveGatewayErrors", 0),
    ("DestinationRule", "spec.trafficPolicy.outlierDetection.maxEjectionPercent", 100),
    (_RES, "spec.configPatches.0.match.cluster.portNumber", 50052),
    (_RES, "spec.configPatches.0.patch.value.health_checks.0.grpc_health_check", DELETE),
    (_RES, "spec.configPatches.0.patch.value.common_lb_config", DELETE),
    (_RES, f"{_RETRY}.retry_on", "5xx"),
    (_RES, f"{_RETRY}.retry_back_off.max_interval", "0.5s"),
    (_RES, f"{_RETRY}.retry_host_predicate", []),
    (_RES, "spec.configPatches.1.patch.value.name", "envoy.filters.http.rbac"),
    ("IstioOperator", f"{_GRPC}.timeout", "0.1s"),
]


@pytest.mark.parametrize(("kind", "path", "value"), RESILIENCE_BREAKS,
                         ids=[f"{k}:{p}" for k, p, _ in RESILIENCE_BREAKS])
def test_resilience_check_rejects_a_weakened_setup(kind: str, path: str,
                                                   value: object) -> None:
    kube, istio = _kube_docs(), _istio_docs()
    break_at(_only(kube + istio, kind), path, value)
    with pytest.raises((AssertionError, KeyError)):
        check_resilience_wiring(kube, istio)
