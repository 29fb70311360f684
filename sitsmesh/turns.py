"""One slice of background work per pass of the event loop.

Work that shares the loop with Check (RLQS reports, replies and refreshes) is cut into
short slices that yield between them. Yielding alone is not enough: asyncio runs every
callback that is ready in one pass, in order, so 100 RLQS streams each ready with a
slice put a Check behind all of them (its p99 was 4-5 ms with 100 streams against an
idle 1 ms). Slices that take a turn first run one a pass: a Check that arrives waits
for at most one of them.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Turns:
    """`await turns.take()` before a slice; the slice then runs, and the next taker's
    turn comes in the next pass of the loop. Waiters are served in order."""

    __slots__ = ("_loop", "_taken", "_waiters")

    def __init__(self) -> None:
        self._taken = False
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def take(self) -> None:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        if not self._taken:
            self._taken = True
            loop.call_soon(self._pass)
            return
        waiter = loop.create_future()
        self._waiters.append(waiter)
        # Cancelled while waiting or once handed the turn, nobody waits for it: a turn
        # lasts one pass, and the next is handed on whether or not this one was used.
        await waiter

    def _pass(self) -> None:
        """A pass has run since the turn was taken: hand it to the next waiter (whose
        slice runs in the pass after this one), or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                assert self._loop is not None
                self._loop.call_soon(self._pass)
                return
        self._taken = False
