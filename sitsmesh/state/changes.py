"""Waking the waiters of one store when its revision moves (shared by the backends)."""

from __future__ import annotations

import asyncio
import contextlib


class ChangeSignal:
    """An edge that every current waiter sees: each `notify` wakes them all at once.

    Replacing the event (rather than clear()) keeps a waiter that has not run yet from
    missing the edge it was woken for.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait(self, within_s: float) -> bool:
        """True when notified within `within_s` seconds."""
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(within_s, 0.0))
        return event.is_set()
