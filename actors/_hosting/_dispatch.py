"""Running the calls a worker receives: each on its actor, as a task (or on a synchronous actor's thread).

A call to an actor not constructed yet waits (up to :data:`SPAWN_WAIT`)
for it; every invocation of an async endpoint runs as its own task on the
process's event loop, so endpoints of one actor interleave; the ``def``
endpoints of a synchronous actor run one at a time on that actor's own
thread (as in Monarch), so they never freeze the message pump.
"""

from __future__ import annotations

import asyncio
import functools
import traceback
import weakref
from typing import Any

from .._runtime._context import actor_context
from .._runtime._core import Runtime
from .._shared._errors import DecodeError, actor_stopped
from .._shared._names import shown
from .._wire._records import SUPERVISION, ErrorRecord
from ._actor import Endpoint
from ._failure_reports import FailureReports
from ._invocation import Invocation
from ._lifecycle import Lifecycle
from ._response_port import ResponsePort
from ._slots import ActorSlot, SlotTable

__all__ = ["SPAWN_WAIT", "CallDispatcher"]

#: How long a call may wait for an actor that has not been spawned here yet.
SPAWN_WAIT = 30.0


class CallDispatcher:
    """Starts each call to a hosted actor, answers it, and fails the actor when the call kills it."""

    def __init__(self, rt: Runtime, slots: SlotTable, reports: FailureReports, lifecycle: Lifecycle) -> None:
        self._rt = rt
        self._loop = lifecycle.loop
        self._slots = slots
        self._reports = reports
        self._lifecycle = lifecycle

    def dispatch(self, inv: Invocation) -> None:
        """Run ``inv`` on its actor now, or once that actor is constructed, or refuse it."""
        actor = inv.call.actor
        slot = self._slots.get(actor)
        if slot is None and actor in self._slots.stopped:
            self._reports.refuse(inv, ErrorRecord(SUPERVISION, actor_stopped(actor)))
        elif slot is None:
            self._slots.waiting.setdefault(actor, []).append(inv)
            # (held weakly: a call the spawn took and ran is not kept, with its buffers, until the timer fires)
            self._loop.call_later(SPAWN_WAIT, self._expire, actor, weakref.ref(inv))
        elif slot.instance is None and slot.error is None:
            slot.backlog.append(inv)
        else:
            self._start(slot, inv)

    def replay(self, slot: ActorSlot) -> None:
        """Start the calls that waited for ``slot``'s construction (or refuse them, if it failed)."""
        backlog, slot.backlog = slot.backlog, []
        for waiting in backlog:
            self._start(slot, waiting)

    def _expire(self, actor: str, held: weakref.ref[Invocation]) -> None:
        """The call still waits for its actor's spawn (the very call, not an equal one): it is refused."""
        inv = held()
        waiting = self._slots.waiting.get(actor)
        if inv is None or not waiting or not any(w is inv for w in waiting):
            return
        waiting[:] = [w for w in waiting if w is not inv]
        if not waiting:
            del self._slots.waiting[actor]
        self._reports.refuse(inv, ErrorRecord("LookupError", f"no actor named {shown(actor)!r} in this process"))

    def _start(self, slot: ActorSlot, inv: Invocation) -> None:
        refuse = self._reports.refuse
        if slot.error is not None:
            refuse(inv, slot.error)
            return
        if slot.stopping:
            refuse(inv, ErrorRecord("RuntimeError", f"actor {shown(slot.name)!r} is stopping"))
            return
        ep = slot.endpoints.get(inv.call.method)
        if ep is None:
            cls = type(slot.instance).__qualname__
            refuse(inv, ErrorRecord("AttributeError", f"{cls} has no endpoint {inv.call.method!r}"))
            return
        # (decoded in the actor's context, as its constructor's arguments are: a proc mesh among them has this actor
        # as its owner, so failures of what it spawns there are offered to this actor's __supervise__)
        token = actor_context.set(slot.context_for(inv.call))
        try:
            try:
                args, kwargs = inv.arguments(self._rt)
            except DecodeError as exc:
                refuse(inv, ErrorRecord.of(exc))
                return
            task = self._loop.create_task(self._invoke(slot, ep, args, kwargs, inv))
        finally:
            actor_context.reset(token)
        slot.track(task)

    async def _invoke(
        self, slot: ActorSlot, ep: Endpoint[Any, Any], args: list[Any], kwargs: dict[str, Any], inv: Invocation
    ) -> None:
        port = ResponsePort[Any](self._rt, inv, self._reports, slot) if ep.explicit_response_port else None
        if port is not None:
            args = [port, *args]
        try:
            if ep.is_async:
                result = await ep.fn(slot.instance, *args, **kwargs)
            else:
                result = await slot.run_sync(self._loop, functools.partial(ep.fn, slot.instance, *args, **kwargs))
        except asyncio.CancelledError as exc:
            if not (slot.stopping or self._lifecycle.stopping):  # its own (it awaited a cancelled task): a failure
                self._failed(slot, inv, port, exc)
                return
            if self._lifecycle.ending and slot.error is None:
                return  # the process is ending (SIGTERM, owner gone): its callers hear ActorDied when it exits
            record = slot.error or ErrorRecord("CancelledError", f"actor {shown(slot.name)!r} stopped first")
            if port is None or port.take_over():  # (a port answered already has its answer; claimed, it is closed)
                self._reports.fail(slot, inv, record, report=False)
        except BaseException as exc:
            self._failed(slot, inv, port, exc)
        else:
            if port is not None:
                return  # it answers through its port, now or later (unanswered, the port answers when dropped)
            if inv.wants_reply:
                inv.reply(self._rt, True, result)
            else:
                inv.deliver_result(result)

    def _failed(self, slot: ActorSlot, inv: Invocation, port: ResponsePort[Any] | None, exc: BaseException) -> None:
        """The endpoint raised ``exc``: an Exception fails the call; any other BaseException fails the actor."""
        record = ErrorRecord.of(exc, traceback.format_exc())  # (called in the except clause)
        kill = self._lifecycle.kill
        if port is not None:
            # (answered already: the caller has its answer, and the failure is the actor's all the same)
            unanswered = port.take_over()
            how = "instead of answering" if unanswered else "after answering"
            why = f"{inv.call.method} raised {how} its response port: {record.type_name}: {record.message}"
            kill(slot, inv.call.method, why, record, exc, inv if unanswered else None)
        elif isinstance(exc, Exception):
            self._reports.fail(slot, inv, record)
        else:
            why = f"{inv.call.method} raised {record.type_name}: {record.message}"
            kill(slot, inv.call.method, why, record, exc, inv)
