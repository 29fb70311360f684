"""A two-hop token pipeline for token-chain tests: a guard stage before an LLM stage,
each behind its own Envoy with the access_log fragment and one that times tokens.

    client -> Envoy A --(cluster guard)--> G -> Envoy B --(cluster llm)--> TokenStage

G is a small proxy: it holds each request `x-guard-ms` ms (its "check"), then forwards
it to Envoy B with its headers (x-request-id included) and relays the response body
chunk by chunk as it comes. Both Envoys keep the request id they are given.
"""

from __future__ import annotations

import contextlib
import http.client
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sitsmesh.dev import envoyconf, harness
from sitsmesh.dev.tokenstage import TokenStage

PIPELINE_YAML = """\
name: chat
models: ['stage']
stages:
  - {name: guard, match: {upstream_cluster: guard}}
  - {name: llm, match: {upstream_cluster: llm}}
"""
MAX_BODY = 1 << 20
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    next_port = 0


class _Guard(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # each relayed chunk goes out at once
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        del format, args

    def do_POST(self) -> None:
        body = self.rfile.read(min(int(self.headers.get("content-length") or 0), MAX_BODY))
        time.sleep(float(self.headers.get("x-guard-ms") or 0) / 1000)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        conn = http.client.HTTPConnection("127.0.0.1", self.server.next_port, timeout=30)
        try:
            conn.request("POST", self.path, body=body, headers=headers)
            upstream = conn.getresponse()
            self.send_response(upstream.status)
            for name, value in upstream.getheaders():
                if name.lower() not in HOP_HEADERS:
                    self.send_header(name, value)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            while data := upstream.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            conn.close()


def bootstrap(sitsmesh_addr: str, listen: int, admin: int, cluster: str,
              upstream: int, timing: str = "ext_proc") -> dict[str, Any]:
    """filters/local/bootstrap.yaml with access_log and `timing` (the fragment that times
    tokens: ext_proc or token_timing), its requests routed to `cluster` at `upstream`,
    and the caller's x-request-id kept."""
    config = envoyconf.render(
        harness.REPO / "filters" / "local" / "bootstrap.yaml",
        harness.envoy_values(sitsmesh_addr, upstream, listen, admin),
        ["access_log", timing])
    envoyconf.add_route(config, name=cluster, prefix="/v1", host="127.0.0.1", port=upstream)
    envoyconf.http_connection_manager(config)["preserve_external_request_id"] = True
    return config


@dataclass
class TokenStack:
    entry: harness.Envoy
    stage: TokenStage


@contextlib.contextmanager
def token_stack(tmp: Path, sitsmesh_addr: str, *, ttft_s: float, itl_s: float,
                tokens: int, timing: str = "ext_proc") -> Iterator[TokenStack]:
    """The stage, both Envoys and the guard; all torn down on exit."""
    with contextlib.ExitStack() as stack:
        stage = TokenStage(ttft_s=ttft_s, itl_s=itl_s, tokens=tokens).start()
        stack.callback(stage.stop)
        listen_b, admin_b = harness.free_port(), harness.free_port()
        (tmp / "b").mkdir()
        config_b = bootstrap(sitsmesh_addr, listen_b, admin_b, "llm", stage.port, timing)
        envoy_b = harness.launch_envoy(
            envoyconf.write(config_b, tmp / "b" / "envoy.yaml"), listen_b, admin_b,
            tmp / "b" / "log")
        stack.callback(envoy_b.kill)
        guard = _Server(("127.0.0.1", 0), _Guard)
        guard.next_port = listen_b
        guard_port = stack.enter_context(harness.serving(guard))
        listen_a, admin_a = harness.free_port(), harness.free_port()
        (tmp / "a").mkdir()
        config_a = bootstrap(sitsmesh_addr, listen_a, admin_a, "guard", guard_port, timing)
        envoy_a = harness.launch_envoy(
            envoyconf.write(config_a, tmp / "a" / "envoy.yaml"), listen_a, admin_a,
            tmp / "a" / "log")
        stack.callback(envoy_a.kill)
        yield TokenStack(envoy_a, stage)
