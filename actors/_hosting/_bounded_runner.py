"""A worker's event loop, run as ``uvloop.run`` runs it, but ended within a bound.

asyncio's runner ends a loop by cancelling the tasks left and waiting for
them, then for the default executor's threads, without limit: a
``__cleanup__`` that swallows its cancel (which the stop already gave up
on), or an ``asyncio.to_thread`` stuck in a blocking read, held the
worker's exit for good (after SIGTERM, with its owner alive, nothing killed
it). Here the loop is closed by :func:`~actors._shared._loops.close_loop`:
what is left gets a bounded wait, and the executor is not joined (the
worker ends with ``os._exit``).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._shared._loops import close_loop

__all__ = ["run_bounded"]

T = TypeVar("T")


def run_bounded(main: Coroutine[Any, Any, T], loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> T:
    """Run ``main`` to its end on a new loop (Ctrl-C cancels it, as ``asyncio.run``), then close the loop in
    bounded time (:func:`~actors._shared._loops.close_loop`)."""
    if sys.version_info < (3, 11):  # (no asyncio.Runner: the runner of that version, as before)
        import uvloop

        return uvloop.run(main)  # type: ignore[no-any-return]
    runner = asyncio.Runner(loop_factory=loop_factory)
    try:
        return runner.run(main)
    finally:
        loop = runner.get_loop()
        try:
            close_loop(loop)
        finally:
            asyncio.set_event_loop(None)
