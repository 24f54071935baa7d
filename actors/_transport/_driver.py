"""What drives a runtime: the event loop it is bound to.

The inbox socket, every peer's pidfd and the forkserver's status pipe are
loop readers; nothing here ever blocks the loop's thread. The loop is the
program's own when it runs one; a synchronous program's runtime is bound to
a :class:`~._background.BackgroundLoop` instead, and its calls wait on
their own thread (:meth:`Driver.wait`) for that loop's work. Only at
interpreter exit, once the background loop stopped, is a runtime pumped by
:meth:`Driver.wait` itself, on the exiting thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from .._shared._errors import CallTimeout
from .._shared._loops import running_loop, wake_all
from ._background import HANDOVER_TIMEOUT, BackgroundLoop
from ._inbox_pump import Inbox
from ._outbox import Outbox
from ._registry import Registry

__all__ = ["Driver"]

#: How long one hand-off of a wait without a deadline to another thread's loop lasts before it is renewed (s).
LOOP_WAIT_SLICE = 60.0


class Driver:
    """Binds a runtime's sockets and pidfds to an event loop (a background one for a program without its own)."""

    def __init__(self, inbox: Inbox, registry: Registry, outbox: Outbox, *, serve_in_background: bool) -> None:
        self._inbox = inbox
        self._registry = registry
        self._watcher = registry.watcher
        self._outbox = outbox
        self._chasing: Any = None  # the timer looking up pids not yet recorded
        registry.pid_missing.connect(self._chase_pids)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: int | None = None
        self.closed = False
        self._readers: dict[int, Callable[[], None]] = {}
        self._progress: list[asyncio.Future[None]] = []
        inbox.handled.connect(self.notify_progress)
        #: Whether a caller without a loop gets a background loop (a controller's runtime; a worker's is bound
        #: to its own loop at once); off after :meth:`release`, when the exiting thread pumps in :meth:`wait`.
        self.serve_in_background = serve_in_background
        self._background: BackgroundLoop | None = None

    def ensure_loop(self) -> asyncio.AbstractEventLoop:
        """Bind to the running event loop (rebinding if an earlier loop ended)."""
        loop = asyncio.get_running_loop()
        if loop is self.loop:
            return loop
        old = self.loop
        background = self._background
        if background is not None and old is background.loop:
            background.stop()  # it unbinds on its own thread; milliseconds (raises if it cannot)
            self._background = None
            old = self.loop
        if old is not None and not old.is_closed():
            if old.is_running():
                raise RuntimeError("the actors runtime is already driven by an event loop in another thread")
            self.unbind()
        self.loop = loop
        self.thread = threading.get_ident()
        loop.add_reader(self._inbox.sock.FD, self._readable)
        self._watcher.bind(loop.add_reader, loop.remove_reader)
        for fd, callback in self._readers.items():
            loop.add_reader(fd, callback)
        self._outbox.bind(loop)
        loop.call_soon(self._readable)  # messages may have arrived before binding
        if self._registry.unresolved:
            self._chase_pids()
        return loop

    def unbind(self) -> None:
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(self._inbox.sock.FD)
                for fd in self._readers:
                    loop.remove_reader(fd)
                for fd in self._watcher.fds():
                    loop.remove_reader(fd)
        self._watcher.bind(None, None)
        self._outbox.bind(None)
        if self._chasing is not None:
            self._chasing.cancel()
            self._chasing = None
        self.loop = None
        self.thread = None

    def follow_running_loop(self) -> None:
        """Rebind if the caller runs a different event loop; a caller without one gets the background loop."""
        running = running_loop()
        loop = self.loop
        if running is loop and loop is not None:
            return
        if loop is not None and loop.is_closed():
            self.unbind()
            loop = None
        if running is not None:
            self.ensure_loop()
        elif self.serve_in_background and not self.closed and (loop is None or not loop.is_running()):
            self._serve_in_background()

    def _serve_in_background(self) -> None:
        if self.loop is not None:
            self.unbind()  # a loop of the program's that is not running now: rebound when it runs again
        self._background = BackgroundLoop(self.ensure_loop, self.unbind)
        try:
            self._background.start()
        except BaseException:
            self._background = None
            raise

    def release(self) -> None:
        """From now on no background loop: stop the one running (it unbinds there), or unbind from the program's.

        At interpreter exit the exiting thread then drives what is left (the
        stop of what the program still holds) itself, in :meth:`wait`.
        """
        self.serve_in_background = False
        background, self._background = self._background, None
        if background is not None and background.alive and threading.get_ident() != background.thread_id:
            background.stop()
        self.unbind()

    def loop_active(self) -> bool:
        """True when called on the thread of the running loop this runtime is bound to."""
        loop = self.loop
        return loop is not None and threading.get_ident() == self.thread and loop.is_running()

    def on_runtime_thread(self) -> bool:
        loop = self.loop
        return self.thread is None or threading.get_ident() == self.thread or loop is None or not loop.is_running()

    def on_thread(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` on the runtime's thread (directly if already there) and return its result.

        Another thread (a synchronous endpoint's worker, a synchronous
        program's main thread) hands ``fn`` to the loop's thread and waits for
        it on its own thread, never on the loop's.
        """
        if self.on_runtime_thread():
            return fn()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

        assert self.loop is not None
        # In the caller's context: an actor's identity (``context()``) goes with its work.
        self.loop.call_soon_threadsafe(run, context=contextvars.copy_context())
        return done.result(timeout)

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Watch an extra file descriptor, with a loop or without one."""
        self._readers[fd] = callback
        if self.loop is not None and not self.loop.is_closed():
            self.loop.add_reader(fd, callback)

    def remove_reader(self, fd: int) -> None:
        self._readers.pop(fd, None)
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(Exception):
                self.loop.remove_reader(fd)

    def _chase_pids(self, delay: float = 0.01) -> None:
        """While some peer's pid is unknown, look it up again now and then (loop mode)."""
        loop = self.loop
        if loop is None or self._chasing is not None or self.closed:
            return

        def again() -> None:
            self._chasing = None
            if self._registry.retry_unresolved():
                self._chase_pids(min(delay * 2, 0.5))

        self._chasing = loop.call_later(delay, again)

    def _readable(self) -> None:
        if self.closed:
            return
        if not self._inbox.pump(limit=256):
            assert self.loop is not None
            self.loop.call_soon(self._readable)

    def notify_progress(self) -> None:
        """Something arrived or died: wake whoever waits in :meth:`wait_until`."""
        if self._progress:
            wake_all(self._progress)

    async def wait_until(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Await until ``condition()`` holds after some message or death; False at the deadline.

        The deadline wakes the waiter as progress would (it does not cancel
        it), so a cancellation of the awaiting task always passes through.
        """
        loop = self.ensure_loop()
        deadline = loop.time() + timeout
        while not condition():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            waiter = loop.create_future()
            self._progress.append(waiter)
            handle = loop.call_later(remaining, _wake, waiter)
            try:
                await waiter
            finally:
                handle.cancel()
                with contextlib.suppress(ValueError):  # woken by its deadline or cancelled: not progress's to wake
                    self._progress.remove(waiter)
        return True

    def _wait_on_loop(
        self, loop: asyncio.AbstractEventLoop, condition: Callable[[], bool], timeout: float | None, what: str
    ) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            limit = LOOP_WAIT_SLICE if deadline is None else max(0.0, deadline - time.monotonic())
            waiting = asyncio.run_coroutine_threadsafe(self.wait_until(condition, limit), loop)
            try:
                if waiting.result(limit + HANDOVER_TIMEOUT):
                    return
            except concurrent.futures.TimeoutError:
                waiting.cancel()
            if deadline is not None and time.monotonic() >= deadline:
                raise CallTimeout(f"gave up after {timeout:.1f}s waiting for {what}")

    def next_loop(self, old: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop | None:
        """For a thread whose wait through ``old`` was cancelled as that loop ended: the running loop that drives
        the runtime now (the program's, which took it over, or a new background one), once there is one.

        A hand-over takes milliseconds; None if no loop ran within
        :data:`HANDOVER_TIMEOUT` (the caller then waits as a program without
        one does). This thread never starts a loop itself: one starting here
        mid-hand-over would contest the runtime with the program's.
        """
        give_up = time.monotonic() + HANDOVER_TIMEOUT
        while True:
            loop = self.loop
            if loop is not None and loop is not old and loop.is_running():
                return loop
            if time.monotonic() >= give_up:
                return None
            time.sleep(0.001)  # (this thread's own wait, during a hand-over: never an event loop's)

    def block(self, condition: Callable[[], bool], writable: zmq.Socket[Any], timeout: float, what: str) -> None:
        self.wait(condition, timeout=timeout, writable=writable, what=what)

    def wait(
        self,
        condition: Callable[[], bool],
        *,
        timeout: float | None,
        writable: zmq.Socket[Any] | None = None,
        what: str = "a reply",
    ) -> None:
        """Block this thread, serving the inbox, until ``condition()`` holds (CallTimeout at ``timeout``).

        Only for callers without an event loop: a loop's thread never comes
        here. ``timeout`` None (``get()`` of a call without a deadline) waits
        until the call is answered, fails, or its actor's process dies. While
        a loop on another thread drives the runtime (the background loop, a
        worker's loop), ``condition`` is checked there and this thread waits.
        """
        loop = self.loop
        if loop is not None and loop.is_running() and threading.get_ident() != self.thread:
            self._wait_on_loop(loop, condition, timeout, what)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        inbox, watcher = self._inbox, self._watcher
        while not condition():
            remaining = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if remaining <= 0:
                raise CallTimeout(f"gave up after {timeout:.1f}s waiting for {what}")
            poller = zmq.Poller()
            if not inbox.dispatching:
                poller.register(inbox.sock, zmq.POLLIN)
            if writable is not None:
                poller.register(writable, zmq.POLLOUT)
            pidfds = watcher.fds()
            for fd in pidfds:
                poller.register(fd, zmq.POLLIN)
            for fd in self._readers:
                poller.register(fd, zmq.POLLIN)
            events = dict(poller.poll(int(remaining * 1000) + 1))
            if inbox.sock in events:
                inbox.pump()
            for fd in pidfds:
                if fd in events:
                    watcher.check(fd)
            for fd, callback in list(self._readers.items()):
                if fd in events:
                    callback()
            self._outbox.retry_stuck()
            if self._registry.unresolved:
                self._registry.retry_unresolved()


def _wake(waiter: asyncio.Future[None]) -> None:
    """A deadline's wake-up: the waiter looks at its condition (and the clock) again."""
    if not waiter.done():
        waiter.set_result(None)
