"""deploy/istio/token-timing.yaml: the Istio form of the token-timing Lua filter is the
fragment's http_filter exactly (the Lua source included), goes where ext-proc.yaml puts
ext_proc (right after ext_authz, on the same workload), carries ext-proc.yaml's stream
settings, sits where Telemetry sends the access log to sitsmesh, validates against
Istio's CRD schemas, and passes the real Envoy binary inside a bootstrap laid out as
Istio would, with the access log Istio makes of the sitsmesh provider. The real-process
proof of the filter itself is tests/integration/test_token_streams.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from sitsmesh.dev import envoyconf, harness
from tests.istiofilters import (
    AUTHZ,
    DEPLOY,
    HCM,
    Doc,
    break_at,
    docs,
    istio_docs,
    istio_like_bootstrap,
    kube_docs,
    sitsmesh_cluster,
    validate,
)

FRAGMENT = harness.REPO / "filters" / "fragments" / "token_timing.yaml"
MANIFEST = DEPLOY / "istio" / "token-timing.yaml"
TIMING = "sitsmesh.token_timing"
SOURCE = "patch.value.typed_config.default_source_code.inline_string"
VALIDATOR = harness.REPO / "tests" / "istio" / "validate.mjs"
HTTP_GRPC_LOG = ("type.googleapis.com/"
                 "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig")


def _fragment() -> Doc:
    found: Doc = yaml.safe_load(FRAGMENT.read_text(encoding="utf-8"))["http_filter"]
    return found


def _filters(istio: list[Doc]) -> dict[str, Doc]:
    """The two EnvoyFilters that time token streams, by metadata name."""
    return {d["metadata"]["name"]: d for d in istio if d["kind"] == "EnvoyFilter"
            and d["metadata"]["name"] in ("sitsmesh-token-timing", "sitsmesh-ext-proc")}


def _patches(istio: list[Doc]) -> list[Doc]:
    patches: list[Doc] = _filters(istio)["sitsmesh-token-timing"]["spec"]["configPatches"]
    return patches


def _settings(envoy_filter: Doc) -> list[Doc]:
    return [p for p in envoy_filter["spec"]["configPatches"]
            if p["patch"]["operation"] == "MERGE"]


def check_token_timing(fragment: Doc, istio: list[Doc]) -> None:
    filters = _filters(istio)
    timing, ext_proc = filters["sitsmesh-token-timing"], filters["sitsmesh-ext-proc"]
    [patch] = [p for p in timing["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
    [ext_proc_patch] = [p for p in ext_proc["spec"]["configPatches"]
                        if p["applyTo"] == "HTTP_FILTER"]
    # Where ext_proc goes: same workload, same place in the chain.
    assert timing["metadata"]["namespace"] == ext_proc["metadata"]["namespace"]
    assert timing["spec"]["workloadSelector"] == ext_proc["spec"]["workloadSelector"]
    assert patch["match"] == ext_proc_patch["match"]
    chain_filter = patch["match"]["listener"]["filterChain"]["filter"]
    assert chain_filter["name"] == HCM and chain_filter["subFilter"]["name"] == AUTHZ
    assert patch["patch"]["operation"] == ext_proc_patch["patch"]["operation"] == \
        "INSERT_AFTER"
    assert patch["patch"]["value"] == fragment, \
        "filters/fragments/token_timing.yaml and the EnvoyFilter drifted apart"
    assert _settings(timing) == _settings(ext_proc), \
        "the stream settings drifted from ext-proc.yaml's"
    # The summary reaches sitsmesh only on the access log: a Telemetry of the namespace
    # that covers the workload must enable an envoyHttpAls provider.
    labels = timing["spec"]["workloadSelector"]["labels"]
    als = {p["name"] for d in istio if d["kind"] == "IstioOperator"
           for p in d["spec"]["meshConfig"]["extensionProviders"] if "envoyHttpAls" in p}
    logged = {provider["name"] for d in istio if d["kind"] == "Telemetry"
              and d["metadata"]["namespace"] == timing["metadata"]["namespace"]
              and d["spec"].get("selector", {}).get("matchLabels", labels).items()
              <= labels.items()
              for entry in d["spec"]["accessLogging"] if not entry.get("disabled")
              for provider in entry["providers"]}
    assert logged & als, "no access log to sitsmesh on the timed workload"


def test_the_envoy_filter_is_the_fragment_where_ext_proc_goes() -> None:
    check_token_timing(_fragment(), istio_docs())


def _telemetry(istio: list[Doc]) -> Doc:
    [found] = [d for d in istio if d["kind"] == "Telemetry"]
    return found


@pytest.mark.parametrize(("where", "path", "value"), [
    ("timing", SOURCE, _fragment()["typed_config"]["default_source_code"]["inline_string"]
     .replace("MAX_GAPS = 4096", "MAX_GAPS = 8192")),
    ("timing", "patch.value.name", "envoy.filters.http.lua"),
    ("timing", "patch.operation", "INSERT_BEFORE"),
    ("timing", "match.context", "SIDECAR_OUTBOUND"),
    ("settings", "patch.value.per_connection_buffer_limit_bytes", 1048576),
    ("telemetry", "spec.selector", {"matchLabels": {"app": "elsewhere"}}),
    ("telemetry", "spec.accessLogging.0.providers.0.name", "envoy"),
])
def test_the_check_rejects_a_drifted_filter(where: str, path: str, value: object) -> None:
    istio = istio_docs()
    target = {"timing": _patches(istio)[0], "settings": _patches(istio)[2],
              "telemetry": _telemetry(istio)}[where]
    break_at(target, path, value)
    with pytest.raises(AssertionError):
        check_token_timing(_fragment(), istio)


# --- Istio's schemas ---------------------------------------------------------------------

def _istio_schemas(objects: list[Doc], tmp_path: Path) -> tuple[int, list[str]]:
    """What Istio's CRD schemas say (tests/istio/validate.mjs; test_istio_crds.py)."""
    found = tmp_path / "objects.json"
    found.write_text(json.dumps(objects))
    done = subprocess.run(["node", str(VALIDATOR), str(found)], capture_output=True,
                          text=True, timeout=60, check=False, cwd=VALIDATOR.parent)
    assert not done.stderr, done.stderr
    return done.returncode, done.stdout.splitlines()


def test_the_envoy_filter_validates_against_istios_schemas(tmp_path: Path) -> None:
    objects = docs(MANIFEST)
    assert _istio_schemas(objects, tmp_path) == (0, ["ok EnvoyFilter sitsmesh-token-timing"])
    break_at(objects[0], "spec.configPatches.0.patch.operation", "INSERT_AFTERWARDS")
    status, [line] = _istio_schemas(objects, tmp_path)
    assert status == 1 and line.startswith("invalid EnvoyFilter sitsmesh-token-timing: ")


# --- the real Envoy ----------------------------------------------------------------------

def _istio_like(istio: list[Doc], value: Doc) -> Doc:
    """The local bootstrap as Istio would make it for the timed workload: the filter after
    ext_authz, ext-proc.yaml's stream settings merged, and the access log Istio makes of
    the envoyHttpAls provider telemetry.yaml enables."""
    cluster = sitsmesh_cluster(kube_docs())
    config = istio_like_bootstrap(value, cluster)
    hcm = envoyconf.http_connection_manager(config)
    listener = config["static_resources"]["listeners"][0]
    [upstream] = [c for c in config["static_resources"]["clusters"] if c["name"] == "upstream"]
    for patch in _settings(_filters(istio)["sitsmesh-token-timing"]):
        merged = patch["patch"]["value"]
        if patch["applyTo"] == "NETWORK_FILTER":
            hcm.update({k: v for k, v in merged["typed_config"].items() if k != "@type"})
        else:
            (listener if patch["applyTo"] == "LISTENER" else upstream).update(merged)
    [provider] = [p["envoyHttpAls"] for d in istio if d["kind"] == "IstioOperator"
                  for p in d["spec"]["meshConfig"]["extensionProviders"]
                  if p["name"] == _telemetry(istio)["spec"]["accessLogging"][0][
                      "providers"][0]["name"]]
    hcm["access_log"] = [{"name": "envoy.access_loggers.http_grpc", "typed_config": {
        "@type": HTTP_GRPC_LOG,
        "common_config": {"log_name": provider["logName"], "transport_api_version": "V3",
                          "grpc_service": {"envoy_grpc": {"cluster_name": cluster}}},
        "additional_request_headers_to_log": provider["additionalRequestHeadersToLog"]}}]
    return config


def test_the_envoy_filter_config_passes_the_real_envoy(tmp_path: Path) -> None:
    istio = istio_docs()
    config = _istio_like(istio, _patches(istio)[0]["patch"]["value"])
    names = [f["name"] for f in envoyconf.http_connection_manager(config)["http_filters"]]
    assert names == [AUTHZ, TIMING, "envoy.filters.http.router"]
    result = validate(config, tmp_path / "istio-token-timing.yaml")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize(("path", "value", "error"), [
    # Envoy compiles the script when it loads the config: a broken one is refused.
    (SOURCE, "function envoy_on_response(handle)\n  if then\nend\n", "script load error"),
    # Per-route settings are not a filter.
    ("patch.value.typed_config.@type",
     "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute",
     "'default_source_code'"),  # protobuf varies the spaces in its message
])
def test_the_real_envoy_refuses_a_broken_filter(tmp_path: Path, path: str, value: object,
                                                error: str) -> None:
    istio = istio_docs()
    patch = _patches(istio)[0]
    break_at(patch, path, value)
    result = validate(_istio_like(istio, patch["patch"]["value"]), tmp_path / "broken.yaml")
    assert result.returncode != 0 and error in result.stderr, result.stderr[-3000:]
