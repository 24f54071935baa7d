"""``Future``: the answer to a message that is already on the wire.

Await it inside a coroutine, or call ``get()`` from synchronous code, which
waits on its own thread while the runtime's loop (the program's, or the
background loop of a program without one) serves the inbox.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._shared._errors import CallTimeout
from .._shared._loops import done_within, loop_running
from ._core import runtime

R = TypeVar("R")
T = TypeVar("T")

if TYPE_CHECKING:
    from .._transport._driver import Driver

__all__ = ["Future"]

#: ``Future._get_elsewhere``'s word that no loop drives the runtime (its outcome may be None).
_NO_LOOP = object()


class Future(Generic[R]):
    """A result that will arrive; awaitable, or ``get()`` synchronously."""

    __slots__ = (
        "_any_thread",
        "_done",
        "_elsewhere",
        "_elsewhere_on",
        "_error",
        "_make",
        "_running",
        "_value",
        "_wait_sync",
    )

    def __init__(
        self,
        make: Callable[[], Coroutine[Any, Any, R]],
        wait_sync: Callable[[float | None], R] | None = None,
        *,
        any_thread: bool = False,
    ) -> None:
        self._make = make
        self._wait_sync = wait_sync
        #: ``wait_sync`` may wait on a thread whose runtime another thread's loop drives (a call's reply).
        self._any_thread = any_thread
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        #: The run a ``get()`` started on the loop of another thread: a later ``get()`` or ``await`` waits for
        #: it (a ``get(timeout)`` that gave up does not consume the future, as in Monarch, nor run it twice).
        self._elsewhere: concurrent.futures.Future[R] | None = None
        #: The loop that run is on.
        self._elsewhere_on: asyncio.AbstractEventLoop | None = None
        #: Set once the run an awaiter started ends (others awaiting meanwhile wait for it: the work runs once).
        self._running: asyncio.Future[None] | None = None

    @classmethod
    def ready(cls, value: R) -> Future[R]:
        """A future that already holds ``value``."""

        async def make() -> R:
            return value

        return cls(make, lambda _timeout: value)

    def then(self, fn: Callable[[R], T]) -> Future[T]:
        """A future of ``fn(result)``, awaitable or ``get()``-able like this one."""

        async def make() -> T:
            return fn(await self)

        return Future(make, lambda timeout: fn(self.get(timeout)))

    def __await__(self) -> Generator[Any, None, R]:
        return self._run().__await__()

    def as_asyncio(self) -> asyncio.Future[R]:
        """An ``asyncio.Future`` on the running loop that resolves as this one does (Monarch's). The work starts now,
        runs once however many observe it (``await`` it, or call this again), and is not consumed: a later
        ``await`` sees the same outcome. Off a running loop, ``RuntimeError`` (nothing is started)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("as_asyncio() needs a running asyncio event loop (use get() outside one)") from None
        return loop.create_task(self._run())

    async def _run(self) -> R:
        if self._done:
            return self._result()
        elsewhere = self._elsewhere
        on = self._elsewhere_on
        if elsewhere is not None and not elsewhere.done() and (on is None or not on.is_running()):
            elsewhere.cancel()  # stranded on a loop that stopped (one handing the runtime over still runs it)
            elsewhere = None
        if elsewhere is not None:  # a get() started it on another thread's loop: its outcome is this one's
            try:  # (shielded: this await cancelled leaves that run going)
                await asyncio.shield(asyncio.wrap_future(elsewhere))
            except asyncio.CancelledError:
                if not elsewhere.cancelled():
                    raise  # this await's own cancellation
            except BaseException:
                pass  # the outcome, kept: raised below
            if self._done:
                return self._result()
        return await self._shared_body()

    async def _shared_body(self) -> R:
        """The work, run once however many await it at once on this loop: a later awaiter waits for the run under
        way (and runs it itself if that one was cancelled: a cancelled await is not the future's outcome)."""
        loop = asyncio.get_running_loop()
        while not self._done:
            running = self._running
            if running is None or running.done() or running.get_loop() is not loop:
                break
            await asyncio.wait({running})
        if self._done:
            return self._result()
        running = self._running = loop.create_future()
        try:
            return await self._body()
        finally:
            running.set_result(None)
            if self._running is running:
                self._running = None

    async def _body(self) -> R:
        """Run the future's work and keep its outcome (a cancellation is not one: it may be run again; nor is the
        ``GeneratorExit`` of a run closed with the loop it was left on)."""
        try:
            self._value = await self._make()
        except BaseException as exc:
            if not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                self._done, self._error = True, exc
            raise
        self._done = True
        return self._value  # type: ignore[no-any-return]

    def _result(self) -> R:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def get(self, timeout: float | None = None) -> R:
        """Block until the result is here (synchronous code only)."""
        if self._done:
            return self._result()
        if loop_running():
            raise RuntimeError("Future.get() would block the running event loop; use 'await' instead")
        driver = runtime().driver
        loop = driver.loop
        deadline = None if timeout is None else time.monotonic() + timeout  # (one bound, whichever way it waits)
        runs_elsewhere = loop is not None and loop.is_running() and driver.thread != threading.get_ident()
        if runs_elsewhere and not (self._any_thread and self._wait_sync is not None):
            assert loop is not None
            # Another thread drives the runtime: the background loop of a program without one, or a
            # worker's loop seen from a synchronous actor's thread. The wait is on this thread.
            outcome = self._get_elsewhere(driver, loop, timeout, deadline)
            if outcome is not _NO_LOOP:
                return outcome  # type: ignore[return-value]
            # no loop drives the runtime any more: this thread waits as a program without one does, for what is left
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._wait_sync is None:
            raise RuntimeError("this Future can only be awaited")
        try:
            self._value = self._wait_sync(timeout)
        except CallTimeout:
            raise  # not an outcome: the answer may still come (an expired call keeps its error itself)
        except Exception as exc:
            self._done, self._error = True, exc
            raise  # (a KeyboardInterrupt is the waiter's own: not the outcome, which a later get() still waits for)
        self._done = True
        return self._value  # type: ignore[no-any-return]

    def _get_elsewhere(
        self, driver: Driver, loop: asyncio.AbstractEventLoop, timeout: float | None, deadline: float | None
    ) -> R | object:
        """Run the work on ``loop``, which another thread runs, and wait for it here; ``_NO_LOOP`` if none drives.

        When ``loop`` ends or hands the runtime over before the work is done
        (a program's ``asyncio.run`` returned and cancelled the run, or its
        loop stopped with the run pending on it), the run there is cancelled
        and started again on the loop that drives the runtime now.
        """
        cancelled_on: asyncio.AbstractEventLoop | None = None  # the loop that last cancelled a run while it drove
        while True:
            if self._done:  # (the run ended as its loop stopped, or an await of this future finished the work)
                return self._result()
            waiting = self._elsewhere
            on = self._elsewhere_on
            if waiting is not None and not waiting.done() and (on is None or not on.is_running()):
                waiting.cancel()  # stranded on a loop that stopped (an earlier get gave up on it there)
            if waiting is None or waiting.cancelled():  # (a loop that ended cancels its run)
                try:
                    waiting = self._elsewhere = asyncio.run_coroutine_threadsafe(self._shared_body(), loop)
                    self._elsewhere_on = loop
                except RuntimeError:  # closed since this thread looked
                    waiting = None
            if waiting is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                driven = driver.wait_while_driven(loop, functools.partial(done_within, waiting), left)
                if waiting.done() and not waiting.cancelled():
                    return waiting.result()  # the outcome (a call's own deadline too: CallTimeout)
                if self._done:
                    return self._result()
                if driven is False or (deadline is not None and time.monotonic() >= deadline):
                    # the run goes on: a later get() or await waits for the same one (Monarch: a timeout never
                    # consumes the future)
                    raise CallTimeout(f"gave up after {timeout:.1f}s waiting for the result")
                if driven and waiting.cancelled():  # cancelled while its loop drove: a loop shutting down, or the
                    if cancelled_on is loop:  # work's own cancellation, twice on the same loop: that is its end
                        raise concurrent.futures.CancelledError()
                    cancelled_on = loop
                waiting.cancel()  # (stranded on a loop that stopped: cancelled there should it run again)
            following = driver.next_loop(loop, until=deadline)
            if following is None:
                if deadline is not None and time.monotonic() >= deadline:  # (it waited for a hand-over meanwhile)
                    raise CallTimeout(f"gave up after {timeout:.1f}s waiting for the result")
                return _NO_LOOP
            loop = following

    def result(self, timeout: float | None = None) -> R:
        """Alias of :meth:`get`."""
        return self.get(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the future ended with, or None."""
        try:
            self.get(timeout)
        except Exception as exc:
            return exc
        return None
