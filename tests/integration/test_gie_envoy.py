"""Inference Extension headers end to end: real Envoy's ext_authz filter applies what
Check decides, with renamed headers, and leaves them alone when the feature is off."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

from sitsmesh.dev import harness

Start = Callable[..., harness.Sitsmesh]


def _stack(tmp: Path, start: Start, upstream: int, *extra: str) -> tuple[harness.Envoy, str]:
    node = start(*extra)
    done = node.cli("tenants", "create", "acme", "--models", "bert", "--priority", "2",
                    "--max-priority", "8")
    assert done.returncode == 0, done.stderr
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    assert made.returncode == 0, made.stderr
    envoy = harness.start_envoy(tmp, node.data_addr, upstream, fragments=["ext_authz"])
    return envoy, json.loads(made.stdout)["key"]


def _seen(envoy: harness.Envoy, headers: dict[str, str]) -> dict[str, str]:
    req = urllib.request.Request(envoy.url("/v2/models/bert/infer"), data=b"{}",
                                 method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
        seen: dict[str, str] = json.loads(resp.read())["headers"]
    return seen


def test_renamed_headers_follow_the_asked_priority(tmp_path: Path, start_sitsmesh: Start,
                                                  upstream: int) -> None:
    envoy, key = _stack(tmp_path, start_sitsmesh, upstream,
                        "--gie-objective-header", "x-objective",
                        "--gie-fairness-header", "x-flow",
                        "--gie-priority-objectives", "0=batch,5=interactive")
    try:
        # Several calls per decision: the servicer's cached reply must carry the values
        # of its own decision, whatever the client sent this time.
        for forged in ("interactive", "premium"):
            low = _seen(envoy, {"x-api-key": key, "x-objective": forged, "x-flow": "x"})
            assert low["x-flow"] == "acme" and low["x-objective"] == "batch"
            assert "x-gateway-inference-objective" not in low
        high = _seen(envoy, {"x-api-key": key, "x-priority": "6", "x-objective": "batch"})
        assert high["x-objective"] == "interactive" and high["x-sits-priority"] == "6"
    finally:
        envoy.kill()


def test_off_passes_client_values_through_untouched(tmp_path: Path, start_sitsmesh: Start,
                                                   upstream: int) -> None:
    envoy, key = _stack(tmp_path, start_sitsmesh, upstream, "--gie-headers", "false",
                        "--gie-priority-objectives", "0=batch")
    try:
        seen = _seen(envoy, {"x-api-key": key, "x-gateway-inference-objective": "mine"})
        assert seen["x-gateway-inference-objective"] == "mine"
        assert "x-gateway-inference-fairness-id" not in seen
        assert seen["x-sits-tenant"] == "acme"
    finally:
        envoy.kill()
