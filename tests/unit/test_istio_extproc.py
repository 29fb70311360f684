"""deploy/istio/ext-proc.yaml: the Istio form of Envoy's ext_proc filter for token
streams is the plain-Envoy fragment's config apart from where sitsmesh is, goes right
after ext_authz on the entry workload, and passes the real Envoy binary inside a
bootstrap laid out as Istio would. Its stream settings (idle timeout, HTTP/2 windows,
requests per connection, buffer limits) are the local bootstrap's, merged where Istio
would merge them, and pass the real Envoy too. The real-process proof of the filter
itself is tests/integration/test_token_streams.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sitsmesh.dev import envoyconf, harness
from tests.istiofilters import (
    AUTHZ,
    DELETE,
    HCM,
    Doc,
    break_at,
    istio_docs,
    istio_like_bootstrap,
    kube_docs,
    sitsmesh_cluster,
    validate,
)

FRAGMENT = harness.REPO / "filters" / "fragments" / "ext_proc.yaml"
BOOTSTRAP = harness.REPO / "filters" / "local" / "bootstrap.yaml"
EXT_PROC = "envoy.filters.http.ext_proc"


def _patches(istio: list[Doc]) -> list[Doc]:
    return [p for d in istio if d["kind"] == "EnvoyFilter" for p in d["spec"]["configPatches"]
            if p.get("patch", {}).get("value", {}).get("name") == EXT_PROC]


def check_ext_proc(fragment: Doc, kube: list[Doc], istio: list[Doc]) -> None:
    [patch] = _patches(istio)
    assert patch["applyTo"] == "HTTP_FILTER"
    assert patch["patch"]["operation"] == "INSERT_AFTER"
    chain_filter = patch["match"]["listener"]["filterChain"]["filter"]
    assert chain_filter["name"] == HCM and chain_filter["subFilter"]["name"] == AUTHZ
    value = patch["patch"]["value"]
    assert value["typed_config"]["grpc_service"] == {"envoy_grpc": {
        "cluster_name": sitsmesh_cluster(kube)}}
    # Never holding a stream back, nor failing one when sitsmesh is away.
    assert value["typed_config"]["observability_mode"] is True
    assert value["typed_config"]["failure_mode_allow"] is True

    def apart_from_site(flt: Doc) -> Doc:
        typed = {k: v for k, v in flt["typed_config"].items() if k != "grpc_service"}
        return {**flt, "typed_config": typed}
    assert apart_from_site(value) == apart_from_site(fragment), \
        "filters/fragments/ext_proc.yaml and the EnvoyFilter drifted apart"


def _fragment() -> Doc:
    found: Doc = yaml.safe_load(FRAGMENT.read_text(encoding="utf-8"))["http_filter"]
    return found


def test_the_envoy_filter_is_the_fragment_after_ext_authz() -> None:
    check_ext_proc(_fragment(), kube_docs(), istio_docs())


@pytest.mark.parametrize(("path", "value"), [
    ("patch.value.typed_config.observability_mode", False),
    ("patch.value.typed_config.processing_mode.request_body_mode", "STREAMED"),
    ("patch.value.typed_config.grpc_service.envoy_grpc.cluster_name", "sitsmesh_data"),
    ("patch.operation", "INSERT_BEFORE"),
])
def test_the_check_rejects_a_drifted_filter(path: str, value: object) -> None:
    istio = istio_docs()
    break_at(_patches(istio)[0], path, value)
    with pytest.raises(AssertionError):
        check_ext_proc(_fragment(), kube_docs(), istio)


def test_the_envoy_filter_config_passes_the_real_envoy(tmp_path: Path) -> None:
    istio = istio_docs()
    [patch] = _patches(istio)
    value = patch["patch"]["value"]
    config = istio_like_bootstrap(value, value["typed_config"]["grpc_service"]["envoy_grpc"][
        "cluster_name"])
    names = [f["name"] for f in envoyconf.http_connection_manager(config)["http_filters"]]
    assert names == [AUTHZ, EXT_PROC, "envoy.filters.http.router"]
    # Istio's generated inbound side carries none of the settings: the patches bring them.
    hcm = envoyconf.http_connection_manager(config)
    listener = config["static_resources"]["listeners"][0]
    [upstream] = [c for c in config["static_resources"]["clusters"] if c["name"] == "upstream"]
    for node, keys in ((hcm, HCM_SETTINGS), (listener, [BUFFER]), (upstream, [BUFFER])):
        for key in keys:
            node.pop(key)
    settings = _settings_patches(istio)
    hcm.update({k: v for k, v in settings["NETWORK_FILTER"]["typed_config"].items()
                if k != "@type"})
    listener.update(settings["LISTENER"])
    upstream.update(settings["CLUSTER"])
    result = validate(config, tmp_path / "istio-ext-proc.yaml")
    assert result.returncode == 0, result.stderr[-3000:]


# --- stream settings ---------------------------------------------------------------------

HCM_SETTINGS = ["stream_idle_timeout", "http2_protocol_options",
                "common_http_protocol_options"]
BUFFER = "per_connection_buffer_limit_bytes"


def _settings_patches(istio: list[Doc]) -> dict[str, Doc]:
    """The ext_proc EnvoyFilter's MERGE patches, by what they apply to."""
    [envoy_filter] = [d for d in istio if d["kind"] == "EnvoyFilter"
                      and d["metadata"]["name"] == "sitsmesh-ext-proc"]
    return {p["applyTo"]: p["patch"]["value"] for p in envoy_filter["spec"]["configPatches"]
            if p["patch"]["operation"] == "MERGE"}


def _local() -> Doc:
    values = harness.envoy_values("127.0.0.1:50051", 18080, 10000, 9901)
    return envoyconf.render(BOOTSTRAP, values, ["ext_proc"])


def check_stream_settings(local: Doc, istio: list[Doc]) -> None:
    patches = _settings_patches(istio)
    hcm = envoyconf.http_connection_manager(local)
    merged = patches["NETWORK_FILTER"]
    assert merged["name"] == HCM
    assert {k: v for k, v in merged["typed_config"].items() if k != "@type"} == {
        k: hcm[k] for k in HCM_SETTINGS}, "HCM stream settings drifted from the bootstrap"
    [listener] = local["static_resources"]["listeners"]
    assert patches["LISTENER"] == {BUFFER: listener[BUFFER]}
    [upstream] = [c for c in local["static_resources"]["clusters"] if c["name"] == "upstream"]
    assert patches["CLUSTER"] == {BUFFER: upstream[BUFFER]}


def test_the_stream_settings_are_the_local_bootstraps() -> None:
    local = _local()
    hcm = envoyconf.http_connection_manager(local)
    # Token streams: below Envoy's defaults (5 min, 256 MiB windows, 1 MiB buffers).
    assert hcm["stream_idle_timeout"] == "60s"
    assert hcm["http2_protocol_options"] == {"initial_stream_window_size": 65536,
                                             "initial_connection_window_size": 1048576}
    assert local["static_resources"]["listeners"][0][BUFFER] == 65536
    # The filter's own: a waiting mode holds a chunk at most 50 ms.
    [flt] = [f for f in hcm["http_filters"] if f["name"] == EXT_PROC]
    assert flt["typed_config"]["message_timeout"] == "0.05s"
    check_stream_settings(local, istio_docs())


@pytest.mark.parametrize(("apply_to", "path", "value"), [
    ("NETWORK_FILTER", "typed_config.stream_idle_timeout", "300s"),
    ("NETWORK_FILTER", "typed_config.http2_protocol_options.initial_stream_window_size",
     268435456),
    ("NETWORK_FILTER", "typed_config.common_http_protocol_options", DELETE),
    ("LISTENER", BUFFER, 1048576),
    ("CLUSTER", BUFFER, DELETE),
])
def test_the_settings_check_rejects_a_drifted_patch(apply_to: str, path: str,
                                                    value: object) -> None:
    istio = istio_docs()
    break_at(_settings_patches(istio)[apply_to], path, value)
    with pytest.raises((AssertionError, KeyError)):
        check_stream_settings(_local(), istio)


def test_an_http2_engine_route_gets_the_windows_and_passes_the_real_envoy(
        tmp_path: Path) -> None:
    local = _local()
    envoyconf.add_route(local, name="engine", prefix="/inference.", host="127.0.0.1",
                        port=8001, timeout="0s", http2=True)
    [engine] = [c for c in local["static_resources"]["clusters"] if c["name"] == "engine"]
    options = engine["typed_extension_protocol_options"][envoyconf.HTTP_OPTIONS]
    assert options["explicit_http_config"]["http2_protocol_options"] == \
        envoyconf.http_connection_manager(local)["http2_protocol_options"]
    assert engine[BUFFER] == 32768
    result = validate(local, tmp_path / "engine.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
