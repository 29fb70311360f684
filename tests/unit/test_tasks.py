"""Tasks end for sure: a lost cancellation, or a part of a group that failed, leaves
nothing running (asyncio.run's one cancel at its end would then wait for it forever)."""

from __future__ import annotations

import asyncio

import pytest

from sitsmesh.tasks import cancel_until_done, run_together


async def _swallows_first_cancel(ended: list[str], name: str) -> None:
    """What a client library did with a cancellation: turned it into an error its
    caller's loop caught, and went on."""
    lost = False
    try:
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if lost:
                    raise
                lost = True
    finally:
        ended.append(name)


def _others() -> set[asyncio.Task[object]]:
    return asyncio.all_tasks() - {asyncio.current_task()}


def test_a_part_that_fails_ends_the_others_before_its_error_is_raised() -> None:
    ended: list[str] = []
    started = asyncio.Event()

    async def fails() -> None:
        await started.wait()
        raise RuntimeError("a bug")

    async def loops() -> None:
        started.set()
        await _swallows_first_cancel(ended, "loops")

    async def main() -> set[asyncio.Task[object]]:
        with pytest.raises(RuntimeError, match="a bug"):
            await asyncio.wait_for(run_together(fails(), loops()), 10)
        return _others()

    assert asyncio.run(main()) == set()
    assert ended == ["loops"]


def test_a_cancelled_group_ends_every_part_and_then_says_it_was_cancelled() -> None:
    ended: list[str] = []

    async def main() -> set[asyncio.Task[object]]:
        group = asyncio.ensure_future(run_together(_swallows_first_cancel(ended, "a"),
                                                   _swallows_first_cancel(ended, "b")))
        await asyncio.sleep(0)
        group.cancel()
        done, _ = await asyncio.wait((group,), timeout=10)
        assert done == {group}
        assert group.cancelled()
        return _others()

    assert asyncio.run(main()) == set()
    assert sorted(ended) == ["a", "b"]


def test_a_caller_cancelled_meanwhile_still_waits_until_the_tasks_have_ended() -> None:
    ended: list[str] = []

    async def main() -> None:
        task = asyncio.ensure_future(_swallows_first_cancel(ended, "task"))
        await asyncio.sleep(0)
        stopping = asyncio.ensure_future(cancel_until_done([task]))
        await asyncio.sleep(0)
        stopping.cancel()  # a caller's own stop, re-cancelled as Background does
        done, _ = await asyncio.wait((stopping,), timeout=10)
        assert done == {stopping}
        assert stopping.cancelled()
        assert task.done()

    asyncio.run(main())
    assert ended == ["task"]
