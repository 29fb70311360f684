"""What every component shares: the data services it offers and its background tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from grpc import aio

from sitsmesh import logs

_log = logs.get("sitsmesh.app.background")

# Rule counters and expiry sweeps: once a second keeps scrapes and holds fresh enough
# without a timer on the request path.
HOUSEKEEPING_S = 1.0
# How long a cancelled task gets before it is cancelled again.
RECANCEL_S = 0.1


@dataclass(frozen=True, slots=True)
class DataService:
    """An Envoy-facing service on the data-plane server, with its own health status."""

    name: str
    add_to_server: Callable[[aio.Server], None]
    # False: no health status of its own (a service that only refuses, see
    # transport.rlqs.ServedElsewhere), so health does not call it SERVING.
    health: bool = True


class Background:
    """A component's background tasks: started on the running loop, stopped together."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(work))

    def every(self, seconds: float, tick: Callable[[], object]) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(seconds)
                tick()

        self.spawn(loop())

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            # A library may turn the cancellation into an error the loop catches and
            # goes on (redis-py's pipeline did: a replica then never exited), so a
            # task still running is cancelled again until it ends.
            while not task.done():
                await asyncio.wait((task,), timeout=RECANCEL_S)
                if not task.done():
                    task.cancel()
            if not task.cancelled() and task.exception() is not None:
                # It had failed on its own; stopping the rest matters more than raising.
                _log.warning("background task had failed", task=task.get_name(),
                             error=repr(task.exception()))
