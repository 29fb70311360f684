"""Following the state store from every process: refresh when its revision moves."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod

from sitsmesh import logs
from sitsmesh.state.contract import StateStore

_log = logs.get("sitsmesh.state.watch")


class RevisionFollower(ABC):
    """Base for views built from the state store (tenants and keys, pipelines).

    Writes in any process bump the store's revision; each process polls it and
    rebuilds its view whole, so workers and replicas converge within the interval.
    """

    def __init__(self, state: StateStore) -> None:
        self._state = state
        self._revision = -1

    @abstractmethod
    async def _rebuild(self) -> None:
        """Read the store and swap the new view in."""

    async def refresh(self) -> None:
        revision = await self._state.revision()
        await self._rebuild()
        self._revision = revision

    async def watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                if await self._state.revision() != self._revision:
                    await self.refresh()
            except Exception as exc:  # a transient store error must not end the watch
                _log.warning("state watch failed", view=type(self).__name__, error=str(exc))
