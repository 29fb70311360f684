"""Check throughput: sitsmesh's ext_authz service (1 and 2 workers) vs a no-op grpc.aio one.

Every process is started (and stopped) by this script on free 127.0.0.1 ports:

- **no-op**: a grpc.aio `envoy.service.auth.v3.Authorization` (a subprocess of
  this script) that answers every Check with the same prebuilt OK
  CheckResponse: the Python ceiling;
- `sitsmesh serve` (1 worker);
- `sitsmesh serve --workers 2` (SO_REUSEPORT on one data port);
- two `sitsmesh serve` replicas on one state store, each loaded by its own h2load
  (half the requests and clients each, started together).

Once a sitsmesh answers, the script creates tenant `bench` (models `*`, no
concurrency cap) and one API key through the admin CLI (`sitsmesh tenants
create`, `sitsmesh apikeys create --output json`), against that server's admin
address and state dir.

The load generator is h2load (Debian: nghttp2-client) speaking gRPC unary to
`/envoy.service.auth.v3.Authorization/Check` with a pre-serialized, gRPC-framed
CheckRequest: `attributes.request.http` with path `/v2/models/llama/infer`,
method POST and headers `x-api-key: <key>`, `x-request-id`. The no-op gets the
same request with a dummy key of the same length.

Before any load, each sitsmesh is checked with a real gRPC client, each Check
on a new TCP connection (so that with 2 workers both are reached; the script
also waits for 2 LISTEN sockets on the data port): the key must get status OK
with an ok_response carrying `x-sits-tenant: bench` and `x-sits-model: llama`,
and a Check without a key, and one with a wrong secret, must be denied with
UNAUTHENTICATED and an HTTP 401 denied_response, so the benchmark does not load
a no-op. Every OK reply must have the same size.

Each round must report requests == 2xx and exactly that OK reply's framed size
in DATA bytes per response (a denial is larger; a gRPC error is a trailers-only
response with no DATA), and sitsmesh's own
`grpc_server_handled_total{grpc_method="Check",grpc_code="OK"}` must
grow by exactly the number of requests. p50/p99 come from h2load's per-request
`--log-file`, under the full load (`-c` x `-m` streams in flight).

Rounds interleave the targets (order rotated each round); the table reports
medians per target and the ratio to the no-op median, and the script then
prints the 2-worker vs 1-worker scaling. The 1-worker goal (>= 0.85 of the
no-op) is reported only. The exit status is 1 if any target fails to start,
verify, finish a round, or stop cleanly.

    .venv/bin/python bench/authz_throughput.py --rounds 5 --requests 10000

The process, h2load and table helpers are in benchlib.py; authz_envoy.py also
uses the Check and provisioning pieces here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib as bl
import grpc
import health_throughput as ht

METHOD = "/envoy.service.auth.v3.Authorization/Check"
SERVICE = "envoy.service.auth.v3.Authorization"
TENANT = "bench"
MODEL = "llama"
PATH = f"/v2/models/{MODEL}/infer"
REQUEST_ID = "bench-request-id"
# The shape of a sitsmesh key (smk_<12 hex>_<43 base64url>), for the no-op's request.
DUMMY_KEY = "smk_000000000000_" + "x" * 43
NOOP = "no-op grpc.aio Authorization"
ONE = "sitsmesh serve (1 worker)"
TWO = "sitsmesh serve --workers 2"
REPLICAS = "2 x sitsmesh serve (replicas)"
GOALS = {ONE: 0.85}
# Checks of each kind per sitsmesh before load, each on a new TCP connection: with
# 2 workers behind SO_REUSEPORT, all landing on one worker has odds of 2^-(n-1).
FRESH_CONNECTIONS = 12
CLI_TIMEOUT_S = 15.0
UNAUTHENTICATED = 16  # google.rpc.Code


def check_request(key: str | None, request_id: str = REQUEST_ID) -> Any:
    """An HTTP CheckRequest for POST PATH, with `x-api-key: key` unless key is None."""
    from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2

    ctx = attribute_context_pb2.AttributeContext
    headers = {"x-request-id": request_id}
    if key is not None:
        headers["x-api-key"] = key
    http = ctx.HttpRequest(method="POST", path=PATH, headers=headers)
    return external_auth_pb2.CheckRequest(
        attributes=ctx(request=ctx.Request(http=http)))


def check(addr: str, request: Any, timeout: float = 5.0) -> Any:
    """One Check with a real gRPC client on a new connection; raises grpc.RpcError."""
    from envoy.service.auth.v3 import external_auth_pb2_grpc

    # A local subchannel pool: otherwise channels to one address share a connection.
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(addr, options=options) as channel:
        return external_auth_pb2_grpc.AuthorizationStub(channel).Check(request, timeout=timeout)


def answers(addr: str) -> bool:
    with contextlib.suppress(grpc.RpcError):
        check(addr, check_request(None), timeout=1.0)
        return True
    return False


def ok_headers(reply: Any) -> dict[str, str]:
    return {h.header.key: h.header.value for h in reply.ok_response.headers}


def verify_allowed(reply: Any, what: str) -> None:
    headers = ok_headers(reply)
    if reply.status.code != 0 or not reply.HasField("ok_response") \
            or headers.get("x-sits-tenant") != TENANT or headers.get("x-sits-model") != MODEL:
        raise bl.BenchError(f"{what}: expected OK with x-sits-tenant: {TENANT} and "
                            f"x-sits-model: {MODEL}, got {reply}")


def verify_denied(reply: Any, what: str) -> None:
    if reply.status.code != UNAUTHENTICATED or not reply.HasField("denied_response") \
            or reply.denied_response.status.code != 401:
        raise bl.BenchError(f"{what}: expected UNAUTHENTICATED with an HTTP 401 "
                            f"denied_response, got {reply}")


def wrong_secret(key: str) -> str:
    """The key with its last character changed: same id, wrong secret."""
    return key[:-1] + ("A" if key[-1] != "A" else "B")


def verify_sitsmesh(addr: str, key: str) -> int:
    """Allowed with the key, 401 without or with a wrong one; returns the OK reply's frame size."""
    sizes = set()
    try:
        for i in range(FRESH_CONNECTIONS):
            reply = check(addr, check_request(key))
            verify_allowed(reply, f"Check with the key (connection {i + 1})")
            sizes.add(len(bl.grpc_frame(reply)))
            verify_denied(check(addr, check_request(None)), "Check without a key")
            verify_denied(check(addr, check_request(wrong_secret(key))),
                          "Check with a wrong secret")
    except grpc.RpcError as exc:
        raise bl.BenchError(f"Check failed: {exc}") from exc
    if len(sizes) != 1:
        raise bl.BenchError(f"OK replies differ in size: {sorted(sizes)}")
    return sizes.pop()


def argv_value(proc: bl.Proc, flag: str) -> str:
    return proc.argv[proc.argv.index(flag) + 1]


def provision(proc: bl.Proc) -> str:
    """Tenant `bench` (models '*', no cap) and one API key via the admin CLI; returns the key."""
    where = ["--admin", argv_value(proc, "--admin-addr"),
             "--state-dir", argv_value(proc, "--state-dir")]

    def cli(*argv: str) -> str:
        try:
            done = subprocess.run([bl.SITSMESH, *argv, *where], capture_output=True, text=True,
                                  env=bl.clean_env(), cwd=bl.REPO, timeout=CLI_TIMEOUT_S,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise bl.BenchError(f"sitsmesh {' '.join(argv[:2])} timed out") from exc
        if done.returncode != 0:
            raise bl.BenchError(f"sitsmesh {' '.join(argv[:2])} exited {done.returncode}: "
                                f"{done.stderr.strip()}")
        return done.stdout

    cli("tenants", "create", TENANT, "--models", "*")
    out = cli("apikeys", "create", "--tenant", TENANT, "--output", "json")
    try:
        key = json.loads(out)["key"]
    except (ValueError, KeyError, TypeError) as exc:
        raise bl.BenchError(f"cannot read the key from `apikeys create`: {out!r}") from exc
    if not isinstance(key, str) or len(key) != len(DUMMY_KEY):
        raise bl.BenchError(f"unexpected key shape: {key!r}")
    return key


def handled_ok(n: int) -> dict[str, float]:
    """Counter deltas of a sitsmesh that answered n Checks with gRPC OK."""
    return {bl.sample_key("grpc_server_handled_total", grpc_service=SERVICE,
                          grpc_method="Check", grpc_code="OK", grpc_type="unary"): n}


def prepare_sitsmesh(proc: bl.Proc, data: str, workers: int, timeout: float) -> tuple[str, int]:
    """Wait until up (`workers` LISTEN sockets), provision, wait until every worker knows
    the key, verify. Returns the key and the framed size of its OK reply."""
    port = int(data.rpartition(":")[2])

    def up() -> bool:
        proc.check_alive()
        return ht.listening_sockets(port) >= workers and answers(data)

    bl.wait_until(up, timeout, f"sitsmesh with {workers} listener(s) on {data}")
    key = provision(proc)

    def knows_key() -> bool:  # workers reload the state store within reload_interval (1 s)
        proc.check_alive()
        try:
            return all(check(data, check_request(key)).status.code == 0
                       for _ in range(FRESH_CONNECTIONS))
        except grpc.RpcError:
            return False

    bl.wait_until(knows_key, timeout, f"every worker on {data} to accept the new key")
    return key, verify_sitsmesh(data, key)


# --------------------------------------------------------------------------- targets

def noop_target(workdir: Path, args: argparse.Namespace) -> bl.Target:
    addr = f"127.0.0.1:{bl.free_port()}"
    proc = bl.Proc("no-op server", [sys.executable, str(Path(__file__).resolve()),
                                    "--serve-noop", addr], workdir / "noop.log")
    body = workdir / "check-noop.grpc"
    body.write_bytes(bl.grpc_frame(check_request(DUMMY_KEY)))

    def setup() -> None:
        def ready() -> bool:
            proc.check_alive()
            return answers(addr)

        bl.wait_until(ready, args.ready_timeout, f"{NOOP} on {addr}")
        try:
            reply = check(addr, check_request(DUMMY_KEY))
        except grpc.RpcError as exc:
            raise bl.BenchError(f"Check failed: {exc}") from exc
        if reply.status.code != 0 or not reply.HasField("ok_response"):
            raise bl.BenchError(f"{NOOP}: expected OK, got {reply}")
        size = len(bl.grpc_frame(reply))
        target.response_bytes = (size, size)

    target = bl.Target(NOOP, f"http://{addr}{METHOD}", [proc], setup, bl.grpc_args(body))
    return target


def sitsmesh_target(name: str, workdir: Path, args: argparse.Namespace,
                    workers: int) -> bl.Target:
    extra = ["--workers", str(workers)] if workers > 1 else []
    proc, data, metrics = bl.sitsmesh_proc(f"sitsmesh-{workers}w", workdir, *extra)
    proc.cpu_name = ht.by_kind
    body = workdir / f"check-{workers}w.grpc"

    def setup() -> None:
        key, size = prepare_sitsmesh(proc, data, workers, args.ready_timeout)
        body.write_bytes(bl.grpc_frame(check_request(key)))
        target.response_bytes = (size, size)

    def counters() -> dict[str, float]:
        try:
            return bl.metric_samples(metrics)
        except OSError as exc:
            raise bl.BenchError(f"cannot read counters: {exc}") from exc

    # The handled counter moves when each RPC ends (no periodic flush): no wait needed.
    target = bl.Target(name, f"http://{data}{METHOD}", [proc], setup, bl.grpc_args(body),
                       counters=counters, expected=handled_ok, goal=GOALS.get(name),
                       flush_wait_s=0.0)
    return target


def replicas_target(workdir: Path, args: argparse.Namespace) -> bl.Target:
    """Two `sitsmesh serve` processes on one state store (as replicas behind an Envoy
    cluster), each loaded by its own h2load with half the requests and clients."""
    first, data_a, metrics_a = bl.sitsmesh_proc("replica-a", workdir)
    second, data_b, metrics_b = bl.sitsmesh_proc("replica-b", workdir, "--state-dir",
                                                 argv_value(first, "--state-dir"))
    for proc in (first, second):
        proc.cpu_name = ht.by_kind
    body = workdir / "check-replicas.grpc"

    def setup() -> None:
        key, size = prepare_sitsmesh(first, data_a, 1, args.ready_timeout)

        def knows_key() -> bool:  # b follows the shared state store
            second.check_alive()
            try:
                code: int = check(data_b, check_request(key)).status.code
            except grpc.RpcError:
                return False
            return code == 0

        bl.wait_until(knows_key, args.ready_timeout, f"replica b on {data_b} to know the key")
        if verify_sitsmesh(data_b, key) != size:
            raise bl.BenchError("the replicas' OK replies differ in size")
        body.write_bytes(bl.grpc_frame(check_request(key)))
        target.response_bytes = (size, size)

    def counters() -> dict[str, float]:
        summed: dict[str, float] = {}
        try:
            for metrics in (metrics_a, metrics_b):
                for key, value in bl.metric_samples(metrics).items():
                    summed[key] = summed.get(key, 0.0) + value
        except OSError as exc:
            raise bl.BenchError(f"cannot read counters: {exc}") from exc
        return summed

    target = bl.Target(REPLICAS, f"http://{data_a}{METHOD}", [first, second], setup,
                       bl.grpc_args(body), counters=counters, expected=handled_ok,
                       flush_wait_s=0.0, extra_urls=[f"http://{data_b}{METHOD}"])
    return target


async def serve_noop(addr: str) -> None:
    """The ceiling: the same prebuilt OK CheckResponse for every Check, no interceptors."""
    from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
    from google.rpc import status_pb2

    ok = external_auth_pb2.CheckResponse(status=status_pb2.Status(code=0),
                                         ok_response=external_auth_pb2.OkHttpResponse())

    class Noop(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
        async def Check(self, request: Any, context: Any) -> Any:
            del request, context
            return ok

    server = grpc.aio.server()
    external_auth_pb2_grpc.add_AuthorizationServicer_to_server(Noop(), server)
    await bl.serve_grpc(server, addr)


def scaling(targets: Sequence[bl.Target]) -> str:
    medians = {t.name: statistics.median(t.rates) for t in targets if t.rates}
    if ONE not in medians or TWO not in medians:
        return "2 workers vs 1: n/a (a sitsmesh target failed)"
    line = (f"2 workers vs 1: {medians[TWO] / medians[ONE]:.2f}x "
            f"({medians[TWO]:,.0f} vs {medians[ONE]:,.0f} req/s)")
    if NOOP in medians:
        line += (f"; per worker {medians[TWO] / 2 / medians[NOOP]:.2f} of the no-op "
                 f"(1 worker: {medians[ONE] / medians[NOOP]:.2f})")
    if REPLICAS in medians:
        line += (f"\n2 replicas vs 1 process: {medians[REPLICAS] / medians[ONE]:.2f}x "
                 f"({medians[REPLICAS]:,.0f} req/s)")
    return line


def bench(args: argparse.Namespace) -> int:
    h2load = bl.find_h2load()
    if h2load is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="sitsmesh-authz-bench-") as tmp:
        workdir = Path(tmp)
        targets = [noop_target(workdir, args),
                   sitsmesh_target(ONE, workdir, args, 1),
                   sitsmesh_target(TWO, workdir, args, 2),
                   replicas_target(workdir, args)]
        code = bl.run_bench(targets, args, workdir, h2load, "Authorization/Check, direct gRPC")
        print(f"\n{scaling(targets)}")
        return code


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = bl.load_parser(__doc__, requests=10000)
    p.add_argument("--serve-noop", metavar="ADDR", help=argparse.SUPPRESS)
    return bl.parse_load_args(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_noop:
        asyncio.run(serve_noop(args.serve_noop))
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
