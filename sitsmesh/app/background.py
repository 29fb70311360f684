"""What every component shares: the data services it offers and its background tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from grpc import aio

from sitsmesh import logs
from sitsmesh.tasks import cancel_until_done

_log = logs.get("sitsmesh.app.background")

# Rule counters and expiry sweeps: once a second keeps scrapes and holds fresh enough
# without a timer on the request path.
HOUSEKEEPING_S = 1.0


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
        task = asyncio.get_running_loop().create_task(work)
        task.add_done_callback(_report_failure)
        self._tasks.append(task)

    def every(self, seconds: float, tick: Callable[[], object]) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(seconds)
                tick()

        self.spawn(loop())

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        # A library may turn the cancellation into an error the loop catches and goes
        # on (redis-py's pipeline did: a replica then never exited): see sitsmesh.tasks.
        await cancel_until_done(tasks)


def _report_failure(task: asyncio.Task[None]) -> None:
    """Said when it happens, not at the stop: the work it did stopped then (a hop bus
    whose reader failed assembled nothing more), and nothing else tells."""
    if not task.cancelled() and task.exception() is not None:
        _log.error("background task failed", task=task.get_name(),
                   error=repr(task.exception()))
