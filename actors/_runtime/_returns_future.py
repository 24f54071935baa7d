"""``@returns_future``: an ``async def`` that both kinds of caller can use, as in Monarch.

The decorated function returns a :class:`~actors.Future` at once, without
starting its body: ``await`` runs the body on the awaiting loop;
``.get()`` from synchronous code runs it on a loop of its own on the
calling thread (as ``asyncio.run`` does), bounded by ``get``'s timeout.
``.get()`` on a thread whose loop is running refuses, as every
:class:`~actors.Future` does, rather than run a second loop inside it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from ._future import Future

__all__ = ["returns_future"]

P = ParamSpec("P")
R = TypeVar("R")


def returns_future(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Future[R]]:
    """Make the ``async def`` ``fn`` return a :class:`Future` instead of a coroutine."""
    if not asyncio.iscoroutinefunction(fn):
        raise TypeError(f"@returns_future needs an async def, not {fn!r}")

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Future[R]:
        def body() -> Coroutine[Any, Any, R]:
            return fn(*args, **kwargs)

        def run_here(timeout: float | None) -> R:
            async def bounded() -> R:
                return await asyncio.wait_for(body(), timeout)

            return asyncio.run(bounded())

        return Future(body, run_here)

    return wrapper
