"""The RLQS process (rlqs_addr): Envoy's quota streams served by a process of its own.

RLQS work grows with every bucket of every Envoy: 100 Envoys of 1 000 buckets take
0.1-0.2 cores, and on the data process's one event loop that time is Check's (its p99
went to 2.5-3.3x idle, bench/RESULTS.md). In a process of its own it runs beside Check
instead of between two Checks. The process follows the rate-limit config and the
pipelines in the state store as workers do. The controller's decisions live in the data
process; they come over a socket pair made at each start, an end inherited by the child
only, so no other process can reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

from sitsmesh import logs
from sitsmesh.app import budgets, compose, dataserver, stopbound
from sitsmesh.app.metrics import RpcMetrics
from sitsmesh.app.workers import WorkerPool
from sitsmesh.config import Settings
from sitsmesh.errors import StartupError
from sitsmesh.pressure.controller import Snapshot
from sitsmesh.pressure.gate import PressureGate
from sitsmesh.state.open import open_store
from sitsmesh.status import Serving, StatusBoard
from sitsmesh.transport.budget import tune_allocator

_log = logs.get("sitsmesh.rlqs")
_FRAME = struct.Struct("!I")
# A snapshot of many pipelines is a few KiB; past this the frame is not ours.
MAX_FRAME = 4 << 20
# A child that stops reading loses snapshots (the next one supersedes them); it never
# makes the data process hold more than this or wait.
MAX_UNSENT = 256 << 10


def frame(snapshot: Snapshot) -> bytes:
    body = pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
    return _FRAME.pack(len(body)) + body


async def read_frames(reader: asyncio.StreamReader) -> AsyncIterator[Snapshot]:
    """Snapshots until the data process's end closes. Pickle is safe here only because
    the peer is the parent, over a socket pair no one else holds."""
    while True:
        try:
            head = await reader.readexactly(_FRAME.size)
        except asyncio.IncompleteReadError:
            return
        (size,) = _FRAME.unpack(head)
        if size > MAX_FRAME:
            raise ValueError(f"decision frame of {size} bytes (at most {MAX_FRAME})")
        # The parent's own bytes, over a socket pair no one else holds (module docstring).
        snapshot = pickle.loads(await reader.readexactly(size))  # noqa: S301
        if not isinstance(snapshot, Snapshot):
            raise ValueError(f"decision frame holds a {type(snapshot).__name__}")
        yield snapshot


class QuotaProcess:
    """The data process's side: starts the RLQS process, restarts it when it dies (as
    workers are), and sends it every decision the controller makes live."""

    def __init__(self, settings: Settings,
                 pick: Callable[[Snapshot], Snapshot] = lambda made: made,
                 on_change: Callable[[bool], None] = lambda _alive: None) -> None:
        """pick(the decision made live): what RLQS is to apply of it; on_change(alive)
        whenever the process dies or is replaced."""
        self._pick = pick
        self._on_change = on_change
        self._writer: asyncio.StreamWriter | None = None
        self._pending: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.pool = WorkerPool(settings, self._changed, quota_main, count=1, name="rlqs",
                               extra=self._channel)

    def _changed(self, alive: bool) -> None:
        if not alive and self._writer is not None:
            self._writer.close()
            self._writer = None
        self._on_change(alive)

    def _channel(self, _index: int) -> tuple[Any, ...]:
        ours, theirs = socket.socketpair()
        if self._pending is not None:
            self._pending.close()
        self._pending = ours
        return (theirs,)

    def start(self, watch: AsyncIterator[Snapshot] | None) -> None:
        self.pool.start()
        if watch is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._feed(watch)))

    async def _connect(self) -> asyncio.StreamWriter | None:
        """The writer to the current child; a restart leaves a new pending end."""
        if self._pending is not None:
            if self._writer is not None:
                self._writer.close()
            sock, self._pending = self._pending, None
            _, self._writer = await asyncio.open_connection(sock=sock)
        return self._writer

    async def _feed(self, watch: AsyncIterator[Snapshot]) -> None:
        async for made in watch:
            writer = await self._connect()
            if writer is None or writer.transport.get_write_buffer_size() > MAX_UNSENT:
                continue
            writer.write(frame(self._pick(made)))

    async def ready(self, timeout_s: float) -> bool:
        """Whether it serves within timeout_s (False at once if it exits first)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while loop.time() < until:
            if self.pool.ready(0):
                return True
            if not self.pool.all_alive():
                return False
            await asyncio.sleep(0.05)
        return False

    def signal(self, signum: int) -> None:
        self.pool.signal(signum)

    def terminate(self) -> None:
        self.pool.terminate()

    async def wait(self, deadline_s: float) -> bool:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        clean = await self.pool.wait(deadline_s)
        if self._writer is not None:
            self._writer.close()
        if self._pending is not None:
            self._pending.close()
        return clean


def quota_main(settings: Settings, index: int, ready: Any, channel: socket.socket) -> None:
    """The RLQS process's entry (spawned by QuotaProcess's pool)."""
    del index
    logs.configure(settings.log_level, settings.log_format)
    tune_allocator()
    try:
        code = asyncio.run(run_quota(settings, channel, ready.set))
    except StartupError as exc:  # the data process says it did not start, and why
        _log.error("RLQS process cannot start", error=exc.message)
        code = 2
    raise SystemExit(code)


async def _follow(channel: socket.socket, gate: PressureGate, stop: asyncio.Event) -> None:
    reader, writer = await asyncio.open_connection(sock=channel)
    try:
        async for snapshot in read_frames(reader):
            gate.snapshot = snapshot
    except (ValueError, pickle.UnpicklingError, asyncio.IncompleteReadError) as exc:
        _log.error("decision channel broken", error=str(exc))
    finally:
        writer.close()
    # The data process is gone (or broken): serving on would split quotas on decisions
    # no one updates. Stop, as a worker whose supervisor died would be.
    if not stop.is_set():
        _log.warning("data process gone: stopping the RLQS process")
        stop.set()


async def run_quota(settings: Settings, channel: socket.socket,
                    on_ready: Callable[[], None] = lambda: None) -> int:
    assert settings.rlqs_addr is not None
    board = StatusBoard()
    state = await open_store(settings.state_url, settings.state_dir)
    graph = compose.build_quota(settings, state, board)
    stop = dataserver.stop_event(dataserver.reload_on_hup(graph.ratelimit))
    await graph.start()
    follow = asyncio.get_running_loop().create_task(_follow(channel, graph.gate, stop))
    budget = budgets.budget(settings)
    # Large messages are paced while the loop lags so that Check, sharing it, is not
    # kept waiting. This loop serves RLQS alone: pacing only held reports back (100
    # streams of 80 KB reports, on a shared core: write p90 281-413 ms paced, 2-15 ms
    # with large_message_lag_ms at its maximum).
    services = budgets.budgeted(settings, budget, graph.data_services(), loop_share=False)
    server, bound = await dataserver.start_data(
        settings, board, RpcMetrics(None), reuseport=False,
        services=dataserver.gated(settings, services, None),
        listen=("rlqs_addr", settings.rlqs_addr))
    board.set_all(Serving.SERVING)
    on_ready()
    _log.info("rlqs serving", rlqs_addr=bound)
    await stop.wait()
    stopbound.arm(settings)
    await dataserver.drain_and_stop(settings, board, [server], graph.streams)
    follow.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await follow
    await budget.lag.stop()
    await graph.stop()
    await state.close()
    await stopbound.end_leftovers()
    _log.info("rlqs stopped")
    return 0
