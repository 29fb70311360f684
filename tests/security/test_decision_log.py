"""The decision log never shows a credential: API keys (x-api-key, Bearer), a header the
operator marks secret, a JWT, or a key sent as a rate-limit descriptor, through real
Envoy (ext_authz and ratelimit) in front of a real `sitsmesh serve`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sitsmesh.dev import harness

pytestmark = pytest.mark.integration
CONFIG = harness.REPO / "filters" / "local" / "ratelimit"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlLXNlY3JldA"
ORG_SECRET = "org-credential-7f3a9c1e5b"




def _decisions(output: str) -> list[dict[str, Any]]:
    found = []
    for line in output.splitlines():
        if line.startswith("{") and '"event": "decision"' in line:
            found.append(json.loads(line))
    return found


def test_no_secret_reaches_the_decision_log(tmp_path: Path) -> None:
    node = harness.start_sitsmesh(
        tmp_path, "--ratelimit-config", str(CONFIG), "--log-format", "json",
        "--decision-log", "all", "--decision-log-mask", "x-org-credential",
        "--decision-log-headers", "x-api-key,authorization,x-org-credential,x-user,"
                                  "x-jwt-payload,x-trace-note")
    with harness.echo_upstream() as upstream:
        envoy = harness.start_envoy(tmp_path, node.data_addr, upstream,
                                    fragments=["ext_authz", "ratelimit"])
        try:
            assert node.cli("tenants", "create", "acme", "--models", "*").returncode == 0
            made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
            doc = json.loads(made.stdout)
            key, key_id = doc["key"], doc["id"]
            secret_part = key.rsplit("_", 1)[1]
            harness.wait_until(lambda: envoy.post_status("/v2/models/m/infer",
                                                         {"x-api-key": key}) == 200, 10,
                               "the key to be known")
            # Allowed with the key in x-api-key; a client sends a JWT and an operator
            # secret too, and the key again as its rate-limit user (an x-user header).
            assert envoy.post_status("/v2/models/m/infer?token=" + secret_part,
                                     {"x-api-key": key, "x-org-credential": ORG_SECRET,
                                      "x-jwt-payload": JWT, "x-user": key,
                                      "x-trace-note": "plain-note"}) == 200
            # A Bearer key, then a wrong key (denied by ext_authz: no rate-limit call).
            assert envoy.post_status("/v2/models/m/infer",
                                     {"authorization": f"Bearer {key}", "x-user": "alice"}) == 200
            assert envoy.post_status("/v2/models/m/infer",
                                     {"x-api-key": key[:-3] + "zzz", "x-user": "alice"}) == 401

            def logged() -> bool:
                kinds = [str(r["kind"]) for r in _decisions(node.output())]
                return kinds.count("authz") >= 4 and kinds.count("ratelimit") >= 2

            harness.wait_until(logged, 10, "the decision log to be flushed")
        finally:
            envoy.kill()
    node.stop()
    output = node.output()
    for secret in (key, secret_part, ORG_SECRET, JWT, JWT.split(".")[2]):
        assert secret not in output, f"a secret reached the log: {secret[:8]}..."
    records = _decisions(output)
    authz = [r for r in records if r["kind"] == "authz"]
    allowed = next(r for r in authz if isinstance(r.get("headers"), dict)
                   and r["headers"].get("x-trace-note") == "plain-note")
    assert allowed["decision"] == "allow" and allowed["tenant"] == "acme"
    assert allowed["api_key_id"] == key_id  # the key's id, which is no secret
    assert allowed["path"] == "/v2/models/m/infer"  # the query string is not logged
    assert allowed["headers"] == {"x-api-key": "[masked]", "x-org-credential": "[masked]",
                                  "x-user": "[masked]", "x-jwt-payload": "[masked]",
                                  "x-trace-note": "plain-note"}
    assert allowed["model"] == "m" and isinstance(allowed["latency_ms"], float)
    denied = [r for r in authz if r["decision"] == "deny"]
    assert denied and denied[0]["reason"] == "unauthenticated" and denied[0]["status"] == 401
    limits = [r for r in records if r["kind"] == "ratelimit"]
    assert ["user=[masked]"] in [r["descriptors"] for r in limits]
    assert ["user=alice"] in [r["descriptors"] for r in limits]
    assert all(r["domain"] == "sitsmesh-local" for r in limits)
