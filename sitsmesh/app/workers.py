"""Data-plane worker processes sharing one port through SO_REUSEPORT.

One Python process saturates one core at a few thousand RPCs/s, so the data
plane scales out by process. The supervisor restarts a worker that dies.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import multiprocess

from sitsmesh import logs
from sitsmesh.config import Settings
from sitsmesh.status import WorkerState

_log = logs.get("sitsmesh.workers")
RESTART_BACKOFF_S = 1.0

# A worker's entry: (settings, index, ready event, *extra). It must be a module-level
# function, since the spawn start method pickles it by name.
WorkerEntry = Callable[..., None]


class WorkerPool:
    def __init__(self, settings: Settings, on_change: Callable[[bool], None],
                 entry: WorkerEntry, *, count: int | None = None, name: str = "worker",
                 extra: Callable[[int], tuple[Any, ...]] = lambda _index: ()) -> None:
        """on_change(all_alive) is called whenever a worker dies or is replaced; extra(i)
        gives the further arguments of worker i's entry, at each (re)start."""
        self._settings = settings
        self._on_change = on_change
        self._entry = entry
        self._name = name
        self._extra = extra
        self._ctx = multiprocessing.get_context("spawn")
        self._count = settings.workers if count is None else count
        self._procs: list[BaseProcess | None] = [None] * self._count
        self._ready: list[Any] = [None] * self._count
        self._restarts = [0] * self._count
        self._stopping = False
        self._monitor: asyncio.Task[None] | None = None

    def _spawn(self, index: int) -> None:
        ready = self._ctx.Event()
        self._ready[index] = ready
        proc = self._ctx.Process(target=self._entry,
                                 args=(self._settings, index, ready, *self._extra(index)),
                                 name=f"sitsmesh-{self._name}-{index}", daemon=False)
        proc.start()
        self._procs[index] = proc
        _log.info(f"{self._name} started", worker=index, pid=proc.pid)

    def start(self) -> None:
        for index in range(self._count):
            self._spawn(index)
        self._monitor = asyncio.get_running_loop().create_task(self._watch())

    def snapshot(self) -> list[WorkerState]:
        return [
            WorkerState(i, p.pid or 0, p.is_alive(), self._restarts[i])
            for i, p in enumerate(self._procs) if p is not None
        ]

    def ready(self, index: int) -> bool:
        """Whether worker `index` has started serving (since its last start)."""
        ready = self._ready[index]
        return ready is not None and bool(ready.is_set())

    def all_alive(self) -> bool:
        return all(p is not None and p.is_alive() for p in self._procs)

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.25)
            for index, proc in enumerate(self._procs):
                if self._stopping or proc is None or proc.is_alive():
                    continue
                _log.error(f"{self._name} exited; restarting", worker=index, pid=proc.pid,
                           exitcode=proc.exitcode, backoff_s=RESTART_BACKOFF_S)
                if proc.pid:
                    multiprocess.mark_process_dead(proc.pid)  # type: ignore[no-untyped-call]
                self._on_change(False)
                await asyncio.sleep(RESTART_BACKOFF_S)
                if not self._stopping:
                    self._restarts[index] += 1
                    self._spawn(index)
                    self._on_change(self.all_alive())

    def signal(self, signum: int) -> None:
        for proc in self._procs:
            if proc is not None and proc.is_alive() and proc.pid:
                os.kill(proc.pid, signum)

    def terminate(self) -> None:
        """Ask every worker to drain and stop; each runs its own graceful shutdown."""
        self._stopping = True
        for proc in self._procs:
            if proc is not None and proc.is_alive() and proc.pid:
                proc.terminate()

    def _ended_before_serving(self, index: int, proc: BaseProcess) -> bool:
        """A worker stopped by our SIGTERM while still starting had no RPCs to lose."""
        return proc.exitcode == -signal.SIGTERM and not self._ready[index].is_set()

    async def wait(self, deadline_s: float) -> bool:
        """Wait for workers to exit; kill stragglers after deadline_s. True if all exited 0."""
        if self._monitor is not None:
            self._monitor.cancel()
        loop = asyncio.get_running_loop()
        clean = True
        for index, proc in enumerate(self._procs):
            if proc is None:
                continue
            await loop.run_in_executor(None, proc.join, deadline_s)
            if proc.is_alive():
                _log.error(f"{self._name} did not stop in time; killing", pid=proc.pid)
                proc.kill()
                await loop.run_in_executor(None, proc.join, 5)
                clean = False
            elif proc.exitcode != 0 and not self._ended_before_serving(index, proc):
                clean = False
        return clean
