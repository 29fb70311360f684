"""Token streams from Triton: a decoupled python-backend model streams one response per
token through `generate_stream` (SSE) and gRPC `ModelStreamInfer`, through real Envoy
with each way of timing tokens (the ext_proc fragment, and Envoy's own timing filter
reporting on the access log); sitsmesh reads Triton's event shape and counts and times
the same tokens the client got."""

from __future__ import annotations

import http.client
import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sitsmesh.dev import harness, stream_model
from sitsmesh.dev.triton import TritonServer

pytestmark = pytest.mark.integration
TOKENS, TTFT_MS = 12, 120
# Both observers, one after the other against the same Triton and sitsmesh.
OBSERVERS = (["ext_proc"], ["access_log", "token_timing"])


@pytest.fixture
def triton(tmp_path: Path) -> Iterator[TritonServer]:
    server = stream_model.start_triton(tmp_path, ttft_ms=TTFT_MS, itl_ms=20, tokens=TOKENS)
    yield server
    server.kill()


def _metric(node: harness.Sitsmesh, fmt: str) -> Callable[[str], float]:
    """A series of `fmt`'s streams, counted from now."""
    def value(name: str) -> float:
        return harness.metric_value(node.metrics(), name, format=fmt)
    base = {name: value(name) for name in (
        "gen_ai_server_time_to_first_token_seconds_sum",
        "gen_ai_server_time_to_first_token_seconds_count",
        "gen_ai_server_time_per_output_token_seconds_sum",
        "sitsmesh_token_events_unreadable_total", "sitsmesh_output_tokens_total")}
    return lambda name: value(name) - base[name]


def _agree(metric: Callable[[str], float], client_ttft: float, stamps: list[float]) -> None:
    """sitsmesh's TTFT and time per token (one stream) against the client's stamps:
    within 5 % or 2 ms (sitsmesh's clock starts when Envoy had the request)."""
    ttft = metric("gen_ai_server_time_to_first_token_seconds_sum")
    tpot = metric("gen_ai_server_time_per_output_token_seconds_sum")
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps))
    client_itl = gaps[len(gaps) // 2]
    print(f"\nTTFT: sitsmesh {ttft * 1000:.1f} ms, client {client_ttft * 1000:.1f} ms; "
          f"per token: sitsmesh {tpot * 1000:.2f} ms, client {client_itl * 1000:.2f} ms")
    assert abs(ttft - client_ttft) <= max(0.05 * client_ttft, 0.002), (ttft, client_ttft)
    assert abs(tpot - client_itl) <= max(0.05 * client_itl, 0.002), (tpot, client_itl)
    assert metric("sitsmesh_token_events_unreadable_total") == 0


def test_triton_generate_stream_tokens_are_counted_and_timed(
        tmp_path: Path, triton: TritonServer,
        start_sitsmesh: Callable[..., harness.Sitsmesh]) -> None:
    node = start_sitsmesh()
    for fragments in OBSERVERS:
        (tmp_path / fragments[-1]).mkdir()
        envoy = harness.start_envoy(tmp_path / fragments[-1], node.data_addr,
                                    triton.http_port, fragments=fragments)
        try:
            _generate_stream(node, envoy)
        finally:
            envoy.kill()


def _generate_stream(node: harness.Sitsmesh, envoy: harness.Envoy) -> None:
    metric = _metric(node, "triton")
    conn = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=20)
    began = time.monotonic()
    conn.request("POST", f"/v2/models/{stream_model.NAME}/generate_stream",
                 body=json.dumps({"text_input": "hi", "max_tokens": TOKENS}),
                 headers={"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()[:300]
    texts, stamps = [], []
    for line in response:
        if line.startswith(b"data: "):
            stamps.append(time.monotonic())
            texts.append(json.loads(line[6:])["text_output"])
    conn.close()
    assert texts == [f" t{i}" for i in range(TOKENS)]
    harness.wait_until(lambda: metric("sitsmesh_output_tokens_total") == TOKENS, 5,
                       "sitsmesh's count of Triton's tokens")
    _agree(metric, stamps[0] - began, stamps)


def test_triton_grpc_model_stream_infer_tokens_are_counted(
        tmp_path: Path, triton: TritonServer,
        start_sitsmesh: Callable[..., harness.Sitsmesh]) -> None:
    """ModelStreamInfer through Envoy (HTTP/2 to Triton's gRPC port): sitsmesh splits the
    length-prefixed messages out of the body and counts a token per response."""
    import numpy as np
    from tritonclient import grpc as triton_grpc

    from sitsmesh.dev import envoyconf

    node = start_sitsmesh()
    for fragments in OBSERVERS:
        (tmp_path / fragments[-1]).mkdir()
        envoy = harness.start_envoy(
            tmp_path / fragments[-1], node.data_addr, triton.http_port,
            fragments=fragments, edit=lambda bootstrap: envoyconf.add_route(
                bootstrap, name="triton_grpc", prefix="/inference.", host="127.0.0.1",
                port=triton.grpc_port, timeout="0s", http2=True))
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{envoy.listen_port}")
        try:
            _model_stream_infer(node, client, triton_grpc, np)
        finally:
            client.close()
            envoy.kill()


def _model_stream_infer(node: harness.Sitsmesh, client: Any, triton_grpc: Any, np: Any
                        ) -> None:
    import queue

    metric = _metric(node, "triton-grpc")
    answers: queue.Queue[tuple[float, object]] = queue.Queue()
    text = triton_grpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    count = triton_grpc.InferInput("max_tokens", [1], "INT32")
    count.set_data_from_numpy(np.array([TOKENS], dtype=np.int32))
    began = time.monotonic()
    client.start_stream(callback=lambda result, error: answers.put(
        (time.monotonic(), error or result)))
    client.async_stream_infer(stream_model.NAME, [text, count])
    got = [answers.get(timeout=10) for _ in range(TOKENS)]
    client.stop_stream()
    assert all(not isinstance(a, Exception) for _, a in got), got
    assert [a.as_numpy("text_output")[0] for _, a in got] == [  # type: ignore[attr-defined]
        f" t{i}".encode() for i in range(TOKENS)]
    stamps = [at for at, _ in got]
    harness.wait_until(lambda: metric("sitsmesh_output_tokens_total") == TOKENS, 10,
                       "sitsmesh's count of the stream's responses")
    assert metric("gen_ai_server_time_to_first_token_seconds_count") == 1
    _agree(metric, stamps[0] - began, stamps)
