"""Access-log ingestion: sitsmesh's AccessLogService (1 worker, chains on) vs a no-op grpc.aio one.

Two measurements.

**1. Entries per second.** Every server is started (and stopped) by this
script on free 127.0.0.1 ports:

- **no-op**: a grpc.aio `envoy.service.accesslog.v3.AccessLogService` (a
  subprocess of this script) whose StreamAccessLogs iterates the messages,
  counts their entries and discards them; it returns the count in the
  trailing metadata, so the client can check that it saw every entry. This is
  the Python ceiling;
- `sitsmesh serve` (1 worker), with pipeline `demo` applied through the admin
  API (`ApplyPipeline`, bearer token from `<state-dir>/admin-token`): stages
  pre, feat and model, matched by upstream_cluster pre, feat and model.

The load comes from Python client processes (multiprocessing, spawn), not
from this one: `--client-procs` processes share `--streams` concurrent
client-streaming calls. Each stream sends `--messages` StreamAccessLogsMessages
of `--entries-per-message` HTTP entries (Envoy batches), the first message
also carrying the identifier, as Envoy sends it. Each stream's 30 messages
(1,000 requests) are serialized once, before any load, and cycled: the client
only writes bytes. Every 3 consecutive entries are the pre, feat and model
hops of one request. The hops are nested (pre 0-50 ms calls feat 2-42 ms calls
model 5-25 ms), so the assembler's own times are pre 10, feat 20 and model
20 ms, and end to end 50 ms. Request ids never repeat: each id holds an
8-character placeholder, which the client replaces with the pass number over
the pool (one bytes.replace per message, same length). This matters because
the assembler drops hops of a recently closed request id as duplicates.
Every stream sends whole chains, so a round of N entries must
complete exactly N/3 chains. The clients connect first, then all start on
one signal; the rate is all entries over the span from the first start to the
last finish. The client processes measure their own CPU (getrusage, all their
threads) and report it, so the table shows whether they could be the limit.

Before any load, sitsmesh gets one stream of 3 chains plus an entry of an
unknown cluster, and must report exactly 3 more chains, none incomplete, and
stage p50s at the expected own times (within the histogram's 4.4 % buckets).
After every round (warm-up included), the following must hold:

- every stream ended with gRPC OK;
- the no-op counted exactly the entries sent;
- sitsmesh's GetLatencyChain(pipeline="demo", window="5m") `chains` grew by
  exactly entries/3, with `incomplete` unchanged;
- `sitsmesh_pipeline_latency_seconds_count{pipeline="demo"}` grew by
  entries/3;
- `grpc_server_handled_total` for StreamAccessLogs with code OK grew
  by the number of streams.

The window is 5m, not 1m, because a count must not lose a 10 s slot between
two reads; the script fails if sitsmesh has run longer than that window
allows. The sitsmesh process RSS (all processes of its group) is read after
setup, after the warm-up and after every round.

Rounds interleave the two targets (order rotated each round). The table
gives medians and the ratio to the no-op. The goals, >= 30,000 entries/s per
worker and >= 0.70 of the no-op, are only reported.

**2. Memory over 10 million hops.** A spawned process drives hops straight
into an in-process `sitsmesh.chains.assembler.Assembler` (no gRPC, to keep
the time bounded: about 2 minutes by default, `--memory-budget`). It has
pipeline `demo`, a fake clock that advances 1 ms per request and the server's
30 s TTL, and `expire()` runs every simulated second, as the server does.
Each request id is new. One request in 1,000 misses its model hop, so the TTL
path runs too. RSS (from /proc/self/statm) is sampled every `--memory-sample`
hops. The run stops early at the first sample past `--memory-budget` seconds
and says how far it got; stopping early is not a failure. The completed and expired chain counts
must match what was sent.

The exit status is 1 if a target fails to start, verify, finish a round or
stop cleanly, or the memory run fails its checks.

    .venv/bin/python bench/accesslog_throughput.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import benchlib as bl
import grpc
import health_throughput as ht

METHOD = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
PIPELINE = "demo"
STAGES = ("pre", "feat", "model")
PIPELINE_BODY = {"name": PIPELINE, "stages": [
    {"name": s, "match": {"upstream_cluster": s}} for s in STAGES]}
PIPELINE_YAML = "name: demo\nstages:\n" + "".join(
    f"  - name: {s}\n    match:\n      upstream_cluster: {s}\n" for s in STAGES)
# (start offset, duration) in ms of each hop of one request: pre calls feat calls model.
TIMINGS_MS = {"pre": (0.0, 50.0), "feat": (2.0, 40.0), "model": (5.0, 20.0)}
OWN_MS = {"pre": 10.0, "feat": 20.0, "model": 20.0}
E2E_MS = 50.0
BUCKET_RATIO = 2 ** (1 / 16)  # sitsmesh.chains.histogram: a quantile is a bucket's upper bound
POOL_MESSAGES = 30  # prebuilt messages per stream, cycled
EPOCH_MARK = b"zzzzzzzz"  # in every request id of the prebuilt messages; never hex
COUNT_WINDOW = "5m"
COUNT_WINDOW_S = 300
SLOT_S = 10  # the assembler's slot: a window loses its oldest slot every 10 s
ENTRIES_KEY = "x-bench-entries"  # the no-op's trailing metadata
NOOP = "no-op grpc.aio AccessLogService"
SITS = "sitsmesh serve (1 worker, chains on)"
SHARED = "sitsmesh serve, shared_runtime=redis"
GOAL_RATE = 30_000.0
GOAL_RATIO = 0.70
START_NS = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z: start_time of request 0
CONNECT_S = 10.0


# --------------------------------------------------------------------------- entries

def make_entry(request_id: str, stage: str, start_ns: int) -> Any:
    """One HTTP access-log entry as Envoy's ALS sends it, for one hop of a request."""
    from envoy.config.core.v3 import base_pb2
    from envoy.data.accesslog.v3 import accesslog_pb2

    offset_ms, duration_ms = TIMINGS_MS[stage]
    entry = accesslog_pb2.HTTPAccessLogEntry(
        protocol_version=accesslog_pb2.HTTPAccessLogEntry.HTTP2)
    common = entry.common_properties
    common.start_time.FromNanoseconds(start_ns + int(offset_ms * 1e6))
    common.time_to_last_rx_byte.FromNanoseconds(200_000)
    common.time_to_first_upstream_tx_byte.FromNanoseconds(300_000)
    common.time_to_first_downstream_tx_byte.FromNanoseconds(int(duration_ms * 0.5e6))
    common.time_to_last_downstream_tx_byte.FromNanoseconds(int(duration_ms * 1e6))
    common.upstream_cluster = stage
    common.route_name = f"{stage}-route"
    common.downstream_remote_address.socket_address.address = "10.0.0.7"
    common.downstream_remote_address.socket_address.port_value = 41234
    common.upstream_remote_address.socket_address.address = "10.0.1.9"
    common.upstream_remote_address.socket_address.port_value = 8080
    request = entry.request
    request.request_id = request_id
    request.request_method = base_pb2.POST
    request.scheme = "http"
    request.authority = f"{stage}.bench.svc"
    request.path = f"/v2/models/{stage}/infer"
    request.user_agent = "bench/1.0"
    request.request_headers_bytes = 312
    request.request_body_bytes = 76
    entry.response.response_code.value = 200
    entry.response.response_headers_bytes = 128
    entry.response.response_body_bytes = 512
    return entry


def request_id(client: int, stream: int, n: int, epoch: str = "00000000") -> str:
    """A UUID-shaped id; `epoch` (8 characters) is EPOCH_MARK in the prebuilt messages."""
    return f"{epoch}-{client:04x}-{stream:04x}-8000-{n:012x}"


@dataclass
class StreamPool:
    """One stream's prebuilt messages: whole chains over the pool, request ids marked."""

    identifier: bytes  # a message with only the identifier, sent before the first one
    pool: list[bytes]
    sent: int = 0  # messages sent so far, over all rounds

    def message(self, first: bool) -> bytes:
        """The next message: ids get this pass over the pool as epoch, so none repeats."""
        epoch, position = divmod(self.sent, len(self.pool))
        self.sent += 1
        body = self.pool[position].replace(EPOCH_MARK, b"%08x" % epoch)
        # Serialized messages concatenate into one message with the fields of both.
        return self.identifier + body if first else body


def message_pool(client: int, stream: int, per_message: int) -> StreamPool:
    from envoy.service.accesslog.v3 import als_pb2

    msg_type = als_pb2.StreamAccessLogsMessage
    mark = EPOCH_MARK.decode()
    pool: list[bytes] = []
    k = 0
    for _ in range(POOL_MESSAGES):
        msg = msg_type()
        for _ in range(per_message):
            n = k // 3
            msg.http_logs.log_entry.append(make_entry(
                request_id(client, stream, n, mark), STAGES[k % 3], START_NS + n * 10**6))
            k += 1
        body = msg.SerializeToString()
        if body.count(EPOCH_MARK) != per_message:
            raise AssertionError("the epoch mark must appear once per entry")
        pool.append(body)
    ident = msg_type()
    ident.identifier.node.id = f"bench-envoy-{client}-{stream}"
    ident.identifier.node.cluster = "bench"
    ident.identifier.log_name = "sits_als"
    return StreamPool(ident.SerializeToString(), pool)


def entries_message(entries: Sequence[Any]) -> Any:
    from envoy.service.accesslog.v3 import als_pb2

    msg = als_pb2.StreamAccessLogsMessage()
    msg.http_logs.log_entry.extend(entries)
    return msg


# --------------------------------------------------------------------------- client processes

def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _one_stream(multi: Any, stream: StreamPool, messages: int,
                      timeout: float) -> int | None:
    """One StreamAccessLogs call; the entry count in the trailers (no-op only), or None."""
    call = multi(timeout=timeout)
    for i in range(messages):
        await call.write(stream.message(i == 0))
    await call.done_writing()
    await call
    for key, value in await call.trailing_metadata():
        if key == ENTRIES_KEY:
            return int(value)
    return None


async def _client_round(conn: Connection, seq: int, addr: str, streams: list[StreamPool],
                        messages: int, timeout: float) -> dict[str, Any] | None:
    """`addr`: one address, or several joined by commas (stream i to the i-th, round robin)."""
    async with contextlib.AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(grpc.aio.insecure_channel(a))
                    for a in addr.split(",")]
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), CONNECT_S)
        # No serializer: the messages are bytes already.
        multis: list[Any] = [channel.stream_unary(METHOD) for channel in channels]
        conn.send(("ready", seq, None))
        if not conn.poll(timeout):
            raise RuntimeError("no go signal")
        cmd = conn.recv()
        if cmd != ("go", seq):
            return None  # aborted: another client failed to get ready
        cpu, started = _cpu_self(), time.monotonic()
        counts = await asyncio.gather(*(_one_stream(multis[i % len(multis)], stream,
                                                    messages, timeout)
                                        for i, stream in enumerate(streams)))
        finished = time.monotonic()
        return {"start": started, "end": finished, "cpu": _cpu_self() - cpu,
                "counts": list(counts)}


def client_main(conn: Connection, client: int, streams: int, per_message: int,
                timeout: float) -> None:
    """A load client: builds its streams' messages, then runs rounds on command."""
    pools = [message_pool(client, s, per_message) for s in range(streams)]
    conn.send(("started", 0, None))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd[0] == "stop":
            return
        if cmd[0] != "run":
            continue  # a late go/abort of a round that failed
        _, seq, addr, messages = cmd
        try:
            result = asyncio.run(_client_round(conn, seq, addr, pools, messages, timeout))
        except Exception as exc:
            conn.send(("error", seq, f"{type(exc).__name__}: {exc}"))
        else:
            if result is not None:
                conn.send(("done", seq, result))


@dataclass
class Client:
    index: int
    streams: int
    process: BaseProcess
    conn: Connection


@dataclass(frozen=True)
class Load:
    entries: int
    wall_s: float
    client_cpu_s: float
    counts: list[int | None]  # per stream, as the server reported it


class Clients:
    def __init__(self, procs: int, streams: int, per_message: int, timeout: float) -> None:
        self.per_message = per_message
        self.timeout = timeout
        self.clients: list[Client] = []
        self._seq = 0
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that uses gRPC
        for i in range(procs):
            share = streams // procs + (1 if i < streams % procs else 0)
            parent, child = ctx.Pipe()
            process = ctx.Process(target=client_main, name=f"bench-client-{i}",
                                  args=(child, i, share, per_message, timeout), daemon=True)
            self.clients.append(Client(i, share, process, parent))

    @property
    def streams(self) -> int:
        return sum(c.streams for c in self.clients)

    def start(self) -> None:
        for c in self.clients:
            c.process.start()
        for c in self.clients:
            self._recv(c, "started", 60.0, 0)

    def _recv(self, c: Client, kind: str, timeout: float, seq: int) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not c.conn.poll(left):
                    raise bl.BenchError(f"client {c.index}: no '{kind}' within {timeout:g}s")
                got_kind, got_seq, payload = c.conn.recv()
            except (EOFError, OSError) as exc:
                raise bl.BenchError(f"client {c.index} exited (exit code "
                                    f"{c.process.exitcode})") from exc
            if got_seq != seq:
                continue  # left over from a failed round
            if got_kind == "error":
                raise bl.BenchError(f"client {c.index}: {payload}")
            if got_kind != kind:
                raise bl.BenchError(f"client {c.index}: expected '{kind}', got '{got_kind}'")
            return payload

    def run(self, addr: str, messages: int) -> Load:
        """All streams send `messages` messages to addr, started together."""
        self._seq += 1
        seq = self._seq
        for c in self.clients:
            c.conn.send(("run", seq, addr, messages))
        try:
            for c in self.clients:
                self._recv(c, "ready", CONNECT_S + 5, seq)
        except bl.BenchError:
            for c in self.clients:
                with contextlib.suppress(OSError):
                    c.conn.send(("abort", seq))
            raise
        for c in self.clients:
            c.conn.send(("go", seq))
        results = [self._recv(c, "done", self.timeout + 5, seq) for c in self.clients]
        counts: list[int | None] = [n for r in results for n in r["counts"]]
        return Load(self.streams * messages * self.per_message,
                    max(r["end"] for r in results) - min(r["start"] for r in results),
                    sum(r["cpu"] for r in results), counts)

    def stop(self) -> list[str]:
        errors = []
        for c in self.clients:
            with contextlib.suppress(OSError):
                c.conn.send(("stop", 0))
        for c in self.clients:
            if c.process.pid is None:
                continue
            c.process.join(10)
            if c.process.exitcode is None:
                errors.append(f"client {c.index} did not exit on stop")
                c.process.kill()
                c.process.join(5)
            elif c.process.exitcode != 0:
                errors.append(f"client {c.index} exited {c.process.exitcode}")
            c.conn.close()
        return errors


# --------------------------------------------------------------------------- targets

def group_rss_mib(proc: bl.Proc) -> float:
    """Resident memory of every process in the Proc's group, MiB."""
    if proc.proc is None:
        return 0.0
    pgid, pages = proc.proc.pid, 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                pages += int(fields[21])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class Target:
    name: str
    addr: str
    proc: bl.Proc
    setup: Callable[[], None]  # ready, then correct; raises BenchError
    counters: Callable[[], dict[str, float]]
    verify: Callable[[dict[str, float], Load], None]  # counters before the round, the load
    rates: list[float] = field(default_factory=list)
    server_us: list[float] = field(default_factory=list)
    server_cores: list[float] = field(default_factory=list)
    client_cores: list[float] = field(default_factory=list)
    rss_mib: list[tuple[str, float]] = field(default_factory=list)
    warmup_rate: float | None = None
    errors: list[str] = field(default_factory=list)


def run_round(target: Target, clients: Clients, messages: int) -> tuple[Load, float]:
    """One checked load; the server's CPU seconds."""
    target.proc.check_alive()
    before = target.counters()
    cpu_before = bl.procs_cpu([target.proc])
    load = clients.run(target.addr, messages)
    cpu_after = bl.procs_cpu([target.proc])
    server_cpu = sum(v - cpu_before.get(k, 0.0) for k, v in cpu_after.items())
    target.verify(before, load)
    return load, server_cpu


def noop_target(workdir: Path) -> Target:
    addr = f"127.0.0.1:{bl.free_port()}"
    proc = bl.Proc("no-op server", [sys.executable, str(Path(__file__).resolve()),
                                    "--serve-noop", addr], workdir / "noop.log")

    def setup() -> None:
        def ready() -> bool:
            proc.check_alive()
            return ht.listening_sockets(int(addr.rpartition(":")[2])) >= 1

        bl.wait_until(ready, 30.0, f"{NOOP} on {addr}")

    def verify(before: dict[str, float], load: Load) -> None:
        del before
        if sum(n or 0 for n in load.counts) != load.entries or None in load.counts:
            raise bl.BenchError(f"the no-op counted {load.counts} entries per stream, "
                                f"{load.entries} sent")

    return Target(NOOP, addr, proc, setup, dict, verify)


class Admin:
    """sitsmesh's admin API with the bearer token of its state dir."""

    def __init__(self, addr: str, state_dir: Path) -> None:
        self.addr = addr
        self.state_dir = state_dir
        self.channel: grpc.Channel | None = None
        self.metadata: tuple[tuple[str, str], ...] = ()

    def connect(self) -> None:
        token = (self.state_dir / "admin-token").read_text().strip()
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.channel = grpc.insecure_channel(self.addr)

    def stub(self) -> Any:
        from sitsmesh.admin.v1 import admin_pb2_grpc

        if self.channel is None:
            self.connect()
        assert self.channel is not None
        return admin_pb2_grpc.AdminServiceStub(self.channel)

    def chain(self) -> Any:
        from sitsmesh.admin.v1 import admin_pb2

        return self.stub().GetLatencyChain(
            admin_pb2.GetLatencyChainRequest(pipeline=PIPELINE, window=COUNT_WINDOW),
            metadata=self.metadata, timeout=5.0)

    def apply(self) -> Any:
        from sitsmesh.admin.v1 import admin_pb2

        return self.stub().ApplyPipeline(
            admin_pb2.ApplyPipelineRequest(yaml=PIPELINE_YAML, source="bench"),
            metadata=self.metadata, timeout=5.0)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


def check_own_times(reply: Any, what: str) -> None:
    """Every stage's p50 own time, and the e2e p50, in the bucket of the expected value."""
    got = {s.name: s.p50_ms for s in reply.stages}
    want = {**OWN_MS, "e2e": E2E_MS}
    got["e2e"] = reply.e2e_p50_ms
    wrong = {k: got.get(k) for k, v in want.items()
             if not v * 0.999 <= got.get(k, 0.0) <= v * BUCKET_RATIO * 1.001}
    if wrong:
        raise bl.BenchError(f"{what}: p50 own times {got}, expected {want} (ms, within one "
                            f"histogram bucket)")


def sitsmesh_target(workdir: Path, args: argparse.Namespace,
                    redis_url: str = "") -> tuple[Target, Admin]:
    """With `redis_url`, every hop goes through the shared hop bus (a Redis stream) and
    back before the assembler sees it, as on every replica of a fleet."""
    extra = ["--shared-runtime", "redis", "--redis-url", redis_url] if redis_url else []
    proc, data, metrics = bl.sitsmesh_proc("sitsmesh-shared" if redis_url else "sitsmesh-1w",
                                           workdir, *extra)
    proc.cpu_name = ht.by_kind
    admin_addr = proc.argv[proc.argv.index("--admin-addr") + 1]
    admin = Admin(admin_addr, Path(proc.argv[proc.argv.index("--state-dir") + 1]))
    born = [0.0]
    handled = bl.sample_key("grpc_server_handled_total",
                            grpc_service="envoy.service.accesslog.v3.AccessLogService",
                            grpc_method="StreamAccessLogs", grpc_code="OK",
                            grpc_type="client_stream")
    e2e_count = bl.sample_key("sitsmesh_pipeline_latency_seconds_count", pipeline=PIPELINE)

    def counters() -> dict[str, float]:
        age = time.monotonic() - born[0]
        if age > COUNT_WINDOW_S - 2 * SLOT_S:
            raise bl.BenchError(f"sitsmesh has run {age:.0f} s: the {COUNT_WINDOW} window no "
                                "longer holds every chain; use fewer rounds or messages")
        try:
            reply = admin.chain()
            samples = bl.metric_samples(metrics)
        except (grpc.RpcError, OSError) as exc:
            raise bl.BenchError(f"cannot read counters: {exc}") from exc
        return {"chains": reply.chains, "incomplete": reply.incomplete,
                "e2e_count": samples.get(e2e_count, 0.0), "handled": samples.get(handled, 0.0)}

    def check(before: dict[str, float], chains: int, streams: int) -> None:
        want = {"chains": chains, "incomplete": 0, "e2e_count": chains, "handled": streams}
        deadline = time.monotonic() + bl.COUNTER_SETTLE_S
        while True:
            after = counters()
            wrong = [f"{k}: grew by {after[k] - before[k]:g}, expected {v:g}"
                     for k, v in want.items() if after[k] - before[k] != v]
            if not wrong:
                return
            if time.monotonic() > deadline:
                raise bl.BenchError("sitsmesh's counts disagree with the load:\n  "
                                    + "\n  ".join(wrong))
            time.sleep(0.2)

    def setup() -> None:
        from envoy.service.accesslog.v3 import als_pb2_grpc

        def up() -> bool:
            proc.check_alive()
            if not (admin.state_dir / "admin-token").exists() \
                    or ht.listening_sockets(int(data.rpartition(":")[2])) < 1:
                return False
            with contextlib.suppress(grpc.RpcError):
                admin.apply()
                return True
            return False

        bl.wait_until(up, args.ready_timeout, f"sitsmesh on {data} to accept the pipeline")
        born[0] = time.monotonic()
        target.rss_mib.append(("after setup", group_rss_mib(proc)))
        # 3 chains with a stray entry of a cluster no stage matches, on a plain stub.
        entries = [make_entry(request_id(99, 0, n), STAGES[k], START_NS + n * 10**6)
                   for n in range(3) for k in range(3)]
        entries.insert(4, make_entry(request_id(99, 1, 0), "pre", START_NS))
        entries[4].common_properties.upstream_cluster = "unrelated"
        before = counters()
        with grpc.insecure_channel(data) as channel:
            try:
                als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(
                    iter([entries_message(entries)]), timeout=5.0)
            except grpc.RpcError as exc:
                raise bl.BenchError(f"StreamAccessLogs failed: {exc}") from exc
        check(before, 3, 1)
        check_own_times(admin.chain(), "after 3 chains")

    def verify(before: dict[str, float], load: Load) -> None:
        check(before, load.entries // 3, len(load.counts))

    target = Target(SHARED if redis_url else SITS, data, proc, setup, counters, verify)
    return target, admin


async def serve_noop(addr: str) -> None:
    """The ceiling: iterate the messages, count the entries, discard them."""
    from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

    reply = als_pb2.StreamAccessLogsResponse()

    class Noop(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
        async def StreamAccessLogs(self, request_iterator: Any, context: Any) -> Any:
            entries = 0
            async for message in request_iterator:
                entries += len(message.http_logs.log_entry)
            context.set_trailing_metadata(((ENTRIES_KEY, str(entries)),))
            return reply

    server = grpc.aio.server()
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(Noop(), server)
    await bl.serve_grpc(server, addr)


# --------------------------------------------------------------------------- part 1

def throughput(args: argparse.Namespace, workdir: Path,
               redis_url: str = "") -> tuple[list[Target], list[str]]:
    noop = noop_target(workdir)
    sits, admin = sitsmesh_target(workdir, args)
    targets = [noop, sits]
    admins = [admin]
    if redis_url:
        shared, shared_admin = sitsmesh_target(workdir, args, redis_url)
        targets.append(shared)
        admins.append(shared_admin)
    clients = Clients(args.client_procs, args.streams, args.entries_per_message, args.timeout)
    errors: list[str] = []
    try:
        for t in targets:
            t.proc.start()
        clients.start()
        for t in targets:
            try:
                t.setup()
                load, _ = run_round(t, clients, args.warmup_messages)
                t.warmup_rate = load.entries / load.wall_s
                t.rss_mib.append(("after warm-up", group_rss_mib(t.proc)))
            except bl.BenchError as exc:
                t.errors.append(f"setup: {exc}")
        live = [t for t in targets if not t.errors]
        for rnd in range(args.rounds):
            shift = rnd % len(live) if live else 0
            for t in live[shift:] + live[:shift]:
                try:
                    load, server_cpu = run_round(t, clients, args.messages)
                except bl.BenchError as exc:
                    t.errors.append(f"round {rnd + 1}: {exc}")
                    continue
                t.rates.append(load.entries / load.wall_s)
                t.server_us.append(server_cpu * 1e6 / load.entries)
                t.server_cores.append(server_cpu / load.wall_s)
                t.client_cores.append(load.client_cpu_s / load.wall_s)
                t.rss_mib.append((f"after round {rnd + 1}", group_rss_mib(t.proc)))
                print(f"round {rnd + 1}/{args.rounds}  {t.name:<38} {t.rates[-1]:>9,.0f} "
                      f"entries/s  {load.wall_s:5.2f} s  server {t.server_cores[-1]:.2f} "
                      f"cores  clients {t.client_cores[-1]:.2f} cores  RSS "
                      f"{t.rss_mib[-1][1]:.1f} MiB", file=sys.stderr, flush=True)
    finally:
        errors.extend(clients.stop())
        for one in admins:
            one.close()
        for t in reversed(targets):
            t.errors.extend(t.proc.stop())
    return targets, errors


def render_throughput(targets: Sequence[Target], args: argparse.Namespace) -> str:
    base = statistics.median(targets[0].rates) if targets[0].rates else None
    lines = ["| target | median entries/s | ratio vs no-op | server CPU (µs/entry) "
             "| server cores busy | client cores busy | rounds ok | entries/s per round |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for t in targets:
        if t.rates:
            median = statistics.median(t.rates)
            cells = [f"{median:,.0f}", f"{median / base:.2f}" if base else "n/a",
                     f"{statistics.median(t.server_us):.1f}",
                     f"{statistics.median(t.server_cores):.2f}",
                     f"{statistics.median(t.client_cores):.2f}"]
        else:
            cells = ["failed", "n/a", "n/a", "n/a", "n/a"]
        per_round = ", ".join(f"{r:,.0f}" for r in t.rates) or "-"
        lines.append(f"| {t.name} | {' | '.join(cells)} | {len(t.rates)}/{args.rounds} "
                     f"| {per_round} |")
    return "\n".join(lines)


def goals(targets: Sequence[Target]) -> str:
    noop, sits = targets[:2]
    if not (noop.rates and sits.rates):
        return "Goals: n/a (a target failed)"
    rate = statistics.median(sits.rates)
    ratio = rate / statistics.median(noop.rates)
    met = ("met" if rate >= GOAL_RATE else "**not met**",
           "met" if ratio >= GOAL_RATIO else "**not met**")
    return (f"Goals: >= {GOAL_RATE:,.0f} entries/s per worker: {met[0]} ({rate:,.0f}); "
            f">= {GOAL_RATIO:.2f} of the no-op: {met[1]} ({ratio:.2f}).")


# --------------------------------------------------------------------------- part 2

def _rss_self_mib() -> float:
    resident = int(Path("/proc/self/statm").read_text().split()[1])
    return resident * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_main(conn: Connection, hops: int, sample_every: int, budget_s: float) -> None:
    """Drive hops into an in-process Assembler; send (hops, RSS MiB, seconds, open) samples."""
    from sitsmesh.chains.assembler import Assembler, Hop
    from sitsmesh.chains.pipeline import pipeline_from

    now = [0.0]
    completed = [0]

    def on_chain(pipeline: str, own: dict[str, float], e2e: float) -> None:
        del pipeline, own, e2e
        completed[0] += 1

    asm = Assembler({PIPELINE: pipeline_from(PIPELINE, PIPELINE_BODY)},
                    clock=lambda: now[0], ttl_s=30.0, on_chain=on_chain)
    conn.send(("sample", (0, _rss_self_mib(), 0.0, 0)))
    timings = [(stage, TIMINGS_MS[stage][0] / 1000, TIMINGS_MS[stage][1] / 1000)
               for stage in STAGES]
    started = time.monotonic()
    sent = requests = partial = expired = 0
    next_sample = sample_every
    while sent < hops:
        rid = f"{requests:032x}"
        base = 1.7e9 + requests * 0.001
        for stage, offset, nominal in timings:
            duration = nominal
            if stage == "model":
                if requests % 1000 == 999:
                    partial += 1
                    continue  # this request's model hop never comes: the chain expires
                duration += (requests % 97) * 0.0001  # still nested in feat
            asm.add(Hop(rid, base + offset, duration, ttfb=duration / 2, queue=0.0003,
                        upstream_cluster=stage))
            sent += 1
        requests += 1
        now[0] += 0.001  # 1,000 requests per simulated second
        if requests % 1000 == 0:
            expired += asm.expire()
        if sent >= next_sample:
            next_sample += sample_every
            elapsed = time.monotonic() - started
            conn.send(("sample", (sent, _rss_self_mib(), elapsed, asm.open_chains())))
            if elapsed > budget_s:
                break
    conn.send(("end", {"hops": sent, "requests": requests, "completed": completed[0],
                       "partial": partial, "expired": expired, "open": asm.open_chains(),
                       "duplicates": asm.duplicates, "unmatched": asm.unmatched,
                       "seconds": time.monotonic() - started,
                       "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def memory(args: argparse.Namespace) -> tuple[list[tuple[int, float, float, int]],
                                              dict[str, Any] | None, list[str]]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=memory_main, name="bench-memory", daemon=True,
                          args=(child, args.memory_hops, args.memory_sample,
                                args.memory_budget))
    samples: list[tuple[int, float, float, int]] = []
    end: dict[str, Any] | None = None
    errors: list[str] = []
    process.start()
    try:
        deadline = time.monotonic() + args.memory_budget + 120
        while end is None:
            left = deadline - time.monotonic()
            if left <= 0 or not parent.poll(left):
                errors.append("memory run: timed out")
                break
            try:
                kind, payload = parent.recv()
            except EOFError:
                errors.append(f"memory run exited {process.exitcode} before its end")
                break
            if kind == "sample":
                samples.append(payload)
                print(f"memory  {payload[0]:>11,} hops  RSS {payload[1]:7.1f} MiB  "
                      f"{payload[2]:6.1f} s  open {payload[3]}", file=sys.stderr, flush=True)
            else:
                end = payload
    finally:
        process.join(10)
        if process.exitcode is None:
            process.kill()
            process.join(5)
        parent.close()
    if end is not None:
        # Every request was sent whole: those missing a hop expire or are still open.
        partial = end["partial"]
        if end["completed"] != end["requests"] - partial:
            errors.append(f"memory run: {end['completed']} chains completed, expected "
                          f"{end['requests'] - partial}")
        if end["expired"] + end["open"] != partial:
            errors.append(f"memory run: {end['expired']} expired + {end['open']} open, "
                          f"expected {partial}")
        if end["duplicates"] or end["unmatched"]:
            errors.append(f"memory run: {end['duplicates']} duplicates, "
                          f"{end['unmatched']} unmatched")
    return samples, end, errors


def render_memory(samples: Sequence[tuple[int, float, float, int]],
                  end: dict[str, Any] | None, hops: int) -> str:
    lines = ["| hops | RSS (MiB) | elapsed (s) | hops/s since previous sample | open chains |",
             "|---:|---:|---:|---:|---:|"]
    previous: tuple[int, float, float, int] | None = None
    for s in samples:
        rate = "-" if previous is None or s[2] <= previous[2] else \
            f"{(s[0] - previous[0]) / (s[2] - previous[2]):,.0f}"
        lines.append(f"| {s[0]:,} | {s[1]:.1f} | {s[2]:.1f} | {rate} | {s[3]} |")
        previous = s
    if len(samples) >= 3:  # growth from the first sample after the start to the last
        first, last = samples[1], samples[-1]
        growth = last[1] - first[1]
        lines.append(f"\nRSS growth from {first[0]:,} to {last[0]:,} hops: "
                     f"{growth:+.1f} MiB ({growth / first[1]:+.1%}).")
    if end is not None and end["hops"] < hops:
        lines.append(f"Stopped early, at the first sample past --memory-budget: {end['hops']:,} "
                     f"of {hops:,} hops.")
    if end is not None:
        lines.append(f"Overall {end['hops'] / end['seconds']:,.0f} hops/s in "
                     f"{end['seconds']:.1f} s; {end['completed']:,} chains completed, "
                     f"{end['expired']:,} expired incomplete, {end['open']} open at the end; "
                     f"peak RSS {end['maxrss_mib']:.1f} MiB.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def bench(args: argparse.Namespace) -> int:
    started = time.monotonic()
    failed = False
    with tempfile.TemporaryDirectory(prefix="sitsmesh-accesslog-bench-") as tmp, \
            contextlib.ExitStack() as stack:
        redis_url = ""
        if args.shared:  # the hop bus's cost: a redis-server for the shared target
            from sitsmesh.dev.redis import redis_server

            redis_url = stack.enter_context(redis_server(Path(tmp) / "redis")).url
        targets, errors = throughput(args, Path(tmp), redis_url)
        print(f"\nStreamAccessLogs, direct gRPC: {args.client_procs} client processes, "
              f"{args.streams} streams x {args.messages} messages x "
              f"{args.entries_per_message} entries "
              f"({args.streams * args.messages * args.entries_per_message:,} entries/round), "
              f"{args.rounds} rounds, {os.cpu_count()} CPUs, "
              f"{time.monotonic() - started:.0f} s\n")
        print(render_throughput(targets, args))
        print(f"\n{goals(targets)}")
        warm = args.streams * args.warmup_messages * args.entries_per_message
        for t in targets:
            if t.warmup_rate is not None:
                print(f"\n{t.name} warm-up ({warm:,} entries, uncounted): "
                      f"{t.warmup_rate:,.0f} entries/s")
        for t in targets:
            if t.rss_mib:
                print(f"\n{t.name} RSS (MiB): "
                      + ", ".join(f"{what} {mib:.1f}" for what, mib in t.rss_mib))
        for t in targets:
            if t.errors or len(t.rates) != args.rounds:
                failed = True
                print(f"\nFAILED {t.name}:", file=sys.stderr)
                for err in t.errors or ["fewer successful rounds than requested"]:
                    print(f"  {err}", file=sys.stderr)
                tail = t.proc.output_tail()
                if tail:
                    print(f"  --- last output of {t.proc.role} ---\n{tail}", file=sys.stderr)
        for err in errors:
            failed = True
            print(f"FAILED: {err}", file=sys.stderr)
    if args.memory_hops > 0:
        samples, end, mem_errors = memory(args)
        print("\nAssembler memory, in process (no gRPC), fake clock 1 ms per request:\n")
        print(render_memory(samples, end, args.memory_hops))
        for err in mem_errors:
            failed = True
            print(f"FAILED: {err}", file=sys.stderr)
    return 1 if failed else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=5, help="rounds per target (default 5)")
    p.add_argument("--shared", action="store_true",
                   help="also a sitsmesh with shared_runtime=redis (its own redis-server): "
                        "what the hop bus costs per entry")
    p.add_argument("--streams", type=int, default=4,
                   help="concurrent StreamAccessLogs calls (default 4)")
    p.add_argument("--client-procs", type=int, default=2,
                   help="client processes sharing the streams (default 2)")
    p.add_argument("--messages", type=int, default=2100,
                   help="messages per stream per round (default 2100)")
    p.add_argument("--entries-per-message", type=int, default=100,
                   help="entries per message (default 100)")
    p.add_argument("--warmup-messages", type=int, default=300,
                   help="messages per stream in the uncounted warm-up (default 300)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds allowed per round (default 120)")
    p.add_argument("--ready-timeout", type=float, default=30.0,
                   help="seconds allowed for sitsmesh to accept the pipeline (default 30)")
    p.add_argument("--memory-hops", type=int, default=10_000_000,
                   help="hops driven into the in-process assembler; 0 skips (default 10M)")
    p.add_argument("--memory-sample", type=int, default=1_000_000,
                   help="hops between RSS samples (default 1M)")
    p.add_argument("--memory-budget", type=float, default=120.0,
                   help="seconds after which the memory run stops at its next sample "
                        "(default 120)")
    p.add_argument("--serve-noop", metavar="ADDR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.rounds, args.streams, args.client_procs, args.messages,
           args.entries_per_message, args.warmup_messages, args.memory_sample) < 1:
        p.error("counts must be >= 1")
    if args.client_procs > args.streams:
        p.error("--client-procs must not exceed --streams")
    for flag, messages in (("--messages", args.messages),
                           ("--warmup-messages", args.warmup_messages)):
        if messages * args.entries_per_message % 3:
            p.error(f"{flag} x --entries-per-message must be a multiple of 3 (whole chains)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_noop:
        asyncio.run(serve_noop(args.serve_noop))
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
