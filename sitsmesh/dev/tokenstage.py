"""A streaming LLM stage for tests and `make run`: OpenAI-compatible chat completions
as SSE, with set TTFT and time per token, a usage chunk when the client asks
(`stream_options.include_usage`, as vLLM sends it), an optional stall, and no more
generation once the client has gone (it counts those aborts).

Per request, headers override the defaults: `x-stage-ttft-ms`, `x-stage-itl-ms`,
`x-stage-tokens`, `x-stage-stall-after` (tokens) with `x-stage-stall-ms`, and
`x-stage-bad-bytes`: an event of that many bytes that is not JSON, before the tokens.
A request's `max_completion_tokens` or `max_tokens` caps the tokens, as an engine's does,
and one with `"stream": false` gets the whole completion as JSON, with its usage.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 1 << 20


# The prompt tokens its usage event reports (it reads no prompt).
PROMPT_TOKENS = 3
# What each of its content events holds (json.dumps of {"content": " t<i>"}).
CONTENT_MARK = b'"content": " t'


def read_tokens(lines: Iterable[bytes], stop_after: int | None = None) -> int:
    """The content events a client read from this stage's stream (an HTTP response
    iterated line by line); with `stop_after`, it stops reading there, as a client that
    hangs up."""
    read = 0
    for line in lines:
        if line.startswith(b"data: {") and CONTENT_MARK in line:
            read += 1
            if stop_after is not None and read >= stop_after:
                break
    return read

@dataclass
class TokenStage:
    ttft_s: float = 0.2
    itl_s: float = 0.02
    tokens: int = 16
    aborted: int = 0
    served: int = 0
    sent: int = 0  # content tokens written, over all requests
    _server: ThreadingHTTPServer | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def start(self) -> TokenStage:
        stage = self

        class Handler(_Handler):
            owner = stage

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: a burst of new upstream connections from
    # Envoy (100 streams, STREAMED ext_proc releasing requests in a bunch) overflowed
    # it, and Envoy's connects timed out into 503s.
    request_queue_size = 256


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    event = {"id": "chatcmpl-stage", "object": "chat.completion.chunk", "model": "stage",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


class _Handler(BaseHTTPRequestHandler):
    owner: TokenStage
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _setting(self, name: str, default: float) -> float:
        raw = self.headers.get(name)
        try:
            return float(raw) if raw is not None else default
        except ValueError:
            return default

    def do_POST(self) -> None:
        length = min(int(self.headers.get("content-length") or 0), MAX_BODY)
        try:
            request = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            request = {}
        stage = self.owner
        ttft = self._setting("x-stage-ttft-ms", stage.ttft_s * 1000) / 1000
        itl = self._setting("x-stage-itl-ms", stage.itl_s * 1000) / 1000
        tokens = int(self._setting("x-stage-tokens", stage.tokens))
        stall_after = int(self._setting("x-stage-stall-after", -1))
        stall = self._setting("x-stage-stall-ms", 0) / 1000
        ceiling = request.get("max_completion_tokens") or request.get("max_tokens")
        if isinstance(ceiling, int) and not isinstance(ceiling, bool) and ceiling > 0:
            tokens = min(tokens, ceiling)  # as an engine stops at the request's ceiling
        usage = bool((request.get("stream_options") or {}).get("include_usage"))
        if request.get("stream") is False:
            self._complete(ttft + max(0, tokens - 1) * itl, tokens)
            return
        bad = min(int(self._setting("x-stage-bad-bytes", 0)), 8 << 20)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        try:
            self._send(_chunk({"role": "assistant", "content": ""}))  # before generating
            if bad:
                self._send(b"data: {" + b"x" * bad + b"\n\n")
            time.sleep(ttft)
            for i in range(tokens):
                if i:
                    time.sleep(itl + (stall if i == stall_after else 0.0))
                self._send(_chunk({"content": f" t{i}"}))
                stage.sent += 1
            self._send(_chunk({}, "length"))
            if usage:
                self._send(b"data: " + json.dumps({
                    "id": "chatcmpl-stage", "object": "chat.completion.chunk",
                    "model": "stage", "choices": [],
                    "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens,
                              "total_tokens": tokens + PROMPT_TOKENS}}).encode() + b"\n\n")
            self._send(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            stage.served += 1
        except (BrokenPipeError, ConnectionResetError):
            stage.aborted += 1  # the client went away: stop generating
            self.close_connection = True

    def _complete(self, wait_s: float, tokens: int) -> None:
        """A `"stream": false` completion: the whole answer, with its usage, once
        generated."""
        stage = self.owner
        time.sleep(wait_s)
        body = json.dumps({
            "id": "chatcmpl-stage", "object": "chat.completion", "model": "stage",
            "choices": [{"index": 0, "finish_reason": "length", "message": {
                "role": "assistant", "content": "".join(f" t{i}" for i in range(tokens))}}],
            "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens,
                      "total_tokens": tokens + PROMPT_TOKENS}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        stage.sent += tokens
        stage.served += 1

    def _send(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()
