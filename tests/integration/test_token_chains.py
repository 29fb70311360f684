"""Token streams on latency chains, through two real Envoy hops (a guard stage before an
LLM stage, tests/tokenstack.py) to real sitsmesh: each request's TTFT and ITL agree with
what the client measured, a slow guard is named as the owner of TTFT in the slowest 1 %,
and a stage that stalls is named with the stall's length."""

from __future__ import annotations

import http.client
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.tokenstage import read_tokens
from tests import tokenstack

pytestmark = pytest.mark.integration
Start = Callable[..., harness.Sitsmesh]
TTFT_MS, ITL_MS, TOKENS = 150, 20, 20
# The two fragments that time tokens: each chunk copied to sitsmesh, or timed in Envoy.
TIMING = ("ext_proc", "token_timing")


def _node(start_sitsmesh: Start, tmp_path: Path) -> harness.Sitsmesh:
    node = start_sitsmesh()
    (tmp_path / "chat.yaml").write_text(tokenstack.PIPELINE_YAML)
    applied = node.cli("pipelines", "apply", str(tmp_path / "chat.yaml"))
    assert applied.returncode == 0, applied.stderr
    return node


def _chain(node: harness.Sitsmesh, joined: int) -> dict[str, Any]:
    """`chain show -o json` once `joined` requests have their token figures."""
    doc: dict[str, Any] = {}

    def ready() -> bool:
        nonlocal doc
        shown = node.cli("chain", "show", "chat", "-o", "json")
        assert shown.returncode == 0, shown.stderr
        doc = json.loads(shown.stdout)
        return bool(doc.get("tokens", {}).get("chains", 0) >= joined)

    harness.wait_until(ready, 15, f"{joined} chains joined to their token streams")
    return doc


def _raw(envoy: harness.Envoy, rid: str, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=15)
    conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}',
                 headers={"content-type": "application/json", "x-request-id": rid,
                          **headers})
    response = conn.getresponse()
    read = read_tokens(response)
    conn.close()
    return read


@pytest.mark.parametrize("timing", TIMING)
def test_ttft_and_itl_through_two_envoy_hops_agree_with_the_client(
        tmp_path: Path, start_sitsmesh: Start, timing: str) -> None:
    node = _node(start_sitsmesh, tmp_path)
    with tokenstack.token_stack(tmp_path, node.data_addr, ttft_s=TTFT_MS / 1000,
                                itl_s=ITL_MS / 1000, tokens=TOKENS, timing=timing) as stack:
        measured: dict[str, tuple[float, float]] = {}
        sent: list[float] = []  # the client's TTFT counts from the httpx2 request hook
        client = openai.OpenAI(
            base_url=stack.entry.url("/v1"), api_key="unused", max_retries=0, timeout=15,
            http_client=httpx2.Client(event_hooks={"request": [
                lambda request: sent.append(time.monotonic())]}))
        for i in range(6):
            rid = f"two-hops-{i}"
            stamps = []
            for chunk in client.chat.completions.create(
                    model="stage", messages=[{"role": "user", "content": "hi"}], stream=True,
                    extra_headers={"x-request-id": rid, "x-guard-ms": "30"}):
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.monotonic())
            assert len(stamps) == TOKENS
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            measured[rid] = (stamps[0] - sent[-1], statistics.median_low(gaps))
        doc = _chain(node, len(measured))
    slowest = {c["request_id"]: c for c in doc["slowest"]}
    for rid, (ttft, itl) in measured.items():
        chain = slowest[rid]
        guard = next(s for s in chain["stages"] if s["name"] == "guard")
        llm = next(s for s in chain["stages"] if s["name"] == "llm")
        print(f"\n{rid}: TTFT sitsmesh {chain['ttft_ms']:.1f} ms, client {ttft * 1000:.1f} ms;"
              f" ITL sitsmesh {guard['stream']['itl_p50_ms']:.2f} ms, client "
              f"{itl * 1000:.2f} ms")
        # sitsmesh's clock starts when the entry Envoy has the request, the client's when
        # it sends; the first token is the one the entry Envoy relayed.
        assert abs(chain["ttft_ms"] - ttft * 1000) <= max(0.05 * ttft * 1000, 2.0), rid
        assert abs(guard["stream"]["itl_p50_ms"] - itl * 1000) <= max(0.05 * itl * 1000,
                                                                      2.0), rid
        assert guard["stream"]["output_tokens"] == llm["stream"]["output_tokens"] == TOKENS
        assert guard["stream"]["end"] == llm["stream"]["end"] == "complete"
        # The LLM's own TTFT, from its hop's start, is the request's minus the guard's 30 ms.
        assert llm["stream"]["ttft_ms"] < chain["ttft_ms"] - 25
        assert chain["ttft_owner"] == "llm"
    tokens = doc["tokens"]
    assert tokens["chains"] == len(measured) and tokens["reports_dropped"] == 0
    client_ttfts = sorted(t for t, _ in measured.values())
    # Histogram quantiles: within a bucket (4.4 %) of the measured figures.
    assert abs(tokens["ttft_p50_ms"] - client_ttfts[2] * 1000) <= 0.1 * client_ttfts[2] * 1000


def test_a_slow_guard_before_the_llm_owns_ttft_in_the_slowest_one_percent(
        tmp_path: Path, start_sitsmesh: Start) -> None:
    node = _node(start_sitsmesh, tmp_path)
    with tokenstack.token_stack(tmp_path, node.data_addr, ttft_s=TTFT_MS / 1000,
                                itl_s=0.005, tokens=4, timing="token_timing") as stack:
        # 30 requests: one of them held 600 ms by the guard; the slowest 1 % is that one.
        for i in range(30):
            guard_ms = "600" if i == 11 else "5"
            assert _raw(stack.entry, f"guarded-{i}", {"x-guard-ms": guard_ms}) == 4
        doc = _chain(node, 30)
    tokens = doc["tokens"]
    assert tokens["ttft_owner"] == "guard", tokens
    stages = {s["name"]: s for s in doc["stages"]}
    assert stages["guard"]["ttft_attributed_ms"] >= 590
    assert stages["guard"]["ttft_share"] > 0.7
    slow = doc["slowest"][0]
    assert slow["request_id"] == "guarded-11" and slow["ttft_owner"] == "guard"
    # An ordinary request's TTFT is the LLM's.
    assert any(c["ttft_owner"] == "llm" for c in doc["slowest"][1:])
    table = node.cli("chain", "show", "chat")
    assert "TTFT owner in the slowest 1 %: guard" in table.stdout, table.stdout
    # Prometheus: every request's TTFT, and each stage's part of it.
    metrics = node.metrics()
    assert harness.metric_value(metrics, "sitsmesh_chain_time_to_first_token_seconds_count",
                                pipeline="chat") == 30
    assert harness.metric_value(
        metrics, "sitsmesh_chain_time_to_first_token_part_seconds_total", pipeline="chat",
        stage="guard") >= 0.6 + 29 * 0.005


@pytest.mark.parametrize("timing", TIMING)
def test_a_stage_that_stalls_is_named_with_the_stalls_length(
        tmp_path: Path, start_sitsmesh: Start, timing: str) -> None:
    import grpc

    from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc

    node = _node(start_sitsmesh, tmp_path)
    with tokenstack.token_stack(tmp_path, node.data_addr, ttft_s=0.05, itl_s=0.01,
                                tokens=10, timing=timing) as stack:
        assert _raw(stack.entry, "smooth", {}) == 10
        assert _raw(stack.entry, "stalled", {"x-stage-stall-after": "5",
                                             "x-stage-stall-ms": "2000"}) == 10
        doc = _chain(node, 2)
    stalled = next(c for c in doc["slowest"] if c["request_id"] == "stalled")
    streams = {s["name"]: s["stream"] for s in stalled["stages"]}
    # Both Envoys saw the gap; the LLM made it, the guard only relayed it.
    assert streams["guard"]["stall_count"] == streams["llm"]["stall_count"] == 1
    assert streams["guard"]["stalls"] == []
    [stall] = streams["llm"]["stalls"]
    assert 2000 <= stall["length_ms"] <= 2100
    stages = {s["name"]: s for s in doc["stages"]}
    assert 2000 <= stages["llm"]["tokens"]["stall_max_ms"] <= 2100
    assert "stall_max_ms" not in stages["guard"]["tokens"]
    table = node.cli("chain", "show", "chat")
    assert "llm 20" in table.stdout and "ms @+" in table.stdout, table.stdout
    # The same on GetLatencyChain.
    with grpc.insecure_channel(node.admin_addr) as channel:
        reply = admin_pb2_grpc.AdminServiceStub(channel).GetLatencyChain(
            admin_pb2.GetLatencyChainRequest(pipeline="chat"),
            metadata=node.admin_metadata(), timeout=5).chain
    [chain] = [c for c in reply.slowest if c.request_id == "stalled"]
    [llm] = [s for s in chain.stages if s.name == "llm"]
    assert len(llm.stream.stalls) == 1 and llm.stream.stalls[0].length_ms >= 2000


def test_a_stage_behind_no_envoy_joins_its_requests_chain(
        tmp_path: Path, start_sitsmesh: Start) -> None:
    import grpc
    from google.protobuf.timestamp_pb2 import Timestamp

    from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc

    node = _node(start_sitsmesh, tmp_path)

    def at(seconds: float) -> Timestamp:
        stamp = Timestamp()
        stamp.FromNanoseconds(int(seconds * 1e9))
        return stamp

    now = time.time()
    sent = []
    for i in range(4):
        # The guard's hop holds the request 0.4 s, then the LLM streams from 0.4 s on.
        sent += [admin_pb2.ReportStageLatencyRequest(
                     request_id=f"r{i}", pipeline="chat", stage="guard", start=at(now),
                     end=at(now + 2.0)),
                 admin_pb2.ReportStageLatencyRequest(
                     request_id=f"r{i}", pipeline="chat", stage="llm", start=at(now + 0.4),
                     end=at(now + 1.9), first_token=at(now + 0.5), output_tokens=50,
                     time_per_output_token_ms=25)]
    with grpc.insecure_channel(node.admin_addr) as channel:
        reply = admin_pb2_grpc.AdminServiceStub(channel).ReportStageLatency(
            iter(sent), metadata=node.admin_metadata(), timeout=5)
    assert (reply.accepted, reply.rejected) == (8, 0)
    doc = _chain(node, 4)
    assert doc["tokens"]["ttft_owner"] == "guard"
    for chain in doc["slowest"]:
        assert abs(chain["ttft_ms"] - 500) <= 1 and chain["ttft_owner"] == "guard"
        parts = {s["name"]: s.get("ttft_part_ms") for s in chain["stages"]}
        assert abs(parts["guard"] - 400) <= 1 and abs(parts["llm"] - 100) <= 1
