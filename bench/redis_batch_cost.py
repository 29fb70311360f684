"""CPU of one RedisStore batch: a single redis-server vs a Redis Cluster (issue 31).

The store sends the hits of one event-loop turn as one batch: to a single server as
pre-packed EVALSHAs on one connection, to a cluster through redis-py's non-transactional
cluster pipeline, which builds, routes and packs every command in Python. This script
times that difference alone, with no gRPC around it: `batch` concurrent `hit()` calls
(one fixed-window hit each, on 1 counter or on 6 counters dealt over the 3 masters) per
batch, the median process CPU of a batch over `--batches` batches, against a
redis-server and a 3-master cluster with replicas (sitsmesh.dev.rediscluster) that it
starts itself. Sizes alternate between the two stores, the same order each size.

    .venv/bin/python bench/redis_batch_cost.py [--sizes 1,8,20,80] [--batches 400]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import benchlib as bl

from sitsmesh.dev import harness
from sitsmesh.dev.redis import ping, redis_server_binary
from sitsmesh.dev.rediscluster import redis_cluster
from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.redis_store import RedisStore
from sitsmesh.ratelimit.store import Hit

# Counter keys as ratelimit_throughput.py's bench rule makes them: "bench" alone, or
# --users 6's values (2 per master of a fresh 3-master cluster).
ONE = ["bench_user_bench"]
SIX = [f"bench_user_u{n}" for n in (0, 3, 6, 9, 10, 11)]
WARMUP_BATCHES = 20


async def batch_cpu_us(url: str, keys: list[str], size: int, batches: int) -> float:
    """Median CPU µs of one batch of `size` hits through RedisStore on `url`."""
    store = RedisStore.from_url(url, timeout_s=1.0)
    hits = [[Hit(keys[n % len(keys)], Algorithm.FIXED_WINDOW, 10**9, 1, 1)]
            for n in range(size)]
    now = time.time()
    try:
        for _ in range(WARMUP_BATCHES):  # connections, script caches
            await asyncio.gather(*(store.hit(h, now) for h in hits))
        cpu: list[float] = []
        for _ in range(batches):
            start = time.process_time()
            counts = await asyncio.gather(*(store.hit(h, now) for h in hits))
            cpu.append(time.process_time() - start)
            if any(c[0].over for c in counts):
                raise bl.BenchError("a hit was over its limit: the store did not count")
    finally:
        await store.close()
    return statistics.median(cpu) * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default="1,8,20,80", help="batch sizes (default 1,8,20,80)")
    p.add_argument("--batches", type=int, default=400, help="batches per size (default 400)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="sitsmesh-batch-") as tmp:
        port = harness.free_port()
        server = harness.spawn([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no", "--dir", tmp],
                               Path(tmp) / "redis.log")
        try:
            bl.wait_until(lambda: server.proc.poll() is None and ping(port), 10,
                          "redis-server")
            with redis_cluster(Path(tmp) / "cluster") as nodes:
                for size in sizes:
                    for name, keys in (("1 counter", ONE), ("6 counters", SIX)):
                        single = asyncio.run(batch_cpu_us(f"redis://127.0.0.1:{port}/0",
                                                          keys, size, args.batches))
                        cluster = asyncio.run(batch_cpu_us(nodes.url, keys, size,
                                                           args.batches))
                        rows.append(f"| {size} | {name} | {single:,.0f} | {cluster:,.0f} "
                                    f"| {cluster / single:.2f} "
                                    f"| {(cluster - single) / size:.1f} |")
                        print(rows[-1], file=sys.stderr, flush=True)
        finally:
            server.kill()
    print("| batch | counters | single CPU µs/batch | cluster CPU µs/batch | cluster/single "
          "| extra µs per hit |\n|---:|---|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
