"""Background tasks stop even when their code swallows the cancellation."""

from __future__ import annotations

import asyncio

from sitsmesh.app.background import Background


def test_stop_ends_a_loop_that_turns_the_first_cancellation_into_an_error() -> None:
    swallowed: list[asyncio.CancelledError] = []

    async def loop() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError as exc:  # what a client library did
                if not swallowed:
                    swallowed.append(exc)
                    continue
                raise

    async def main() -> bool:
        background = Background()
        background.spawn(loop())
        await asyncio.sleep(0)
        # Not wait_for: its own cancel would be the second one the loop needs.
        done, _ = await asyncio.wait((asyncio.ensure_future(background.stop()),), timeout=5)
        return bool(done)

    assert asyncio.run(main()), "stop() still waiting on the task after 5 s"
    assert len(swallowed) == 1


def test_stop_reports_a_task_that_had_failed_and_still_stops_the_others() -> None:
    stopped: list[bool] = []

    async def fails() -> None:
        raise RuntimeError("boom")

    async def waits() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            stopped.append(True)

    async def main() -> None:
        background = Background()
        background.spawn(fails())
        background.spawn(waits())
        await asyncio.sleep(0.01)
        await asyncio.wait_for(background.stop(), 5)

    asyncio.run(main())
    assert stopped == [True]
