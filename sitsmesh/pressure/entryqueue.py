"""Requests held at a pipeline's entry until it has room for them under its in-flight cap.

At the cap, refusing a low-priority request sends it away although the stage may free
a slot a few milliseconds later; admitting it anyway queues it at the stage ahead of
high-priority work that comes after it. Held in Check instead, it goes in when an end
is learned: the stage stays busy while high priority still meets no more low-priority
work ahead of it than the cap allows (bench/pressure_frontier.py measures both rules
against an oracle). Highest priority first, then oldest first; each waits at most its
decision's `wait_s`, then it is refused as it would have been at once.

One event loop owns a queue: plain lists and a heap, no locks. The gate decides room
and counts; this module only orders the waiters and times them out.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Iterable

from sitsmesh.pressure.estimate import quantile_of

LET_IN, WAITED_OUT, GONE = "let_in", "waited_out", "gone"
# Requests wait only while the ends of requests reach the gate this soon (p95 of the
# access-log delay): a waiter is let in on the ends the gate knows of, and on ends a log
# flush behind, the in-flight estimate lets a queue in (measured: at Envoy's 1 s flush,
# high priority on time fell from 96-99 % to 80-85 %).
WAIT_LAG_S = 0.05
# Waiters per process, over all pipelines: past this a request is refused at once. Each
# is a Check call Envoy keeps open, and Envoy's ext_authz timeout ends it anyway.
MAX_WAITING = 4096


def wait_for(wait_ms: int, lags: Iterable[float]) -> float:
    """The wait a decision gives requests at the cap: `wait_ms` (the entry_wait_ms
    threshold) while ends come in soon after they happen (`lags`, seconds), else none."""
    if wait_ms <= 0 or quantile_of(lags, 0.95) > WAIT_LAG_S:
        return 0.0
    return wait_ms / 1000


class Waiter:
    """One held request. `future` resolves to True once it is let in (its hold is then
    counted), or False once it waited its time (refused)."""

    __slots__ = ("abandoned", "future", "granted", "grpc", "on_grant", "on_leave",
                 "pipeline", "priority", "queue", "refusal", "request_id", "tenant", "timer")

    def __init__(self, queue: EntryQueue, pipeline: str, priority: int,
                 future: asyncio.Future[bool], *, on_grant: Callable[[], None],
                 on_leave: Callable[[], object]) -> None:
        self.queue = queue
        self.pipeline = pipeline
        self.priority = priority
        self.future = future
        self.on_grant = on_grant    # count it in flight (the admission's hold)
        self.on_leave = on_leave    # undo that: let in, but its Check went away
        self.granted = False
        self.abandoned = False
        self.grpc = False           # the caller speaks gRPC (for its refusal)
        self.request_id = self.tenant = ""
        self.refusal: object = None  # what the gate answers once it waited its time
        self.timer: asyncio.TimerHandle | None = None

    def abandon(self) -> None:
        """Its Check went away (Envoy's timeout, the client): a let-in request that was
        never forwarded must not hold a slot until its hold times out."""
        if self.abandoned:
            return
        self.abandoned = True
        if self.timer is not None:
            self.timer.cancel()
        if self.granted:
            self.on_leave()
        else:
            self.queue.remove(self)
        self.queue.count(self, GONE)


class EntryQueue:
    """The waiters of every pipeline of one process."""

    __slots__ = ("_heaps", "_order", "_room", "_timed_out", "limit", "outcomes", "waiting")

    def __init__(self, room: Callable[[str], bool], timed_out: Callable[[Waiter], None],
                 limit: int = MAX_WAITING) -> None:
        self._room = room            # whether the pipeline can take one more now
        self._timed_out = timed_out  # count the refusal of a waiter that waited its time
        self._heaps: dict[str, list[tuple[int, int, Waiter]]] = {}
        self._order = itertools.count()
        self.limit = limit
        self.waiting = 0
        # (pipeline, LET_IN / WAITED_OUT / GONE) -> waiters, since the runtime last took them.
        self.outcomes: dict[tuple[str, str], int] = {}

    def hold(self, pipeline: str, priority: int, wait_s: float, most: int, *,
             on_grant: Callable[[], None], on_leave: Callable[[], object]) -> Waiter | None:
        """Hold a request for at most `wait_s`; None when `most` already wait on this
        pipeline (or the process is at its limit): it is refused at once."""
        heap = self._heaps.get(pipeline)
        if heap is None:
            heap = self._heaps[pipeline] = []
        if len(heap) >= most or self.waiting >= self.limit:
            return None
        loop = asyncio.get_running_loop()
        waiter = Waiter(self, pipeline, priority, loop.create_future(),
                        on_grant=on_grant, on_leave=on_leave)
        waiter.timer = loop.call_later(wait_s, self._expire, waiter)
        heapq.heappush(heap, (-priority, next(self._order), waiter))
        self.waiting += 1
        return waiter

    def queued(self, pipeline: str) -> int:
        heap = self._heaps.get(pipeline)
        return len(heap) if heap else 0

    def wake(self, pipeline: str) -> int:
        """Let in the best waiters while the pipeline has room; how many went in."""
        heap = self._heaps.get(pipeline)
        let_in = 0
        while heap and self._room(pipeline):
            waiter = heapq.heappop(heap)[2]
            self.waiting -= 1
            if waiter.future.done() or waiter.abandoned:
                continue  # its Check went away as it was let in
            if waiter.timer is not None:
                waiter.timer.cancel()
            waiter.on_grant()
            waiter.granted = True
            waiter.future.set_result(True)
            let_in += 1
        if let_in:
            key = (pipeline, LET_IN)
            self.outcomes[key] = self.outcomes.get(key, 0) + let_in
        return let_in

    def count(self, waiter: Waiter, outcome: str) -> None:
        key = (waiter.pipeline, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def wake_all(self) -> None:
        for pipeline, heap in self._heaps.items():
            if heap:
                self.wake(pipeline)

    def remove(self, waiter: Waiter) -> None:
        """Take a waiter out before its turn. Rare next to let-ins (a timeout means the
        stage stayed full), so a linear removal keeps the heap exact without tombstones."""
        heap = self._heaps.get(waiter.pipeline)
        if not heap:
            return
        for index, item in enumerate(heap):
            if item[2] is waiter:
                heap[index] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                self.waiting -= 1
                return

    def _expire(self, waiter: Waiter) -> None:
        if waiter.future.done() or waiter.granted or waiter.abandoned:
            return
        self.remove(waiter)
        self.count(waiter, WAITED_OUT)
        self._timed_out(waiter)
        waiter.future.set_result(False)
