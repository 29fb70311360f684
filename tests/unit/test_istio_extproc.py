"""deploy/istio/ext-proc.yaml: the Istio form of Envoy's ext_proc filter for token
streams is the plain-Envoy fragment's config apart from where sitsmesh is, goes right
after ext_authz on the entry workload, and passes the real Envoy binary inside a
bootstrap laid out as Istio would. The real-process proof of the filter itself is
tests/integration/test_token_streams.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

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

FRAGMENT = harness.REPO / "filters" / "fragments" / "ext_proc.yaml"
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
    [patch] = _patches(istio_docs())
    value = patch["patch"]["value"]
    config = istio_like_bootstrap(value, value["typed_config"]["grpc_service"]["envoy_grpc"][
        "cluster_name"])
    names = [f["name"] for f in envoyconf.http_connection_manager(config)["http_filters"]]
    assert names == [AUTHZ, EXT_PROC, "envoy.filters.http.router"]
    result = validate(config, tmp_path / "istio-ext-proc.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
