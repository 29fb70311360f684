"""Per-message checks of gRPC streams: the latency and CPU they add per message (issue 27).

What it measures: what the grpc_stream_check ext_proc filter
(`filters/fragments/grpc_stream_check.yaml`, FULL_DUPLEX_STREAMED: Envoy hands sitsmesh
every client message of a ModelStreamInfer stream and forwards only what sitsmesh sends
back) adds to each message's round trip, and what it costs in CPU, at a paced
`--rate` messages/s in total (default 1 000: 10 streams x 100 msg/s).

Setup, all on 127.0.0.1 free ports, started and stopped by this script, alive for the
whole run:
- an **upstream**: a grpc.aio GRPCInferenceService whose ModelStreamInfer answers each
  request at once with one response carrying the request's id (tritonclient's
  service_pb2), in a process of its own; a real Triton python backend could not answer
  1 000 messages/s on this machine, and an instant answer isolates the check path;
- `sitsmesh serve` (harness defaults: 1 worker, deadline 1 s, fail closed), a tenant
  allowed the model and an API key for it;
- **A, baseline**: Envoy with ext_authz only, the route configured as
  `envoyconf.stream_checks_on` sets it (ext_authz `disable_request_body_buffering` and
  the `sitsmesh_stream_check: per_message` context extension), without the
  grpc_stream_check filter. This is the fairest baseline: the same Check per stream,
  the body streamed through unbuffered; the filter is the only difference. (Checks
  off, ext_authz would buffer the body of a bidirectional stream until it ends.)
- **B, checked**: the same Envoy config plus the grpc_stream_check filter.
- with `--floor` also **F, floor**: B's config with the filter pointed at a bare
  grpc.aio ExternalProcessor (own process) that hands each body chunk straight back,
  checking nothing: what any Python ext_proc server costs per message, so B - F is
  what sitsmesh's own work (the gate, its metrics, its budget) adds on top.

Load: one round opens `--streams` streams (gRPC, one channel each, `x-api-key`), sends
one message on each and waits for its answer (not counted: it carries the stream's
set-up), then sends `--messages` messages per stream, stream i's k-th at
T0 + (k + i / streams) x streams / rate, so the sends are evenly spaced. The client is
grpc.aio in this process: each message is stamped just before `call.write` and its
answer when `call.read` returns it (matched by id); latency = answer - send. Every
message must be answered, in order, and every stream end with OK, within the round's
bound (its nominal time + 15 s); otherwise the run fails (exit 1).

Rounds: a warm-up round per configuration (not reported), then `--rounds` rounds, each
running every configuration once, one after the other, the order rotated each round (A,
B then B, A; with F: A, B, F then B, F, A then F, A, B), so the drift of this noisy
2-core VM hits all alike. Per round: latency p50/p99 (nearest rank over all its
messages), messages/s achieved (messages / first send to last answer), and CPU per 1 000
messages over the paced part of the round (once every stream is open, until every stream
has ended) from /proc/<pid>/stat utime+stime of every process in each server's process
group: sitsmesh (one process with the default 1 worker), the configuration's Envoy, the
upstream, the floor server, and this client (its own process time). Added latency = B -
A (and F - A) per round (adjacent in time): the median and range over rounds, and over
all rounds pooled; the ratio B / A likewise. sitsmesh's
`sitsmesh_stream_check_messages_total{outcome="forwarded"}` must grow by exactly the
messages of each B round and not at all in A or F.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from token_streams import (
    BenchError,
    group_cpu,
    load1,
    log_notes,
    pct,
)
from token_streams import spread as token_spread
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sitsmesh.dev import envoyconf, harness

MODEL = "bench-model"
UPSTREAM_CODE = """
import asyncio
from grpc import aio
from tritonclient.grpc import service_pb2, service_pb2_grpc

class Echo(service_pb2_grpc.GRPCInferenceServiceServicer):
    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            await context.write(service_pb2.ModelStreamInferResponse(
                infer_response=service_pb2.ModelInferResponse(
                    model_name=request.model_name, id=request.id)))

async def main():
    server = aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print("PORT", port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""
# The floor (--floor): the same filter pointed at a bare grpc.aio ExternalProcessor that
# hands every body chunk straight back: what any Python ext_proc server costs per message.
NOOP_CODE = """
import asyncio
from grpc import aio
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

CONTINUE = {kind: pb.ProcessingResponse(**{kind: answer}) for kind, answer in (
    ("request_headers", pb.HeadersResponse()), ("response_headers", pb.HeadersResponse()),
    ("request_trailers", pb.TrailersResponse()), ("response_trailers", pb.TrailersResponse()))}

class Noop(pb_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator, context):
        async for request in request_iterator:
            kind = request.WhichOneof("request")
            if kind == "request_body":
                body = request.request_body
                await context.write(pb.ProcessingResponse(request_body=pb.BodyResponse(
                    response=pb.CommonResponse(body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(
                            body=body.body, end_of_stream=body.end_of_stream))))))
            else:
                await context.write(CONTINUE[kind])

async def main():
    server = aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Noop(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print("PORT", port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""
FORWARDED = "sitsmesh_stream_check_messages_total"


def request(seq: int, payload: bytes) -> Any:
    message = service_pb2.ModelInferRequest(model_name=MODEL, id=str(seq))
    text = message.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(payload)
    return message


# --------------------------------------------------------------------------- client

@dataclass
class Round:
    config: str
    index: int
    latencies: list[float]
    wall_s: float
    cpu: dict[str, float]  # role -> CPU seconds over the paced part
    forwarded: float = 0.0  # sitsmesh's forwarded-messages counter, delta

    @property
    def messages(self) -> int:
        return len(self.latencies)

    def per_1k(self, role: str) -> float:
        return self.cpu.get(role, 0.0) / self.messages * 1000


@dataclass
class Shared:
    """One round's streams: all open (set once each stream's first answer came), the
    paced part's start (loop clock), and what each stream measured."""

    streams: int
    opened: int = 0
    all_open: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    start: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)


async def _one_stream(port: int, key: str, index: int, args: argparse.Namespace,
                      shared: Shared) -> None:
    payload = b"x" * args.payload_bytes
    period = args.streams / args.rate
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            metadata=(("x-api-key", key),))
        await call.write(request(0, payload))  # the stream's set-up: not counted
        first = await call.read()
        if first is aio.EOF or first.infer_response.id != "0":
            raise BenchError(f"stream {index}: first answer {first!r}, "
                             f"status {await call.code()}")
        shared.opened += 1
        if shared.opened == shared.streams:
            shared.all_open.set()
        await shared.go.wait()
        offset = shared.start + index / args.streams * period
        sent = [0.0] * (args.messages + 1)

        async def writer() -> None:
            loop = asyncio.get_running_loop()
            for k in range(1, args.messages + 1):
                delay = offset + (k - 1) * period - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent[k] = time.monotonic()
                await call.write(request(k, payload))
            await call.done_writing()

        write = asyncio.ensure_future(writer())
        for k in range(1, args.messages + 1):
            answer = await call.read()
            now = time.monotonic()
            if answer is aio.EOF:
                raise BenchError(f"stream {index}: ended after {k - 1} answers, "
                                 f"{await call.code()} {await call.details()}")
            if answer.error_message or answer.infer_response.id != str(k):
                raise BenchError(f"stream {index}: answer {k} was {answer!r}")
            shared.latencies.append(now - sent[k])
        shared.ends.append(time.monotonic())
        await write
        if await call.read() is not aio.EOF or await call.code() != grpc.StatusCode.OK:
            raise BenchError(f"stream {index}: did not end OK: {await call.code()}")


def run_round(name: str, port: int, key: str, index: int, args: argparse.Namespace,
              pgids: dict[str, int], node: harness.Sitsmesh) -> Round:
    cpu_before: dict[str, float] = {}
    bound = args.messages * args.streams / args.rate + 15
    shared: list[Shared] = []

    async def all_streams() -> None:
        mine = Shared(args.streams)
        shared.append(mine)
        tasks = [asyncio.ensure_future(_one_stream(port, key, i, args, mine))
                 for i in range(args.streams)]
        opened = asyncio.ensure_future(mine.all_open.wait())
        done, _ = await asyncio.wait([opened, *tasks], timeout=15,
                                     return_when=asyncio.FIRST_COMPLETED)
        if opened not in done:
            for t in tasks:
                t.cancel()
            failed = [t.exception() for t in done if t.exception() is not None]
            raise failed[0] if failed and failed[0] is not None else BenchError(
                f"{name} round {index}: streams not open within 15 s")
        cpu_before.update({role: group_cpu(pgid) for role, pgid in pgids.items()})
        cpu_before["client"] = time.process_time()
        mine.start = asyncio.get_running_loop().time() + 0.05
        mine.go.set()
        await asyncio.wait_for(asyncio.gather(*tasks), bound)

    before = harness.metric_value(node.metrics(), FORWARDED, outcome="forwarded")
    try:
        asyncio.run(all_streams())
    except TimeoutError:
        raise BenchError(f"{name} round {index}: not done within {bound:.0f} s "
                         f"({len(shared[0].latencies)} answers)") from None
    cpu = {role: group_cpu(pgid) - cpu_before[role] for role, pgid in pgids.items()}
    cpu["client"] = time.process_time() - cpu_before["client"]
    # The loop's clock is time.monotonic().
    wall = max(shared[0].ends) - shared[0].start
    result = Round(name, index, shared[0].latencies, wall, cpu)
    want = args.streams * (args.messages + 1) if name == "B" else 0
    harness.wait_until(lambda: harness.metric_value(
        node.metrics(), FORWARDED, outcome="forwarded") - before >= want, 10,
        "sitsmesh's forwarded count")
    result.forwarded = harness.metric_value(node.metrics(), FORWARDED,
                                            outcome="forwarded") - before
    if result.forwarded != want:
        raise BenchError(f"{name} round {index}: sitsmesh forwarded {result.forwarded:g} "
                         f"messages, expected {want}")
    return result


# --------------------------------------------------------------------------- tables

def ms(value: float) -> str:
    return f"{value * 1000:.3f}"


def spread(values: Sequence[float], fmt: Callable[[float], str] = ms) -> str:
    """token_streams' median (range), in this bench's finer milliseconds by default."""
    return token_spread(values, fmt)


def cpu_fmt(value: float) -> str:
    return f"{value * 1000:.1f}"


def round_line(r: Round) -> str:
    floor = cpu_fmt(r.per_1k("floor")) if "floor" in r.cpu else "-"
    return (f"| {r.index} | {r.config} | {ms(pct(r.latencies, 50))} | "
            f"{ms(pct(r.latencies, 99))} | {ms(max(r.latencies))} | "
            f"{r.messages / r.wall_s:.0f} | {cpu_fmt(r.per_1k('sitsmesh'))} | "
            f"{cpu_fmt(r.per_1k(r.config))} | {cpu_fmt(r.per_1k('upstream'))} | {floor} | "
            f"{cpu_fmt(r.per_1k('client'))} |")


def print_tables(rounds: list[Round], configs: list[str], args: argparse.Namespace) -> None:
    print(f"\n{args.streams} streams x {args.messages} messages per round at "
          f"{args.rate:g} messages/s in total ({args.rate / args.streams:g} per stream), "
          f"{args.payload_bytes}-byte payload; {args.rounds} rounds, order rotated.")
    for name in configs:
        print(f"- {name}: {DESCRIBED[name]}")
    print("\nPer round (latency in ms, send to answer; CPU in ms per 1 000 messages):\n")
    print("| round | config | p50 | p99 | max | msg/s | sitsmesh CPU | Envoy CPU | "
          "upstream CPU | floor CPU | client CPU |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rounds:
        print(round_line(r))
    print(f"\nPer configuration, median over {args.rounds} rounds (range); CPU in ms per "
          "1 000 messages:\n")
    print("| config | p50 ms | p99 ms | msg/s | sitsmesh CPU | Envoy CPU | floor server CPU "
          "| upstream CPU | client CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in configs:
        mine = [r for r in rounds if r.config == name]
        floor = spread([r.per_1k("floor") for r in mine], cpu_fmt) if name == "F" else "-"
        print(f"| {name} | {spread([pct(r.latencies, 50) for r in mine])} | "
              f"{spread([pct(r.latencies, 99) for r in mine])} | "
              f"{spread([r.messages / r.wall_s for r in mine], lambda v: f'{v:.0f}')} | "
              f"{spread([r.per_1k('sitsmesh') for r in mine], cpu_fmt)} | "
              f"{spread([r.per_1k(name) for r in mine], cpu_fmt)} | {floor} | "
              f"{spread([r.per_1k('upstream') for r in mine], cpu_fmt)} | "
              f"{spread([r.per_1k('client') for r in mine], cpu_fmt)} |")
    base = {r.index: r for r in rounds if r.config == "A"}
    for name in configs[1:]:
        print_added(base, {r.index: r for r in rounds if r.config == name}, name)


def print_added(a: dict[int, Round], b: dict[int, Round], name: str) -> None:
    print(f"\nAdded per message ({name} - A, same round), ms, and ratio {name} / A:\n")
    print("| | p50 added | p99 added | p50 ratio | p99 ratio |")
    print("|---|---:|---:|---:|---:|")
    rows: dict[str, list[float]] = {"d50": [], "d99": [], "r50": [], "r99": []}
    for i in sorted(a):
        pa50, pa99 = pct(a[i].latencies, 50), pct(a[i].latencies, 99)
        pb50, pb99 = pct(b[i].latencies, 50), pct(b[i].latencies, 99)
        row = {"d50": pb50 - pa50, "d99": pb99 - pa99, "r50": pb50 / pa50, "r99": pb99 / pa99}
        for k, v in row.items():
            rows[k].append(v)
        print(f"| round {i} | {ms(row['d50'])} | {ms(row['d99'])} | {row['r50']:.2f} | "
              f"{row['r99']:.2f} |")

    def ratio(v: float) -> str:
        return f"{v:.2f}"

    print(f"| median over rounds (range) | {spread(rows['d50'])} | {spread(rows['d99'])} | "
          f"{spread(rows['r50'], ratio)} | {spread(rows['r99'], ratio)} |")
    pooled_a = [x for r in a.values() for x in r.latencies]
    pooled_b = [x for r in b.values() for x in r.latencies]
    print(f"| all rounds pooled | {ms(pct(pooled_b, 50) - pct(pooled_a, 50))} | "
          f"{ms(pct(pooled_b, 99) - pct(pooled_a, 99))} | "
          f"{pct(pooled_b, 50) / pct(pooled_a, 50):.2f} | "
          f"{pct(pooled_b, 99) / pct(pooled_a, 99):.2f} |")
    server = "sitsmesh" if name == "B" else "floor"
    d_server = [b[i].per_1k(server) - a[i].per_1k(server) for i in a]
    d_envoy = [b[i].per_1k(name) - a[i].per_1k("A") for i in a]
    print(f"\nAdded CPU per 1 000 messages ({name} - A, same round), ms: ext_proc server "
          f"({server}) {spread(d_server, cpu_fmt)}, Envoy {spread(d_envoy, cpu_fmt)}")


# --------------------------------------------------------------------------- main

DESCRIBED = {
    "A": "baseline: Envoy + ext_authz, the route's body not buffered and the per_message "
         "context extension (as envoyconf.stream_checks_on sets them), no grpc_stream_check",
    "B": "A + the grpc_stream_check filter (sitsmesh checks every message)",
    "F": "floor: A + the same filter pointed at a bare grpc.aio ExternalProcessor that "
         "hands each body chunk straight back (no checks)",
}


def start_server(code: str, work: Path, role: str) -> tuple[harness.Proc, int]:
    """A Python server from `code`, which prints `PORT <n>` once it listens."""
    server = harness.spawn([sys.executable, "-c", code], work / f"{role}.log")
    port: list[int] = []

    def ready() -> bool:
        if server.proc.poll() is not None:
            raise BenchError(f"{role} exited: {server.output()}")
        words = server.output().split()
        if "PORT" in words:
            port.append(int(words[words.index("PORT") + 1]))
        return bool(port)

    try:
        harness.wait_until(ready, 20, f"the {role}'s port")
    except BaseException:
        server.kill()
        raise
    return server, port[0]


def start_envoy(work: Path, node: harness.Sitsmesh, upstream_port: int, name: str,
                floor_port: int = 0) -> harness.Envoy:
    work.mkdir()
    values = harness.envoy_values(node.data_addr, upstream_port, harness.free_port(),
                                  harness.free_port())
    fragments = ["ext_authz"] if name == "A" else ["ext_authz", "grpc_stream_check"]
    bootstrap = envoyconf.render(harness.REPO / "filters" / "local" / "bootstrap.yaml",
                                 values, fragments)
    envoyconf.add_route(bootstrap, name="grpc_stream", prefix="/inference.",
                        host="127.0.0.1", port=upstream_port, timeout="0s", http2=True)
    envoyconf.stream_checks_on(bootstrap, ["grpc_stream"])
    manager = envoyconf.http_connection_manager(bootstrap)
    if name == "A":  # no filter to turn off on the other routes
        for host in manager["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                route.get("typed_per_filter_config", {}).pop(envoyconf.STREAM_CHECK, None)
    if name == "F":
        clusters = bootstrap["static_resources"]["clusters"]
        floor = copy.deepcopy(next(c for c in clusters if c["name"] == "sitsmesh_data"))
        floor.pop("health_checks", None)
        floor["name"] = floor["load_assignment"]["cluster_name"] = "floor_ext_proc"
        address = floor["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
            "address"]["socket_address"]
        address["port_value"] = floor_port
        clusters.append(floor)
        flt = next(f for f in manager["http_filters"] if f["name"] == envoyconf.STREAM_CHECK)
        flt["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "floor_ext_proc"
    config = envoyconf.write(bootstrap, work / "envoy.yaml")
    return harness.launch_envoy(config, int(values["listen_port"]),  # type: ignore[call-overload]
                                int(values["envoy_admin_port"]),  # type: ignore[call-overload]
                                work / "envoy.log")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--rate", type=float, default=1000.0, help="messages/s, all streams")
    p.add_argument("--streams", type=int, default=10, help="concurrent streams")
    p.add_argument("--messages", type=int, default=500, help="messages per stream per round")
    p.add_argument("--payload-bytes", type=int, default=64, help="text_input bytes")
    p.add_argument("--rounds", type=int, default=8, help="rounds of every configuration")
    p.add_argument("--floor", action="store_true",
                   help="also F: the filter against a bare Python ExternalProcessor")
    args = p.parse_args(argv)
    if min(args.rate, args.streams, args.messages, args.rounds) <= 0:
        p.error("--rate, --streams, --messages and --rounds must be positive")
    configs = ["A", "B", "F"] if args.floor else ["A", "B"]
    start_load = load1()
    print(f"start {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, 1-min load "
          f"{start_load:.2f}", file=sys.stderr)
    rounds: list[Round] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sitsmesh-scbench-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        try:
            upstream, upstream_port = start_server(UPSTREAM_CODE, work, "upstream")
            stack.callback(upstream.kill)
            procs: dict[str, harness.Proc] = {"upstream": upstream}
            floor_port = 0
            if args.floor:
                floor, floor_port = start_server(NOOP_CODE, work, "floor")
                stack.callback(floor.kill)
                procs["floor"] = floor
            node = harness.start_sitsmesh(work)
            stack.callback(node.kill)
            made = node.cli("tenants", "create", "acme", "--models", MODEL)
            if made.returncode != 0:
                raise BenchError(f"tenants create: {made.stderr}")
            keyed = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
            if keyed.returncode != 0:
                raise BenchError(f"apikeys create: {keyed.stderr}")
            key = json.loads(keyed.stdout)["key"]
            envoys = {}
            for name in configs:
                envoys[name] = start_envoy(work / name, node, upstream_port, name, floor_port)
                stack.callback(envoys[name].kill)
            procs.update({"sitsmesh": node, **envoys})
            pgids = {role: proc.proc.pid for role, proc in procs.items()}
            warm = argparse.Namespace(**{**vars(args), "messages": min(args.messages, 100)})
            for name in configs:  # warm-up, not reported
                run_round(name, envoys[name].listen_port, key, -1, warm, pgids, node)
            for i in range(args.rounds):
                shift = i % len(configs)
                for name in configs[shift:] + configs[:shift]:
                    r = run_round(name, envoys[name].listen_port, key, i, args, pgids, node)
                    rounds.append(r)
                    print(round_line(r), file=sys.stderr, flush=True)
            stats = envoys["B"].admin_get("/stats").splitlines()
            ext = [line for line in stats if "ext_proc" in line and not line.endswith(": 0")]
            notes.append("B Envoy's nonzero ext_proc stats: " + "; ".join(ext))
            notes += log_notes(procs)
        except (BenchError, TimeoutError, RuntimeError, OSError) as exc:
            print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    end_load = load1()
    print(f"end {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, 1-min load "
          f"{end_load:.2f}", file=sys.stderr)
    print(f"1-min load: {start_load:.2f} at the start, {end_load:.2f} at the end")
    print_tables(rounds, configs, args)
    print("\nNotes:")
    for note in notes:
        print(f"- {note}")
    print(f"- every message answered in order, every stream ended OK: "
          f"{sum(r.messages for r in rounds)} paced messages; sitsmesh's forwarded count "
          "grew by exactly each B round's messages (set-up ones included), by none in the "
          "others")
    return 0


if __name__ == "__main__":
    sys.exit(main())
