"""Issue 18: an endpoint picker (GIE EPP, llm-d) behind sitsmesh schedules on
x-gateway-inference-fairness-id and x-gateway-inference-objective. A client that sets them
itself would pick its own fairness bucket and priority class; through real Envoy and real
sitsmesh, the upstream must see sitsmesh's values or none.
"""

from __future__ import annotations

import http.client
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sitsmesh.dev import harness

pytestmark = pytest.mark.integration

OBJECTIVE = "x-gateway-inference-objective"
FAIRNESS = "x-gateway-inference-fairness-id"
FORGED = {OBJECTIVE: "premium", FAIRNESS: "gold"}
INFER = "/v2/models/bert/infer"


class _AllValues(BaseHTTPRequestHandler):
    """Echoes every value of every request header: a forged copy left beside sitsmesh's
    value must show (harness.echo_upstream keeps one value per name)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        seen: dict[str, list[str]] = {}
        for name, value in self.headers.items():
            seen.setdefault(name.lower(), []).append(value)
        payload = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


@dataclass
class Stack:
    keys: dict[str, str]
    envoy: harness.Envoy


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gie")
    with harness.serving(ThreadingHTTPServer(("127.0.0.1", 0), _AllValues)) as upstream:
        node = harness.start_sitsmesh(tmp, "--gie-priority-objectives", "6=interactive")
        envoy: harness.Envoy | None = None
        try:
            keys = {}
            for args in (("gold", "--priority", "1", "--label", "inference-objective=premium"),
                         ("plain", "--priority", "3", "--max-priority", "5"),
                         ("fast", "--priority", "7")):
                done = node.cli("tenants", "create", *args, "--models", "bert")
                assert done.returncode == 0, done.stderr
                made = node.cli("apikeys", "create", "--tenant", args[0], "--output", "json")
                assert made.returncode == 0, made.stderr
                keys[args[0]] = json.loads(made.stdout)["key"]
            envoy = harness.start_envoy(tmp, node.data_addr, upstream, fragments=["ext_authz"])
            yield Stack(keys, envoy)
        finally:
            if envoy is not None:
                envoy.kill()
            node.kill()


def _seen(stack: Stack, tenant: str, headers: dict[str, str]) -> dict[str, list[str]]:
    """Every value of every request header the upstream received."""
    req = urllib.request.Request(stack.envoy.url(INFER), data=b"{}", method="POST",
                                 headers={"x-api-key": stack.keys[tenant], **headers})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
        seen: dict[str, list[str]] = json.loads(resp.read())
    return seen


def test_forged_values_are_overwritten_with_the_tenants(stack: Stack) -> None:
    seen = _seen(stack, "fast", FORGED)
    assert seen[FAIRNESS] == ["fast"]
    assert seen[OBJECTIVE] == ["interactive"], "priority 7 maps to the objective of 6"
    labelled = _seen(stack, "gold", {OBJECTIVE: "batch", FAIRNESS: "fast"})
    assert labelled[FAIRNESS] == ["gold"] and labelled[OBJECTIVE] == ["premium"]
    assert labelled["x-sits-tenant"] == ["gold"]


def test_forged_objective_is_removed_when_sitsmesh_has_none(stack: Stack) -> None:
    # plain may ask for priority 5 at most: asking 9 neither reaches the objective of 6
    # nor lets the client's own objective through.
    seen = _seen(stack, "plain", {**FORGED, "x-priority": "9"})
    assert seen[FAIRNESS] == ["plain"]
    assert OBJECTIVE not in seen
    assert seen["x-sits-priority"] == ["5"]


@pytest.mark.parametrize(("tenant", "objective"), [("plain", None), ("fast", "interactive")])
def test_repeated_forged_headers_leave_no_copy(stack: Stack, tenant: str,
                                               objective: str | None) -> None:
    # Each header twice, in mixed case: no second copy may survive the overwrite or removal.
    conn = http.client.HTTPConnection("127.0.0.1", stack.envoy.listen_port, timeout=5)
    try:
        conn.putrequest("POST", INFER)
        conn.putheader("x-api-key", stack.keys[tenant])
        for value in ("premium", "batch"):
            conn.putheader("X-Gateway-Inference-Objective", value)
            conn.putheader("X-Gateway-Inference-Fairness-Id", value)
        conn.putheader("content-length", "2")
        conn.endheaders(b"{}")
        resp = conn.getresponse()
        assert resp.status == 200
        seen = json.loads(resp.read())
    finally:
        conn.close()
    assert seen[FAIRNESS] == [tenant]
    assert seen.get(OBJECTIVE) == ([objective] if objective else None)
