"""Envoy's sitsmesh_data cluster never opens more HTTP/2 streams on a connection than
sitsmesh allows (max_streams_per_connection): before Envoy reads sitsmesh's SETTINGS,
the extra streams of a cold burst are refused (measured: 20 of 250 token-stream reports
lost). The local bootstrap and the Istio DestinationRule both say so."""

from __future__ import annotations

import yaml

from sitsmesh.config import Settings
from sitsmesh.dev import envoyconf, harness

DEFAULT = Settings().max_streams_per_connection


def test_the_local_bootstrap_caps_streams_per_connection_at_sitsmeshs_limit() -> None:
    values = harness.envoy_values("127.0.0.1:50051", 18080, 10000, 9901)
    bootstrap = envoyconf.render(harness.REPO / "filters" / "local" / "bootstrap.yaml",
                                 values, ["ext_authz", "ext_proc"])
    [data] = [c for c in bootstrap["static_resources"]["clusters"]
              if c["name"] == "sitsmesh_data"]
    options = data["typed_extension_protocol_options"][envoyconf.HTTP_OPTIONS]
    assert options["explicit_http_config"]["http2_protocol_options"][
        "max_concurrent_streams"] == DEFAULT


def test_the_istio_destination_rule_caps_them_too() -> None:
    path = harness.REPO / "deploy" / "istio" / "sitsmesh-resilience.yaml"
    [rule] = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8"))
              if d and d["kind"] == "DestinationRule"]
    assert rule["spec"]["trafficPolicy"]["connectionPool"]["http"][
        "maxConcurrentStreams"] == DEFAULT
