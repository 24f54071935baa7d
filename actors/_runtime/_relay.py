"""Answers from other threads (Ray's, a lifeline's), handed to the runtime's thread.

A Ray call completes on one of Ray's threads, a lifeline ends on its own;
the registry and the proc meshes belong to the runtime's thread. The relay
queues each completion and wakes that thread through a pipe it watches (a
loop reader, or the synchronous pump's poll), so the handler runs there,
never on the other thread and never blocking the loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ._core import Runtime

__all__ = ["Relay"]

log = logging.getLogger("actors")


class _Done:
    """A result that is already there: what :meth:`Relay.call_soon` queues."""

    @staticmethod
    def result() -> None:
        return None


_DONE = _Done()


class Relay:
    """Runs ``handler(result, error)`` on the runtime's thread when a future of another thread completes."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()
        self._done: collections.deque[tuple[Callable[[Any, BaseException | None], None], Any]] = collections.deque()
        self.closed = False
        rt.driver.add_reader(self._read, self._drain)

    def when_done(
        self, future: concurrent.futures.Future[Any], handler: Callable[[Any, BaseException | None], None]
    ) -> None:
        """Call ``handler(value, None)`` or ``handler(None, error)`` once ``future`` resolves (a Ray ref's ``future()``)."""

        def done(fut: Any) -> None:
            with self._lock:
                if self.closed:
                    return
                self._done.append((handler, fut))
                with contextlib.suppress(BlockingIOError):
                    os.write(self._write, b"!")

        future.add_done_callback(done)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the runtime's thread (from any thread)."""
        with self._lock:
            if self.closed:
                return
            self._done.append((lambda _value, _error: fn(), _DONE))
            with contextlib.suppress(BlockingIOError):
                os.write(self._write, b"!")

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, 4096):
                pass
        while True:
            with self._lock:
                if not self._done:
                    break
                handler, fut = self._done.popleft()
            try:
                value, error = fut.result(), None
            except BaseException as exc:  # (a Ray error, say): the handler decides what it means
                value, error = None, exc
            try:
                handler(value, error)
            except Exception:
                log.exception("handling an answer from another thread failed")
        self._rt.driver.notify_progress()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._done.clear()
        self._rt.driver.remove_reader(self._read)
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
