"""One budget for the request bytes a process holds in flight, across every RPC and
stream it serves (Check, ShouldRateLimit, access logs, stats, RLQS, the admin API).

Each message bound on its own (max_message_bytes and the like) bounded one message;
200 access-log streams of 3.7 MB each still took the RSS past 1 GB, because every
stream held its message, parsed (about 4x its bytes), at once. Here every request
message is charged from its length before it is parsed and given back when its
handler is done with it; a message that does not fit is refused unparsed, at once:

- a unary call gets RESOURCE_EXHAUSTED (Check: a 503 deny with Retry-After, see
  checklimits.busy);
- a stream is ended with RESOURCE_EXHAUSTED; what it sent before was processed.

Refusing, not waiting: a stream made to wait keeps its concurrency slot, and its
caller's retry waits with it. (What a waiting stream holds is small: with the 64 KiB
HTTP/2 windows of app/server.py, gRPC holds a stream's window, not its message, until
the handler reads; 48 unread streams of 3.7 MB took +3 MB, read once +105 MB, measured
on grpcio 1.85.)

Messages over `LARGE_BYTES` (more than Envoy ever forwards in a Check body) take the
event loop for milliseconds each to parse (a 1 MiB JSON body up to ~40 ms): while the
loop is behind (`large_message_lag_ms`), they are refused fast (unary calls) or their
stream waits before its next read, so a caller sending the largest messages allowed
cannot starve the small Checks queued behind them. An idle server parses them all.

The event loop's threads call it; a lock keeps the counts right should the admin
server run on a loop of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MIB = 1 << 20
FALLBACK_BYTES = 64 * MIB       # no memory limit found (cgroup "max", or no cgroup)
LIMIT_SHARE = 8                 # the budget is 1/8 of the memory limit
MIN_BYTES = 4 * MIB
LARGE_BYTES = 64 << 10          # Envoy's ext_authz fragment forwards at most 64 KiB of body
TICK_S = 0.02
LARGE_PART = 0.75
# Streams' first reads hold room before their message is in (see FIRST_HOLD_S) only in
# this part of the budget: speculative holds must not crowd out a message that has come.
# (Holding the whole large share, they did: an RLQS stream's first report, read once its
# hold had ended, found no room and its stream was ended.)
HOLD_PART = 0.5
# Large messages may take a tenth of the loop's time, 50 ms of it back to back: one
# 1 MiB JSON body parsed costs 30-300 ms (more on a busy machine), and each one delays
# every small Check queued behind it by as much.
LARGE_SHARE = 0.1
LARGE_BURST_S = 0.05
TRIM_TICKS = 25                 # at most one malloc_trim every 25 ticks (0.5 s)
# What a large message costs while its handler works on it, in multiples of its wire
# bytes (measured, grpcio 1.85, upb): a 1 MB ShouldRateLimit of 960 descriptors ~17x
# (each of its 15 000 values becomes a str, and the descriptors objects), a 3.7 MB
# access-log batch ~4x, a 1 MB JSON Check body of empty objects ~10x. Charging the wire
# bytes let 20 concurrent large ShouldRateLimits hold 350 MB against a 64 MiB budget.
EXPANSION = 8
READ_AHEAD = 2                  # messages gRPC buffers for a stream it has read from
# A stream's first read holds room for the largest message until that message is in,
# or this long: Envoy sends its first message as it opens a stream, and an open stream
# that sends nothing must not keep others out (twelve idle streams held the whole large
# share of a 64 MiB budget, and every stream opened after them was refused).
FIRST_HOLD_S = 0.25
# How long a new stream waits for that room before it is refused. While it waits it
# costs the server its 64 KiB HTTP/2 window, not its message (gRPC takes a message only
# once it is read).
FIRST_WAIT_S = 10.0
CGROUP_FILES = (Path("/sys/fs/cgroup/memory.max"),                       # cgroup v2
                Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))     # cgroup v1
_UNLIMITED_V1 = 1 << 60         # v1 reports "no limit" as a huge page-rounded number


def memory_limit(files: Sequence[Path] = CGROUP_FILES) -> int | None:
    """The container's memory limit in bytes, or None when there is none."""
    for path in files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return value if 0 < value < _UNLIMITED_V1 else None
    return None


M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 256 << 10
ARENA_MAX = 2


def tune_allocator() -> bool:
    """Make glibc return message buffers to the system once freed. By default glibc
    raises its mmap threshold after the first large free, so later megabyte buffers
    come from per-thread heaps that keep their pages: 200 callers sending 1 MiB Checks
    left the RSS at 611-758 MB; with a fixed 256 KiB threshold and two arenas, 206 MB
    (measured). False where the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_ARENA_MAX, ARENA_MAX))


def allocator_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0), or None where the C library is not glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return lambda: trim(0)


def cost(size: int) -> int:
    """What a message of `size` wire bytes is charged: EXPANSION times that if large."""
    return size * EXPANSION if size > LARGE_BYTES else size


def default_capacity(limit: int | None) -> int:
    """1/LIMIT_SHARE of the memory limit: the parsed form of a message takes up to ~5x
    its wire bytes, and the caches and the interpreter need the rest."""
    if limit is None:
        return FALLBACK_BYTES
    return max(MIN_BYTES, limit // LIMIT_SHARE)


class ByteBudget:
    """Bytes held in flight: `take` when a message arrives, `give` when it is done."""

    def __init__(self, capacity: int, large_lag_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self._large_cap = int(capacity * LARGE_PART)
        self._hold_cap = int(capacity * HOLD_PART)
        self.held = 0
        self.peak = 0
        self.refused = 0
        self._lock = threading.Lock()
        self.lag = LoopLag(large_lag_s, clock)
        self._room: asyncio.Event | None = None  # made by the first waiter, on the loop

    def take(self, size: int, large: bool = False) -> bool:
        """Charge `size` if it fits. Large messages fit only in the first LARGE_PART of
        the budget: the rest stays for the small ones Envoy sends, so a caller of large
        messages cannot starve it. (A stream's first read, which may be one, holds room
        in the first HOLD_PART: see `hold`.)"""
        if self._claim(size, self._large_cap if large else self.capacity):
            return True
        self.note_refused()
        return False

    def _claim(self, size: int, cap: int) -> bool:
        with self._lock:
            if self.held + size > cap:
                return False
            self.held += size
            self.peak = max(self.peak, self.held)
            return True

    async def hold(self, size: int, seconds: float) -> bool:
        """Room for a message not yet read, within the first HOLD_PART of the budget,
        waiting up to `seconds` for it (woken as room is given back); a refusal is
        counted only when the wait runs out. On the event loop only."""
        deadline = time.monotonic() + seconds
        while not self._claim(size, self._hold_cap):
            left = deadline - time.monotonic()
            if left <= 0:
                self.note_refused()
                return False
            if self._room is None:
                self._room = asyncio.Event()
            self._room.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._room.wait(), left)
        return True

    def give(self, size: int) -> None:
        if size:
            with self._lock:
                self.held -= size
            if self._room is not None:
                self._room.set()

    def note_refused(self) -> None:
        with self._lock:
            self.refused += 1


class LoopLag:
    """Whether the event loop is behind: a tick every TICK_S notes how late it ran, and
    a tick overdue by more than `limit_s` counts as late already (while a backlog of
    large messages is parsed, the tick itself waits behind it)."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._due = clock() + TICK_S
        self.late_s = 0.0
        self._credit = LARGE_BURST_S
        self._stamp = clock()
        self._caught_up = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._trim = allocator_trim()
        self._trim_due = False
        self._trimming: asyncio.Future[object] | None = None
        self._trimmer: ThreadPoolExecutor | None = None

    def behind(self) -> bool:
        """Whether large work must wait: the loop is late, or large messages have used
        their share of it (LARGE_SHARE of the loop's time, LARGE_BURST_S at once). The
        share holds on an idle loop too: lateness shows only after a parse has held the
        loop, and one 1 MiB body may hold it for 300 ms."""
        if self._task is None:  # started on the loop, by the first large message
            self.start()
        now = self._clock()
        self._credit = min(LARGE_BURST_S, self._credit + (now - self._stamp) * LARGE_SHARE)
        self._stamp = now
        return self._credit <= 0 or max(self.late_s, now - self._due) > self.limit_s

    def spent(self, seconds: float) -> None:
        """Large work took `seconds` of the loop."""
        self._credit -= seconds
        self._trim_due = True

    def note_large(self) -> None:
        """A large message came and went without being paced (the admin API's, the RLQS
        process's): its freed pages go back on the next trim all the same, as after the
        data plane's. Nothing else asks for a trim there."""
        if self._task is None:
            self.start()
        self._trim_due = True

    def tick(self) -> None:
        """Note one tick, due at `self._due` (the ticker calls this every TICK_S)."""
        now = self._clock()
        self.late_s = max(0.0, now - self._due)
        self._due = now + TICK_S
        if self.late_s <= self.limit_s:
            self._caught_up.set()
        else:
            self._caught_up.clear()

    async def caught_up(self) -> None:
        """Return once the loop is no longer behind."""
        while self.behind():
            self._caught_up.clear()
            await self._caught_up.wait()

    def start(self) -> None:
        async def ticker() -> None:
            ticks = 0
            while True:
                await asyncio.sleep(TICK_S)
                self.tick()
                ticks += 1
                if not ticks % TRIM_TICKS:
                    self._trim_now()

        self._due = self._clock() + TICK_S
        self._task = asyncio.get_running_loop().create_task(ticker())

    def _trim_now(self) -> None:
        """Give the allocator's free pages back, in a thread, once large messages have
        come and gone since the last time.
        Their gRPC slices and parsed forms are small blocks of the main heap, freed
        between long-lived ones: glibc returns only the heap's top, so under a stream
        of 3.7 MB access-log batches it kept 180 MB free but resident (244 MB of heap,
        63 MB in use, measured); malloc_trim(0) hands the free pages inside back too,
        in a few ms, with the loop free meanwhile."""
        if not self._trim_due:
            return
        self._trim_due = False
        # No gc.collect() here any more: it was for the cycles grpc aio's abort() left
        # per refused call (transport/errors.refuse avoids them), and a full collection
        # on the loop beside 100 000 RLQS buckets took 15 % of the loop in slices of
        # tens of ms, every 0.5 s: Check's p99 with 100 RLQS streams was 5 ms against
        # an idle 1 ms.
        if self._trim is None or (self._trimming is not None and not self._trimming.done()):
            return
        # A thread of its own: in the loop's default executor it queued behind the admin
        # API's YAML parsing, and the collection above with it (the soak's RSS then rose
        # to 580 MB between the interpreter's own full collections).
        if self._trimmer is None:
            self._trimmer = ThreadPoolExecutor(1, thread_name_prefix="malloc-trim")
        self._trimming = asyncio.get_running_loop().run_in_executor(self._trimmer, self._trim)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._trimmer is not None:
            self._trimmer.shutdown(wait=False)
            self._trimmer = None
