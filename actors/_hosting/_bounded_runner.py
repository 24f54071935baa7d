"""A worker's event loop, run as ``uvloop.run`` runs it, but ended within a bound.

asyncio's runner ends a loop by cancelling the tasks left and waiting for
them, then for the default executor's threads, without limit: a
``__cleanup__`` that swallows its cancel (which the stop already gave up
on), or an ``asyncio.to_thread`` stuck in a blocking read, held the
worker's exit for good (after SIGTERM, with its owner alive, nothing killed
it). Here what is left gets :data:`LEFTOVER_WAIT` seconds, and the executor
is not joined: the worker ends with ``os._exit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LEFTOVER_WAIT", "run_bounded"]

#: How long the tasks still pending when the worker's main coroutine returns get to end once cancelled (s).
LEFTOVER_WAIT = 1.0

T = TypeVar("T")


def run_bounded(main: Coroutine[Any, Any, T], loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> T:
    """Run ``main`` to its end on a new loop (Ctrl-C cancels it, as ``asyncio.run``), then end the loop in bounded
    time: the tasks left are cancelled and waited for up to :data:`LEFTOVER_WAIT` s, async generators closed."""
    if sys.version_info < (3, 11):  # (no asyncio.Runner: the runner of that version, as before)
        import uvloop

        return uvloop.run(main)  # type: ignore[no-any-return]
    runner = asyncio.Runner(loop_factory=loop_factory)
    try:
        return runner.run(main)
    finally:
        _end(runner.get_loop())


def _end(loop: asyncio.AbstractEventLoop) -> None:
    try:
        left = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=LEFTOVER_WAIT))
        with contextlib.suppress(Exception):
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), LEFTOVER_WAIT))
    finally:
        asyncio.set_event_loop(None)
        loop.close()  # (its executor is shut down without waiting for its threads)
