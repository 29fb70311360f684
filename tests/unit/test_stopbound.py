"""A stop always ends: leftover tasks are cancelled until they end, and past its
deadline the process exits with the stacks of what held it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

from sitsmesh.app import stopbound


def test_a_leftover_task_that_loses_a_cancellation_no_longer_holds_asyncio_run() -> None:
    """asyncio.run cancels what is left once, then waits for it without end."""
    ended = threading.Event()

    async def loses_the_first() -> None:
        lost = False
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if lost:
                    raise
                lost = True

    async def main() -> None:
        asyncio.get_running_loop().create_task(loses_the_first())
        await asyncio.sleep(0)
        await stopbound.end_leftovers(within_s=5)

    def run() -> None:
        asyncio.run(main())
        ended.set()

    # A thread: without the fix asyncio.run never returns, and the test must not hang.
    threading.Thread(target=run, daemon=True).start()
    assert ended.wait(10), "asyncio.run still waiting on the task after 10 s"


def test_past_its_deadline_a_stuck_stop_exits_1_with_the_stacks() -> None:
    script = textwrap.dedent("""
        import asyncio, dataclasses, time
        from sitsmesh.app import stopbound
        from sitsmesh.config import Settings

        async def main():
            stopbound.arm(dataclasses.replace(Settings(), drain_seconds=0,
                                              grace_seconds=0), margin_s=0.2)
            time.sleep(60)  # the loop stuck: nothing on it can end the stop

        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 1
    out = done.stdout + done.stderr
    assert "stop did not finish in time" in out
    assert "in main" in out  # the stuck frame, from the dump of every thread
