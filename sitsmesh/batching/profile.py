"""Measure a model's throughput and latency at each batch size on one ModelServer.

Each point sends requests of `batch_size` items from `concurrency` callers at
once, after a few unmeasured ones, and stops at `requests` requests or
`seconds`, whichever comes first; on production a pace holds the items/s
under `max_rate`. No grpc here: the server comes in through the swap contract.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from sitsmesh.batching.curve import Curve, InvalidCurve, Point
from sitsmesh.swap.contract import ModelServer, Tensor

WARM_REQUESTS = 2
REQUEST_TIMEOUT_S = 30.0
MAX_REQUESTS = 10_000
MAX_SECONDS = 120.0
MAX_CONCURRENCY = 256


@dataclass(frozen=True, slots=True)
class ProfilePlan:
    batch_sizes: tuple[int, ...]
    concurrency: int = 0          # 0: one caller per model instance
    requests: int = 40            # measured per batch size
    seconds: float = 10.0         # at most, per batch size
    max_rate: float = 0.0         # items/s; 0 = unpaced (sandbox only)

    def validate(self) -> None:
        if not 0 <= self.concurrency <= MAX_CONCURRENCY:
            raise InvalidCurve(f"concurrency must be 0-{MAX_CONCURRENCY}, got "
                               f"{self.concurrency}")
        if not 5 <= self.requests <= MAX_REQUESTS:
            raise InvalidCurve(f"requests must be 5-{MAX_REQUESTS}, got {self.requests}")
        if not 0.5 <= self.seconds <= MAX_SECONDS or math.isnan(self.seconds):
            raise InvalidCurve(f"seconds must be 0.5-{MAX_SECONDS:g}, got {self.seconds}")
        if self.max_rate < 0 or math.isnan(self.max_rate):
            raise InvalidCurve(f"max_rate must be >= 0, got {self.max_rate}")


def batched(probe: Sequence[Tensor], size: int) -> list[Tensor]:
    """The one-item probe as a request of `size` items (its first dimension)."""
    return [Tensor(t.name, t.datatype, (size, *t.shape[1:]), t.values * size) for t in probe]


async def measure(server: ModelServer, model: str, probe: Sequence[Tensor], plan: ProfilePlan,
                  *, instances: int, max_batch_size: int, endpoint: str, source: str,
                  clock: Callable[[], float] = time.perf_counter,
                  wall: Callable[[], float] = time.time,
                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                  progress: Callable[[Point], None] = lambda point: None) -> Curve:
    plan.validate()
    concurrency = plan.concurrency or instances
    points = []
    for size in plan.batch_sizes:
        request = batched(probe, size)
        for _ in range(WARM_REQUESTS):
            await server.infer(model, None, request, REQUEST_TIMEOUT_S)
        point = await _point(server, model, request, size, concurrency=concurrency, plan=plan,
                             clock=clock, sleep=sleep)
        progress(point)
        points.append(point)
    return Curve(model, endpoint, source, instances, max_batch_size, concurrency, wall(),
                 tuple(points))


async def _point(server: ModelServer, model: str, request: list[Tensor], size: int, *,
                 concurrency: int, plan: ProfilePlan, clock: Callable[[], float],
                 sleep: Callable[[float], Awaitable[None]]) -> Point:
    latencies: list[float] = []
    started = clock()
    deadline = started + plan.seconds
    # Each caller waits its turn so all together send at most max_rate items/s.
    gap = concurrency * size / plan.max_rate if plan.max_rate else 0.0

    async def caller() -> None:
        while len(latencies) < plan.requests and clock() < deadline:
            began = clock()
            answer = await server.infer(model, None, request, REQUEST_TIMEOUT_S)
            latencies.append(answer.seconds)
            if gap:
                await sleep(max(0.0, gap - (clock() - began)))

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = max(clock() - started, 1e-9)
    if len(latencies) < 2:
        raise InvalidCurve(f"batch size {size}: only {len(latencies)} request(s) finished "
                           f"in {plan.seconds:g} s; give more seconds")
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, math.ceil(len(latencies) * 0.99) - 1)]
    return Point(size, len(latencies) * size / elapsed, statistics.median(latencies) * 1000,
                 p99 * 1000, len(latencies))
