"""Issue 31: CPU per access-log entry on each replica, fleets of 1, 2, 4... replicas.

Fleets run side by side, each `sitsmesh serve --shared-runtime redis` on a redis-server
of its own: one per replica count of `--replicas` (default 1 2 4; 1 is always run, as
every ratio is to it) of the build `--after` (a source tree: PYTHONPATH of the
replicas), and as many again of `--before` if given, e.g. main and the partition branch.
Each round sends the same traffic to every fleet, fleets in rotated order: `--streams`
client-streaming calls of `--messages` messages of `--entries-per-message` entries (the
accesslog bench's 3-hop chains, whole ones: messages x entries a multiple of 3), split
evenly over the fleet's replicas: one client process per replica (or, with
`--one-client`, one process whose streams go round the replicas), request ids never
repeated across clients, at least one stream each. A round ends when the fleet's chains
are all counted (`sitsmesh_pipeline_latency_seconds_count` summed over replicas grows by
the chains sent, times the replicas for the build before, where every replica assembles
every chain); the replicas' CPU (user+system, their process groups) over the round
divided by the entries sent is the figure: per replica, and the fleet's total.
redis-server's CPU is not counted.

The first table gives medians over rounds per fleet. The second, per build, sets each
fleet of N replicas against the build's one replica, each ratio taken per round (same
round, so the same noise) then median [min-max] over rounds: the busiest replica's and
the replicas' mean CPU per entry over one replica's (target: at most 1.3/N); the fleet's
capacity from CPU, one replica's CPU per entry over the busiest replica's (how many times
one replica's entries/s the fleet takes when each replica has a core: target >= 1.7 at 2
replicas); and the entries/s the clients sent, N over 1 (wall clock, on these 2 cores).
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import accesslog_throughput as at
import benchlib as bl

CPU_TARGET = 1.3  # each of N replicas spends at most 1.3/N of one replica's CPU per entry
CAPACITY_TARGETS = {2: 1.7}  # fleet capacity from CPU, x one replica


class OffsetClients(at.Clients):
    """at.Clients of one process whose client index is `offset`: distinct request ids."""

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


@dataclass(frozen=True)
class Round:
    per_replica_us: list[float]  # CPU per entry the fleet received
    rate: float  # entries/s sent, client side

    @property
    def max_us(self) -> float:
        return max(self.per_replica_us)

    @property
    def mean_us(self) -> float:
        return statistics.fmean(self.per_replica_us)


@dataclass
class Fleet:
    build: str
    everyone_assembles: bool  # the build before partitions: each replica assembles all
    nodes: list[tuple[bl.Proc, str, str]]  # proc, data addr, metrics addr
    rounds: dict[int, Round] = field(default_factory=dict)  # by round number
    errors: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.build}, {len(self.nodes)} replica{'s' if len(self.nodes) > 1 else ''}"

    def chains(self) -> float:
        key = bl.sample_key("sitsmesh_pipeline_latency_seconds_count", pipeline=at.PIPELINE)
        return sum(bl.metric_samples(metrics).get(key, 0.0) for _, _, metrics in self.nodes)

    def split(self, partitions: int) -> bool:
        """Every replica sees them all and owns some; the partitions are all owned."""
        if self.everyone_assembles:
            return True
        members = bl.sample_key("sitsmesh_hop_partition_replicas")
        owned = bl.sample_key("sitsmesh_hop_partitions_owned")
        seen = [bl.metric_samples(metrics) for _, _, metrics in self.nodes]
        return (all(s.get(members) == len(self.nodes) and s.get(owned, 0) >= 1 for s in seen)
                and sum(s.get(owned, 0) for s in seen) == partitions)


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


def setup(fleet: Fleet, args: argparse.Namespace, partitions: int) -> None:
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
    bl.wait_until(lambda: fleet.split(partitions), args.ready_timeout,
                  f"{fleet.name}: the hop partitions split over the replicas")


def round_once(fleet: Fleet, groups: Sequence[at.Clients], messages: int) -> Round:
    procs = [p for p, _, _ in fleet.nodes]
    for p in procs:
        p.check_alive()
    before = fleet.chains()
    cpu0 = [bl.procs_cpu([p]) for p in procs]
    addrs = [data for _, data, _ in fleet.nodes]
    if len(groups) == 1:  # --one-client: its streams go round the replicas
        addrs = [",".join(addrs)]
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        loads = list(pool.map(lambda pair: pair[0].run(pair[1], messages),
                              zip(groups, addrs, strict=True)))
    entries = sum(load.entries for load in loads)
    want = entries // 3 * (len(procs) if fleet.everyone_assembles else 1)
    # Every poll scrapes each replica's /metrics, inside the CPU measured: at 0.1 s that
    # was about 1 µs per entry on each replica, the same for any N, which weighs most
    # on the largest fleet's small per-replica figure.
    bl.wait_until(lambda: fleet.chains() - before >= want, 120,
                  f"{fleet.name}: {want} chains counted", interval=0.5)
    got = fleet.chains() - before
    if got != want:
        raise bl.BenchError(f"{fleet.name}: {got:g} chains counted, {want} expected")
    cpu = [sum(v - c0.get(k, 0.0) for k, v in bl.procs_cpu([p]).items())
           for p, c0 in zip(procs, cpu0, strict=True)]
    return Round([c * 1e6 / entries for c in cpu],
                 entries / max(load.wall_s for load in loads))


def client_groups(replicas: Sequence[int],
                  args: argparse.Namespace) -> dict[int, list[OffsetClients]]:
    """Per fleet size N, N one-process clients sharing `--streams` (at least one each);
    with --one-client, one process with max(N, --streams) streams."""
    groups: dict[int, list[OffsetClients]] = {}
    offset = 0
    for n in replicas:
        groups[n] = []
        if args.one_client:
            groups[n].append(OffsetClients(offset, max(n, args.streams),
                                           args.entries_per_message, args.timeout))
            offset += 1
            continue
        for i in range(n):
            share = max(1, args.streams // n + (1 if i < args.streams % n else 0))
            groups[n].append(OffsetClients(offset, share, args.entries_per_message,
                                           args.timeout))
            offset += 1
    return groups


def paired(fleet: Fleet, one: Fleet, ratio: Callable[[Round, Round], float]) -> list[float]:
    """ratio(N replicas' round, one replica's same round), over the rounds both have."""
    return [ratio(r, one.rounds[k]) for k, r in fleet.rounds.items() if k in one.rounds]


def spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def verdict(values: Sequence[float], bound: float, *, at_most: bool) -> str:
    """Whether the median of values meets the bound."""
    if not values:
        return "-"
    m = statistics.median(values)
    return "yes" if (m <= bound if at_most else m >= bound) else "no"


def print_tables(fleets: Sequence[Fleet], args: argparse.Namespace) -> bool:
    failed = False
    print(f"\n{args.streams} streams x {args.messages} messages x {args.entries_per_message} "
          f"entries per round, {args.rounds} rounds, fleets interleaved\n")
    print("| fleet | replica CPU per entry, median (µs): each replica | fleet CPU per entry "
          "(µs) | entries/s sent (median) | rounds ok |")
    print("|---|---|---:|---:|---:|")
    for fleet in fleets:
        rounds = list(fleet.rounds.values())
        ok = len(rounds)
        each = ", ".join(f"{statistics.median(r.per_replica_us[i] for r in rounds):.1f}"
                         for i in range(len(fleet.nodes))) if ok else "-"
        total = f"{statistics.median(sum(r.per_replica_us) for r in rounds):.1f}" if ok else "-"
        rate = f"{statistics.median(r.rate for r in rounds):,.0f}" if ok else "-"
        print(f"| {fleet.name} | {each} | {total} | {rate} | {ok}/{args.rounds} |")
        for e in fleet.errors:
            failed = True
            print(f"  error: {e}")
    print_ratios(fleets)
    return failed


def print_ratios(fleets: Sequence[Fleet]) -> None:
    for build in dict.fromkeys(f.build for f in fleets):
        mine = {len(f.nodes): f for f in fleets if f.build == build}
        one = mine[1]
        print(f"\n{build}: N replicas against 1, ratios per round then median [min-max] "
              "over rounds\n")
        print("| replicas | replica CPU per entry, median (µs): busiest / mean | busiest / 1 "
              "replica | mean / 1 replica | busiest replica's median / 1 replica's | target "
              "(1.3/N) | met | fleet capacity from CPU (x 1 replica) | target | met | "
              "entries/s sent, N / 1 |")
        print("|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|")
        for n, fleet in mine.items():
            rounds = list(fleet.rounds.values())
            cpu = (f"{statistics.median(r.max_us for r in rounds):.1f} / "
                   f"{statistics.median(r.mean_us for r in rounds):.1f}") if rounds else "-"
            if n == 1:
                print(f"| 1 | {cpu} | base | base | base | - | - | base | - | - | base |")
                continue
            # Each replica's median over rounds, the highest of them, over one replica's
            # median: the busiest of N noisy figures taken per round sits above the
            # busiest replica's typical figure (the max of N samples), one replica's not.
            medians = [statistics.median(r.per_replica_us[i] for r in rounds)
                       for i in range(n)] if rounds else []
            one_rounds = list(one.rounds.values())
            typical = (f"{max(medians) / statistics.median(r.max_us for r in one_rounds):.3f}"
                       if medians and one_rounds else "-")
            busiest = paired(fleet, one, lambda r, o: r.max_us / o.max_us)
            mean = paired(fleet, one, lambda r, o: r.mean_us / o.mean_us)
            capacity = paired(fleet, one, lambda r, o: o.max_us / r.max_us)
            rate = paired(fleet, one, lambda r, o: r.rate / o.rate)
            target = CPU_TARGET / n
            goal = CAPACITY_TARGETS.get(n)
            print(f"| {n} | {cpu} | {spread(busiest)} | {spread(mean)} | {typical} | "
                  f"{target:.3f} | "
                  f"{verdict(busiest, target, at_most=True)} | {spread(capacity)} | "
                  + ("- | - |" if goal is None else
                     f">= {goal:g} | {verdict(capacity, goal, at_most=False)} |")
                  + f" {spread(rate)} |")


def replica_counts(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("a fleet has at least one replica")
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="source tree of the build before (optional)")
    p.add_argument("--before-partitioned", action="store_true",
                   help="the build before already splits chains over replicas (else each of "
                        "its replicas assembles every chain)")
    p.add_argument("--after", required=True, help="source tree of the build after")
    p.add_argument("--replicas", type=replica_counts, nargs="+", default=[1, 2, 4],
                   help="fleet sizes; 1 is always run, every ratio is to it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4, help="in all, split over the replicas")
    p.add_argument("--one-client", action="store_true",
                   help="one client process per fleet, its streams round the replicas (fewer "
                        "processes contending for the cores than one client per replica)")
    p.add_argument("--messages", type=int, default=150)
    p.add_argument("--entries-per-message", type=int, default=100)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=60.0)
    args = p.parse_args()
    if min(args.rounds, args.streams, args.messages, args.entries_per_message) < 1:
        p.error("counts must be >= 1")
    if args.messages * args.entries_per_message % 3:
        p.error("--messages x --entries-per-message must be a multiple of 3 (whole chains)")
    # A fifth of a round, in whole chains too: within 3 tries, as any multiple of 3 is.
    warmup = next(w for w in range(max(1, args.messages // 5), args.messages + 3)
                  if w * args.entries_per_message % 3 == 0)
    from sitsmesh.dev.redis import redis_server
    from sitsmesh.shared.partitions import PARTITIONS

    replicas = sorted({1, *args.replicas})
    builds = [("after", args.after, False)]
    if args.before is not None:
        builds.insert(0, ("before", args.before, not args.before_partitioned))
    fleets: list[Fleet] = []
    with tempfile.TemporaryDirectory(prefix="sitsmesh-partitions-bench-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        groups = client_groups(replicas, args)
        clients = [g for gs in groups.values() for g in gs]
        try:
            for build, tree, everyone in builds:
                for n in replicas:
                    url = stack.enter_context(redis_server(work / f"redis-{build}-{n}")).url
                    fleets.append(start_fleet(work, build, tree, n, url, everyone))
            for g in clients:
                g.start()
            with concurrent.futures.ThreadPoolExecutor(len(fleets)) as pool:
                # list() re-raises the first fleet that failed to come up.
                list(pool.map(lambda f: setup(f, args, PARTITIONS), fleets))
            for fleet in fleets:  # warm-up, not counted
                round_once(fleet, groups[len(fleet.nodes)], warmup)
            for rnd in range(args.rounds):
                shift = rnd % len(fleets)
                for fleet in fleets[shift:] + fleets[:shift]:
                    try:
                        got = round_once(fleet, groups[len(fleet.nodes)], args.messages)
                    except bl.BenchError as exc:
                        fleet.errors.append(f"round {rnd + 1}: {exc}")
                        continue
                    fleet.rounds[rnd] = got
                    print(f"round {rnd + 1} {fleet.name:<22} per replica "
                          f"{[round(u, 1) for u in got.per_replica_us]} µs/entry, "
                          f"{got.rate:,.0f} entries/s", file=sys.stderr, flush=True)
        finally:
            for g in clients:
                g.stop()
            for fleet in fleets:
                for proc, _, _ in fleet.nodes:
                    fleet.errors.extend(proc.stop())
    return 1 if print_tables(fleets, args) else 0


if __name__ == "__main__":
    sys.exit(main())
