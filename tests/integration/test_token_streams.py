"""Token streams through real Envoy's ext_proc filter (observability mode) to sitsmesh,
from a streaming OpenAI-compatible stage, with the official `openai` client: the client
gets the same tokens with and without the filter, and sitsmesh's TTFT, time per token
and token counts agree with what the client measured."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.tokenstage import TokenStage, read_tokens

pytestmark = pytest.mark.integration
STREAMS = 6
TTFT_MS, ITL_MS, TOKENS = 150, 20, 20
CHAT = {"pipeline": "chat", "stage": "llm", "format": "openai"}
# The two ways Envoy shows sitsmesh a token stream: each chunk copied to sitsmesh's
# ExternalProcessor, or timed in Envoy and summed up on the access-log entry.
OBSERVERS = {"ext_proc": ["ext_proc"], "envoy": ["access_log", "token_timing"]}
# How a stream the client hung up on is reported by each.
CUT_END = {"ext_proc": "cut", "envoy": "client_abort"}


@pytest.fixture
def stage() -> Iterator[TokenStage]:
    served = TokenStage(ttft_s=TTFT_MS / 1000, itl_s=ITL_MS / 1000, tokens=TOKENS).start()
    yield served
    served.stop()


def _stream(envoy: harness.Envoy, **extra: object) -> tuple[list[str], float, list[float]]:
    """The tokens, the client's TTFT (from sending the request to the first content
    token: the SDK's own work before it is not the server's) and its gaps."""
    sent: list[float] = []
    client = openai.OpenAI(
        base_url=envoy.url("/v1"), api_key="unused", max_retries=0, timeout=10,
        http_client=httpx2.Client(event_hooks={"request": [
            lambda request: sent.append(time.monotonic())]}))
    stream = client.chat.completions.create(
        model="stage", messages=[{"role": "user", "content": "hi"}], stream=True,
        **extra)  # type: ignore[call-overload]
    tokens: list[str] = []
    stamps: list[float] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            tokens.append(chunk.choices[0].delta.content)
            stamps.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return tokens, stamps[0] - sent[0], gaps


@pytest.mark.parametrize("observer", sorted(OBSERVERS))
def test_sitsmesh_times_the_tokens_the_openai_client_gets(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh],
        stage: TokenStage, observer: str) -> None:
    """Through each way of timing the tokens: sitsmesh's ExternalProcessor, and Envoy's
    own timing filter reporting through the access log."""
    node = start_sitsmesh()
    # The stage the streams belong to: the harness's Envoy calls its upstream "upstream".
    (tmp_path / "chat.yaml").write_text(
        "name: chat\nmodels: ['stage']\nstages:\n"
        "  - {name: llm, match: {upstream_cluster: upstream}}\n")
    applied = node.cli("pipelines", "apply", str(tmp_path / "chat.yaml"))
    assert applied.returncode == 0, applied.stderr
    (tmp_path / "plain").mkdir()
    (tmp_path / "observed").mkdir()
    plain = harness.start_envoy(tmp_path / "plain", node.data_addr, stage.port, fragments=[])
    observed = harness.start_envoy(tmp_path / "observed", node.data_addr, stage.port,
                                   fragments=OBSERVERS[observer])
    try:
        expected = [f" t{i}" for i in range(TOKENS)]
        assert _stream(plain)[0] == expected
        ttfts, gaps = [], []
        for i in range(STREAMS):
            tokens, ttft, stream_gaps = _stream(
                observed, **({"stream_options": {"include_usage": True}} if i % 2 else {}))
            assert tokens == expected  # the filter changes nothing for the client
            ttfts.append(ttft)
            gaps += stream_gaps

        def seen() -> float:
            return harness.metric_value(node.metrics(),
                                        "gen_ai_server_time_to_first_token_seconds_count",
                                        pipeline="chat", stage="llm", format="openai")

        harness.wait_until(lambda: seen() == STREAMS, 5, "every stream's report")
        metrics = node.metrics()
        ttft_sum = harness.metric_value(metrics, "gen_ai_server_time_to_first_token_seconds_sum",
                                        **CHAT)
        client_ttft = sum(ttfts) / len(ttfts)
        print(f"\nTTFT: sitsmesh {ttft_sum / STREAMS * 1000:.1f} ms, client "
              f"{client_ttft * 1000:.1f} ms")
        # sitsmesh's clock starts when Envoy has the request, the client's when it sends.
        assert abs(ttft_sum / STREAMS - client_ttft) <= max(0.05 * client_ttft, 0.002), (
            ttft_sum / STREAMS, client_ttft)
        tpot_sum = harness.metric_value(
            metrics, "gen_ai_server_time_per_output_token_seconds_sum", **CHAT)
        client_itl = sorted(gaps)[len(gaps) // 2]
        print(f"time per token: sitsmesh {tpot_sum / STREAMS * 1000:.2f} ms, client "
              f"{client_itl * 1000:.2f} ms")
        assert abs(tpot_sum / STREAMS - client_itl) <= max(0.05 * client_itl, 0.002), (
            tpot_sum / STREAMS, client_itl)
        assert harness.metric_value(metrics, "sitsmesh_output_tokens_total",
                                    **CHAT) == STREAMS * TOKENS
        assert harness.metric_value(metrics, "sitsmesh_token_streams_total", **CHAT,
                                    end="complete") == STREAMS
        assert harness.metric_value(metrics, "sitsmesh_token_stalls_total",
                                    **CHAT) == 0

        # The same figures on the stage's row of the pipeline's latency chain.
        shown = node.cli("chain", "show", "chat", "-o", "json")
        assert shown.returncode == 0, shown.stderr
        [llm] = json.loads(shown.stdout)["stages"]
        streamed = llm["tokens"]
        assert (streamed["streams"], streamed["output_tokens"], streamed["stalls"]) == (
            STREAMS, STREAMS * TOKENS, 0)
        # Histogram quantiles: within a bucket (4.4 %) of the measured figures.
        assert abs(streamed["ttft_p50_ms"] - client_ttft * 1000) <= 0.1 * client_ttft * 1000
        assert abs(streamed["tpot_p50_ms"] - client_itl * 1000) <= 0.1 * client_itl * 1000
        table = node.cli("chain", "show", "chat")
        assert "TOKEN STREAMS" in table.stdout and "TTFT50 ms" in table.stdout
    finally:
        plain.kill()
        observed.kill()


def _raw_stream(envoy: harness.Envoy, headers: dict[str, str], read_events: int | None = None
                ) -> int:
    """POST a streaming chat request; read `read_events` SSE lines (all when None) and
    hang up. Returns the content events read."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}',
                 headers={"content-type": "application/json", **headers})
    read = read_tokens(conn.getresponse(), read_events)
    conn.close()
    return read


@pytest.mark.parametrize("observer", sorted(OBSERVERS))
def test_a_stall_is_counted_a_hang_up_is_a_cut_and_sitsmesh_away_changes_nothing(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh],
        stage: TokenStage, observer: str) -> None:
    node = start_sitsmesh()
    envoy = harness.start_envoy(tmp_path, node.data_addr, stage.port,
                                fragments=OBSERVERS[observer])
    try:
        def metric(name: str, **labels: str) -> float:
            return harness.metric_value(node.metrics(), name, format="openai", **labels)

        # A 1.5 s stall after the 5th token (the stall threshold is 1 s).
        assert _raw_stream(envoy, {"x-stage-tokens": "8", "x-stage-stall-after": "5",
                                   "x-stage-stall-ms": "1500"}) == 8
        harness.wait_until(lambda: metric("sitsmesh_token_stalls_total") == 1, 5,
                           "the stall counted")
        # The client hangs up after 3 tokens of 200: the stage stops, sitsmesh says cut
        # (ext_proc sees only that the body stopped; the access-log entry says the
        # downstream went away).
        assert _raw_stream(envoy, {"x-stage-tokens": "200"}, read_events=3) == 3
        harness.wait_until(lambda: metric("sitsmesh_token_streams_total",
                                          end=CUT_END[observer]) == 1, 10,
                           "the cut stream reported")
        harness.wait_until(lambda: stage.aborted == 1, 10, "the stage to stop generating")

        # A malformed event and one over the 64 KiB event bound: counted, skipped, and
        # the tokens after them still timed.
        for size in (100, 200_000):
            assert _raw_stream(envoy, {"x-stage-tokens": "4", "x-stage-bad-bytes": str(size)}
                               ) == 4
        harness.wait_until(lambda: metric("sitsmesh_token_events_unreadable_total") == 2, 5,
                           "the two bad events counted")
        assert metric("sitsmesh_output_tokens_total") == 8 + 3 + 4 + 4

        # sitsmesh gone: observability mode and failure_mode_allow keep the stream whole.
        node.kill()
        assert _raw_stream(envoy, {"x-stage-tokens": "12"}) == 12
    finally:
        envoy.kill()


@pytest.mark.parametrize("observer", sorted(OBSERVERS))
def test_a_client_that_does_not_read_holds_the_stage_back_and_the_stream_is_reported(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh],
        stage: TokenStage, observer: str) -> None:
    import http.client
    import socket

    node = start_sitsmesh()
    envoy = harness.start_envoy(tmp_path, node.data_addr, stage.port,
                                fragments=OBSERVERS[observer])
    client = socket.socket()
    try:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", envoy.listen_port))
        body = b'{"stream": true}'
        # A million tokens as fast as the stage can write them, and never a byte read.
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: stage\r\n"
                       b"content-type: application/json\r\nx-stage-tokens: 1000000\r\n"
                       b"x-stage-ttft-ms: 0\r\nx-stage-itl-ms: 0\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
        samples = [-1]

        def stopped() -> bool:
            before, samples[0] = samples[0], stage.sent
            return before == samples[0] > 0

        # Envoy's buffer limits stop the stage (and with it the copies to sitsmesh).
        harness.wait_until(stopped, 30, "the stage to be held back", interval=0.5)
        assert stage.sent < 1_000_000
        client.close()  # the client gives up: a cut stream, reported; the stage stops
        harness.wait_until(lambda: harness.metric_value(
            node.metrics(), "sitsmesh_token_streams_total", format="openai",
            end=CUT_END[observer]) == 1, 10, "the cut stream reported")
        harness.wait_until(lambda: stage.aborted == 1, 10, "the stage to stop generating")
        counted = harness.metric_value(node.metrics(), "sitsmesh_output_tokens_total",
                                       format="openai")
        assert 0 < counted <= stage.sent  # what passed Envoy, never more
        if observer == "ext_proc":
            # A response that is not a token stream is passed by unparsed, and counted
            # (Envoy's own filter never reports one).
            plain = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=10)
            plain.request("GET", "/v1/models")
            plain.getresponse().read()
            plain.close()
            harness.wait_until(lambda: harness.metric_value(
                node.metrics(), "sitsmesh_token_streams_untracked_total",
                reason="not_streaming") == 1, 10, "the untracked response counted")
    finally:
        client.close()
        envoy.kill()


def test_a_stage_behind_no_envoy_reports_its_token_figures(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh]) -> None:
    import grpc
    from google.protobuf.timestamp_pb2 import Timestamp

    from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc

    node = start_sitsmesh()
    (tmp_path / "rag.yaml").write_text(
        "name: rag\nmodels: ['m']\nstages:\n  - {name: llm, match: {route_name: llm}}\n")
    assert node.cli("pipelines", "apply", str(tmp_path / "rag.yaml")).returncode == 0

    def at(seconds: float) -> Timestamp:
        stamp = Timestamp()
        stamp.FromNanoseconds(int(seconds * 1e9))
        return stamp

    now = time.time()

    def report(rid: str, first: float, tokens: int, stalls: int = 0,
               stage: str = "llm") -> admin_pb2.ReportStageLatencyRequest:
        return admin_pb2.ReportStageLatencyRequest(
            request_id=rid, pipeline="rag", stage=stage, start=at(now), end=at(now + 2.0),
            first_token=at(now + first), output_tokens=tokens, time_per_output_token_ms=25,
            stalls=stalls)

    sent = [report(f"r{i}", 0.3, 64) for i in range(4)]
    sent += [report("early", -0.1, 64),           # first token before the stage began
             report("stalls", 0.3, 3, stalls=5),  # more stalls than gaps
             report("other", 0.3, 64, stage="nope")]  # no such stage: no token figures
    with grpc.insecure_channel(node.admin_addr) as channel:
        reply = admin_pb2_grpc.AdminServiceStub(channel).ReportStageLatency(
            iter(sent), metadata=node.admin_metadata(), timeout=5)
    assert (reply.accepted, reply.rejected) == (5, 2)
    shown = node.cli("chain", "show", "rag", "-o", "json")
    [llm] = json.loads(shown.stdout)["stages"]
    assert llm["tokens"]["streams"] == 4 and llm["tokens"]["output_tokens"] == 256
    assert abs(llm["tokens"]["ttft_p50_ms"] - 300) <= 15  # a histogram bucket
    assert abs(llm["tokens"]["tpot_p50_ms"] - 25) <= 1.5
    assert harness.metric_value(node.metrics(), "sitsmesh_output_tokens_total",
                                pipeline="rag", stage="llm", format="reported") == 256


def test_only_requests_check_classed_as_streaming_are_copied_when_asked(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh],
        stage: TokenStage) -> None:
    """envoyconf.ext_proc_streaming_only: behind ext_authz, a `"stream": false` call on a
    streaming route never reaches sitsmesh's ExternalProcessor (the stage here streams
    either way: only the request's class decides)."""
    import http.client

    from sitsmesh.dev import envoyconf

    node = start_sitsmesh()
    assert node.cli("tenants", "create", "acme", "--models", "stage").returncode == 0
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    key = json.loads(made.stdout)["key"]
    envoy = harness.start_envoy(tmp_path, node.data_addr, stage.port,
                                fragments=["ext_authz", "ext_proc"],
                                edit=envoyconf.ext_proc_streaming_only)
    try:
        def post(streaming: bool) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=10)
            conn.request("POST", "/v1/chat/completions", headers={
                "content-type": "application/json", "x-api-key": key,
                "x-stage-tokens": "5"}, body=json.dumps(
                    {"model": "stage", "stream": streaming, "messages": []}).encode())
            reply = conn.getresponse()
            reply.read()
            conn.close()
            return reply.status

        def seen(end: str = "complete") -> float:
            return harness.metric_value(node.metrics(), "sitsmesh_token_streams_total",
                                        format="openai", end=end)

        assert post(True) == 200
        harness.wait_until(lambda: seen() == 1, 5, "the streaming call's report")
        assert post(False) == 200
        assert post(True) == 200
        harness.wait_until(lambda: seen() == 2, 5, "the second streaming call's report")
        # The non-streaming call was never copied: not even counted as not streaming.
        assert harness.metric_value(node.metrics(), "sitsmesh_token_streams_untracked_total",
                                    reason="not_streaming") == 0
        assert harness.metric_value(node.metrics(), "sitsmesh_output_tokens_total",
                                    format="openai") == 10
    finally:
        envoy.kill()
