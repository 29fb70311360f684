"""Envoy's sitsmesh_data cluster never opens more HTTP/2 streams on a connection than
sitsmesh allows (max_streams_per_connection): before Envoy reads sitsmesh's SETTINGS,
the extra streams of a cold burst are refused (measured: 20 of 250 token-stream reports
lost). And it pings each connection, so a frozen sitsmesh's streams fail within seconds
(tests/integration/test_stream_checks.py). The local bootstrap and the Istio objects
(DestinationRule, the resilience EnvoyFilter) say the same."""

from __future__ import annotations

import yaml

from sitsmesh.config import Settings
from sitsmesh.dev import envoyconf, harness

DEFAULT = Settings().max_streams_per_connection


def _local_http2() -> dict[str, object]:
    values = harness.envoy_values("127.0.0.1:50051", 18080, 10000, 9901)
    bootstrap = envoyconf.render(harness.REPO / "filters" / "local" / "bootstrap.yaml",
                                 values, ["ext_authz", "ext_proc"])
    [data] = [c for c in bootstrap["static_resources"]["clusters"]
              if c["name"] == "sitsmesh_data"]
    options: dict[str, object] = data["typed_extension_protocol_options"][
        envoyconf.HTTP_OPTIONS]["explicit_http_config"]["http2_protocol_options"]
    return options


def test_the_local_bootstrap_caps_streams_per_connection_at_sitsmeshs_limit() -> None:
    options = _local_http2()
    assert options["max_concurrent_streams"] == DEFAULT
    assert options["connection_keepalive"] == {"interval": "1s", "timeout": "1s"}


def test_the_istio_resilience_filter_gives_the_cluster_the_same_http2_options() -> None:
    path = harness.REPO / "deploy" / "istio" / "sitsmesh-resilience.yaml"
    [envoy_filter] = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8"))
                      if d and d["kind"] == "EnvoyFilter"]
    [cluster] = [p["patch"]["value"] for p in envoy_filter["spec"]["configPatches"]
                 if p["applyTo"] == "CLUSTER"]
    options = cluster["typed_extension_protocol_options"][envoyconf.HTTP_OPTIONS]
    assert options["explicit_http_config"]["http2_protocol_options"] == _local_http2()


def test_the_istio_destination_rule_caps_them_too() -> None:
    path = harness.REPO / "deploy" / "istio" / "sitsmesh-resilience.yaml"
    [rule] = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8"))
              if d and d["kind"] == "DestinationRule"]
    assert rule["spec"]["trafficPolicy"]["connectionPool"]["http"][
        "maxConcurrentStreams"] == DEFAULT
