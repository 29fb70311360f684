"""A three-stage pipeline of chained Envoy hops, for latency-chain tests.

One Envoy process, three listeners L1 -> L2 -> L3, each logging every request
to sitsmesh's AccessLogService (the access_log fragment):

    client -> L1 --(cluster pre)--> P -> L2 --(cluster feat)--> F -> L3 --(cluster model)--> M

P and F are small Python HTTP upstreams that call the next listener, forwarding
x-request-id, and answer with its body (on /short P answers itself, so the
chain misses the feat and model hops). M answers at once; on /stream it sends
its first chunk at once and the rest STREAM_DELAY_S later (chunked encoding).
L1 generates the request id; L2 and L3 keep the one they are given.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

from sitsmesh.dev import envoyconf, harness

STREAM_DELAY_S = 0.2
STAGES = (("pre", "L1"), ("feat", "L2"), ("model", "L3"))
PIPELINE_YAML = """\
name: demo
stages:
  - {name: pre, match: {upstream_cluster: pre}}
  - {name: feat, match: {upstream_cluster: feat}}
  - {name: model, match: {upstream_cluster: model}}
"""
HCM = "envoy.filters.network.http_connection_manager"
HEADER_DELAY = "x-envoy-fault-delay-request"  # ms, honoured on `header_delay_on`


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    next_port = 0  # the listener a forwarding upstream calls


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without this, Nagle meets the
    # peer's delayed ACK and each hop gains ~40 ms that belongs to no stage.
    disable_nagle_algorithm = True
    server: _Server

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


class _Forward(_Handler):
    """P and F: call the next listener with the same x-request-id, return its body."""

    def do_GET(self) -> None:
        if self.path.startswith("/short"):
            self._answer(b"short")
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.server.next_port, timeout=10)
        try:
            conn.request("GET", self.path,
                         headers={"x-request-id": self.headers.get("x-request-id", "")})
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        self._answer(body)


class _Model(_Handler):
    """M: answer at once, or on /stream first chunk now and the rest later."""

    def do_GET(self) -> None:
        rid = self.headers.get("x-request-id", "").encode()
        if not self.path.startswith("/stream"):
            self._answer(b"model:" + rid)
            return
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self._chunk(b"first:" + rid)
        self.wfile.flush()
        time.sleep(STREAM_DELAY_S)
        self._chunk(b";rest")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


@contextlib.contextmanager
def _serve(handler: type[_Handler], next_port: int = 0) -> Iterator[int]:
    server = _Server(("127.0.0.1", 0), handler)
    server.next_port = next_port
    with harness.serving(server) as port:
        yield port


def bootstrap(sitsmesh_addr: str, listen: dict[str, int], upstream: dict[str, int],
              admin_port: int, fault_on: str | None = None,
              fault_delay: str = "0.12s", header_delay_on: str | None = None) -> dict[str, Any]:
    """The Envoy bootstrap: filters/local/bootstrap.yaml with the access_log fragment,
    its listener copied three times (one per stage) and its upstream replaced by
    the stage clusters. `fault_on` names the listener (L1/L2/L3) that delays every request;
    `header_delay_on` one that delays the requests that ask for it (HEADER_DELAY, in ms)."""
    base = envoyconf.render(
        harness.REPO / "filters" / "local" / "bootstrap.yaml",
        harness.envoy_values(sitsmesh_addr, upstream["pre"], listen["L1"], admin_port),
        ["access_log"])
    resources = base["static_resources"]
    template = resources["listeners"][0]
    listeners = []
    for cluster, name in STAGES:
        listener = copy.deepcopy(template)
        listener["name"] = name
        listener["address"]["socket_address"]["port_value"] = listen[name]
        hcm = _hcm(listener)
        hcm["stat_prefix"] = name
        hcm["generate_request_id"] = True          # L1 makes one when absent...
        hcm["preserve_external_request_id"] = True  # ...and every hop keeps it
        route = hcm["route_config"]
        route["name"] = name
        for vhost in route["virtual_hosts"]:
            for entry in vhost["routes"]:
                entry["name"] = name
                entry["route"]["cluster"] = cluster
                entry["route"].pop("rate_limits", None)
        if fault_on == name:
            hcm["http_filters"] = [_fault(fault_delay), *hcm["http_filters"]]
        if header_delay_on == name:
            hcm["http_filters"] = [_header_fault(), *hcm["http_filters"]]
        listeners.append(listener)
    resources["listeners"] = listeners
    clusters = [c for c in resources["clusters"] if c["name"] != "upstream"]
    for cluster, _ in STAGES:
        clusters.append({
            "name": cluster, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": cluster, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": upstream[cluster]}}}}]}]}})
    resources["clusters"] = clusters
    return base


def _hcm(listener: dict[str, Any]) -> dict[str, Any]:
    for chain in listener["filter_chains"]:
        for flt in chain["filters"]:
            if flt["name"] == HCM:
                return cast(dict[str, Any], flt["typed_config"])
    raise AssertionError("listener without an http_connection_manager")


def _fault(delay: str) -> dict[str, Any]:
    return {"name": "envoy.filters.http.fault", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
        "delay": {"fixed_delay": delay,
                  "percentage": {"numerator": 100, "denominator": "HUNDRED"}}}}


def _header_fault() -> dict[str, Any]:
    return {"name": "envoy.filters.http.fault", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
        "delay": {"header_delay": {},
                  "percentage": {"numerator": 100, "denominator": "HUNDRED"}}}}


@dataclass
class ChainStack:
    envoy: harness.Envoy
    listen: dict[str, int]

    def get(self, path: str = "/", headers: dict[str, str] | None = None,
            timeout: float = 10) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.listen["L1"], timeout=timeout)
        try:
            conn.request("GET", path, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


def _start_envoy(tmp: Path, config: dict[str, Any], listen: dict[str, int],
                 admin_port: int) -> harness.Envoy:
    path = envoyconf.write(config, tmp / "envoy-chain.yaml")
    return harness.launch_envoy(path, listen["L1"], admin_port, tmp / "envoy-chain.log")


@contextlib.contextmanager
def chain_stack(tmp: Path, sitsmesh_addr: str, fault_on: str | None = None,
                header_delay_on: str | None = None) -> Iterator[ChainStack]:
    """Upstreams P, F, M and one Envoy with listeners L1-L3; all torn down on exit."""
    listen = {name: harness.free_port() for _, name in STAGES}
    with contextlib.ExitStack() as stack:
        upstream = {
            "model": stack.enter_context(_serve(_Model)),
            "feat": stack.enter_context(_serve(_Forward, listen["L3"])),
            "pre": stack.enter_context(_serve(_Forward, listen["L2"])),
        }
        admin = harness.free_port()
        envoy = _start_envoy(tmp, bootstrap(sitsmesh_addr, listen, upstream, admin, fault_on,
                                            header_delay_on=header_delay_on),
                             listen, admin)
        stack.callback(envoy.kill)
        yield ChainStack(envoy, listen)
