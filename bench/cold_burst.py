"""A cold burst of token streams: N streaming chat requests started at once through a
freshly started Envoy with the ext_proc fragment (observability mode), with and without
the sitsmesh_data cluster's cap on streams per connection, side by side in one run.

Before Envoy reads sitsmesh's SETTINGS (max_streams_per_connection, 16) it may open more
streams on a new connection than sitsmesh allows; those are refused, and in
observability mode their token reports are lost. The table: clients answered, reports
sitsmesh made, and Envoy's refused (reset) streams to sitsmesh, per configuration.

    PYTHONPATH=. .venv/bin/python bench/cold_burst.py --streams 250 --rounds 2
"""

from __future__ import annotations

import argparse
import http.client
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sitsmesh.dev import envoyconf, harness
from sitsmesh.dev.tokenstage import TokenStage


def burst(capped: bool, streams: int, work: Path) -> tuple[int, float, int]:
    stage = TokenStage(ttft_s=0.05, itl_s=0.02, tokens=20).start()
    node = harness.start_sitsmesh(work)
    envoy = None
    try:
        def uncapped(bootstrap: dict[str, Any]) -> None:
            [data] = [c for c in bootstrap["static_resources"]["clusters"]
                      if c["name"] == "sitsmesh_data"]
            data["typed_extension_protocol_options"][envoyconf.HTTP_OPTIONS][
                "explicit_http_config"]["http2_protocol_options"].pop("max_concurrent_streams")

        envoy = harness.start_envoy(work, node.data_addr, stage.port, fragments=["ext_proc"],
                                    edit=None if capped else uncapped)
        answered: list[bool] = []

        def one() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=30)
            conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}',
                         headers={"content-type": "application/json"})
            reply = conn.getresponse()
            answered.append(reply.status == 200 and b"[DONE]" in reply.read())
            conn.close()

        threads = [threading.Thread(target=one) for _ in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)

        def reported() -> float:
            return harness.metric_value(node.metrics(), "sitsmesh_token_streams_total",
                                        format="openai", end="complete")
        deadline = time.monotonic() + 5  # reports trail the last token by milliseconds
        while reported() < streams and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = "cluster.sitsmesh_data.upstream_rq_rx_reset:"
        resets = sum(int(line.rsplit(":", 1)[1])
                     for line in envoy.admin_get("/stats").splitlines()
                     if line.startswith(refused))
        return sum(answered), reported(), resets
    finally:
        if envoy is not None:
            envoy.kill()
        node.kill()
        stage.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.streams} streams at once, cold Envoy and sitsmesh each time\n")
    print("| round | sitsmesh_data cluster | clients answered | reports | refused streams |")
    print("|---:|---|---:|---:|---:|")
    for i in range(args.rounds):
        for capped in ((False, True) if i % 2 == 0 else (True, False)):
            with tempfile.TemporaryDirectory(prefix="sitsmesh-burst-") as tmp:
                ok, reports, resets = burst(capped, args.streams, Path(tmp))
            label = "max_concurrent_streams: 16" if capped else "no cap"
            print(f"| {i} | {label} | {ok} | {reports:g} | {resets} |")


if __name__ == "__main__":
    main()
