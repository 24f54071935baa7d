"""One event loop that code without one runs coroutines on, call after call (not a new loop each time).

A loop made per call (``asyncio.run``) breaks what async code keeps between
calls bound to the loop that made it: a module-level ``asyncio.Semaphore``
or a cached HTTP client of an LLM judge works once and fails from then on.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["BlockingLoop"]

T = TypeVar("T")


class BlockingLoop:
    """Runs coroutines to completion on one loop it keeps, for callers on threads without a running loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one caller at a time: a loop runs one ``run_until_complete`` at once
        self._loop: asyncio.AbstractEventLoop | None = None
        self._finalizer: weakref.finalize[[asyncio.AbstractEventLoop], BlockingLoop] | None = None

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """``coroutine``'s result, run on this object's loop on the calling thread (which must run no loop)."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._finalizer = weakref.finalize(self, _close, self._loop)
            return self._loop.run_until_complete(coroutine)

    def close(self) -> None:
        """Cancel what the loop still runs, finish its async generators and executor, and close it (idempotent)."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._loop = self._finalizer = None


def _close(loop: asyncio.AbstractEventLoop) -> None:
    if loop.is_closed() or loop.is_running():
        return
    left = asyncio.all_tasks(loop)
    for task in left:
        task.cancel()
    try:
        if not _a_loop_runs_here():  # (else run_until_complete cannot run here: cancelled and closed only)
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


def _a_loop_runs_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
