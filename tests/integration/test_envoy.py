"""A real Envoy in front of an upstream, pointed at a real `sitsmesh serve`."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from grpc_health.v1 import health_pb2

from sitsmesh.dev import envoyconf, harness

FILTERS = harness.REPO / "filters"


def test_http_through_envoy_reaches_upstream_and_sitsmesh_is_serving(
    envoy: harness.Envoy, sitsmesh: harness.Sitsmesh
) -> None:
    req = urllib.request.Request(envoy.url("/v2/models/demo/infer"), data=b'{"x": 1}',
                                 method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
        echoed = json.loads(resp.read())
    assert echoed["path"] == "/v2/models/demo/infer"
    assert echoed["body"] == '{"x": 1}'
    assert echoed["headers"]["x-request-id"], "Envoy should stamp a request id"

    assert harness.health_status(sitsmesh.data_addr) == health_pb2.HealthCheckResponse.SERVING
    # Envoy itself talks to sitsmesh: its active gRPC health check marks the host healthy.
    harness.wait_until(lambda: envoy.cluster_health("sitsmesh_data") == ["healthy"], 10,
                       "Envoy to see sitsmesh healthy")


def test_envoy_sees_sitsmesh_drain_and_keeps_serving_traffic(
    tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh], upstream: int
) -> None:
    node: harness.Sitsmesh = start_sitsmesh(drain=3.0)
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream)
    try:
        harness.wait_until(lambda: envoy.cluster_health("sitsmesh_data") == ["healthy"], 10,
                           "healthy")
        node.proc.send_signal(signal.SIGTERM)
        # Health flips to NOT_SERVING at the start of the drain window, before the
        # listener closes, so Envoy stops choosing this host while it still answers.
        harness.wait_until(
            lambda: "failed_active_hc" in "".join(envoy.cluster_health("sitsmesh_data")), 3,
            "Envoy to fail the health check during the drain window")
        assert node.proc.poll() is None, "still draining when Envoy noticed"
        with urllib.request.urlopen(envoy.url("/still-up"), timeout=5) as resp:
            assert resp.status == 200
        assert node.proc.wait(20) == 0
    finally:
        envoy.kill()
        node.kill()


def _bootstraps() -> list[Path]:
    return sorted(FILTERS.glob("*/bootstrap*.yaml"))


def test_filters_dir_has_bootstraps_and_fragments() -> None:
    assert _bootstraps(), "filters/ should hold at least the local bootstrap"
    assert (FILTERS / "fragments" / "router.yaml").is_file()


@pytest.mark.parametrize("bootstrap", _bootstraps(), ids=lambda p: str(p.relative_to(FILTERS)))
def test_every_envoy_config_validates_with_the_real_binary(
    bootstrap: Path, tmp_path: Path
) -> None:
    fragments = sorted(p.stem for p in (FILTERS / "fragments").glob("*.yaml"))
    values = harness.envoy_values("127.0.0.1:50051", 18080, 10000, 9901)
    for variant, names in (("template", None), ("all-fragments", fragments),
                           ("three-replicas", fragments)):
        config = envoyconf.render(bootstrap, values, names)
        if variant == "three-replicas":
            envoyconf.set_endpoints(config, "sitsmesh_data",
                                    ["127.0.0.1:50051", "127.0.0.1:50061", "127.0.0.1:50071"])
        out = envoyconf.write(config, tmp_path / f"{variant}.yaml")
        result = subprocess.run(
            [harness.ENVOY, "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
            capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, f"{bootstrap} ({variant}):\n{result.stderr[-3000:]}"
        assert "OK" in result.stdout + result.stderr


def test_istio_resilience_patches_are_valid_envoy_config(tmp_path: Path) -> None:
    """deploy/istio/sitsmesh-resilience.yaml's Envoy fields, applied the way Istio's MERGE
    would to our own sitsmesh cluster and ext_authz filter, pass the real binary."""
    [_, envoy_filter] = yaml.safe_load_all(
        (harness.REPO / "deploy" / "istio" / "sitsmesh-resilience.yaml").read_text())
    cluster_patch, filter_patch = (p["patch"]["value"]
                                   for p in envoy_filter["spec"]["configPatches"])
    values = harness.envoy_values("127.0.0.1:50051", 18080, 10000, 9901)
    config = envoyconf.render(FILTERS / "local" / "bootstrap.yaml", values, ["ext_authz"])
    [cluster] = [c for c in config["static_resources"]["clusters"]
                 if c["name"] == "sitsmesh_data"]
    cluster.update(cluster_patch)
    authz = envoyconf.http_connection_manager(config)["http_filters"][0]
    assert authz["name"] == filter_patch["name"]
    authz["typed_config"]["grpc_service"]["retry_policy"] = (
        filter_patch["typed_config"]["grpc_service"]["retry_policy"])
    out = envoyconf.write(config, tmp_path / "istio-patched.yaml")
    result = subprocess.run(
        [harness.ENVOY, "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


def test_validate_rejects_a_broken_config(tmp_path: Path) -> None:
    """The validation test above can fail: Envoy rejects a config with a bad field."""
    values = harness.envoy_values("127.0.0.1:50051", 18080, 10000, 9901)
    config = envoyconf.render(FILTERS / "local" / "bootstrap.yaml", values)
    config["static_resources"]["clusters"][0]["connect_timeout"] = "not-a-duration"
    out = envoyconf.write(config, tmp_path / "broken.yaml")
    result = subprocess.run(
        [harness.ENVOY, "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
