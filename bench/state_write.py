"""Admin write latency: the SQLite state store vs the PostgreSQL one, in one run.

Both stores run in this process on the same disk (a temp dir): SQLite in WAL
mode with synchronous=FULL, as `sitsmesh serve` opens it; PostgreSQL a
throwaway cluster (sitsmesh.dev.postgres) with fsync on and the default
synchronous_commit, over TCP on 127.0.0.1, so a commit is on disk before either
acknowledges it. Measured one call at a time, as the admin API issues them:

- `put`: one upsert of a tenant-sized body (one transaction, one revision);
- `apply`: a batch of `--batch` puts in one transaction (as revoking a tenant's
  keys does);
- `seen by another store`: from a `put` returning on store A to
  `wait_for_change` returning on a second store B on the same database
  (PostgreSQL: LISTEN/NOTIFY; SQLite: B polls every 0.2 s).

Rounds interleave the backends; the table gives p50/p99/mean over all rounds in
milliseconds. Every written record is read back at the end (exit 1 if one is
missing or a revision is out of order).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sitsmesh.dev.postgres import postgres_server
from sitsmesh.state import Put, SqliteStore, StateStore
from sitsmesh.state.postgres import PostgresStore

BODY = {"models": ["llama-*", "bert"], "priority": 3, "max_priority": 5,
        "max_concurrency": 0, "labels": {"team": "search", "env": "prod"}}
Opener = Callable[[], Awaitable[StateStore]]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_round(store: StateStore, follower: StateStore, tag: str, writes: int,
                    batch: int, out: dict[str, list[float]]) -> int:
    made = 0
    for i in range(writes):
        start = time.perf_counter()
        await store.put("bench", f"{tag}-p{i}", BODY)
        out["put"].append(time.perf_counter() - start)
        made += 1
    for i in range(writes // batch):
        start = time.perf_counter()
        await store.apply([Put("bench", f"{tag}-a{i}-{j}", BODY) for j in range(batch)])
        out["apply"].append(time.perf_counter() - start)
        made += batch
    for i in range(max(writes // 10, 5)):
        seen = await follower.revision()
        waiting = asyncio.create_task(follower.wait_for_change(seen, 5))
        await asyncio.sleep(0.25 + (i % 5) * 0.037)  # spread over SQLite's poll phase
        await store.put("bench", f"{tag}-w{i}", BODY)
        written = time.perf_counter()
        await waiting
        out["seen by another store"].append(time.perf_counter() - written)
        made += 1
    return made


async def main(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="sitsmesh-bench-state-"))
    with postgres_server(fsync=True) as pg:
        url = pg.create_database("bench")
        openers: dict[str, Opener] = {
            "sqlite": lambda: _sqlite(tmp / "state.db"),
            "postgresql": lambda: PostgresStore.open(url),
        }
        stores = {name: (await op(), await op()) for name, op in openers.items()}
        results: dict[str, dict[str, list[float]]] = {
            name: {"put": [], "apply": [], "seen by another store": []} for name in openers}
        expected = dict.fromkeys(openers, 0)
        for r in range(args.rounds):
            order = list(openers)[r % 2:] + list(openers)[:r % 2]
            for name in order:
                store, follower = stores[name]
                expected[name] += await one_round(store, follower, f"r{r}", args.writes,
                                                  args.batch, results[name])
                print(f"round {r + 1}/{args.rounds} {name}: "
                      f"put p50 {statistics.median(results[name]['put']) * 1e3:.2f} ms",
                      file=sys.stderr)
        failed = False
        for name, (store, follower) in stores.items():
            records = await follower.list("bench")
            if len(records) != expected[name]:
                print(f"{name}: {len(records)} records, expected {expected[name]}",
                      file=sys.stderr)
                failed = True
            await store.close()
            await follower.close()
    print(f"writes per round: {args.writes} put, {args.writes // args.batch} apply of "
          f"{args.batch}; rounds: {args.rounds}\n")
    print("| backend | operation | n | p50 ms | p99 ms | mean ms |")
    print("|---|---|---|---|---|---|")
    for name, ops in results.items():
        for op, values in ops.items():
            print(f"| {name} | {op} | {len(values)} | {pct(values, 0.5) * 1e3:.2f} | "
                  f"{pct(values, 0.99) * 1e3:.2f} | {statistics.fmean(values) * 1e3:.2f} |")
    return 1 if failed else 0


async def _sqlite(path: Path) -> StateStore:
    return SqliteStore(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writes", type=int, default=200, help="puts per round and backend")
    parser.add_argument("--batch", type=int, default=5, help="puts per apply")
    raise SystemExit(asyncio.run(main(parser.parse_args())))
