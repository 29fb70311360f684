"""deploy/overlays/istio-rlqs/rate-limit-quota.yaml (issue 16): the Istio form of Envoy's
rate_limit_quota filter is the plain-Envoy fragment's config apart from where sitsmesh
is (Istio's cluster for the Service's port of the RLQS process, which the overlay adds
and has sitsmesh listen on) and the domain, goes right after ext_authz on the
workload the CUSTOM policy sends through ext_authz, and passes the real Envoy binary
(`--mode validate`, a fraction of a second) inside a bootstrap laid out as Istio would.

The real-process proof of the filter itself is tests/integration/test_rlqs_envoy.py.
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
    docs,
    entry_policy,
    istio_docs,
    istio_like_bootstrap,
    kube_docs,
    sitsmesh_cluster,
    validate,
)

FRAGMENT = harness.REPO / "filters" / "fragments" / "rate_limit_quota.yaml"
OVERLAY = harness.REPO / "deploy" / "overlays" / "istio-rlqs"
QUOTA = "envoy.filters.http.rate_limit_quota"
ALLOW_ALL = {"blanket_rule": "ALLOW_ALL"}
# Where sitsmesh is and which rules apply: the only fields the two forms may differ in.
SITE_FIELDS = ("rlqs_server", "domain")


def _istio() -> list[Doc]:
    """deploy/istio's objects with the overlay's quota filter."""
    return istio_docs() + docs(OVERLAY / "rate-limit-quota.yaml")


def _rlqs_port() -> int:
    """The port the overlay has sitsmesh serve RLQS on (SITSMESH_RLQS_ADDR)."""
    patches = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())["patches"]
    [addr] = [op["value"]["value"] for p in patches
              if p.get("target", {}).get("kind") == "Deployment"
              for op in yaml.safe_load(p["patch"])
              if op["value"].get("name") == "SITSMESH_RLQS_ADDR"]
    return int(addr.rpartition(":")[2])


def _fragment_filter() -> Doc:
    http_filter: Doc = yaml.safe_load(FRAGMENT.read_text(encoding="utf-8"))["http_filter"]
    return http_filter


def _quota_patches(istio: Sequence[Doc]) -> list[tuple[Doc, Doc]]:
    """(EnvoyFilter, patch) for every patch that adds the rate_limit_quota filter."""
    return [(d, p) for d in istio if d["kind"] == "EnvoyFilter"
            for p in d["spec"]["configPatches"]
            if p.get("patch", {}).get("value", {}).get("name") == QUOTA]


def _bucket_settings(typed_config: Doc) -> list[Doc]:
    return [m["on_match"]["action"]["typed_config"]
            for m in typed_config["bucket_matchers"]["matcher_list"]["matchers"]]


def check_quota_filter(fragment: Doc, kube: Sequence[Doc], istio: Sequence[Doc]) -> None:
    """One EnvoyFilter adds rate_limit_quota: right after ext_authz, on the workload the
    CUSTOM policy covers in full, with the fragment's config, pointed at the sitsmesh
    Service's RLQS port, failing open."""
    patches = _quota_patches(istio)
    assert len(patches) == 1, f"one patch adds {QUOTA}, found {len(patches)}"
    [(envoy_filter, patch)] = patches
    assert patch["applyTo"] == "HTTP_FILTER"
    assert patch["patch"]["operation"] == "INSERT_AFTER", "the headers come from ext_authz"
    match = patch["match"]
    assert match["context"] in ("SIDECAR_INBOUND", "GATEWAY")
    chain_filter = match["listener"]["filterChain"]["filter"]
    assert chain_filter["name"] == HCM
    assert chain_filter["subFilter"]["name"] == AUTHZ

    value = patch["patch"]["value"]
    config = value["typed_config"]
    assert config["rlqs_server"] == {"envoy_grpc": {
        "cluster_name": sitsmesh_cluster(kube, _rlqs_port())}}, \
        "Istio's cluster for sitsmesh's RLQS port"
    domain = config["domain"]
    assert isinstance(domain, str) and domain and "${" not in domain, domain
    for settings in _bucket_settings(config):
        # A token_bucket here crashes Envoy 1.40; a deny would fail closed.
        assert settings["no_assignment_behavior"] == {"fallback_rate_limit": ALLOW_ALL}
        assert settings["expired_assignment_behavior"]["fallback_rate_limit"] == ALLOW_ALL

    def apart_from_site(flt: Doc) -> Doc:
        typed = {k: v for k, v in flt["typed_config"].items() if k not in SITE_FIELDS}
        return {**flt, "typed_config": typed}
    assert apart_from_site(value) == apart_from_site(fragment), \
        "filters/fragments/rate_limit_quota.yaml and the EnvoyFilter drifted apart"

    # Only where every request went through ext_authz first: it strips client-sent
    # x-sits-* headers, and the buckets are keyed on the ones it sets.
    entry_policy(istio, envoy_filter)


def test_quota_filter_is_the_fragment_after_ext_authz_on_the_checked_workload() -> None:
    check_quota_filter(_fragment_filter(), kube_docs(), _istio())


_P = "spec.configPatches.0"
_T = f"{_P}.patch.value.typed_config"
_S = f"{_T}.bucket_matchers.matcher_list.matchers.0.on_match.action.typed_config"
_ID = f"{_S}.bucket_id_builder.bucket_id_builder"
_FRAGMENT_S = "typed_config.bucket_matchers.matcher_list.matchers.0.on_match.action.typed_config"
QUOTA_BREAKS: list[tuple[str, str, object]] = [
    ("filter", f"{_P}.patch.operation", "INSERT_BEFORE"),
    ("filter", f"{_P}.patch.operation", "INSERT_FIRST"),
    ("filter", f"{_P}.match.listener.filterChain.filter.subFilter.name",
     "envoy.filters.http.router"),
    ("filter", f"{_P}.match.context", "SIDECAR_OUTBOUND"),
    ("filter", f"{_P}.applyTo", "EXTENSION_CONFIG"),
    ("filter", f"{_T}.rlqs_server.envoy_grpc.cluster_name", "sitsmesh_data"),
    ("filter", f"{_T}.rlqs_server.envoy_grpc.cluster_name",
     "outbound|50052||sitsmesh.sitsmesh.svc.cluster.local"),
    ("filter", f"{_T}.domain", "${ratelimit_domain}"),
    ("filter", f"{_T}.domain", ""),
    ("filter", f"{_S}.no_assignment_behavior.fallback_rate_limit",
     {"token_bucket": {"max_tokens": 10, "tokens_per_fill": 10, "fill_interval": "1s"}}),
    ("filter", f"{_S}.expired_assignment_behavior.fallback_rate_limit",
     {"blanket_rule": "DENY_ALL"}),
    ("filter", f"{_S}.expired_assignment_behavior.expired_assignment_behavior_timeout", "5s"),
    ("filter", f"{_S}.deny_response_settings.http_status.code", 403),
    ("filter", f"{_S}.deny_response_settings.response_headers_to_add", DELETE),
    ("filter", f"{_ID}.model", DELETE),
    ("filter", f"{_ID}.tenant.custom_value.typed_config.header_name", "x-tenant"),
    ("filter", f"{_T}.bucket_matchers.matcher_list.matchers.0.predicate.single_predicate."
               "input.typed_config.header_name", "x-tenant"),
    ("filter", "spec.workloadSelector.labels", {"app": "other"}),
    ("filter", "metadata.namespace", "default"),
    ("policy", "spec.rules", [{"to": [{"operation": {"paths": ["/v2/*"]}}]}]),
    ("fragment", f"{_FRAGMENT_S}.deny_response_settings.http_status.code", 503),
]


@pytest.mark.parametrize(("where", "path", "value"), QUOTA_BREAKS,
                         ids=[f"{w}:{'.'.join(p.split('.')[-2:])}={'-' if v is DELETE else v}"
                              for w, p, v in QUOTA_BREAKS])
def test_quota_check_rejects_a_drifted_or_misplaced_filter(where: str, path: str,
                                                           value: object) -> None:
    fragment, kube, istio = _fragment_filter(), kube_docs(), _istio()
    if where == "fragment":
        target = fragment
    elif where == "policy":
        target = next(d for d in istio if d["kind"] == "AuthorizationPolicy"
                      and d["spec"].get("action") == "CUSTOM")
    else:
        [(target, _)] = _quota_patches(istio)
    break_at(target, path, value)
    with pytest.raises(AssertionError):
        check_quota_filter(fragment, kube, istio)


def test_the_envoy_filter_config_passes_the_real_envoy(tmp_path: Path) -> None:
    [(_, patch)] = _quota_patches(_istio())
    value = patch["patch"]["value"]
    config = istio_like_bootstrap(value, value["typed_config"]["rlqs_server"]["envoy_grpc"][
        "cluster_name"])
    names = [f["name"] for f in envoyconf.http_connection_manager(config)["http_filters"]]
    assert names == [AUTHZ, QUOTA, "envoy.filters.http.router"]
    result = validate(config, tmp_path / "istio-quota.yaml")
    assert result.returncode == 0, result.stderr[-3000:]


def test_envoy_validation_reads_the_bucket_settings(tmp_path: Path) -> None:
    """The check above can fail: a bad value deep in the bucket settings is refused."""
    [(_, patch)] = _quota_patches(_istio())
    value = copy.deepcopy(patch["patch"]["value"])
    _bucket_settings(value["typed_config"])[0]["no_assignment_behavior"][
        "fallback_rate_limit"] = {"blanket_rule": "ALLOW_SOME"}
    cluster = value["typed_config"]["rlqs_server"]["envoy_grpc"]["cluster_name"]
    result = validate(istio_like_bootstrap(value, cluster), tmp_path / "broken.yaml")
    assert result.returncode != 0
    assert "ALLOW_SOME" in result.stderr + result.stdout
