"""What every component shares: the data services it offers and its background tasks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from grpc import aio

# Rule counters and expiry sweeps: once a second keeps scrapes and holds fresh enough
# without a timer on the request path.
HOUSEKEEPING_S = 1.0


@dataclass(frozen=True, slots=True)
class DataService:
    """An Envoy-facing service on the data-plane server, with its own health status."""

    name: str
    add_to_server: Callable[[aio.Server], None]


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
            with contextlib.suppress(asyncio.CancelledError):
                await task
