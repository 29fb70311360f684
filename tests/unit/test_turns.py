"""Turns: background slices run one per pass of the event loop, in order, and a
cancelled waiter does not keep the others waiting."""

from __future__ import annotations

import asyncio

from sitsmesh.turns import Turns


class Passes:
    """Counts passes of the loop: a callback that schedules itself runs once a pass."""

    def __init__(self) -> None:
        self.count = 0
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._tick)
        self.stopped = False

    def _tick(self) -> None:
        self.count += 1
        if not self.stopped:
            self._loop.call_soon(self._tick)


async def test_slices_of_many_workers_run_one_a_pass_in_order() -> None:
    turns, passes = Turns(), Passes()
    ran: list[tuple[int, str]] = []

    async def worker(name: str) -> None:
        for _ in range(3):
            await turns.take()
            ran.append((passes.count, name))

    await asyncio.gather(*(worker(n) for n in "abcd"))
    passes.stopped = True
    assert len(ran) == 12
    # Never two slices in one pass: a callback ready meanwhile (a Check) waits for one.
    assert len({at for at, _ in ran}) == 12
    # Served in the order they asked: "a" asked again before the others first asked.
    assert [n for _, n in ran] == list("aabcdabcdbcd")


async def test_a_free_turn_is_taken_at_once() -> None:
    turns = Turns()
    await asyncio.wait_for(turns.take(), 1)
    await asyncio.sleep(0)  # a pass: the turn is free again
    await asyncio.sleep(0)
    await asyncio.wait_for(turns.take(), 1)


async def test_a_cancelled_waiter_hands_its_turn_on() -> None:
    turns = Turns()
    holder, gone, after = (asyncio.ensure_future(turns.take()) for _ in range(3))
    await asyncio.sleep(0)  # all three asked: the first holds the turn
    await asyncio.sleep(0)  # a pass later the turn is handed to `gone`...
    assert holder.done() and not gone.done()
    gone.cancel()           # ...which is cancelled before it runs
    await asyncio.wait_for(after, 1)
    assert gone.cancelled()
