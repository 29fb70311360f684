"""deploy/istio/grpc-stream-check.yaml: the Istio form of the grpc_stream_check filter is
the fragment's config apart from where sitsmesh is, goes right after ext_authz, gives
ModelStreamInfer a route of its own with the per-route settings envoyconf.stream_checks_on
gives the local bootstrap, keeps every other route out of the filter, and passes the real
Envoy binary. The real-process proof is tests/integration/test_stream_checks.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from sitsmesh.authz.check import MODEL_STREAM_INFER
from sitsmesh.dev import envoyconf, harness
from tests.istiofilters import (
    AUTHZ,
    HCM,
    Doc,
    break_at,
    istio_docs,
    istio_like_bootstrap,
    kube_docs,
    sitsmesh_cluster,
    validate,
)

FRAGMENT = harness.REPO / "filters" / "fragments" / "grpc_stream_check.yaml"


def _patches(istio: list[Doc]) -> list[Doc]:
    [found] = [d for d in istio if d["kind"] == "EnvoyFilter"
               and d["metadata"]["name"] == "sitsmesh-grpc-stream-check"]
    patches: list[Doc] = found["spec"]["configPatches"]
    return patches


def _local_route_settings() -> dict[str, Doc]:
    """What stream_checks_on gives the checked route and the others, locally."""
    values = harness.envoy_values("127.0.0.1:50051", 18080, 10000, 9901)
    local = envoyconf.render(harness.REPO / "filters" / "local" / "bootstrap.yaml", values,
                             ["ext_authz", "grpc_stream_check"])
    envoyconf.add_route(local, name="grpc", prefix="/inference.", host="127.0.0.1",
                        port=8001, timeout="0s", http2=True)
    envoyconf.stream_checks_on(local, ["grpc"])
    routes = envoyconf.http_connection_manager(local)["route_config"]["virtual_hosts"][0][
        "routes"]
    return {"checked": routes[0]["typed_per_filter_config"],
            "other": routes[1]["typed_per_filter_config"]}


def check_stream_check(fragment: Doc, kube: list[Doc], istio: list[Doc]) -> None:
    flt, route, others = _patches(istio)
    assert flt["applyTo"] == "HTTP_FILTER" and flt["patch"]["operation"] == "INSERT_AFTER"
    chain_filter = flt["match"]["listener"]["filterChain"]["filter"]
    assert chain_filter["name"] == HCM and chain_filter["subFilter"]["name"] == AUTHZ
    value = flt["patch"]["value"]
    service = value["typed_config"]["grpc_service"]
    assert service["envoy_grpc"] == {"cluster_name": sitsmesh_cluster(kube)}
    assert service["initial_metadata"] == fragment["typed_config"]["grpc_service"][
        "initial_metadata"]

    def apart_from_site(doc: Doc) -> Doc:
        return {**doc, "typed_config": {k: v for k, v in doc["typed_config"].items()
                                        if k != "grpc_service"}}
    assert apart_from_site(value) == apart_from_site(fragment), \
        "filters/fragments/grpc_stream_check.yaml and the EnvoyFilter drifted apart"
    local = _local_route_settings()
    assert route["patch"]["operation"] == "INSERT_BEFORE"
    assert route["patch"]["value"]["match"] == {"path": MODEL_STREAM_INFER}
    assert route["patch"]["value"]["typed_per_filter_config"] == {
        envoyconf.EXT_AUTHZ: local["checked"][envoyconf.EXT_AUTHZ]}
    assert others["patch"]["operation"] == "MERGE"
    assert others["patch"]["value"]["typed_per_filter_config"] == {
        envoyconf.STREAM_CHECK: local["other"][envoyconf.STREAM_CHECK]}
    ports = {flt["match"]["listener"]["portNumber"]} | {
        p["match"]["routeConfiguration"]["portNumber"] for p in (route, others)}
    assert len(ports) == 1, "the three patches name different ports"


def _fragment() -> Doc:
    found: Doc = yaml.safe_load(FRAGMENT.read_text(encoding="utf-8"))["http_filter"]
    return found


def test_the_envoy_filter_is_the_fragment_and_the_local_route_settings() -> None:
    check_stream_check(_fragment(), kube_docs(), istio_docs())


@pytest.mark.parametrize(("index", "path", "value"), [
    (0, "patch.value.typed_config.failure_mode_allow", True),
    (0, "patch.value.typed_config.processing_mode.request_body_mode", "STREAMED"),
    (0, "patch.value.typed_config.grpc_service.initial_metadata", []),
    (1, "patch.value.typed_per_filter_config", {}),
    (1, "patch.value.match.path", "/inference.GRPCInferenceService/ModelInfer"),
    (2, "match.routeConfiguration.portNumber", 9000),
])
def test_the_check_rejects_a_drifted_patch(index: int, path: str, value: object) -> None:
    istio = istio_docs()
    break_at(_patches(istio)[index], path, value)
    with pytest.raises(AssertionError):
        check_stream_check(_fragment(), kube_docs(), istio)


def test_the_patched_config_passes_the_real_envoy(tmp_path: Path) -> None:
    flt, route, others = _patches(istio_docs())
    value = flt["patch"]["value"]
    config = istio_like_bootstrap(value, value["typed_config"]["grpc_service"]["envoy_grpc"][
        "cluster_name"])
    names = [f["name"] for f in envoyconf.http_connection_manager(config)["http_filters"]]
    assert names == [AUTHZ, envoyconf.STREAM_CHECK, "envoy.filters.http.router"]
    # Istio's inbound cluster for the port, and its route patches as Istio applies them.
    clusters = config["static_resources"]["clusters"]
    [upstream] = [c for c in clusters if c["name"] == "upstream"]
    inbound = copy.deepcopy(upstream)
    inbound["name"] = inbound["load_assignment"]["cluster_name"] = \
        route["patch"]["value"]["route"]["cluster"]
    clusters.append(inbound)
    routes = envoyconf.http_connection_manager(config)["route_config"]["virtual_hosts"][0][
        "routes"]
    for existing in routes:
        existing.setdefault("typed_per_filter_config", {}).update(
            others["patch"]["value"]["typed_per_filter_config"])
    routes.insert(0, copy.deepcopy(route["patch"]["value"]))
    result = validate(config, tmp_path / "istio-grpc-stream-check.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
