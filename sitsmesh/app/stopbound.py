"""A stop that always ends: what is left is cancelled until it ends, and past a deadline
the process exits anyway, saying where it was stuck.

A replica in bench/chain_partitions.py once in about a hundred stops did not exit
within 20 s of SIGTERM, and its log was gone with the bench's directory. The
deadline turns such a hang into exit status 1 within a bound, with every thread's
stack and every task's in the log, so the next one says where it was.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import sys
import threading
import time

from sitsmesh import logs
from sitsmesh.config import Settings
from sitsmesh.tasks import cancel_until_done

_log = logs.get("sitsmesh.server")
# Past the drain window and the grace: the components' stops and the state store's close
# (a fraction of a second when nothing is stuck). Under the 20 s the benchmarks give a
# stop at the default grace, so that a stuck one shows its stacks there.
STOP_MARGIN_S = 8.0
# A process with children (workers, the RLQS process) waits for them: each has a deadline
# of its own as long as this one's, and is killed, and reaped, after it.
CHILDREN_S = 15.0
LEFTOVER_S = 5.0  # the tasks still running once every part has stopped


def arm(settings: Settings, margin_s: float = STOP_MARGIN_S, *,
        children: bool = False) -> None:
    """Start the deadline of a stop that has begun. A thread of its own, not the loop's
    timer: the loop may be what is stuck, or the interpreter's exit joining a thread,
    which the deadline covers too (a daemon thread: a process that exits ends it)."""
    deadline_s = (settings.drain_seconds + settings.grace_seconds + margin_s
                  + (CHILDREN_S if children else 0.0))
    loop = asyncio.get_running_loop()
    threading.Thread(target=_watch, args=(deadline_s, loop), name="stop-deadline",
                     daemon=True).start()


def _watch(deadline_s: float, loop: asyncio.AbstractEventLoop) -> None:
    time.sleep(deadline_s)
    _log.error("stop did not finish in time: exiting; stacks follow", seconds=deadline_s)
    _dump_tasks(loop)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's tasks, read from this thread: not safe while the loop runs them, but
    the loop is stuck or idle by now, and a failed read only loses the listing."""
    try:
        for task in asyncio.all_tasks(loop):
            task.print_stack(limit=12, file=sys.stderr)
    except Exception as exc:
        print(f"tasks not listed: {exc!r}", file=sys.stderr)


async def end_leftovers(within_s: float = LEFTOVER_S) -> None:
    """Cancel the tasks still running, again until they end (within `within_s`), and
    name them. asyncio.run cancels what is left once and then waits for it without
    end: one that loses that cancellation kept the process from exiting."""
    current = asyncio.current_task()
    left = {t for t in asyncio.all_tasks() if t is not current}
    if not left:
        return
    _log.info("tasks still running at the stop; cancelling them",
                 tasks=sorted(t.get_name() for t in left))
    left = await cancel_until_done(left, within_s)
    if left:
        _log.error("tasks did not end when cancelled", tasks=sorted(t.get_name() for t in left))
