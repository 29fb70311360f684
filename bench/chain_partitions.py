"""Issue 31: CPU per access-log entry on each replica, 1 and 2 replicas, two builds.

Four fleets run side by side, each `sitsmesh serve --shared-runtime redis` on a
redis-server of its own: {before, after} x {1, 2 replicas}. "before" and "after" are
two source trees (--before, --after: PYTHONPATH of the replicas), e.g. main and the
partition branch. Each round sends the same traffic to every fleet, fleets in
rotated order: `--streams` client-streaming calls of `--messages` messages of
`--entries-per-message` entries (the accesslog bench's whole 3-hop chains, request
ids never repeated), split evenly over the fleet's replicas. A round ends when the
fleet's chains are all counted (`sitsmesh_pipeline_latency_seconds_count` summed
over replicas grows by the chains sent, times the replicas for a build where every
replica assembles every chain); the replicas' CPU (user+system, their process
groups) over the round divided by the entries sent is the figure: per replica, and
the fleet's total. Medians over rounds; redis-server's CPU is not counted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import accesslog_throughput as at
import benchlib as bl


class OffsetClients(at.Clients):
    """at.Clients whose client indexes start at `offset`: two groups, distinct request ids."""

    def __init__(self, offset: int, streams: int, per_message: int, timeout: float) -> None:
        self.per_message = per_message
        self.timeout = timeout
        self.clients = []
        self._seq = 0
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=at.client_main, name=f"bench-client-{offset}",
                              args=(child, offset, streams, per_message, timeout), daemon=True)
        self.clients.append(at.Client(offset, streams, process, parent))


@dataclass
class Fleet:
    build: str
    everyone_assembles: bool  # the build before partitions: each replica assembles all
    nodes: list[tuple[bl.Proc, str, str]]  # proc, data addr, metrics addr
    per_replica_us: list[list[float]] = field(default_factory=list)
    total_us: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.build}, {len(self.nodes)} replica{'s' if len(self.nodes) > 1 else ''}"

    def chains(self) -> float:
        key = bl.sample_key("sitsmesh_pipeline_latency_seconds_count", pipeline=at.PIPELINE)
        return sum(bl.metric_samples(metrics).get(key, 0.0) for _, _, metrics in self.nodes)


def start_fleet(workdir: Path, build: str, tree: str, replicas: int, redis_url: str,
                everyone: bool) -> Fleet:
    nodes = []
    state = workdir / f"state-{build}-{replicas}"
    for i in range(replicas):
        proc, data, metrics = bl.sitsmesh_proc(
            f"{build}-{replicas}r-{i}", workdir, "--shared-runtime", "redis", "--redis-url",
            redis_url, "--reload-interval-seconds", "0.5")
        # One state dir for the fleet (pipelines, admin token), as replicas share one.
        proc.argv[proc.argv.index("--state-dir") + 1] = str(state)
        proc.env = {**proc.env, "PYTHONPATH": tree}
        proc.start()
        if i == 0:
            bl.wait_until((state / "admin-token").exists, 30, "the admin token")
        nodes.append((proc, data, metrics))
    return Fleet(build, everyone, nodes)


def setup(fleet: Fleet, args: argparse.Namespace) -> None:
    proc, _, _ = fleet.nodes[0]
    admin_addr = proc.argv[proc.argv.index("--admin-addr") + 1]
    admin = at.Admin(admin_addr, Path(proc.argv[proc.argv.index("--state-dir") + 1]))

    def applied() -> bool:
        for p, _, _ in fleet.nodes:
            p.check_alive()
        with contextlib.suppress(Exception):
            admin.apply()
            return True
        return False

    bl.wait_until(applied, args.ready_timeout, f"{fleet.name}: the pipeline")
    admin.close()
    time.sleep(3)  # the catalog reload (0.5 s) and the partitions' split (1-2 beats)


def round_once(fleet: Fleet, groups: Sequence[at.Clients], messages: int) -> None:
    procs = [p for p, _, _ in fleet.nodes]
    for p in procs:
        p.check_alive()
    before = fleet.chains()
    cpu0 = [bl.procs_cpu([p]) for p in procs]
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        loads = list(pool.map(lambda pair: pair[0].run(pair[1], messages),
                              zip(groups, [data for _, data, _ in fleet.nodes], strict=True)))
    entries = sum(load.entries for load in loads)
    want = entries // 3 * (len(procs) if fleet.everyone_assembles else 1)
    bl.wait_until(lambda: fleet.chains() - before >= want, 120,
                  f"{fleet.name}: {want} chains counted")
    got = fleet.chains() - before
    if got != want:
        raise bl.BenchError(f"{fleet.name}: {got:g} chains counted, {want} expected")
    cpu = [sum(v - c0.get(k, 0.0) for k, v in bl.procs_cpu([p]).items())
           for p, c0 in zip(procs, cpu0, strict=True)]
    fleet.per_replica_us.append([c * 1e6 / entries for c in cpu])
    fleet.total_us.append(sum(cpu) * 1e6 / entries)
    fleet.rates.append(entries / max(load.wall_s for load in loads))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="source tree of the build before")
    p.add_argument("--after", required=True, help="source tree of the build after")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4, help="in all, split over the replicas")
    p.add_argument("--messages", type=int, default=150)
    p.add_argument("--entries-per-message", type=int, default=100)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=60.0)
    args = p.parse_args()
    from sitsmesh.dev.redis import redis_server

    fleets: list[Fleet] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="sitsmesh-partitions-bench-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        half = args.streams // 2
        one = OffsetClients(0, args.streams, args.entries_per_message, args.timeout)
        pair = [OffsetClients(10 + i, half, args.entries_per_message, args.timeout)
                for i in range(2)]
        groups = {1: [one], 2: pair}
        try:
            for build, tree, everyone in (("before", args.before, True),
                                          ("after", args.after, False)):
                for replicas in (1, 2):
                    url = stack.enter_context(
                        redis_server(work / f"redis-{build}-{replicas}")).url
                    fleets.append(start_fleet(work, build, tree, replicas, url, everyone))
            for g in (one, *pair):
                g.start()
            for fleet in fleets:
                setup(fleet, args)
                round_once(fleet, groups[len(fleet.nodes)], max(1, args.messages // 5))
                fleet.per_replica_us.clear()
                fleet.total_us.clear()
                fleet.rates.clear()
            for rnd in range(args.rounds):
                shift = rnd % len(fleets)
                for fleet in fleets[shift:] + fleets[:shift]:
                    try:
                        round_once(fleet, groups[len(fleet.nodes)], args.messages)
                    except bl.BenchError as exc:
                        fleet.errors.append(f"round {rnd + 1}: {exc}")
                        continue
                    print(f"round {rnd + 1} {fleet.name:<22} per replica "
                          f"{[round(u, 1) for u in fleet.per_replica_us[-1]]} µs/entry, "
                          f"{fleet.rates[-1]:,.0f} entries/s", file=sys.stderr, flush=True)
        finally:
            for g in (one, *pair):
                g.stop()
            for fleet in fleets:
                for proc, _, _ in fleet.nodes:
                    fleet.errors.extend(proc.stop())
    print(f"\n{args.streams} streams x {args.messages} messages x {args.entries_per_message} "
          f"entries per round, {args.rounds} rounds, fleets interleaved\n")
    print("| fleet | replica CPU per entry, median (µs): each replica | fleet CPU per entry "
          "(µs) | entries/s sent (median) | rounds ok |")
    print("|---|---|---:|---:|---:|")
    for fleet in fleets:
        ok = len(fleet.total_us)
        each = ", ".join(f"{statistics.median(r[i] for r in fleet.per_replica_us):.1f}"
                         for i in range(len(fleet.nodes))) if ok else "-"
        total = f"{statistics.median(fleet.total_us):.1f}" if ok else "-"
        rate = f"{statistics.median(fleet.rates):,.0f}" if ok else "-"
        print(f"| {fleet.name} | {each} | {total} | {rate} | {ok}/{args.rounds} |")
        for e in fleet.errors:
            failed = True
            print(f"  error: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
