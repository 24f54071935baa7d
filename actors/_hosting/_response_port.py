"""The reply port an ``@endpoint(explicit_response_port=True)`` method answers through.

The method gets the caller's reply as its first argument and may answer
now, later (from another task or thread), or pass the duty on within its
own process. Exactly one answer is delivered: a second is refused with
:class:`~actors.PortClosed`. A port dropped unanswered (garbage-collected)
answers the caller with an error, so no caller waits for a reply that can
never come.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._shared._errors import PortClosed
from .._wire._records import ErrorRecord

if TYPE_CHECKING:
    from .._runtime._core import Runtime
    from ._failure_reports import FailureReports
    from ._invocation import Invocation
    from ._slots import ActorSlot

__all__ = ["ResponsePort"]

T = TypeVar("T")


class _Answer:
    """Whether the reply went out; shared by the port and its finalizer."""

    __slots__ = ("lock", "sent")

    def __init__(self) -> None:
        self.sent = False
        self.lock = threading.Lock()

    def claim(self) -> bool:
        with self.lock:
            first, self.sent = not self.sent, True
            return first


def _deliver(rt: Runtime, inv: Invocation, ok: bool, value: Any) -> None:
    """The answer to its caller; a fire-and-forget call's to the port it was sent with (as a plain endpoint's
    result, or error, goes there)."""
    if inv.call.call_id or inv.call.port is None:
        rt.driver.on_thread(lambda: inv.reply(rt, ok, value))
    elif ok:
        rt.driver.on_thread(lambda: inv.deliver_result(value))
    else:
        rt.driver.on_thread(lambda: inv.answer_error(rt, value, inv.call.rank))


def _dropped(rt: Runtime, inv: Invocation, answer: _Answer) -> None:
    """The port was garbage-collected (on any thread): answer with an error unless it answered."""
    loop = rt.driver.loop
    if answer.claim() and not rt.closed and loop is not None and not loop.is_closed():
        record = ErrorRecord(
            "PortClosed", f"{inv.call.actor}.{inv.call.method} dropped its response port without answering"
        )
        loop.call_soon_threadsafe(inv.answer_error, rt, record, inv.call.rank)


class ResponsePort(Generic[T]):
    """Answers one caller: ``send(value)`` or ``exception(exc)``, once."""

    __slots__ = ("__weakref__", "_answer", "_inv", "_reports", "_rt", "_slot")

    def __init__(self, rt: Runtime, inv: Invocation, reports: FailureReports, slot: ActorSlot) -> None:
        self._rt = rt
        self._inv = inv
        #: Where an error nobody waits for goes (a fire-and-forget call's): the actor's supervisor. (Its slot weakly:
        #: a port the actor keeps must not keep the stopped actor's instance alive through it.)
        self._reports = reports
        self._slot = weakref.ref(slot)
        self._answer = _Answer()
        weakref.finalize(self, _dropped, rt, inv, self._answer)

    @property
    def answered(self) -> bool:
        return self._answer.sent

    def send(self, value: T) -> None:
        """Reply ``value`` to the caller."""
        self._claim()
        _deliver(self._rt, self._inv, True, value)

    def exception(self, exc: BaseException) -> None:
        """Reply with an error: the caller's future raises :class:`~actors.ActorError` for ``exc``. A
        fire-and-forget call sent with no port has nobody waiting: the error is a failure of the call, logged and
        reported to the actor's supervisor, as an endpoint's raised in such a call is (it was dropped silently)."""
        self._claim()
        record = ErrorRecord.of(exc)
        call = self._inv.call
        if call.call_id or call.port is not None:
            _deliver(self._rt, self._inv, False, record)
        else:
            reports, slot, inv = self._reports, self._slot, self._inv
            self._rt.driver.on_thread(lambda: reports.fail(slot(), inv, record))

    def take_over(self) -> bool:
        """Claim the answer for the runtime (the endpoint raised); False if the endpoint already answered."""
        return self._answer.claim()

    def _claim(self) -> None:
        if not self._answer.claim():
            call = self._inv.call
            raise PortClosed(f"the response port of {call.actor}.{call.method} has already answered")

    def __repr__(self) -> str:
        call = self._inv.call
        return f"<ResponsePort {call.actor}.{call.method} {'answered' if self.answered else 'open'}>"
