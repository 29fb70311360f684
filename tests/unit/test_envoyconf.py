from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sitsmesh.dev import envoyconf
from sitsmesh.errors import ConfigError


def _tree(tmp_path: Path, bootstrap: str, **fragments: str) -> Path:
    (tmp_path / "local").mkdir()
    (tmp_path / "fragments").mkdir()
    (tmp_path / "fragments" / "router.yaml").write_text(
        "http_filter: {name: envoy.filters.http.router}\n")
    for name, text in fragments.items():
        (tmp_path / "fragments" / f"{name}.yaml").write_text(text)
    path = tmp_path / "local" / "bootstrap.yaml"
    path.write_text(bootstrap)
    return path


BOOT = """
x_sitsmesh_http_filters: [authz]
admin: {address: {socket_address: {address: 127.0.0.1, port_value: "${admin_port}"}}}
static_resources:
  listeners:
  - name: l
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config: {stat_prefix: "in-${zone}", http_filters: []}
"""


def test_substitutes_typed_values_and_splices_fragments_router_last(tmp_path: Path) -> None:
    path = _tree(tmp_path, BOOT, authz=(
        "http_filter: {name: authz, cluster: 'c-${zone}'}\n"
        "clusters: [{name: 'c-${zone}'}]\n"))
    out = envoyconf.render(path, {"admin_port": 9901, "zone": "a"})
    assert out["admin"]["address"]["socket_address"]["port_value"] == 9901
    hcm = out["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert hcm["typed_config"]["stat_prefix"] == "in-a"
    names = [f["name"] for f in hcm["typed_config"]["http_filters"]]
    assert names == ["authz", "envoy.filters.http.router"]
    assert out["static_resources"]["clusters"] == [{"name": "c-a"}]
    assert envoyconf.FRAGMENTS_KEY not in out


def test_fragment_list_can_be_overridden(tmp_path: Path) -> None:
    path = _tree(tmp_path, BOOT, authz="http_filter: {name: authz}\n")
    out = envoyconf.render(path, {"admin_port": 1, "zone": "z"}, fragments=[])
    hcm = out["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert [f["name"] for f in hcm["typed_config"]["http_filters"]] == [
        "envoy.filters.http.router"]


def test_missing_placeholder_value_is_an_error(tmp_path: Path) -> None:
    path = _tree(tmp_path, BOOT, authz="http_filter: {name: authz}\n")
    with pytest.raises(ConfigError, match=r"no value given for placeholder \$\{zone\}"):
        envoyconf.render(path, {"admin_port": 1})


def test_missing_fragment_is_an_error(tmp_path: Path) -> None:
    path = _tree(tmp_path, BOOT)
    with pytest.raises(ConfigError, match=r"authz\.yaml: cannot read"):
        envoyconf.render(path, {"admin_port": 1, "zone": "z"})


def test_fragment_without_http_filter_is_an_error(tmp_path: Path) -> None:
    path = _tree(tmp_path, BOOT, authz="clusters: []\n")
    with pytest.raises(ConfigError, match="a fragment needs one of the keys access_log, "
                                          "bootstrap, http_filter"):
        envoyconf.render(path, {"admin_port": 1, "zone": "z"})


def test_bootstrap_fragments_extend_lists_and_refuse_to_override(tmp_path: Path) -> None:
    sink = ("bootstrap:\n  stats_flush_interval: ${flush}\n"
            "  stats_sinks: [{name: a}]\n")
    path = _tree(tmp_path, BOOT, sink=sink, other="bootstrap:\n  stats_sinks: [{name: b}]\n")
    config = envoyconf.render(path, {"admin_port": 1, "zone": "z", "flush": "0.5s"},
                              ["sink", "other"])
    assert config["stats_flush_interval"] == "0.5s"
    assert config["stats_sinks"] == [{"name": "a"}, {"name": "b"}]
    (tmp_path / "fragments" / "again.yaml").write_text("bootstrap:\n  stats_flush_interval: 1s\n")
    with pytest.raises(ConfigError, match=r"again\.yaml: bootstrap field 'stats_flush_interval' "
                                          "is already set"):
        envoyconf.render(path, {"admin_port": 1, "zone": "z", "flush": "0.5s"},
                         ["sink", "again"])


def test_set_endpoints_lists_every_replica_in_order(tmp_path: Path) -> None:
    boot: dict[str, Any] = {
        "static_resources": {"clusters": [{"name": "other"}, {"name": "sitsmesh_data"}]}}
    envoyconf.set_endpoints(boot, "sitsmesh_data", ["127.0.0.1:5001", "10.0.0.2:5002"])
    cluster = boot["static_resources"]["clusters"][1]
    addrs = [e["endpoint"]["address"]["socket_address"]
             for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert addrs == [{"address": "127.0.0.1", "port_value": 5001},
                     {"address": "10.0.0.2", "port_value": 5002}]
    assert cluster["load_assignment"]["cluster_name"] == "sitsmesh_data"
    assert boot["static_resources"]["clusters"][0] == {"name": "other"}


def test_set_endpoints_refuses_an_unknown_cluster_or_no_endpoint() -> None:
    boot: dict[str, Any] = {"static_resources": {"clusters": [{"name": "a"}]}}
    with pytest.raises(ConfigError, match="no static cluster named 'b'"):
        envoyconf.set_endpoints(boot, "b", ["127.0.0.1:1"])
    with pytest.raises(ConfigError, match="cluster 'a': at least one endpoint is needed"):
        envoyconf.set_endpoints(boot, "a", [])
    assert boot == {"static_resources": {"clusters": [{"name": "a"}]}}
