"""Following the state store from every process: refresh when its revision moves."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod

from sitsmesh import logs
from sitsmesh.state.contract import StateStore

_log = logs.get("sitsmesh.state.watch")


class RevisionFollower(ABC):
    """Base for views built from the state store (tenants and keys, pipelines).

    Writes in any process bump the store's revision; each process waits for it to
    move (PostgreSQL tells it at once, SQLite is polled) and rebuilds its view whole.
    A rebuild that fails (the store is down) keeps the last snapshot serving.
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
        """Follow the store; `interval_s` bounds the wait between two reads of it."""
        failing = False
        while True:
            try:
                if await self._state.wait_for_change(self._revision, interval_s) \
                        != self._revision:
                    await self.refresh()
                if failing:
                    _log.info("state watch recovered", view=type(self).__name__,
                              revision=self._revision)
                failing = False
            except Exception as exc:  # a transient store error must not end the watch
                if not failing:
                    _log.warning("state watch failed; serving the last snapshot",
                                 view=type(self).__name__, error=str(exc))
                failing = True
                await asyncio.sleep(interval_s)
