"""Ending tasks for sure, and running loops together so that none outlives the others.

A cancellation can be lost: redis-py turned one into an error its caller's loop
caught and went on (see app/background.py), and on Python 3.11 `asyncio.wait_for`
returns the result instead of raising when the awaited work finishes at the moment
the cancel comes. A task cancelled once may so run on; asyncio.run cancels what is
left at its end only once, and then waits for it: the process never exits. So a
task is cancelled again until it has ended.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=asyncio.Future[Any])

# How long a cancelled task gets before it is cancelled again.
RECANCEL_S = 0.1


async def cancel_until_done(tasks: Iterable[_F], within_s: float | None = None) -> set[_F]:
    """Cancel `tasks`, again every RECANCEL_S until each has ended (or `within_s` has
    passed: those still running are returned). The caller's own cancellation waits
    meanwhile (it is raised once they have ended): a caller that gave up half-way
    would leave them running."""
    pending = {t for t in tasks if not t.done()}
    deadline = math.inf if within_s is None else time.monotonic() + within_s
    cancelled: asyncio.CancelledError | None = None
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        try:
            await asyncio.wait(pending, timeout=RECANCEL_S)
        except asyncio.CancelledError as exc:
            cancelled = exc
        pending = {t for t in pending if not t.done()}
    if cancelled is not None:
        raise cancelled
    return pending


async def run_together(*work: Coroutine[Any, Any, None]) -> None:
    """Run `work` until all of it has returned or one part has failed (its error is
    raised), like asyncio.gather; unlike gather, the other parts are then ended (and on
    a cancellation too) before this returns: a failed part leaves none running."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            error = None if task.cancelled() else task.exception()
            if error is not None:
                raise error
    finally:
        await cancel_until_done(tasks)
        for task in tasks:  # retrieved: asyncio would log the others' errors as lost
            if not task.cancelled():
                task.exception()
