"""Deadlines of the requests a controller sends its hosts' agents, kept whichever loop drives the runtime.

Nobody awaits such a request (its answer is handled where it lands), so
its deadline is a timer on the runtime's loop; a timer dies with a loop the
program leaves (``asyncio.run`` returning, a background loop handing over),
so the open ones are armed again on the loop that drives the runtime next.
"""

from __future__ import annotations

import time

from .._runtime._core import Runtime
from .._runtime._pending_calls import PendingCall

__all__ = ["RequestDeadlines"]


class RequestDeadlines:
    """Fails each open request at its deadline (on the runtime's thread), across changes of event loop."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        #: Open requests, by id: the call and its deadline (``time.monotonic``).
        self._open: dict[int, tuple[PendingCall, float]] = {}
        rt.driver.moved.connect(self._rearm)

    def add(self, pending: PendingCall, timeout: float) -> None:
        """Fail ``pending`` in ``timeout`` s unless answered by then (call on the runtime's thread)."""
        if pending.done:
            return
        pending.timeout = timeout
        deadline = time.monotonic() + timeout
        self._open[id(pending)] = (pending, deadline)
        self._arm(pending, deadline)

    @property
    def open(self) -> int:
        """Requests waiting for their answer or their deadline."""
        return sum(1 for pending, _ in self._open.values() if not pending.done)

    def _arm(self, pending: PendingCall, deadline: float) -> None:
        loop = self._rt.driver.loop
        if loop is not None and loop.is_running():
            loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, pending)

    def _expire(self, pending: PendingCall) -> None:
        self._open.pop(id(pending), None)
        if not pending.done:
            pending.expire()

    def _rearm(self) -> None:
        """The runtime moved to another loop: the timers of the one it left will not fire."""
        for key, (pending, deadline) in list(self._open.items()):
            if pending.done:
                del self._open[key]
            else:
                self._arm(pending, deadline)

    def close(self) -> None:
        self._rt.driver.moved.disconnect(self._rearm)
