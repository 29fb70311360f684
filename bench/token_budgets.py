"""Token budgets (issue 28): how far a budget is overshot per window when reserving at
Check vs charging after the stream, what a reservation adds to Check, and the Redis
round trips it costs.

Everything runs on 127.0.0.1 free ports, started and stopped by this script, each
role its own process: `sitsmesh serve` (harness defaults, `--reload-interval-seconds
0.2`), Envoy with the ext_authz, token_timing and access_log fragments, a
`sitsmesh.dev.tokenstage` TokenStage (own process), and for parts b and c a
redis-server (`sitsmesh.dev.redis`).

a. **Overshoot per window.** One tenant with a budget of `--budget` tokens a minute;
   `--clients` concurrent streaming clients (raw asyncio HTTP/1.1, tests/budgetload.py)
   each loop: stream a chat completion (`--max-tokens`, stage time per token
   `--itl-ms`, so about `--clients` streams are in flight while the budget lasts); on
   429 wait the Retry-After capped at 1 s. Two fresh stacks run side by side, at the
   same time on the same windows: sitsmesh with `--budget-charging reserve` and with
   `charge_after`, each with its own Envoy and stage. The load starts 0.25 s before a
   minute boundary (`--no-align`: at once) and lasts `--seconds` + 0.5 s, so 120 s
   covers two windows. **Tokens charged are summed client-side**: per stream the input
   estimate ceil(body bytes / 4) plus the content tokens received, in the window the
   request started in (sitsmesh charges a stream without `usage` exactly that, in the
   window it reserved in); after the load the total is checked against sitsmesh's
   `sitsmesh_token_budget_tokens_total` (input + output) and must be equal (else exit
   1). Per window: tokens charged, the ratio to the budget; per mode the max and median
   ratio over the windows fully covered. Target: reserve <= 1.05 in every window.
b. **Check latency a reservation adds.** A gRPC `Authorization/Check` client (sync
   grpcio, one channel, calls one after another, as Envoy would send them: POST
   /v1/chat/completions with the body packed as bytes, `x-api-key`, a fresh
   `x-request-id` each) against sitsmesh's data port: a tenant without a budget vs one
   with a budget (10^9 tokens a minute: never refused), on the memory ledger and on
   Redis (`--ratelimit-store redis`). `--rounds` interleaved rounds of `--calls` calls
   per configuration, alternating order; p50/p99 per round, median (range) over rounds,
   and budget minus no budget per round. Reservations are never settled here (held).
c. **Redis commands per request.** On the Redis sitsmesh, through Envoy, in
   alternating rounds of `--streams` N streams (the stage produces 20 tokens): of the
   tenant without a budget; of the budgeted one with max_tokens 20 (the estimate is
   exact, settling adjusts nothing); and with max_tokens 40 (over, settling adjusts).
   The redis-server's `INFO commandstats` delta (INFO left out, one measuring
   connection) once sitsmesh has logged every stream (and settled every budgeted one),
   divided by N: round trips, and apart the commands the Lua scripts run inside Redis.

Prints markdown tables on stdout, progress on stderr; exit 1 if anything fails
(a setup, a request with a status other than 200/429, a stream without [DONE], a
count that disagrees).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from sitsmesh.dev import harness
from tests import budgetload as bl

STAGE_CODE = """
import sys, threading
from sitsmesh.dev.tokenstage import TokenStage
stage = TokenStage(ttft_s=0.02, itl_s=float(sys.argv[1]), tokens=int(sys.argv[2])).start()
print("PORT", stage.port, flush=True)
threading.Event().wait()
"""
FRAGMENTS = ["ext_authz", "token_timing", "access_log"]
HUGE = 10**9  # a budget that is never spent: parts b and c measure its cost, not refusals
ABSURD = b'{"model": "stage", "max_tokens": 1000000000}'


class BenchError(Exception):
    pass


@dataclass
class Stack:
    name: str
    node: harness.Sitsmesh
    envoy: harness.Envoy
    keys: dict[str, str]  # tenant -> key

    def metric(self, name: str, **labels: str) -> float:
        return harness.metric_value(self.node.metrics(), name, **labels)


def spawn_stage(work: Path, itl_ms: float, tokens: int, stack: contextlib.ExitStack) -> int:
    proc = harness.spawn([sys.executable, "-c", STAGE_CODE, str(itl_ms / 1000), str(tokens)],
                         work / "stage.log")
    stack.callback(proc.kill)
    found: list[int] = []

    def port() -> bool:
        if proc.proc.poll() is not None:
            raise BenchError(f"stage exited: {proc.output()}")
        found[:] = [int(w) for w in proc.output().split() if w.isdigit()]
        return bool(found)

    harness.wait_until(port, 20, "the stage's port")
    return found[0]


def start_stack(work: Path, name: str, budgets: dict[str, int | None], itl_ms: float,
                tokens: int, stack: contextlib.ExitStack, *extra: str) -> Stack:
    """sitsmesh (with `extra`), its tenants (tenant -> budget a minute, None: none),
    a stage and an Envoy; returned once each budget governs Check."""
    work = work / f"stack-{name}"
    work.mkdir()
    node = harness.start_sitsmesh(work, "--reload-interval-seconds", "0.2", *extra)
    stack.callback(node.kill)
    keys = {tenant: bl.setup_tenant(node, work, tenant, None if tokens_ is None else
                                    bl.budget_yaml(tenant, tokens_))
            for tenant, tokens_ in budgets.items()}
    envoy = harness.start_envoy(work, node.data_addr, spawn_stage(work, itl_ms, tokens, stack),
                                fragments=FRAGMENTS)
    stack.callback(envoy.kill)
    for tenant, tokens_ in budgets.items():
        if tokens_ is not None:
            harness.wait_until(lambda t=tenant: asyncio.run(bl.stream_once(
                envoy.listen_port, keys[t], ABSURD, itl_ms)).status == 400, 15,
                f"{name}: the budget of {tenant} to govern Check")
    return Stack(name, node, envoy, keys)


def spread(values: Sequence[float], fmt: str = "{:.0f}") -> str:
    return (f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))} to "
            f"{fmt.format(max(values))})")


def pct(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


# --------------------------------------------------------------------------- part a

def part_a(work: Path, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    modes = ("reserve", "charge_after")
    stacks = {m: start_stack(work, m, {"acme": args.budget}, args.itl_ms, args.max_tokens,
                             stack, "--budget-charging", m) for m in modes}
    now = time.time()
    start = now if args.no_align else (now // 60 + 1) * 60 - 0.25
    if start - now < 0.5 and not args.no_align:
        start += 60
    end = start + args.seconds + 0.5
    print(f"a: load from {time.strftime('%H:%M:%S', time.gmtime(start))} for "
          f"{end - start:.1f} s", file=sys.stderr)

    async def both() -> list[list[bl.Outcome]]:
        return list(await asyncio.gather(*(bl.load(
            stacks[m].envoy.listen_port, stacks[m].keys["acme"], clients=args.clients,
            start=start, end=end, max_tokens=args.max_tokens, itl_ms=args.itl_ms)
            for m in modes)))

    results = dict(zip(modes, asyncio.run(both()), strict=True))
    for mode, outcomes in results.items():
        bad = [o for o in outcomes if o.error or o.status not in (200, 429)]
        if bad:
            raise BenchError(f"{mode}: {len(bad)} requests failed, e.g. {bad[:3]}")
        served = [o for o in outcomes if o.status == 200]
        s, n = stacks[mode], len(served)
        harness.wait_until(lambda s=s, n=n: s.metric(
            "sitsmesh_token_budget_settlements_total", outcome="settled") == n, 30,
            f"{mode}: every stream settled")
        server = sum(s.metric("sitsmesh_token_budget_tokens_total", tenant="acme",
                              model="stage", kind=k) for k in ("input", "output"))
        client = sum(bl.charged(o) for o in served)
        if server != client:
            raise BenchError(f"{mode}: sitsmesh charged {server:g}, the client counts "
                             f"{client}")
    full = bl.covered(start, end)
    windows = {m: bl.per_window(o) for m, o in results.items()}
    whole = bl.Outcome(0, 200, len(bl.chat_body(args.max_tokens)), args.max_tokens)
    per_stream, held = bl.charged(whole), bl.reserved(whole, args.max_tokens)
    print(f"\n### a. Overshoot per window\n\nbudget {args.budget} tokens/minute, "
          f"{args.clients} clients, {args.max_tokens} tokens a stream at {args.itl_ms:g} ms "
          f"(reserved {held} a stream, charged {per_stream}: the stage's usage prompt), "
          f"load {end - start:.1f} s from {time.strftime('%H:%M:%S', time.gmtime(start))} "
          "UTC; charged = client-side sum (equal to sitsmesh's totals)\n")
    print("| window (UTC) | fully covered | reserve: charged | ratio | streams | 429s | "
          "charge_after: charged | ratio | streams | 429s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in sorted(set(windows["reserve"]) | set(windows["charge_after"])):
        cells = []
        for m in modes:
            mine = [o for o in results[m] if int(o.started // 60) * 60 == w]
            got = windows[m].get(w, 0)
            cells.append(f"{got} | {got / args.budget:.3f} | "
                         f"{sum(o.status == 200 for o in mine)} | "
                         f"{sum(o.status == 429 for o in mine)}")
        print(f"| {time.strftime('%H:%M', time.gmtime(w))} | {'yes' if w in full else 'no'} "
              f"| {' | '.join(cells)} |")
    print("\n| mode | windows fully covered | max ratio | median ratio | streams | 429s |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in modes:
        ratios = [windows[m].get(w, 0) / args.budget for w in full]
        print(f"| {m} | {len(full)} | {max(ratios, default=0):.3f} | "
              f"{statistics.median(ratios) if ratios else 0:.3f} | "
              f"{sum(o.status == 200 for o in results[m])} | "
              f"{sum(o.status == 429 for o in results[m])} |")
    worst = max((windows["reserve"].get(w, 0) / args.budget for w in full), default=0)
    verdict = ("no window was fully covered" if not full else
               f"{'met' if worst <= 1.05 else 'MISSED'} ({worst:.3f})")
    print(f"\nTarget reserve <= 1.05 in every covered window: {verdict}; for scale, "
          f"{args.clients} streams in flight x {per_stream} = "
          f"{args.clients * per_stream} tokens ({args.clients * per_stream / args.budget:.2f} "
          "of the budget)")


# --------------------------------------------------------------------------- part b

def check_request(key: str, body: bytes) -> Any:
    from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2

    ctx = attribute_context_pb2.AttributeContext
    http = ctx.HttpRequest(method="POST", path="/v1/chat/completions", raw_body=body,
                           headers={"x-api-key": key, "x-request-id": uuid.uuid4().hex,
                                    "content-type": "application/json"})
    return external_auth_pb2.CheckRequest(attributes=ctx(request=ctx.Request(http=http)))


def timed_checks(stub: Any, key: str, calls: int, budgeted: bool) -> list[float]:
    body = bl.chat_body(200)
    requests = [check_request(key, body) for _ in range(calls)]
    took = []
    for request in requests:
        began = time.perf_counter()
        reply = stub.Check(request, timeout=5)
        took.append(time.perf_counter() - began)
        if reply.status.code != 0:
            raise BenchError(f"Check refused: {reply}")
    names = {h.header.key for h in reply.ok_response.headers}
    if ("x-sits-token-estimate" in names) != budgeted:
        raise BenchError(f"budgeted {budgeted}, but the reply's headers are {names}")
    return took


def part_b(stacks: dict[str, Stack], args: argparse.Namespace) -> None:
    from envoy.service.auth.v3 import external_auth_pb2_grpc

    channels = {n: grpc.insecure_channel(s.node.data_addr) for n, s in stacks.items()}
    try:
        stubs = {n: external_auth_pb2_grpc.AuthorizationStub(c) for n, c in channels.items()}
        configs = [(ledger, tenant) for ledger in stacks for tenant in ("plain", "acme")]
        p50: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
        p99: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
        for ledger, tenant in configs:  # warm-up
            timed_checks(stubs[ledger], stacks[ledger].keys[tenant], 300, tenant == "acme")
        for r in range(args.rounds):
            for c in configs if r % 2 == 0 else configs[::-1]:
                took = timed_checks(stubs[c[0]], stacks[c[0]].keys[c[1]], args.calls,
                                    c[1] == "acme")
                p50[c].append(pct(took, 50) * 1e6)
                p99[c].append(pct(took, 99) * 1e6)
            print(f"b: round {r}: " + ", ".join(f"{ledger}/{tenant} {p50[(ledger, tenant)][-1]:.0f}"
                  for ledger, tenant in configs) + " us p50", file=sys.stderr)
    finally:
        for channel in channels.values():
            channel.close()
    print(f"\n### b. Check latency (gRPC client, {args.calls} sequential calls per "
          f"configuration per round, {args.rounds} interleaved rounds; µs, median (range) "
          "over rounds)\n")
    print("| ledger | tenant | p50 | p99 |")
    print("|---|---|---:|---:|")
    for ledger, tenant in configs:
        label = "with a budget" if tenant == "acme" else "no budget"
        print(f"| {ledger} | {label} | {spread(p50[(ledger, tenant)])} | "
              f"{spread(p99[(ledger, tenant)])} |")
    print("\nAdded by the reservation (with - without, per round; µs, median (range)):\n")
    print("| ledger | p50 | p99 |")
    print("|---|---:|---:|")
    for ledger in stacks:
        d50 = [a - b for a, b in zip(p50[(ledger, "acme")], p50[(ledger, "plain")], strict=True)]
        d99 = [a - b for a, b in zip(p99[(ledger, "acme")], p99[(ledger, "plain")], strict=True)]
        print(f"| {ledger} | {spread(d50)} | {spread(d99)} |")


# --------------------------------------------------------------------------- part c

def commandstats(client: Any) -> dict[str, int]:
    """Calls per command so far; one connection for the whole part, so its own
    handshake is not counted in a round."""
    info = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in info.items()
            if name != "cmdstat_info"}


# Commands sitsmesh's Lua scripts run inside Redis: counted by INFO commandstats, but
# not round trips. On one Redis server sitsmesh sends only EVALSHA (EVAL once per script
# after a restart) for budgets: reserve and settle each write or claim the record inside
# their script (SET, GET, DEL), so those are inside too (on Redis Cluster they are not).
IN_SCRIPTS = ("get", "incrby", "pexpire", "exists", "set", "del")
# (label, tenant, max_tokens): the stage produces 20 tokens, so at max_tokens 40 the
# estimate is over and settling adjusts the counters; at 20 it is exact.
C_VARIANTS = (("no budget", "plain", 20), ("budget, estimate exact", "acme", 20),
              ("budget, estimate over", "acme", 40))


def c_round(s: Stack, client: Any, tenant: str, max_tokens: int,
            n: int) -> dict[str, int]:
    body = bl.chat_body(max_tokens)
    streams = s.metric("sitsmesh_token_streams_total")
    settled = s.metric("sitsmesh_token_budget_settlements_total", outcome="settled")
    before = commandstats(client)

    async def some() -> list[bl.Outcome]:
        sem = asyncio.Semaphore(5)

        async def one() -> bl.Outcome:
            async with sem:
                return await bl.stream_once(s.envoy.listen_port, s.keys[tenant], body, 1.0)

        return list(await asyncio.gather(*(one() for _ in range(n))))

    bad = [o for o in asyncio.run(some()) if o.status != 200 or o.error or o.tokens != 20]
    if bad:
        raise BenchError(f"c: {len(bad)} streams failed, e.g. {bad[:3]}")
    harness.wait_until(lambda: s.metric("sitsmesh_token_streams_total") >= streams + n, 15,
                       "c: every stream logged")
    if tenant == "acme":
        harness.wait_until(lambda: s.metric("sitsmesh_token_budget_settlements_total",
                                            outcome="settled") == settled + n, 15,
                           "c: every stream settled")
    after = commandstats(client)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def part_c(s: Stack, redis_port: int, args: argparse.Namespace) -> None:
    import redis

    per: dict[str, list[dict[str, int]]] = {label: [] for label, _, _ in C_VARIANTS}
    with redis.Redis(port=redis_port) as client:
        for r in range(args.rounds_c):
            for label, tenant, max_tokens in C_VARIANTS if r % 2 == 0 else C_VARIANTS[::-1]:
                per[label].append(c_round(s, client, tenant, max_tokens, args.streams))
    print(f"\n### c. Redis commands per request ({args.streams} streams per round and "
          f"variant, {args.rounds_c} rounds; INFO left out; the stage produces 20 tokens)\n")
    print("| variant | round trips per stream | run inside scripts | by command, per stream "
          "(medians) |")
    print("|---|---:|---:|---|")
    n = args.streams
    for label, rounds in per.items():
        trips = [sum(v for k, v in d.items() if k not in IN_SCRIPTS) / n for d in rounds]
        inner = [sum(v for k, v in d.items() if k in IN_SCRIPTS) / n for d in rounds]
        names = sorted({k for d in rounds for k in d})
        split = ", ".join(f"{k} {statistics.median(d.get(k, 0) for d in rounds) / n:.2f}"
                          for k in names) or "none"
        print(f"| {label} | {spread(trips, '{:.2f}')} | {spread(inner, '{:.2f}')} | "
              f"{split} |")


# --------------------------------------------------------------------------- main

def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=int, default=10_000, help="a: tokens per minute")
    p.add_argument("--clients", type=int, default=20, help="a: concurrent clients per mode")
    p.add_argument("--seconds", type=float, default=120.0, help="a: load duration")
    p.add_argument("--max-tokens", type=int, default=200, help="a: tokens per stream")
    p.add_argument("--itl-ms", type=float, default=10.0, help="a: stage time per token")
    p.add_argument("--no-align", action="store_true",
                   help="a: start at once, not just before a minute boundary")
    p.add_argument("--calls", type=int, default=2000, help="b: Checks per round and config")
    p.add_argument("--rounds", type=int, default=5, help="b: rounds")
    p.add_argument("--streams", type=int, default=50, help="c: streams per round")
    p.add_argument("--rounds-c", type=int, default=3, help="c: rounds")
    p.add_argument("--parts", default="abc", help="which parts to run (default abc)")
    args = p.parse_args(argv)
    print(f"start {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, 1-min load "
          f"{os.getloadavg()[0]:.2f}", file=sys.stderr)
    print(f"1-min load at the start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="sitsmesh-budgets-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        try:
            if "b" in args.parts or "c" in args.parts:
                from sitsmesh.dev.redis import redis_server

                redis = stack.enter_context(redis_server(work / "redis"))
                tenants: dict[str, int | None] = {"acme": HUGE, "plain": None}
                stacks = {
                    "redis": start_stack(work, "redis", tenants, 1.0, 20, stack,
                                         "--ratelimit-store", "redis", "--redis-url",
                                         redis.url),
                    "memory": start_stack(work, "memory", tenants, 1.0, 20, stack)}
                # c first: b's reservations are never settled, and their expiry must
                # not count among c's commands.
                if "c" in args.parts:
                    part_c(stacks["redis"], redis.port, args)
                if "b" in args.parts:
                    part_b(stacks, args)
            if "a" in args.parts:
                part_a(work, args, stack)
        except (BenchError, TimeoutError, RuntimeError, OSError, grpc.RpcError) as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
    print(f"\n1-min load at the end: {os.getloadavg()[0]:.2f}; "
          f"end {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
