"""Whether this thread runs an event loop (the one check behind "never wait on the loop's thread"), and waking
the loop futures that waiters park on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

__all__ = ["LEFTOVER_WAIT", "close_loop", "done_within", "loop_running", "running_loop", "wake_all"]

#: How long the tasks still pending on a loop being closed get to end once cancelled (s): one that swallows its
#: cancel (a ``__cleanup__`` a stop gave up on) or waits on a thread stuck in a read must not hold the close for good.
LEFTOVER_WAIT = 1.0


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop this thread runs, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def loop_running() -> bool:
    """True when this thread runs an event loop: code here must not block (wait, sleep, long I/O)."""
    return running_loop() is not None


def wake_all(waiters: list[asyncio.Future[None]], error: BaseException | None = None) -> None:
    """Finish every pending future in ``waiters`` (with ``error``, if given) and empty the list.

    Each waiter looks again at what it waits for; one whose loop has
    closed is skipped.
    """
    for waiter in waiters:
        if not waiter.done():
            with contextlib.suppress(RuntimeError):  # its loop may be closed
                if error is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(error)
    waiters.clear()


def done_within(future: concurrent.futures.Future[Any], seconds: float) -> bool:
    """Whether ``future`` is done, waiting up to ``seconds`` on this thread for it (never a loop's)."""
    return bool(concurrent.futures.wait([future], timeout=seconds).done)


def close_loop(loop: asyncio.AbstractEventLoop, wait: float = LEFTOVER_WAIT) -> None:
    """Cancel what is left on ``loop``, give it ``wait`` s to end, close its async generators, and close it.

    As ``asyncio.run`` ends a loop, but in bounded time (it waits for every task, and for the default executor's
    threads, without limit); the executor's threads are not joined.
    """
    try:
        left = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=wait))
        with contextlib.suppress(Exception):
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), wait))
    finally:
        loop.close()
