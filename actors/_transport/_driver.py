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
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from .._shared._errors import CallTimeout, HandOffTimeout
from .._shared._hooks import Hook
from .._shared._loops import done_within, running_loop, wake_all
from ._background import HANDOVER_TIMEOUT, BackgroundLoop
from ._inbox_pump import Inbox
from ._outbox import Outbox
from ._registry import Registry

__all__ = ["Driver"]

#: How long one hand-off of a wait without a deadline to another thread's loop lasts before it is renewed (s).
LOOP_WAIT_SLICE = 60.0
#: How often a thread waiting for :meth:`Driver.on_thread` looks whether the loop it handed work to ended (s).
ON_THREAD_SLICE = 0.05


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
        #: Held through every change of the loop that drives the runtime (a bind, a hand-over, the start of a
        #: background loop), so another thread never sees the runtime unbound mid-hand-over and starts a loop
        #: that contests it. Never taken on the fast path (the caller's loop is the bound one).
        self._binding = threading.RLock()
        self._retiring: asyncio.AbstractEventLoop | None = None  # a background loop being handed over
        #: The runtime moved to another event loop (announced on it, on its thread): what lived on the old one
        #: (a receiving task, a timer) starts again there.
        self.moved: Hook[[]] = Hook("the runtime moving to another event loop")

    def ensure_loop(self) -> asyncio.AbstractEventLoop:
        """Bind to the running event loop (rebinding if an earlier loop ended)."""
        loop = asyncio.get_running_loop()
        if loop is self.loop:
            return loop
        if loop is self._retiring:  # (its last tasks, cancelled by the hand-over; the runtime left this loop)
            raise RuntimeError("the actors runtime is handed over from this (background) loop to another")
        with self._binding:
            if loop is self.loop:
                return loop
            return self._bind(loop)

    def _bind_background(self) -> None:
        """The background loop's first step, on its thread (the thread starting it holds :attr:`_binding`)."""
        self._bind(asyncio.get_running_loop())

    def _bind(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        old = self.loop
        background = self._background
        if background is not None and old is background.loop:
            self._retiring = old
            try:
                background.stop()  # it unbinds on its own thread; milliseconds (raises if it cannot)
            finally:
                self._retiring = None
            self._background = None
            old = self.loop
        if old is not None:
            if not old.is_closed() and old.is_running():
                raise RuntimeError("the actors runtime is already driven by an event loop in another thread")
            # (a closed one too: its timers, a pid lookup's among them, died with it and must not look pending)
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
        self.moved()
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
        if running is not None:
            self.ensure_loop()
            return
        if loop is not None and loop.is_running():
            return  # another thread's loop drives the runtime
        with self._binding:  # (waits out a hand-over in progress: the loop it binds serves this caller too)
            loop = self.loop
            if loop is not None and loop.is_closed():
                self.unbind()
                loop = None
            if self.serve_in_background and not self.closed and (loop is None or not loop.is_running()):
                self._serve_in_background()

    def _serve_in_background(self) -> None:
        if self.loop is not None:
            self.unbind()  # a loop of the program's that is not running now: rebound when it runs again
        self._background = BackgroundLoop(self._bind_background, self.unbind)
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
        background = self._background
        if background is not None and threading.get_ident() == background.thread_id:
            # (a handler on the background loop itself: a hand-over holding the lock may be waiting for it)
            self._background = None
            self.unbind()
            return
        with self._binding:
            background, self._background = self._background, None
            if background is not None and background.alive:
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
        it on its own thread, never on the loop's. A loop that ends before
        running ``fn`` (it handed the runtime over) passes it on to the next.
        """
        give_up = time.monotonic() + timeout
        while True:
            loop = self.loop
            if loop is None or not loop.is_running() or threading.get_ident() == self.thread:
                if threading.get_ident() == self.thread or not self._settle():
                    return fn()
                continue  # a hand-over just ended: the loop it bound runs ``fn``
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            # Taken by whichever comes first: ``run`` on the loop, or this thread giving up on that loop, so
            # ``fn`` runs once even when a stopped loop runs its queue again later.
            claim = threading.Lock()

            def run(
                done: concurrent.futures.Future[Any] = done,
                claim: threading.Lock = claim,
                loop: asyncio.AbstractEventLoop = loop,
            ) -> None:
                if self.loop is not loop or not claim.acquire(blocking=False):
                    return  # (the runtime left this loop, or the waiting thread took ``fn`` elsewhere)
                try:
                    done.set_result(fn())
                except BaseException as exc:
                    done.set_exception(exc)

            try:
                # In the caller's context: an actor's identity (``context()``) goes with its work.
                loop.call_soon_threadsafe(run, context=contextvars.copy_context())
            except RuntimeError:  # closed since this thread looked
                self.next_loop(loop)
                continue
            while True:
                served = self.wait_while_driven(
                    loop,
                    functools.partial(done_within, done),
                    max(0.0, give_up - time.monotonic()),
                )
                if served:
                    return done.result()
                if served is None and claim.acquire(blocking=False):
                    break  # it stopped, ended or handed over without running ``fn``: hand it to the next loop
                if served is False or time.monotonic() >= give_up:
                    claim.acquire(blocking=False)  # (not started: it never runs after this timeout)
                    raise HandOffTimeout(f"{fn!r} was not run on the runtime's thread in {timeout:g}s")
                # (the loop stopped while ``fn`` ran on it: its result is still to come, up to the timeout)
            self.next_loop(loop)

    def drives(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether ``loop`` still drives the runtime: bound to it and running (not stopped, closed or handed over)."""
        return self.loop is loop and loop.is_running()

    def wait_while_driven(
        self, loop: asyncio.AbstractEventLoop | None, ready: Callable[[float], bool], timeout: float | None
    ) -> bool | None:
        """Wait on this thread (never a loop's) until ``ready(seconds)`` holds, asked in slices: True then, False
        at ``timeout``, None as soon as ``loop`` no longer drives the runtime (what it would have done will not
        happen there: the caller goes on through whatever drives it now)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if ready(ON_THREAD_SLICE if left is None else min(ON_THREAD_SLICE, left)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if loop is None or not self.drives(loop):
                return None

    def _settle(self) -> bool:
        """Wait out a change of loop another thread is making; True if a running loop drives the runtime now.

        Never waits on the loop being handed over (its last tasks run while
        the thread handing it over waits for that loop to end).
        """
        retiring = self._retiring
        if retiring is None or running_loop() is not retiring:
            with self._binding:
                pass
        loop = self.loop
        return loop is not None and loop.is_running() and threading.get_ident() != self.thread

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Watch an extra file descriptor, with a loop or without one; from any thread (the change is made on the
        runtime's: a loop's watchers, uvloop's libuv handles, are not thread-safe)."""

        def add() -> None:
            self._readers[fd] = callback
            if self.loop is not None and not self.loop.is_closed():
                self.loop.add_reader(fd, callback)

        self.on_thread(add)

    def remove_reader(self, fd: int) -> None:
        """Stop watching ``fd`` (from any thread, as :meth:`add_reader`); it may be closed once this returns."""

        def remove() -> None:
            self._readers.pop(fd, None)
            if self.loop is not None and not self.loop.is_closed():
                with contextlib.suppress(Exception):
                    self.loop.remove_reader(fd)

        self.on_thread(remove)

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
        if self.closed or running_loop() is not self.loop:
            return  # (queued on a loop the runtime has left: the loop that drives it now reads the inbox)
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
        self,
        loop: asyncio.AbstractEventLoop,
        condition: Callable[[], bool],
        deadline: float | None,
        timeout: float | None,
        what: str,
    ) -> bool:
        """Wait on this thread while ``loop`` checks ``condition``: True once it holds, False if ``loop`` ended
        (or handed the runtime over) meanwhile; CallTimeout at ``deadline``."""
        while True:
            limit = LOOP_WAIT_SLICE if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                waiting = asyncio.run_coroutine_threadsafe(self._wait_if_bound(loop, condition, limit), loop)
            except RuntimeError:  # closed since this thread looked
                return False
            end = time.monotonic() + limit + HANDOVER_TIMEOUT
            while True:
                try:
                    held = waiting.result(min(ON_THREAD_SLICE, max(0.0, end - time.monotonic())))
                except concurrent.futures.CancelledError:  # the loop ended with the wait on it
                    return False
                except concurrent.futures.TimeoutError:
                    if not self.drives(loop):  # it stopped or handed the runtime over, the wait still on it
                        waiting.cancel()
                        return False
                    if time.monotonic() < end:
                        continue
                    waiting.cancel()
                    held = False
                if held is None:  # it ran on a loop the runtime had left (a hand-over's last tasks)
                    return False
                if held:
                    return True
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise CallTimeout(f"gave up after {timeout:.1f}s waiting for {what}")

    async def _wait_if_bound(
        self, loop: asyncio.AbstractEventLoop, condition: Callable[[], bool], timeout: float
    ) -> bool | None:
        """:meth:`wait_until` on ``loop`` while it drives the runtime; None if the runtime left it first."""
        if self.loop is not loop or loop is self._retiring:
            return None
        return await self.wait_until(condition, timeout)

    def next_loop(self, old: asyncio.AbstractEventLoop, until: float | None = None) -> asyncio.AbstractEventLoop | None:
        """For a thread whose wait through ``old`` ended with that loop: the running loop that drives the
        runtime now, once there is one — the program's, which took it over (or runs again), or a background loop.

        A hand-over takes milliseconds; this thread starts the background
        loop itself when none runs (under the binding lock, so it never
        contests a hand-over). None if no loop ran within
        :data:`HANDOVER_TIMEOUT` (or by ``until``, a caller's own deadline),
        or none will (the runtime closed or is released to the exiting
        thread): the caller then waits as a program without a loop does.
        """
        give_up = time.monotonic() + HANDOVER_TIMEOUT
        if until is not None:
            give_up = min(give_up, until)
        while True:
            if running_loop() is None:
                self.follow_running_loop()
            loop = self.loop
            # (``old`` too, once it runs again: a program's loop that stopped and runs its next coroutine; never
            # while it is handed over: its last tasks run then)
            if loop is not None and loop.is_running() and loop is not self._retiring:
                return loop
            if self.closed or not self.serve_in_background or time.monotonic() >= give_up:
                return None
            time.sleep(0.001)  # (this thread's own wait, while ``old`` finishes ending: never an event loop's)

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
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            loop = self.loop
            if loop is not None and loop.is_running() and threading.get_ident() != self.thread:
                if self._wait_on_loop(loop, condition, deadline, timeout, what):
                    return
                self.next_loop(loop)  # the loop that took the runtime over checks the condition from now on
            elif threading.get_ident() == self.thread or not self._settle():
                break  # no other loop drives the runtime (a change of loop under way has settled)
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
