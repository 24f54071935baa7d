"""Calls in flight: the replies a caller still expects, their deadlines, and what ends them.

A call to N actors is one :class:`PendingCall` keyed by its call id in the
:class:`CallTable`. It is done at the last reply, at the first error
reply, when a target's process dies (:class:`~actors.ActorDied`), or when
its deadline passes (:class:`~actors.CallTimeout`), whether or not anyone
still waits for it: a caller that gave up first leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .._shared._errors import ActorDied, CallTimeout
from .._shared._liveness import ProcRef
from .._shared._loops import wake_all
from .._shared._names import shown
from .._wire._records import ErrorRecord, Reply

__all__ = ["CallTable", "Doomed", "PendingCall", "fail_waiting"]


class PendingCall:
    """Replies expected for one call, by rank; done at the last reply or first error."""

    __slots__ = (
        "actor",
        "arrived",
        "call_id",
        "callbacks",
        "class_ref",
        "deadline",
        "done",
        "error",
        "method",
        "procs",
        "remaining",
        "results",
        "timeout",
        "timer",
        "waiters",
    )

    def __init__(
        self,
        call_id: int,
        actor: str,
        procs: dict[int, ProcRef],
        method: str = "",
        timeout: float | None = None,
        class_ref: str = "",
    ) -> None:
        self.call_id = call_id
        self.actor = shown(actor)  # for messages
        self.method = method
        self.class_ref = class_ref  # ``module:Class`` of the actor called, for messages ("" for the runtime's own)
        self.timeout = timeout
        #: ``time.monotonic()`` after which a waiting caller gets CallTimeout (None: no deadline).
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.procs = procs
        self.remaining = set(procs)
        self.results: dict[int, Any] = {}
        self.error: BaseException | None = None
        self.done = not procs
        self.waiters: list[asyncio.Future[None]] = []
        #: Run once when the call is done (e.g. a restart's re-spawn reporting a failed constructor).
        self.callbacks: list[Callable[[PendingCall], None]] = []
        #: The loop's timer that expires the call at its deadline (:meth:`CallTable.open` sets it).
        self.timer: asyncio.TimerHandle | None = None
        #: Set once the call is done, for threads that wait on their own (one, however often they poll).
        self.arrived: threading.Event | None = None

    def deliver(self, rank: int, ok: bool, value: Any) -> None:
        if self.done or rank not in self.remaining:
            return
        if ok:
            self.results[rank] = value
            self.remaining.discard(rank)
            if not self.remaining:
                self.finish()
        else:
            record = value if isinstance(value, ErrorRecord) else ErrorRecord.from_wire(value)
            self.fail(record.to_error(self.actor, rank, self.method))

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self.finish()

    def finish(self) -> None:
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        wake_all(self.waiters)
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback(self)

    def arrival(self) -> threading.Event:
        """An event set once the call is done, for a thread that waits on its own (not the loop's).

        The loop's thread finishes the call: ``finish`` sets ``done`` before it
        takes the callbacks, so a callback added too late is covered by the
        second look at ``done``. One event serves every poll (two threads
        that race to make it each add their own callback, and both are set).
        """
        arrived = self.arrived
        if arrived is None:
            arrived = self.arrived = threading.Event()
            if not self.done:
                self.callbacks.append(lambda _call: arrived.set())
        if self.done:
            arrived.set()
        return arrived

    async def wait(self) -> dict[int, Any]:
        """The results by rank, once every reply is in; raises the call's error."""
        loop = asyncio.get_running_loop()
        timer = None
        if self.deadline is not None and not self.done:
            timer = loop.call_at(loop.time() + self.deadline - time.monotonic(), self.expire)
        try:
            while not self.done:
                waiter = loop.create_future()
                self.waiters.append(waiter)
                await waiter
        finally:
            if timer is not None:
                timer.cancel()
            if not self.done:  # this wait was cancelled: its waiter goes (a future awaited again makes another)
                self.waiters = [w for w in self.waiters if not w.done()]
        if self.error is not None:
            raise self.error
        return self.results

    def expire(self) -> None:
        """Fail with CallTimeout: the deadline passed before every reply came (a late reply is dropped).

        The actor is alive (a dead one fails the call at once), so it is busy
        or its event loop is blocked.
        """
        if self.done:
            return
        late = ", ".join(f"rank {rank} (pid {self.procs[rank].pid})" for rank in sorted(self.remaining))
        self.fail(
            CallTimeout(
                f"{self.actor}.{self.method}() got no answer from {late} within {self.timeout:g}s; "
                "the actor is alive but busy, or its event loop is blocked by synchronous code"
            )
        )


class Doomed(NamedTuple):
    """Calls waiting on a process that exited, to fail once what waits in the inbox has been read."""

    calls: list[PendingCall]
    ref: ProcRef
    reason: str


def fail_waiting(calls: list[PendingCall], ref: ProcRef, pid: int | None, reason: str) -> None:
    """Fail each of ``calls`` still waiting on a rank ``ref`` hosts (one answered meanwhile is left as it is) with
    ``ActorDied`` naming process ``pid`` and ``reason``."""
    for call in calls:
        for rank in call.remaining:
            if call.procs[rank] is ref:
                call.fail(ActorDied.of(call.actor, rank, pid, reason, call.method, call.class_ref))
                break


class CallTable:
    """Every call of this process that still expects replies, by call id."""

    def __init__(self) -> None:
        self._pending: dict[int, PendingCall] = {}
        # from a random start: a process restarted at its address (a restart policy) numbers its calls apart from
        # its predecessor's, so an answer still on its way to that one completes none of its own (0: no reply)
        self._ids = itertools.count(1 + secrets.randbits(62))

    def open(
        self,
        actor: str,
        method: str,
        targets: list[tuple[int, ProcRef]],
        timeout: float | None = None,
        class_ref: str = "",
    ) -> PendingCall:
        call = PendingCall(next(self._ids), actor, dict(targets), method, timeout, class_ref)
        if not call.done:  # (a call to no process is done at once: nothing to wait for, nothing to keep)
            self._pending[call.call_id] = call
            call.callbacks.append(self._forget)
            if timeout is not None:  # it ends at its deadline even if its caller stopped waiting first
                with contextlib.suppress(RuntimeError):  # (no loop runs: a waiting ``get`` expires it)
                    call.timer = asyncio.get_running_loop().call_later(timeout, call.expire)
        return call

    def _forget(self, call: PendingCall) -> None:
        self._pending.pop(call.call_id, None)

    def rearm(self, loop: asyncio.AbstractEventLoop) -> None:
        """The runtime moved to ``loop`` (on its thread): each call's deadline is timed there; the timer of the loop
        it left never fires (``asyncio.run`` returned), and a call given up on, never answered, stayed for good."""
        now = time.monotonic()
        for call in self._pending.values():
            if call.deadline is not None and not call.done:
                if call.timer is not None:
                    call.timer.cancel()  # (its loop drives nothing now: should it run again, the timer is off)
                call.timer = loop.call_later(max(0.0, call.deadline - now), call.expire)

    def on_reply(self, reply: Reply) -> None:
        call = self._pending.get(reply.call_id)
        if call is not None:  # else it already failed or timed out
            call.deliver(reply.rank, reply.ok, reply.value)

    def waiting_on(self, ref: ProcRef) -> list[PendingCall]:
        """Each call still waiting on a rank hosted by ``ref``."""
        return [call for call in self._pending.values() if any(call.procs[rank] is ref for rank in call.remaining)]

    def __len__(self) -> int:
        return len(self._pending)
