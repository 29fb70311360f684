"""The streams Envoy keeps open for good (access logs, stats), ended at shutdown.

Envoy opens one access-log and one stats stream and never closes them, so a draining
replica's grpc server waited out its whole grace for them on every shutdown, and
then cut them off. Ending them when the drain window closes (health has said
NOT_SERVING for that long) lets the server stop at once; Envoy opens its next stream
on a replica that still serves, at its next flush.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


class OpenStreams:
    """Runs each stream's body as a task `end_all` can cut short. Only the event loop's
    thread touches it, so it needs no lock."""

    def __init__(self) -> None:
        self._open: set[asyncio.Task[object]] = set()
        self.ending = False

    async def run(self, body: Awaitable[None]) -> None:
        """Await `body`; return normally (the stream ends OK) if end_all cut it short."""
        if self.ending:
            # A stream opened after the drain window: Envoy should have moved away by
            # now; ending it at once sends its next flush elsewhere.
            close = getattr(body, "close", None)
            if close is not None:
                close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._open.add(task)
        try:
            await body
        except asyncio.CancelledError:
            if not self.ending:
                raise
            task.uncancel()  # we cancelled it to end the stream; grpc did not
        finally:
            self._open.discard(task)

    def end_all(self) -> int:
        """End every open stream (at their next await); returns how many there were."""
        self.ending = True
        for task in self._open:
            task.cancel()
        return len(self._open)
