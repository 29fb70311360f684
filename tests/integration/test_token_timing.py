"""Envoy's token-timing filter (filters/fragments/token_timing.yaml, Lua) against
sitsmesh's own parser (the ext_proc observer): the same awkward streams, cut into the
same awkward chunks, through real Envoy each way, give the same token counts,
unreadable events and ends. The filter reads events by pattern, not with a JSON
parser; this is where the two must agree."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sitsmesh.dev import harness

pytestmark = pytest.mark.integration
SSE, NDJSON = "text/event-stream", "application/x-ndjson"


def _chat(text: str, **extra: object) -> bytes:
    delta = {"content": text} if text is not None else {}
    return json.dumps({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": None}], **extra}).encode()


def _event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


TOKENS = b"".join(_event(_chat(f" t{i}")) for i in range(4))
DONE = b"data: [DONE]\n\n"
# name -> (path, content type, chunks as the stage writes them)
CASES: dict[str, tuple[str, str, list[bytes]]] = {
    "split events and several in a chunk": ("/v1/chat/completions", SSE, [
        _event(_chat("")),  # the role-only first delta: no token
        b": keep-alive\n\nevent: delta\n" + _event(_chat(" a"))[:30],
        _event(_chat(" a"))[30:] + _event(_chat(" b")) + _event(_chat(" c")),
        _event(_chat(" d"))[:-1], b"\n" + _event(json.dumps({
            "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}}).encode()),
        DONE]),
    "CRLF line ends, split inside a CRLF": ("/v1/chat/completions", SSE, [
        TOKENS.replace(b"\n", b"\r\n")[:-1], TOKENS.replace(b"\n", b"\r\n")[-1:],
        b"data: [DONE]\r\n\r\n"]),
    "an event over two data lines, and other text fields": ("/v1/completions", SSE, [
        b'data: {"choices": [{"index": 0,\ndata: "text": " x"}]}\n\n',
        _event(json.dumps({"choices": [{"index": 0, "delta": {
            "reasoning_content": " why"}}]}).encode()),
        _event(json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "{\\"}}]}}]}).encode()),
        _event(json.dumps({"choices": [{"index": 0, "delta": {
            "content": "an escaped \"content\": \"x\" inside"}}]}).encode()),
        DONE]),
    "unreadable and oversized events": ("/v1/chat/completions", SSE, [
        _event(_chat(" a")), b"data: not json\n\n",
        b"data: " + b"x" * 40_000, b"y" * 40_000 + b"\n\n",
        _event(_chat(" b")), DONE]),
    "an engine error ends it": ("/v1/chat/completions", SSE, [
        TOKENS, _event(b'{"error": {"message": "overloaded"}}'), _event(_chat(" late"))]),
    "no [DONE]: the body's end": ("/v1/chat/completions", SSE, [TOKENS]),
    "Triton's generate_stream": ("/v2/models/m/generate_stream", SSE, [
        b"".join(_event(json.dumps({"model_name": "m", "text_output": t}).encode())
                 for t in (" a", "", " b"))]),
    "NDJSON with its usage": ("/api/chat", NDJSON, [
        b'{"message": {"content": " a"}, "done": false}\n{"message": {"con',
        b'tent": " b"}, "done": false}\r\n\n',
        b'{"message": {"content": ""}, "done": true, "prompt_eval_count": 3, '
        b'"eval_count": 2}\n']),
}


class _Stage(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        _, kind, chunks = CASES[self.headers["x-case"]]
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            time.sleep(0.02)  # each its own read in Envoy, as the case cuts them
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stage() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stage)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


SERIES = ("sitsmesh_output_tokens_total", "sitsmesh_token_events_unreadable_total",
          "sitsmesh_token_streams_total", "gen_ai_server_time_to_first_token_seconds_count")


def _series(text: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SERIES:
                out[(sample.name, *sorted(sample.labels.items()))] = sample.value  # type: ignore[arg-type]
    return out


def _run(node: harness.Sitsmesh, envoy: harness.Envoy, case: str) -> dict[str, float]:
    """The case through `envoy`; what sitsmesh's series moved by."""
    before = _series(node.metrics())

    def streams() -> float:
        return sum(v for k, v in _series(node.metrics()).items()
                   if k[0] == "sitsmesh_token_streams_total")

    counted = streams()
    conn = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=10)
    conn.request("POST", CASES[case][0], body=b"{}", headers={
        "content-type": "application/json", "x-case": case})
    response = conn.getresponse()
    assert response.status == 200
    response.read()
    conn.close()
    harness.wait_until(lambda: streams() == counted + 1, 5, f"the report of {case!r}")
    after = _series(node.metrics())
    return {" ".join(map(str, k)): v - before.get(k, 0.0) for k, v in after.items()
            if v != before.get(k, 0.0)}


def test_the_envoy_filter_and_sitsmesh_s_parser_agree_on_awkward_streams(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh], stage: int) -> None:
    node = start_sitsmesh()
    (tmp_path / "ext_proc").mkdir()
    (tmp_path / "envoy").mkdir()
    by_ext_proc = harness.start_envoy(tmp_path / "ext_proc", node.data_addr, stage,
                                      fragments=["ext_proc"])
    by_envoy = harness.start_envoy(tmp_path / "envoy", node.data_addr, stage,
                                   fragments=["access_log", "token_timing"])
    try:
        for case in CASES:
            parsed = _run(node, by_ext_proc, case)
            timed = _run(node, by_envoy, case)
            print(f"\n{case}: {parsed}")
            assert timed == parsed, case
        # Not vacuous: the cases between them count tokens, unreadable events and
        # every way a whole stream ends.
        text = node.metrics()
        assert harness.metric_value(text, "sitsmesh_token_events_unreadable_total",
                                    format="openai") >= 6
        for end in ("complete", "error"):
            assert harness.metric_value(text, "sitsmesh_token_streams_total",
                                        format="openai", end=end) >= 2
    finally:
        by_ext_proc.kill()
        by_envoy.kill()
