"""sitsmesh's CPU per ext_proc message, without Envoy: what one copied chunk costs.

A server process runs the ExternalProcessor servicer on a gRPC aio server, registered
through the data port's byte budget (BudgetedRegistrar) as `sitsmesh serve` does; this
process is the client: `--streams` concurrent Process streams, each the messages Envoy
sends for one OpenAI-compatible SSE response in observability mode (request headers,
response headers, a role delta, `--tokens` content events, the finish event and
`[DONE]`), one body chunk every `--itl-ms`, streams started at random offsets over
500 ms. Per round: the server process's CPU (utime + stime) over the round, divided by
the messages sent. With `--floor`, the server's handler only iterates the messages (no
parsing): gRPC aio's own cost per message.

A/B of two trees: run it once with PYTHONPATH at each and interleave the runs; the
machine has 2 noisy cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc import aio

SERVER = """
import asyncio, sys
from grpc import aio
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from sitsmesh.transport.budget import ByteBudget
from sitsmesh.transport.budgetwrap import BudgetedRegistrar
from sitsmesh.transport.extproc import ExternalProcessorServicer, add_to_server
from sitsmesh.transport.streams import OpenStreams

class Floor(pb_grpc.ExternalProcessorServicer):
    async def Process(self, requests, context):
        async for _ in requests:
            pass

async def main():
    server = aio.server(options=[("grpc.max_concurrent_streams", 1000)])
    registrar = BudgetedRegistrar(server, ByteBudget(256 << 20))
    if sys.argv[1] == "floor":
        pb_grpc.add_ExternalProcessorServicer_to_server(Floor(), registrar)
    else:
        add_to_server(ExternalProcessorServicer(lambda report: None, OpenStreams(),
                                                stall_s=1.0), registrar)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    event = {"id": "chatcmpl-stage", "object": "chat.completion.chunk", "model": "stage",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def messages(tokens: int) -> list[pb.ProcessingRequest]:
    """What Envoy's ext_proc filter sends for one streamed chat completion."""
    headers = pb.ProcessingRequest(observability_mode=True)
    for key, value in ((":authority", "stage"), (":path", "/v1/chat/completions"),
                       (":method", "POST"), ("content-type", "application/json"),
                       ("x-request-id", "4b3e0c1e-6a57-4a5e-9b8f-2c9e0b1d2f3a")):
        headers.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    headers.attributes["envoy.filters.http.ext_proc"].update(
        {"request.time": "2026-12-05T06:16:15.718213+00:00"})
    response = pb.ProcessingRequest(observability_mode=True)
    for key, value in ((":status", "200"), ("content-type", "text/event-stream")):
        response.response_headers.headers.headers.add(key=key, raw_value=value.encode())
    response.attributes["envoy.filters.http.ext_proc"].update(
        {"xds.cluster_name": "stage", "xds.route_name": "r"})
    bodies = [_event({"role": "assistant", "content": ""}),
              *(_event({"content": f" t{i}"}) for i in range(tokens)),
              _event({}, "length"), b"data: [DONE]\n\n"]
    return [headers, response, *(pb.ProcessingRequest(
        observability_mode=True, response_body=pb.HttpBody(body=b)) for b in bodies)]


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


async def one_round(port: int, args: argparse.Namespace, sent: list[pb.ProcessingRequest],
                    seed: int) -> None:
    rng = random.Random(seed)
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def stream(delay: float) -> None:
            await asyncio.sleep(delay)

            async def paced() -> Any:
                start = time.monotonic()
                for i, message in enumerate(sent):
                    wait = start + i * args.itl_ms / 1000 - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    yield message

            async for _ in stub.Process(paced()):
                pass

        await asyncio.gather(*(stream(rng.uniform(0, 0.5)) for _ in range(args.streams)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--floor", action="store_true", help="a handler that only iterates")
    args = p.parse_args()
    server = subprocess.Popen([sys.executable, "-c", SERVER,
                               "floor" if args.floor else "servicer"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        sent = messages(args.tokens)
        asyncio.run(one_round(port, argparse.Namespace(streams=10, itl_ms=1.0), sent, 0))
        per_message = []
        for i in range(args.rounds):
            before = cpu(server.pid)
            asyncio.run(one_round(port, args, sent, i + 1))
            time.sleep(0.3)  # the last messages handled
            spent = cpu(server.pid) - before
            per_message.append(spent / (args.streams * len(sent)) * 1e6)
            print(f"round {i}: {per_message[-1]:.1f} us per message", file=sys.stderr)
        kind = "floor" if args.floor else "servicer"
        print(f"{kind}: median {statistics.median(per_message):.1f} us of server CPU per "
              f"message ({min(per_message):.1f} to "
              f"{max(per_message):.1f}), {args.rounds} rounds of {args.streams} streams x "
              f"{len(sent)} messages")
    finally:
        server.kill()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
