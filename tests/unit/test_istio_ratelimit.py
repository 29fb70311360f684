"""deploy/istio/rate-limit.yaml: the Istio form of Envoy's ratelimit filter is the
plain-Envoy fragment's config apart from where sitsmesh is (Istio's cluster for the
Service) and the domain, goes right after ext_authz on the workload the CUSTOM policy
covers, builds its descriptors from the x-sits-* headers ext_authz sets, and passes the
real Envoy binary (`--mode validate`) inside a bootstrap laid out as Istio's would be.

The real-process proof of the filter itself is tests/integration/test_ratelimit_envoy.py.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
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
    entry_policy,
    istio_docs,
    istio_like_bootstrap,
    kube_docs,
    sitsmesh_cluster,
    validate,
)

FRAGMENT = harness.REPO / "filters" / "fragments" / "ratelimit.yaml"
RATELIMIT = "envoy.filters.http.ratelimit"
TENANT = {"request_headers": {"header_name": "x-sits-tenant", "descriptor_key": "tenant"}}


def _fragment_filter() -> Doc:
    http_filter: Doc = yaml.safe_load(FRAGMENT.read_text(encoding="utf-8"))["http_filter"]
    return http_filter


def _ratelimit_filter(istio: Sequence[Doc]) -> Doc:
    [envoy_filter] = [d for d in istio if d["kind"] == "EnvoyFilter" and any(
        p.get("patch", {}).get("value", {}).get("name") == RATELIMIT
        for p in d["spec"]["configPatches"])]
    return envoy_filter


def check_ratelimit_filter(fragment: Doc, kube: Sequence[Doc], istio: Sequence[Doc]) -> None:
    envoy_filter = _ratelimit_filter(istio)
    patches = envoy_filter["spec"]["configPatches"]
    [added] = [p for p in patches if p["applyTo"] == "HTTP_FILTER"]
    assert added["patch"]["operation"] == "INSERT_AFTER", "the headers come from ext_authz"
    match = added["match"]
    assert match["context"] in ("SIDECAR_INBOUND", "GATEWAY")
    assert match["listener"]["filterChain"]["filter"]["name"] == HCM
    assert match["listener"]["filterChain"]["filter"]["subFilter"]["name"] == AUTHZ

    value = added["patch"]["value"]
    config = value["typed_config"]
    grpc_service = config["rate_limit_service"]["grpc_service"]
    assert grpc_service["envoy_grpc"] == {"cluster_name": sitsmesh_cluster(kube)}, \
        "Istio's cluster for sitsmesh's data port"
    domain = config["domain"]
    assert isinstance(domain, str) and domain and "${" not in domain, domain
    assert config["failure_mode_deny"] is False, "documented to fail open"

    def apart_from_site(flt: Doc) -> Doc:
        flt = copy.deepcopy(flt)
        del flt["typed_config"]["domain"]
        del flt["typed_config"]["rate_limit_service"]["grpc_service"]["envoy_grpc"]
        return flt
    assert apart_from_site(value) == apart_from_site(fragment), \
        "filters/fragments/ratelimit.yaml and the EnvoyFilter drifted apart"

    # Descriptors from what ext_authz decided, on the same inbound virtual hosts.
    [routes] = [p for p in patches if p["applyTo"] == "VIRTUAL_HOST"]
    assert routes["match"]["context"] == match["context"]
    assert routes["patch"]["operation"] == "MERGE"
    limits = routes["patch"]["value"]["rate_limits"]
    assert limits and all(limit["actions"][0] == TENANT for limit in limits), \
        "every descriptor starts with the tenant ext_authz identified"
    headers = {a["request_headers"]["header_name"] for limit in limits
               for a in limit["actions"]}
    assert all(h.startswith("x-sits-") for h in headers), "client-sent headers are forgeable"
    entry_policy(istio, envoy_filter)


def test_ratelimit_filter_is_the_fragment_after_ext_authz_on_the_checked_workload() -> None:
    check_ratelimit_filter(_fragment_filter(), kube_docs(), istio_docs())


_P = "spec.configPatches.0"
_T = f"{_P}.patch.value.typed_config"
_R = "spec.configPatches.1.patch.value.rate_limits"
BREAKS: list[tuple[str, object]] = [
    (f"{_P}.patch.operation", "INSERT_BEFORE"),
    (f"{_P}.match.listener.filterChain.filter.subFilter.name", "envoy.filters.http.router"),
    (f"{_P}.match.context", "SIDECAR_OUTBOUND"),
    (f"{_T}.rate_limit_service.grpc_service.envoy_grpc.cluster_name", "sitsmesh_data"),
    (f"{_T}.domain", "${ratelimit_domain}"),
    (f"{_T}.failure_mode_deny", True),
    (f"{_T}.timeout", "5s"),
    (f"{_T}.rate_limit_service.grpc_service.retry_policy", DELETE),
    (f"{_R}.0.actions.0.request_headers.header_name", "x-tenant"),
    (f"{_R}.1.actions.1.request_headers.header_name", "x-model"),
    ("spec.configPatches.1.match.context", "GATEWAY"),
    ("spec.workloadSelector.labels", {"app": "other"}),
]


@pytest.mark.parametrize(("path", "value"), BREAKS,
                         ids=[f"{'.'.join(p.split('.')[-2:])}={'-' if v is DELETE else v}"
                              for p, v in BREAKS])
def test_ratelimit_check_rejects_a_drifted_or_misplaced_filter(path: str,
                                                               value: object) -> None:
    istio = istio_docs()
    break_at(_ratelimit_filter(istio), path, value)
    with pytest.raises(AssertionError):
        check_ratelimit_filter(_fragment_filter(), kube_docs(), istio)


def test_the_envoy_filter_config_passes_the_real_envoy(tmp_path: Path) -> None:
    envoy_filter = _ratelimit_filter(istio_docs())
    patches = envoy_filter["spec"]["configPatches"]
    [added] = [p for p in patches if p["applyTo"] == "HTTP_FILTER"]
    [routes] = [p for p in patches if p["applyTo"] == "VIRTUAL_HOST"]
    value = added["patch"]["value"]
    cluster = value["typed_config"]["rate_limit_service"]["grpc_service"]["envoy_grpc"][
        "cluster_name"]
    config = istio_like_bootstrap(value, cluster)
    hcm = envoyconf.http_connection_manager(config)
    for host in hcm["route_config"]["virtual_hosts"]:  # Istio's MERGE into each
        host.update(copy.deepcopy(routes["patch"]["value"]))
    assert [f["name"] for f in hcm["http_filters"]] == [AUTHZ, RATELIMIT,
                                                         "envoy.filters.http.router"]
    result = validate(config, tmp_path / "istio-ratelimit.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    # And the check can fail: a descriptor action Envoy does not know is refused.
    hcm["route_config"]["virtual_hosts"][0]["rate_limits"][0]["actions"][0] = {
        "request_header": {"header_name": "x-sits-tenant"}}
    broken = validate(config, tmp_path / "broken.yaml")
    assert broken.returncode != 0
    assert "request_header" in broken.stderr + broken.stdout
