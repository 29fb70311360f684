"""What a client that stops reading costs Envoy, with the local bootstrap's buffer limits
(64 KiB listener, 32 KiB clusters: filters/fragments/ext_proc.yaml says why) against
Envoy's default 1 MiB (issue 27, item 5).

Setup, on 127.0.0.1 free ports: an engine (a raw socket in a thread of this script)
answers any request with an endless chunked text/event-stream of ~200-byte SSE events,
written as fast as its socket takes them; Envoy (filters/local/bootstrap.yaml, no
fragments) in front of it; a client that sends one request, with a 4 KiB receive buffer,
and never reads. The engine stops when its socket has not been writable for 2 s: the
pushback reached it. Then Envoy's gauges say what it held for the stream:
`http.ingress.downstream_cx_tx_bytes_buffered` (for the client) and
`cluster.upstream.upstream_cx_rx_bytes_buffered` (read from the engine).

Each round runs the bootstrap as it is, then with `per_connection_buffer_limit_bytes`
removed from its listener and clusters (Envoy's 1 MiB), interleaved.
The events the engine wrote include every kernel socket buffer on the way (on loopback
they dominate); Envoy's gauges are what the settings bound.

Run: PYTHONPATH=. .venv/bin/python bench/stream_buffers.py --rounds 3
"""

from __future__ import annotations

import argparse
import select
import socket
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

from sitsmesh.dev import envoyconf, harness

EVENT = (b'data: {"choices":[{"delta":{"content":" tok"}}],"pad":"' + b"x" * 140
         + b'"}\n\n')
CHUNK = f"{len(EVENT):x}\r\n".encode() + EVENT + b"\r\n"
GAUGES = ("http.ingress.downstream_cx_tx_bytes_buffered",
          "cluster.upstream.upstream_cx_rx_bytes_buffered")
STALLED_S = 2.0


def _engine(written: list[int], port: list[int]) -> None:
    """Serve one request: events until the socket stays unwritable for STALLED_S."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port.append(server.getsockname()[1])
    conn, _ = server.accept()
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    conn.setblocking(False)
    events, pending = 0, CHUNK
    while select.select([], [conn], [], STALLED_S)[1]:
        pending = pending[conn.send(pending):]
        if not pending:
            events, pending = events + 1, CHUNK
    written.append(events)
    conn.close()
    server.close()


def one(tmp: Path, defaults: bool) -> tuple[int, dict[str, int]]:
    written: list[int] = []
    port: list[int] = []
    threading.Thread(target=_engine, args=(written, port), daemon=True).start()
    harness.wait_until(lambda: bool(port), 5, "the engine to listen")
    values = harness.envoy_values("127.0.0.1:1", port[0], harness.free_port(),
                                  harness.free_port())
    config: dict[str, Any] = envoyconf.render(
        harness.REPO / "filters" / "local" / "bootstrap.yaml", values, [])
    if defaults:
        for node in (*config["static_resources"]["listeners"],
                     *config["static_resources"]["clusters"]):
            node.pop("per_connection_buffer_limit_bytes", None)
    name = "defaults" if defaults else "bootstrap"
    path = envoyconf.write(config, tmp / f"{name}.yaml")
    listen = int(values["listen_port"])  # type: ignore[call-overload]
    envoy = harness.launch_envoy(path, listen, int(values["envoy_admin_port"]),  # type: ignore[call-overload]
                                 tmp / f"{name}.log")
    try:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", listen))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                       b"content-length: 2\r\n\r\n{}")
        harness.wait_until(lambda: bool(written), 120, "the engine to feel pushback")
        stats = envoy.admin_get("/stats?filter=bytes_buffered")
        held = {name: int(value) for name, _, value in
                (line.partition(": ") for line in stats.splitlines()) if name in GAUGES}
        client.close()
        return written[0], held
    finally:
        envoy.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[tuple[int, int]]] = {"bootstrap": [], "defaults": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for defaults in (False, True):
                events, held = one(Path(tmp), defaults)
                name = "defaults" if defaults else "bootstrap"
                envoy_bytes = sum(held.values())
                results[name].append((events, envoy_bytes))
                print(f"round {r} {name:9}: engine wrote {events} events "
                      f"({events * len(EVENT) / 1024:.0f} KiB) before pushback; Envoy held "
                      f"{envoy_bytes / 1024:.0f} KiB ({held})", flush=True)
    for name, rows in results.items():
        held_kib = statistics.median(b for _, b in rows) / 1024
        print(f"median {name:9}: Envoy held {held_kib:.0f} KiB "
              f"(~{held_kib * 1024 / len(EVENT):.0f} events); engine wrote "
              f"{statistics.median(e for e, _ in rows):.0f} events in all")


if __name__ == "__main__":
    main()
