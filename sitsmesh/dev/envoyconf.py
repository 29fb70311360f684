"""Render Envoy bootstraps from filters/: a template plus HTTP filter fragments."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import yaml

from sitsmesh.errors import ConfigError

FRAGMENTS_KEY = "x_sitsmesh_http_filters"
# What a fragment may bring: an HTTP filter, an access log, clusters, and top-level
# bootstrap fields (stats sinks and their flush interval).
FRAGMENT_KEYS = frozenset({"http_filter", "access_log", "bootstrap"})
_PLACEHOLDER = re.compile(r"\$\{([a-z_][a-z0-9_]*)\}")
_WHOLE = re.compile(r"^\$\{([a-z_][a-z0-9_]*)\}$")


def _substitute(node: Any, values: Mapping[str, object], source: Path) -> Any:
    if isinstance(node, dict):
        return {k: _substitute(v, values, source) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, values, source) for v in node]
    if not isinstance(node, str):
        return node

    def lookup(name: str) -> object:
        if name not in values:
            raise ConfigError(f"{source}: no value given for placeholder ${{{name}}}")
        return values[name]

    whole = _WHOLE.match(node)
    if whole:  # keep the value's type, so ports stay integers
        return lookup(whole.group(1))
    return _PLACEHOLDER.sub(lambda m: str(lookup(m.group(1))), node)


def _load(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None


def local_values(*, sitsmesh_addr: str, upstream_port: int, listen_port: int,
                 envoy_admin_port: int, health_interval: str = "1s",
                 ratelimit_domain: str = "sitsmesh-local",
                 upstream_host: str = "127.0.0.1", access_log_flush: str = "1s",
                 stats_flush: str = "0.25s") -> dict[str, object]:
    """The placeholder values of filters/local/bootstrap.yaml and its fragments."""
    host, _, port = sitsmesh_addr.rpartition(":")
    return {"envoy_admin_port": envoy_admin_port, "listen_port": listen_port,
            "upstream_host": upstream_host, "upstream_port": upstream_port,
            "sitsmesh_host": host, "sitsmesh_port": int(port),
            "health_interval": health_interval, "ratelimit_domain": ratelimit_domain,
            "access_log_flush": access_log_flush, "stats_flush": stats_flush}


def http_connection_manager(bootstrap: dict[str, Any], source: Path | str = "bootstrap"
                            ) -> dict[str, Any]:
    """The typed config of the first HTTP connection manager, to edit in place."""
    for listener in bootstrap.get("static_resources", {}).get("listeners", []):
        for chain in listener.get("filter_chains", []):
            for flt in chain.get("filters", []):
                if flt.get("name") == "envoy.filters.network.http_connection_manager":
                    return cast(dict[str, Any], flt["typed_config"])
    raise ConfigError(f"{source}: no http_connection_manager listener to put filters in")


def render(bootstrap_path: Path, values: Mapping[str, object],
           fragments: list[str] | None = None) -> dict[str, Any]:
    """Return the bootstrap as a dict, ready to dump as YAML for `envoy -c`.

    `fragments` overrides the template's own list (x_sitsmesh_http_filters).
    """
    bootstrap = _load(bootstrap_path)
    if not isinstance(bootstrap, dict):
        raise ConfigError(f"{bootstrap_path}: top level must be a mapping")
    names: list[str] = bootstrap.pop(FRAGMENTS_KEY, None) or []
    if fragments is not None:
        names = fragments
    names = [n for n in names if n != "router"] + ["router"]
    bootstrap = cast(dict[str, Any], _substitute(bootstrap, values, bootstrap_path))
    fragment_dir = bootstrap_path.parent.parent / "fragments"
    http_filters: list[Any] = []
    access_logs: list[Any] = []
    clusters = bootstrap.setdefault("static_resources", {}).setdefault("clusters", [])
    for name in names:
        path = fragment_dir / f"{name}.yaml"
        fragment = _load(path)
        if not isinstance(fragment, dict) or not FRAGMENT_KEYS & set(fragment):
            raise ConfigError(f"{path}: a fragment needs one of the keys "
                              f"{', '.join(sorted(FRAGMENT_KEYS))}")
        fragment = _substitute(fragment, values, path)
        if "http_filter" in fragment:
            http_filters.append(fragment["http_filter"])
        if "access_log" in fragment:
            access_logs.append(fragment["access_log"])
        clusters.extend(fragment.get("clusters", []))
        _merge_bootstrap(bootstrap, fragment.get("bootstrap", {}), path)
    hcm = http_connection_manager(bootstrap, bootstrap_path)
    hcm["http_filters"] = http_filters
    if access_logs:
        hcm.setdefault("access_log", []).extend(access_logs)
    return bootstrap


def _merge_bootstrap(bootstrap: dict[str, Any], extra: Any, source: Path) -> None:
    """Top-level fields of a fragment: lists (stats_sinks) extend, anything else is set,
    and a field two fragments both set is an error rather than a silent override."""
    if not isinstance(extra, dict):
        raise ConfigError(f"{source}: bootstrap must be a mapping of top-level fields")
    for key, value in extra.items():
        if isinstance(value, list):
            bootstrap.setdefault(key, []).extend(value)
        elif key in bootstrap:
            raise ConfigError(f"{source}: bootstrap field {key!r} is already set")
        else:
            bootstrap[key] = value


def set_endpoints(bootstrap: dict[str, Any], cluster: str, addrs: Sequence[str]) -> None:
    """Make host:port addresses the endpoints of static cluster `cluster`, in order."""
    if not addrs:
        raise ConfigError(f"cluster {cluster!r}: at least one endpoint is needed")
    for entry in bootstrap.get("static_resources", {}).get("clusters", []):
        if entry.get("name") == cluster:
            entry["load_assignment"] = {"cluster_name": cluster, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {
                    "address": host, "port_value": int(port)}}}}
                for host, _, port in (addr.rpartition(":") for addr in addrs)]}]}
            return
    raise ConfigError(f"no static cluster named {cluster!r}")


def use_rlqs_addr(bootstrap: dict[str, Any], addr: str) -> None:
    """Send the rate_limit_quota filter's stream to sitsmesh's rlqs_addr: a cluster
    `sitsmesh_rlqs`, sitsmesh_data's settings (HTTP/2, health checks) at that address."""
    clusters = bootstrap.get("static_resources", {}).get("clusters", [])
    data = next((c for c in clusters if c.get("name") == "sitsmesh_data"), None)
    if data is None:
        raise ConfigError("no static cluster named 'sitsmesh_data' to copy for RLQS")
    clusters.append({**copy.deepcopy(data), "name": "sitsmesh_rlqs"})
    set_endpoints(bootstrap, "sitsmesh_rlqs", [addr])
    for flt in http_connection_manager(bootstrap).get("http_filters", []):
        if flt.get("name") == "envoy.filters.http.rate_limit_quota":
            flt["typed_config"]["rlqs_server"] = {"envoy_grpc": {"cluster_name": "sitsmesh_rlqs"}}
            return
    raise ConfigError("no rate_limit_quota filter to point at rlqs_addr")


def add_route(bootstrap: dict[str, Any], *, name: str, prefix: str, host: str,
              port: int, timeout: str = "30s", http2: bool = False) -> None:
    """Route `prefix` to a new static cluster `name` at host:port, ahead of the catch-all.

    The cluster has the template's `upstream` cluster's buffer limit; `http2`: it speaks
    HTTP/2 (gRPC) with the connection manager's flow-control windows, so an engine
    cannot push more ahead of a slow client than a client can push ahead of Envoy
    (filters/fragments/ext_proc.yaml). `timeout` "0s": none, for streaming routes."""
    manager = http_connection_manager(bootstrap)
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(0, {"name": name, "match": {"prefix": prefix},
                      "route": {"cluster": name, "timeout": timeout}})
    clusters = bootstrap["static_resources"]["clusters"]
    cluster: dict[str, Any] = {
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {
                "address": host, "port_value": port}}}}]}]}}
    template: dict[str, Any] = next((c for c in clusters if c.get("name") == "upstream"), {})
    if "per_connection_buffer_limit_bytes" in template:
        cluster["per_connection_buffer_limit_bytes"] = template[
            "per_connection_buffer_limit_bytes"]
    if http2:
        windows = {k: v for k, v in manager.get("http2_protocol_options", {}).items()
                   if k.startswith("initial_")}
        cluster["typed_extension_protocol_options"] = {HTTP_OPTIONS: {
            "@type": f"type.googleapis.com/{HTTP_OPTIONS}",
            "explicit_http_config": {"http2_protocol_options": windows}}}
    clusters.append(cluster)


HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


EXT_PROC = "envoy.filters.http.ext_proc"


def ext_proc_only_on(bootstrap: dict[str, Any], route_names: Sequence[str]) -> None:
    """Turn the ext_proc filter off on every route but `route_names`: only streaming
    routes should copy their bodies to sitsmesh (the fragment's advice)."""
    _ext_proc_only_on(bootstrap, EXT_PROC, route_names)


def _ext_proc_only_on(bootstrap: dict[str, Any], filter_name: str,
                      route_names: Sequence[str]) -> list[dict[str, Any]]:
    """ExtProcPerRoute `disabled` for ext_proc filter `filter_name` on every route but
    `route_names`; those routes."""
    kept = []
    for host in http_connection_manager(bootstrap)["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            if route.get("name") in route_names:
                kept.append(route)
                continue
            route.setdefault("typed_per_filter_config", {})[filter_name] = {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3"
                         ".ExtProcPerRoute", "disabled": True}
    return kept


def ext_proc_streaming_only(bootstrap: dict[str, Any]) -> None:
    """Run the ext_proc filter only for requests Check classed as streaming
    (`x-sits-request-class: stream`: OpenAI `"stream": true`, Triton `generate_stream`),
    so a `"stream": false` call on a streaming route is never copied to sitsmesh. For a
    hop behind ext_authz on the same Envoy: elsewhere the header may be absent."""
    filters = http_connection_manager(bootstrap)["http_filters"]
    at = next(i for i, f in enumerate(filters) if f["name"] == EXT_PROC)
    filters[at] = {"name": EXT_PROC, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.common.matching.v3"
                 ".ExtensionWithMatcher",
        "extension_config": filters[at],
        "xds_matcher": {"matcher_list": {"matchers": [{
            "predicate": {"not_matcher": {"single_predicate": {
                "input": {"name": "request-class", "typed_config": {
                    "@type": "type.googleapis.com/envoy.type.matcher.v3"
                             ".HttpRequestHeaderMatchInput",
                    "header_name": "x-sits-request-class"}},
                "value_match": {"exact": "stream"}}}},
            "on_match": {"action": {"name": "skip", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.common.matcher"
                         ".action.v3.SkipFilter"}}}}]}}}}


STREAM_CHECK = "sitsmesh.grpc_stream_check"
EXT_AUTHZ = "envoy.filters.http.ext_authz"


def stream_checks_on(bootstrap: dict[str, Any], route_names: Sequence[str]) -> None:
    """Check the messages of the gRPC streams on `route_names` one by one (the
    grpc_stream_check fragment): ext_authz there checks the headers only, and tells
    Check so; every other route skips the filter."""
    for route in _ext_proc_only_on(bootstrap, STREAM_CHECK, route_names):
        route.setdefault("typed_per_filter_config", {})[EXT_AUTHZ] = {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3"
                     ".ExtAuthzPerRoute",
            "check_settings": {"disable_request_body_buffering": True,
                               "context_extensions": {
                                   "sitsmesh_stream_check": "per_message"}}}


FRAGMENT_DIR = Path(__file__).resolve().parents[2] / "filters" / "fragments"
RATELIMIT_TOKENS = "sitsmesh.ratelimit_tokens"


def charge_tokens_on(bootstrap: dict[str, Any], route_names: Sequence[str],
                     fragment: Path = FRAGMENT_DIR / "ratelimit_tokens.yaml") -> None:
    """Give the ratelimit_tokens filter, on `route_names`, the fragment's
    `route_rate_limits` (a check on the request, a charge when the stream is done): as
    its RateLimitPerRoute, the form whose hits_addend Envoy sends. Routes are the
    template's, so render cannot splice them."""
    loaded = _load(fragment)
    entries = loaded.get("route_rate_limits") if isinstance(loaded, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{fragment}: no route_rate_limits to put on routes")
    found: set[str] = set()
    for host in http_connection_manager(bootstrap)["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            if route.get("name") in route_names and "route" in route:
                found.add(route["name"])
                route.setdefault("typed_per_filter_config", {})[RATELIMIT_TOKENS] = {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit"
                             ".v3.RateLimitPerRoute",
                    "rate_limits": copy.deepcopy(entries)}
    missing = [name for name in route_names if name not in found]
    if missing:
        raise ConfigError(f"no forwarding route named {', '.join(map(repr, missing))} "
                          "to charge on")


def write(bootstrap: dict[str, Any], out: Path) -> Path:
    out.write_text(yaml.safe_dump(bootstrap, sort_keys=False), encoding="utf-8")
    return out
