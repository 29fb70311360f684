"""Token budgets through real Envoy (ext_authz, the token-timing filter and the access
log) to real sitsmesh, with a streaming OpenAI-compatible stage and the official
`openai` client: a tenant's streams reserve at Check and are settled with what they
produced, so what is served stays within the budget; once it is spent the client gets
429 with OpenAI's x-ratelimit-*-tokens headers; an aborted stream is charged what it
produced, a lost end is released after the hold; bodies that cannot be estimated are
refused with a precise 400."""

from __future__ import annotations

import http.client
import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.tokenstage import PROMPT_TOKENS, TokenStage, read_tokens
from tests.pgcluster import pg_cluster, pg_url  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration
Start = Callable[..., harness.Sitsmesh]
FRAGMENTS = ["ext_authz", "token_timing", "access_log"]
BUDGET = 600  # tokens per day: no window turns over during a test
MAX_TOKENS = 20
CONCURRENT = 20


def budget_doc(tokens: int = BUDGET) -> str:
    return ("apiVersion: sitsmesh.io/v1alpha1\nkind: TokenBudget\n"
            "metadata: {name: acme}\n"
            f"spec:\n  limits:\n    - {{tokens: {tokens}, per: day}}\n")


@dataclass
class Stack:
    node: harness.Sitsmesh
    envoy: harness.Envoy
    stage: TokenStage
    key: str

    def metric(self, name: str, **labels: str) -> float:
        return harness.metric_value(self.node.metrics(), name, **labels)


def setup_tenant(node: harness.Sitsmesh, tmp_path: Path, budget: str | None) -> str:
    created = node.cli("tenants", "create", "acme", "--models", "stage")
    assert created.returncode == 0, created.stderr
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    assert made.returncode == 0, made.stderr
    if budget is not None:
        (tmp_path / "budget.yaml").write_text(budget)
        applied = node.cli("apply", "-f", str(tmp_path / "budget.yaml"))
        assert applied.returncode == 0, applied.stdout + applied.stderr
    key: str = json.loads(made.stdout)["key"]
    return key


@pytest.fixture
def stack(tmp_path: Path, start_sitsmesh: Start) -> Iterator[Stack]:
    node = start_sitsmesh("--reload-interval-seconds", "0.2",
                          "--token-budget-hold-seconds", "2", "--decision-log", "all")
    key = setup_tenant(node, tmp_path, budget_doc())
    stage = TokenStage(ttft_s=0.02, itl_s=0.005, tokens=MAX_TOKENS).start()
    envoy = harness.start_envoy(tmp_path, node.data_addr, stage.port, fragments=FRAGMENTS)
    # The budget reaches Check's directory within the reload interval.
    absurd = json.dumps({"model": "stage", "max_tokens": 10**9}).encode()
    harness.wait_until(lambda: _raw(envoy, key, absurd)[0] == 400, 10,
                       "the budget to govern Check")
    yield Stack(node, envoy, stage, key)
    envoy.kill()
    stage.stop()


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.envoy.url("/v1"), api_key=stack.key, max_retries=0,
                         timeout=10, http_client=httpx2.Client())


def _stream(client: openai.OpenAI, **extra: object) -> list[str]:
    stream = client.chat.completions.create(
        model="stage", messages=[{"role": "user", "content": "hi"}], stream=True,
        max_tokens=MAX_TOKENS, **extra)  # type: ignore[call-overload]
    return [c.choices[0].delta.content for c in stream
            if c.choices and c.choices[0].delta.content]


def _json_or_none(line: str) -> dict[str, object] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _raw(envoy: harness.Envoy, key: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"content-type": "application/json", "x-api-key": key})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data


def test_streams_stay_within_the_budget_and_then_get_429_with_openai_headers(
        stack: Stack) -> None:
    client = _client(stack)
    served = 0
    refused: openai.RateLimitError | None = None
    for _ in range(40):  # bounded: the budget runs out long before
        try:
            tokens = _stream(client)
        except openai.RateLimitError as exc:
            refused = exc
            break
        assert tokens == [f" t{i}" for i in range(MAX_TOKENS)]  # unchanged for the client
        served += 1
        # Settled before the next: each stream is charged what it produced.
        harness.wait_until(lambda n=served: stack.metric(
            "sitsmesh_token_budget_settlements_total", outcome="settled") == n, 10,
            "the stream settled")
    client.close()
    assert refused is not None, "the budget never ran out"
    charged = sum(stack.metric("sitsmesh_token_budget_tokens_total", tenant="acme",
                               model="stage", kind=kind) for kind in ("input", "output"))
    print(f"\nserved {served} streams, charged {charged:g} of {BUDGET} tokens")
    assert served >= 3 and charged <= BUDGET
    assert stack.metric("sitsmesh_token_budget_tokens_total", tenant="acme", model="stage",
                        kind="output") == served * MAX_TOKENS
    headers = refused.response.headers
    assert headers["x-ratelimit-limit-tokens"] == str(BUDGET)
    body = refused.response.json()
    needed = int(re.search(r"needs about (\d+) tokens", body["message"]).group(1))  # type: ignore[union-attr]
    assert 0 <= int(headers["x-ratelimit-remaining-tokens"]) < needed
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    assert int(headers["retry-after"]) >= 1
    assert body["code"] == "token_budget_exceeded"
    assert body["budget"] == f"{BUDGET} tokens per day for tenant acme"
    # `tenants usage` reads the same ledger: what was charged, and what is left.
    shown = stack.node.cli("tenants", "usage", "acme", "-o", "json")
    assert shown.returncode == 0, shown.stderr
    [row] = json.loads(shown.stdout)["usage"]
    assert (int(row["tokens"]), int(row["used"])) == (BUDGET, charged)
    assert int(row["remaining"]) == BUDGET - charged and row["per"] == "day"
    table = stack.node.cli("tenants", "usage", "acme")
    assert table.returncode == 0 and str(int(charged)) in table.stdout, table.stdout
    # The decision log has each reservation, each charge and the refusal's budget.
    def logged() -> list[dict[str, object]]:
        return [r for r in map(_json_or_none, stack.node.output().splitlines())
                if r is not None and r.get("event") == "decision"]

    harness.wait_until(lambda: any(r.get("budget") for r in logged()
                                   if r.get("decision") == "deny"), 5,
                       "the refusal in the decision log")
    records = logged()
    assert any(r.get("reserved_tokens") for r in records if r.get("kind") == "authz")
    charges = [r for r in records if r.get("kind") == "token_budget"]
    assert charges and all(r["tenant"] == "acme" and r["charged_tokens"] for r in charges)


def test_concurrent_streams_cannot_overspend(stack: Stack) -> None:
    """Reservations are made before any stream has produced: 20 streams at once against
    room for about 12; what is admitted is what fits, and what is charged stays within."""
    client = _client(stack)
    results: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            got = len(_stream(client))
        except openai.RateLimitError:
            got = -1
        with lock:
            results.append(got)

    threads = [threading.Thread(target=one) for _ in range(CONCURRENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    client.close()
    admitted = [n for n in results if n >= 0]
    assert len(results) == CONCURRENT and admitted and len(admitted) < CONCURRENT
    harness.wait_until(lambda: stack.metric(
        "sitsmesh_token_budget_settlements_total", outcome="settled") == len(admitted), 10,
        "every admitted stream settled")
    charged = sum(stack.metric("sitsmesh_token_budget_tokens_total", tenant="acme",
                               model="stage", kind=kind) for kind in ("input", "output"))
    assert charged <= BUDGET


def test_an_aborted_stream_is_charged_what_it_produced_and_a_lost_end_is_released(
        stack: Stack, tmp_path: Path) -> None:
    # The client reads 3 tokens of 20 (slow ones) and hangs up.
    conn = http.client.HTTPConnection("127.0.0.1", stack.envoy.listen_port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": "stage", "stream": True, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"content-type": "application/json", "x-api-key": stack.key,
                 "x-stage-itl-ms": "100"})
    assert read_tokens(conn.getresponse(), stop_after=3) == 3
    conn.close()
    harness.wait_until(lambda: stack.metric(
        "sitsmesh_token_budget_settlements_total", outcome="settled") == 1, 10,
        "the aborted stream settled")
    output = stack.metric("sitsmesh_token_budget_tokens_total", tenant="acme", model="stage",
                          kind="output")
    assert 3 <= output < MAX_TOKENS  # what was produced, not the reservation
    # An engine that is away: no stream, so no token report. The reservation is held
    # for the hold (2 s here), then released, charged at its estimate, and counted.
    (tmp_path / "dead").mkdir()
    dead = harness.start_envoy(tmp_path / "dead", stack.node.data_addr, harness.free_port(),
                               fragments=FRAGMENTS)
    try:
        status, _, _ = _raw(dead, stack.key, json.dumps({
            "model": "stage", "stream": True, "max_tokens": 5, "messages": []}).encode())
    finally:
        dead.kill()
    assert status == 503
    harness.wait_until(lambda: stack.metric(
        "sitsmesh_token_budget_settlements_total", outcome="expired") == 1, 10,
        "the lost end released")


@pytest.mark.parametrize(("body", "status", "code", "message"), [
    # Not JSON, or no object: Check cannot read a model from it, before any budget.
    (b"not json", 403, "model_unknown", "cannot determine the model"),
    (b"[1, 2]", 403, "model_unknown", "cannot determine the model"),
    (json.dumps({"model": "stage", "max_tokens": 10**9}).encode(), 400,
     "token_budget_bad_request", "max_tokens must be an integer from 1 to 1000000"),
    (json.dumps({"model": "stage", "max_tokens": "many"}).encode(), 400,
     "token_budget_bad_request", "max_tokens must be an integer"),
    (json.dumps({"model": "stage", "max_completion_tokens": True}).encode(), 400,
     "token_budget_bad_request", "max_completion_tokens must be an integer"),
])
def test_a_body_a_budget_cannot_estimate_is_refused_precisely(
        stack: Stack, body: bytes, status: int, code: str, message: str) -> None:
    got, _, data = _raw(stack.envoy, stack.key, body)
    assert got == status, data
    refusal = json.loads(data)
    assert refusal["code"] == code and message in refusal["message"], refusal
    # Nothing was reserved for it.
    assert stack.metric("sitsmesh_token_budget_requests_total", outcome="reserved") == 0


@pytest.mark.parametrize("required", [False, True])
def test_a_tenant_without_a_budget_is_unlimited_or_refused_as_configured(
        tmp_path: Path, start_sitsmesh: Start, required: bool) -> None:
    node = start_sitsmesh("--reload-interval-seconds", "0.2",
                          "--budget-required", str(required).lower())
    key = setup_tenant(node, tmp_path, None)
    stage = TokenStage(ttft_s=0.01, itl_s=0.002, tokens=5).start()
    envoy = harness.start_envoy(tmp_path, node.data_addr, stage.port, fragments=FRAGMENTS)
    try:
        status, _, data = _raw(envoy, key, json.dumps({
            "model": "stage", "stream": True, "max_tokens": 10**9}).encode())
        if required:
            assert status == 403, data
            refusal = json.loads(data)
            assert refusal["code"] == "token_budget_missing"
            assert "tenant acme has no token budget" in refusal["message"]
        else:
            assert status == 200 and b"[DONE]" in data
        assert harness.metric_value(node.metrics(), "sitsmesh_token_budget_requests_total",
                                    outcome="reserved") == 0
    finally:
        envoy.kill()
        stage.stop()


def test_two_replicas_behind_two_envoys_share_one_budget(
        tmp_path: Path, start_sitsmesh: Start, pg_url: str) -> None:  # noqa: F811
    """Two replicas on one PostgreSQL (the budget) and one redis-server (the ledger),
    each behind its own Envoy: clients of both spend one budget, within 5 %."""
    from sitsmesh.dev.redis import redis_server

    with redis_server(tmp_path / "redis") as redis:
        args = ("--state-url", pg_url, "--ratelimit-store", "redis", "--redis-url",
                redis.url, "--reload-interval-seconds", "0.2")
        a = start_sitsmesh(*args, name="a")
        b = start_sitsmesh(*args, name="b")
        key = setup_tenant(a, tmp_path, budget_doc())
        stage = TokenStage(ttft_s=0.01, itl_s=0.003, tokens=MAX_TOKENS).start()
        envoys = []
        try:
            for name, node in (("envoy-a", a), ("envoy-b", b)):
                (tmp_path / name).mkdir()
                envoys.append(harness.start_envoy(tmp_path / name, node.data_addr,
                                                  stage.port, fragments=FRAGMENTS))
            absurd = json.dumps({"model": "stage", "max_tokens": 10**9}).encode()
            for envoy in envoys:
                harness.wait_until(lambda e=envoy: _raw(e, key, absurd)[0] == 400, 10,
                                   "the budget to govern both replicas")
            served: list[int] = []
            lock = threading.Lock()

            def client(envoy: harness.Envoy) -> None:
                c = openai.OpenAI(base_url=envoy.url("/v1"), api_key=key, max_retries=0,
                                  timeout=10, http_client=httpx2.Client())
                with c:
                    for _ in range(30):  # bounded: the budget runs out first
                        try:
                            got = len(_stream(c))
                        except openai.RateLimitError:
                            return
                        with lock:
                            served.append(got)

            threads = [threading.Thread(target=client, args=(e,)) for e in envoys * 3]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)

            def charged() -> float:
                return sum(harness.metric_value(n.metrics(),
                                                "sitsmesh_token_budget_tokens_total",
                                                tenant="acme", model="stage", kind=kind)
                           for n in (a, b) for kind in ("input", "output"))

            def settled() -> float:
                return sum(harness.metric_value(n.metrics(),
                                                "sitsmesh_token_budget_settlements_total",
                                                outcome="settled") for n in (a, b))

            harness.wait_until(lambda: settled() == len(served), 10, "every stream settled")
            print(f"\nserved {len(served)} streams, charged {charged():g} of {BUDGET}")
            assert len(served) >= 3
            assert charged() <= BUDGET * 1.05
            # Both replicas reserved, so the budget was shared, not spent twice.
            for node in (a, b):
                assert harness.metric_value(node.metrics(),
                                            "sitsmesh_token_budget_requests_total",
                                            outcome="reserved") >= 1
        finally:
            for envoy in envoys:
                envoy.kill()
            stage.stop()


def test_usage_is_asked_for_and_the_client_still_sees_what_it_asked_for(
        stack: Stack) -> None:
    """The token-timing filter adds stream_options.include_usage to a streaming request
    that did not ask, so the engine reports true counts (the stage answers usage only
    when asked: prompt 3); the client that did not ask sees no usage chunk, the one that
    asked sees its own."""
    client = _client(stack)

    def chunks(**extra: object) -> list[object]:
        stream = client.chat.completions.create(
            model="stage", messages=[{"role": "user", "content": "hi"}], stream=True,
            max_tokens=MAX_TOKENS, **extra)  # type: ignore[call-overload]
        return list(stream)

    plain = chunks()
    assert not any(getattr(c, "usage", None) for c in plain)
    assert all(c.choices for c in plain)  # type: ignore[attr-defined]
    asked = chunks(stream_options={"include_usage": True})
    usage = [c.usage for c in asked if getattr(c, "usage", None)]  # type: ignore[attr-defined]
    assert len(usage) == 1 and usage[0].completion_tokens == MAX_TOKENS
    client.close()
    harness.wait_until(lambda: stack.metric(
        "sitsmesh_token_budget_settlements_total", outcome="settled") == 2, 10,
        "both streams settled")
    # Both were charged the engine's own prompt count (3 each), not the estimate.
    assert stack.metric("sitsmesh_token_budget_tokens_total", tenant="acme", model="stage",
                        kind="input") == 6


def test_a_configured_tokenizer_counts_the_prompt_at_check(
        tmp_path: Path, start_sitsmesh: Start) -> None:
    """--budget-tokenizers: the reservation's input is the model's own token count of
    the prompt (a word-level tokenizer.json the test writes: "hello world" is 2 tokens,
    plus 4 for the chat message), not the body's size."""
    from tests.tokenizerfile import write_tokenizer

    tokenizer = write_tokenizer(tmp_path / "tokenizer.json")
    node = start_sitsmesh("--reload-interval-seconds", "0.2", "--decision-log", "all",
                          "--budget-tokenizers", f"stage={tokenizer}")
    key = setup_tenant(node, tmp_path, budget_doc())
    stage = TokenStage(ttft_s=0.01, itl_s=0.002, tokens=5).start()
    envoy = harness.start_envoy(tmp_path, node.data_addr, stage.port, fragments=FRAGMENTS)
    try:
        body = json.dumps({"model": "stage", "stream": True, "max_tokens": 5,
                           "messages": [{"role": "user", "content": "hello world"}]})

        def reserved() -> list[object]:
            return [r.get("reserved_tokens")
                    for r in map(_json_or_none, node.output().splitlines())
                    if r is not None and r.get("kind") == "authz"
                    and r.get("reserved_tokens")]

        def streamed() -> bool:
            status, _, data = _raw(envoy, key, body.encode())
            return status == 200 and b"[DONE]" in data

        harness.wait_until(streamed, 10, "a stream under the budget")
        harness.wait_until(lambda: bool(reserved()), 5, "the reservation logged")
        assert reserved()[0] == 2 + 4 + 5
    finally:
        envoy.kill()
        stage.stop()


def test_the_ledger_away_follows_on_store_error_and_recovers(
        tmp_path: Path, start_sitsmesh: Start) -> None:
    """Budgets on Redis (--ratelimit-store redis): Redis stopped, a budgeted stream is
    admitted without a reservation (on_store_error allow, counted); Redis back, streams
    reserve again."""
    from sitsmesh.dev.redis import redis_server

    with redis_server(tmp_path / "redis") as redis:
        node = start_sitsmesh("--reload-interval-seconds", "0.2", "--ratelimit-store",
                              "redis", "--redis-url", redis.url)
        key = setup_tenant(node, tmp_path, budget_doc())
        stage = TokenStage(ttft_s=0.01, itl_s=0.002, tokens=5).start()
        envoy = harness.start_envoy(tmp_path, node.data_addr, stage.port,
                                    fragments=FRAGMENTS)
        body = json.dumps({"model": "stage", "stream": True, "max_tokens": 5}).encode()

        def metric(outcome: str) -> float:
            return harness.metric_value(node.metrics(), "sitsmesh_token_budget_requests_total",
                                        outcome=outcome)

        try:
            harness.wait_until(lambda: _raw(envoy, key, body)[0] == 200
                               and metric("reserved") >= 1, 10, "a reservation on Redis")
            redis.stop()
            status, _, data = _raw(envoy, key, body)
            assert status == 200 and b"[DONE]" in data  # fail-open: the stream goes on
            assert metric("store_error_allowed") == 1
            redis.start()
            before = metric("reserved")
            harness.wait_until(lambda: _raw(envoy, key, body)[0] == 200
                               and metric("reserved") > before, 10,
                               "reservations again after Redis came back")
        finally:
            envoy.kill()
            stage.stop()


def test_streams_seen_through_ext_proc_settle_too(tmp_path: Path, start_sitsmesh: Start
                                                  ) -> None:
    """The ext_proc observer's reports settle reservations as the timing filter's do
    (x-sits-tenant and x-sits-token-estimate reach it with the request headers)."""
    node = start_sitsmesh("--reload-interval-seconds", "0.2")
    key = setup_tenant(node, tmp_path, budget_doc())
    stage = TokenStage(ttft_s=0.01, itl_s=0.002, tokens=MAX_TOKENS).start()
    envoy = harness.start_envoy(tmp_path, node.data_addr, stage.port,
                                fragments=["ext_authz", "ext_proc", "access_log"])
    body = json.dumps({"model": "stage", "stream": True, "max_tokens": MAX_TOKENS}).encode()

    def metric(name: str, **labels: str) -> float:
        return harness.metric_value(node.metrics(), name, **labels)

    try:
        harness.wait_until(lambda: _raw(envoy, key, body)[0] == 200
                           and metric("sitsmesh_token_budget_requests_total",
                                      outcome="reserved") >= 1, 10, "a reservation")
        harness.wait_until(lambda: metric("sitsmesh_token_budget_settlements_total",
                                          outcome="settled") >= 1, 10, "its settlement")
        assert metric("sitsmesh_token_budget_tokens_total", tenant="acme", model="stage",
                      kind="output") == MAX_TOKENS
        # No usage asked for on this path: the input charged is the reserved estimate.
        assert metric("sitsmesh_token_budget_tokens_total", tenant="acme", model="stage",
                      kind="input") == -(-len(body) // 4)
    finally:
        envoy.kill()
        stage.stop()


def test_a_completion_that_does_not_stream_is_charged_its_usage(stack: Stack) -> None:
    """The timing filter reads a JSON completion's usage at its end: it settles at once
    with the engine's counts, and counts as no token stream."""
    status, _, data = _raw(stack.envoy, stack.key, json.dumps({
        "model": "stage", "stream": False, "max_tokens": 7,
        "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 200, data
    assert json.loads(data)["usage"]["completion_tokens"] == 7
    harness.wait_until(lambda: stack.metric(
        "sitsmesh_token_budget_settlements_total", outcome="settled") == 1, 10,
        "the completion settled")
    assert stack.metric("sitsmesh_token_budget_tokens_total", tenant="acme", model="stage",
                        kind="output") == 7
    assert stack.metric("sitsmesh_token_budget_tokens_total", tenant="acme", model="stage",
                        kind="input") == PROMPT_TOKENS
    streams = sum(harness.metric_value(stack.node.metrics(), "sitsmesh_token_streams_total",
                                       format=fmt, end="complete")
                  for fmt in ("openai", "json"))
    assert streams == 0
