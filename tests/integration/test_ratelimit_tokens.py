"""Tokens charged by Envoy's own ratelimit filter (filters/fragments/ratelimit_tokens.yaml)
through real Envoy, with the token-timing filter counting a streaming stage's tokens and
real sitsmesh answering ShouldRateLimit from an envoyproxy/ratelimit config: each stream
is charged its tokens once it is done, a spent budget gets 429 from the filter, and a
stream the client cut is charged what the filter had counted.

The client sends x-sits-tenant itself: the ratelimit filter reads the header whoever set
it, and Check setting it is tests/integration/test_token_budgets.py's; without ext_authz
no TokenBudget can refuse first, so every 429 here is the ratelimit filter's."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sitsmesh.dev import envoyconf, harness
from sitsmesh.dev.tokenstage import CONTENT_MARK, TokenStage, read_tokens

pytestmark = pytest.mark.integration
LIMIT = 100  # tokens per hour per tenant: no window turns over during a test
TOKENS = 20
CONFIG = f"""domain: sitsmesh-local
descriptors:
  - key: tenant
    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}
"""


@dataclass
class Stack:
    node: harness.Sitsmesh
    envoy: harness.Envoy
    stage: TokenStage

    def total(self, name: str, **labels: str) -> float:
        """The sum of every sample of `name` with these labels."""
        return sum(s.value for f in text_string_to_metric_families(self.node.metrics())
                   for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def charged(self) -> float:
        """Hits counted by sitsmesh: the request-time checks add 0, so only charges."""
        return self.total("sitsmesh_ratelimit_hits_total", outcome="total_hits")


@pytest.fixture
def stack(tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh]) -> Iterator[Stack]:
    (tmp_path / "tokens.yaml").write_text(CONFIG)
    node = start_sitsmesh("--ratelimit-config", str(tmp_path / "tokens.yaml"))
    stage = TokenStage(ttft_s=0.01, itl_s=0.002, tokens=TOKENS).start()
    envoy = harness.start_envoy(
        tmp_path, node.data_addr, stage.port,
        fragments=["token_timing", "access_log", "ratelimit_tokens"],
        edit=lambda config: envoyconf.charge_tokens_on(config, ["upstream"]))
    # A few seconds of streams in one hour window (the limit is per hour).
    if time.time() % 3600 > 3570:
        time.sleep(3601 - time.time() % 3600)
    yield Stack(node, envoy, stage)
    envoy.kill()
    stage.stop()


def _open(envoy: harness.Envoy, tenant: str, **headers: str
          ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": "stage", "stream": True, "max_tokens": TOKENS,
        "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"content-type": "application/json", "x-sits-tenant": tenant, **headers})
    return conn, conn.getresponse()


def _stream(envoy: harness.Envoy, tenant: str) -> tuple[int, dict[str, str], int]:
    """Status, headers and content tokens of one whole stream."""
    conn, response = _open(envoy, tenant)
    body = response.read()
    conn.close()
    headers = {k.lower(): v for k, v in response.getheaders()}
    return response.status, headers, body.count(CONTENT_MARK)


def _over_limit(envoy: harness.Envoy) -> int:
    stats = envoy.admin_get("/stats?filter=ratelimit.over_limit")
    counts: dict[str, Any] = dict(line.split(": ") for line in stats.splitlines() if line)
    return int(counts.get("cluster.upstream.ratelimit.over_limit", 0))


def test_streams_are_charged_when_done_until_the_tenant_is_refused_with_429(
        stack: Stack) -> None:
    served, remaining = 0, []
    refused: tuple[int, dict[str, str], int] | None = None
    for _ in range(10):  # bounded: the limit runs out at the 7th
        status, headers, tokens = _stream(stack.envoy, "acme")
        if status != 200:
            refused = (status, headers, tokens)
            break
        assert tokens == TOKENS
        served += 1
        remaining.append(int(headers["x-ratelimit-remaining"]))
        # The charge is sent as the stream ends, without Envoy waiting for the answer:
        # it must have counted before the next request's check.
        harness.wait_until(lambda n=served: stack.charged() == n * TOKENS, 10,
                           "the stream-done charge reached sitsmesh")
    print(f"\nserved {served} streams, charged {stack.charged():g} of {LIMIT} tokens")
    # The check on the request adds 0 and a fixed window is over when used + 0 > limit:
    # at 5 x 20 = 100 used the 6th is still admitted (100 is not over 100) and served
    # whole, so the tenant ends 20 over: charge-after overshoots by what was admitted
    # last. The 7th, at 120, is refused.
    assert served == LIMIT // TOKENS + 1
    assert stack.charged() == served * TOKENS == LIMIT + TOKENS
    # Each check saw every earlier stream's charge.
    assert remaining == [max(LIMIT - i * TOKENS, 0) for i in range(served)]
    assert refused is not None
    status, headers, tokens = refused
    assert status == 429 and tokens == 0
    assert headers["x-ratelimit-remaining"] == "0"
    assert headers["x-ratelimit-limit"].startswith(f"{LIMIT}, {LIMIT};w=3600")
    assert _over_limit(stack.envoy) == 1  # the ratelimit filter's reply, not the stage's
    assert stack.stage.served == served
    # A refused request has no token count, so its stream-done entry has no descriptor:
    # nothing more is charged. Another tenant has a budget of its own.
    status, headers, tokens = _stream(stack.envoy, "globex")
    assert (status, tokens, headers["x-ratelimit-remaining"]) == (200, TOKENS, str(LIMIT))
    harness.wait_until(lambda: stack.charged() == (served + 1) * TOKENS, 10,
                       "globex's charge")


def test_a_stream_cut_by_the_client_is_charged_the_tokens_counted_at_the_cut(
        stack: Stack) -> None:
    # Slow tokens: the client reads 3 of 20 and hangs up.
    conn, response = _open(stack.envoy, "initech", **{"x-stage-itl-ms": "100"})
    assert response.status == 200
    read = read_tokens(response, stop_after=3)
    assert read == 3
    conn.close()
    # The access log carries the same count (n) to sitsmesh's token metrics.
    harness.wait_until(lambda: stack.total("sitsmesh_token_streams_total",
                                           end="client_abort") == 1, 10,
                       "the cut stream's access-log entry")
    counted = stack.total("sitsmesh_output_tokens_total")
    print(f"\ncut after {read} tokens read, {counted:g} counted and charged")
    assert read <= counted < TOKENS
    harness.wait_until(lambda: stack.charged() == counted, 10,
                       "the cut stream's charge reached sitsmesh")
    # The next check sees it: what is left is the limit less the tokens at the cut.
    status, headers, tokens = _stream(stack.envoy, "initech")
    assert (status, tokens) == (200, TOKENS)
    assert int(headers["x-ratelimit-remaining"]) == LIMIT - counted
