"""One Envoy per variant with one listener per hop of a scenario's pipeline.

Rendered from filters/local/bootstrap.yaml with the ext_authz, access_log and
metrics_service fragments (sitsmesh.dev.envoyconf), then its listener is copied
once per hop, as tests/chainstack.py does:

    client -> L1 (ext_authz, [adaptive_concurrency], access_log) --cluster pre--> pre
           -> L2 (access_log) --cluster svc--> svc ...

Each hop's route goes to a cluster named after its stage, so a pipeline matches its
stages by `upstream_cluster`. Only the entry listener authorises and admits (that is
where shedding happens); every listener logs, so sitsmesh sees each hop's latency.
The access-log flush is the variable under test; the stats sink (Envoy's per-cluster
gauges pushed to sitsmesh) is the same in every variant. With several sitsmesh replicas,
all of them are endpoints of the one `sitsmesh_data` cluster, as a mesh would list them:
Envoy spreads Checks over them; each of its access-log and stats streams stays on one.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from sitsmesh.dev import envoyconf, harness

HCM = "envoy.filters.network.http_connection_manager"
SITSMESH_CLUSTER = "sitsmesh_data"  # filters/local/bootstrap.yaml's name for sitsmesh
EXT_AUTHZ = "envoy.filters.http.ext_authz"
FRAGMENTS = ["ext_authz", "access_log", "metrics_service"]
STATS_FLUSH = "0.25s"
# Envoy's adaptive concurrency filter with the settings of its documentation's example:
# the gradient controller, p90 samples, 0.1 s updates, minRTT from 50 requests every 60 s
# with 10 % jitter, default buffer 25 % and min concurrency 3; 503 when over the limit.
ADAPTIVE_FILTER: dict[str, Any] = {
    "name": "envoy.filters.http.adaptive_concurrency",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.adaptive_concurrency.v3"
                 ".AdaptiveConcurrency",
        "gradient_controller_config": {
            "sample_aggregate_percentile": {"value": 90},
            "concurrency_limit_params": {"concurrency_update_interval": "0.1s"},
            "min_rtt_calc_params": {"jitter": {"value": 10}, "interval": "60s",
                                    "request_count": 50},
        },
        "enabled": {"default_value": True, "runtime_key": "adaptive_concurrency.enabled"},
    },
}
AC_LIMIT_BODY = "reached concurrency limit"


@dataclass(frozen=True)
class Hop:
    listener: str       # L1 is the entry
    cluster: str        # the stage behind it; the pipeline matches it by upstream_cluster
    listen_port: int
    upstream_port: int


def bootstrap(sitsmesh_addrs: Sequence[str], hops: list[Hop], admin_port: int, *,
              access_log_flush: str, adaptive: bool) -> dict[str, Any]:
    entry = hops[0]
    values = envoyconf.local_values(
        sitsmesh_addr=sitsmesh_addrs[0], upstream_port=entry.upstream_port,
        listen_port=entry.listen_port, envoy_admin_port=admin_port,
        # Envoy must see sitsmesh healthy before the first Check: probe it often.
        health_interval="0.25s", access_log_flush=access_log_flush, stats_flush=STATS_FLUSH)
    base = envoyconf.render(harness.REPO / "filters" / "local" / "bootstrap.yaml", values,
                            FRAGMENTS)
    if len(sitsmesh_addrs) > 1:
        envoyconf.set_endpoints(base, SITSMESH_CLUSTER, sitsmesh_addrs)
    resources = base["static_resources"]
    template = resources["listeners"][0]
    listeners = []
    for i, hop in enumerate(hops):
        listener = copy.deepcopy(template)
        listener["name"] = hop.listener
        listener["address"]["socket_address"]["port_value"] = hop.listen_port
        hcm = _hcm(listener)
        hcm["stat_prefix"] = hop.listener
        hcm["generate_request_id"] = True          # the entry makes one...
        hcm["preserve_external_request_id"] = True  # ...and every hop keeps it
        route = hcm["route_config"]
        route["name"] = hop.listener
        for vhost in route["virtual_hosts"]:
            for entry_route in vhost["routes"]:
                entry_route["name"] = hop.cluster
                entry_route["route"]["cluster"] = hop.cluster
                entry_route["route"].pop("rate_limits", None)
        filters = hcm["http_filters"]
        if i > 0:  # inner hops: the stage's caller is the pipeline, not a tenant
            filters[:] = [f for f in filters if f["name"] != EXT_AUTHZ]
        elif adaptive:
            filters.insert(len(filters) - 1, copy.deepcopy(ADAPTIVE_FILTER))  # before router
        listeners.append(listener)
    resources["listeners"] = listeners
    clusters = [c for c in resources["clusters"] if c["name"] != "upstream"]
    for hop in hops:
        clusters.append({
            "name": hop.cluster, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": hop.cluster, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": hop.upstream_port}}}}]}]}})
    resources["clusters"] = clusters
    return base


def _hcm(listener: dict[str, Any]) -> dict[str, Any]:
    for chain in listener["filter_chains"]:
        for flt in chain["filters"]:
            if flt["name"] == HCM:
                return cast(dict[str, Any], flt["typed_config"])
    raise ValueError("listener without an http_connection_manager")


def start_envoy(tmp: Path, name: str, sitsmesh_addrs: Sequence[str], hops: list[Hop], *,
                access_log_flush: str, adaptive: bool) -> harness.Envoy:
    """A fresh Envoy, returned once it is live and sees every sitsmesh replica healthy."""
    admin = harness.free_port()
    path = envoyconf.write(bootstrap(sitsmesh_addrs, hops, admin,
                                     access_log_flush=access_log_flush, adaptive=adaptive),
                           tmp / f"envoy-{name}.yaml")
    envoy = harness.launch_envoy(path, hops[0].listen_port, admin, tmp / f"envoy-{name}.log")
    try:
        # ext_authz fails closed: the sitsmesh_data cluster must be healthy first, and
        # every replica in it, or the first Checks would all go to the ones that are.
        healthy = ["healthy"] * len(sitsmesh_addrs)
        harness.wait_until(lambda: envoy.cluster_health(SITSMESH_CLUSTER) == healthy, 10,
                           f"envoy ({name}) to see sitsmesh healthy")
    except BaseException:
        envoy.kill()
        raise
    return envoy
